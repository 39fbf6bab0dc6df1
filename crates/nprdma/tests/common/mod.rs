//! Shared set-up of the engine integration tests: two software hosts in
//! this process, each with its own pager, context, PD and CQs.
#![allow(dead_code)]

pub mod child;

use std::time::Duration;

use nprdma::{Access, Completion, Config, Context, Cq, Mr, Opcode, Pd, Qp, SendWr};

pub struct Side {
    pub host: rnic::Host,
    pub pager: vmem::Pager,
    pub ctx: Context,
    pub pd: Pd,
    pub cq: Cq,
    pub rcq: Cq,
}

pub fn side_with(cfg: Config) -> Side {
    side_on(rnic::HostConfig::default(), cfg)
}

/// A side on a host with configuration `hc`.
pub fn side_on(hc: rnic::HostConfig, cfg: Config) -> Side {
    let host = rnic::Host::new(hc).expect("host");
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 256 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::new(&host, &pager, cfg).expect("context");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4096).expect("cq");
    let rcq = ctx.create_cq(4096).expect("rcq");
    Side {
        host,
        pager,
        ctx,
        pd,
        cq,
        rcq,
    }
}

pub fn side() -> Side {
    side_with(Config::default())
}

/// A connected QP pair `a.qp <-> b.qp`.
pub fn connect(a: &Side, b: &Side, depth: u32) -> (Qp, Qp) {
    let qa = a.pd.create_qp(&a.cq, &a.rcq, depth).expect("qp a");
    let qb = b.pd.create_qp(&b.cq, &b.rcq, depth).expect("qp b");
    qa.connect(&qb.endpoint()).expect("connect a");
    qb.connect(&qa.endpoint()).expect("connect b");
    (qa, qb)
}

/// Two default sides and one connected QP pair (`qa` on `a` is the initiator).
pub struct Env {
    pub a: Side,
    pub b: Side,
    pub qa: Qp,
    pub _qb: Qp,
}

/// [`Env`] with QPs of `depth`.
pub fn env_with_depth(depth: u32) -> Env {
    let a = side();
    let b = side();
    let (qa, qb) = connect(&a, &b, depth);
    Env { a, b, qa, _qb: qb }
}

/// Pager-managed memory registered as an NP-RDMA MR.
pub struct Buf {
    pub mr: Mr,
    pub region: vmem::Region,
}

impl Buf {
    /// An untouched (never faulted) buffer.
    pub fn new(s: &Side, len: usize) -> Buf {
        Self::with(s, len, None)
    }

    /// A buffer holding `data` before registration (resident pages start
    /// mapped), or untouched if `None`.
    pub fn with(s: &Side, len: usize, data: Option<&[u8]>) -> Buf {
        let mut region = s.pager.alloc(len).expect("alloc");
        if let Some(d) = data {
            region.as_mut_slice()[..d.len()].copy_from_slice(d);
        }
        let acc = Access::LOCAL_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_WRITE
            | Access::REMOTE_ATOMIC;
        // SAFETY: the region is private anonymous memory; `Buf` drops the MR
        // before the region (see Drop).
        #[allow(unsafe_code)]
        let mr = unsafe { s.pd.reg_mr(region.addr() as u64, len as u64, acc) }.expect("reg_mr");
        Buf { region, mr }
    }
    pub fn addr(&self) -> u64 {
        self.region.addr() as u64
    }
    pub fn bytes(&self) -> &[u8] {
        &self.region.as_slice()[..self.mr.len() as usize]
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.mr.len() as usize;
        &mut self.region.as_mut_slice()[..n]
    }
    pub fn swap_out(&self) {
        self.region.swap_out().expect("swap out");
    }
}

/// Wait for exactly one completion (panics after 10 s).
pub fn wait1(cq: &Cq) -> Completion {
    let v = cq.poll_wait(1, Duration::from_secs(10));
    assert_eq!(v.len(), 1, "no completion within 10 s");
    v[0]
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A signaled one-sided `op` of `len` bytes from `l + loff` to/from `r + roff`.
pub fn one_sided(op: Opcode, id: u64, l: &Buf, loff: u64, r: &Buf, roff: u64, len: u32) -> SendWr {
    SendWr::new(
        id,
        op,
        Some(l.mr.sge(loff, len)),
        r.addr() + roff,
        r.mr.rkey(),
    )
}

/// A READ of `r[roff..roff+len]` into `l[loff..]`.
pub fn rd(id: u64, l: &Buf, loff: u64, r: &Buf, roff: u64, len: u32) -> SendWr {
    one_sided(Opcode::Read, id, l, loff, r, roff, len)
}

/// A WRITE of `l[loff..loff+len]` to `r[roff..]`.
pub fn wr(id: u64, l: &Buf, loff: u64, r: &Buf, roff: u64, len: u32) -> SendWr {
    one_sided(Opcode::Write, id, l, loff, r, roff, len)
}

/// Xorshift PRNG of the randomized tests (deterministic per seed).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
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
    pub const MR: usize = 1 << 20;
    /// Top of each MR: 4 KiB of atomic words, then 4 KiB of their results.
    pub const ATOM_AREA: usize = 8192;
    /// READ / WRITE / SEND area below it.
    pub const DATA: usize = MR - ATOM_AREA;
    pub const RSLOTS: usize = 8;
    pub const RSLOT: usize = 32 * 1024;
    /// The software NIC's default magic word, planted in buffers on purpose.
    pub const MAGIC: u32 = 0xdead_beef;
}

/// One random operation of the chaos tests, already applied to the model
/// (offsets into the local / remote MR).
#[derive(Debug, Clone, Copy)]
pub enum ChaosOp {
    Read {
        lo: usize,
        ro: usize,
        len: usize,
    },
    Write {
        lo: usize,
        ro: usize,
        len: usize,
        signaled: bool,
    },
    Atomic {
        op: Opcode,
        w: usize,
        res: usize,
    },
    Send {
        lo: usize,
        len: usize,
    },
}

/// The expected bytes of both MRs of a chaos QP ([`chaos_layout`]): `data`
/// bytes of READ / WRITE / SEND area, then the atomic words and results.
pub struct ChaosModel {
    pub local: Vec<u8>,
    pub remote: Vec<u8>,
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
    pub fn wr(&self, id: u64, l: &Mr, rbase: u64, rkey: u32) -> SendWr {
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
