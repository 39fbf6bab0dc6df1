//! The control channel's command-slot rings live in rnic's NIC-shared DMA
//! pool (pinned, mlocked pages: observable as the process's `VmLck`) and
//! go back to it when the QP is destroyed; without a pool (or with it
//! exhausted) they fall back to heap buffers and everything still works.
//! One test per binary state: `VmLck` is process-wide, so the measuring
//! test is the only one here that creates QPs on pool hosts concurrently.

mod common;

use common::*;
use nprdma::{Config, Opcode, SendWr};

const LEN: usize = 64 * 1024;

/// The process's locked memory in KiB (only rnic's DMA pool mlocks here).
fn vm_lck_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmLck line")
}

/// A two-sided (fault) READ and WRITE in both directions on `a <-> b`.
fn exercise(a: &Side, b: &Side, qa: &nprdma::Qp, qb: &nprdma::Qp) {
    let pa = pattern(21, LEN);
    let ma = Buf::with(a, LEN, Some(&pa));
    let mb = Buf::new(b, LEN); // untouched: faults go two-sided
    let lb = Buf::with(b, LEN, Some(&pattern(22, LEN)));
    qa.post_send(&[SendWr::new(
        1,
        Opcode::Write,
        Some(ma.mr.sge(0, 4096)),
        mb.addr(),
        mb.mr.rkey(),
    )])
    .unwrap();
    let c = wait1(&a.cq);
    assert_eq!(c.status, 0, "A writes B's untouched page: {c:?}");
    qb.post_send(&[SendWr::new(
        2,
        Opcode::Read,
        Some(lb.mr.sge(0, 2)),
        ma.addr() + 3 * 4096,
        ma.mr.rkey(),
    )])
    .unwrap();
    let c = wait1(&b.cq);
    assert_eq!(c.status, 0, "B reads A: {c:?}");
    assert_eq!(&lb.bytes()[..2], &pa[3 * 4096..3 * 4096 + 2]);
    assert_eq!(&mb.bytes()[..4096], &pa[..4096], "written data");
    let st = a.ctx.stats().two_sided + b.ctx.stats().two_sided;
    assert!(st >= 1, "the untouched target page made a two-sided op");
}

#[test]
fn ctrl_rings_from_pool_freed_on_destroy_and_heap_fallback() {
    // Pool hosts: the rings are locked pool pages while the QPs exist.
    let a = side();
    let b = side();
    let l0 = vm_lck_kib();
    let (qa, qb) = connect(&a, &b, 16);
    let l1 = vm_lck_kib();
    // depth 16: 256 slots x 64 B = 16 KiB per QP ring, two QPs.
    assert!(
        l1 >= l0 + 32,
        "rings not in the DMA pool: VmLck {l0} -> {l1} KiB"
    );
    exercise(&a, &b, &qa, &qb);
    drop(qa);
    drop(qb);
    let l2 = vm_lck_kib();
    assert!(
        l2 + 32 <= l1,
        "rings not returned on QP destroy: VmLck {l1} -> {l2} KiB"
    );
    // Reusing the freed pool space works.
    let (qa, qb) = connect(&a, &b, 16);
    exercise(&a, &b, &qa, &qb);
    drop((qa, qb));

    // No pool on either side: heap rings, same behaviour.
    let nopool = || {
        side_on(
            rnic::HostConfig {
                dma_pool_size: 0,
                ..Default::default()
            },
            Config::default(),
        )
    };
    let c = nopool();
    let d = nopool();
    let (qc, qd) = connect(&c, &d, 16);
    exercise(&c, &d, &qc, &qd);
    // Mixed: a pool host talking to one without.
    let (qa, qc) = connect(&a, &c, 16);
    exercise(&a, &c, &qa, &qc);
    // Pool too small for the ring (4 KiB < 16 KiB): heap fallback.
    let tiny = side_on(
        rnic::HostConfig {
            dma_pool_size: 4096,
            ..Default::default()
        },
        Config::default(),
    );
    let (qt, qb2) = connect(&tiny, &b, 16);
    exercise(&tiny, &b, &qt, &qb2);
}
