//! A failing swap device under NP-RDMA traffic (issue 12's fault-injection suite):
//! while every swap write fails, evictions leave their pages resident and every
//! READ / WRITE / atomic still completes with the right bytes; once the device
//! works again, pages go out and come back through major faults intact. A swap
//! device too small for what must go out is reported full, never overrun.

mod common;

use std::time::Duration;

use common::*;
use nprdma::{Opcode, SendWr};

const LEN: usize = 64 * 4096;

/// READ all of `rb` into `la`, then WRITE `la`'s second half over `rb`'s first
/// half; checks both against `want` (updated with the WRITE).
fn read_write_check(env: &Env, la: &Buf, rb: &Buf, want: &mut [u8], id: u64) {
    env.qa
        .post_send(&[rd(id, la, 0, rb, 0, LEN as u32)])
        .expect("post READ");
    let c = wait1(&env.a.cq);
    assert_eq!(c.status, 0, "READ");
    assert!(la.bytes() == want, "READ returned other bytes");
    let half = LEN / 2;
    env.qa
        .post_send(&[wr(id + 1, la, half as u64, rb, 0, half as u32)])
        .expect("post WRITE");
    let c = wait1(&env.a.cq);
    assert_eq!(c.status, 0, "WRITE");
    let (lo, hi) = want.split_at_mut(half);
    lo.copy_from_slice(hi);
    assert!(rb.bytes() == want, "WRITE landed other bytes");
}

#[test]
fn failing_swap_writes_lose_nothing_and_traffic_goes_on() {
    let env = env_with_depth(16);
    let mut want = pattern(7, LEN);
    let la = Buf::new(&env.a, LEN);
    let rb = Buf::with(&env.b, LEN, Some(&want));

    env.b.pager.inject_swap_write_failures(true);
    let before = env.b.pager.stats().evict_failures;
    assert_eq!(
        rb.region.swap_out().expect("swap_out reports, not fails"),
        0
    );
    let s = env.b.pager.stats();
    assert_eq!(
        s.evict_failures - before,
        (LEN / 4096) as u64,
        "every page stayed"
    );
    assert_eq!(rb.region.resident_count().unwrap(), LEN / 4096);
    read_write_check(&env, &la, &rb, &mut want, 1);

    // An atomic on a page whose eviction failed.
    assert_eq!(rb.region.swap_out().unwrap(), 0);
    env.qa
        .post_send(&[SendWr::new(
            3,
            Opcode::FetchAdd { add: 5 },
            Some(la.mr.sge(0, 8)),
            rb.addr() + 8,
            rb.mr.rkey(),
        )])
        .unwrap();
    let c = env.a.cq.poll_wait(1, Duration::from_secs(10));
    assert_eq!((c.len(), c[0].status), (1, 0));
    assert_eq!(
        la.bytes()[..8],
        want[8..16],
        "FETCH_ADD returned the old word"
    );
    let w = u64::from_le_bytes(want[8..16].try_into().unwrap()).wrapping_add(5);
    want[8..16].copy_from_slice(&w.to_le_bytes());
    assert!(rb.bytes() == want, "FETCH_ADD result");

    // The device works again: the pages go out, and come back intact.
    env.b.pager.inject_swap_write_failures(false);
    assert_eq!(rb.region.swap_out().unwrap(), LEN / 4096);
    assert_eq!(rb.region.resident_count().unwrap(), 0);
    let ins = env.b.pager.stats().bytes_swapped_in;
    read_write_check(&env, &la, &rb, &mut want, 4);
    assert!(
        env.b.pager.stats().bytes_swapped_in > ins,
        "the traffic read the device"
    );
}

#[test]
fn a_full_swap_device_is_reported_not_overrun() {
    let a = side();
    // A pager whose swap device holds 8 pages, under a 64-page MR.
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 8 * 4096,
        ..vmem::PagerConfig::default()
    })
    .unwrap();
    let host = rnic::Host::new(rnic::HostConfig::default()).unwrap();
    let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default()).unwrap();
    let b = Side {
        pd: ctx.alloc_pd(),
        cq: ctx.create_cq(64).unwrap(),
        rcq: ctx.create_cq(64).unwrap(),
        host,
        pager,
        ctx,
    };
    let (qa, _qb) = connect(&a, &b, 16);
    let env = Env { a, b, qa, _qb };
    let mut want = pattern(9, LEN);
    let la = Buf::new(&env.a, LEN);
    let rb = Buf::with(&env.b, LEN, Some(&want));
    assert!(matches!(
        rb.region.swap_out(),
        Err(vmem::Error::SwapFull(8))
    ));
    assert_eq!(
        env.b.pager.swap_out(rb.addr() as usize, 8 * 4096).unwrap(),
        8
    );
    assert!(matches!(
        env.b.pager.swap_out(rb.addr() as usize + 8 * 4096, 4096),
        Err(vmem::Error::SwapFull(8))
    ));
    assert_eq!(env.b.pager.stats().swap_slots_used, 8);
    read_write_check(&env, &la, &rb, &mut want, 1);
}

#[test]
fn a_window_of_major_faults_is_swapped_in_together_and_read_exact() {
    const N: usize = 64;
    let env = env_with_depth(N as u32);
    let want = pattern(11, N * 4096);
    let la = Buf::new(&env.a, N * 64);
    let rb = Buf::with(&env.b, N * 4096, Some(&want));
    assert_eq!(rb.region.swap_out().unwrap(), N);
    let before = env.b.ctx.stats().batched_swap_ins;
    // One 8-byte READ per swapped-out page, all posted at once (a window),
    // each into its own local slot.
    let wrs: Vec<SendWr> = (0..N)
        .map(|k| {
            rd(
                k as u64,
                &la,
                (k * 64) as u64,
                &rb,
                (k * 4096 + 100) as u64,
                8,
            )
        })
        .collect();
    env.qa.post_send(&wrs).expect("post the window");
    let mut ids: Vec<u64> = (0..N)
        .map(|_| wait1(&env.a.cq))
        .map(|c| {
            assert_eq!(c.status, 0, "READ {}", c.wr_id);
            c.wr_id
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (0..N as u64).collect::<Vec<_>>(),
        "one completion each"
    );
    let got = la.bytes();
    for k in 0..N {
        assert_eq!(
            got[k * 64..k * 64 + 8],
            want[k * 4096 + 100..k * 4096 + 108],
            "page {k}"
        );
    }
    assert!(
        env.b.ctx.stats().batched_swap_ins > before,
        "the target swapped the window's pages in together"
    );
    assert_eq!(env.b.ctx.nic_stats().nonresident_dma, 0);
}
