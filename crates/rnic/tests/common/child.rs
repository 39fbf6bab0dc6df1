//! The passive peer of a cross-process test: the test binary re-executed as one
//! named child test, driven by one-line commands over its stdin and answering on
//! its stdout (libtest's own output lines are skipped).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

pub struct Child {
    pub child: std::process::Child,
    pub inp: std::process::ChildStdin,
    out: BufReader<std::process::ChildStdout>,
    /// Prefixes of the child's reply lines; any other line is libtest chatter.
    replies: &'static [&'static str],
}

impl Child {
    /// Re-executes this test binary running only `test`, with `env=val` set.
    pub fn spawn(test: &str, env: &str, val: &str, replies: &'static [&'static str]) -> Child {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1", "-q"])
            .env(env, val)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let inp = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Child {
            child,
            inp,
            out,
            replies,
        }
    }

    /// The next reply line, trimmed.
    pub fn line(&mut self) -> String {
        loop {
            let mut s = String::new();
            assert!(self.out.read_line(&mut s).unwrap() > 0, "child exited");
            let s = s.trim().to_string();
            if self.replies.iter().any(|p| s.starts_with(p)) {
                return s;
            }
        }
    }

    /// Sends one command line and returns the reply.
    pub fn cmd(&mut self, c: &str) -> String {
        writeln!(self.inp, "{c}").unwrap();
        self.inp.flush().unwrap();
        self.line()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = writeln!(self.inp, "EXIT");
        let _ = self.inp.flush();
        let _ = self.child.wait();
    }
}

/// The child's side: prints `INFO <info>`, then answers each command line from
/// stdin with `reply(words)` until it returns `None` (or stdin ends).
pub fn serve(info: &str, mut reply: impl FnMut(&[&str]) -> Option<String>) {
    let mut out = std::io::stdout();
    writeln!(out, "INFO {info}").unwrap();
    out.flush().unwrap();
    for l in std::io::stdin().lock().lines() {
        let l = l.unwrap();
        let w: Vec<&str> = l.split_whitespace().collect();
        let Some(r) = reply(&w) else { break };
        writeln!(out, "{r}").unwrap();
        out.flush().unwrap();
    }
}
