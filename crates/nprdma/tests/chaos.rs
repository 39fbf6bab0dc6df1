//! The chaos test on the software RNIC (the runner, shared with the
//! libibverbs backend's tests, is `nprdma_test_support::chaos`): two hosts,
//! several QPs in both directions, random READ / WRITE / ATOMIC / SEND of
//! random sizes and offsets over MRs of 1 MiB, while evictors on both sides
//! swap random pages out (budget well below the working set) and some buffers
//! hold the magic word on purpose. Verifies byte-exact data against a model,
//! exactly one completion per signaled WR, in post order, and zero NIC
//! accesses to non-resident pages; at the end no page stays pinned.
//!
//! Short by default; `NPRDMA_CHAOS_OPS=<ops per QP>` runs the long form.

mod common;

use common::*;
use nprdma_test_support::chaos;

impl chaos::Side<nprdma::engine::DefaultNic> for Side {
    fn ctx(&self) -> &nprdma::Context {
        &self.ctx
    }
}

#[test]
fn chaos() {
    run_chaos(nprdma::Config::default(), chaos_ops(600));
}

/// The chaos test with the paper's parking instead of pipelining
/// (`OrderConfig::pipeline` off).
#[test]
fn chaos_parking() {
    let mut cfg = nprdma::Config::default();
    cfg.order.pipeline = false;
    run_chaos(cfg, chaos_ops(600));
}

/// The same under the other modes: retry mode (Receiver-Ready), versioned
/// READs above 8 KiB, interrupt-mode polling threads, smaller inline limit.
#[test]
fn chaos_modes() {
    let mut cfg = nprdma::Config {
        retry_mode: true,
        interrupt_mode: true,
        ..nprdma::Config::default()
    };
    cfg.plan.read_version_threshold = Some(8192);
    cfg.plan.inline_max = 256;
    run_chaos(cfg, chaos_ops(400));
}

/// Every READ and WRITE checked by page versions (the versions before and
/// after each, or on an idle QP the versions its last checks read and those
/// after: `nprdma::seen_versions`, which `modes.rs` drives on purpose —
/// here QPs are seldom idle) while the evictors move pages.
#[test]
fn chaos_versioned() {
    let mut cfg = nprdma::Config::default();
    cfg.plan.read_version_threshold = Some(0);
    cfg.plan.write_version_threshold = 0;
    run_chaos(cfg, chaos_ops(600));
}

/// Two-sided READs and WRITEs longer than 4 KiB go in 4 KiB pieces (the
/// default piece is 1 MiB, longer than the chaos test's operations).
#[test]
fn chaos_pieces() {
    let cfg = nprdma::Config {
        two_sided_piece: 4096,
        ..nprdma::Config::default()
    };
    run_chaos(cfg, chaos_ops(600));
}

fn run_chaos(cfg: nprdma::Config, ops: u64) {
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    let (sa, sb) = chaos::run(&a, &b, ops).stats;
    assert!(sa.two_sided + sb.two_sided > 0 && sa.optimistic_ok + sb.optimistic_ok > 0);
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma,
        0,
        "NIC touched a non-resident page on A"
    );
    assert_eq!(
        b.ctx.nic_stats().nonresident_dma,
        0,
        "NIC touched a non-resident page on B"
    );
}
