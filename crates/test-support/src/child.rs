//! A peer in a child process: this test binary re-executed to run one test
//! (the child's `main`), talking over stdin / stdout lines. The child prints
//! its lines with [`say`] ("NPX …", so the test harness's own output is
//! skipped); a watchdog kills a child that outlives its time limit, which
//! fails the test instead of hanging it.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nprdma::Endpoint;

/// A running child: its stdin, its protocol lines, and its watchdog.
pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
    done: Arc<AtomicBool>,
}

impl ChildProc {
    /// Run test `test` of this binary with `env_var=1` in its environment,
    /// killed after `limit`.
    pub fn spawn(test: &str, env_var: &str, limit: Duration) -> ChildProc {
        Self::spawn_with(test, env_var, &[], limit)
    }

    /// [`ChildProc::spawn`] with the variables `env` set as well.
    pub fn spawn_with(
        test: &str,
        env_var: &str,
        env: &[(&str, &OsStr)],
        limit: Duration,
    ) -> ChildProc {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env_var, "1")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let done = Arc::new(AtomicBool::new(false));
        {
            let done = done.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                while t.elapsed() < limit {
                    std::thread::sleep(Duration::from_millis(100));
                    if done.load(Ordering::Relaxed) {
                        return;
                    }
                }
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            });
        }
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        ChildProc {
            child,
            stdin,
            out,
            done,
        }
    }

    /// The child's next `NPX` line (without the prefix).
    pub fn read_line(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "child exited");
            if let Some(i) = line.find("NPX ") {
                return line[i + 4..].trim().to_string();
            }
        }
    }

    /// Send one line to the child.
    pub fn send(&mut self, line: &str) {
        let w = self.stdin.as_mut().expect("child stdin open");
        writeln!(w, "{line}").unwrap();
        w.flush().unwrap();
    }

    /// [`ChildProc::send`] `line`, then the child's answer.
    pub fn ask(&mut self, line: &str) -> String {
        self.send(line);
        self.read_line()
    }

    /// The child's PID (to signal it from another thread).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL the child and reap it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.done.store(true, Ordering::Relaxed);
    }

    /// Close the child's stdin, wait for it and say whether it succeeded.
    pub fn finish(mut self) -> bool {
        drop(self.stdin.take());
        let ok = self.child.wait().map(|s| s.success()).unwrap_or(false);
        self.done.store(true, Ordering::Relaxed);
        ok
    }
}

/// Print one protocol line from the child.
pub fn say(out: &mut impl Write, s: &str) {
    writeln!(out, "NPX {s}").unwrap();
    out.flush().unwrap();
}

/// `b` in lower-case hexadecimal.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An endpoint from its [`hex`] form.
pub fn ep_from(s: &str) -> Endpoint {
    let b: Vec<u8> = (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    Endpoint::from_bytes(b[..20].try_into().unwrap())
}

/// An endpoint as one word of the protocol: address, QPN and control QPN (a
/// device's control QP number cannot be derived from the data QP's).
pub fn ep_word(ep: &Endpoint) -> String {
    format!("{}:{}:{}", hex(&ep.addr), ep.qpn, ep.ctrl_qpn)
}

/// The endpoint of an [`ep_word`].
pub fn ep_of(w: &str) -> Endpoint {
    let mut it = w.split(':');
    let a = it.next().expect("address");
    let mut addr = [0u8; 16];
    for (i, b) in addr.iter_mut().enumerate() {
        *b = u8::from_str_radix(&a[2 * i..2 * i + 2], 16).unwrap();
    }
    Endpoint {
        addr,
        qpn: it.next().expect("qpn").parse().unwrap(),
        ctrl_qpn: it.next().expect("control qpn").parse().unwrap(),
    }
}
