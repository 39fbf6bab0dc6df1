//! Shared set-up of the engine integration tests: two software hosts in
//! this process, each with its own pager, context, PD and CQs.
#![allow(dead_code)]

#[allow(unused_imports)] // not every test binary has a child process
pub use nprdma_test_support::child;

use nprdma::{Config, Context, Cq, Opcode, Pd, Qp, SendWr};

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
    side_paged(hc, pager_cfg(), cfg)
}

/// The tests' pager configuration (256 MiB of swap; a 4 MiB zero reserve, so
/// the long first-touch runs of pins for writing are moved in from it).
pub fn pager_cfg() -> vmem::PagerConfig {
    vmem::PagerConfig {
        swap_size: 256 << 20,
        zero_reserve: 1024,
        ..vmem::PagerConfig::default()
    }
}

/// A side on a host with configuration `hc` and a pager with `pc`.
pub fn side_paged(hc: rnic::HostConfig, pc: vmem::PagerConfig, cfg: Config) -> Side {
    let host = rnic::Host::new(hc).expect("host");
    let pager = vmem::Pager::new(pc).expect("pager");
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

/// Pager-managed memory registered as an NP-RDMA MR (the shared helper on
/// the default backend).
pub type Buf = nprdma_test_support::Buf<nprdma::engine::DefaultNic>;

impl nprdma_test_support::Mem<nprdma::engine::DefaultNic> for Side {
    fn pager(&self) -> &vmem::Pager {
        &self.pager
    }
    fn pd(&self) -> &Pd {
        &self.pd
    }
}

#[allow(unused_imports)] // not every test binary uses both
pub use nprdma_test_support::{pattern, wait1};

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

#[allow(unused_imports)] // not every test binary uses them all
pub use nprdma_test_support::chaos::{
    chaos_layout, chaos_ops, evictor, first_difference, rand_len, ChaosModel, ChaosOp, Rng,
};
