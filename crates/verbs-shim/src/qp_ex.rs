//! The `ibv_qp_ex` work-request builder (`ibv_wr_start` .. `ibv_wr_complete`) for QPs
//! created through `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`: the calls
//! build a batch (`objects::Batch`, beside the QP object that holds it) that
//! `wr_complete` posts; unsupported builders make the batch fail with a clear error at
//! `wr_complete`. `ibv_create_qp_ex` itself is a QP verb of `resources`, which
//! installs these builders.

use crate::error::{report, ShimError};
use crate::ffi::*;
use crate::objects::{Batch, PendingWr, ShimQp};
use rnic::{SendFlags, SendWr, Sge, WrOpcode};
use std::ffi::{c_int, c_void};

/// Send ops the builder supports.
pub const SUPPORTED_SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;

/// # Safety
/// `qp` is the `ibv_qp_ex` of a live `ShimQp`.
unsafe fn with(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut Batch, &ibv_qp_ex)) {
    // SAFETY: per the contract (qp_base is the first field of ShimQp).
    let q = unsafe { &*(qp as *const ShimQp) };
    let mut b = q.batch.lock();
    f(&mut b, &q.qp);
}

fn fail(b: &mut Batch, e: ShimError) {
    if b.err.is_none() {
        b.err = Some(e);
    }
}

unsafe fn push(qp: *mut ibv_qp_ex, op: WrOpcode, remote_addr: u64, rkey: u32) {
    // SAFETY: forwarded contract.
    unsafe {
        with(qp, |b, q| {
            let known = IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE;
            if q.wr_flags & !known != 0 {
                fail(
                    b,
                    ShimError::Unsupported(format!("wr_flags {:#x}", q.wr_flags & !known)),
                );
            }
            b.wrs.push(PendingWr {
                wr_id: q.wr_id,
                flags: SendFlags::from_bits_truncate(q.wr_flags) - SendFlags::INLINE,
                op,
                remote_addr,
                rkey,
                sges: Vec::new(),
                inline: Vec::new(),
                ud: None,
            });
        })
    }
}

unsafe fn last(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut PendingWr)) {
    // SAFETY: forwarded contract.
    unsafe {
        with(qp, |b, _| match b.wrs.last_mut() {
            Some(p) => f(p),
            None => fail(
                b,
                ShimError::InvalidArgument("wr_set_* without a work request".into()),
            ),
        })
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: called by the application on its own QP.
    unsafe { with(qp, |b, _| *b = Batch::default()) }
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: as above.
    unsafe { with(qp, |b, _| *b = Batch::default()) }
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    // SAFETY: as above.
    let q = unsafe { &*(qp as *const ShimQp) };
    let b = std::mem::take(&mut *q.batch.lock());
    if let Some(e) = b.err {
        return report("ibv_wr_complete", &e);
    }
    let wrs: Vec<SendWr> = b
        .wrs
        .iter()
        .map(|p| SendWr {
            wr_id: p.wr_id,
            sg_list: &p.sges,
            opcode: p.op,
            // INLINE is set exactly when wr_set_inline_data* supplied the payload.
            flags: p.flags,
            remote_addr: p.remote_addr,
            rkey: p.rkey,
            inline_data: &p.inline,
            ud: p.ud,
        })
        .collect();
    match q.inner.post_send(&wrs) {
        Ok(()) => 0,
        Err(e) => e.err.errno(),
    }
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::Write, addr, rkey) }
}
unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::WriteImm(imm), addr, rkey) }
}
unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::Read, addr, rkey) }
}
unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::Send, 0, 0) }
}
unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: u32) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::SendImm(imm), 0, 0) }
}
unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::CmpSwap { compare, swap }, addr, rkey) }
}
unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    // SAFETY: as above.
    unsafe { push(qp, WrOpcode::FetchAdd { add }, addr, rkey) }
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: as above.
    unsafe { last(qp, |p| p.sges = vec![Sge { addr, length, lkey }]) }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: u64, list: *const ibv_sge) {
    let mut v = Vec::with_capacity(n.min(64) as usize);
    let ok = n <= 64 && (n == 0 || !list.is_null());
    if ok {
        for i in 0..n as usize {
            // SAFETY: the application passes `n` SGEs.
            let s = unsafe { &*list.add(i) };
            v.push(Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            });
        }
    }
    // SAFETY: as above.
    unsafe {
        with(qp, |b, _| match (ok, b.wrs.last_mut()) {
            (true, Some(p)) => p.sges = v,
            _ => fail(
                b,
                ShimError::InvalidArgument(format!("wr_set_sge_list({n})")),
            ),
        })
    }
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, len: u64) {
    let data = if len == 0 {
        Vec::new()
    } else {
        // SAFETY: inline data is read at this call (the ibv_wr_set_inline_data contract).
        unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }.to_vec()
    };
    // SAFETY: as above.
    unsafe {
        last(qp, |p| {
            p.inline = data;
            p.flags |= SendFlags::INLINE;
        })
    }
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    n: u64,
    bufs: *const ibv_data_buf,
) {
    let mut data = Vec::new();
    for i in 0..n as usize {
        // SAFETY: the application passes `n` buffers, read at this call.
        let d = unsafe { &*bufs.add(i) };
        if d.length > 0 {
            // SAFETY: as above.
            data.extend_from_slice(unsafe {
                std::slice::from_raw_parts(d.addr as *const u8, d.length as usize)
            });
        }
    }
    // SAFETY: as above.
    unsafe {
        last(qp, |p| {
            p.inline = data;
            p.flags |= SendFlags::INLINE;
        })
    }
}

unsafe fn refuse(qp: *mut ibv_qp_ex, what: &str) {
    // SAFETY: as above.
    unsafe { with(qp, |b, _| fail(b, ShimError::Unsupported(what.into()))) }
}
unsafe extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, _rkey: u32) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_local_inv") }
}
unsafe extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, _rkey: u32) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_send_inv") }
}
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut ibv_qp_ex, _srqn: u32) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_set_xrc_srqn (XRC)") }
}
unsafe extern "C" fn wr_bind_mw(
    qp: *mut ibv_qp_ex,
    _mw: *mut ibv_mw,
    _rkey: u32,
    _i: *const ibv_mw_bind_info,
) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_bind_mw (memory windows)") }
}
unsafe extern "C" fn wr_send_tso(qp: *mut ibv_qp_ex, _h: *mut c_void, _hs: u16, _mss: u16) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_send_tso") }
}
unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, ah: *mut ibv_ah, qpn: u32, qkey: u32) {
    // SAFETY: the application passes an address handle of ours (NULL is refused).
    match unsafe { crate::ah::ud_dest(ah, qpn, qkey) } {
        // SAFETY: as above.
        Ok(d) => unsafe { last(qp, |p| p.ud = Some(d)) },
        // SAFETY: as above.
        Err(e) => unsafe { with(qp, |b, _| fail(b, e)) },
    }
}
unsafe extern "C" fn wr_atomic_write(
    qp: *mut ibv_qp_ex,
    _rkey: u32,
    _addr: u64,
    _wr: *const c_void,
) {
    // SAFETY: as above.
    unsafe { refuse(qp, "ibv_wr_atomic_write") }
}

/// Fill the builder function pointers of a new `ibv_qp_ex`.
pub fn install_wr_ops(q: &mut ibv_qp_ex) {
    q.wr_start = Some(wr_start);
    q.wr_complete = Some(wr_complete);
    q.wr_abort = Some(wr_abort);
    q.wr_rdma_write = Some(wr_rdma_write);
    q.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    q.wr_rdma_read = Some(wr_rdma_read);
    q.wr_send = Some(wr_send);
    q.wr_send_imm = Some(wr_send_imm);
    q.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    q.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    q.wr_set_sge = Some(wr_set_sge);
    q.wr_set_sge_list = Some(wr_set_sge_list);
    q.wr_set_inline_data = Some(wr_set_inline_data);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    q.wr_local_inv = Some(wr_local_inv);
    q.wr_send_inv = Some(wr_send_inv);
    q.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    q.wr_bind_mw = Some(wr_bind_mw);
    q.wr_send_tso = Some(wr_send_tso);
    q.wr_set_ud_addr = Some(wr_set_ud_addr);
    q.wr_atomic_write = Some(wr_atomic_write);
}
