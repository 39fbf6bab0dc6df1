//! nprdma's cross-process chaos test over the libibverbs backend in user-space
//! mode (the runner is `nprdma_test_support::xchaos`, the same as on the
//! software RNIC): the target is a child process (this test binary
//! re-executed) with its own libnprdma.so device, reached through the
//! libibverbs C ABI over the software NIC's shared-memory transport. Random
//! READ / WRITE / ATOMIC / SEND with evictors on both sides; the parent's
//! memory checked against the model, the child's by hash, SEND payloads in
//! order, nothing pinned at the end — and nothing one-sided.
//!
//! Short by default; `NPRDMA_CHAOS_OPS=<ops>` runs the long form.

mod common;

use std::time::Duration;

use common::UserSide;
use ibverbs_nic::VerbsNic;
use nprdma_test_support::child::ChildProc;
use nprdma_test_support::{chaos, xchaos};

const CHILD_ENV: &str = "NPRDMA_IBVERBS_XCHAOS_CHILD";

fn open(lib: &std::path::Path) -> VerbsNic {
    VerbsNic::open(&common::config(lib)).expect("open")
}

#[test]
fn xchaos_child() {
    if std::env::var_os(CHILD_ENV).is_some() {
        let lib = common::lib_path().expect("library (the parent found it)");
        let s = UserSide::new(open(&lib));
        xchaos::child(&s, || 0);
    }
}

#[test]
fn chaos_across_processes_in_user_space_mode() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(lib) = common::lib_path() else {
        return;
    };
    let ops = chaos::chaos_ops(600);
    let child = ChildProc::spawn_with(
        "xchaos_child",
        CHILD_ENV,
        &[("NPRDMA_TEST_VERBS_LIB", lib.as_os_str())],
        Duration::from_secs(60 + ops / 50),
    );
    let a = UserSide::new(open(&lib));
    let st = xchaos::parent(&a, child, ops, || 0);
    assert_eq!(st.optimistic_ok, 0, "user-space mode has no one-sided path");
    assert!(st.two_sided > 0, "{st:?}");
}
