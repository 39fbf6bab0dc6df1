//! The NP-RDMA engine: the verbs-shaped public API ([`Context`], [`Pd`],
//! [`Mr`], [`Cq`], [`Qp`]) over the software RNIC and the `vmem` pager, and
//! the per-process polling thread.
//!
//! The engine is a tower of files, each importing only files beneath it
//! (bottom first): `types` (configuration, errors, WRs, counters) →
//! `idhash`, `ctrlbuf`, `wrid` (NIC WR ids) → `ucq` (user CQ queues) → `mr`
//! (MR entries) → `pin` (engine pins, temporary MRs) → `dev` (the NIC
//! resources of a context) → `op` (operation records) → `qp` (per-QP state)
//! → `state` (the shared state under the one lock) → `retire` (the one
//! exit of an operation, QP failure and teardown) → `two_sided` → `replay`
//! → `one_sided` → `fast` (the lean path) → `serve` (control messages) →
//! `post` → `progress` (NIC completion dispatch, the polling thread) →
//! `keysync` → `reg` (registration) → `cq` → this file.

mod cq;
mod ctrlbuf;
mod dev;
mod fast;
mod idhash;
mod keysync;
mod mr;
mod one_sided;
mod op;
mod pin;
mod post;
mod progress;
mod qp;
mod reg;
mod replay;
mod retire;
mod serve;
mod state;
mod two_sided;
mod types;
mod ucq;
mod wrid;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

pub use self::cq::Cq;
use self::dev::Dev;
use self::qp::QpState;
pub use self::reg::Mr;
use self::state::{Shared, State};
pub use self::types::{Config, Endpoint, Error, RecvWr, SendWr, Stats};
use crate::adapt::{RnicIommu, VmemMm};
use crate::check::CheckConfig;
pub use crate::nic::{Access, CompOp, Completion, Sge};
pub use crate::plan::AppOp as Opcode;

/// An NP-RDMA device context: one per process and host, owning the polling
/// thread that serves all its QPs and CQs.
#[derive(Clone)]
pub struct Context {
    sh: Arc<Shared>,
    _poller: Arc<PollerGuard>,
}

struct PollerGuard {
    sh: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for PollerGuard {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Context {
    /// Open NP-RDMA on `host` with the process's `pager`.
    pub fn new(host: &rnic::Host, pager: &vmem::Pager, cfg: Config) -> Result<Context, Error> {
        if std::env::var_os("NPRDMA_TRACE").is_some_and(|v| v == "1") {
            crate::trace::enable(true);
        }
        let ctx = host.open_context()?;
        let pd = ctx.alloc_pd()?;
        let chan = ctx.create_comp_channel()?;
        let depth = cfg.nic_cq_depth.min(host.query_device().max_cqe);
        let ncq = ctx.create_cq(depth, Some(&chan))?;
        let rcq = ctx.create_cq(depth, Some(&chan))?;
        let dev = host.query_device();
        let check = CheckConfig::new(
            dev.max_tlp as usize,
            dev.signature_magic,
            dev.page_size as usize,
            crate::check::AtomGrid::Aligned,
        )
        .map_err(|e| Error::Other(e.to_string()))?;
        let sh = Arc::new(Shared {
            dev: Dev {
                host: host.clone(),
                iommu: Arc::new(RnicIommu::new(host.clone(), pd.clone())),
                pd,
                mm: VmemMm(pager.clone()),
                chan,
                ncq,
                rcq,
                check,
                cfg,
                _ctx: ctx,
            },
            st: Mutex::new(State::new()),
            stop: AtomicBool::new(false),
            app_polls: AtomicU64::new(0),
        });
        let s2 = sh.clone();
        let t = std::thread::Builder::new()
            .name("nprdma-poll".into())
            .spawn(move || progress::poller(s2))
            .map_err(|e| Error::Other(e.to_string()))?;
        Ok(Context {
            _poller: Arc::new(PollerGuard {
                sh: sh.clone(),
                thread: Mutex::new(Some(t)),
            }),
            sh,
        })
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Pd {
        let mut st = self.sh.st.lock();
        st.next_pd += 1;
        Pd {
            ctx: self.clone(),
            id: st.next_pd,
        }
    }

    /// A user-space CQ of `depth` entries.
    pub fn create_cq(&self, depth: u32) -> Result<Cq, Error> {
        Cq::new(self.sh.clone(), depth)
    }

    /// The software NIC's statistics (`nonresident_dma` must stay 0).
    pub fn nic_stats(&self) -> rnic::NicStats {
        self.sh.host.stats()
    }

    /// Engine counters.
    pub fn stats(&self) -> Stats {
        self.sh.st.lock().stats
    }

    /// Drive progress in the calling thread (what `Cq::poll` does too).
    pub fn progress(&self) -> usize {
        let mut st = self.sh.st.lock();
        progress::progress(&self.sh, &mut st)
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    ctx: Context,
    id: u32,
}

impl Pd {
    /// Register `[addr, addr+len)` without pinning it.
    ///
    /// # Safety
    /// The range must be private anonymous memory of this process that stays
    /// mapped while the MR exists (as for `ibv_reg_mr`); the pager may swap
    /// its pages at any time.
    #[allow(unsafe_code)]
    pub unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        // SAFETY: forwarded contract.
        unsafe { reg::register(&self.ctx.sh, self.id, addr, len, access) }
    }

    /// An RC QP of `depth` outstanding send WRs (and `depth` receives).
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, depth: u32) -> Result<Qp, Error> {
        let sh = &self.ctx.sh;
        let qs = QpState::create(sh, self.id, send_cq.inner(), recv_cq.inner(), depth)?;
        let qpn = qs.qpn();
        let (idx, gen) = sh.st.lock().insert_qp(qs);
        Ok(Qp {
            ctx: self.ctx.clone(),
            idx,
            gen,
            qpn,
        })
    }
}

/// An NP-RDMA RC queue pair (a NIC data QP + a control QP).
pub struct Qp {
    ctx: Context,
    idx: usize,
    gen: u8,
    qpn: u32,
}

impl Qp {
    /// The application-visible QP number (the data QP's).
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            addr: self.ctx.sh.host.addr().to_bytes(),
            qpn: self.qpn,
        }
    }

    /// Connect to the peer QP (both sides must connect).
    pub fn connect(&self, peer: &Endpoint) -> Result<(), Error> {
        let mut st = self.ctx.sh.st.lock();
        let qp = st.qp_mut(self.idx, self.gen).ok_or(Error::QpState)?;
        qp.connect(peer)
    }

    /// Set the QP's remote access flags (`qp_access_flags` of
    /// `ibv_modify_qp`; REMOTE_READ / REMOTE_WRITE / REMOTE_ATOMIC count, the
    /// rest is ignored). The peer's READs, WRITEs and atomics this QP does not
    /// grant fail with REM_INV_REQ_ERR at the peer, one-sided (the data QP's
    /// NIC) or two-sided (the target's check). A new QP grants all three.
    pub fn set_remote_access(&self, access: Access) -> Result<(), Error> {
        let mut st = self.ctx.sh.st.lock();
        let qp = st.qp_mut(self.idx, self.gen).ok_or(Error::QpState)?;
        qp.set_remote_access(access)
    }

    /// Post send WRs; on an error, WRs before the failing one were posted.
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<(), (usize, Error)> {
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let r = post::post_send(sh, &mut st, self.idx, self.gen, wrs);
        post::run_ready(sh, &mut st);
        r
    }

    /// Post receive WRs.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), (usize, Error)> {
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let r = post::post_recv(sh, &mut st, self.idx, self.gen, wrs);
        post::run_ready(sh, &mut st);
        r
    }

    /// Move the QP to ERR (`ibv_modify_qp(IBV_QPS_ERR)`), e.g. to drain it
    /// before destroying it: every outstanding send WR (issued, parked,
    /// waiting for keys, two-sided or with a deferred read-back) and every
    /// posted RECV completes exactly once with WR_FLUSH_ERR (5) in post
    /// order, and the pins they held are released. The NIC QPs go to ERR,
    /// so the peer's requests to this QP fail at its side (its operations
    /// complete with an error). Like rdma-core providers, later
    /// `post_send`/`post_recv` on the QP succeed and each WR completes
    /// with WR_FLUSH_ERR. Idempotent; there is no way back (destroy and
    /// recreate the QP).
    pub fn set_error(&self) -> Result<(), Error> {
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        retire::set_error(&mut st, self.idx, self.gen)
    }

    /// Whether the QP is in ERR ([`Qp::set_error`]).
    pub fn is_error(&self) -> bool {
        let mut st = self.ctx.sh.st.lock();
        st.qp_mut(self.idx, self.gen).is_some_and(|q| q.is_error())
    }

    /// Operations of this QP not yet completed.
    pub fn outstanding(&self) -> usize {
        let mut st = self.ctx.sh.st.lock();
        st.qp_mut(self.idx, self.gen)
            .map(|q| q.outstanding())
            .unwrap_or(0)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let sh = &self.ctx.sh;
        let qs = {
            let mut st = sh.st.lock();
            retire::destroy_qp(sh, &mut st, self.idx, self.gen)
        };
        // The NIC QPs and buffers go away outside the engine lock.
        drop(qs);
    }
}
