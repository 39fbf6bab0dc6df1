//! Harness for running unmodified libibverbs programs under `LD_PRELOAD=libnprdma.so`:
//! locate the cdylib cargo built, skip when a program is not installed (a failure under
//! `NPRDMA_REQUIRE_ALL=1`, as in CI: [`nprdma_test_support::skip`]), run server + client
//! as two processes with bounded time.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use nprdma_test_support::skip::skip;

/// Per-process time limit.
pub const LIMIT: Duration = Duration::from_secs(60);

/// The libnprdma.so next to this test binary (target/<profile>/), built by
/// [`nprdma_test_support::cdylib::libnprdma`] when cargo runs the test.
pub fn lib_path() -> PathBuf {
    nprdma_test_support::cdylib::libnprdma().unwrap_or_else(|why| panic!("libnprdma.so: {why}"))
}

/// Full path of `bin` in PATH, or None.
pub fn find_bin(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// Returns the binaries' paths, or skips ([`skip`]: fails under
/// `NPRDMA_REQUIRE_ALL=1`) and returns None.
pub fn require(bins: &[&str]) -> Option<Vec<PathBuf>> {
    let mut v = Vec::new();
    for b in bins {
        match find_bin(b) {
            Some(p) => v.push(p),
            None => {
                skip(format!(
                    "`{b}` is not installed (apt-get install -y perftest ibverbs-utils)"
                ));
                return None;
            }
        }
    }
    Some(v)
}

pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }
    pub fn all(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

pub fn spawn(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    spawn_with(&lib_path(), bin, args, env)
}

/// [`spawn`] preloading `lib`.
pub fn spawn_with(lib: &Path, bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(bin);
    c.args(args)
        .env("LD_PRELOAD", lib)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
}

/// Wait for `child` at most until `deadline`; kill it if it runs over.
pub fn finish(mut child: Child, deadline: Instant) -> Output {
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let code = loop {
        match child.try_wait().expect("try_wait") {
            Some(st) => break st.code(),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    Output {
        code,
        stdout: to.join().unwrap_or_default(),
        stderr: te.join().unwrap_or_default(),
    }
}

pub fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    finish(spawn(bin, args, env), Instant::now() + LIMIT)
}

/// [`run`] with the release build of the library and its own time limit.
pub fn run_release_within(
    bin: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Output {
    let lib = nprdma_test_support::cdylib::libnprdma_release()
        .unwrap_or_else(|why| panic!("libnprdma.so (release): {why}"));
    finish(spawn_with(&lib, bin, args, env), Instant::now() + limit)
}

/// A perftest `-R` pair (`run(port)` gives the server's and the client's outputs),
/// tried up to six times, each on the next port: perftest's server re-listens between
/// connections and may reject a client that comes too early (its own race:
/// RDMA_CM_EVENT_REJECTED, error 8); any other failure ends the tries. Ok once both
/// succeeded and the client reported `iters` iterations.
pub fn perftest_cm_tries(
    port: &mut u16,
    iters: f64,
    mut run: impl FnMut(u16) -> (Output, Output),
) -> Result<(), String> {
    let mut result = Err(String::new());
    for _ in 0..6 {
        *port += 1;
        let (s, c) = run(*port);
        if s.ok() && c.ok() && result_rows(&c.stdout).iter().any(|r| r[1] == iters) {
            return Ok(());
        }
        result = Err(format!("{}\n{}", c.all(), s.all()));
        if !c.stderr.contains("RDMA_CM_EVENT_REJECTED; error: 8.") {
            break;
        }
    }
    result
}

/// Whether something in network namespace `ns` listens on TCP `port`.
pub fn listening_in(ns: &str, port: u16) -> bool {
    let want = format!(":{port:04X}");
    let Ok(o) = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "cat",
            "/proc/net/tcp",
            "/proc/net/tcp6",
        ])
        .output()
    else {
        return false;
    };
    String::from_utf8_lossy(&o.stdout).lines().any(|l| {
        let c: Vec<&str> = l.split_whitespace().collect();
        c.len() > 3 && c[1].ends_with(&want) && c[3] == "0A"
    })
}

/// Whether something listens on TCP `port` (IPv4 or IPv6).
pub fn listening(port: u16) -> bool {
    let want = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|s| {
            s.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&want) && cols[3] == "0A"
            })
        })
    })
}

/// [`spawn`] a server, then wait (at most [`LIMIT`]) until it listens on TCP `port`.
pub fn spawn_listening(bin: &Path, port: u16, args: &[&str], env: &[(&str, &str)]) -> Child {
    let deadline = Instant::now() + LIMIT;
    let server = spawn(bin, args, env);
    while !listening(port) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// Run `bin server_args` and, once it listens on `port`, `bin client_args`; both bounded.
pub fn run_pair(
    bin: &Path,
    port: u16,
    server_args: &[&str],
    client_args: &[&str],
    env: &[(&str, &str)],
) -> (Output, Output) {
    let deadline = Instant::now() + LIMIT;
    let server = spawn_listening(bin, port, server_args, env);
    let client = spawn(bin, client_args, env);
    let c = finish(client, deadline);
    // The server normally finishes with the client; give it a few seconds more.
    let s = finish(server, Instant::now() + Duration::from_secs(10).min(LIMIT));
    (s, c)
}

/// The perftest result rows (lines starting with a number) of an output.
pub fn result_rows(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .map(str::trim)
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|t| t.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|r| r.len() >= 3)
        .collect()
}

/// The counters of a `NPRDMA_STATS=1` line (`nprdma-stats: key=value ...`) in `stderr`.
pub fn np_stats(stderr: &str) -> Option<std::collections::HashMap<String, String>> {
    let line = stderr
        .lines()
        .find_map(|l| l.split("nprdma-stats: ").nth(1))?;
    Some(
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// Counter `key` of a stats line as a number (panics with the output when missing).
pub fn stat(o: &Output, key: &str) -> u64 {
    np_stats(&o.stderr)
        .and_then(|m| m.get(key).and_then(|v| v.parse().ok()))
        .unwrap_or_else(|| panic!("no nprdma-stats {key}:\n{}", o.all()))
}

/// Environment of NP-RDMA mode with counters printed at ibv_close_device.
pub const NP: &[(&str, &str)] = &[("NPRDMA_MODE", "nprdma"), ("NPRDMA_STATS", "1")];

/// A copy of libnprdma.so at another path (`dlopen` of it gives a second instance):
/// the device of the chain tests, where NP-RDMA runs in user-space mode over the next
/// libibverbs (`NPRDMA_DEVICE=verbs`) and that library is the software NIC behind the
/// C ABI in pinned mode. Copied once per test binary.
pub fn device_lib() -> PathBuf {
    static COPY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    COPY.get_or_init(|| {
        let lib = lib_path();
        let dir = lib.parent().expect("target dir").join("nprdma-chain");
        std::fs::create_dir_all(&dir).expect("chain dir");
        let exe = std::env::current_exe().expect("test exe");
        let stem = exe.file_name().and_then(|n| n.to_str()).unwrap_or("test");
        let copy = dir.join(format!("libnprdma-device-{stem}.so"));
        let tmp = dir.join(format!("libnprdma-device-{stem}.so.{}", std::process::id()));
        std::fs::copy(&lib, &tmp).expect("copy libnprdma.so");
        std::fs::rename(&tmp, &copy).expect("rename the copy");
        copy
    })
    .clone()
}

/// Environment of the chain (NP-RDMA user-space mode → libibverbs C ABI → software
/// NIC), with counters printed at exit; `extra` appended.
pub fn chain_env(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = [
        ("NPRDMA_MODE", "nprdma"),
        ("NPRDMA_DEVICE", "verbs"),
        ("NPRDMA_STATS", "1"),
    ]
    .iter()
    .chain(extra)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    v.push((
        "NPRDMA_VERBS_LIB".into(),
        device_lib().to_string_lossy().into_owned(),
    ));
    v
}

/// `env` as the pairs [`run_pair`] takes.
pub fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Both sides of a chain run: NP-RDMA in user-space mode over the next libibverbs
/// (no optimistic operation, registrations at the device, none failed).
pub fn assert_chain_stats(o: &Output) {
    assert_eq!(
        np_stats(&o.stderr).and_then(|m| m.get("mode").cloned()),
        Some("nprdma-verbs".to_string()),
        "{}",
        o.all()
    );
    assert_eq!(stat(o, "optimistic_ok"), 0, "{}", o.all());
    assert_eq!(stat(o, "verbs_reg_failures"), 0, "{}", o.all());
}

pub const HEADER: &str = "/usr/include/infiniband/verbs.h";

/// Where the programs are built: `target/<profile>/c-programs/` beside this test
/// binary (the temp dir if that cannot be found).
pub fn out_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent()?.parent().map(Path::to_path_buf))
            .unwrap_or_else(std::env::temp_dir);
        let d = profile.join("c-programs");
        std::fs::create_dir_all(&d).expect("create the programs' build dir");
        d
    })
}

/// Compile `tests/c/<name>.c` (the C programs of `c_programs.rs` and
/// `pressure.rs`); None (skipped) without the headers.
pub fn compile(name: &str) -> Option<PathBuf> {
    if !Path::new(HEADER).exists() {
        skip(format!(
            "{name}: {HEADER} missing (apt-get install -y libibverbs-dev)"
        ));
        return None;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = out_dir().join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-O1", "-g", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-libverbs", "-lpthread"])
        // The rdma_cm programs (`cm_*.c`) link librdmacm as applications do.
        .args(if name.starts_with("cm_") {
            &["-lrdmacm"][..]
        } else {
            &[][..]
        })
        .output()
        .unwrap_or_else(|e| panic!("run {cc}: {e}"));
    assert!(
        out.status.success(),
        "{cc} {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}
