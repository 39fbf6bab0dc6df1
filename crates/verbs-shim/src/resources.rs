//! Resource verbs: PDs, MRs, completion channels, CQs and their events, QPs
//! (create / modify / query / destroy), shared receive queues, and clean refusals for
//! what the NIC does not model (multicast, ECE, rereg/resize, …).

use crate::convert::{qp_attr_from_c, qp_attr_to_c};
use crate::error::{set_errno, ShimError};
use crate::ffi::*;
use crate::objects::{
    guard, guard_rc, shim, zeroed, ShimChannel, ShimContext, ShimCq, ShimMr, ShimPd, ShimQp,
    ShimSrq,
};
use parking_lot::Mutex;
use rnic::{Access, QpInitAttr};
use rustix::event::epoll;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};

fn nonnull<T>(p: *mut T, what: &str) -> Result<(), ShimError> {
    if p.is_null() {
        Err(ShimError::InvalidArgument(format!("NULL {what}")))
    } else {
        Ok(())
    }
}

// ---- PD ----

/// What `ibv_import_pd` / `ibv_import_mr` find by handle: the live (exporting) PDs
/// and MRs of the process. Handles are unique per process (any context may import).
struct Exports {
    next: u32,
    /// Each PD's backend and its use count (shared with its imports).
    pds: HashMap<u32, (Arc<dyn crate::backend::Pd>, Arc<AtomicU32>)>,
    mrs: HashMap<u32, MrExport>,
}

#[derive(Clone, Copy)]
struct MrExport {
    pd_handle: u32,
    length: u64,
    lkey: u32,
    rkey: u32,
}

static EXPORTS: LazyLock<Mutex<Exports>> = LazyLock::new(|| {
    Mutex::new(Exports {
        next: 1,
        pds: HashMap::new(),
        mrs: HashMap::new(),
    })
});

impl Exports {
    fn handle(&mut self) -> u32 {
        let h = self.next;
        self.next = self.next.wrapping_add(1).max(1);
        h
    }
}

/// An imported MR: the registration belongs to the exporting MR (keys only).
struct ImportedMr {
    lkey: u32,
    rkey: u32,
}

impl crate::backend::Mr for ImportedMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
}

/// # Safety
/// `ctx` an open context.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard("ibv_alloc_pd", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        let s = unsafe { ShimContext::from_ibv(ctx)? };
        let inner = s.dev.alloc_pd()?;
        let users = Arc::new(AtomicU32::new(0));
        let mut ex = EXPORTS.lock();
        let handle = ex.handle();
        ex.pds.insert(handle, (inner.clone(), users.clone()));
        let pd = ibv_pd {
            context: ctx,
            handle,
        };
        let p = Box::into_raw(Box::new(ShimPd {
            pd,
            inner,
            users,
            imported: false,
        }));
        Ok(p as *mut ibv_pd)
    })
}

/// # Safety
/// `pd` from `ibv_alloc_pd`.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard_rc("ibv_dealloc_pd", || {
        // SAFETY: caller contract.
        let s: &ShimPd = unsafe { shim(pd, "PD")? };
        if s.users.load(Ordering::Acquire) != 0 {
            return Err(ShimError::Busy(
                "PD still has MRs, QPs or address handles".into(),
            ));
        }
        if !s.imported {
            EXPORTS.lock().pds.remove(&s.pd.handle);
        }
        // SAFETY: allocated by ibv_alloc_pd / ibv_import_pd.
        drop(unsafe { Box::from_raw(pd as *mut ShimPd) });
        Ok(())
    })
}

// ---- MR ----

const SUPPORTED_ACCESS: u32 = IBV_ACCESS_LOCAL_WRITE
    | IBV_ACCESS_REMOTE_WRITE
    | IBV_ACCESS_REMOTE_READ
    | IBV_ACCESS_REMOTE_ATOMIC
    | IBV_ACCESS_RELAXED_ORDERING
    | IBV_ACCESS_HUGETLB;

/// A registration that lets anyone write (LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC)
/// needs memory the process can write: a NIC pins it for writing and refuses
/// read-only mappings with EFAULT.
fn check_writable(addr: usize, len: usize, acc: Access) -> Result<(), ShimError> {
    let writes = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    if len > 0 && acc.intersects(writes) && crate::maps::all_writable(addr, len) == Some(false) {
        return Err(ShimError::Fault(format!(
            "{len} bytes at {addr:#x} are not all mapped writable (access {acc:?} writes)"
        )));
    }
    Ok(())
}

unsafe fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> Result<*mut ibv_mr, ShimError> {
    // SAFETY: caller contract.
    let s: &ShimPd = unsafe { shim(pd, "PD")? };
    let mut access = access as u32;
    if access & IBV_ACCESS_ON_DEMAND != 0 {
        // SAFETY: the PD's context is an open context of ours.
        let ctx = unsafe { ShimContext::from_ibv(s.pd.context)? };
        if !ctx.dev.odp() {
            return Err(ShimError::Unsupported(
                "IBV_ACCESS_ON_DEMAND (no ODP in pinned mode)".into(),
            ));
        }
        if addr.is_null() && len == usize::MAX {
            return Err(ShimError::Unsupported(
                "implicit ODP MRs (IBV_ODP_SUPPORT_IMPLICIT is not offered)".into(),
            ));
        }
        // NP-RDMA MRs are on demand already.
        access &= !IBV_ACCESS_ON_DEMAND;
    }
    if access & !SUPPORTED_ACCESS != 0 {
        return Err(ShimError::Unsupported(format!(
            "MR access flags {:#x} (supported: LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC, RELAXED_ORDERING, HUGETLB)",
            access & !SUPPORTED_ACCESS
        )));
    }
    if iova != addr as u64 {
        return Err(ShimError::Unsupported(format!(
            "MR with iova {iova:#x} != addr {:#x}",
            addr as u64
        )));
    }
    // Relaxed ordering is a PCIe hint, HUGETLB a hint that the memory is backed by
    // huge pages (how it is backed is read from the memory itself): dropped.
    let acc = Access::from_bits_truncate(access & !IBV_ACCESS_HUGETLB);
    check_writable(addr as usize, len, acc)?;
    // SAFETY: the application keeps [addr, addr+len) mapped while the MR is registered
    // (the ibv_reg_mr contract).
    let inner = unsafe { s.inner.reg_mr(addr as usize, len, acc)? };
    let mut ex = EXPORTS.lock();
    let handle = ex.handle();
    ex.mrs.insert(
        handle,
        MrExport {
            pd_handle: s.pd.handle,
            length: len as u64,
            lkey: inner.lkey(),
            rkey: inner.rkey(),
        },
    );
    drop(ex);
    let mr = ibv_mr {
        context: s.pd.context,
        pd,
        addr,
        length: len as u64,
        handle,
        lkey: inner.lkey(),
        rkey: inner.rkey(),
    };
    Ok(Box::into_raw(Box::new(ShimMr {
        mr,
        inner,
        access: acc,
        pd_use: Some(s.take_use()),
    })) as *mut ibv_mr)
}

/// `ibv_rereg_mr`: move an MR to another PD (`IBV_REREG_MR_CHANGE_PD`), range
/// (`_TRANSLATION`) or access (`_ACCESS`), keeping its keys; the NIC is fenced off the
/// old registration first (as by a deregistration). 0, or `IBV_REREG_MR_ERR_INPUT`
/// (bad flags or arguments, nothing changed) / `IBV_REREG_MR_ERR_CMD` (refused,
/// nothing changed) with errno set, as libibverbs returns them. Pinned mode; an
/// NP-RDMA MR (whose keys its peers have synced) is refused with EOPNOTSUPP.
///
/// # Safety
/// `mr` ours; `pd` ours when changing the PD; a new range stays mapped while
/// registered.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    let flags = flags as u32;
    let translation = flags & IBV_REREG_MR_CHANGE_TRANSLATION != 0;
    let bad_input = mr.is_null()
        || flags & !IBV_REREG_MR_FLAGS_SUPPORTED != 0
        || (translation && (addr.is_null() || length == 0))
        || (!translation && (!addr.is_null() || length != 0))
        || (flags & IBV_REREG_MR_CHANGE_PD != 0 && pd.is_null());
    if bad_input {
        crate::error::report(
            "ibv_rereg_mr",
            &ShimError::InvalidArgument("flags, PD, address or length".into()),
        );
        return IBV_REREG_MR_ERR_INPUT;
    }
    let rc = guard_rc("ibv_rereg_mr", || {
        // SAFETY: caller contract.
        let s: &mut ShimMr = unsafe { &mut *(mr as *mut ShimMr) };
        if s.imported() {
            return Err(ShimError::InvalidArgument("an imported MR".into()));
        }
        let new_pd: Option<&ShimPd> = if flags & IBV_REREG_MR_CHANGE_PD != 0 {
            // SAFETY: caller contract.
            Some(unsafe { shim(pd, "PD")? })
        } else {
            None
        };
        let acc = if flags & IBV_REREG_MR_CHANGE_ACCESS != 0 {
            let a = access as u32;
            if a & !SUPPORTED_ACCESS != 0 {
                return Err(ShimError::Unsupported(format!(
                    "MR access flags {:#x}",
                    a & !SUPPORTED_ACCESS
                )));
            }
            Some(Access::from_bits_truncate(a))
        } else {
            None
        };
        let range = translation.then_some((addr as usize, length));
        if range.is_some() || acc.is_some() {
            let (a, l) = range.unwrap_or((s.mr.addr as usize, s.mr.length as usize));
            check_writable(a, l, acc.unwrap_or(s.access))?;
        }
        // SAFETY: forwarded contract (a new range stays mapped while registered).
        unsafe { s.inner.rereg(new_pd.map(|p| &*p.inner), range, acc)? };
        if let Some(a) = acc {
            s.access = a;
        }
        if let Some(p) = new_pd {
            // Releases the old PD's use.
            s.pd_use = Some(p.take_use());
            s.mr.pd = pd;
        }
        if let Some((a, l)) = range {
            s.mr.addr = a as *mut c_void;
            s.mr.length = l as u64;
        }
        // A new translation may come with new keys (NP-RDMA mode; libibverbs
        // updates them from the kernel's answer the same way).
        s.mr.lkey = s.inner.lkey();
        s.mr.rkey = s.inner.rkey();
        let pd_handle = s.pd_use.as_ref().map(|u| u.handle);
        if let (Some(x), Some(h)) = (EXPORTS.lock().mrs.get_mut(&s.mr.handle), pd_handle) {
            x.pd_handle = h;
            x.length = s.mr.length;
        }
        Ok(())
    });
    if rc == 0 {
        0
    } else {
        IBV_REREG_MR_ERR_CMD
    }
}

/// `verbs_context.advise_mr` (what libibverbs' `ibv_advise_mr` inline calls; set in
/// NP-RDMA mode, whose MRs are on demand): PREFETCH / PREFETCH_WRITE fault the
/// SGEs' pages in now (synchronously, so IBV_ADVISE_MR_FLAG_FLUSH holds),
/// PREFETCH_NO_FAULT has nothing to do. The SGEs must lie in MRs of `pd`.
///
/// # Safety
/// `pd` ours; `sg_list` has `num_sges` entries.
pub(crate) unsafe extern "C" fn advise_mr_op(
    pd: *mut ibv_pd,
    advice: ib_uverbs_advise_mr_advice,
    flags: u32,
    sg_list: *mut ibv_sge,
    num_sges: u32,
) -> c_int {
    guard_rc("ibv_advise_mr", || {
        // SAFETY: caller contract.
        let p: &ShimPd = unsafe { shim(pd, "PD")? };
        if flags & !IB_UVERBS_ADVISE_MR_FLAG_FLUSH != 0 {
            return Err(ShimError::InvalidArgument(format!(
                "advise flags {flags:#x}"
            )));
        }
        let fault = match advice {
            IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH | IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE => true,
            IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT => false,
            a => return Err(ShimError::InvalidArgument(format!("advice {a}"))),
        };
        if num_sges == 0 || sg_list.is_null() {
            return Err(ShimError::InvalidArgument("no SGEs".into()));
        }
        // SAFETY: caller contract: num_sges readable entries.
        let list = unsafe { std::slice::from_raw_parts(sg_list, num_sges as usize) };
        let sges: Vec<rnic::Sge> = list
            .iter()
            .map(|s| rnic::Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        p.inner.advise(&sges, fault)
    })
}

/// # Safety
/// `pd` ours; memory stays mapped while registered.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr", std::ptr::null_mut(), || unsafe {
        reg_mr(pd, addr, len, addr as u64, access)
    })
}

/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr_iova", std::ptr::null_mut(), || unsafe {
        reg_mr(pd, addr, len, iova, access)
    })
}

/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr_iova2", std::ptr::null_mut(), || unsafe {
        reg_mr(pd, addr, len, iova, access as c_int)
    })
}

/// # Safety
/// `mr` from our reg_mr.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard_rc("ibv_dereg_mr", || {
        // SAFETY: caller contract.
        let s: &ShimMr = unsafe { shim(mr, "MR")? };
        if !s.imported() {
            EXPORTS.lock().mrs.remove(&s.mr.handle);
        }
        // SAFETY: allocated by reg_mr / ibv_import_mr; dropping deregisters (waits for
        // in-flight DMA) and releases the PD's use.
        drop(unsafe { Box::from_raw(mr as *mut ShimMr) });
        Ok(())
    })
}

// ---- completion channels and CQs ----

/// # Safety
/// `ctx` an open context.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    guard("ibv_create_comp_channel", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        unsafe { ShimContext::from_ibv(ctx)? };
        let epfd = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| rnic::Error::from(std::io::Error::from(e)))?;
        let fd = epfd.as_raw_fd();
        let ch = ibv_comp_channel {
            context: ctx,
            fd,
            refcnt: 0,
        };
        let p = Box::into_raw(Box::new(ShimChannel {
            ch,
            epfd,
            cqs: Mutex::new(Vec::new()),
        }));
        Ok(p as *mut ibv_comp_channel)
    })
}

/// # Safety
/// `ch` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard_rc("ibv_destroy_comp_channel", || {
        // SAFETY: caller contract.
        let s: &ShimChannel = unsafe { shim(ch, "completion channel")? };
        if !s.cqs.lock().is_empty() {
            return Err(ShimError::Busy("completion channel still has CQs".into()));
        }
        // SAFETY: allocated by ibv_create_comp_channel.
        drop(unsafe { Box::from_raw(ch as *mut ShimChannel) });
        Ok(())
    })
}

/// # Safety
/// `ctx` an open context; `channel` null or ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    guard("ibv_create_cq", std::ptr::null_mut(), || {
        // SAFETY: forwarded contract.
        let p = unsafe { create_cq_common(ctx, cqe, cq_context, channel, comp_vector)? };
        Ok(p as *mut ibv_cq)
    })
}

/// A CQ of `ctx` (legacy or extended: the object is the same, its C struct an
/// `ibv_cq_ex` whose prefix is the `ibv_cq`).
///
/// # Safety
/// `ctx` an open context; `channel` null or ours.
pub(crate) unsafe fn create_cq_common(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut ShimCq, ShimError> {
    {
        // SAFETY: caller contract.
        let s = unsafe { ShimContext::from_ibv(ctx)? };
        // As the kernel's ib_uverbs_create_cq and providers: 1..=max_cqe entries,
        // comp_vector < num_comp_vectors.
        let max_cqe = s.dev.attr().max_cqe;
        if cqe <= 0 || cqe as u32 > max_cqe {
            return Err(ShimError::InvalidArgument(format!(
                "cqe {cqe} (the device allows 1..={max_cqe})"
            )));
        }
        let vectors = s.vctx.context.num_comp_vectors;
        if comp_vector < 0 || comp_vector >= vectors {
            return Err(ShimError::InvalidArgument(format!(
                "comp_vector {comp_vector} (the device has {vectors})"
            )));
        }
        let chan: Option<&ShimChannel> = if channel.is_null() {
            None
        } else {
            // SAFETY: caller contract.
            Some(unsafe { shim(channel, "completion channel")? })
        };
        let inner = s.dev.create_cq(cqe as u32, chan.is_some())?;
        // SAFETY: plain C data.
        let mut cq: ibv_cq_ex = unsafe { zeroed() };
        cq.context = ctx;
        cq.channel = channel;
        cq.cq_context = cq_context;
        cq.cqe = cqe;
        let p = Box::into_raw(Box::new(ShimCq {
            cq,
            inner,
            users: AtomicU32::new(0),
            cur: Mutex::new(rnic::Wc::default()),
            events: Default::default(),
        }));
        if let Some(ch) = chan {
            // SAFETY: just allocated, alive.
            let efd = unsafe { &*p }
                .inner
                .event_fd()
                .expect("CQ created with events");
            // SAFETY: the new CQ's eventfd, open while the CQ lives (it leaves the
            // epoll set in `ibv_destroy_cq` before it goes).
            let efd = unsafe { BorrowedFd::borrow_raw(efd) };
            let data = epoll::EventData::new_u64(p as u64);
            if let Err(e) = epoll::add(&ch.epfd, efd, data, epoll::EventFlags::IN) {
                let e = std::io::Error::from(e);
                // SAFETY: allocated above, never shared.
                drop(unsafe { Box::from_raw(p) });
                return Err(rnic::Error::from(e).into());
            }
            ch.cqs.lock().push(p as usize);
        }
        Ok(p)
    }
}

/// `ibv_resize_cq`: 1..=max_cqe entries, not fewer than the completions waiting
/// (EINVAL, as rxe); `cq->cqe` says the new size.
///
/// # Safety
/// `cq` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard_rc("ibv_resize_cq", || {
        // SAFETY: caller contract.
        let s: &ShimCq = unsafe { shim(cq, "CQ")? };
        // SAFETY: a CQ's context outlives it.
        let c = unsafe { ShimContext::from_ibv(s.cq.context)? };
        let max_cqe = c.dev.attr().max_cqe;
        if cqe <= 0 || cqe as u32 > max_cqe {
            return Err(ShimError::InvalidArgument(format!(
                "cqe {cqe} (the device allows 1..={max_cqe})"
            )));
        }
        s.inner.resize(cqe as u32)?;
        // SAFETY: `cq` is our live CQ; its `cqe` field is the size the application
        // reads (libibverbs' providers update it the same way).
        unsafe { (*cq).cqe = cqe };
        Ok(())
    })
}

/// # Safety
/// `cq` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard_rc("ibv_destroy_cq", || {
        // SAFETY: caller contract.
        let s: &ShimCq = unsafe { shim(cq, "CQ")? };
        if s.users.load(Ordering::Acquire) != 0 {
            return Err(ShimError::Busy("CQ still used by QPs".into()));
        }
        // libibverbs' destroy waits until every event it reported is acked.
        s.events.wait_all_acked();
        if !s.cq.channel.is_null() {
            // SAFETY: a channel cannot be destroyed while it has CQs.
            let ch: &ShimChannel = unsafe { shim(s.cq.channel, "completion channel")? };
            if let Some(efd) = s.inner.event_fd() {
                // SAFETY: the CQ's eventfd, still open (the CQ is freed below).
                let efd = unsafe { BorrowedFd::borrow_raw(efd) };
                let _ = epoll::delete(&ch.epfd, efd);
            }
            ch.cqs.lock().retain(|&c| c != cq as usize);
        }
        // SAFETY: allocated by ibv_create_cq.
        drop(unsafe { Box::from_raw(cq as *mut ShimCq) });
        Ok(())
    })
}

/// Wait for a completion event on `channel` (blocking unless its fd is O_NONBLOCK).
///
/// # Safety
/// `channel` ours; out pointers writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard("ibv_get_cq_event", -1, || {
        // SAFETY: caller contract.
        let ch: &ShimChannel = unsafe { shim(channel, "completion channel")? };
        nonnull(cq, "cq out pointer")?;
        nonnull(cq_context, "cq_context out pointer")?;
        let nonblock = is_nonblocking(&ch.epfd);
        let now = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut ready = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
        let mut block = false;
        loop {
            // The CQs whose eventfds are readable, in the order they became readable
            // (epoll's ready list is first-in first-out): events are taken in the
            // order they were signalled, as the kernel queues them on a channel.
            let order: &[epoll::Event] =
                match epoll::wait(&ch.epfd, &mut ready, (!block).then_some(&now)) {
                    Ok((evs, _)) => evs,
                    // A blocking read of the channel's fd (libibverbs') fails with
                    // EINTR when a handler without SA_RESTART ran (qperf and perftest
                    // end timed loops with SIGALRM this way); epoll_wait never restarts.
                    Err(rustix::io::Errno::INTR) if block && !restarting_handlers() => {
                        set_errno(libc::EINTR);
                        return Ok(-1);
                    }
                    Err(rustix::io::Errno::INTR) => &[],
                    Err(e) => return Err(rnic::Error::from(std::io::Error::from(e)).into()),
                };
            let cqs = ch.cqs.lock();
            // Then every CQ: an event may be pending a moment before its fd signals.
            let fired = order
                .iter()
                .map(|e| e.data.u64() as usize)
                .filter(|c| cqs.contains(c))
                .chain(cqs.iter().copied())
                .find(|&c| {
                    // SAFETY: CQs remove themselves from the list (under its lock, held
                    // here) before being freed.
                    unsafe { &*(c as *const ShimCq) }.inner.take_event()
                });
            drop(cqs);
            if let Some(c) = fired {
                let c = c as *mut ShimCq;
                // SAFETY: c is alive (see above); ibv_destroy_cq waits for this event's ack.
                unsafe { &*c }.events.handed_out();
                // SAFETY: out pointers checked non-null; c is alive (see above).
                unsafe {
                    *cq = c as *mut ibv_cq;
                    *cq_context = (*c).cq.cq_context;
                }
                return Ok(0);
            }
            if nonblock {
                set_errno(libc::EAGAIN);
                return Ok(-1);
            }
            block = true;
        }
    })
}

/// Whether every signal handler the process installed restarts interrupted calls
/// (`SA_RESTART`): then a read the kernel interrupted would have been restarted, so
/// the wait goes on. Which signal interrupted the wait is not known, so one handler
/// without it is enough to return EINTR, as the program's own reads would.
fn restarting_handlers() -> bool {
    (1..libc::SIGRTMAX()).all(|sig| {
        // SAFETY: plain C data; sigaction with a NULL new action only reads the
        // current one (an invalid signal number fails and is skipped).
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: see above.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return true;
        }
        let h = old.sa_sigaction;
        h == libc::SIG_DFL || h == libc::SIG_IGN || old.sa_flags & libc::SA_RESTART != 0
    })
}

/// # Safety
/// `cq` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: u32) {
    // SAFETY: caller contract (a CQ of ours, or null: nothing to do).
    if let Ok(s) = unsafe { shim::<ibv_cq, ShimCq>(cq, "CQ") } {
        s.events.ack(nevents);
        // SAFETY: as above; the counter is informational.
        unsafe { (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents) };
    }
}

// ---- QP ----

/// Create an RC, UC or UD QP from `a` (caps written back). With `send_ops`, the QP also offers
/// the `ibv_qp_ex` work-request builder (`ibv_qp_to_qp_ex`).
///
/// # Safety
/// `pd` ours (or null); the CQ pointers in `a` ours.
pub(crate) unsafe fn create_qp_common(
    pd: *mut ibv_pd,
    a: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
) -> Result<*mut ibv_qp, ShimError> {
    // SAFETY: caller contract.
    let p: &ShimPd = unsafe { shim(pd, "PD")? };
    let qp_type = match a.qp_type {
        IBV_QPT_RC => rnic::QpType::Rc,
        IBV_QPT_UC => rnic::QpType::Uc,
        IBV_QPT_UD => rnic::QpType::Ud,
        t => {
            return Err(ShimError::Unsupported(format!(
                "QP type {t} (RC, UC and UD QPs are supported)"
            )))
        }
    };
    // UD carries SEND and SEND_WITH_IMM only (as rxe's provider).
    const UD_OPS: u64 = (IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM) as u64;
    if qp_type == rnic::QpType::Ud && send_ops.is_some_and(|f| f & !UD_OPS != 0) {
        return Err(ShimError::Unsupported(
            "send_ops_flags of a UD QP other than SEND / SEND_WITH_IMM".into(),
        ));
    }
    // UC carries no READ or atomics (as rxe's provider refuses them in send_ops_flags).
    const RC_ONLY_OPS: u64 = (IBV_QP_EX_WITH_RDMA_READ
        | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
        | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;
    if qp_type == rnic::QpType::Uc && send_ops.is_some_and(|f| f & RC_ONLY_OPS != 0) {
        return Err(ShimError::Unsupported(
            "RDMA READ and atomics in send_ops_flags of a UC QP".into(),
        ));
    }
    // Within what ibv_query_device advertises, or EINVAL (quietly: see Exceeds).
    // SAFETY: our PD's context is ours and open while the PD exists.
    let dev = &unsafe { ShimContext::from_ibv(p.pd.context)? }.dev;
    let (d, max_wr) = (dev.attr(), dev.max_qp_wr_of(qp_type));
    for (what, v, max) in [
        ("max_send_wr", a.cap.max_send_wr, max_wr),
        ("max_recv_wr", a.cap.max_recv_wr, max_wr),
        ("max_send_sge", a.cap.max_send_sge, d.max_sge),
        ("max_recv_sge", a.cap.max_recv_sge, d.max_sge),
        ("max_inline_data", a.cap.max_inline_data, d.max_inline_data),
    ] {
        if v > max {
            return Err(ShimError::Exceeds(format!("{what} {v} > {max}")));
        }
    }
    let srq: Option<&ShimSrq> = if a.srq.is_null() {
        None
    } else {
        // SAFETY: caller contract (an SRQ of this context).
        Some(unsafe { shim(a.srq, "SRQ")? })
    };
    // SAFETY: caller contract (CQs of this context).
    let scq: &ShimCq = unsafe { shim(a.send_cq, "send CQ")? };
    // SAFETY: as above.
    let rcq: &ShimCq = unsafe { shim(a.recv_cq, "recv CQ")? };
    let init = QpInitAttr {
        qpn: None,
        max_send_wr: a.cap.max_send_wr.max(1),
        max_recv_wr: a.cap.max_recv_wr,
        max_send_sge: a.cap.max_send_sge.max(1),
        max_recv_sge: a.cap.max_recv_sge.max(1),
        max_inline_data: a.cap.max_inline_data,
        sq_sig_all: a.sq_sig_all != 0,
    };
    let inner = p.inner.create_qp_of(
        qp_type,
        &*scq.inner,
        &*rcq.inner,
        srq.map(|s| &*s.inner),
        &init,
    )?;
    let cap = inner.cap();
    a.cap = ibv_qp_cap {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        max_send_sge: cap.max_send_sge,
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    };
    // SAFETY: plain C data.
    let mut q: ibv_qp_ex = unsafe { zeroed() };
    let b = &mut q.qp_base;
    b.context = p.pd.context;
    b.qp_context = a.qp_context;
    b.pd = pd;
    b.send_cq = a.send_cq;
    b.recv_cq = a.recv_cq;
    b.qp_num = inner.qpn();
    b.state = IBV_QPS_RESET;
    b.qp_type = a.qp_type;
    b.srq = a.srq;
    if send_ops.is_some() {
        crate::qp_ex::install_wr_ops(&mut q);
    }
    scq.users.fetch_add(1, Ordering::AcqRel);
    rcq.users.fetch_add(1, Ordering::AcqRel);
    if let Some(s) = srq {
        s.users.fetch_add(1, Ordering::AcqRel);
    }
    let qp = Box::into_raw(Box::new(ShimQp {
        qp: q,
        inner,
        ex: send_ops.is_some(),
        batch: Mutex::new(Default::default()),
        pd_use: p.take_use(),
        async_events: Default::default(),
    }));
    crate::objects::qp_born(qp.cast());
    Ok(qp as *mut ibv_qp)
}

/// # Safety
/// `pd` ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    guard("ibv_create_qp", std::ptr::null_mut(), || {
        nonnull(attr, "QP init attr")?;
        // SAFETY: checked non-null; caller-provided; pd/CQs per the caller contract.
        unsafe { create_qp_common(pd, &mut *attr, None) }
    })
}

/// # Safety
/// `qp` ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard_rc("ibv_modify_qp", || {
        // SAFETY: caller contract.
        let q: &ShimQp = unsafe { shim(qp, "QP")? };
        nonnull(attr, "QP attr")?;
        // SAFETY: the QP's context is ours and open while the QP exists.
        let c = unsafe { ShimContext::from_ibv(q.qp.qp_base.context)? };
        let resolve = |av: &ibv_ah_attr, qpn: u32| {
            crate::gid::resolve(c, av, Some(qpn))?
                .ok_or_else(|| ShimError::InvalidArgument("address vector names no device".into()))
        };
        // SAFETY: checked non-null.
        let (a, m) = qp_attr_from_c(unsafe { &*attr }, mask, resolve)?;
        // As rxe's rxe_qp_chk_attr: RDMA READ/atomic depths within the device's.
        let max_rd = c.dev.attr().max_qp_rd_atom;
        for (bit, v, what) in [
            (
                rnic::QpAttrMask::MAX_QP_RD_ATOMIC,
                a.max_rd_atomic,
                "max_rd_atomic",
            ),
            (
                rnic::QpAttrMask::MAX_DEST_RD_ATOMIC,
                a.max_dest_rd_atomic,
                "max_dest_rd_atomic",
            ),
        ] {
            if m.contains(bit) && u32::from(v) > max_rd {
                return Err(ShimError::InvalidArgument(format!(
                    "{what} {v} > max_qp_rd_atom {max_rd}"
                )));
            }
        }
        let was = q.inner.query().qp_state;
        q.inner.modify(&a, m)?;
        let now = q.inner.query().qp_state;
        // SAFETY: the QP struct is ours; apps read `state`.
        unsafe { (*qp).state = now as u32 };
        if now == rnic::QpState::Err && was != rnic::QpState::Err && !q.qp.qp_base.srq.is_null() {
            // It takes no more WQEs of its SRQ: the application may now destroy it.
            // SAFETY: the QP's context is ours and open while the QP exists.
            let c = unsafe { ShimContext::from_ibv(q.qp.qp_base.context)? };
            c.post_async(IBV_EVENT_QP_LAST_WQE_REACHED, qp as usize);
        }
        Ok(())
    })
}

/// # Safety
/// `qp` ours; out structs writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard_rc("ibv_query_qp", || {
        // SAFETY: caller contract.
        let q: &ShimQp = unsafe { shim(qp, "QP")? };
        nonnull(attr, "QP attr")?;
        nonnull(init, "QP init attr")?;
        let cap = q.inner.cap();
        let c = ibv_qp_cap {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: cap.max_recv_wr,
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            max_inline_data: cap.max_inline_data,
        };
        // SAFETY: checked non-null, caller-provided.
        unsafe {
            *attr = qp_attr_to_c(&q.inner.query(), c);
            // libibverbs' ibv_query_qp refreshes `state` (e.g. ERR after an
            // error completion).
            if mask & IBV_QP_STATE as c_int != 0 {
                (*qp).state = (*attr).qp_state;
            }
            let i = &mut *init;
            i.qp_context = q.qp.qp_base.qp_context;
            i.send_cq = q.qp.qp_base.send_cq;
            i.recv_cq = q.qp.qp_base.recv_cq;
            i.srq = q.qp.qp_base.srq;
            i.cap = c;
            i.qp_type = q.qp.qp_base.qp_type;
            i.sq_sig_all = cap.sq_sig_all as c_int;
        }
        Ok(())
    })
}

/// # Safety
/// `qp` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard_rc("ibv_destroy_qp", || {
        // SAFETY: caller contract.
        let q: &ShimQp = unsafe { shim(qp, "QP")? };
        // Its unread events go with it; the ones handed out must be acknowledged
        // first (libibverbs waits for them the same way).
        // SAFETY: the QP's context is ours and open while the QP exists.
        unsafe { ShimContext::from_ibv(q.qp.qp_base.context)? }.forget_async(qp as usize);
        q.async_events.wait_all_acked();
        // SAFETY: CQs outlive their QPs (their destroy refuses while in use). The PD is
        // not touched: an imported PD may be gone (the QP holds its use by value).
        let (scq, rcq): (&ShimCq, &ShimCq) = unsafe {
            (
                shim(q.qp.qp_base.send_cq, "CQ")?,
                shim(q.qp.qp_base.recv_cq, "CQ")?,
            )
        };
        let srq = q.qp.qp_base.srq;
        crate::objects::qp_gone(qp);
        // SAFETY: allocated by ibv_create_qp; dropping releases the PD's use.
        drop(unsafe { Box::from_raw(qp as *mut ShimQp) });
        if !srq.is_null() {
            // SAFETY: an SRQ outlives its QPs (its destroy refuses while in use).
            let s: &ShimSrq = unsafe { shim(srq, "SRQ")? };
            s.users.fetch_sub(1, Ordering::AcqRel);
        }
        scq.users.fetch_sub(1, Ordering::AcqRel);
        rcq.users.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    })
}

// ---- shared receive queues ----

/// A shared receive queue of `attr.max_wr` WQEs (written back: what it has). SRQ limit
/// events are not generated, so an SRQ limit (`srq_limit` > 0, the
/// `IBV_EVENT_SRQ_LIMIT_REACHED` trigger) is refused rather than never firing.
///
/// # Safety
/// `pd` ours (or null); `a` valid.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    a: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    guard("ibv_create_srq", std::ptr::null_mut(), || {
        nonnull(a, "SRQ init attr")?;
        // SAFETY: caller contract.
        let p: &ShimPd = unsafe { shim(pd, "PD")? };
        // SAFETY: checked non-null, caller-provided.
        let a = unsafe { &mut *a };
        // SAFETY: the PD's context is ours.
        let s = unsafe { ShimContext::from_ibv(p.pd.context)? };
        let Some((max_wr, max_sge)) = s.dev.srq_limits() else {
            return Err(ShimError::Unsupported(format!(
                "shared receive queues (SRQ) in {} mode",
                s.dev.mode()
            )));
        };
        if a.attr.max_wr == 0 || a.attr.max_wr > max_wr {
            return Err(ShimError::InvalidArgument(format!(
                "SRQ max_wr {} (the device allows 1..={max_wr})",
                a.attr.max_wr
            )));
        }
        if a.attr.max_sge > max_sge {
            return Err(ShimError::InvalidArgument(format!(
                "SRQ max_sge {} (the device allows {max_sge})",
                a.attr.max_sge
            )));
        }
        if a.attr.srq_limit != 0 {
            return Err(ShimError::Unsupported(
                "SRQ limit (srq_limit): SRQ limit events are not generated".into(),
            ));
        }
        let inner = p.inner.create_srq(a.attr.max_wr, a.attr.max_sge.max(1))?;
        a.attr.max_wr = inner.max_wr();
        a.attr.max_sge = inner.max_sge();
        // SAFETY: plain C data (an all-zero mutex and cond are their static initialisers).
        let mut srq: ibv_srq = unsafe { zeroed() };
        srq.context = p.pd.context;
        srq.srq_context = a.srq_context;
        srq.pd = pd;
        Ok(Box::into_raw(Box::new(ShimSrq {
            srq,
            inner,
            users: AtomicU32::new(0),
            pd_use: p.take_use(),
        })) as *mut ibv_srq)
    })
}

/// # Safety
/// `srq` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard_rc("ibv_destroy_srq", || {
        // SAFETY: caller contract.
        let s: &ShimSrq = unsafe { shim(srq, "SRQ")? };
        if s.users.load(Ordering::Acquire) != 0 {
            return Err(ShimError::Busy("SRQ still used by QPs".into()));
        }
        // SAFETY: allocated by ibv_create_srq; dropping releases the PD's use.
        drop(unsafe { Box::from_raw(srq as *mut ShimSrq) });
        Ok(())
    })
}

/// `IBV_SRQ_LIMIT` 0 (disarmed) is accepted; a limit to arm is refused (no limit
/// events), and so is `IBV_SRQ_MAX_WR` (no resize, as mlx5).
///
/// # Safety
/// `srq` ours; `a` valid.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    a: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    guard_rc("ibv_modify_srq", || {
        // SAFETY: caller contract.
        let _: &ShimSrq = unsafe { shim(srq, "SRQ")? };
        nonnull(a, "SRQ attr")?;
        let mask = mask as u32;
        if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
            return Err(ShimError::InvalidArgument(format!(
                "SRQ attr mask {mask:#x}"
            )));
        }
        if mask & IBV_SRQ_MAX_WR != 0 {
            return Err(ShimError::InvalidArgument(
                "SRQ resize (IBV_SRQ_MAX_WR)".into(),
            ));
        }
        // SAFETY: checked non-null, caller-provided.
        if mask & IBV_SRQ_LIMIT != 0 && unsafe { (*a).srq_limit } != 0 {
            return Err(ShimError::Unsupported(
                "SRQ limit (srq_limit): SRQ limit events are not generated".into(),
            ));
        }
        Ok(())
    })
}

/// # Safety
/// `srq` ours; `a` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, a: *mut ibv_srq_attr) -> c_int {
    guard_rc("ibv_query_srq", || {
        // SAFETY: caller contract.
        let s: &ShimSrq = unsafe { shim(srq, "SRQ")? };
        nonnull(a, "SRQ attr")?;
        // SAFETY: checked non-null, caller-provided.
        unsafe {
            *a = ibv_srq_attr {
                max_wr: s.inner.max_wr(),
                max_sge: s.inner.max_sge(),
                srq_limit: 0,
            };
        }
        Ok(())
    })
}

/// The `ibv_qp_ex` of a QP created through `ibv_create_qp_ex` with
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`; NULL (EOPNOTSUPP) otherwise.
///
/// # Safety
/// `qp` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // SAFETY: caller contract.
    match unsafe { shim::<_, ShimQp>(qp, "QP") } {
        Ok(q) if q.ex => qp as *mut ibv_qp_ex,
        _ => {
            set_errno(libc::EOPNOTSUPP);
            std::ptr::null_mut()
        }
    }
}

// ---- status strings ----

const WC_STATUS: [&std::ffi::CStr; 22] = [
    c"success",
    c"local length error",
    c"local QP operation error",
    c"local EE context operation error",
    c"local protection error",
    c"Work Request Flushed Error",
    c"memory management operation error",
    c"bad response error",
    c"local access error",
    c"remote invalid request error",
    c"remote access error",
    c"remote operation error",
    c"transport retry counter exceeded",
    c"RNR retry counter exceeded",
    c"local RDD violation error",
    c"remote invalid RD request",
    c"aborted error",
    c"invalid EE context number",
    c"invalid EE context state",
    c"fatal error",
    c"response timeout error",
    c"general error",
];

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: u32) -> *const std::ffi::c_char {
    WC_STATUS
        .get(status as usize)
        .copied()
        .unwrap_or(c"unknown")
        .as_ptr()
}

// ---- refused verbs (the NIC does not model them) ----

macro_rules! refuse_ptr {
    ($name:ident, $what:literal, ($($a:ident : $t:ty),*) -> $ret:ty) => {
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> $ret {
            let _ = ($($a,)*);
            crate::error::report(stringify!($name), &ShimError::Unsupported($what.into()));
            std::ptr::null_mut()
        }
    };
}
macro_rules! refuse_rc {
    ($name:ident, $what:literal, $rc:expr, ($($a:ident : $t:ty),*)) => {
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> c_int {
            let _ = ($($a,)*);
            let e = crate::error::report(stringify!($name), &ShimError::Unsupported($what.into()));
            if $rc { -1 } else { e }
        }
    };
}

refuse_rc!(ibv_attach_mcast, "multicast (UD QPs)", false, (qp: *mut ibv_qp, g: *const ibv_gid, l: u16));
refuse_rc!(ibv_detach_mcast, "multicast (UD QPs)", false, (qp: *mut ibv_qp, g: *const ibv_gid, l: u16));
refuse_ptr!(ibv_reg_dmabuf_mr, "dma-buf MRs", (pd: *mut ibv_pd, o: u64, l: usize, i: u64, fd: c_int, a: c_int) -> *mut ibv_mr);
refuse_rc!(ibv_query_ece, "enhanced connection establishment (ECE)", false, (qp: *mut ibv_qp, e: *mut ibv_ece));
refuse_rc!(ibv_set_ece, "enhanced connection establishment (ECE)", false, (qp: *mut ibv_qp, e: *mut ibv_ece));

/// Fork support needs no preparation: the software NIC reaches registered memory
/// by the registering process's virtual addresses, and a fork leaves the parent's
/// mappings (and so every MR) where they were — the situation of a kernel with
/// copy-on-fork for pinned pages, where rdma-core's `ibv_fork_init` returns 0
/// without doing anything, before or after registrations. (NP-RDMA mode: the
/// parent's registrations stay valid and its peers keep working; the child's copy
/// of registered memory holds what the parent wrote, pages the pager had swapped
/// out included — they are read from swap into the child's copy during fork(),
/// while the parent's eviction pauses — as a kernel that copies pinned pages on
/// fork gives it; the child cannot use the parent's verbs objects, as with
/// rdma-core.)
#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `IBV_FORK_UNNEEDED` (see [`ibv_fork_init`]), as rdma-core reports on kernels
/// that copy pinned pages on fork.
#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> ibv_fork_status {
    IBV_FORK_UNNEEDED
}

/// The next asynchronous event (blocking unless the async fd is O_NONBLOCK). Events
/// generated: `IBV_EVENT_QP_LAST_WQE_REACHED` when a QP that receives from an SRQ is
/// moved to ERR (no WQE of the SRQ will be taken by it any more: the application may
/// destroy it). As with the kernel, destroying a QP drops its events not yet taken,
/// and `ibv_destroy_qp` waits until those taken are acknowledged.
///
/// # Safety
/// `ctx` an open context; `ev` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    ev: *mut ibv_async_event,
) -> c_int {
    guard("ibv_get_async_event", -1, || {
        // SAFETY: caller contract.
        let s = unsafe { ShimContext::from_ibv(ctx)? };
        nonnull(ev, "async event out pointer")?;
        // The semaphore counts the queued events; its counts are taken with the
        // queue locked, one per event taken off it (`take_async_count`).
        let (t, el) = loop {
            {
                let mut q = s.async_events.lock();
                if let Some((t, el)) = q.pop_front() {
                    s.take_async_count();
                    if is_qp_event(t) {
                        // Counted while the queue is locked: a destroy of the QP
                        // now either dropped the event first or waits for its ack.
                        // SAFETY: a queued QP event names a live QP of ours
                        // (`ibv_destroy_qp` drops its events under this lock).
                        unsafe { &*(el as *const ShimQp) }.async_events.handed_out();
                    }
                    drop(q);
                    break (t, el);
                }
            }
            // Nothing queued: EAGAIN on a non-blocking fd, else wait for a post.
            if is_nonblocking(&s.async_fd) {
                set_errno(libc::EAGAIN);
                return Ok(-1);
            }
            let mut pfd = [rustix::event::PollFd::new(
                &s.async_fd,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut pfd, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => {
                    set_errno(libc::EINTR);
                    return Ok(-1);
                }
                Err(e) => return Err(rnic::Error::from(std::io::Error::from(e)).into()),
            }
        };
        // SAFETY: checked non-null, caller-provided; the union's members are all
        // object pointers of the same size.
        unsafe {
            (*ev).event_type = t;
            (*ev).element.qp = el as *mut ibv_qp;
        }
        Ok(0)
    })
}

/// Events about a QP (the `element.qp` of the event).
fn is_qp_event(t: u32) -> bool {
    matches!(
        t,
        IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_PATH_MIG
            | IBV_EVENT_PATH_MIG_ERR
            | IBV_EVENT_QP_LAST_WQE_REACHED
    )
}

/// Acknowledges an event from `ibv_get_async_event` (an `ibv_destroy_qp` of its
/// QP waits for that).
///
/// # Safety
/// `ev` NULL or an event `ibv_get_async_event` filled in, acknowledged once.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(ev: *mut ibv_async_event) {
    if ev.is_null() {
        return;
    }
    // SAFETY: caller contract: a filled-in event.
    let (t, qp) = unsafe { ((*ev).event_type, (*ev).element.qp) };
    if is_qp_event(t) && !qp.is_null() {
        // SAFETY: the QP lives until its handed-out events are acknowledged
        // (`ibv_destroy_qp` waits for this).
        unsafe { &*(qp as *const ShimQp) }.async_events.ack(1);
    }
}

/// Data placement order is not guaranteed beyond RC semantics: report "not in order"
/// (0), as providers without the capability do.
#[no_mangle]
pub extern "C" fn ibv_query_qp_data_in_order(_qp: *mut ibv_qp, _op: u32, _flags: u32) -> c_int {
    0
}

/// A PD of any context of the process by its handle (`ibv_pd.handle`), for `ctx`
/// (typically a context from `ibv_import_device`). The imported PD shares the
/// exporting PD's objects; release it with `ibv_unimport_pd`.
///
/// # Safety
/// `ctx` an open context.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(ctx: *mut ibv_context, handle: u32) -> *mut ibv_pd {
    guard("ibv_import_pd", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        unsafe { ShimContext::from_ibv(ctx)? };
        let (inner, users) = EXPORTS
            .lock()
            .pds
            .get(&handle)
            .cloned()
            .ok_or_else(|| ShimError::InvalidArgument(format!("no PD with handle {handle}")))?;
        let p = Box::into_raw(Box::new(ShimPd {
            pd: ibv_pd {
                context: ctx,
                handle,
            },
            inner,
            users,
            imported: true,
        }));
        Ok(p as *mut ibv_pd)
    })
}

/// An MR of the process by its handle (`ibv_mr.handle`), on the imported PD `pd` of
/// the MR's own PD. As with rdma-core, the imported MR's `addr` is NULL (the
/// importer knows where its memory is); release it with `ibv_unimport_mr`.
///
/// # Safety
/// `pd` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(pd: *mut ibv_pd, handle: u32) -> *mut ibv_mr {
    guard("ibv_import_mr", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        let p: &ShimPd = unsafe { shim(pd, "PD")? };
        let e = EXPORTS
            .lock()
            .mrs
            .get(&handle)
            .copied()
            .filter(|e| e.pd_handle == p.pd.handle)
            .ok_or_else(|| {
                ShimError::InvalidArgument(format!("no MR with handle {handle} on this PD"))
            })?;
        let mr = ibv_mr {
            context: p.pd.context,
            pd,
            addr: std::ptr::null_mut(),
            length: e.length,
            handle,
            lkey: e.lkey,
            rkey: e.rkey,
        };
        Ok(Box::into_raw(Box::new(ShimMr {
            mr,
            inner: Box::new(ImportedMr {
                lkey: e.lkey,
                rkey: e.rkey,
            }),
            access: Access::empty(),
            pd_use: None,
        })) as *mut ibv_mr)
    })
}
refuse_ptr!(ibv_import_dm, "importing device memory", (c: *mut ibv_context, h: u32) -> *mut ibv_dm);

#[no_mangle]
pub extern "C" fn ibv_unimport_dm(_dm: *mut ibv_dm) {}

/// Release a PD from `ibv_import_pd` (the exporting PD is untouched). Ignored for
/// other PDs.
///
/// # Safety
/// `pd` ours, with no MRs or QPs of its own left.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(pd: *mut ibv_pd) {
    // SAFETY: caller contract.
    if let Ok(s) = unsafe { shim::<_, ShimPd>(pd, "PD") } {
        if s.imported {
            // SAFETY: allocated by ibv_import_pd.
            drop(unsafe { Box::from_raw(pd as *mut ShimPd) });
        }
    }
}

/// Release an MR from `ibv_import_mr` (the registration stays with the exporting
/// MR). Ignored for other MRs.
///
/// # Safety
/// `mr` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(mr: *mut ibv_mr) {
    // SAFETY: caller contract.
    if let Ok(s) = unsafe { shim::<_, ShimMr>(mr, "MR") } {
        if s.imported() {
            // SAFETY: allocated by ibv_import_mr.
            drop(unsafe { Box::from_raw(mr as *mut ShimMr) });
        }
    }
}

/// Whether the application set O_NONBLOCK on one of our fds.
fn is_nonblocking(fd: &OwnedFd) -> bool {
    rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f.contains(rustix::fs::OFlags::NONBLOCK))
}

const SUPPORTED_COMP_MASK: u32 =
    IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;

/// `verbs_context.create_qp_ex` (reached through the `ibv_create_qp_ex` inline).
pub unsafe extern "C" fn create_qp_ex_op(
    ctx: *mut ibv_context,
    a: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard("ibv_create_qp_ex", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        unsafe { ShimContext::from_ibv(ctx)? };
        if a.is_null() {
            return Err(ShimError::InvalidArgument(
                "NULL ibv_qp_init_attr_ex".into(),
            ));
        }
        // SAFETY: checked non-null; caller-provided.
        let ax = unsafe { &mut *a };
        if ax.comp_mask & !SUPPORTED_COMP_MASK != 0 {
            return Err(ShimError::Unsupported(format!(
                "ibv_qp_init_attr_ex comp_mask {:#x} (supported: PD, CREATE_FLAGS=0, SEND_OPS_FLAGS)",
                ax.comp_mask & !SUPPORTED_COMP_MASK
            )));
        }
        if ax.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
            return Err(ShimError::InvalidArgument(
                "ibv_create_qp_ex needs a PD".into(),
            ));
        }
        if ax.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && ax.create_flags != 0 {
            return Err(ShimError::Unsupported(format!(
                "QP create_flags {:#x}",
                ax.create_flags
            )));
        }
        let send_ops = if ax.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            if ax.send_ops_flags & !crate::qp_ex::SUPPORTED_SEND_OPS != 0 {
                return Err(ShimError::Unsupported(format!(
                    "send_ops_flags {:#x} (supported: RDMA_WRITE[_WITH_IMM], SEND[_WITH_IMM], RDMA_READ, ATOMIC_CMP_AND_SWP, ATOMIC_FETCH_AND_ADD)",
                    ax.send_ops_flags & !crate::qp_ex::SUPPORTED_SEND_OPS
                )));
            }
            Some(ax.send_ops_flags)
        } else {
            None
        };
        let mut base = ibv_qp_init_attr {
            qp_context: ax.qp_context,
            send_cq: ax.send_cq,
            recv_cq: ax.recv_cq,
            srq: ax.srq,
            cap: ax.cap,
            qp_type: ax.qp_type,
            sq_sig_all: ax.sq_sig_all,
        };
        // SAFETY: PD and CQs per the caller contract.
        let qp = unsafe { create_qp_common(ax.pd, &mut base, send_ops)? };
        ax.cap = base.cap;
        Ok(qp)
    })
}
