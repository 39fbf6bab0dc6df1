//! NP-RDMA's polling thread, with a core to itself, waits for the swap reads
//! of the major faults it serves by polling an io_uring, not by sleeping in
//! `pread` (`vmem::poll_swap_reads`); in interrupt mode it sleeps. Its own test
//! binary: the count of polled reads is process-wide.

mod common;

use common::*;
use nprdma::Config;

const LEN: usize = 16 * 4096;

/// Major faults on `b`'s swapped-out buffer, served by `b`'s polling thread:
/// how many swap reads were polled for meanwhile.
fn polled_during_major_faults(cfg: Config) -> u64 {
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    let (qa, _qb) = connect(&a, &b, 16);
    let want = pattern(3, LEN);
    let la = Buf::new(&a, LEN);
    let rb = Buf::with(&b, LEN, Some(&want));
    let before = vmem::polled_swap_reads();
    for round in 0..4u64 {
        rb.swap_out();
        // One READ per page, each its own fault.
        for p in 0..(LEN / 4096) as u64 {
            qa.post_send(&[rd(round * 100 + p, &la, p * 4096, &rb, p * 4096, 64)])
                .expect("post");
            let c = wait1(&a.cq);
            assert_eq!(c.status, 0);
        }
        for p in 0..LEN / 4096 {
            assert!(la.bytes()[p * 4096..p * 4096 + 64] == want[p * 4096..p * 4096 + 64]);
        }
    }
    assert!(b.pager.stats().swap_ins > 0, "no major fault happened");
    vmem::polled_swap_reads() - before
}

#[test]
fn the_polling_thread_polls_for_its_swap_reads_and_sleeps_in_interrupt_mode() {
    if !vmem::swap_reads_can_poll() {
        eprintln!("io_uring unavailable here: swap reads always use pread; skipped");
        return;
    }
    let asleep = polled_during_major_faults(Config {
        interrupt_mode: true,
        ..Config::default()
    });
    assert_eq!(asleep, 0, "a thread in interrupt mode polled for reads");
    let polled = polled_during_major_faults(Config::default());
    assert!(
        polled > 0,
        "the polling thread slept through every swap read"
    );
}
