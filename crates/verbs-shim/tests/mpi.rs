//! Open MPI jobs over UCX over libnprdma.so (Debian's Open MPI 4.1 and UCX 1.13:
//! packages openmpi-bin, libopenmpi-dev, ucx-utils): the programs of `tests/mpi/`,
//! written against `mpi.h` only, built with `mpicc` and run by
//! `mpirun -np 2 --mca pml ucx` with `UCX_TLS` naming a verbs transport (rc_verbs or
//! ud_verbs with `self`: on one host UCX would otherwise choose shared memory and
//! never reach the device). Each program checks every byte of what it received and
//! exits non-zero on a mismatch:
//! * `pingpong.c`: 1 B to 64 MiB in fresh buffers (eager, and rendezvous by RDMA
//!   READ from the sender's buffer);
//! * `collectives.c`: MPI_Allreduce and MPI_Alltoall of 32 MiB buffers that are
//!   mostly never touched (one written page in eight).
//!
//! Both in pinned mode and in NP-RDMA mode, and the collectives also under a pager
//! budget smaller than each rank's buffers (16 MiB over rc_verbs, 48 MiB over
//! ud_verbs, whose posted receives alone hold ~35 MiB): pages are swapped out and in
//! during the job and the results are the same. Not here: the ping-pong under such
//! a budget, which does not finish yet (a rendezvous READ of a message larger than
//! the budget stalls: the closing note).

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `tests/mpi/<name>.c` built with `mpicc`, or None (skipped) without Open MPI. Each
/// program is built once per test binary: the tests run in parallel and must not
/// compile over a program another test is running.
fn build(name: &str) -> Option<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let b = require(&["mpicc", "mpirun"])?;
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, exe)) = built.iter().find(|(n, _)| n == name) {
        return Some(exe.clone());
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/mpi/{name}.c"));
    let exe = out_dir().join(format!("mpi-{name}"));
    let out = Command::new(&b[0])
        .args(["-O2", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("run mpicc: {e}"));
    assert!(
        out.status.success(),
        "mpicc {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    built.push((name.to_string(), exe.clone()));
    Some(exe)
}

/// Seconds Open MPI gives a job before it aborts it (`mpirun --timeout`).
const JOB_SECS: u64 = 120;

/// `mpirun -np 2 --mca pml ucx` of `exe` with libnprdma.so preloaded into the ranks
/// (not into mpirun), `UCX_TLS=tls` and `env` passed to them; the job's output.
fn mpirun(exe: &Path, tls: &str, env: &[(&str, &str)]) -> Output {
    let mpirun = find_bin("mpirun").expect("mpirun (checked by build)");
    let lib = lib_path();
    let mut args: Vec<String> = [
        "--allow-run-as-root",
        "--oversubscribe",
        "--timeout",
        &JOB_SECS.to_string(),
        "-np",
        "2",
        "--mca",
        "pml",
        "ucx",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut xs = vec![
        format!("LD_PRELOAD={}", lib.display()),
        format!("UCX_TLS={tls}"),
        "NPRDMA_STATS=1".to_string(),
    ];
    xs.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    for x in xs {
        args.push("-x".into());
        args.push(x);
    }
    args.push(exe.display().to_string());
    let child = Command::new(&mpirun)
        .args(&args)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn mpirun: {e}"));
    finish(child, Instant::now() + Duration::from_secs(JOB_SECS + 30))
}

/// The `nprdma-stats` lines of both ranks, as maps.
fn rank_stats(o: &Output) -> Vec<std::collections::HashMap<String, u64>> {
    o.stderr
        .lines()
        .chain(o.stdout.lines())
        .filter_map(np_stats)
        .map(|m| {
            m.into_iter()
                .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
                .collect()
        })
        .collect()
}

/// Run `name` over `tls` in `mode` (with `env`): the job succeeds and prints
/// `<name> ok`; both ranks print their counters, and in NP-RDMA mode no DMA of
/// either met a non-resident page. The ranks' counters.
fn job(
    name: &str,
    mode: &str,
    tls: &str,
    env: &[(&str, &str)],
) -> Option<Vec<std::collections::HashMap<String, u64>>> {
    let exe = build(name)?;
    let mut e = vec![("NPRDMA_MODE", mode)];
    e.extend_from_slice(env);
    let o = mpirun(&exe, tls, &e);
    assert!(o.ok(), "{name} ({mode}, {tls}) failed:\n{}", o.all());
    assert!(
        o.stdout.contains(&format!("{name} ok")),
        "{name} ({mode}, {tls}):\n{}",
        o.all()
    );
    let stats = rank_stats(&o);
    assert_eq!(stats.len(), 2, "one stats line per rank:\n{}", o.all());
    if mode == "nprdma" {
        for s in &stats {
            assert_eq!(s.get("nonresident_dma"), Some(&0), "{}", o.all());
        }
    }
    Some(stats)
}

#[test]
fn mpi_over_ucx_rc_verbs_pinned() {
    for name in ["pingpong", "collectives"] {
        job(name, "pinned", "rc_v,self", &[]);
    }
}

#[test]
fn mpi_over_ucx_rc_verbs_nprdma() {
    for name in ["pingpong", "collectives"] {
        job(name, "nprdma", "rc_v,self", &[]);
    }
}

#[test]
fn mpi_over_ucx_ud_verbs_nprdma() {
    for name in ["pingpong", "collectives"] {
        job(name, "nprdma", "ud_v,self", &[]);
    }
}

/// The collectives with a 16 MiB budget per rank (each rank's four buffers are
/// 128 MiB): pages are swapped out during the job, the results are the same, and
/// what was resident stayed within the budget, its slack and the pages the engine
/// held pinned for operations in flight (UCX's receive buffers among them).
#[test]
fn mpi_collectives_nprdma_under_a_budget() {
    let Some(stats) = job(
        "collectives",
        "nprdma",
        "rc_v,self",
        &[("NPRDMA_BUDGET_MB", "16")],
    ) else {
        return;
    };
    for s in &stats {
        let g = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no {k} in {s:?}"));
        assert_eq!(g("budget_pages"), 4096, "{s:?}");
        assert!(g("swap_outs") > 0, "the budget never pressed: {s:?}");
        assert!(
            g("resident_high") <= g("budget_pages") + g("budget_slack") + g("engine_pinned_high"),
            "{s:?}"
        );
    }
}

/// The collectives over ud_verbs with a 48 MiB budget per rank (above the ~35 MiB of
/// receive buffers ud_verbs keeps posted, below the 128 MiB of buffers): datagrams
/// are sent from pages that were swapped out, which the NIC reaches only once the
/// engine's pin brought them back and marked them resident (before, such a SEND
/// failed LOC_PROT_ERR on a non-resident page and took the QP to ERR).
#[test]
fn mpi_collectives_nprdma_ud_verbs_under_a_budget() {
    let Some(stats) = job(
        "collectives",
        "nprdma",
        "ud_v,self",
        &[("NPRDMA_BUDGET_MB", "48")],
    ) else {
        return;
    };
    for s in &stats {
        assert!(s.get("swap_outs").is_some_and(|&n| n > 0), "{s:?}");
    }
}
