//! End-to-end tests of the `nprdma` binary: the CI smoke form of `eval` (every
//! figure produced and finite), perf's table and JSON output, the two-process shm
//! run, and argument errors (clear message, non-zero exit, no panic).

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Run the binary with a time limit (the test fails instead of hanging).
fn run(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nprdma"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nprdma");
    let t0 = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "nprdma {args:?} exceeded {limit:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ok(args: &[&str]) -> String {
    let out = run(args, Duration::from_secs(240));
    assert!(
        out.status.success(),
        "nprdma {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn fails(args: &[&str], needle: &str) {
    let out = run(args, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "nprdma {args:?} should fail");
    assert!(!err.contains("panicked"), "nprdma {args:?} panicked: {err}");
    assert!(
        err.contains(needle),
        "nprdma {args:?}: expected {needle:?} in {err}"
    );
}

fn finite(v: &serde_json::Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"));
    assert!(x.is_finite() && x >= 0.0, "{key} = {x} in {v}");
    x
}

const LAT: [&str; 6] = [
    "t_min_us",
    "t_typical_us",
    "t_avg_us",
    "p99_us",
    "p99_9_us",
    "t_max_us",
];
const BW: [&str; 2] = ["bw_avg_gbps", "mops"];

fn check_row(v: &serde_json::Value) {
    let keys: &[&str] = if v["test"] == "lat" { &LAT } else { &BW };
    for k in keys {
        finite(v, k);
    }
    if v["test"] == "lat" {
        assert!(finite(v, "t_min_us") <= finite(v, "t_max_us"));
    }
    assert_eq!(
        v["nonresident_dma"], 0,
        "NIC touched a non-resident page: {v}"
    );
}

#[test]
fn eval_smoke_produces_every_figure() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("eval-smoke");
    let _ = std::fs::remove_dir_all(&dir);
    ok(&["eval", "--quick", "--smoke", "--out", dir.to_str().unwrap()]);
    let res: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let perf = res["perf"].as_array().unwrap();
    let sizes = [2u64, 4096, 65536];
    // Every (op, mode, fault, test, size) the report plots has a finite row.
    let mut modes = vec![("pinned", vec!["none"])];
    modes.push(("nprdma", vec!["none", "minor", "major"]));
    if !res["missing"]
        .as_object()
        .unwrap()
        .contains_key("ODP (model)")
    {
        modes.push(("odp", vec!["none", "minor", "major"]));
    }
    for (mode, faults) in &modes {
        for fault in faults {
            for op in ["read", "write"] {
                for test in ["lat", "bw"] {
                    for size in sizes {
                        let r = perf
                            .iter()
                            .find(|r| {
                                r["mode"] == *mode
                                    && r["fault"] == *fault
                                    && r["op"] == op
                                    && r["test"] == test
                                    && r["bytes"] == size
                            })
                            .unwrap_or_else(|| panic!("no row {mode} {fault} {op} {test} {size}"));
                        check_row(r);
                        if *mode == "nprdma" && *fault != "none" {
                            assert!(
                                r["fault_pages_prepared"].as_u64().unwrap() > 0,
                                "scenario not produced: {r}"
                            );
                        }
                    }
                }
            }
        }
    }
    for key in ["signature", "versioning"] {
        let v = res[key].as_array().unwrap();
        assert_eq!(v.len(), 2 * sizes.len(), "{key} rows");
        v.iter().for_each(check_row);
    }
    for m in ["pinned", "nprdma"] {
        let c = &res["control"][m];
        for k in [
            "library_init_us",
            "mr_base_us",
            "mr_per_gib_ms",
            "create_qp_us",
            "create_cq_us",
            "qp_init_us",
            "swap_out_us",
            "swap_out_unregistered_us",
            "state_per_page_b",
            "state_per_qp_b",
            "state_per_cq_b",
        ] {
            finite(c, k);
        }
        assert!(c["first_op_extra_us"].as_f64().unwrap().is_finite());
    }
    let reg = res["reg"].as_array().unwrap();
    assert_eq!(reg.len(), 2);
    for r in reg {
        finite(r, "total_ms");
        finite(r, "ms_per_gib");
    }
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    let mut plots = 0;
    for op in ["read", "write"] {
        for test in ["lat", "bw"] {
            for fault in ["none", "minor", "major"] {
                let f = format!("{op}_{test}_{fault}.svg");
                let svg = std::fs::read_to_string(dir.join(&f)).unwrap();
                assert!(
                    svg.starts_with("<svg") && svg.contains("<polyline"),
                    "{f} has no curve"
                );
                assert!(!svg.contains("NaN") && !svg.contains("inf"), "{f}");
                assert!(report.contains(&f), "report does not show {f}");
                plots += 1;
            }
        }
        let f = format!("{op}_signature_vs_versioning.svg");
        assert_eq!(
            std::fs::read_to_string(dir.join(&f))
                .unwrap()
                .matches("<polyline")
                .count(),
            2
        );
        assert!(report.contains(&f));
        plots += 1;
    }
    assert_eq!(plots, 14);
    // Fault rate vs tx-depth: a row per (mode, fault, depth), and its plot.
    let rate = res["fault_rate"].as_array().unwrap();
    for (mode, _) in modes.iter().filter(|(m, _)| *m != "pinned") {
        for fault in ["minor", "major"] {
            for depth in [1u64, 4, 16, 64, 128] {
                let r = rate
                    .iter()
                    .find(|r| r["mode"] == *mode && r["fault"] == fault && r["tx_depth"] == depth)
                    .unwrap_or_else(|| panic!("no fault-rate row {mode} {fault} {depth}"));
                check_row(r);
                assert!(r["mops"].as_f64().unwrap() > 0.0, "{r}");
                assert!(r["fault_pages_prepared"].as_u64().unwrap() > 0, "{r}");
            }
        }
    }
    let svg = std::fs::read_to_string(dir.join("fault_rate.svg")).unwrap();
    assert!(svg.matches("<polyline").count() >= 2, "fault_rate.svg");
    assert!(report.contains("fault_rate.svg") && report.contains("Fault resolution rate"));
    assert!(report.contains("ODP (model)"));
    assert!(report.contains("| what | paper (quoted) | measured here | ratio here |"));
}

#[test]
fn perf_table_has_perftest_columns() {
    // More iterations than message bytes: every op targets the same buffer.
    let out = ok(&[
        "perf", "--mode", "pinned", "--op", "read", "--size", "64", "--iters", "500",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("# READ latency test, mode pinned RDMA"),
        "{out}"
    );
    assert!(lines[1].contains("t_typical[us]") && lines[1].contains("p99.9[us]"));
    let cols: Vec<f64> = lines[2]
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    assert_eq!(cols.len(), 8);
    assert_eq!((cols[0], cols[1]), (64.0, 500.0));
    assert!(cols[2] <= cols[7], "t_min <= t_max: {out}");
}

#[test]
fn perf_json_bandwidth_all_sizes_fields() {
    let out = ok(&[
        "perf",
        "--mode",
        "nprdma",
        "--op",
        "write",
        "--size",
        "4096",
        "--iters",
        "64",
        "--bw",
        "--tx-depth",
        "8",
        "--signal-every",
        "4",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["bytes"], 4096);
    assert_eq!(v["iterations"], 64);
    assert_eq!(v["mode_label"], "NP-RDMA");
    assert!(v["t_avg_us"].is_null());
    check_row(&v);
}

#[test]
fn perf_faults_and_atomics_and_send() {
    for fault in ["minor", "major"] {
        let out = ok(&[
            "perf", "--fault", fault, "--size", "8192", "--iters", "10", "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        check_row(&v);
        assert_eq!(
            v["fault_pages_prepared"], 20,
            "{fault}: two pages per op: {v}"
        );
        assert!(v["np_two_sided"].as_u64().unwrap() >= 1, "{v}");
    }
    for mode in ["pinned", "nprdma"] {
        for op in ["atomic", "send"] {
            let out = ok(&[
                "perf", "--mode", mode, "--op", op, "--size", "256", "--iters", "20", "--json",
            ]);
            let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
            check_row(&v);
            assert_eq!(v["bytes"], if op == "atomic" { 8 } else { 256 });
        }
    }
}

#[test]
#[cfg(feature = "odp")]
fn perf_odp_model_is_labelled_and_faults() {
    for fault in ["minor", "major"] {
        let out = ok(&[
            "perf", "--mode", "odp", "--fault", fault, "--size", "4096", "--iters", "3", "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        check_row(&v);
        assert_eq!(v["mode_label"], "ODP (model)");
        assert_eq!(v["fault_pages_prepared"], 3, "{v}");
    }
    let out = ok(&["perf", "--mode", "odp", "--size", "64", "--iters", "20"]);
    assert!(
        out.starts_with("# READ latency test, mode ODP (model)"),
        "{out}"
    );
}

#[test]
fn perf_shm_spawns_its_peer() {
    for mode in ["pinned", "nprdma"] {
        let out = ok(&[
            "perf",
            "--transport",
            "shm",
            "--mode",
            mode,
            "--size",
            "128",
            "--iters",
            "30",
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["transport"], "shm (2 processes)");
        check_row(&v);
    }
}

#[test]
fn signal_every_is_capped_at_the_depth_like_perftests_cq_mod() {
    // The default (100) and any larger value signal every depth-th WR.
    for extra in [&[][..], &["--signal-every", "16"][..]] {
        let mut args = vec![
            "perf",
            "--bw",
            "--tx-depth",
            "8",
            "--iters",
            "64",
            "--size",
            "64",
            "--json",
        ];
        args.extend_from_slice(extra);
        let v: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
        assert_eq!(v["signal_every"], 8, "{extra:?}");
        assert_eq!(v["tx_depth"], 8);
        check_row(&v);
    }
}

#[test]
fn library_logs_reach_stderr_under_rust_log() {
    let out = Command::new(env!("CARGO_BIN_EXE_nprdma"))
        .args(["perf", "--mode", "nprdma", "--size", "64", "--iters", "10"])
        .env("RUST_LOG", "vmem=debug")
        .output()
        .expect("run nprdma");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("swap device created"),
        "no pager log on stderr: {err}"
    );
    // Without RUST_LOG, debug lines stay off.
    let out = Command::new(env!("CARGO_BIN_EXE_nprdma"))
        .args(["perf", "--mode", "nprdma", "--size", "64", "--iters", "10"])
        .env_remove("RUST_LOG")
        .output()
        .expect("run nprdma");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("swap device created"));
}

#[test]
fn bad_arguments_are_clear_errors() {
    fails(
        &["perf", "--tx-depth", "8", "--signal-every", "0", "--bw"],
        "--signal-every",
    );
    fails(&["perf", "--size", "0"], "--size");
    fails(&["perf", "--bw", "--tx-depth", "4096"], "--tx-depth");
    fails(&["perf", "--size", "12Q"], "not a size");
    fails(&["perf", "--iters", "0"], "--iters");
    fails(&["perf", "--op", "nope"], "invalid value");
    fails(&["perf", "--client", "127.0.0.1"], "--transport shm");
    fails(&["perf", "--server"], "--transport shm");
    fails(&["perf", "--lat", "--bw"], "cannot be used with");
    fails(
        &["perf", "--op", "send", "--fault", "minor"],
        "--fault applies",
    );
    fails(&["reg", "--mode", "odp", "--size", "1M"], "reg compares");
}

/// `nprdma perf` with one extra environment variable; (success, stdout, stderr).
fn perf_env(args: &[&str], var: (&str, &str)) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nprdma"))
        .args(args)
        .env(var.0, var.1)
        .output()
        .expect("run nprdma");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn perf_major_fault_reports_swap_io_and_the_device_baseline() {
    // In process and across the shm transport (the target measures its device).
    for transport in ["inproc", "shm"] {
        let out = ok(&[
            "perf",
            "--transport",
            transport,
            "--fault",
            "major",
            "--iters",
            "20",
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        check_row(&v);
        let io = v["swap_io"].as_str().unwrap_or_else(|| panic!("{v}"));
        assert_ne!(io, "buffered (page cache)", "O_DIRECT by default: {v}");
        let med = finite(&v, "device_read_4k_us");
        assert!(finite(&v, "device_read_4k_min_us") <= med, "{v}");
        assert!(med <= finite(&v, "device_read_4k_max_us"), "{v}");
        assert!(finite(&v, "device_iops") > 0.0, "{v}");
        assert!(finite(&v, "device_iops_at_depth") > 0.0, "{v}");
        assert!(v["device_depth"].as_u64().unwrap() > 1, "{v}");
    }
    // The table prints the baseline under the row and the swap I/O in the banner.
    let out = ok(&["perf", "--fault", "major", "--iters", "20"]);
    assert!(out.contains(", swap "), "{out}");
    assert!(out.contains("# device (swap file, O_DIRECT 4 KiB"), "{out}");
    // No major faults, no baseline.
    let out = ok(&["perf", "--fault", "minor", "--iters", "20", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        v["device_read_4k_us"].is_null() && v["swap_io"].is_null(),
        "{v}"
    );
    // Buffered swap on request, labelled; a bad value is a clear error.
    let args = ["perf", "--fault", "major", "--iters", "20", "--json"];
    let (okay, out, err) = perf_env(&args, ("NPRDMA_SWAP_BUFFERED", "1"));
    assert!(okay, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["swap_io"], "buffered (page cache)", "{v}");
    finite(&v, "device_read_4k_us");
    let (okay, _, err) = perf_env(&args, ("NPRDMA_SWAP_BUFFERED", "yes"));
    assert!(!okay && err.contains("NPRDMA_SWAP_BUFFERED"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
