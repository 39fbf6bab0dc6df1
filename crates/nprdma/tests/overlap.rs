//! Overlapping registrations: an application may register the same pages in
//! several MRs (libibverbs allows it; the LD_PRELOAD library sees it). Each MR
//! keeps its own views and versions; swap-outs reach all of them; dropping one
//! leaves the other working.

mod common;

use common::*;
use nprdma::{Access, Opcode, SendWr};

const LEN: usize = 64 * 1024;

fn read(a: &Side, qa: &nprdma::Qp, la: &Buf, raddr: u64, rkey: u32, len: usize, id: u64) {
    qa.post_send(&[SendWr::new(
        id,
        Opcode::Read,
        Some(la.mr.sge(0, len as u32)),
        raddr,
        rkey,
    )])
    .unwrap();
    let c = wait1(&a.cq);
    assert_eq!((c.wr_id, c.status), (id, 0), "READ {id}");
}

#[test]
fn same_pages_in_two_mrs() {
    let a = side();
    let b = side();
    let (qa, _qb) = connect(&a, &b, 16);
    let data = pattern(7, LEN);
    let rb = Buf::with(&b, LEN, Some(&data));
    // A second MR over the middle of the same buffer (overlapping, unaligned).
    let off = 4096 + 100;
    let len2 = 3 * 4096;
    #[allow(unsafe_code)]
    // SAFETY: `rb.region` stays mapped for the whole test and outlives `mr2`.
    let mr2 = unsafe {
        b.pd.reg_mr(
            rb.addr() + off as u64,
            len2 as u64,
            Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
    }
    .expect("overlapping registration");
    let la = Buf::with(&a, LEN, Some(&vec![0u8; LEN]));

    for round in 0..3u64 {
        if round > 0 {
            rb.swap_out();
        }
        read(&a, &qa, &la, rb.addr(), rb.mr.rkey(), LEN, 10 + round);
        assert!(la.bytes() == &data[..], "whole MR, round {round}");
        rb.swap_out();
        read(&a, &qa, &la, mr2.addr(), mr2.rkey(), len2, 20 + round);
        assert!(
            la.bytes()[..len2] == data[off..off + len2],
            "overlapping MR, round {round}"
        );
    }
    drop(mr2);
    rb.swap_out();
    read(&a, &qa, &la, rb.addr(), rb.mr.rkey(), LEN, 30);
    assert!(la.bytes() == &data[..], "first MR after the second is gone");
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}
