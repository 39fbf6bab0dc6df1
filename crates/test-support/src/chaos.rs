//! The chaos test, over any backend: two hosts, several QPs in both
//! directions, random READ / WRITE / ATOMIC / SEND of random sizes and offsets
//! over MRs of 1 MiB, while evictors on both sides swap random pages out
//! (budget well below the working set) and some buffers hold the magic word on
//! purpose. Verifies byte-exact data against a model, exactly one completion
//! per signaled WR, in post order, each SEND's payload in its receive, and that
//! at the end no page stays pinned. The backend-specific checks (what went
//! one-sided, NIC accesses to non-resident pages) are the caller's.
//!
//! Below the runner: the model ([`ChaosModel`], [`ChaosOp`], [`chaos_layout`]),
//! the PRNG and the evictor thread, shared with nprdma's cross-process chaos.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nprdma::engine::Backend;
use nprdma::{CompOp, Context, Cq, Mr, Opcode, Qp, RecvWr, SendWr, Stats};

use crate::{pattern, Buf, Mem};
use chaos_layout::*;

/// One host of a chaos run: its pager, PD and context.
pub trait Side<N: Backend>: Mem<N> {
    /// The engine context.
    fn ctx(&self) -> &Context<N>;
}

/// What a chaos run leaves for the caller's checks.
pub struct Report {
    /// Engine statistics of the two hosts after the run.
    pub stats: (Stats, Stats),
}

/// Run `ops` random operations on each of three QPs (two from `a` to `b`, one
/// back) with both pagers' budgets at 200 pages and evictors running; panics
/// on any wrong byte, completion or leaked pin.
pub fn run<N: Backend, S: Side<N>>(a: &S, b: &S, ops: u64) -> Report {
    // Two QPs A -> B and one B -> A, each with its own MRs.
    let mut ds = vec![driver(a, b, 1), driver(a, b, 2), driver(b, a, 3)];
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
    a.pager().set_budget(Some(200));
    b.pager().set_budget(Some(200));
    let stop = Arc::new(AtomicBool::new(false));
    let ea = evictor(a.pager().clone(), ra.clone(), stop.clone(), 11);
    let eb = evictor(b.pager().clone(), rb.clone(), stop.clone(), 12);
    let t0 = Instant::now();
    let ds: Vec<Driver<N>> = std::thread::scope(|s| {
        let hs: Vec<_> = ds
            .drain(..)
            .enumerate()
            .map(|(i, mut d)| {
                s.spawn(move || {
                    d.run(ops, 1000 + i as u64);
                    d
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("driver")).collect()
    });
    stop.store(true, Ordering::Relaxed);
    let evicted = (ea.join().unwrap(), eb.join().unwrap());
    let stats = (a.ctx().stats(), b.ctx().stats());
    eprintln!(
        "chaos: {ops} ops/QP x 3 QPs in {:?}; evictor swap-outs {evicted:?}; A {:?}; B {:?}; pagers A {:?} B {:?}",
        t0.elapsed(),
        stats.0,
        stats.1,
        (a.pager().stats().swap_outs, a.pager().stats().major_faults),
        (b.pager().stats().swap_outs, b.pager().stats().major_faults),
    );
    for d in &ds {
        assert!(d.completions > 0 && d.recvs_done > 0);
    }
    // No leaked pins: every page can be swapped out now (in user-space mode
    // once the leases lent to the peer are past their time).
    a.pager().set_budget(None);
    b.pager().set_budget(None);
    for (p, rs) in [(a.pager(), &ra), (b.pager(), &rb)] {
        assert_eq!(
            crate::resident_after_swap_out(p, rs),
            0,
            "a page stayed pinned"
        );
    }
    drop(ds);
    Report { stats }
}

/// One initiator QP with its own MRs on both sides and its model.
struct Driver<N: Backend> {
    qa: Qp<N>,
    qb: Qp<N>,
    cq: Cq<N>,
    rcq: Cq<N>,
    la: Buf<N>,
    rb: Buf<N>,
    recv: Buf<N>,
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

fn driver<N: Backend, S: Side<N>>(a: &S, b: &S, seed: u64) -> Driver<N> {
    let cq = a.ctx().create_cq(1024).unwrap();
    let rcq_a = a.ctx().create_cq(64).unwrap();
    let cq_b = b.ctx().create_cq(64).unwrap();
    let rcq = b.ctx().create_cq(1024).unwrap();
    let qa = a.pd().create_qp(&cq, &rcq_a, 32).unwrap();
    let qb = b.pd().create_qp(&cq_b, &rcq, 32).unwrap();
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

impl<N: Backend> Driver<N> {
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
        // Where the latest READ took the first wrong byte from, and the ops
        // that wrote that remote byte before it (by remote range).
        let remote = writers
            .iter()
            .find(|h| h.1 == "READ")
            .map(|h| (h.0, h.4 + (first - h.2)));
        let remote_writers: Vec<_> = remote
            .map(|(rid, at)| {
                self.history
                    .iter()
                    .rev()
                    .filter(|h| h.0 < rid && h.1 != "READ" && h.4 <= at && at < h.4 + h.3.max(1))
                    .take(6)
                    .collect()
            })
            .unwrap_or_default();
        panic!(
            "local memory differs from the model after op {i}: [{first}, {last}] got {:02x?} want {:02x?}; latest writers {writers:?}; read from remote {remote:?}, whose latest writers were {remote_writers:?}",
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

/// Xorshift PRNG of the randomized tests (deterministic per seed).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)] // an infinite stream, not an Iterator
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A number below `n` (0 if `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Chaos-test transfer length: mostly ≤ 4 KiB, some ≤ 16 KiB, a few ≤ 128 KiB.
pub fn rand_len(r: &mut Rng) -> usize {
    match r.below(10) {
        0..=5 => 1 + r.below(4096) as usize,
        6..=8 => 1 + r.below(16384) as usize,
        _ => 1 + r.below(131072) as usize,
    }
}

/// A thread swapping random runs of 1–8 pages of `ranges` out until `stop`;
/// returns how many pages it swapped out.
pub fn evictor(
    pager: vmem::Pager,
    ranges: Vec<(usize, usize)>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seed: u64,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut r = Rng(seed | 1);
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let (a, len) = ranges[r.below(ranges.len() as u64) as usize];
            let pages = len / 4096;
            let p = r.below(pages as u64) as usize;
            let k = (1 + r.below(8) as usize).min(pages - p);
            n += pager.swap_out(a + p * 4096, k * 4096).unwrap_or(0) as u64;
            std::thread::sleep(Duration::from_micros(200));
        }
        n
    })
}

/// Operations per QP of a chaos test: `default`, or `NPRDMA_CHAOS_OPS`.
pub fn chaos_ops(default: u64) -> u64 {
    std::env::var("NPRDMA_CHAOS_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Layout of a chaos test's MRs and receive ring (both chaos tests and
/// [`ChaosModel`] assume it).
pub mod chaos_layout {
    /// Size of each MR.
    pub const MR: usize = 1 << 20;
    /// Top of each MR: 4 KiB of atomic words, then 4 KiB of their results.
    pub const ATOM_AREA: usize = 8192;
    /// READ / WRITE / SEND area below it.
    pub const DATA: usize = MR - ATOM_AREA;
    /// Receive slots per QP.
    pub const RSLOTS: usize = 8;
    /// Bytes per receive slot (the largest SEND).
    pub const RSLOT: usize = 32 * 1024;
    /// The software NIC's default magic word, planted in buffers on purpose.
    pub const MAGIC: u32 = 0xdead_beef;
}

/// One random operation of the chaos tests, already applied to the model
/// (offsets into the local / remote MR).
#[derive(Debug, Clone, Copy)]
pub enum ChaosOp {
    /// READ `len` bytes at remote `ro` into local `lo`.
    Read {
        /// Local offset.
        lo: usize,
        /// Remote offset.
        ro: usize,
        /// Length.
        len: usize,
    },
    /// WRITE `len` bytes at local `lo` to remote `ro`.
    Write {
        /// Local offset.
        lo: usize,
        /// Remote offset.
        ro: usize,
        /// Length.
        len: usize,
        /// Whether it asks for a completion.
        signaled: bool,
    },
    /// An atomic on remote word `w`, its old value into local `res`.
    Atomic {
        /// FETCH_ADD or CMP_SWAP, with operands.
        op: Opcode,
        /// Remote word offset.
        w: usize,
        /// Local result offset.
        res: usize,
    },
    /// SEND `len` bytes at local `lo` into the peer's next receive.
    Send {
        /// Local offset.
        lo: usize,
        /// Length.
        len: usize,
    },
}

/// The expected bytes of both MRs of a chaos QP ([`chaos_layout`]): `data`
/// bytes of READ / WRITE / SEND area, then the atomic words and results.
pub struct ChaosModel {
    /// The initiator's MR.
    pub local: Vec<u8>,
    /// The target's MR.
    pub remote: Vec<u8>,
    /// Bytes of READ / WRITE / SEND area.
    pub data: usize,
    /// Largest SEND (a receive slot).
    pub max_send: usize,
    /// The last READ's local range: a third of the READs reuse it (a
    /// same-buffer window, where later READs supersede earlier ones).
    pub last_read: Option<(usize, usize)>,
}

impl ChaosModel {
    /// Draw the next operation (40 % READ, 40 % WRITE, 12 % atomic, 8 %
    /// SEND) and apply it to the model as RC executes it.
    pub fn next(&mut self, r: &mut Rng) -> ChaosOp {
        let data = self.data;
        let kind = r.below(100);
        if kind < 80 {
            let mut len = rand_len(r).min(data);
            let mut lo = r.below((data - len + 1) as u64) as usize;
            if kind < 40 && r.below(3) == 0 {
                if let Some((l, n)) = self.last_read {
                    (lo, len) = (l, n);
                }
            }
            let ro = r.below((data - len + 1) as u64) as usize;
            if kind < 40 {
                self.last_read = Some((lo, len));
                let src = self.remote[ro..ro + len].to_vec();
                self.local[lo..lo + len].copy_from_slice(&src);
                return ChaosOp::Read { lo, ro, len };
            }
            let src = self.local[lo..lo + len].to_vec();
            self.remote[ro..ro + len].copy_from_slice(&src);
            let signaled = r.below(5) != 0;
            return ChaosOp::Write {
                lo,
                ro,
                len,
                signaled,
            };
        }
        if kind < 92 {
            let w = data + 8 * r.below(64) as usize;
            let res = data + chaos_layout::ATOM_AREA / 2 + 8 * r.below(64) as usize;
            let old = u64::from_le_bytes(self.remote[w..w + 8].try_into().unwrap());
            let op = if r.below(2) == 0 {
                let add = r.below(1000);
                self.remote[w..w + 8].copy_from_slice(&old.wrapping_add(add).to_le_bytes());
                Opcode::FetchAdd { add }
            } else {
                let hit = r.below(2) == 0;
                let compare = if hit { old } else { old ^ 1 };
                let swap = r.next();
                if hit {
                    self.remote[w..w + 8].copy_from_slice(&swap.to_le_bytes());
                }
                Opcode::CmpSwap { compare, swap }
            };
            self.local[res..res + 8].copy_from_slice(&old.to_le_bytes());
            return ChaosOp::Atomic { op, w, res };
        }
        let len = (rand_len(r) % self.max_send).max(1);
        let lo = r.below((data - len + 1) as u64) as usize;
        ChaosOp::Send { lo, len }
    }
}

impl ChaosOp {
    /// The WR: local buffer `l`, remote MR at `rbase` with `rkey`.
    pub fn wr<N: Backend>(&self, id: u64, l: &Mr<N>, rbase: u64, rkey: u32) -> SendWr {
        match *self {
            ChaosOp::Read { lo, ro, len } => SendWr::new(
                id,
                Opcode::Read,
                Some(l.sge(lo as u64, len as u32)),
                rbase + ro as u64,
                rkey,
            ),
            ChaosOp::Write {
                lo,
                ro,
                len,
                signaled,
            } => {
                let mut w = SendWr::new(
                    id,
                    Opcode::Write,
                    Some(l.sge(lo as u64, len as u32)),
                    rbase + ro as u64,
                    rkey,
                );
                w.signaled = signaled;
                w
            }
            ChaosOp::Atomic { op, w, res } => {
                SendWr::new(id, op, Some(l.sge(res as u64, 8)), rbase + w as u64, rkey)
            }
            ChaosOp::Send { lo, len } => {
                SendWr::new(id, Opcode::Send, Some(l.sge(lo as u64, len as u32)), 0, 0)
            }
        }
    }

    /// (kind, local offset, length, remote offset), for failure reports.
    pub fn describe(&self) -> (&'static str, usize, usize, usize) {
        match *self {
            ChaosOp::Read { lo, ro, len } => ("READ", lo, len, ro),
            ChaosOp::Write { lo, ro, len, .. } => ("WRITE", lo, len, ro),
            ChaosOp::Atomic { w, res, .. } => ("ATOMIC", res, 8, w),
            ChaosOp::Send { lo, len } => ("SEND", lo, len, 0),
        }
    }
}

/// The first run of bytes where `got` differs from `want`, as `[first, last]`.
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<(usize, usize)> {
    let first = (0..want.len()).find(|&k| got[k] != want[k])?;
    let last = (first..want.len())
        .take_while(|&k| got[k] != want[k])
        .last()
        .unwrap_or(first);
    Some((first, last))
}
