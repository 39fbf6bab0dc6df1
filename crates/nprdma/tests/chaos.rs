//! The chaos test: two hosts, several QPs in both directions, random
//! READ / WRITE / ATOMIC / SEND of random sizes and offsets over MRs of a
//! few MB, while evictors on both sides swap random pages out (budget well
//! below the working set) and some buffers hold the magic word on purpose.
//! Verifies byte-exact data against a model, exactly one completion per
//! signaled WR, in post order, and zero NIC accesses to non-resident pages;
//! at the end no page stays pinned.
//!
//! Short by default; `NPRDMA_CHAOS_OPS=<ops per QP>` runs the long form.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::chaos_layout::*;
use common::*;
use nprdma::{CompOp, Cq, Qp, RecvWr, SendWr};

/// One initiator QP with its own MRs on both sides and its model.
struct Driver {
    qa: Qp,
    qb: Qp,
    cq: Cq,
    rcq: Cq,
    la: Buf,
    rb: Buf,
    recv: Buf,
    m: ChaosModel,
    expect: VecDeque<(u64, bool)>, // (wr_id, signaled) in post order
    sends: VecDeque<(usize, Vec<u8>)>, // (local offset, expected payload) of posted SENDs
    next_recv_slot: usize,
    completions: u64,
    recvs_done: u64,
    /// (wr id, kind, local offset, len, remote offset) of every posted WR,
    /// to name the operations behind a failure.
    history: Vec<(u64, &'static str, usize, usize, usize)>,
}

fn driver(a: &Side, b: &Side, seed: u64) -> Driver {
    let cq = a.ctx.create_cq(1024).unwrap();
    let rcq_a = a.ctx.create_cq(64).unwrap();
    let cq_b = b.ctx.create_cq(64).unwrap();
    let rcq = b.ctx.create_cq(1024).unwrap();
    let qa = a.pd.create_qp(&cq, &rcq_a, 32).unwrap();
    let qb = b.pd.create_qp(&cq_b, &rcq, 32).unwrap();
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    let pl = pattern(seed, MR);
    let pr = pattern(seed ^ 0xabc, MR);
    let la = Buf::with(a, MR, Some(&pl));
    let rb = Buf::with(b, MR, Some(&pr));
    let recv = Buf::new(b, RSLOTS * RSLOT);
    for s in 0..RSLOTS {
        qb.post_recv(&[RecvWr {
            wr_id: s as u64,
            sge: Some(recv.mr.sge((s * RSLOT) as u64, RSLOT as u32)),
        }])
        .unwrap();
    }
    Driver {
        qa,
        qb,
        cq,
        rcq,
        la,
        rb,
        recv,
        m: ChaosModel {
            local: pl,
            remote: pr,
            data: DATA,
            max_send: RSLOT,
            last_read: None,
        },
        expect: VecDeque::new(),
        sends: VecDeque::new(),
        next_recv_slot: 0,
        completions: 0,
        recvs_done: 0,
        history: Vec::new(),
    }
}

/// What a wrong payload looks like: where it differs, and whether the
/// wrong bytes are the source's later content, zeroes or the magic word.
fn mismatch(got: &[u8], want: &[u8], later: &[u8], lo: usize) -> String {
    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    let (first, last) = (bad[0], *bad.last().expect("some byte differs"));
    let later_match = bad.iter().all(|&i| got[i] == later[i]);
    let zeros = bad.iter().all(|&i| got[i] == 0);
    let magic = MAGIC.to_le_bytes();
    let magicish = bad.iter().all(|&i| got[i] == magic[(lo + i) % 4]);
    format!(
        "len {} src offset {lo}: {} bytes differ in [{first}, {last}]; wrong bytes = source's later content: {later_match}, zeroes: {zeros}, magic: {magicish}; got {:02x?} want {:02x?}",
        want.len(),
        bad.len(),
        &got[first..(first + 16).min(got.len())],
        &want[first..(first + 16).min(want.len())],
    )
}

impl Driver {
    fn poll(&mut self) -> usize {
        let mut out = [nprdma::Completion::default(); 32];
        let n = self.cq.poll(&mut out);
        for c in &out[..n] {
            assert_eq!(c.status, 0, "completion error {c:?}");
            // Post order: skip unsignaled WRs posted before it.
            loop {
                let (id, sig) = self.expect.pop_front().expect("completion for a posted WR");
                if id == c.wr_id {
                    assert!(sig, "completion for an unsignaled WR {id}");
                    break;
                }
                assert!(!sig, "signaled WR {id} skipped (got {})", c.wr_id);
            }
            self.completions += 1;
        }
        let mut rc = [nprdma::Completion::default(); 8];
        let k = self.rcq.poll(&mut rc);
        for c in &rc[..k] {
            assert_eq!(c.status, 0, "recv error {c:?}");
            assert_eq!(c.op, CompOp::Recv);
            let (lo, want) = self.sends.pop_front().expect("a RECV for a posted SEND");
            let s = c.wr_id as usize;
            assert_eq!(s, self.next_recv_slot, "RECVs complete in order");
            assert_eq!(c.byte_len as usize, want.len());
            let got = &self.recv.bytes()[s * RSLOT..s * RSLOT + want.len()];
            if got != &want[..] {
                let first = (0..want.len()).find(|&i| got[i] != want[i]).unwrap_or(0);
                let at = lo + first;
                let recent: Vec<_> = self
                    .history
                    .iter()
                    .rev()
                    .filter(|h| h.2 <= at && at < h.2 + h.3)
                    .take(6)
                    .collect();
                panic!(
                    "SEND payload mismatch: {}; last WR {:?}; latest WRs touching local {at}: {recent:?}",
                    mismatch(got, &want, &self.m.local[lo..lo + want.len()], lo),
                    self.history.last()
                );
            }
            self.next_recv_slot = (s + 1) % RSLOTS;
            self.qb
                .post_recv(&[RecvWr {
                    wr_id: s as u64,
                    sge: Some(self.recv.mr.sge((s * RSLOT) as u64, RSLOT as u32)),
                }])
                .unwrap();
            self.recvs_done += 1;
        }
        n + k
    }

    fn post(&mut self, wr: SendWr) {
        let t0 = Instant::now();
        loop {
            match self.qa.post_send(&[wr]) {
                Ok(()) => break,
                Err((_, nprdma::Error::QueueFull)) => {
                    self.poll();
                    assert!(t0.elapsed() < Duration::from_secs(30), "QP stuck");
                }
                Err((_, e)) => panic!("post: {e}"),
            }
        }
        self.expect.push_back((wr.wr_id, wr.signaled));
    }

    fn drain(&mut self) {
        let t0 = Instant::now();
        while self.qa.outstanding() > 0 || self.expect.iter().any(|e| e.1) || !self.sends.is_empty()
        {
            if self.poll() == 0 {
                std::thread::yield_now();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "drain stuck: outstanding {} expect {:?} sends {}",
                self.qa.outstanding(),
                self.expect.iter().filter(|e| e.1).count(),
                self.sends.len()
            );
        }
        self.expect.clear();
    }

    /// After a drain the local buffer must equal the model byte for byte
    /// (every READ and atomic result landed): name the first wrong range
    /// and the WRs that wrote it.
    fn verify_local(&self, i: u64) {
        let got = self.la.bytes();
        let Some((first, last)) = first_difference(got, &self.m.local) else {
            return;
        };
        let writers: Vec<_> = self
            .history
            .iter()
            .rev()
            .filter(|h| {
                matches!(h.1, "READ" | "ATOMIC" | "MAGIC") && h.2 <= first && first < h.2 + h.3
            })
            .take(4)
            .collect();
        panic!(
            "local memory differs from the model after op {i}: [{first}, {last}] got {:02x?} want {:02x?}; latest writers {writers:?}",
            &got[first..(first + 16).min(MR)],
            &self.m.local[first..(first + 16).min(MR)],
        );
    }

    /// Put magic words into both buffers (and the model) on purpose.
    fn inject_magic(&mut self, r: &mut Rng) {
        for _ in 0..8 {
            let off = (r.below((DATA / 4) as u64) * 4) as usize;
            let m = MAGIC.to_le_bytes();
            if r.below(2) == 0 {
                self.m.local[off..off + 4].copy_from_slice(&m);
                self.la.bytes_mut()[off..off + 4].copy_from_slice(&m);
                self.history.push((0, "MAGIC", off, 4, 0));
            } else {
                self.m.remote[off..off + 4].copy_from_slice(&m);
                self.rb.bytes_mut()[off..off + 4].copy_from_slice(&m);
                self.history.push((0, "MAGIC-REMOTE", 0, 0, off));
            }
        }
    }

    fn run(&mut self, ops: u64, seed: u64) {
        let mut r = Rng(seed | 1);
        let rb = self.rb.addr();
        let rkey = self.rb.mr.rkey();
        for i in 0..ops {
            if i % 200 == 199 {
                self.drain();
                self.verify_local(i);
                self.inject_magic(&mut r);
            }
            let id = i + 1;
            let op = self.m.next(&mut r);
            let (kind, lo, len, ro) = op.describe();
            self.history.push((id, kind, lo, len, ro));
            if let ChaosOp::Send { lo, len } = op {
                if self.sends.len() >= RSLOTS {
                    self.drain();
                }
                self.sends
                    .push_back((lo, self.m.local[lo..lo + len].to_vec()));
            }
            self.post(op.wr(id, &self.la.mr, rb, rkey));
            self.poll();
        }
        self.drain();
        assert!(
            self.la.bytes() == &self.m.local[..],
            "local memory differs from the model"
        );
        assert!(
            self.rb.bytes() == &self.m.remote[..],
            "remote memory differs from the model"
        );
    }
}

#[test]
fn chaos() {
    run_chaos(nprdma::Config::default(), chaos_ops(600));
}

/// The chaos test with the paper's parking instead of pipelining
/// (`OrderConfig::pipeline` off).
#[test]
fn chaos_parking() {
    let mut cfg = nprdma::Config::default();
    cfg.order.pipeline = false;
    run_chaos(cfg, chaos_ops(600));
}

/// The same under the other modes: retry mode (Receiver-Ready), versioned
/// READs above 8 KiB, interrupt-mode polling threads, smaller inline limit.
#[test]
fn chaos_modes() {
    let mut cfg = nprdma::Config {
        retry_mode: true,
        interrupt_mode: true,
        ..nprdma::Config::default()
    };
    cfg.plan.read_version_threshold = Some(8192);
    cfg.plan.inline_max = 256;
    run_chaos(cfg, chaos_ops(400));
}

fn run_chaos(cfg: nprdma::Config, ops: u64) {
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    // Two QPs A -> B and one B -> A, each with its own MRs.
    let mut ds = vec![driver(&a, &b, 1), driver(&a, &b, 2), driver(&b, &a, 3)];
    let ranges = |side_is_a: bool| -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (i, d) in ds.iter().enumerate() {
            let init_on_a = i < 2;
            if init_on_a == side_is_a {
                v.push((d.la.addr() as usize, MR));
            } else {
                v.push((d.rb.addr() as usize, MR));
                v.push((d.recv.addr() as usize, RSLOTS * RSLOT));
            }
        }
        v
    };
    let (ra, rb) = (ranges(true), ranges(false));
    // Working set ~3.8 MB per side; budget 200 pages (800 KB).
    a.pager.set_budget(Some(200));
    b.pager.set_budget(Some(200));
    let stop = Arc::new(AtomicBool::new(false));
    let ea = evictor(a.pager.clone(), ra.clone(), stop.clone(), 11);
    let eb = evictor(b.pager.clone(), rb.clone(), stop.clone(), 12);
    let t0 = Instant::now();
    let handles: Vec<_> = ds
        .drain(..)
        .enumerate()
        .map(|(i, mut d)| {
            std::thread::spawn(move || {
                d.run(ops, 1000 + i as u64);
                d
            })
        })
        .collect();
    let ds: Vec<Driver> = handles
        .into_iter()
        .map(|h| h.join().expect("driver"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let evicted = (ea.join().unwrap(), eb.join().unwrap());
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    eprintln!(
        "chaos: {ops} ops/QP x 3 QPs in {:?}; evictor swap-outs {evicted:?}; A {sa:?}; B {sb:?}; pagers A {:?} B {:?}",
        t0.elapsed(),
        (a.pager.stats().swap_outs, a.pager.stats().major_faults),
        (b.pager.stats().swap_outs, b.pager.stats().major_faults),
    );
    for d in &ds {
        assert!(d.completions > 0 && d.recvs_done > 0);
    }
    assert!(sa.two_sided + sb.two_sided > 0 && sa.optimistic_ok + sb.optimistic_ok > 0);
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma,
        0,
        "NIC touched a non-resident page on A"
    );
    assert_eq!(
        b.ctx.nic_stats().nonresident_dma,
        0,
        "NIC touched a non-resident page on B"
    );
    // No leaked pins: every page can be swapped out now.
    a.pager.set_budget(None);
    b.pager.set_budget(None);
    for (p, rs) in [(&a.pager, &ra), (&b.pager, &rb)] {
        for &(addr, len) in rs {
            p.swap_out(addr, len).unwrap();
            assert_eq!(
                p.resident_count(addr, len).unwrap(),
                0,
                "a page stayed pinned"
            );
        }
    }
    drop(ds);
}
