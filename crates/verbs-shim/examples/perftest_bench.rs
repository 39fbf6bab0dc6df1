//! Benchmark: Debian's unmodified perftest (ib_read_lat, ib_write_lat, ib_read_bw,
//! ib_write_bw) through `LD_PRELOAD=libnprdma.so`, server + client as two processes on
//! localhost, in pinned mode, under the shim's default NIC settings and under rnic's
//! own defaults (`NPRDMA_RING_MAX=4096 NPRDMA_NIC_SPIN_US=100`). Prints a markdown table.
//!
//! Run: `cargo run --release -p verbs-shim --example perftest_bench` (builds
//! libnprdma.so first). Env: `PERFTEST_BENCH_ITERS` (latency iterations, default 10000).
//! Baseline (same run): `RNIC_BENCH_ONLY=shm cargo run --release -p rnic --example
//! rnic_bench` — the same operations through rnic's Rust API, two processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn lib() -> PathBuf {
    let exe = std::env::current_exe().expect("exe");
    // target/<profile>/examples/<bin> -> target/<profile>/libnprdma.so
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    if let Some(cargo) = std::env::var_os("CARGO") {
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("release");
        let profile = if name == "debug" { "dev" } else { name };
        let st = Command::new(cargo)
            .args(["build", "--lib", "--profile", profile, "--manifest-path"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", dir.parent().expect("target"))
            .status()
            .expect("cargo build");
        assert!(st.success());
    }
    let p = dir.join("libnprdma.so");
    assert!(p.exists(), "{} missing", p.display());
    p
}

fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|s| {
            s.lines().skip(1).any(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                c.len() > 3 && c[1].ends_with(&want) && c[3] == "0A"
            })
        })
    })
}

/// Run one perftest pair; the client's result row for `size` (numbers only).
fn pair(
    lib: &Path,
    tool: &str,
    port: u16,
    args: &[&str],
    env: &[(&str, &str)],
    size: &str,
) -> Option<Vec<f64>> {
    let p = port.to_string();
    let mk = |client: bool| {
        let mut c = Command::new(tool);
        c.args(args)
            .args(["-p", &p])
            .env("LD_PRELOAD", lib)
            .env("NPRDMA_MODE", "pinned");
        if client {
            c.arg("localhost");
        }
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut srv = mk(false).spawn().ok()?;
    let t = Instant::now();
    while !listening(port) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = mk(true).output().ok()?;
    let _ = srv.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        eprintln!(
            "{tool} {args:?} failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    text.lines()
        .map(str::trim)
        .find(|l| l.split_whitespace().next() == Some(size))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect()
        })
}

fn main() {
    let lib = lib();
    let iters = std::env::var("PERFTEST_BENCH_ITERS").unwrap_or_else(|_| "10000".into());
    let configs: [(&str, &[(&str, &str)]); 2] = [
        ("shim defaults (ring 8 B, NIC spin 0)", &[]),
        (
            "rnic defaults (ring 4 KiB, NIC spin 100 us)",
            &[("NPRDMA_RING_MAX", "4096"), ("NPRDMA_NIC_SPIN_US", "100")],
        ),
    ];
    println!("| NIC settings | test | size | iterations | result |");
    println!("|---|---|---|---|---|");
    let mut port = 18900;
    for (name, env) in configs {
        for tool in ["ib_read_lat", "ib_write_lat"] {
            for size in ["2", "64", "4096"] {
                port += 1;
                let r = pair(&lib, tool, port, &["-s", size, "-n", &iters], env, size);
                let cell = match r {
                    // #bytes #iter t_min t_max t_typical t_avg t_stdev p99 p99.9
                    Some(v) if v.len() >= 8 => format!(
                        "typical {:.2} us, avg {:.2} us, p99 {:.2} us",
                        v[4], v[5], v[7]
                    ),
                    _ => "FAILED".into(),
                };
                println!("| {name} | {tool} | {size} B | {iters} | {cell} |");
            }
        }
        for tool in ["ib_read_bw", "ib_write_bw"] {
            for (size, n) in [("65536", "5000"), ("1048576", "500")] {
                port += 1;
                let r = pair(&lib, tool, port, &["-s", size, "-n", n], env, size);
                let cell = match r {
                    // #bytes #iter BW_peak[MB/s] BW_avg[MB/s] MsgRate[Mpps]
                    Some(v) if v.len() >= 5 => {
                        format!("avg {:.2} GB/s, {:.0} kmsg/s", v[3] / 1e3, v[4] * 1e3)
                    }
                    _ => "FAILED".into(),
                };
                println!("| {name} | {tool} | {size} B | {n} | {cell} |");
            }
        }
    }
}
