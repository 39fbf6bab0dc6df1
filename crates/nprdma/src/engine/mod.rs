//! The NP-RDMA engine: the verbs-shaped public API ([`Context`], [`Pd`],
//! [`Mr`], [`Cq`], [`Qp`]) over a NIC seen through the [`crate::nic`]
//! traits (the backend `backend` names: the software RNIC) and the `vmem`
//! pager, and the per-process polling thread.
//!
//! The engine is a tower of files, each importing only files beneath it
//! (bottom first): `types` (configuration, errors, WRs, counters) →
//! `backend` (the seam: the NIC backend trait and the default backend) →
//! `views` (the IOMMU behind the MR views: the NIC's, or key-only views in
//! user-space mode) → `idhash`, `wrid` (NIC WR ids) → `ucq` (user CQ
//! queues) → `mr` (MR entries) → `regcache` (the registration cache of
//! user-space mode) → `pin` (engine pins, temporary MRs) → `lease` (user-space
//! mode's leases of target registrations) → `dev` (the NIC
//! resources of a context) → `op` (operation records) → `qp` (per-QP state)
//! → `state` (the shared state under the one lock) → `retire` (the one
//! exit of an operation, QP failure and teardown) → `two_sided` → `replay`
//! → `one_sided` → `fast` (the lean path) → `serve` (control messages) →
//! `post` → `progress` (NIC completion dispatch, the polling thread) →
//! `keysync` → `reg` (registration) → `cq` → this file.

mod backend;
mod cq;
mod dev;
mod fast;
mod idhash;
mod keysync;
mod lease;
mod mr;
mod one_sided;
mod op;
mod pin;
mod post;
mod progress;
mod qp;
mod reg;
mod regcache;
mod replay;
mod retire;
mod serve;
mod state;
mod two_sided;
mod types;
mod ucq;
mod views;
mod wrid;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

pub use self::backend::{Backend, DefaultNic, Device, NicStats};
pub use self::cq::Cq;
use self::dev::Dev;
pub use self::pin::{pinned_pages, NicPin};
use self::qp::QpState;
pub use self::qp::MAX_QP_DEPTH;
pub use self::reg::Mr;
use self::state::{Shared, State};
pub use self::types::{Config, Endpoint, Error, RecvWr, SendWr, Stats};
use self::views::{UserKeys, Views};
use crate::adapt::VmemMm;
use crate::check::CheckConfig;
use crate::nic::MemoryManager as _;
pub use crate::nic::{Access, CompOp, Completion, Sge};
pub use crate::plan::AppOp as Opcode;

/// An NP-RDMA device context: one per process and host, owning the polling
/// thread that serves all its QPs and CQs.
pub struct Context<N: Backend = DefaultNic> {
    sh: Arc<Shared<N>>,
    _poller: Arc<PollerGuard<N>>,
}

impl<N: Backend> Clone for Context<N> {
    fn clone(&self) -> Self {
        Context {
            sh: self.sh.clone(),
            _poller: self._poller.clone(),
        }
    }
}

struct PollerGuard<N: Backend> {
    sh: Arc<Shared<N>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<N: Backend> Drop for PollerGuard<N> {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        self.sh.armed_cqs.wake_poller();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Context {
    /// Open NP-RDMA on `host` (the software RNIC) with the process's `pager`.
    pub fn new(host: &Device, pager: &vmem::Pager, cfg: Config) -> Result<Context, Error> {
        Context::with_nic(backend::open(host)?, pager, cfg)
    }
}

impl<N: Backend> Context<N> {
    /// Open NP-RDMA on `nic` (one PD of any backend) with the process's
    /// `pager`. A NIC with IOMMU control runs the paper's kernel-module mode
    /// (optimistic one-sided operations over the Read/Write MR views); one
    /// without ([`crate::nic::Nic::iommu`] is `None`, e.g. a libibverbs
    /// device) the paper's **user-space mode**: every READ/WRITE goes
    /// two-sided (`plan.user_space_mode`; no retry-one-sided form) — the
    /// initiator registers its local range on the fly or sends it inline
    /// (≤ the inline limit), the target pins, registers on the fly and
    /// performs the reverse operation, and both deregister; atomics,
    /// SEND/RECV and WRITE_WITH_IMM as always. The app MRs' views are then
    /// key-only (no NIC registration, no Version MR); the control rings,
    /// read-back scratch and zero source are the long-lived registrations.
    pub fn with_nic(nic: N, pager: &vmem::Pager, cfg: Config) -> Result<Context<N>, Error> {
        if std::env::var_os("NPRDMA_TRACE").is_some_and(|v| v == "1") {
            crate::trace::enable(true);
        }
        let caps = nic.caps();
        let mut cfg = cfg;
        let iommu = match nic.iommu() {
            Some(io) => Views::Nic(io),
            None => {
                // The paper's user-space mode: every READ/WRITE two-sided
                // (the target performs the reverse operation over MRs
                // registered on the fly), never the retry-one-sided form.
                cfg.plan.user_space_mode = true;
                cfg.retry_mode = false;
                Views::User(UserKeys::new())
            }
        };
        let iommu = Arc::new(iommu);
        let depth = cfg.nic_cq_depth.min(caps.max_cqe);
        let ncq = nic.create_cq(depth).map_err(N::error)?;
        let rcq = nic.create_cq(depth).map_err(N::error)?;
        let check = CheckConfig::new(
            caps.max_tlp,
            caps.magic,
            caps.page_size,
            crate::check::AtomGrid::Aligned,
        )
        .map_err(|e| Error::Other(e.to_string()))?;
        let cache = Arc::new(regcache::RegCache::new(if iommu.is_user() {
            cfg.reg_cache_bytes
        } else {
            0
        }));
        let mm = VmemMm(pager.clone());
        let cache_listener = cache
            .enabled()
            .then(|| mm.add_swap_listener(cache.clone() as Arc<dyn crate::nic::SwapListener>));
        let leases = Arc::new(lease::Leases::new(
            if iommu.is_user() { cfg.lease_bytes } else { 0 },
            cfg.lease_ms,
        ));
        let lease_listener = leases
            .enabled()
            .then(|| mm.add_swap_listener(leases.clone() as Arc<dyn crate::nic::SwapListener>));
        let sh = Arc::new(Shared {
            dev: Dev {
                cache,
                cache_listener,
                leases,
                lease_listener,
                ncq,
                rcq,
                iommu,
                nic,
                caps,
                mm,
                check,
                cfg,
            },
            st: Mutex::new(State::new()),
            stop: AtomicBool::new(false),
            app_polls: AtomicU64::new(0),
            armed_cqs: Arc::default(),
        });
        let s2 = sh.clone();
        let t = std::thread::Builder::new()
            .name("nprdma-poll".into())
            .spawn(move || progress::poller(s2))
            .map_err(|e| Error::Other(e.to_string()))?;
        sh.armed_cqs.set_poller(t.thread().clone());
        Ok(Context {
            _poller: Arc::new(PollerGuard {
                sh: sh.clone(),
                thread: Mutex::new(Some(t)),
            }),
            sh,
        })
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Pd<N> {
        let mut st = self.sh.st.lock();
        st.next_pd += 1;
        Pd {
            ctx: self.clone(),
            id: st.next_pd,
        }
    }

    /// A user-space CQ of `depth` entries.
    pub fn create_cq(&self, depth: u32) -> Result<Cq<N>, Error> {
        Cq::new(self.sh.clone(), depth)
    }

    /// The NIC's statistics (the software NIC's `nonresident_dma` must stay 0).
    pub fn nic_stats(&self) -> N::Stats {
        self.sh.nic.stats()
    }

    /// Engine counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.sh.st.lock().stats;
        let c = self.sh.cache.counts();
        s.reg_cache_hits = c.hits;
        s.reg_cache_misses = c.misses;
        s.reg_cache_invalidations = c.invalidations;
        let l = self.sh.leases.counts();
        s.leases_granted = l.granted;
        s.leases_renewed = l.renewed;
        s.leases_released = l.released;
        s.leases_expired = l.expired;
        s
    }

    /// Pin `[addr, addr+len)` of the MR `lkey` for a NIC of this host that
    /// reaches the memory through a plain NIC MR over it (writing it if
    /// `write`, which needs LOCAL_WRITE; the caller checks the PD): swapped-out
    /// pages are brought in, and the pages stay resident for the NIC and
    /// mapped in the MR's NIC views until the [`NicPin`] is dropped.
    /// [`Error::Invalid`]: no MR with that key covers the range (or it is not
    /// writable).
    pub fn pin_for_nic(
        &self,
        lkey: u32,
        addr: u64,
        len: u64,
        write: bool,
    ) -> Result<NicPin<N>, Error> {
        let for_ = if write {
            crate::nic::PinFor::Write
        } else {
            crate::nic::PinFor::Read
        };
        reg::pin_for_nic(&self.sh, lkey, addr, len, for_)
    }

    /// Drive progress in the calling thread (what `Cq::poll` does too).
    pub fn progress(&self) -> usize {
        let mut st = self.sh.st.lock();
        progress::progress(&self.sh, &mut st)
    }
}

/// A protection domain.
pub struct Pd<N: Backend = DefaultNic> {
    ctx: Context<N>,
    id: u32,
}

impl<N: Backend> Clone for Pd<N> {
    fn clone(&self) -> Self {
        Pd {
            ctx: self.ctx.clone(),
            id: self.id,
        }
    }
}

impl<N: Backend> Pd<N> {
    /// Register `[addr, addr+len)` without pinning it. Memory the pager
    /// cannot page (hugetlbfs, file mappings outside tmpfs) is taken as a
    /// pinning NIC takes it: always resident (`vmem::Pager::register_foreign_raw`;
    /// before unmapping it, `vmem::Pager::forget_foreign`).
    ///
    /// # Safety
    /// The range must be memory of this process that stays mapped while the
    /// MR exists (as for `ibv_reg_mr`); the pager may swap its private
    /// anonymous pages at any time.
    #[allow(unsafe_code)]
    pub unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<Mr<N>, Error> {
        // SAFETY: forwarded contract.
        unsafe { reg::register(&self.ctx.sh, self.id, addr, len, access) }
    }

    /// This PD's id, for [`Mr::rereg`].
    pub fn id(&self) -> u32 {
        self.id
    }

    /// A shared receive queue of `depth` receives, for QPs of this context
    /// ([`Qp::attach_srq`]); their messages take its receives in post order.
    pub fn create_srq(&self, depth: u32) -> Result<Srq<N>, Error> {
        if depth == 0 {
            return Err(Error::Invalid("SRQ depth 0"));
        }
        Ok(Srq {
            ctx: self.ctx.clone(),
            shared: Arc::new(qp::SrqShared {
                recvs: parking_lot::Mutex::new(std::collections::VecDeque::new()),
                depth,
                pd: self.id,
            }),
        })
    }

    /// An RC QP of `depth` outstanding send WRs (and `depth` receives).
    pub fn create_qp(&self, send_cq: &Cq<N>, recv_cq: &Cq<N>, depth: u32) -> Result<Qp<N>, Error> {
        let sh = &self.ctx.sh;
        let qs = QpState::create(sh, self.id, send_cq.inner(), recv_cq.inner(), depth, None)?;
        let qpn = qs.qpn();
        let ctrl_qpn = qs.ctrl_qpn_for_peer();
        let (idx, gen) = sh.st.lock().insert_qp(qs);
        Ok(Qp {
            ctx: self.ctx.clone(),
            slot: std::sync::atomic::AtomicU64::new(slot_of(idx, gen)),
            qpn,
            ctrl_qpn,
        })
    }
}

/// A shared receive queue ([`Pd::create_srq`]).
pub struct Srq<N: Backend = DefaultNic> {
    ctx: Context<N>,
    shared: Arc<qp::SrqShared>,
}

impl<N: Backend> Srq<N> {
    /// Post receives (`ibv_post_srq_recv`): taken by whichever attached QP's
    /// message arrives first. On error, `(index of the failed WR, why)`; the
    /// WRs before it were posted.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), (usize, Error)> {
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        post::post_srq_recv(sh, &mut st, &self.shared, wrs)
    }

    /// Capacity in receives.
    pub fn depth(&self) -> u32 {
        self.shared.depth
    }
}

/// An NP-RDMA queue pair (a NIC data QP + a control QP): RC, or UC after
/// [`Qp::set_unreliable`].
pub struct Qp<N: Backend = DefaultNic> {
    ctx: Context<N>,
    /// The QP's slot in the engine state: index << 8 | generation (a new one
    /// after [`Qp::reset`]).
    slot: std::sync::atomic::AtomicU64,
    qpn: u32,
    ctrl_qpn: u32,
}

fn slot_of(idx: usize, gen: u8) -> u64 {
    (idx as u64) << 8 | u64::from(gen)
}

impl<N: Backend> Qp<N> {
    /// The QP's slot: (index, generation).
    fn at(&self) -> (usize, u8) {
        let s = self.slot.load(std::sync::atomic::Ordering::Acquire);
        ((s >> 8) as usize, s as u8)
    }

    /// The application-visible QP number (the data QP's).
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            addr: self.ctx.sh.nic.addr().0,
            qpn: self.qpn,
            ctrl_qpn: self.ctrl_qpn,
        }
    }

    /// Connect to the peer QP (both sides must connect).
    pub fn connect(&self, peer: &Endpoint) -> Result<(), Error> {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let (pd, access) = {
            let mut st = sh.st.lock();
            let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
            (qp.pd, qp.remote_access)
        };
        // The peer may reach every lease's key through this QP: none it has
        // no right to may be left (no new one is lent while this QP exists).
        sh.leases.expose_wait(pd, access);
        let mut st = sh.st.lock();
        let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
        qp.connect(peer)
    }

    /// Set the QP's remote access flags (`qp_access_flags` of
    /// `ibv_modify_qp`; REMOTE_READ / REMOTE_WRITE / REMOTE_ATOMIC count, the
    /// rest is ignored). The peer's READs, WRITEs and atomics this QP does not
    /// grant fail with REM_INV_REQ_ERR at the peer, one-sided (the data QP's
    /// NIC) or two-sided (the target's check). A new QP grants all three.
    pub fn set_remote_access(&self, access: Access) -> Result<(), Error> {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let (pd, now) = {
            let mut st = sh.st.lock();
            let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
            qp.set_remote_access(access)?;
            (qp.pd, qp.remote_access)
        };
        // Fewer rights: the leases lent with the ones taken away go first.
        sh.leases.expose_wait(pd, now);
        Ok(())
    }

    /// Set the QP's receiver-not-ready policy, as `ibv_modify_qp` does:
    /// `rnr_retry` (0–7; 7, the default, = forever; larger values count as 7)
    /// for the SENDs and WRITE_WITH_IMMs this QP sends, and `min_rnr_timer`
    /// (IB's 5-bit code: 0 = 655.36 ms, 1 = 10 µs … 31 = 491.52 ms; default
    /// 12 = 0.64 ms) for the ones it receives. A message that finds no RECV
    /// posted waits at the receiver for `rnr_retry` × the receiver's timer
    /// (a RECV posted meanwhile takes it), then its WR completes with
    /// RNR_RETRY_EXC_ERR and the sender's QP fails (RC's error rule); with
    /// `rnr_retry` 0 at once, with 7 for as long as it takes. `None` leaves a
    /// value as it is.
    pub fn set_rnr(&self, rnr_retry: Option<u8>, min_rnr_timer: Option<u8>) -> Result<(), Error> {
        let (idx, gen) = self.at();
        let mut st = self.ctx.sh.st.lock();
        let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
        if let Some(r) = rnr_retry {
            qp.rnr_retry = r.min(7);
        }
        if let Some(t) = min_rnr_timer {
            qp.min_rnr_timer = t & 31;
        }
        Ok(())
    }

    /// Post send WRs; on an error, WRs before the failing one were posted.
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<(), (usize, Error)> {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        // Held until the lock below is released (dropped after it).
        let _pinned = post::prefault(sh, wrs);
        let mut st = sh.st.lock();
        let r = post::post_send(sh, &mut st, idx, gen, wrs);
        post::run_ready(sh, &mut st);
        r
    }

    /// Post receive WRs.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), (usize, Error)> {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let r = post::post_recv(sh, &mut st, idx, gen, wrs);
        post::run_ready(sh, &mut st);
        r
    }

    /// Take this QP's receives from `srq` (an SRQ of this context) instead of
    /// its own receive queue, whose `post_recv` is then refused. Before the QP
    /// has receives of its own or messages waiting.
    pub fn attach_srq(&self, srq: &Srq<N>) -> Result<(), Error> {
        let (idx, gen) = self.at();
        if !Arc::ptr_eq(&self.ctx.sh, &srq.ctx.sh) {
            return Err(Error::Invalid("SRQ of another context"));
        }
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
        if !qp.recvs.is_empty() || !qp.inbound.is_empty() {
            return Err(Error::Invalid("the QP has receives or messages of its own"));
        }
        qp.srq = Some(srq.shared.clone());
        Ok(())
    }

    /// Make this QP unreliable-connected (IB's UC service over the same engine):
    /// READ and atomics are refused at post (`Error::Invalid`); a message or WRITE
    /// the responder refuses — no receive posted, a receive too small, a bad key —
    /// is dropped there (its receive stays posted, its QP stays up) and the WR
    /// completes successfully at the requester, which on UC never hears back.
    /// Both ends of a connection must be UC (as on verbs, the service is part of
    /// the connection); set it before posting.
    pub fn set_unreliable(&self) -> Result<(), Error> {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let qp = st.qp_mut(idx, gen).ok_or(Error::QpState)?;
        qp.unreliable = true;
        Ok(())
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
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        retire::set_error(&mut st, idx, gen)
    }

    /// Move the QP to RESET (`ibv_modify_qp(IBV_QPS_RESET)`, from any state),
    /// so that it can be connected again ([`Qp::connect`]) to the same or
    /// another peer QP, keeping its number, PD, CQs, depth, SRQ and service
    /// (RC/UC); remote access and the RNR policy go back to their defaults.
    /// As on verbs hardware (IB: "WQEs are removed without completion"; mlx5
    /// also cleans the QP's completions out of its CQs), what is outstanding
    /// is dropped and the QP's completions still queued in its CQs go with
    /// it. Its NIC QPs are reset in place, so a peer connected to it
    /// meanwhile still reaches it. If they cannot be, the QP stays unusable
    /// (every later call fails with `Error::QpState`) and the error is
    /// returned.
    pub fn reset(&self) -> Result<(), Error> {
        let sh = &self.ctx.sh;
        let (idx, gen) = self.at();
        let old = {
            let mut st = sh.st.lock();
            st.qp_mut(idx, gen).ok_or(Error::QpState)?;
            let old = retire::destroy_qp(sh, &mut st, idx, gen).ok_or(Error::QpState)?;
            old.send_cq.discard_qp(self.qpn);
            old.recv_cq.discard_qp(self.qpn);
            old
        };
        // The NIC QPs go to RESET outside the engine lock.
        let qs = old.renew(sh)?;
        let (idx, gen) = sh.st.lock().insert_qp(qs);
        self.slot
            .store(slot_of(idx, gen), std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Whether the QP is in ERR ([`Qp::set_error`]).
    pub fn is_error(&self) -> bool {
        let (idx, gen) = self.at();
        let mut st = self.ctx.sh.st.lock();
        st.qp_mut(idx, gen).is_some_and(|q| q.is_error())
    }

    /// Operations of this QP not yet completed.
    pub fn outstanding(&self) -> usize {
        let (idx, gen) = self.at();
        let mut st = self.ctx.sh.st.lock();
        st.qp_mut(idx, gen).map(|q| q.outstanding()).unwrap_or(0)
    }
}

impl<N: Backend> Drop for Qp<N> {
    fn drop(&mut self) {
        let (idx, gen) = self.at();
        let sh = &self.ctx.sh;
        let qs = {
            let mut st = sh.st.lock();
            retire::destroy_qp(sh, &mut st, idx, gen)
        };
        // The NIC QPs and buffers go away outside the engine lock.
        drop(qs);
    }
}
