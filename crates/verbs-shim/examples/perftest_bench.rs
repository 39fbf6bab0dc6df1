//! Benchmark: Debian's unmodified perftest (ib_read_lat, ib_write_lat, ib_read_bw,
//! ib_write_bw) through `LD_PRELOAD=libnprdma.so`, server + client as two processes on
//! localhost, pinned mode vs NP-RDMA mode (and NP-RDMA with a pager budget below the
//! buffers, so pages are swapped during the run), each with target-enforced protection
//! (the default) and pinned / NP-RDMA also between trusting processes
//! (`NPRDMA_TRUSTED_PEERS=1`, the labelled opt-in), all in one run. Prints a markdown
//! table (one column per configuration). A last column runs NP-RDMA in user-space mode
//! over the next libibverbs (`NPRDMA_DEVICE=verbs`; a copy of libnprdma.so in pinned mode
//! plays the device: "the chain").
//!
//! Run: `cargo run --release -p verbs-shim --example perftest_bench` (builds
//! libnprdma.so first). Env: `PERFTEST_BENCH_ITERS` (latency iterations, default 10000),
//! `PERFTEST_BENCH_RUNS` (runs per cell, configurations alternating; each cell shows the
//! median and the range, default 3),
//! `PERFTEST_BENCH_BUDGET_PAGES` (the pager budget of the swapped column, default 4
//! pages = 16 KiB per process, below every buffer here), `PERFTEST_BENCH_RNIC_DEFAULTS=1` (add trusting pinned mode under rnic's own NIC
//! defaults, `NPRDMA_RING_MAX=4096 NPRDMA_NIC_SPIN_US=100`). Every process is limited to 180 s.
//! Baseline for the NIC itself: `RNIC_BENCH_ONLY=shm cargo run --release -p rnic
//! --example rnic_bench` — the same operations through rnic's Rust API.

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

/// `swap_outs` / `swap_ins` of a `NPRDMA_STATS=1` line (NP-RDMA mode only).
fn swaps(stderr: &str) -> Option<(u64, u64)> {
    let line = stderr
        .lines()
        .find_map(|l| l.split("nprdma-stats: ").nth(1))?;
    let get = |k: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
    };
    Some((get("swap_outs")?, get("swap_ins")?))
}

/// Pages swapped (out, in) by (server, client).
type Swaps = ((u64, u64), (u64, u64));

/// Run one perftest pair; the client's result row for `size` (numbers only) and the
/// pages swapped out/in by (server, client) when in NP-RDMA mode.
fn pair(
    lib: &Path,
    tool: &str,
    port: u16,
    args: &[&str],
    env: &[(&str, &str)],
    size: &str,
) -> Option<(Vec<f64>, Option<Swaps>)> {
    let p = port.to_string();
    let mk = |client: bool| {
        let mut c = Command::new("timeout");
        c.args(["180", tool])
            .args(args)
            .args(["-p", &p])
            .env("LD_PRELOAD", lib)
            .env("NPRDMA_MODE", "pinned")
            .env("NPRDMA_STATS", "1");
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
    let mut serr = String::new();
    if let Some(mut e) = srv.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut serr);
    }
    let _ = srv.wait();
    let sw = swaps(&serr).zip(swaps(&String::from_utf8_lossy(&out.stderr)));
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
            let row = l
                .split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect();
            (row, sw)
        })
}

type Config = (&'static str, &'static [(&'static str, &'static str)]);

/// One run of a cell: the client's result row and the pages swapped.
type Measured = Option<(Vec<f64>, Option<Swaps>)>;

/// Minimum, median and maximum of `v` (not empty).
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// A table cell from the runs of one configuration: latency tests report perftest's
/// `t_typical` (its median) and p99, bandwidth tests BW_average, each as the median
/// over the runs with their range; failed runs are counted.
fn cell_text(runs: &[Measured], lat: bool, budget: bool) -> String {
    // #bytes #iter t_min t_max t_typical t_avg t_stdev p99 p99.9
    // #bytes #iter BW_peak[MB/s] BW_avg[MB/s] MsgRate[Mpps]
    let ok: Vec<&Vec<f64>> = runs
        .iter()
        .flatten()
        .map(|(v, _)| v)
        .filter(|v| v.len() >= if lat { 8 } else { 5 })
        .collect();
    let failed = runs.len() - ok.len();
    if ok.is_empty() {
        return "FAILED".into();
    }
    let col = |i: usize, scale: f64| ok.iter().map(|v| v[i] * scale).collect::<Vec<f64>>();
    let mut text = if lat {
        let (lo, med, hi) = spread(&mut col(4, 1.0));
        let (_, p99, _) = spread(&mut col(7, 1.0));
        format!("typical {med:.2} µs ({lo:.2}–{hi:.2}), p99 {p99:.2}")
    } else {
        let (lo, med, hi) = spread(&mut col(3, 1e-3));
        format!("{med:.2} GB/s ({lo:.2}–{hi:.2})")
    };
    if failed > 0 {
        text.push_str(&format!("; {failed} of {} runs FAILED", runs.len()));
    }
    if budget {
        if let Some(((so, si), (co, ci))) = runs.iter().flatten().find_map(|(_, s)| *s) {
            text.push_str(&format!(
                "; swapped out/in (one run): server {so}/{si}, client {co}/{ci} pages"
            ));
        }
    }
    text
}

fn main() {
    let lib = lib();
    let iters = std::env::var("PERFTEST_BENCH_ITERS").unwrap_or_else(|_| "10000".into());
    // Default: target-enforced protection (each target's NIC thread serves every
    // request); "trusted": the labelled opt-in where initiators copy into trusting
    // targets themselves (NPRDMA_TRUSTED_PEERS=1 on both sides).
    let mut configs: Vec<Config> = vec![
        ("pinned", &[("NPRDMA_MODE", "pinned")]),
        (
            "pinned, trusted peers",
            &[("NPRDMA_MODE", "pinned"), ("NPRDMA_TRUSTED_PEERS", "1")],
        ),
        ("NP-RDMA", &[("NPRDMA_MODE", "nprdma")]),
        (
            "NP-RDMA, trusted peers",
            &[("NPRDMA_MODE", "nprdma"), ("NPRDMA_TRUSTED_PEERS", "1")],
        ),
    ];
    let budget: &'static str = std::env::var("PERFTEST_BENCH_BUDGET_PAGES")
        .unwrap_or_else(|_| "4".into())
        .leak();
    let name: &'static str = format!("NP-RDMA, budget {budget} pages").leak();
    let env: &'static [(&str, &str)] =
        vec![("NPRDMA_MODE", "nprdma"), ("NPRDMA_BUDGET_PAGES", budget)].leak();
    configs.push((name, env));
    // NP-RDMA in user-space mode over the next libibverbs (issue 14): a second copy of
    // libnprdma.so, in pinned mode, plays the device ("the chain").
    let device =
        std::env::temp_dir().join(format!("nprdma-bench-device-{}.so", std::process::id()));
    if std::fs::copy(&lib, &device).is_ok() {
        let device: &'static str = device.to_string_lossy().into_owned().leak();
        DEVICE_COPY.set(device).ok();
        configs.push((
            "NP-RDMA user-space mode (chain)",
            vec![
                ("NPRDMA_MODE", "nprdma"),
                ("NPRDMA_DEVICE", "verbs"),
                ("NPRDMA_VERBS_LIB", device),
            ]
            .leak(),
        ));
    }
    if std::env::var("PERFTEST_BENCH_RNIC_DEFAULTS").is_ok_and(|v| v == "1") {
        configs.push((
            "pinned, trusted peers, rnic defaults",
            &[
                ("NPRDMA_TRUSTED_PEERS", "1"),
                ("NPRDMA_RING_MAX", "4096"),
                ("NPRDMA_NIC_SPIN_US", "100"),
            ],
        ));
    }
    // Every cell is measured `runs` times, the configurations alternating within each
    // round: on this 2-core machine a latency run lands in one of two scheduler states
    // (see BENCHMARKS.md, session 13), so a single run per cell compares states, not
    // configurations.
    let runs: usize = std::env::var("PERFTEST_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut port = 18900;
    let mut row = |tool: &str, size: &str, n: &str, lat: bool| -> Vec<String> {
        let mut results: Vec<Vec<Measured>> = vec![Vec::new(); configs.len()];
        for _ in 0..runs {
            for (i, (_, env)) in configs.iter().enumerate() {
                port += 1;
                results[i].push(pair(&lib, tool, port, &["-s", size, "-n", n], env, size));
            }
        }
        results
            .iter()
            .zip(&configs)
            .map(|(rs, (_, env))| {
                let budget = env.iter().any(|(k, _)| k.starts_with("NPRDMA_BUDGET"));
                cell_text(rs, lat, budget)
            })
            .collect()
    };
    for tool in ["ib_read_lat", "ib_write_lat"] {
        for size in ["2", "64", "4096"] {
            let cells = row(tool, size, &iters, true);
            rows.push((format!("{tool} | {size} B, -n {iters}"), cells));
        }
    }
    for tool in ["ib_read_bw", "ib_write_bw"] {
        for (size, n) in [("65536", "5000"), ("1048576", "500")] {
            let cells = row(tool, size, n, false);
            rows.push((format!("{tool} | {size} B, -n {n}"), cells));
        }
    }
    println!("Each cell: median over {runs} runs (min–max), configurations alternating.");
    let names: Vec<&str> = configs.iter().map(|c| c.0).collect();
    println!("| test | size | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(names.len()));
    for (k, cells) in rows {
        println!("| {k} | {} |", cells.join(" | "));
    }
    if let Some(d) = DEVICE_COPY.get() {
        let _ = std::fs::remove_file(d);
    }
}

/// The temporary copy of libnprdma.so that plays the device of the chain column.
static DEVICE_COPY: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
