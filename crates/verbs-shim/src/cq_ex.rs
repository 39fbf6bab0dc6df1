//! Extended CQs: `ibv_create_cq_ex` (the `verbs_context.create_cq_ex` op libibverbs'
//! inline calls) and the `ibv_cq_ex` poll ops (`ibv_start_poll`, `ibv_next_poll`,
//! `ibv_end_poll`, `ibv_wc_read_*`). The CQ is the same object as a legacy one
//! (`ibv_poll_cq`, events and `ibv_destroy_cq` work on it); the completion fields
//! offered are IBV_WC_STANDARD_FLAGS (byte_len, imm, qp_num, src_qp, slid, sl,
//! dlid_path_bits); timestamps, CVLAN, flow tags, tag matching and parent domains are
//! refused with EOPNOTSUPP.

use crate::error::ShimError;
use crate::ffi::*;
use crate::objects::{guard, ShimCq};
use crate::resources::create_cq_common;
use std::ffi::c_int;

/// Completion-field flags offered.
const WC_FLAGS: u64 = IBV_WC_STANDARD_FLAGS as u64;
/// Creation flags accepted (a single-threaded CQ is a hint).
const CREATE_FLAGS: u32 = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;

/// `verbs_context.create_cq_ex`.
///
/// # Safety
/// `ctx` an open context; `attr` a valid `ibv_cq_init_attr_ex`.
pub unsafe extern "C" fn create_cq_ex_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    guard("ibv_create_cq_ex", std::ptr::null_mut(), || {
        if attr.is_null() {
            return Err(ShimError::InvalidArgument("NULL attr".into()));
        }
        // SAFETY: caller-provided, valid per the contract.
        let a = unsafe { &*attr };
        if a.wc_flags & !WC_FLAGS != 0 {
            return Err(ShimError::Unsupported(format!(
                "completion fields {:#x} (offered: IBV_WC_STANDARD_FLAGS)",
                a.wc_flags & !WC_FLAGS
            )));
        }
        if a.comp_mask & !IBV_CQ_INIT_ATTR_MASK_FLAGS != 0 {
            return Err(ShimError::Unsupported(format!(
                "CQ init comp_mask {:#x} (parent domains)",
                a.comp_mask
            )));
        }
        if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0 && a.flags & !CREATE_FLAGS != 0 {
            return Err(ShimError::Unsupported(format!(
                "CQ creation flags {:#x}",
                a.flags & !CREATE_FLAGS
            )));
        }
        let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
        let vector = c_int::try_from(a.comp_vector).unwrap_or(c_int::MAX);
        // SAFETY: forwarded contract (channel null or ours).
        let p = unsafe { create_cq_common(ctx, cqe, a.cq_context, a.channel, vector)? };
        // SAFETY: just created, not yet shared.
        let q = unsafe { &mut (*p).cq };
        q.start_poll = Some(start_poll);
        q.next_poll = Some(next_poll);
        q.end_poll = Some(end_poll);
        q.read_opcode = Some(read_opcode);
        q.read_vendor_err = Some(read_vendor_err);
        q.read_byte_len = Some(read_byte_len);
        q.read_imm_data = Some(read_imm_data);
        q.read_qp_num = Some(read_qp_num);
        q.read_src_qp = Some(read_src_qp);
        q.read_wc_flags = Some(read_wc_flags);
        q.read_slid = Some(read_slid);
        q.read_sl = Some(read_sl);
        q.read_dlid_path_bits = Some(read_dlid_path_bits);
        Ok(q as *mut ibv_cq_ex)
    })
}

/// Take the next completion into the CQ's current slot (and the struct's `status` /
/// `wr_id`): 0, ENOENT when empty, or an errno (CQ overrun).
///
/// # Safety
/// `cq` an extended CQ of ours.
unsafe fn advance(cq: *mut ibv_cq_ex) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the ibv_cq_ex is the first field of a live ShimCq.
    let c = unsafe { &*(cq as *const ShimCq) };
    let mut w = [rnic::Wc::default()];
    match c.inner.poll(&mut w) {
        Ok(0) => libc::ENOENT,
        Ok(_) => {
            *c.cur.lock() = w[0];
            // SAFETY: the caller polls this CQ (one poller at a time, as with any
            // provider); these two fields are the poll's output.
            unsafe {
                (*cq).status = w[0].status as u32;
                (*cq).wr_id = w[0].wr_id;
            }
            0
        }
        Err(e) => crate::error::report("ibv_start_poll", &e),
    }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: a valid attr or NULL per the caller contract.
    if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
        return libc::EINVAL;
    }
    // SAFETY: forwarded contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// The current completion of `cq` (default if none).
///
/// # Safety
/// `cq` an extended CQ of ours.
unsafe fn cur(cq: *mut ibv_cq_ex) -> rnic::Wc {
    if cq.is_null() {
        return rnic::Wc::default();
    }
    // SAFETY: the ibv_cq_ex is the first field of a live ShimCq.
    *unsafe { &*(cq as *const ShimCq) }.cur.lock()
}

unsafe extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> ibv_wc_opcode {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.opcode as ibv_wc_opcode
}

unsafe extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.vendor_err
}

unsafe extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.byte_len
}

/// As `ibv_wc.imm_data` (network byte order, as the legacy poll gives it).
unsafe extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> __be32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.imm_data
}

unsafe extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.qp_num
}

unsafe extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.src_qp
}

unsafe extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.wc_flags.bits()
}

unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    crate::convert::slid(&unsafe { cur(cq) }) as u32
}

unsafe extern "C" fn read_sl(_cq: *mut ibv_cq_ex) -> u8 {
    0
}

unsafe extern "C" fn read_dlid_path_bits(_cq: *mut ibv_cq_ex) -> u8 {
    0
}
