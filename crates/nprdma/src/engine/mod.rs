//! The NP-RDMA engine: the verbs-shaped public API ([`Context`], [`Pd`],
//! [`Mr`], [`Cq`], [`Qp`]) over the software RNIC and the `vmem` pager, and
//! the per-process polling thread. The state machine of the operations is
//! in `core`; registration in `mr`.

// TODO(h-tower): documented by the tower split
#![allow(missing_docs)]

mod core;
mod ctrlbuf;
mod idhash;
mod mr;
mod ucq;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use self::core::Endpoint;
use self::core::{QpState, Shared, State};
pub use self::mr::Mr;
pub use self::ucq::Cq;
use crate::adapt::{RnicIommu, VmemMm};
use crate::check::CheckConfig;
use crate::ctrl::CtrlConfig;
pub use crate::nic::{Access, CompOp, Completion, Sge};
use crate::ordering::OrderConfig;
pub use crate::plan::AppOp as Opcode;
use crate::plan::PlanConfig;

/// Engine errors (post-time and setup); execution errors are completions.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("NIC: {0}")]
    Nic(#[from] rnic::Error),
    #[error("pager: {0}")]
    Pager(#[from] vmem::Error),
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("queue full")]
    QueueFull,
    #[error("QP is not connected or in error")]
    QpState,
    #[error("{0}")]
    Other(String),
}

/// Engine configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The polling thread blocks at once when idle (no spinning).
    pub interrupt_mode: bool,
    /// How long the polling thread spins after its last piece of work.
    pub spin: Duration,
    /// Planner thresholds (small-WRITE read-back limit, versioned READ, inline limit).
    ///
    /// The default `plan.write_version_threshold` is **4096**: WRITEs up to
    /// one page use WRITE + read-back, longer ones page versions. Measured
    /// on the software NIC (in-process, 2 B–16 KiB signaled WRITE medians,
    /// best of 3, `NPRDMA_WRITE_VERSION_THRESHOLD` in the `bench` example):
    /// read-back 0.72 / 0.90 / 1.15 / 2.98 µs at 512 B / 4 / 8 / 16 KiB,
    /// versions 0.98 / 1.04 / 1.37 µs at 4 / 8 / 16 KiB — the crossover lies
    /// between 4 and 8 KiB, and a read-back also moves the payload twice
    /// through the NIC (halving WRITE throughput) while versions add 8 B
    /// per page. `PlanConfig::default()` itself (16 KiB) is the planner's
    /// generic value; the QP's read-back scratch is `max(threshold, 4 KiB)`
    /// per WR of depth.
    pub plan: PlanConfig,
    /// Ordering configuration of every QP.
    pub order: OrderConfig,
    /// Control-channel configuration (inline limit).
    pub ctrl: CtrlConfig,
    /// Retry mode: fault requests ask the target for Receiver-Ready and
    /// retry one-sided.
    pub retry_mode: bool,
    /// Entries of the NIC CQ shared by all QPs of the context.
    pub nic_cq_depth: u32,
    /// A two-sided request unanswered this long completes with
    /// RETRY_EXC_ERR (the peer destroyed its QP or died).
    pub two_sided_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interrupt_mode: false,
            spin: Duration::from_micros(50),
            plan: PlanConfig {
                write_version_threshold: 4096,
                ..PlanConfig::default()
            },
            order: OrderConfig::default(),
            ctrl: CtrlConfig::default(),
            retry_mode: false,
            nic_cq_depth: 32768,
            two_sided_timeout: Duration::from_secs(5),
        }
    }
}

/// One application send WR (one SGE at most: NP-RDMA's WRs carry a single
/// local range).
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: Opcode,
    pub sge: Option<Sge>,
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    /// Wait until nothing of this QP is in flight before issuing.
    pub order_before: bool,
    /// Issue nothing behind this WR until it completes.
    pub order_after: bool,
}

impl SendWr {
    /// A signaled WR.
    pub fn new(wr_id: u64, op: Opcode, sge: Option<Sge>, remote_addr: u64, rkey: u32) -> Self {
        SendWr {
            wr_id,
            op,
            sge,
            remote_addr,
            rkey,
            signaled: true,
            order_before: false,
            order_after: false,
        }
    }
}

/// One application receive WR.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sge: Option<Sge>,
}

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
            host: host.clone(),
            iommu: Arc::new(RnicIommu::new(host.clone(), pd.clone())),
            pd,
            mm: VmemMm(pager.clone()),
            chan,
            ncq,
            rcq,
            check,
            cfg,
            st: Mutex::new(State::new()),
            stop: AtomicBool::new(false),
            app_polls: AtomicU64::new(0),
            _ctx: ctx,
        });
        let s2 = sh.clone();
        let t = std::thread::Builder::new()
            .name("nprdma-poll".into())
            .spawn(move || poller(s2))
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
        core::progress(&self.sh, &mut st)
    }
}

/// Engine counters (per context).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Optimistic one-sided attempts that passed their check.
    pub optimistic_ok: u64,
    /// Operations that went (or fell back) to the two-sided path.
    pub two_sided: u64,
    /// Local pre-check fix-ups (pin + map-in before issuing).
    pub local_fixups: u64,
    /// Two-sided requests served as target.
    pub served: u64,
    /// Key queries sent.
    pub key_queries: u64,
    /// Retry-mode one-sided retries after Receiver-Ready.
    pub retries: u64,
    /// Unsignaled WRITEs whose read-back was deferred.
    pub deferred_writes: u64,
    /// Read-back READs posted for deferred WRITEs (contiguous ones merged).
    pub readback_batches: u64,
    /// Ops pipelined behind an op whose optimistic check then failed: their
    /// one-sided result was discarded and they ran again after it.
    pub replayed: u64,
    /// Large READs whose version probe found a page out: they went
    /// two-sided without copying signature frames first.
    pub probed_out: u64,
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
        unsafe { mr::register(&self.ctx.sh, self.id, addr, len, access) }
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
        let r = core::post_send(sh, &mut st, self.idx, self.gen, wrs);
        core::run_ready(sh, &mut st);
        r
    }

    /// Post receive WRs.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), (usize, Error)> {
        let sh = &self.ctx.sh;
        let mut st = sh.st.lock();
        let r = core::post_recv(sh, &mut st, self.idx, self.gen, wrs);
        core::run_ready(sh, &mut st);
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
        core::set_error(&mut st, self.idx, self.gen)
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
            core::destroy_qp(sh, &mut st, self.idx, self.gen)
        };
        // The NIC QPs and buffers go away outside the engine lock.
        drop(qs);
    }
}

/// The polling thread: progress while there is work, spin briefly, then
/// block on the NIC completion channel. While an application thread is
/// polling its CQ (and so progressing inline), it stays out of the way.
///
/// The spin window adapts: work that arrives only after the thread blocked
/// doubles it (up to 40 × `Config::spin`), so a peer whose requests come a
/// little slower than `spin` apart (e.g. two-sided fault requests on a loaded
/// machine) is not served through a sleep/wake (~40–50 µs here, ms under
/// load) every time; a blocking wait that times out idle resets it.
fn poller(sh: Arc<Shared>) {
    let mut last_work = Instant::now();
    let mut window = sh.cfg.spin;
    let max_window = sh.cfg.spin.saturating_mul(40);
    let mut seen = sh.app_polls.load(Ordering::Relaxed);
    // While spinning, this thread also serves the NIC's request rings (peers'
    // small READ/WRITE and atomics) so the NIC thread need not spin as well: a
    // second spinner per process on a 2-core machine turns µs into ms.
    let mut rings = RingPolling::new(&sh.host, !sh.cfg.interrupt_mode);
    while !sh.stop.load(Ordering::Acquire) {
        let polls = sh.app_polls.load(Ordering::Relaxed);
        if polls != seen {
            seen = polls;
            rings.stop();
            std::thread::sleep(Duration::from_micros(500));
            continue;
        }
        let n = {
            let mut st = sh.st.lock();
            core::progress(&sh, &mut st)
        };
        if n > 0 || rings.serve() {
            last_work = Instant::now();
            continue;
        }
        if !sh.cfg.interrupt_mode && last_work.elapsed() < window {
            rings.start();
            std::hint::spin_loop();
            continue;
        }
        if rings.stop() {
            last_work = Instant::now();
            continue;
        }
        for cq in [&sh.ncq, &sh.rcq] {
            if let Err(e) = cq.req_notify(false) {
                tracing::error!(error = %e, "arming a NIC CQ failed");
            }
        }
        let n = {
            let mut st = sh.st.lock();
            core::progress(&sh, &mut st)
        };
        if n > 0 {
            last_work = Instant::now();
            continue;
        }
        match sh.chan.get_event(Some(Duration::from_millis(20))) {
            Ok(_) => {
                last_work = Instant::now();
                window = window.saturating_mul(2).min(max_window);
            }
            Err(rnic::Error::Timeout) => window = sh.cfg.spin,
            Err(e) => {
                tracing::error!(error = %e, "completion channel failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    rings.stop();
}

/// The polling thread's turn at serving the NIC's request rings
/// (`rnic::Host::set_ring_polling`): on while it spins, off before it blocks.
struct RingPolling<'a> {
    host: &'a rnic::Host,
    enabled: bool,
    on: bool,
}

impl<'a> RingPolling<'a> {
    fn new(host: &'a rnic::Host, enabled: bool) -> Self {
        RingPolling {
            host,
            enabled,
            on: false,
        }
    }
    fn start(&mut self) {
        if self.enabled && !self.on {
            self.on = true;
            self.host.set_ring_polling(true);
        }
    }
    /// Serve pending ring requests (while on); whether any was served.
    fn serve(&mut self) -> bool {
        self.on && self.host.serve_rings()
    }
    /// Hand the rings back to the NIC thread; whether pending ones were served.
    fn stop(&mut self) -> bool {
        if !self.on {
            return false;
        }
        self.on = false;
        self.host.set_ring_polling(false)
    }
}
