//! Key synchronisation on first use, MR deregistration, and teardown with
//! operations in flight (flush completions, no leaked pins, peer timeout).

mod common;

use std::time::{Duration, Instant};

use common::*;
use nprdma::{Config, Opcode, SendWr};

const LEN: usize = 256 * 1024;

#[test]
fn first_use_key_query_then_new_mr_push() {
    let a = side();
    let b = side();
    // MRs exist before the QPs: the peer learns them by a KeyQuery.
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    let (qa, _qb) = connect(&a, &b, 16);
    qa.post_send(&[SendWr::new(
        1,
        Opcode::Read,
        Some(la.mr.sge(0, 4096)),
        rb.addr(),
        rb.mr.rkey(),
    )])
    .unwrap();
    let c = wait1(&a.cq);
    assert_eq!(c.status, 0);
    assert_eq!(&la.bytes()[..4096], &pattern(2, LEN)[..4096]);
    assert_eq!(a.ctx.stats().key_queries, 1);
    // A new MR after the QP is up is pushed to the peer (no extra query),
    // or found by a single-key query if the push is not there yet.
    let rb2 = Buf::with(&b, LEN, Some(&pattern(3, LEN)));
    qa.post_send(&[SendWr::new(
        2,
        Opcode::Read,
        Some(la.mr.sge(0, 64)),
        rb2.addr() + 64,
        rb2.mr.rkey(),
    )])
    .unwrap();
    assert_eq!(wait1(&a.cq).status, 0);
    assert_eq!(&la.bytes()[..64], &pattern(3, LEN)[64..128]);
    // A deregistered MR is revoked at the peer: later use is REM_ACCESS_ERR.
    let key = rb2.mr.rkey();
    let addr = rb2.addr();
    drop(rb2);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(100) {
        a.ctx.progress();
    }
    qa.post_send(&[SendWr::new(
        3,
        Opcode::Read,
        Some(la.mr.sge(0, 64)),
        addr,
        key,
    )])
    .unwrap();
    assert_eq!(wait1(&a.cq).status, 10);
    // As on RC, the error moved the QP to ERR: later WRs are flushed; a new
    // QP works.
    assert!(qa.is_error());
    let w = |id| {
        SendWr::new(
            id,
            Opcode::Write,
            Some(la.mr.sge(0, 64)),
            rb.addr(),
            rb.mr.rkey(),
        )
    };
    qa.post_send(&[w(4)]).unwrap();
    assert_eq!(wait1(&a.cq).status, 5);
    let (qa, _qb) = connect(&a, &b, 16);
    qa.post_send(&[w(5)]).unwrap();
    assert_eq!(wait1(&a.cq).status, 0);
}

fn all_swappable(p: &vmem::Pager, addr: u64, len: usize) {
    p.swap_out(addr as usize, len).unwrap();
    assert_eq!(
        p.resident_count(addr as usize, len).unwrap(),
        0,
        "a page stayed pinned"
    );
}

#[test]
fn destroy_initiator_qp_with_ops_in_flight() {
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    let (qa, qb) = connect(&a, &b, 64);
    // Remote pages absent: everything goes two-sided.
    rb.swap_out();
    la.swap_out();
    let mut wrs = Vec::new();
    for i in 0..48u64 {
        let off = (i as usize * 4096) % (LEN - 8192);
        let op = match i % 4 {
            0 => Opcode::Read,
            1 => Opcode::Write,
            2 => Opcode::FetchAdd { add: 1 },
            _ => Opcode::Send,
        };
        let len = if matches!(op, Opcode::FetchAdd { .. }) {
            8
        } else {
            1 + (i as u32 * 977) % 8192
        };
        let off = if len == 8 { off & !7 } else { off };
        wrs.push(SendWr::new(
            i,
            op,
            Some(la.mr.sge(off as u64, len)),
            rb.addr() + off as u64,
            rb.mr.rkey(),
        ));
    }
    qa.post_send(&wrs).unwrap();
    drop(qa);
    // Exactly one completion per WR, success or flush, in post order.
    let cs = a.cq.poll_wait(48, Duration::from_secs(10));
    assert_eq!(cs.len(), 48);
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(c.wr_id, i as u64);
        assert!(c.status == 0 || c.status == 5, "{c:?}");
    }
    assert!(cs.iter().any(|c| c.status == 5), "nothing was in flight");
    assert_eq!(a.cq.poll_wait(1, Duration::from_millis(100)).len(), 0);
    // The target drops what it held (reverse ops fail, requests time out).
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        b.ctx.progress();
    }
    all_swappable(&a.pager, la.addr(), LEN);
    all_swappable(&b.pager, rb.addr(), LEN);
    drop(qb);
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}

#[test]
fn peer_destroyed_two_sided_request_times_out() {
    let cfg = Config {
        two_sided_timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let a = side_with(cfg);
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let (qa, qb) = connect(&a, &b, 8);
    // A SEND without a posted RECV waits at the peer; the peer then goes away.
    qa.post_send(&[SendWr::new(9, Opcode::Send, Some(la.mr.sge(0, 100)), 0, 0)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(qb);
    let c = wait1(&a.cq);
    assert_eq!((c.wr_id, c.status), (9, 12));
    all_swappable(&a.pager, la.addr(), LEN);
}

/// Deregistration fences: with READs in flight into an MR (swapped-out
/// remote memory: they run the two-sided path, the target swaps in and
/// writes back), `Mr` drop returns, the application reuses the memory, and
/// nothing lands there any more. Every WR still completes exactly once —
/// successfully if it finished before the fence, with an error otherwise.
#[test]
fn dereg_fences_reads_in_flight() {
    dereg_fences_reads_in_flight_with(Config::default());
}

/// The same with each READ's two-sided form in 4 KiB pieces
/// (`Config::two_sided_piece`): no piece is sent after the fence, none lands.
#[test]
fn dereg_fences_reads_in_flight_in_pieces() {
    dereg_fences_reads_in_flight_with(Config {
        two_sided_piece: 4096,
        ..Config::default()
    });
}

fn dereg_fences_reads_in_flight_with(cfg: Config) {
    const N: u64 = 32;
    const ONE: u64 = 64 * 1024;
    for round in 0..3 {
        let a = side_with(cfg.clone());
        let b = side();
        let total = (N * ONE) as usize;
        let la = Buf::with(&a, total, Some(&pattern(1, total)));
        let rb = Buf::with(&b, total, Some(&pattern(2, total)));
        let (qa, _qb) = connect(&a, &b, 64);
        // Key sync first, so the READs below are in flight at once.
        qa.post_send(&[SendWr::new(
            99,
            Opcode::Read,
            Some(la.mr.sge(0, 8)),
            rb.addr(),
            rb.mr.rkey(),
        )])
        .unwrap();
        assert_eq!(wait1(&a.cq).status, 0);
        rb.swap_out();
        let wrs: Vec<SendWr> = (0..N)
            .map(|i| {
                SendWr::new(
                    i,
                    Opcode::Read,
                    Some(la.mr.sge(i * ONE, ONE as u32)),
                    rb.addr() + i * ONE,
                    rb.mr.rkey(),
                )
            })
            .collect();
        qa.post_send(&wrs).unwrap();
        if round > 0 {
            std::thread::sleep(Duration::from_micros(200 * round));
        }
        let Buf { mr, mut region } = la;
        drop(mr);
        // The memory is the application's again.
        region.as_mut_slice()[..total].fill(0x5a);
        let cs = a.cq.poll_wait(N as usize, Duration::from_secs(10));
        assert_eq!(cs.len(), N as usize, "round {round}: one completion per WR");
        let mut ids: Vec<u64> = cs.iter().map(|c| c.wr_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..N).collect::<Vec<_>>());
        std::thread::sleep(Duration::from_millis(50));
        let mut more = [nprdma::Completion::default(); 4];
        assert_eq!(a.cq.poll(&mut more), 0, "extra completion {:?}", more[0]);
        if let Some((lo, hi)) = first_difference(&region.as_slice()[..total], &vec![0x5a; total]) {
            panic!("round {round}: bytes {lo}..={hi} were written after dereg returned");
        }
        assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
        assert_eq!(b.ctx.nic_stats().nonresident_dma, 0);
        drop(region);
    }
}

/// Registered memory the application unmaps, with new memory mapped at the
/// same address afterwards: a peer's WRITE / READ with the old rkey fails,
/// and the new memory is neither written nor read (on hardware the MR's
/// own pages would absorb it; never the new mapping).
#[test]
fn unmapped_registered_memory_is_not_reached_through_the_old_mr() {
    const LEN: usize = 64 * 1024;
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let map = |at: *mut libc::c_void, flags: i32| {
        // SAFETY: anonymous private mapping; at a fixed address only over
        // this test's own mapping `old` (MAP_FIXED replaces it, nothing else).
        #[allow(unsafe_code)]
        let p = unsafe {
            libc::mmap(
                at,
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as *mut u8
    };
    let old = map(std::ptr::null_mut(), 0);
    // SAFETY: `old` is a fresh LEN-byte writable mapping.
    #[allow(unsafe_code)]
    unsafe {
        std::ptr::write_bytes(old, 0x5a, LEN)
    };
    let acc =
        nprdma::Access::LOCAL_WRITE | nprdma::Access::REMOTE_READ | nprdma::Access::REMOTE_WRITE;
    // SAFETY: private anonymous memory; the test unmaps it on purpose while
    // registered (the behaviour under test) and never touches it through
    // the MR itself afterwards.
    #[allow(unsafe_code)]
    let mr = unsafe { b.pd.reg_mr(old as u64, LEN as u64, acc) }.unwrap();
    let (qa, _qb) = connect(&a, &b, 16);
    let c = {
        qa.post_send(&[SendWr::new(
            1,
            Opcode::Read,
            Some(la.mr.sge(0, 64)),
            old as u64,
            mr.rkey(),
        )])
        .unwrap();
        wait1(&a.cq)
    };
    assert_eq!(c.status, 0);
    assert!(la.bytes()[..64].iter().all(|&x| x == 0x5a));
    // Unmap it and map other memory at the same address, in one step
    // (`MAP_FIXED` over it: the kernel unmaps the old pages, as munmap does,
    // and reports it to the pager the same way; two steps would let a
    // concurrent test's mapping take the address in between).
    let new = map(old as *mut libc::c_void, libc::MAP_FIXED);
    assert_eq!(new, old, "the address was reused");
    // SAFETY: `new` is a fresh LEN-byte writable mapping.
    #[allow(unsafe_code)]
    let fresh = unsafe { std::slice::from_raw_parts_mut(new, LEN) };
    fresh.fill(0x11);
    // The pager handles the unmap event on its fault thread.
    std::thread::sleep(Duration::from_millis(20));
    for (k, (op, off)) in [
        (Opcode::Write, 0u64),
        (Opcode::Read, 4096),
        (Opcode::Write, 8192 + 100),
    ]
    .into_iter()
    .enumerate()
    {
        let c = {
            qa.post_send(&[SendWr::new(
                10 + k as u64,
                op,
                Some(la.mr.sge(0, 64)),
                old as u64 + off,
                mr.rkey(),
            )])
            .unwrap();
            wait1(&a.cq)
        };
        assert_ne!(c.status, 0, "{op:?} through the old MR succeeded");
        if op == Opcode::Read {
            assert!(
                !la.bytes()[..64].contains(&0x11),
                "READ returned the new memory"
            );
        }
        if c.status != 5 {
            // The QP is in error now: the rest would only be flushed.
            break;
        }
    }
    assert!(
        fresh.iter().all(|&x| x == 0x11),
        "the new memory was written"
    );
    drop(mr);
    // SAFETY: unmapping our own mapping (nothing refers to it any more).
    #[allow(unsafe_code)]
    unsafe {
        libc::munmap(new as *mut libc::c_void, LEN)
    };
    assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(b.ctx.nic_stats().nonresident_dma, 0);
}

#[test]
fn completion_channel_wakes_a_blocked_application() {
    let cfg = Config {
        interrupt_mode: true,
        ..Config::default()
    };
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    let (qa, _qb) = connect(&a, &b, 8);
    rb.swap_out(); // two-sided: the peer's polling thread must wake up
    for i in 0..3u64 {
        a.cq.req_notify();
        qa.post_send(&[SendWr::new(
            i,
            Opcode::Read,
            Some(la.mr.sge(0, 5000)),
            rb.addr(),
            rb.mr.rkey(),
        )])
        .unwrap();
        // Block (no polling) until the polling thread delivers the completion.
        assert!(
            a.cq.wait_event(Duration::from_secs(10)),
            "no completion event"
        );
        let mut c = [nprdma::Completion::default(); 2];
        let n = a.cq.poll(&mut c);
        assert_eq!(n, 1);
        assert_eq!((c[0].wr_id, c[0].status), (i, 0));
    }
    assert_eq!(&la.bytes()[..5000], &pattern(2, LEN)[..5000]);
}

/// One-sided operations of 1–3 NIC WRs (only the last one signaled on the
/// NIC) against a destroyed peer QP: a NIC error on any WR still yields
/// exactly one completion per application WR, in post order.
#[test]
fn multi_wr_ops_complete_once_on_nic_error() {
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    let (qa, qb) = connect(&a, &b, 16);
    // Key sync and a working path first.
    qa.post_send(&[SendWr::new(
        100,
        Opcode::Read,
        Some(la.mr.sge(0, 64)),
        rb.addr(),
        rb.mr.rkey(),
    )])
    .unwrap();
    assert_eq!(wait1(&a.cq).status, 0);
    drop(qb);
    // WRITE+read-back (2 WRs), versioned WRITE (3), READ (1).
    let wrs: Vec<SendWr> = [
        (Opcode::Write, 100u32),
        (Opcode::Write, 32768),
        (Opcode::Read, 64),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(op, len))| {
        SendWr::new(
            i as u64,
            op,
            Some(la.mr.sge(0, len)),
            rb.addr(),
            rb.mr.rkey(),
        )
    })
    .collect();
    qa.post_send(&wrs).unwrap();
    let cs = a.cq.poll_wait(3, Duration::from_secs(10));
    assert_eq!(cs.len(), 3, "{cs:?}");
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(c.wr_id, i as u64);
        assert_ne!(c.status, 0, "{c:?}");
    }
    assert_eq!(a.cq.poll_wait(1, Duration::from_millis(200)).len(), 0);
}

#[test]
fn oversized_readback_threshold_is_an_error_not_a_panic() {
    let mut cfg = Config::default();
    cfg.plan.write_version_threshold = u64::MAX;
    let a = side_with(cfg);
    let err =
        a.pd.create_qp(&a.cq, &a.rcq, 16)
            .err()
            .expect("a QP whose read-back scratch cannot be sized is refused");
    assert!(err.to_string().contains("scratch"), "{err}");
}

#[test]
fn set_error_flushes_parked_two_sided_and_recvs_once() {
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    let (qa, qb) = connect(&a, &b, 64);
    la.swap_out();
    // RECVs posted on the QP that goes to ERR.
    let recvs: Vec<nprdma::RecvWr> = (0..8u64)
        .map(|i| nprdma::RecvWr {
            wr_id: 1000 + i,
            sge: Some(la.mr.sge(LEN as u64 - 8192 + i * 512, 512)),
        })
        .collect();
    qa.post_recv(&recvs).unwrap();
    // A SEND the peer cannot take (no RECV posted there) waits two-sided;
    // `order_after` parks everything behind it in the ordering table.
    let mut first = SendWr::new(0, Opcode::Send, Some(la.mr.sge(0, 100)), 0, 0);
    first.order_after = true;
    let mut wrs = vec![first];
    for i in 1..24u64 {
        let off = i * 4096;
        let op = match i % 3 {
            0 => Opcode::Read,
            1 => Opcode::Write,
            _ => Opcode::FetchAdd { add: 1 },
        };
        let len = if i % 3 == 2 { 8 } else { 100 + i as u32 };
        wrs.push(SendWr::new(
            i,
            op,
            Some(la.mr.sge(off, len)),
            rb.addr() + off,
            rb.mr.rkey(),
        ));
    }
    qa.post_send(&wrs).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(qa.outstanding(), 24, "something completed early");
    assert!(!qa.is_error());
    qa.set_error().unwrap();
    assert!(qa.is_error());
    qa.set_error().unwrap(); // idempotent: nothing completes twice
    let cs = a.cq.poll_wait(24, Duration::from_secs(5));
    assert_eq!(cs.len(), 24);
    for (i, c) in cs.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, 5), "{c:?}");
    }
    let rs = a.rcq.poll_wait(8, Duration::from_secs(5));
    assert_eq!(rs.len(), 8);
    for (i, c) in rs.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (1000 + i as u64, 5), "{c:?}");
    }
    assert_eq!(qa.outstanding(), 0);
    // Posting to a QP in ERR is accepted and flushed (rdma-core semantics).
    qa.post_send(&[SendWr::new(
        77,
        Opcode::Write,
        Some(la.mr.sge(0, 64)),
        rb.addr(),
        rb.mr.rkey(),
    )])
    .unwrap();
    qa.post_recv(&[nprdma::RecvWr {
        wr_id: 78,
        sge: Some(la.mr.sge(0, 64)),
    }])
    .unwrap();
    let c = wait1(&a.cq);
    assert_eq!((c.wr_id, c.status), (77, 5));
    let c = wait1(&a.rcq);
    assert_eq!((c.wr_id, c.status), (78, 5));
    // Nothing else completes.
    assert_eq!(a.cq.poll_wait(1, Duration::from_millis(100)).len(), 0);
    assert_eq!(a.rcq.poll_wait(1, Duration::from_millis(10)).len(), 0);
    // The peer does not crash: its request to the ERR QP fails cleanly,
    // either refused at post (its QP saw the failure and went to error)
    // or completed with an error status.
    let mut lb = Buf::with(&b, LEN, None);
    lb.bytes_mut()[0] = 1;
    let posted = qb.post_send(&[SendWr::new(
        5,
        Opcode::Read,
        Some(lb.mr.sge(0, 4096)),
        la.addr(),
        la.mr.rkey(),
    )]);
    match posted {
        Err((0, nprdma::Error::QpState)) => {}
        Err(e) => panic!("unexpected post error {e:?}"),
        Ok(()) => {
            let cs = b.cq.poll_wait(1, Duration::from_secs(10));
            assert_eq!(cs.len(), 1, "the peer's request never completed");
            assert_eq!(cs[0].wr_id, 5);
            assert_ne!(cs[0].status, 0, "{:?}", cs[0]);
        }
    }
    // No pin is left behind on either side.
    all_swappable(&a.pager, la.addr(), LEN);
    all_swappable(&b.pager, rb.addr(), LEN);
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}

#[test]
fn set_error_flushes_key_wait_deferred_and_two_sided_ops_once() {
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
    // A fresh QP pair: the first ops wait for the peer's keys.
    let (qa, qb) = connect(&a, &b, 64);
    // Half of the remote pages absent: those ops go two-sided.
    b.pager.swap_out(rb.addr() as usize, LEN / 2).unwrap();
    let mut wrs = Vec::new();
    let mut unsignaled = Vec::new();
    for i in 0..40u64 {
        let off = ((i * 6151) % (LEN as u64 - 8192)) & !7;
        let (op, len, signaled) = match i % 4 {
            // Small unsignaled WRITEs: their read-back is deferred.
            0 | 1 => (Opcode::Write, 64 + i as u32, false),
            2 => (Opcode::Read, 3000 + i as u32, true),
            _ => (Opcode::Write, 5000 + i as u32, true),
        };
        let mut w = SendWr::new(
            i,
            op,
            Some(la.mr.sge(off, len)),
            rb.addr() + off,
            rb.mr.rkey(),
        );
        w.signaled = signaled;
        if !signaled {
            unsignaled.push(i);
        }
        wrs.push(w);
    }
    qa.post_send(&wrs).unwrap();
    qa.set_error().unwrap();
    let cs = a.cq.poll_wait(40, Duration::from_millis(500));
    let mut seen = std::collections::HashSet::new();
    let mut last = None;
    for c in &cs {
        assert!(seen.insert(c.wr_id), "two completions for {}", c.wr_id);
        assert!(last.is_none_or(|l| c.wr_id > l), "out of order: {cs:?}");
        last = Some(c.wr_id);
        if unsignaled.contains(&c.wr_id) {
            assert_eq!(c.status, 5, "{c:?}");
        } else {
            assert!(c.status == 0 || c.status == 5, "{c:?}");
        }
    }
    // Every signaled WR completed; unsignaled ones only when flushed.
    for i in 0..40u64 {
        if !unsignaled.contains(&i) {
            assert!(seen.contains(&i), "WR {i} never completed");
        }
    }
    assert!(cs.iter().any(|c| c.status == 5), "nothing was in flight");
    assert_eq!(qa.outstanding(), 0);
    // Let the peer see the failures, then nothing stays pinned.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        b.ctx.progress();
    }
    all_swappable(&a.pager, la.addr(), LEN);
    all_swappable(&b.pager, rb.addr(), LEN);
    drop(qa);
    drop(qb);
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}

/// `Qp::reset` (ibv_modify_qp to RESET): what was outstanding is removed
/// without a completion (as on verbs hardware), the QP keeps its number and
/// connects again — to the same peer QP, reset too — and moves exact bytes,
/// faults included.
#[test]
fn a_reset_qp_keeps_its_number_and_connects_again() {
    let a = side();
    let b = side();
    let la = Buf::with(&a, LEN, Some(&pattern(3, LEN)));
    let rb = Buf::with(&b, LEN, Some(&pattern(4, LEN)));
    let (qa, qb) = connect(&a, &b, 8);
    let (na, nb) = (qa.qpn(), qb.qpn());
    let read = |id: u64, len: u32| {
        let wr = SendWr::new(
            id,
            Opcode::Read,
            Some(la.mr.sge(0, len)),
            rb.addr(),
            rb.mr.rkey(),
        );
        qa.post_send(&[wr]).unwrap();
        wait1(&a.cq).status
    };
    assert_eq!(read(1, 64), 0);
    // A RECV outstanding at b when it is reset (from RTS); a reset from ERR.
    qb.post_recv(&[nprdma::RecvWr {
        wr_id: 2,
        sge: Some(rb.mr.sge(0, 64)),
    }])
    .unwrap();
    qa.set_error().unwrap();
    qa.reset().unwrap();
    qb.reset().unwrap();
    // Removed without a completion (IB), and a's flushes are cleaned out of
    // its CQ with it (as mlx5 does).
    let mut c = [nprdma::Completion::default(); 4];
    assert_eq!(b.rcq.poll(&mut c), 0, "b's RECV completed: {:?}", c[0]);
    assert_eq!((qa.qpn(), qb.qpn()), (na, nb));
    assert!(!qa.is_error());
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    // Traffic again, the remote side swapped out (two-sided path) too.
    rb.swap_out();
    assert_eq!(read(3, 5000), 0);
    assert_eq!(&la.bytes()[..5000], &pattern(4, LEN)[..5000]);
    qb.post_recv(&[nprdma::RecvWr {
        wr_id: 4,
        sge: Some(rb.mr.sge(8192, 2000)),
    }])
    .unwrap();
    qa.post_send(&[SendWr::new(5, Opcode::Send, Some(la.mr.sge(0, 1500)), 0, 0)])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, 0);
    let c = wait1(&b.rcq);
    assert_eq!((c.wr_id, c.status, c.byte_len), (4, 0, 1500));
    assert_eq!(&rb.bytes()[8192..8192 + 1500], &pattern(4, LEN)[..1500]);
}
