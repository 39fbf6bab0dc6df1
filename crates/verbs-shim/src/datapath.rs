//! The data path libibverbs' inline functions reach through `ibv_context.ops`:
//! post_send, post_recv, poll_cq, req_notify_cq (and a refusing post_srq_recv).
//! No allocation: SGEs, inline payloads and completions go through stack buffers.

use crate::convert::{sges, wc_to_c, wr_opcode};
use crate::error::{report, ShimError};
use crate::ffi::*;
use crate::objects::{ShimCq, ShimQp, ShimSrq};
use rnic::{RecvWr, SendFlags, SendWr, Sge, Wc};
use std::ffi::c_int;

/// Largest SGE list per WR (the largest `max_sge` a mode grants: pinned's).
const MAX_SGE: usize = crate::backend::PINNED_MAX_SGE as usize;
/// Largest inline payload gathered at post time (rnic's default `max_inline`).
const MAX_INLINE: usize = 1024;
/// Completions converted per backend poll.
const POLL_CHUNK: usize = 32;
const KNOWN_SEND_FLAGS: u32 =
    IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE;

/// Point the context's data-path ops into this library.
pub fn install_ops(ops: &mut ibv_context_ops) {
    ops.post_send = Some(post_send);
    ops.post_recv = Some(post_recv);
    ops.poll_cq = Some(poll_cq);
    ops.req_notify_cq = Some(req_notify_cq);
    ops.post_srq_recv = Some(post_srq_recv);
}

/// Post one WR (all post-time failures map to an errno).
///
/// # Safety
/// `w` a valid WR whose SGEs (and inline source buffers) are readable.
unsafe fn post_one_send(q: &ShimQp, w: &ibv_send_wr) -> Result<(), i32> {
    if w.send_flags & !KNOWN_SEND_FLAGS != 0 {
        let e = ShimError::Unsupported(format!(
            "send flags {:#x}",
            w.send_flags & !KNOWN_SEND_FLAGS
        ));
        return Err(report("ibv_post_send", &e));
    }
    // SAFETY: valid WR per the contract.
    let (opcode, remote_addr, rkey) =
        unsafe { wr_opcode(w) }.map_err(|e| report("ibv_post_send", &e))?;
    let mut sgb = [Sge::default(); MAX_SGE];
    // SAFETY: the WR's sg_list has num_sge entries.
    let sg = unsafe { sges(w.sg_list, w.num_sge, &mut sgb) }.map_err(|e| e.errno())?;
    let flags = SendFlags::from_bits_truncate(w.send_flags);
    let ud = if q.qp.qp_base.qp_type == IBV_QPT_UD {
        // SAFETY: a UD QP's WR fills the `ud` member of the union.
        let u = unsafe { w.wr.ud };
        // SAFETY: the application's address handle (NULL is refused).
        Some(
            unsafe { crate::ah::ud_dest(u.ah, u.remote_qpn, u.remote_qkey) }
                .map_err(|e| report("ibv_post_send", &e))?,
        )
    } else {
        None
    };
    let wr = SendWr {
        wr_id: w.wr_id,
        sg_list: sg,
        opcode,
        flags,
        remote_addr,
        rkey,
        inline_data: &[],
        ud,
    };
    if flags.contains(SendFlags::INLINE) {
        // SAFETY: forwarded contract (inline sources readable now).
        return unsafe { post_inline(q, wr) };
    }
    q.inner
        .post_send(std::slice::from_ref(&wr))
        .map_err(|e| e.err.errno())
}

/// Gather an inline WR's payload (read at post time, lkeys ignored) and post it.
///
/// # Safety
/// The SGEs of `wr` name application memory readable now (the IBV_SEND_INLINE contract).
unsafe fn post_inline(q: &ShimQp, wr: SendWr) -> Result<(), i32> {
    let mut inl = [0u8; MAX_INLINE];
    let mut len = 0usize;
    for s in wr.sg_list {
        let l = s.length as usize;
        if len + l > MAX_INLINE {
            return Err(libc::EINVAL);
        }
        // SAFETY: readable per the contract; the destination range is within `inl`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                s.addr as usize as *const u8,
                inl.as_mut_ptr().add(len),
                l,
            )
        };
        len += l;
    }
    let wr = SendWr {
        inline_data: &inl[..len],
        ..wr
    };
    q.inner
        .post_send(std::slice::from_ref(&wr))
        .map_err(|e| e.err.errno())
}

unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: qp was returned by our ibv_create_qp (first field of a ShimQp).
    let q = unsafe { &*(qp as *const ShimQp) };
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the application passes a valid NULL-terminated WR list.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        if let Err(e) = unsafe { post_one_send(q, w) } {
            if !bad.is_null() {
                // SAFETY: caller-provided out pointer.
                unsafe { *bad = cur };
            }
            return e;
        }
        cur = w.next;
    }
    0
}

unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: qp was returned by our ibv_create_qp.
    let q = unsafe { &*(qp as *const ShimQp) };
    // SAFETY: the caller's WR list and out pointer (post_recv's contract).
    unsafe { post_recv_list(wr, bad, |rw| q.inner.post_recv(std::slice::from_ref(rw))) }
}

/// Post the NULL-terminated receive WR list `wr` one WR at a time through `post`; on
/// a refusal, its errno, with `*bad` at the WR refused.
///
/// # Safety
/// `wr` a valid NULL-terminated list whose WRs' `sg_list` have `num_sge` entries;
/// `bad` writable or null.
unsafe fn post_recv_list(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    post: impl Fn(&RecvWr) -> Result<(), rnic::PostError>,
) -> c_int {
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the application passes a valid NULL-terminated WR list.
        let w = unsafe { &*cur };
        let mut sgb = [Sge::default(); MAX_SGE];
        // SAFETY: the WR's sg_list has num_sge entries.
        let r = unsafe { sges(w.sg_list, w.num_sge, &mut sgb) }
            .map_err(|e| e.errno())
            .and_then(|sg| {
                post(&RecvWr {
                    wr_id: w.wr_id,
                    sg_list: sg,
                })
                .map_err(|e| e.err.errno())
            });
        if let Err(e) = r {
            if !bad.is_null() {
                // SAFETY: caller-provided out pointer.
                unsafe { *bad = cur };
            }
            return e;
        }
        cur = w.next;
    }
    0
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    if cq.is_null() || (n > 0 && wc.is_null()) {
        return -1;
    }
    // SAFETY: cq was returned by our ibv_create_cq.
    let c = unsafe { &*(cq as *const ShimCq) };
    let want = n.max(0) as usize;
    let mut buf = [Wc::default(); POLL_CHUNK];
    let mut got = 0usize;
    while got < want {
        let k = (want - got).min(POLL_CHUNK);
        match c.inner.poll(&mut buf[..k]) {
            Ok(m) => {
                for (i, w) in buf[..m].iter().enumerate() {
                    // SAFETY: the caller's array has n >= got + m entries.
                    unsafe { *wc.add(got + i) = wc_to_c(w) };
                }
                got += m;
                if m < k {
                    break;
                }
            }
            Err(e) => {
                if got > 0 {
                    break;
                }
                report("ibv_poll_cq", &e);
                return -1;
            }
        }
    }
    got as c_int
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: cq was returned by our ibv_create_cq.
    let c = unsafe { &*(cq as *const ShimCq) };
    match c.inner.req_notify(solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => report("ibv_req_notify_cq", &e),
    }
}

unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: srq was returned by our ibv_create_srq.
    let s = unsafe { &*(srq as *const ShimSrq) };
    // SAFETY: the caller's WR list and out pointer (post_srq_recv's contract).
    unsafe { post_recv_list(wr, bad, |rw| s.inner.post_recv(std::slice::from_ref(rw))) }
}
