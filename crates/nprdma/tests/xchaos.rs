//! The chaos test across processes on the software RNIC (the runner, shared
//! with the libibverbs backend's tests, is `nprdma_test_support::xchaos`): the
//! target is a child process on the software NIC's shared-memory transport, so
//! small one-sided ops and atomics go through the target's request ring and the
//! control channel crosses processes; both one-sided and two-sided paths run.
//!
//! Short by default; `NPRDMA_CHAOS_OPS=<ops>` runs the long form.

mod common;

use std::time::Duration;

use common::child::ChildProc;
use common::*;
use nprdma_test_support::{chaos, xchaos};

impl chaos::Side<nprdma::engine::DefaultNic> for Side {
    fn ctx(&self) -> &nprdma::Context {
        &self.ctx
    }
}

#[test]
fn xchaos_child() {
    if std::env::var("NPRDMA_XCHAOS_CHILD").is_ok() {
        let s = side();
        xchaos::child(&s, || s.ctx.nic_stats().nonresident_dma);
    }
}

#[test]
fn chaos_across_processes() {
    across_processes(nprdma::Config::default());
}

/// The same with the initiator's two-sided READs and WRITEs longer than
/// 4 KiB going in 4 KiB pieces (`Config::two_sided_piece`; the default
/// 1 MiB is longer than the chaos test's operations).
#[test]
fn chaos_across_processes_in_pieces() {
    across_processes(nprdma::Config {
        two_sided_piece: 4096,
        ..nprdma::Config::default()
    });
}

/// The chaos test from this process (engine configuration `cfg`) against a
/// child process on the default configuration.
fn across_processes(cfg: nprdma::Config) {
    let ops = chaos_ops(1500);
    let child = ChildProc::spawn(
        "xchaos_child",
        "NPRDMA_XCHAOS_CHILD",
        Duration::from_secs(60 + ops / 100),
    );
    let a = side_with(cfg);
    let st = xchaos::parent(&a, child, ops, || a.ctx.nic_stats().nonresident_dma);
    assert!(
        st.two_sided > 0 && st.optimistic_ok > 0,
        "both paths ran: {st:?}"
    );
}
