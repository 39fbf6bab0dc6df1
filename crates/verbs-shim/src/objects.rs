//! The C-visible objects: every libibverbs struct handed to the application is the
//! first field of a `#[repr(C)]` shim object, so the application's pointer converts
//! back by a cast, and what those objects hold (a QP's `ibv_wr_*` batch). Also the
//! entry-point guard (errors -> stderr + errno, no unwinding across the C boundary).

use crate::backend::{self, Ah, Cq, Device, Mr, Pd, Qp, Srq};
use crate::error::{report, set_errno, ShimError};
use crate::ffi::*;
use parking_lot::Mutex;
use rnic::Access;
use std::os::fd::OwnedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// `struct verbs_context` (whose last field is the `ibv_context`) + the device.
#[repr(C)]
pub struct ShimContext {
    pub vctx: verbs_context,
    pub dev: Arc<dyn Device>,
    /// A semaphore eventfd counting the events in `async_events` (readable while any
    /// is queued; `ibv_get_async_event` takes one count per event).
    pub async_fd: OwnedFd,
    /// Asynchronous events not yet taken: (`ibv_event_type`, the QP/SRQ/CQ address).
    pub async_events: Mutex<std::collections::VecDeque<(u32, usize)>>,
    /// `ibv_context.cmd_fd`: a private memfd (there is no uverbs device file).
    pub cmd_fd: OwnedFd,
}

#[repr(C)]
pub struct ShimPd {
    pub pd: ibv_pd,
    pub inner: Arc<dyn Pd>,
    /// MRs, QPs, SRQs and address handles on the backend PD (dealloc is refused while
    /// non-zero). One count for the exporting PD and all its imports, as the kernel
    /// keeps one use count on the PD object every handle names.
    pub users: Arc<AtomicU32>,
    /// Made by `ibv_import_pd` (a second handle on another PD's backend PD).
    pub imported: bool,
}

impl ShimPd {
    /// One more user of this PD, released when the returned value is dropped.
    pub fn take_use(&self) -> PdUse {
        self.users.fetch_add(1, Ordering::AcqRel);
        PdUse {
            users: self.users.clone(),
            handle: self.pd.handle,
        }
    }
}

/// A child object's hold on its PD's use count. Held by value, not through the
/// PD's handle: the application may release an imported PD (`ibv_unimport_pd`, which
/// cannot fail) while QPs, MRs or SRQs made on it live on, as rdma-core allows.
pub struct PdUse {
    users: Arc<AtomicU32>,
    /// The PD's handle (`ibv_pd.handle`, the same for a PD and its imports).
    pub handle: u32,
}

impl Drop for PdUse {
    fn drop(&mut self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Events of an object handed out to the application and not yet acknowledged:
/// the object's destroy waits until there are none (libibverbs' rule for
/// completion and asynchronous events).
#[derive(Default)]
pub struct Unacked {
    n: Mutex<u32>,
    acked: parking_lot::Condvar,
}

impl Unacked {
    /// One more event handed out.
    pub fn handed_out(&self) {
        *self.n.lock() += 1;
    }
    /// `k` of them acknowledged.
    pub fn ack(&self, k: u32) {
        let mut n = self.n.lock();
        *n = n.saturating_sub(k);
        self.acked.notify_all();
    }
    /// Returns once every event handed out is acknowledged.
    pub fn wait_all_acked(&self) {
        let mut n = self.n.lock();
        while *n > 0 {
            self.acked.wait(&mut n);
        }
    }
}

#[repr(C)]
pub struct ShimMr {
    pub mr: ibv_mr,
    pub inner: Box<dyn Mr>,
    /// The access it was registered (or last re-registered) with.
    pub access: Access,
    /// Its PD's use, or `None` for an MR made by `ibv_import_mr` (the registration,
    /// and its use of the PD, belong to the exporting MR).
    pub pd_use: Option<PdUse>,
}

impl ShimMr {
    /// Made by `ibv_import_mr`.
    pub fn imported(&self) -> bool {
        self.pd_use.is_none()
    }
}

#[repr(C)]
pub struct ShimCq {
    /// An `ibv_cq_ex` (its prefix is the `ibv_cq` legacy callers see).
    pub cq: ibv_cq_ex,
    pub inner: Box<dyn Cq>,
    /// QPs completing here (destroy is refused while non-zero).
    pub users: AtomicU32,
    /// The completion an extended-CQ poll is on (`ibv_start_poll` .. `ibv_end_poll`).
    pub cur: Mutex<rnic::Wc>,
    /// Completion events handed out by `ibv_get_cq_event`, acknowledged by
    /// `ibv_ack_cq_events` (`ibv_destroy_cq` waits for them, as libibverbs does).
    pub events: Unacked,
}

#[repr(C)]
pub struct ShimQp {
    /// `qp_base` (the `ibv_qp`) first, so both pointer types convert by a cast.
    pub qp: ibv_qp_ex,
    pub inner: Box<dyn Qp>,
    /// Created with the `ibv_wr_*` send ops.
    pub ex: bool,
    /// The `ibv_wr_start` .. `ibv_wr_complete` batch being built.
    pub batch: Mutex<Batch>,
    /// Its PD's use.
    pub pd_use: PdUse,
    /// Asynchronous events about it handed out by `ibv_get_async_event`,
    /// acknowledged by `ibv_ack_async_event` (`ibv_destroy_qp` waits for them, as
    /// libibverbs does).
    pub async_events: Unacked,
}

/// `struct ibv_srq` + the backend SRQ.
#[repr(C)]
pub struct ShimSrq {
    pub srq: ibv_srq,
    pub inner: Box<dyn Srq>,
    /// QPs receiving from it (destroy is refused while non-zero).
    pub users: AtomicU32,
    /// Its PD's use.
    pub pd_use: PdUse,
}

/// Where an address handle's datagrams go.
pub enum AhRoute {
    /// A device the backend resolved.
    Device(Box<dyn Ah>),
    /// An IP GID: the device whose LID owns each datagram's destination QP number,
    /// if that GID is in its table (`gid::by_gid_and_qpn`).
    ByQpn([u8; 16]),
}

/// `struct ibv_ah` + where it sends.
#[repr(C)]
pub struct ShimAh {
    pub ah: ibv_ah,
    pub inner: AhRoute,
    /// Its PD's use.
    pub pd_use: PdUse,
}

/// One work request of an `ibv_wr_*` batch (see `qp_ex`).
pub struct PendingWr {
    /// The application's `wr_id`.
    pub wr_id: u64,
    /// Its send flags (INLINE is carried by `inline`).
    pub flags: rnic::SendFlags,
    /// The operation.
    pub op: rnic::WrOpcode,
    /// Remote address (RDMA and atomics).
    pub remote_addr: u64,
    /// Remote key (RDMA and atomics).
    pub rkey: u32,
    /// Its gather list.
    pub sges: Vec<rnic::Sge>,
    /// Its inline payload.
    pub inline: Vec<u8>,
    /// A UD QP's destination (`ibv_wr_set_ud_addr`).
    pub ud: Option<rnic::UdDest>,
}

/// The batch a QP builds between `ibv_wr_start` and `ibv_wr_complete` /
/// `ibv_wr_abort` (the builder calls are in `qp_ex`).
#[derive(Default)]
pub struct Batch {
    /// The work requests so far.
    pub wrs: Vec<PendingWr>,
    /// The first error of a builder call, reported at `ibv_wr_complete`.
    pub err: Option<ShimError>,
}

/// `ibv_comp_channel`: its fd is an epoll set over its CQs' event fds.
#[repr(C)]
pub struct ShimChannel {
    pub ch: ibv_comp_channel,
    pub epfd: OwnedFd,
    /// Attached CQs (as addresses of `ShimCq`).
    pub cqs: Mutex<Vec<usize>>,
}

/// Offset of the `ibv_context` inside a `ShimContext`.
const CTX_OFFSET: usize = std::mem::offset_of!(verbs_context, context);

impl ShimContext {
    /// Queue an asynchronous event about the object at `element` (an `ibv_qp`,
    /// `ibv_srq` or `ibv_cq`) for `ibv_get_async_event`.
    pub fn post_async(&self, event_type: u32, element: usize) {
        self.async_events.lock().push_back((event_type, element));
        let _ = rustix::io::write(&self.async_fd, &1u64.to_ne_bytes());
    }

    /// Takes one count of the async fd's semaphore for an event just taken off
    /// the queue (with the queue locked: every count read belongs to a queued
    /// event). Its poster may not have written it yet (it writes after queueing):
    /// then this waits for that write.
    pub fn take_async_count(&self) {
        loop {
            match rustix::io::read(&self.async_fd, &mut [0u8; 8]) {
                Ok(_) => return,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => std::thread::yield_now(),
                Err(e) => {
                    tracing::error!(%e, "async event fd read failed");
                    return;
                }
            }
        }
    }

    /// Drops the queued, not yet taken events about the object at `element`
    /// (it is being destroyed: the kernel forgets an object's unread events
    /// with it, so no event names a destroyed object).
    pub fn forget_async(&self, element: usize) {
        let mut q = self.async_events.lock();
        let before = q.len();
        q.retain(|&(_, el)| el != element);
        for _ in q.len()..before {
            self.take_async_count();
        }
    }

    pub fn ibv(&mut self) -> *mut ibv_context {
        &mut self.vctx.context
    }
    /// The shim context owning `ctx`.
    ///
    /// # Safety
    /// `ctx` must be null or a context returned by our `ibv_open_device` and not closed.
    pub unsafe fn from_ibv<'a>(ctx: *mut ibv_context) -> Result<&'a ShimContext, ShimError> {
        if ctx.is_null() {
            return Err(ShimError::InvalidArgument("NULL context".into()));
        }
        // SAFETY: per the contract ctx points at `vctx.context` of a live ShimContext.
        Ok(unsafe { &*((ctx as *mut u8).sub(CTX_OFFSET) as *const ShimContext) })
    }
}

/// Convert an application pointer back to its shim object.
///
/// # Safety
/// `p` must be null or a pointer this library returned for type `S` (whose first field
/// is the C struct `C`), still alive.
pub unsafe fn shim<'a, C, S>(p: *mut C, what: &str) -> Result<&'a S, ShimError> {
    if p.is_null() {
        return Err(ShimError::InvalidArgument(format!("NULL {what}")));
    }
    // SAFETY: per the contract p is the first field of a live repr(C) S.
    Ok(unsafe { &*(p as *const S) })
}

/// The process device, reported as a shim error.
pub fn device() -> Result<Arc<dyn Device>, ShimError> {
    backend::device()
}

/// Run an entry point: `Err` is reported (stderr + errno) and turned into `fail`; a
/// panic never crosses the C boundary.
pub fn guard<T>(verb: &str, fail: T, f: impl FnOnce() -> Result<T, ShimError>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            report(verb, &e);
            fail
        }
        Err(_) => {
            eprintln!("libnprdma: {verb}: internal error (panic)");
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Like [`guard`] for verbs returning 0 or an errno value.
pub fn guard_rc(verb: &str, f: impl FnOnce() -> Result<(), ShimError>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => report(verb, &e),
        Err(_) => {
            eprintln!("libnprdma: {verb}: internal error (panic)");
            set_errno(libc::EIO);
            libc::EIO
        }
    }
}

static LIVE_QPS: std::sync::LazyLock<Mutex<std::collections::HashSet<usize>>> =
    std::sync::LazyLock::new(Default::default);

/// A QP was handed out at `p`.
pub fn qp_born(p: *mut ibv_qp) {
    LIVE_QPS.lock().insert(p as usize);
}

/// The QP at `p` was destroyed.
pub fn qp_gone(p: *mut ibv_qp) {
    LIVE_QPS.lock().remove(&(p as usize));
}

/// Whether `p` is a QP not yet destroyed (the CM's check before it moves an id's QP,
/// which the application may have destroyed with `ibv_destroy_qp` behind its back).
pub fn qp_live(p: *mut ibv_qp) -> bool {
    !p.is_null() && LIVE_QPS.lock().contains(&(p as usize))
}

/// A zero-initialised bindgen C struct.
///
/// # Safety
/// `T` must be plain C data for which all-zero bytes is valid (integers, raw pointers,
/// `Option<fn>`, unions of those, pthread objects whose static initialiser is all zeros
/// on glibc): true for the libibverbs structs in [`crate::ffi`].
pub unsafe fn zeroed<T>() -> T {
    // SAFETY: per the contract.
    unsafe { std::mem::zeroed() }
}
