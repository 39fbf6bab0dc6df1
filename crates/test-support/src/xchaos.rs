//! The chaos test across processes, over any backend: the target is a child
//! process (the test binary re-executed), so the control channel, and on the
//! software RNIC small one-sided ops and atomics, cross processes. The parent
//! posts random READ / WRITE / ATOMIC / SEND of random sizes and offsets;
//! evictors on both sides swap random pages out; both MRs hold magic words on
//! purpose. Checked: the parent's buffer against its model after every drain
//! (every 200 ops), one completion per signaled WR in post order, and at the end
//! — from the child — a hash of its memory against the model's, the received
//! SEND payloads (count and a hash over them in order), zero NIC accesses to
//! non-resident pages and no page left pinned on either side.

use std::collections::VecDeque;
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nprdma::engine::Backend;
use nprdma::{Endpoint, RecvWr, Stats};

use crate::chaos::chaos_layout::*;
use crate::chaos::{evictor, first_difference, ChaosModel, ChaosOp, Rng, Side};
use crate::child::{ep_of, ep_word, say, ChildProc};
use crate::{pattern, Buf};

/// FNV-1a, 64 bit.
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}
const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

/// Initial content of a side's MR: a pattern with magic words at random
/// 4-aligned offsets (both processes compute the same).
fn initial(seed: u64) -> Vec<u8> {
    let mut v = pattern(seed, MR);
    let mut r = Rng(seed.wrapping_mul(77) | 1);
    for _ in 0..64 {
        let off = (r.below((MR / 4) as u64) * 4) as usize;
        v[off..off + 4].copy_from_slice(&MAGIC.to_le_bytes());
    }
    v
}

/// The child (target) of a cross-process chaos run on host `s`: the target MR, a
/// ring of RECV slots, an evictor; hashes each received SEND in order; answers
/// `done` with its verdicts (`nonresident_dma`: the backend's count of NIC
/// accesses to non-resident pages, 0 where it has none).
pub fn child<N: Backend, S: Side<N>>(s: &S, nonresident_dma: impl Fn() -> u64) {
    let cq = s.ctx().create_cq(256).unwrap();
    let rcq = s.ctx().create_cq(256).unwrap();
    let mut out = std::io::stdout();
    let rb = Buf::with(s, MR, Some(&initial(2)));
    let recv = Buf::new(s, RSLOTS * RSLOT);
    let qp = s.pd().create_qp(&cq, &rcq, 32).unwrap();
    for k in 0..RSLOTS {
        qp.post_recv(&[RecvWr {
            wr_id: k as u64,
            sge: Some(recv.mr.sge((k * RSLOT) as u64, RSLOT as u32)),
        }])
        .unwrap();
    }
    say(
        &mut out,
        &format!("{} {} {}", ep_word(&qp.endpoint()), rb.addr(), rb.mr.rkey()),
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let peer = ep_of(lines.next().unwrap().unwrap().trim());
    qp.connect(&peer).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ranges = vec![
        (rb.addr() as usize, MR),
        (recv.addr() as usize, RSLOTS * RSLOT),
    ];
    let ev = evictor(s.pager().clone(), ranges.clone(), stop.clone(), 12);
    // Receive in a thread that blocks between completions (no spinner).
    let quit = AtomicBool::new(false);
    let receiver = || {
        let (mut n, mut h) = (0u64, FNV0);
        let mut cs = [nprdma::Completion::default(); 8];
        while !quit.load(Ordering::Acquire) {
            rcq.req_notify();
            let k = rcq.poll(&mut cs);
            if k == 0 {
                rcq.wait_event(Duration::from_millis(5));
                continue;
            }
            for c in &cs[..k] {
                assert_eq!(c.status, 0, "RECV error {c:?}");
                let slot = c.wr_id as usize;
                let data = &recv.bytes()[slot * RSLOT..slot * RSLOT + c.byte_len as usize];
                h = fnv(fnv(h, &c.byte_len.to_le_bytes()), data);
                n += 1;
                qp.post_recv(&[RecvWr {
                    wr_id: slot as u64,
                    sge: Some(recv.mr.sge((slot * RSLOT) as u64, RSLOT as u32)),
                }])
                .unwrap();
            }
        }
        (n, h)
    };
    std::thread::scope(|sc| {
        let rx = sc.spawn(receiver);
        say(&mut out, "ready");
        let l = lines.next().map(|l| l.unwrap());
        // `done`: the parent drained, every SEND completed, so every RECV
        // is in (or the parent went away).
        quit.store(true, Ordering::Release);
        let (n, h) = rx.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        let swapped = ev.join().unwrap();
        if l.as_deref().map(str::trim) != Some("done") {
            return;
        }
        let mem = fnv(FNV0, rb.bytes());
        let nonres = nonresident_dma();
        s.pager().set_budget(None);
        let left = crate::resident_after_swap_out(s.pager(), &ranges);
        eprintln!(
            "child: {n} RECVs, evictor swapped {swapped} pages, {:?}",
            s.ctx().stats()
        );
        say(&mut out, &format!("{n} {h} {mem} {nonres} {left}"));
    });
}

/// The parent (initiator) of a cross-process chaos run on host `a` against
/// `child` (spawned to run [`child`]): `ops` random operations with an evictor
/// and magic words, the model checked after every drain and at the end, then
/// the child's verdicts. Returns `a`'s engine statistics for the caller's
/// backend-specific checks (which paths ran).
pub fn parent<N: Backend, S: Side<N>>(
    a: &S,
    mut child: ChildProc,
    ops: u64,
    nonresident_dma: impl Fn() -> u64,
) -> Stats {
    let cq = a.ctx().create_cq(256).unwrap();
    let rcq = a.ctx().create_cq(256).unwrap();
    let first = child.read_line();
    let w: Vec<&str> = first.split_whitespace().collect();
    let (peer, rbase, rkey): (Endpoint, u64, u32) =
        (ep_of(w[0]), w[1].parse().unwrap(), w[2].parse().unwrap());

    let mut m = ChaosModel {
        local: initial(1),
        remote: initial(2),
        data: DATA,
        max_send: RSLOT,
        last_read: None,
    };
    let mut la = Buf::with(a, MR, Some(&m.local));
    let qa = a.pd().create_qp(&cq, &rcq, 32).unwrap();
    qa.connect(&peer).unwrap();
    child.send(&ep_word(&qa.endpoint()));
    assert_eq!(child.read_line(), "ready");
    let stop = Arc::new(AtomicBool::new(false));
    let ev = evictor(
        a.pager().clone(),
        vec![(la.addr() as usize, MR)],
        stop.clone(),
        11,
    );
    a.pager().set_budget(Some(128));

    let mut r = Rng(4242);
    let mut expect: VecDeque<(u64, bool)> = VecDeque::new();
    let (mut sends, mut send_hash) = (0u64, FNV0);
    let mut history: Vec<(u64, &str, usize, usize, usize)> = Vec::new();
    let poll = |expect: &mut VecDeque<(u64, bool)>| -> usize {
        let mut out = [nprdma::Completion::default(); 32];
        let n = cq.poll(&mut out);
        for c in &out[..n] {
            assert_eq!(c.status, 0, "completion error {c:?}");
            loop {
                let (id, sig) = expect.pop_front().expect("completion for a posted WR");
                if id == c.wr_id {
                    assert!(sig, "completion for an unsignaled WR {id}");
                    break;
                }
                assert!(!sig, "signaled WR {id} skipped (got {})", c.wr_id);
            }
        }
        n
    };
    let drain = |expect: &mut VecDeque<(u64, bool)>| {
        let t0 = Instant::now();
        while qa.outstanding() > 0 || expect.iter().any(|e| e.1) {
            if poll(expect) == 0 {
                std::thread::yield_now();
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "drain stuck");
        }
        expect.clear();
    };
    let t0 = Instant::now();
    for i in 0..ops {
        if i % 200 == 199 {
            drain(&mut expect);
            if let Some((k, last)) = first_difference(la.bytes(), &m.local) {
                let writers: Vec<_> = history
                    .iter()
                    .rev()
                    .filter(|h| matches!(h.1, "READ" | "ATOMIC") && h.2 <= k && k < h.2 + h.3)
                    .take(4)
                    .collect();
                panic!(
                    "local memory differs from the model after op {i}: [{k}, {last}] got {:02x?} want {:02x?}; latest writers {writers:?}",
                    &la.bytes()[k..(k + 16).min(MR)],
                    &m.local[k..(k + 16).min(MR)]
                );
            }
            let off = (r.below((DATA / 4) as u64) * 4) as usize;
            m.local[off..off + 4].copy_from_slice(&MAGIC.to_le_bytes());
            la.bytes_mut()[off..off + 4].copy_from_slice(&MAGIC.to_le_bytes());
        }
        let id = i + 1;
        let op = m.next(&mut r);
        let (kind, lo, len, ro) = op.describe();
        history.push((id, kind, lo, len, ro));
        if let ChaosOp::Send { lo, len } = op {
            send_hash = fnv(
                fnv(send_hash, &(len as u32).to_le_bytes()),
                &m.local[lo..lo + len],
            );
            sends += 1;
        }
        let wr = op.wr(id, &la.mr, rbase, rkey);
        let tp = Instant::now();
        loop {
            match qa.post_send(&[wr]) {
                Ok(()) => break,
                Err((_, nprdma::Error::QueueFull)) => {
                    poll(&mut expect);
                    assert!(tp.elapsed() < Duration::from_secs(30), "QP stuck");
                }
                Err((_, e)) => panic!("post: {e}"),
            }
        }
        expect.push_back((wr.wr_id, wr.signaled));
        poll(&mut expect);
    }
    drain(&mut expect);
    assert!(
        la.bytes() == &m.local[..],
        "local memory differs from the model at the end"
    );
    stop.store(true, Ordering::Relaxed);
    let swapped = ev.join().unwrap();
    child.send("done");
    let v: Vec<u64> = child
        .read_line()
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(child.finish(), "child failed");
    eprintln!(
        "xchaos: {ops} ops in {:?}; {sends} SENDs; parent evictor {swapped} pages; {:?}; pager {:?}",
        t0.elapsed(),
        a.ctx().stats(),
        (a.pager().stats().swap_outs, a.pager().stats().major_faults)
    );
    assert_eq!(v[0], sends, "RECVs at the child");
    assert_eq!(v[1], send_hash, "SEND payloads (hash over all, in order)");
    assert_eq!(
        v[2],
        fnv(FNV0, &m.remote),
        "the child's memory differs from the model"
    );
    assert_eq!(v[3], 0, "NIC touched a non-resident page at the child");
    assert_eq!(v[4], 0, "a page stayed pinned at the child");
    assert_eq!(nonresident_dma(), 0, "NIC touched a non-resident page here");
    let st = a.ctx().stats();
    a.pager().set_budget(None);
    assert_eq!(
        crate::resident_after_swap_out(a.pager(), &[(la.addr() as usize, MR)]),
        0,
        "a page stayed pinned here"
    );
    st
}
