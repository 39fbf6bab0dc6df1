//! nprdma's chaos test over the libibverbs backend in user-space mode (the
//! runner is `nprdma_test_support::chaos`, the same as on the software RNIC):
//! two hosts on libnprdma.so's software NIC through the libibverbs C ABI,
//! three QPs in both directions, random READ / WRITE / ATOMIC / SEND with
//! evictors swapping both sides' pages out under a 200-page budget. Every
//! byte is checked against the model, every signaled WR completes once in post
//! order, nothing stays pinned — and, the backend having no IOMMU control,
//! nothing goes one-sided.
//!
//! Short by default; `NPRDMA_CHAOS_OPS=<ops per QP>` runs the long form.

mod common;

use common::UserSide;
use nprdma_test_support::chaos;

#[test]
fn chaos_in_user_space_mode() {
    let Some((na, nb)) = common::pair() else {
        return;
    };
    let ops = chaos::chaos_ops(300);
    let (a, b) = (UserSide::new(na), UserSide::new(nb));
    let (sa, sb) = chaos::run(&a, &b, ops).stats;
    assert_eq!(
        sa.optimistic_ok + sb.optimistic_ok,
        0,
        "user-space mode has no one-sided path"
    );
    assert!(sa.two_sided > 0 && sb.two_sided > 0);
    assert!(sa.served > 0 && sb.served > 0);
}
