//! Memory pressure through the C ABI: `tests/c/stress.c` — a program written
//! against `<infiniband/verbs.h>` only — runs random READ / WRITE (signaled and
//! unsignaled bursts) / FETCH_ADD / CMP_SWAP from several threads over shared and
//! separate QPs on a server's 256 MiB, mostly never-touched MR with a 64-page
//! budget, every byte checked against a model and swept at the end, while the
//! server samples its MR's resident pages from the kernel (`mincore`).
//!
//! Each run asserts: the program's own verdict (data, completions, the server's
//! CPU writes and forked readers); the resident bound — every kernel sample, and
//! the pager's own high-water mark, within budget + the pager's slack + the pages
//! the engine held pinned for in-flight operations at most (`engine_pinned_high`,
//! both from the server's `nprdma-stats` line); `nonresident_dma` 0; and for the
//! CI form, at least 200k operations and 100k swap-outs.
//!
//! The long form (10 minutes per mode) is documented in the README:
//! `NPRDMA_PRESSURE_SECS=600 NPRDMA_PRESSURE_OPS=100000000 cargo test --release -p
//! verbs-shim --test pressure -- --test-threads 1`.

mod common;
use common::*;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// One run at a time (each uses both cores).
static SERIAL: Mutex<()> = Mutex::new(());

const BUDGET: u64 = 64;

fn env_num(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// The `nprdma-stats` lines of a run, by their `budget_pages` (the server's has
/// the budget, the clients' `none`).
fn stats_with_budget(stderr: &str, budget: u64) -> HashMap<String, String> {
    let want = format!("budget_pages={budget} ");
    let line = stderr
        .lines()
        .filter_map(|l| l.split("nprdma-stats: ").nth(1))
        .find(|l| l.contains(&want))
        .unwrap_or_else(|| panic!("no server stats line (budget {budget}) in:\n{stderr}"));
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn num(m: &HashMap<String, String>, k: &str) -> u64 {
    m.get(k)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("stats without {k}: {m:?}"))
}

/// `(label, value)` of the program's summary lines: the server's largest
/// `mincore` sample, and the operations of every client.
fn summary(stdout: &str) -> (u64, u64) {
    let max = stdout
        .lines()
        .find_map(|l| l.strip_prefix("stress server: "))
        .and_then(|l| l.split("max ").nth(1))
        .and_then(|l| l.split(',').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no server summary in:\n{stdout}"));
    let ops = stdout
        .lines()
        .filter(|l| l.starts_with("stress client"))
        .filter_map(|l| {
            l.split(": ")
                .nth(1)?
                .split(" ops")
                .next()?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .sum();
    (max, ops)
}

struct Run<'a> {
    name: &'a str,
    env: Vec<(&'a str, &'a str)>,
    budget: u64,
    /// At least this many operations and swap-outs (the CI form).
    min_ops: u64,
    min_swap_outs: u64,
}

fn stress(r: Run) {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(exe) = compile("stress") else { return };
    let budget = r.budget.to_string();
    let mut env = vec![
        ("NPRDMA_STATS", "1"),
        ("STRESS_SERVER_BUDGET_PAGES", budget.as_str()),
        ("GLIBC_TUNABLES", "glibc.malloc.perturb=165"),
    ];
    env.extend(r.env.iter().copied());
    let np = env
        .iter()
        .any(|&(k, v)| k == "NPRDMA_MODE" && v == "nprdma");
    let secs = env_num("NPRDMA_PRESSURE_SECS", 100);
    let o = run_release_within(&exe, &[], &env, Duration::from_secs(secs + 90));
    assert!(o.ok(), "{}: exit {:?}\n{}", r.name, o.code, o.all());
    let (max_sample, ops) = summary(&o.stdout);
    println!(
        "{}: {ops} ops, largest resident sample {max_sample}",
        r.name
    );
    for l in o
        .stdout
        .lines()
        .chain(o.stderr.lines().filter(|l| l.contains("nprdma-stats")))
    {
        println!("  {l}");
    }
    assert!(
        ops >= r.min_ops,
        "{}: {ops} operations, want {}",
        r.name,
        r.min_ops
    );
    if !np {
        return;
    }
    let s = stats_with_budget(&o.stderr, r.budget);
    let bound = r.budget + num(&s, "budget_slack") + num(&s, "engine_pinned_high");
    assert!(
        max_sample <= bound && num(&s, "resident_high") <= bound,
        "{}: resident {max_sample} (kernel) / {} (pager) over budget {} + slack {} + pinned {}",
        r.name,
        num(&s, "resident_high"),
        r.budget,
        num(&s, "budget_slack"),
        num(&s, "engine_pinned_high")
    );
    if s.get("mode").is_some_and(|m| m == "nprdma") {
        // The software NIC's own count (user-space mode has no IOMMU to check).
        assert_eq!(num(&s, "nonresident_dma"), 0, "{}", r.name);
    }
    assert_eq!(
        num(&s, "remap_refusals"),
        0,
        "{}: the IOMMU flush failed",
        r.name
    );
    assert!(
        num(&s, "swap_outs") >= r.min_swap_outs,
        "{}: {} swap-outs, want {}",
        r.name,
        num(&s, "swap_outs"),
        r.min_swap_outs
    );
}

/// The CI form's size: 200k operations (the long form: more, for longer).
fn ci_ops() -> String {
    env_num("NPRDMA_PRESSURE_OPS", 200_000).to_string()
}

fn ci_secs() -> String {
    env_num("NPRDMA_PRESSURE_SECS", 100).to_string()
}

/// Pinned mode: the same program, data and completions (no budget to hold).
#[test]
fn stress_pinned() {
    let (ops, secs) = (ci_ops(), ci_secs());
    stress(Run {
        name: "pinned",
        env: vec![
            ("NPRDMA_MODE", "pinned"),
            ("STRESS_OPS", &ops),
            ("STRESS_SECS", &secs),
        ],
        budget: BUDGET,
        min_ops: 200_000,
        min_swap_outs: 0,
    });
}

/// NP-RDMA mode, default configuration (target-enforced protection, the zero
/// reserve, fault-around and eager swap-in on), budget 64: the CI form. Swap
/// through the page cache, so the run is bound by the engine, not the disk.
#[test]
fn stress_np_default() {
    let (ops, secs) = (ci_ops(), ci_secs());
    stress(Run {
        name: "nprdma",
        env: vec![
            ("NPRDMA_MODE", "nprdma"),
            ("NPRDMA_SWAP_BUFFERED", "1"),
            ("STRESS_OPS", &ops),
            ("STRESS_SECS", &secs),
        ],
        budget: BUDGET,
        min_ops: 200_000,
        min_swap_outs: 100_000,
    });
}

/// NP-RDMA mode between trusting processes (`NPRDMA_TRUSTED_PEERS=1`).
#[test]
fn stress_np_trusted_peers() {
    stress(Run {
        name: "nprdma, trusted peers",
        env: vec![
            ("NPRDMA_MODE", "nprdma"),
            ("NPRDMA_TRUSTED_PEERS", "1"),
            ("NPRDMA_SWAP_BUFFERED", "1"),
            ("STRESS_OPS", "40000"),
        ],
        budget: BUDGET,
        min_ops: 40_000,
        min_swap_outs: 10_000,
    });
}

/// Every pager feature under the same pressure, alone and together: the zero
/// reserve, fault-around, eager swap-in, polled (O_DIRECT) swap reads and
/// batched swap-out (every run), all off, and user-space mode with leases.
#[test]
fn stress_np_each_pager_feature() {
    let off = [
        ("NPRDMA_ZERO_RESERVE_MB", "0"),
        ("NPRDMA_FAULT_AROUND_PAGES", "0"),
        ("NPRDMA_EAGER_SWAP_IN", "0"),
        ("NPRDMA_SWAP_BUFFERED", "1"),
    ];
    // Each feature alone: everything off but it.
    for (i, feature) in [
        "zero reserve",
        "fault-around",
        "eager swap-in",
        "polled swap reads",
    ]
    .iter()
    .enumerate()
    {
        let mut env = vec![("NPRDMA_MODE", "nprdma"), ("STRESS_OPS", "12000")];
        env.extend(
            off.iter()
                .enumerate()
                .filter(|&(k, _)| k != i)
                .map(|(_, kv)| *kv),
        );
        if i == 0 {
            // The reserve fills only runs of 32+ never-touched pages (large
            // WRITEs), in whole 2 MiB chunks of at most a sixteenth of the
            // budget: 32 MiB of budget, a 64 MiB hot part to swap from.
            env.extend([("NPRDMA_ZERO_RESERVE_MB", "2"), ("STRESS_HOT_KB", "65536")]);
        }
        stress(Run {
            name: &format!("nprdma, {feature} alone"),
            env,
            budget: if i == 0 { 8192 } else { BUDGET },
            min_ops: 12_000,
            min_swap_outs: 1_000,
        });
    }
    let mut none = vec![("NPRDMA_MODE", "nprdma"), ("STRESS_OPS", "12000")];
    none.extend(off);
    stress(Run {
        name: "nprdma, every feature off",
        env: none,
        budget: BUDGET,
        min_ops: 12_000,
        min_swap_outs: 1_000,
    });
    // User-space mode (over a second copy of the library as the device), with
    // its leases and registration cache.
    let chain = chain_env(&[("STRESS_OPS", "12000")]);
    stress(Run {
        name: "nprdma user-space mode (leases)",
        env: env_refs(&chain),
        budget: BUDGET,
        min_ops: 12_000,
        min_swap_outs: 1_000,
    });
    stress(Run {
        name: "nprdma, every feature on (O_DIRECT swap)",
        env: vec![("NPRDMA_MODE", "nprdma"), ("STRESS_OPS", "12000")],
        budget: BUDGET,
        min_ops: 12_000,
        min_swap_outs: 1_000,
    });
}

/// Two client processes on one passive server, and children the server forks
/// that read its registered memory while the clients run.
#[test]
fn stress_np_two_clients_and_forked_readers() {
    let every = std::env::var("NPRDMA_PRESSURE_FORK_EVERY").unwrap_or_else(|_| "2000".into());
    stress(Run {
        name: "nprdma, two clients, forked readers",
        env: vec![
            ("NPRDMA_MODE", "nprdma"),
            ("NPRDMA_SWAP_BUFFERED", "1"),
            ("STRESS_CLIENTS", "2"),
            ("STRESS_SERVER_FORK_EVERY", every.as_str()),
            ("STRESS_OPS", "10000"),
        ],
        budget: 256,
        min_ops: 20_000,
        min_swap_outs: 1_000,
    });
}
