//! Every operation × {no fault, local minor/major, remote minor/major}
//! between two software hosts in one process.

mod common;

use common::*;
use nprdma::{CompOp, Opcode, RecvWr, SendWr};

const LEN: usize = 64 * 1024;

#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    LocalMajor,
    RemoteMajor,
    RemoteMinor,
    LocalMinor,
}

const FAULTS: [Fault; 5] = [
    Fault::None,
    Fault::LocalMajor,
    Fault::RemoteMajor,
    Fault::RemoteMinor,
    Fault::LocalMinor,
];

fn env() -> Env {
    env_with_depth(64)
}

/// Fresh buffers for one case; "minor" = never touched (zero pages), so we
/// only write the side that must hold data.
fn bufs(e: &Env, f: Fault, seed: u64) -> (Buf, Buf, Vec<u8>, Vec<u8>) {
    bufs_of(e, f, seed, LEN)
}

/// [`bufs`] of `len` bytes each.
fn bufs_of(e: &Env, f: Fault, seed: u64, len: usize) -> (Buf, Buf, Vec<u8>, Vec<u8>) {
    let pa = pattern(seed, len);
    let pb = pattern(seed + 1, len);
    let la = Buf::with(
        &e.a,
        len,
        (!matches!(f, Fault::LocalMinor)).then_some(&pa[..]),
    );
    let rb = Buf::with(
        &e.b,
        len,
        (!matches!(f, Fault::RemoteMinor)).then_some(&pb[..]),
    );
    match f {
        Fault::LocalMajor => la.swap_out(),
        Fault::RemoteMajor => rb.swap_out(),
        _ => {}
    }
    let pa = if matches!(f, Fault::LocalMinor) {
        vec![0; len]
    } else {
        pa
    };
    let pb = if matches!(f, Fault::RemoteMinor) {
        vec![0; len]
    } else {
        pb
    };
    (la, rb, pa, pb)
}

fn post1(e: &Env, wr: SendWr) -> nprdma::Completion {
    e.qa.post_send(&[wr]).expect("post");
    wait1(&e.a.cq)
}

#[test]
fn read_write_all_faults_and_sizes() {
    let e = env();
    for (k, &f) in FAULTS.iter().enumerate() {
        for &(off, len) in &[
            (0usize, 2usize),
            (100, 64),
            (4000, 300),
            (0, 4096),
            (8, 20000),
            (0, LEN),
        ] {
            let (la, rb, pa, pb) = bufs(&e, f, k as u64 * 7 + len as u64);
            // READ remote [off, off+len) into local [off, ..).
            let c = post1(
                &e,
                SendWr::new(
                    1,
                    Opcode::Read,
                    Some(la.mr.sge(off as u64, len as u32)),
                    rb.addr() + off as u64,
                    rb.mr.rkey(),
                ),
            );
            assert_eq!(c.status, 0, "READ {f:?} len {len}");
            assert_eq!(c.op, CompOp::Read);
            assert_eq!(
                &la.bytes()[off..off + len],
                &pb[off..off + len],
                "READ data {f:?} {len}"
            );
            assert_eq!(&la.bytes()[..off], &pa[..off]);
            // WRITE local back to a different remote offset.
            let roff = LEN - len - off.min(LEN - len);
            let (la2, rb2, pa2, pb2) = bufs(&e, f, k as u64 * 11 + len as u64 + 1);
            let c = post1(
                &e,
                SendWr::new(
                    2,
                    Opcode::Write,
                    Some(la2.mr.sge(off as u64, len as u32)),
                    rb2.addr() + roff as u64,
                    rb2.mr.rkey(),
                ),
            );
            assert_eq!(c.status, 0, "WRITE {f:?} len {len}");
            let mut want = pb2.clone();
            want[roff..roff + len].copy_from_slice(&pa2[off..off + len]);
            assert!(rb2.bytes() == &want[..], "WRITE data {f:?} len {len}");
        }
    }
    let st = e.a.ctx.stats();
    assert!(st.optimistic_ok > 0 && st.two_sided > 0, "{st:?}");
    assert!(e.b.ctx.stats().served > 0);
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// READs of at least `PlanConfig::probe_min` (64 KiB; 4 MiB and more here), once a large READ of the
/// QP met a page out, start with a version probe: with every target page in
/// they go one-sided as usual (and stop probing); with a page
/// out (never touched, or swapped) they go two-sided without copying the
/// signature view first. Bytes exact either way, for unaligned ends too, and
/// for a local fault (the probe reads remote versions only); the large WRITEs
/// after them (not probed) too.
#[test]
fn large_reads_and_writes_probe_versions_first() {
    const BIG: usize = 6 << 20;
    let e = env();
    let mut remote_faults = 0;
    for (k, &f) in FAULTS.iter().enumerate() {
        for &(off, len) in &[
            (0usize, 64usize << 10),
            (3, (1 << 20) + 5),
            (0, 4 << 20),
            (100, (4 << 20) + 4096 + 7),
            (0, BIG),
        ] {
            let (la, rb, pa, pb) = bufs_of(&e, f, 40 + 2 * k as u64, BIG);
            let before = e.a.ctx.stats();
            let c = post1(&e, rd(1, &la, off as u64, &rb, off as u64, len as u32));
            assert_eq!(
                (c.status, c.byte_len as usize),
                (0, len),
                "READ {f:?} {len}"
            );
            assert!(
                la.bytes()[off..off + len] == pb[off..off + len],
                "READ data {f:?} {len}"
            );
            assert!(
                la.bytes()[..off] == pa[..off],
                "READ wrote before its range"
            );
            let after = e.a.ctx.stats();
            if matches!(f, Fault::RemoteMajor | Fault::RemoteMinor) {
                assert!(after.two_sided > before.two_sided, "{f:?} {len}: one-sided");
                remote_faults += 1;
            } else {
                assert_eq!(
                    after.probed_out, before.probed_out,
                    "{f:?} {len}: probed out"
                );
            }
            // WRITE it back over the remote range, then READ it back.
            let la2 = Buf::with(&e.a, BIG, Some(&pattern(60 + k as u64, BIG)));
            let src = pattern(60 + k as u64, BIG);
            let c = post1(&e, wr(2, &la2, off as u64, &rb, off as u64, len as u32));
            assert_eq!(c.status, 0, "WRITE {f:?} {len}");
            let mut want = pb.clone();
            want[off..off + len].copy_from_slice(&src[off..off + len]);
            assert!(rb.bytes() == &want[..], "WRITE data {f:?} {len}");
        }
    }
    // The first large READ that met a page out went optimistic (nothing on
    // the QP had faulted yet); every later one probed first.
    assert_eq!(e.a.ctx.stats().probed_out, remote_faults - 1);
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// A two-sided READ or WRITE longer than a piece (1 MiB) goes as a sequence
/// of fault requests: the target serves one per MiB, the bytes are exact
/// (unaligned ends, never-touched and swapped-out target pages), and the
/// operation completes once, with its whole length.
#[test]
fn long_two_sided_ops_go_in_pieces() {
    const BIG: usize = (5 << 20) + 4096;
    let (off, len) = (5usize, (5 << 20) + 3);
    let pieces = (len as u64).div_ceil(1 << 20);
    let e = env();
    for (k, &f) in [Fault::RemoteMinor, Fault::RemoteMajor].iter().enumerate() {
        let (la, rb, _pa, pb) = bufs_of(&e, f, 200 + 2 * k as u64, BIG);
        let served = e.b.ctx.stats().served;
        let c = post1(&e, rd(1, &la, off as u64, &rb, off as u64, len as u32));
        assert_eq!((c.status, c.byte_len as usize), (0, len), "READ {f:?}");
        assert!(
            la.bytes()[off..off + len] == pb[off..off + len],
            "READ data {f:?}"
        );
        assert_eq!(
            e.b.ctx.stats().served - served,
            pieces,
            "READ {f:?}: one request a piece"
        );
        // A WRITE into other pages of the same kind, then read back whole.
        let (_, rb2, _, mut want) = bufs_of(&e, f, 210 + 2 * k as u64, BIG);
        let src = pattern(220 + k as u64, BIG);
        let la2 = Buf::with(&e.a, BIG, Some(&src));
        let served = e.b.ctx.stats().served;
        let c = post1(&e, wr(2, &la2, off as u64, &rb2, off as u64, len as u32));
        assert_eq!((c.status, c.byte_len as usize), (0, len), "WRITE {f:?}");
        assert_eq!(
            e.b.ctx.stats().served - served,
            pieces,
            "WRITE {f:?}: one request a piece"
        );
        want[off..off + len].copy_from_slice(&src[off..off + len]);
        assert!(rb2.bytes() == &want[..], "WRITE data {f:?}");
    }
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

#[test]
fn atomics_all_faults() {
    let e = env();
    for (k, &f) in FAULTS.iter().enumerate() {
        let (la, mut rb, _pa, _pb) = bufs(&e, f, 100 + k as u64);
        if !matches!(f, Fault::RemoteMinor | Fault::RemoteMajor) {
            rb.bytes_mut()[8..16].copy_from_slice(&5u64.to_le_bytes());
        } else if matches!(f, Fault::RemoteMajor) {
            rb.bytes_mut()[8..16].copy_from_slice(&5u64.to_le_bytes());
            rb.swap_out();
        }
        let before = u64::from_le_bytes(rb.bytes()[8..16].try_into().unwrap());
        if matches!(f, Fault::RemoteMajor) {
            rb.swap_out();
        }
        let c = post1(
            &e,
            SendWr::new(
                3,
                Opcode::FetchAdd { add: 10 },
                Some(la.mr.sge(16, 8)),
                rb.addr() + 8,
                rb.mr.rkey(),
            ),
        );
        assert_eq!(c.status, 0, "{f:?}");
        assert_eq!(
            u64::from_le_bytes(la.bytes()[16..24].try_into().unwrap()),
            before
        );
        let c = post1(
            &e,
            SendWr::new(
                4,
                Opcode::CmpSwap {
                    compare: before + 10,
                    swap: 77,
                },
                Some(la.mr.sge(24, 8)),
                rb.addr() + 8,
                rb.mr.rkey(),
            ),
        );
        assert_eq!(c.status, 0);
        assert_eq!(c.op, CompOp::CmpSwap);
        assert_eq!(
            u64::from_le_bytes(la.bytes()[24..32].try_into().unwrap()),
            before + 10
        );
        assert_eq!(
            u64::from_le_bytes(rb.bytes()[8..16].try_into().unwrap()),
            77
        );
        // Misaligned atomic: an error completion, not a crash (on a QP of
        // its own: the error moves it to ERR).
        let (qx, _qy) = connect(&e.a, &e.b, 16);
        qx.post_send(&[SendWr::new(
            5,
            Opcode::FetchAdd { add: 1 },
            Some(la.mr.sge(0, 8)),
            rb.addr() + 3,
            rb.mr.rkey(),
        )])
        .unwrap();
        assert_ne!(wait1(&e.a.cq).status, 0);
        assert!(qx.is_error());
    }
}

#[test]
fn send_recv_inline_and_rendezvous_with_faults() {
    let e = env();
    for (k, &f) in FAULTS.iter().enumerate() {
        for &len in &[0usize, 1, 1000, 1024, 5000, LEN] {
            let (la, rb, pa, _pb) = bufs(&e, f, 200 + k as u64 * 13 + len as u64);
            e._qb
                .post_recv(&[RecvWr {
                    wr_id: 77,
                    sge: Some(rb.mr.sge(0, LEN as u32)),
                }])
                .expect("recv");
            let mut wr = SendWr::new(
                6,
                Opcode::SendImm(0xabc),
                Some(la.mr.sge(0, len as u32)),
                0,
                0,
            );
            if len % 2 == 0 {
                wr.op = Opcode::Send;
            }
            let c = post1(&e, wr);
            assert_eq!(c.status, 0, "SEND {f:?} {len}");
            let r = wait1(&e.b.rcq);
            assert_eq!(
                (r.wr_id, r.status, r.byte_len),
                (77, 0, len as u32),
                "RECV {f:?} {len}"
            );
            assert_eq!(r.imm, if len % 2 == 0 { None } else { Some(0xabc) });
            assert!(rb.bytes()[..len] == pa[..len], "SEND data {f:?} {len}");
        }
    }
}

#[test]
fn write_with_imm_consumes_a_recv() {
    let e = env();
    for (k, &f) in FAULTS.iter().enumerate() {
        let (la, rb, pa, _) = bufs(&e, f, 300 + k as u64);
        e._qb
            .post_recv(&[RecvWr {
                wr_id: 9,
                sge: None,
            }])
            .expect("recv");
        let c = post1(
            &e,
            SendWr::new(
                7,
                Opcode::WriteImm(42),
                Some(la.mr.sge(0, 9000)),
                rb.addr() + 4096,
                rb.mr.rkey(),
            ),
        );
        assert_eq!(c.status, 0, "{f:?}");
        let r = wait1(&e.b.rcq);
        assert_eq!(
            (r.wr_id, r.op, r.imm, r.byte_len),
            (9, CompOp::RecvWithImm, Some(42), 9000)
        );
        assert!(rb.bytes()[4096..4096 + 9000] == pa[..9000]);
    }
}

/// Protection domains hold one-sided too: through a QP of one PD of the
/// target, a peer's READ or WRITE with the rkey of an MR of another PD of
/// the same target process is refused (REM_ACCESS_ERR, what a NIC gives for
/// an rkey of another PD) and touches nothing, while through a QP of the
/// MR's own PD the same rkey works.
#[test]
fn an_rkey_of_another_pd_of_the_target_is_refused() {
    let e = env();
    let la = Buf::with(&e.a, 4096, Some(&pattern(3, 4096)));
    let pd2 = e.b.ctx.alloc_pd();
    let pb = pattern(4, 4096);
    let mut region = e.b.pager.alloc(4096).expect("alloc");
    region.as_mut_slice().copy_from_slice(&pb);
    let acc = nprdma::Access(
        nprdma::Access::LOCAL_WRITE.0
            | nprdma::Access::REMOTE_READ.0
            | nprdma::Access::REMOTE_WRITE.0,
    );
    // SAFETY: the region outlives the MR (both dropped at the end, MR first).
    let mr2 = unsafe { pd2.reg_mr(region.addr() as u64, 4096, acc) }.expect("mr in pd2");
    for op in [Opcode::Read, Opcode::Write] {
        // A QP of the target's first PD.
        let (qa, _qb) = connect(&e.a, &e.b, 16);
        let wr = SendWr::new(
            1,
            op,
            Some(la.mr.sge(0, 64)),
            region.addr() as u64,
            mr2.rkey(),
        );
        qa.post_send(&[wr]).expect("post");
        let c = wait1(&e.a.cq);
        assert_eq!(c.status, 10, "{op:?} through another PD's QP: {c:?}");
    }
    assert_eq!(region.as_slice(), &pb[..], "target bytes untouched");
    assert_eq!(
        la.bytes(),
        &pattern(3, 4096)[..],
        "nothing read into the source"
    );
    let qa = e.a.pd.create_qp(&e.a.cq, &e.a.rcq, 16).expect("qp a");
    let qb = pd2.create_qp(&e.b.cq, &e.b.rcq, 16).expect("qp b in pd2");
    qa.connect(&qb.endpoint()).expect("connect a");
    qb.connect(&qa.endpoint()).expect("connect b");
    let wr = SendWr::new(
        2,
        Opcode::Read,
        Some(la.mr.sge(0, 64)),
        region.addr() as u64,
        mr2.rkey(),
    );
    qa.post_send(&[wr]).expect("post");
    assert_eq!(wait1(&e.a.cq).status, 0);
    assert_eq!(&la.bytes()[..64], &pb[..64]);
    drop(mr2);
}

#[test]
fn bad_keys_and_bounds_are_error_completions() {
    let e = env();
    let (la, rb, _, _) = bufs(&e, Fault::None, 1);
    let mut bad_lkey = la.mr.sge(0, 8);
    bad_lkey.lkey ^= 0x5500;
    let cases = [
        // Unknown rkey.
        (
            SendWr::new(1, Opcode::Read, Some(la.mr.sge(0, 8)), rb.addr(), 0xdead00),
            10,
        ),
        // Out of bounds.
        (
            SendWr::new(
                2,
                Opcode::Write,
                Some(la.mr.sge(0, 64)),
                rb.addr() + LEN as u64 - 8,
                rb.mr.rkey(),
            ),
            10,
        ),
        // Bad lkey.
        (
            SendWr::new(3, Opcode::Read, Some(bad_lkey), rb.addr(), rb.mr.rkey()),
            4,
        ),
        // Atomic on a bad key is refused by the target CPU.
        (
            SendWr::new(
                4,
                Opcode::FetchAdd { add: 1 },
                Some(la.mr.sge(0, 8)),
                rb.addr(),
                rb.mr.rkey() ^ 0x100,
            ),
            10,
        ),
    ];
    let good = || {
        SendWr::new(
            5,
            Opcode::Read,
            Some(la.mr.sge(0, 8)),
            rb.addr(),
            rb.mr.rkey(),
        )
    };
    for (wr, status) in cases {
        // Each on a fresh QP: as on RC, the error moves the QP to ERR and the
        // WR behind it is flushed; a new QP works.
        let (qa, _qb) = connect(&e.a, &e.b, 16);
        qa.post_send(&[wr, good()]).unwrap();
        let c = e.a.cq.poll_wait(2, std::time::Duration::from_secs(10));
        assert_eq!((c[0].wr_id, c[0].status), (wr.wr_id, status), "{c:?}");
        assert_eq!((c[1].wr_id, c[1].status), (5, 5), "flushed behind: {c:?}");
        assert!(qa.is_error());
        let (qa, _qb) = connect(&e.a, &e.b, 16);
        qa.post_send(&[good()]).unwrap();
        assert_eq!(wait1(&e.a.cq).status, 0);
    }
}

#[test]
fn unsignaled_writes_defer_and_batch_their_readbacks() {
    let e = env();
    for remote_fault in [false, true] {
        let (la, rb, pa, pb) = bufs(&e, Fault::None, 400 + remote_fault as u64);
        if remote_fault {
            rb.swap_out();
        }
        let before = e.a.ctx.stats();
        // 8 contiguous unsignaled 256 B WRITEs, then one signaled WRITE.
        let mut wrs: Vec<SendWr> = (0..8u64)
            .map(|i| {
                let mut w = SendWr::new(
                    i,
                    Opcode::Write,
                    Some(la.mr.sge(i * 256, 256)),
                    rb.addr() + 8192 + i * 256,
                    rb.mr.rkey(),
                );
                w.signaled = false;
                w
            })
            .collect();
        wrs.push(SendWr::new(
            99,
            Opcode::Write,
            Some(la.mr.sge(4096, 64)),
            rb.addr() + 40000,
            rb.mr.rkey(),
        ));
        e.qa.post_send(&wrs).expect("post");
        let c = wait1(&e.a.cq);
        assert_eq!(
            (c.wr_id, c.status),
            (99, 0),
            "only the signaled WR completes"
        );
        assert_eq!(
            e.a.cq
                .poll_wait(1, std::time::Duration::from_millis(50))
                .len(),
            0
        );
        assert_eq!(
            e.qa.outstanding(),
            0,
            "deferred WRITEs were checked before it"
        );
        let mut want = pb.clone();
        want[8192..8192 + 2048].copy_from_slice(&pa[..2048]);
        want[40000..40064].copy_from_slice(&pa[4096..4160]);
        assert!(rb.bytes() == &want[..], "remote fault {remote_fault}");
        let after = e.a.ctx.stats();
        assert_eq!(after.deferred_writes - before.deferred_writes, 8);
        assert!(
            after.readback_batches - before.readback_batches <= 2,
            "{after:?}"
        );
        if remote_fault {
            assert!(after.two_sided > before.two_sided);
        }
    }
}

/// Inline two-sided READ/WRITE (≤ 1 KB) take no local pin: the CPU copies
/// the local buffer. Swapping the local buffer out while such an operation
/// is in flight must not change the result (the copy faults the page back
/// in through the pager) and the NIC must never touch a non-resident page.
#[test]
fn inline_two_sided_with_local_swap_out_in_flight() {
    let e = env();
    for i in 0..40u64 {
        let la = Buf::with(&e.a, 4 * 4096, Some(&pattern(i, 4 * 4096)));
        let pb = pattern(1000 + i, 4 * 4096);
        let rb = Buf::with(&e.b, 4 * 4096, Some(&pb));
        rb.swap_out();
        let (off, len) = (100 + (i as usize % 7) * 300, 64 + (i as usize % 5) * 200);
        let wr = if i % 2 == 0 {
            SendWr::new(
                i,
                Opcode::Read,
                Some(la.mr.sge(off as u64, len as u32)),
                rb.addr() + off as u64,
                rb.mr.rkey(),
            )
        } else {
            SendWr::new(
                i,
                Opcode::Write,
                Some(la.mr.sge(off as u64, len as u32)),
                rb.addr() + 8192 + off as u64,
                rb.mr.rkey(),
            )
        };
        e.qa.post_send(&[wr]).expect("post");
        la.swap_out();
        let c = wait1(&e.a.cq);
        assert_eq!(c.status, 0, "op {i}: {c:?}");
        if i % 2 == 0 {
            assert_eq!(&la.bytes()[off..off + len], &pb[off..off + len], "READ {i}");
        } else {
            let src = pattern(i, 4 * 4096);
            assert_eq!(
                &rb.bytes()[8192 + off..8192 + off + len],
                &src[off..off + len],
                "WRITE {i}"
            );
        }
    }
    assert!(e.a.ctx.stats().two_sided >= 40);
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// The two views behind the zero proof of a target page: the kernel's page
/// table (`adapt::unpopulated_pages`) and the pager's state
/// (`Pager::is_untouched`).
#[test]
fn zero_proof_views_of_pages() {
    use nprdma::adapt::unpopulated_pages;
    let s = side();
    let mut r = s.pager.alloc(4 * 4096).expect("alloc");
    let a = r.addr() as u64;
    let untouched = |k: u64| s.pager.is_untouched((a + k * 4096) as usize);
    assert_eq!(unpopulated_pages(a, 4), [true; 4]);
    assert!((0..4).all(untouched));
    r.as_mut_slice()[4096] = 1;
    std::hint::black_box(r.as_slice()[2 * 4096]);
    assert_eq!(unpopulated_pages(a, 4), [true, false, false, true]);
    assert_eq!(
        (0..4).map(untouched).collect::<Vec<_>>(),
        [true, false, false, true]
    );
    s.pager.swap_out(a as usize + 4096, 4096).expect("swap out");
    // Swapped by the pager: no pte, but not untouched (its data is in swap).
    assert_eq!(unpopulated_pages(a, 4), [true, true, false, true]);
    assert!(!untouched(1));
    // Across the scan's chunks (8192 pages per read).
    let mut big = s.pager.alloc(20_000 * 4096).expect("alloc");
    big.as_mut_slice()[8193 * 4096] = 1;
    let v = unpopulated_pages(big.addr() as u64, 20_000);
    assert_eq!(v.len(), 20_000);
    assert!(!v[8193] && v.iter().filter(|&&x| !x).count() == 1);
    // Memory the pager does not manage: populated, and never "untouched".
    let plain = vec![1u8; 3 * 4096];
    let p = (plain.as_ptr() as u64 + 4095) & !4095;
    assert_eq!(unpopulated_pages(p, 1), [false]);
    assert!(!s.pager.is_untouched(p as usize));
}

/// A remote inline READ of never-touched pages answers zeroes before the
/// target faults them in; they are mapped in afterwards, so the next READ
/// of the same page is one-sided.
#[test]
fn remote_read_of_untouched_pages_is_zero_and_maps_them_in() {
    let e = env();
    let la = Buf::with(&e.a, 4 * 4096, Some(&pattern(5, 4 * 4096)));
    let rb = Buf::new(&e.b, 4 * 4096);
    for (k, &(off, len)) in [(10usize, 2usize), (4090, 12), (8192, 1024)]
        .iter()
        .enumerate()
    {
        let served = e.b.ctx.stats().served;
        let c = post1(
            &e,
            rd(k as u64, &la, off as u64, &rb, off as u64, len as u32),
        );
        assert_eq!(c.status, 0);
        assert!(la.bytes()[off..off + len].iter().all(|&b| b == 0), "zeroes");
        assert_eq!(e.b.ctx.stats().served, served + 1, "two-sided");
        // The target pinned (zero-filled) and mapped the pages after
        // answering: the same READ now succeeds one-sided.
        let again = || {
            let wr = rd(9, &la, off as u64, &rb, off as u64, len as u32);
            post1(&e, wr).status == 0 && la.bytes()[off..off + len].iter().all(|&b| b == 0)
        };
        assert!(eventually_one_sided(&e, again), "one-sided now");
    }
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// A large remote READ of never-populated pages is answered from the
/// target's zero source: the data is zeroes, every size (several zero WRs,
/// partial SGEs, unaligned ends) lands exactly in its range, and nothing is
/// faulted in on the target (a read of untouched memory allocates no page,
/// as on Linux). A READ that also covers a populated page goes the ordinary
/// way and returns its bytes.
#[test]
fn large_remote_read_of_untouched_pages_is_answered_with_zeroes() {
    const BIG: usize = 20 << 20;
    let e = env();
    let la = Buf::with(&e.a, BIG, Some(&vec![0xaa; BIG]));
    let mut rb = Buf::new(&e.b, BIG);
    let mut off = 0usize;
    for (k, &len) in [4097usize, 65536, 512 * 1024 + 3, (8 << 20) + 100, 9 << 20]
        .iter()
        .enumerate()
    {
        let c = post1(
            &e,
            rd(k as u64, &la, off as u64, &rb, off as u64, len as u32),
        );
        assert_eq!((c.status, c.byte_len as usize), (0, len), "READ {len}");
        assert!(
            la.bytes()[off..off + len].iter().all(|&b| b == 0),
            "zeroes ({len})"
        );
        assert!(
            la.bytes()[off + len..off + len + 16]
                .iter()
                .all(|&b| b == 0xaa),
            "nothing past the end ({len})"
        );
        for p in (off..off + len).step_by(4096) {
            assert!(
                e.b.pager.is_untouched(rb.addr() as usize + p),
                "target page at {p} was faulted in"
            );
        }
        off += len.next_multiple_of(4096) + 4096;
    }
    // Populate one page: a READ across it is no longer all zeroes.
    let at = off + 4096;
    rb.bytes_mut()[at..at + 8].copy_from_slice(&[7; 8]);
    let len = 64 * 1024;
    let c = post1(&e, rd(50, &la, off as u64, &rb, off as u64, len as u32));
    assert_eq!(c.status, 0);
    let mut want = vec![0u8; len];
    want[4096..4104].copy_from_slice(&[7; 8]);
    assert!(
        la.bytes()[off..off + len] == want[..],
        "populated page read back"
    );
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// A remote inline READ of swapped-out pages is answered from the swap
/// slot, then the target swaps them in and maps them: the next READ of the
/// same page is one-sided and the data is intact.
#[test]
fn remote_read_of_swapped_pages_answers_from_swap_then_maps_them_in() {
    let e = env();
    let la = Buf::with(&e.a, 4 * 4096, Some(&pattern(6, 4 * 4096)));
    let pb = pattern(7, 4 * 4096);
    let rb = Buf::with(&e.b, 4 * 4096, Some(&pb));
    rb.swap_out();
    for (k, &(off, len)) in [
        (10usize, 2usize),
        (5000, 64),
        (8192, 1024),
        (3 * 4096 - 6, 12),
    ]
    .iter()
    .enumerate()
    {
        let served = e.b.ctx.stats().served;
        let c = post1(
            &e,
            rd(k as u64, &la, off as u64, &rb, off as u64, len as u32),
        );
        assert_eq!(c.status, 0);
        assert_eq!(&la.bytes()[off..off + len], &pb[off..off + len], "READ {k}");
        assert_eq!(e.b.ctx.stats().served, served + 1, "two-sided");
        let again = || {
            let wr = rd(9, &la, off as u64, &rb, off as u64, len as u32);
            post1(&e, wr).status == 0 && la.bytes()[off..off + len] == pb[off..off + len]
        };
        assert!(eventually_one_sided(&e, again), "one-sided now");
    }
    assert_eq!(rb.bytes(), &pb[..], "target memory intact");
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// A small WRITE into a never-touched or swapped-out remote page is
/// answered before the target fills the page (`vmem::Pager::
/// write_absent_then`): when it completes, the target's own CPU reads the
/// data (the rest of a swapped page as it was, of a new one zeroes), and
/// the page is mapped in for the next one-sided WRITE.
#[test]
fn remote_small_write_into_absent_pages_is_visible_when_it_completes() {
    let e = env();
    let src = pattern(10, 4 * 4096);
    let la = Buf::with(&e.a, 4 * 4096, Some(&src));
    let pb = pattern(11, 4 * 4096);
    let swapped = Buf::with(&e.b, 4 * 4096, Some(&pb));
    swapped.swap_out();
    let fresh = Buf::with(&e.b, 4 * 4096, None);
    for (rb, before) in [(&swapped, pb.clone()), (&fresh, vec![0u8; 4 * 4096])] {
        let mut want = before;
        for (k, &(off, len)) in [
            (10usize, 2usize),
            (5000, 64),
            (8192, 1024),
            (3 * 4096 + 7, 300),
        ]
        .iter()
        .enumerate()
        {
            let served = e.b.ctx.stats().served;
            let c = post1(
                &e,
                wr(k as u64, &la, off as u64, rb, off as u64, len as u32),
            );
            assert_eq!(c.status, 0);
            assert_eq!(e.b.ctx.stats().served, served + 1, "two-sided");
            want[off..off + len].copy_from_slice(&src[off..off + len]);
            // The target CPU, right after the completion: the page's fill
            // either happened or its fault waits for it.
            assert_eq!(
                &rb.bytes()[off - off % 4096..][..4096],
                &want[off - off % 4096..][..4096],
                "WRITE {k}"
            );
            let again =
                || post1(&e, wr(9, &la, off as u64, rb, off as u64, len as u32)).status == 0;
            assert!(eventually_one_sided(&e, again), "one-sided now");
        }
        assert_eq!(rb.bytes(), &want[..], "target memory");
    }
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// Lazy swap-in: the target's CPU brought the page back (resident, NIC
/// views still unmapped). An inline READ goes two-sided once, is answered
/// with the right bytes, and the page is mapped in for the next one.
#[test]
fn remote_read_of_lazily_swapped_in_page() {
    let e = env();
    let la = Buf::with(&e.a, 4096, Some(&pattern(8, 4096)));
    let pb = pattern(9, 4 * 4096);
    let rb = Buf::with(&e.b, 4 * 4096, Some(&pb));
    rb.swap_out();
    assert_eq!(std::hint::black_box(rb.bytes()[4096 + 7]), pb[4096 + 7]);
    assert!(e.b.pager.is_resident(rb.region.addr() + 4096));
    let served = e.b.ctx.stats().served;
    let wr = |id| {
        SendWr::new(
            id,
            Opcode::Read,
            Some(la.mr.sge(0, 300)),
            rb.addr() + 4096 + 500,
            rb.mr.rkey(),
        )
    };
    assert_eq!(post1(&e, wr(1)).status, 0);
    assert_eq!(&la.bytes()[..300], &pb[4096 + 500..4096 + 800]);
    assert_eq!(e.b.ctx.stats().served, served + 1);
    // The target maps the page in right after answering: READs turn
    // one-sided (bounded wait for the target thread to get there).
    assert!(
        eventually_one_sided(&e, || post1(&e, wr(2)).status == 0),
        "mapped in after the answer"
    );
    assert_eq!(&la.bytes()[..300], &pb[4096 + 500..4096 + 800]);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// Repeat `op` (which must succeed) until one run of it completed one-sided
/// (an optimistic success at the initiator); false after 5 s.
fn eventually_one_sided(e: &Env, op: impl Fn() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(5) {
        let ok = e.a.ctx.stats().optimistic_ok;
        assert!(op(), "operation failed");
        if e.a.ctx.stats().optimistic_ok > ok {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    false
}

/// The control channel on the data QP (`Config::ctrl_on_data_qp`, what the verbs
/// shim uses over a device that numbers its QPs) in kernel-module mode: the
/// endpoint names the data QP as the control QP, and READ/WRITE with every kind
/// of fault (the two-sided path's control messages and reverse operations share
/// the data QP) and SENDs (inline and rendezvous) move exact bytes.
#[test]
fn control_channel_on_the_data_qp() {
    let cfg = nprdma::Config {
        ctrl_on_data_qp: true,
        ..nprdma::Config::default()
    };
    let (a, b) = (side_with(cfg.clone()), side_with(cfg));
    let (qa, qb) = connect(&a, &b, 16);
    assert_eq!(qa.endpoint().ctrl_qpn, qa.qpn());
    let e = Env { a, b, qa, _qb: qb };
    for (k, &f) in FAULTS.iter().enumerate() {
        let (la, rb, _pa, pb) = bufs(&e, f, 900 + k as u64);
        let c = post1(&e, rd(1, &la, 8, &rb, 8, 20000));
        assert_eq!(c.status, 0, "READ {f:?}");
        assert_eq!(&la.bytes()[8..20008], &pb[8..20008], "READ data {f:?}");
        let (la, rb, pa, _pb) = bufs(&e, f, 950 + k as u64);
        let c = post1(&e, wr(2, &la, 0, &rb, 100, 30000));
        assert_eq!(c.status, 0, "WRITE {f:?}");
        assert_eq!(&rb.bytes()[100..30100], &pa[..30000], "WRITE data {f:?}");
        for len in [100usize, LEN] {
            let (la, rb, pa, _pb) = bufs(&e, f, 990 + k as u64 + len as u64);
            e._qb
                .post_recv(&[RecvWr {
                    wr_id: 7,
                    sge: Some(rb.mr.sge(0, LEN as u32)),
                }])
                .expect("recv");
            let c = post1(
                &e,
                SendWr::new(3, Opcode::Send, Some(la.mr.sge(0, len as u32)), 0, 0),
            );
            assert_eq!(c.status, 0, "SEND {f:?} {len}");
            let r = wait1(&e.b.rcq);
            assert_eq!((r.wr_id, r.status, r.byte_len), (7, 0, len as u32));
            assert!(rb.bytes()[..len] == pa[..len], "SEND data {f:?} {len}");
        }
    }
    assert!(e.a.ctx.stats().two_sided > 0);
    assert_eq!(e.a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
}

/// RC's receiver-not-ready rule: a SEND (inline or rendezvous) or a
/// WRITE_WITH_IMM that finds no RECV waits at the receiver for the sender's
/// `rnr_retry` × the receiver's `min_rnr_timer`: with 7 as long as it takes
/// (past the two-sided timeout), with 0 not at all (RNR_RETRY_EXC_ERR, the
/// sender's QP fails and what it sent behind is never delivered), and a RECV
/// posted inside the budget takes the message.
#[test]
fn a_message_without_a_recv_follows_the_rnr_policy() {
    let cfg = nprdma::Config {
        two_sided_timeout: std::time::Duration::from_millis(300),
        ..nprdma::Config::default()
    };
    let (a, b) = (side_with(cfg.clone()), side_with(cfg));
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, None);
    let recv = |qb: &nprdma::Qp, id: u64| {
        qb.post_recv(&[RecvWr {
            wr_id: id,
            sge: Some(rb.mr.sge(0, LEN as u32)),
        }])
        .expect("recv")
    };
    let empty = |cq: &nprdma::Cq, ms: u64| {
        let t = std::time::Instant::now();
        let mut c = [nprdma::Completion::default(); 1];
        while t.elapsed() < std::time::Duration::from_millis(ms) {
            assert_eq!(cq.poll(&mut c), 0, "unexpected completion {:?}", c[0]);
        }
    };
    // rnr_retry 7: held past the 300 ms two-sided timeout, then delivered.
    for (k, op, len) in [
        (0u64, Opcode::Send, 100u32),
        (1, Opcode::SendImm(5), 20000),
        (2, Opcode::WriteImm(6), 3000),
    ] {
        let (qa, qb) = connect(&a, &b, 16);
        qa.set_rnr(Some(7), None).unwrap();
        let raddr = if matches!(op, Opcode::WriteImm(_)) {
            rb.addr()
        } else {
            0
        };
        qa.post_send(&[SendWr::new(
            k,
            op,
            Some(la.mr.sge(0, len)),
            raddr,
            rb.mr.rkey(),
        )])
        .unwrap();
        empty(&a.cq, 800);
        recv(&qb, 100 + k);
        let c = wait1(&a.cq);
        assert_eq!((c.wr_id, c.status), (k, 0), "{op:?}");
        let r = wait1(&b.rcq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (100 + k, 0, len), "{op:?}");
    }
    // rnr_retry 0: at once; the SEND behind it is flushed and never lands.
    let (qa, qb) = connect(&a, &b, 16);
    qa.set_rnr(Some(0), None).unwrap();
    let t = std::time::Instant::now();
    qa.post_send(&[
        SendWr::new(10, Opcode::Send, Some(la.mr.sge(0, 64)), 0, 0),
        SendWr::new(11, Opcode::Send, Some(la.mr.sge(0, 64)), 0, 0),
    ])
    .unwrap();
    let c = wait1(&a.cq);
    assert_eq!((c.wr_id, c.status), (10, 13)); // RNR_RETRY_EXC_ERR
    assert!(
        t.elapsed() < std::time::Duration::from_secs(1),
        "not at once"
    );
    assert_eq!(wait1(&a.cq).status, 5); // WR_FLUSH_ERR
    assert!(qa.is_error());
    recv(&qb, 110);
    empty(&b.rcq, 100);
    // rnr_retry 2 × 655.36 ms (code 0): a RECV posted 100 ms late takes it;
    // rnr_retry 1 × 0.64 ms (code 12) runs out (at the receiver's next sweep).
    let (qa, qb) = connect(&a, &b, 16);
    qa.set_rnr(Some(2), None).unwrap();
    qb.set_rnr(None, Some(0)).unwrap();
    qa.post_send(&[SendWr::new(20, Opcode::Send, Some(la.mr.sge(0, 64)), 0, 0)])
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    recv(&qb, 120);
    assert_eq!(wait1(&a.cq).status, 0);
    assert_eq!(wait1(&b.rcq).wr_id, 120);
    let (qa, qb) = connect(&a, &b, 16);
    qa.set_rnr(Some(1), None).unwrap();
    let t = std::time::Instant::now();
    qa.post_send(&[SendWr::new(21, Opcode::Send, Some(la.mr.sge(0, 64)), 0, 0)])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, 13);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(1),
        "not the timeout"
    );
    recv(&qb, 121);
    empty(&b.rcq, 50);
}

/// `Mr::rereg` in place (ibv_rereg_mr without a new translation): the keys
/// stay; new rights and a new PD hold at once, one-sided (the target's NIC)
/// and two-sided (its CPU, a page swapped out) alike.
#[test]
fn rereg_changes_rights_and_pd_in_place() {
    let e = env();
    let la = Buf::with(&e.a, 8192, Some(&pattern(5, 8192)));
    let rb = Buf::with(&e.b, 8192, Some(&pattern(6, 8192)));
    let key = rb.mr.rkey();
    let write = |qp: &nprdma::Qp, id: u64| {
        qp.post_send(&[SendWr::new(
            id,
            Opcode::Write,
            Some(la.mr.sge(0, 64)),
            rb.addr(),
            key,
        )])
        .unwrap();
        wait1(&e.a.cq)
    };
    let (q1, _q1b) = connect(&e.a, &e.b, 16);
    assert_eq!(write(&q1, 1).status, 0);
    // No REMOTE_WRITE any more: refused, resident page or swapped out.
    rb.mr
        .rereg(
            None,
            Some(nprdma::Access(
                nprdma::Access::LOCAL_WRITE.0 | nprdma::Access::REMOTE_READ.0,
            )),
        )
        .unwrap();
    assert_eq!(rb.mr.rkey(), key);
    assert_eq!(
        write(&q1, 2).status,
        10,
        "one-sided WRITE after the rights went"
    );
    for swapped in [false, true] {
        let (q, _qb) = connect(&e.a, &e.b, 16);
        if swapped {
            rb.swap_out();
        }
        assert_eq!(write(&q, 3).status, 10, "WRITE, swapped out {swapped}");
    }
    // Rights back, then the MR moves to another PD: a QP of the old PD is
    // refused, one of the new PD reaches it.
    let all = nprdma::Access(
        nprdma::Access::LOCAL_WRITE.0
            | nprdma::Access::REMOTE_READ.0
            | nprdma::Access::REMOTE_WRITE.0,
    );
    rb.mr.rereg(None, Some(all)).unwrap();
    let (q, _qb) = connect(&e.a, &e.b, 16);
    assert_eq!(write(&q, 4).status, 0);
    let pd2 = e.b.ctx.alloc_pd();
    rb.mr.rereg(Some(pd2.id()), None).unwrap();
    let (q, _qb) = connect(&e.a, &e.b, 16);
    assert_eq!(write(&q, 5).status, 10, "a QP of the old PD");
    let qa = e.a.pd.create_qp(&e.a.cq, &e.a.rcq, 16).unwrap();
    let qb = pd2.create_qp(&e.b.cq, &e.b.rcq, 16).unwrap();
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    assert_eq!(write(&qa, 6).status, 0, "a QP of the new PD");
    rb.swap_out();
    assert_eq!(write(&qa, 7).status, 0, "two-sided, new PD");
    assert_eq!(&rb.bytes()[..64], &pattern(5, 8192)[..64]);
}
