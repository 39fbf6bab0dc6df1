//! [`VerbsQp`]: an RC QP, connected by GID (RoCE) through the standard
//! RESET→INIT→RTR→RTS sequence; WRs posted through the context's ops
//! (libibverbs' inline `ibv_post_send` / `ibv_post_recv`).

use std::ffi::c_int;
use std::sync::Arc;

use nprdma::nic::{Access, NicQp, PeerAddr, PostError, QpSpec, RecvRequest, WorkRequest, WrOp};
use smallvec::SmallVec;
use verbs_sys::*;

use crate::cq::VerbsCq;
use crate::device::{qp_access, Dev};
use crate::dl::{check, errno_err};
use crate::Error;

type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// An RC queue pair.
pub struct VerbsQp {
    dev: Arc<Dev>,
    qp: *mut ibv_qp,
    qpn: u32,
    post_send: PostSend,
    post_recv: PostRecv,
    // The CQs outlive the QP.
    _cqs: (VerbsCq, VerbsCq),
}

// SAFETY: libibverbs QPs may be posted to and modified from any thread (the
// provider locks); the pointer is destroyed once, in Drop.
unsafe impl Send for VerbsQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsQp {}

impl std::fmt::Debug for VerbsQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsQp").field("qpn", &self.qpn).finish()
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // SAFETY: our QP, destroyed once (before its CQs: fields drop after).
        if let Err(e) = check("ibv_destroy_qp", unsafe {
            (self.dev.lib.destroy_qp)(self.qp)
        }) {
            tracing::error!(error = %e, qpn = self.qpn, "ibverbs-nic: leaking a QP");
        }
    }
}

fn zeroed<T>() -> T {
    // SAFETY: used for the verbs.h attribute and WR structs only (plain C
    // data: integers, pointers, unions of them; all-zero is valid).
    unsafe { std::mem::zeroed() }
}

impl VerbsQp {
    pub(crate) fn create(
        dev: &Arc<Dev>,
        spec: &QpSpec,
        send_cq: &VerbsCq,
        recv_cq: &VerbsCq,
    ) -> Result<VerbsQp, Error> {
        if spec.qpn.is_some() {
            // A real device numbers its QPs itself; NP-RDMA's control QPs
            // are paired by exchanging numbers instead.
            return Err(Error::Invalid(
                "a chosen QP number (the device assigns them)",
            ));
        }
        let ops = dev.ops();
        let (Some(post_send), Some(post_recv)) = (ops.post_send, ops.post_recv) else {
            return Err(Error::Invalid(
                "the context's ops lack post_send / post_recv",
            ));
        };
        let mut a: ibv_qp_init_attr = zeroed();
        a.send_cq = send_cq.0.cq;
        a.recv_cq = recv_cq.0.cq;
        a.qp_type = IBV_QPT_RC;
        a.cap.max_send_wr = spec.max_send_wr.max(1);
        a.cap.max_recv_wr = spec.max_recv_wr.max(1);
        a.cap.max_send_sge = spec.max_sge.max(1);
        a.cap.max_recv_sge = spec.max_sge.max(1);
        a.cap.max_inline_data = spec.max_inline;
        // SAFETY: a live PD and CQs of the same context.
        let qp = unsafe { (dev.lib.create_qp)(dev.pd, &mut a) };
        if qp.is_null() {
            return Err(errno_err("ibv_create_qp"));
        }
        // SAFETY: the QP just created.
        let qpn = unsafe { (*qp).qp_num };
        Ok(VerbsQp {
            dev: dev.clone(),
            qp,
            qpn,
            post_send,
            post_recv,
            _cqs: (send_cq.clone(), recv_cq.clone()),
        })
    }

    fn modify(&self, verb: &'static str, attr: &mut ibv_qp_attr, mask: u32) -> Result<(), Error> {
        // SAFETY: a live QP, a filled attribute.
        check(verb, unsafe {
            (self.dev.lib.modify_qp)(self.qp, attr, mask as c_int)
        })
    }
}

/// The `ibv_send_wr` of `w` over `sges` (its `next` set by the caller).
fn send_wr(w: &WorkRequest<'_>, sges: *mut ibv_sge) -> ibv_send_wr {
    let mut s: ibv_send_wr = zeroed();
    s.wr_id = w.wr_id;
    s.sg_list = sges;
    s.num_sge = w.sg_list.len() as c_int;
    s.send_flags = (if w.signaled { IBV_SEND_SIGNALED } else { 0 })
        | (if w.fence { IBV_SEND_FENCE } else { 0 })
        | (if w.inline { IBV_SEND_INLINE } else { 0 });
    let rdma = |s: &mut ibv_send_wr| {
        s.wr.rdma = ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: w.remote_addr,
            rkey: w.rkey,
        }
    };
    let atomic = |s: &mut ibv_send_wr, compare_add: u64, swap: u64| {
        s.wr.atomic = ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: w.remote_addr,
            compare_add,
            swap,
            rkey: w.rkey,
        }
    };
    match w.op {
        WrOp::Write => {
            s.opcode = IBV_WR_RDMA_WRITE;
            rdma(&mut s);
        }
        WrOp::WriteImm(imm) => {
            s.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            s.__bindgen_anon_1.imm_data = imm.to_be();
            rdma(&mut s);
        }
        WrOp::Send => s.opcode = IBV_WR_SEND,
        WrOp::SendImm(imm) => {
            s.opcode = IBV_WR_SEND_WITH_IMM;
            s.__bindgen_anon_1.imm_data = imm.to_be();
        }
        WrOp::Read => {
            s.opcode = IBV_WR_RDMA_READ;
            rdma(&mut s);
        }
        WrOp::CmpSwap { compare, swap } => {
            s.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
            atomic(&mut s, compare, swap);
        }
        WrOp::FetchAdd { add } => {
            s.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
            atomic(&mut s, add, 0);
        }
    }
    s
}

fn sge(s: &nprdma::nic::Sge) -> ibv_sge {
    ibv_sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }
}

/// The index of `bad` in the chain starting at `base` (`None` pointer:
/// every WR counts as refused from 0).
fn bad_index<T>(base: *const T, bad: *const T, n: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    let i = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<T>();
    i.min(n)
}

impl NicQp for VerbsQp {
    type Error = Error;

    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn connect(&self, peer: PeerAddr, peer_qpn: u32, access: Access) -> Result<(), Error> {
        let d = &self.dev;
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_INIT;
        a.port_num = d.port;
        a.pkey_index = 0;
        a.qp_access_flags = qp_access(access) as u32;
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
        )?;
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = d.mtu;
        a.dest_qp_num = peer_qpn;
        a.rq_psn = 0;
        a.max_dest_rd_atomic = d.rd_atom;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = peer.0;
        a.ah_attr.grh.sgid_index = d.gid_index;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.port_num = d.port;
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = 0;
        a.max_rd_atomic = d.rd_atom;
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    fn post_send(&self, wrs: &[WorkRequest<'_>]) -> Result<(), PostError<Error>> {
        if wrs.is_empty() {
            return Ok(());
        }
        // On the stack for the engine's usual posts (a few WRs, few SGEs).
        let mut sges: SmallVec<[ibv_sge; 8]> =
            wrs.iter().flat_map(|w| w.sg_list.iter().map(sge)).collect();
        let mut chain: SmallVec<[ibv_send_wr; 4]> = SmallVec::with_capacity(wrs.len());
        let mut at = 0;
        for w in wrs {
            let p = if w.sg_list.is_empty() {
                std::ptr::null_mut()
            } else {
                // In bounds: `at + len <= sges.len()` by construction.
                sges[at..].as_mut_ptr()
            };
            at += w.sg_list.len();
            chain.push(send_wr(w, p));
        }
        let base = chain.as_mut_ptr();
        for i in 1..chain.len() {
            // SAFETY: `i` < len; the chain is not resized (nor moved) any more.
            chain[i - 1].next = unsafe { base.add(i) };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the chain and its SGEs live across the call
        // (libibverbs copies WRs at post time; inline data too).
        let rc = unsafe { (self.post_send)(self.qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        Err(PostError {
            bad_index: bad_index(base, bad, wrs.len()),
            source: Error::Verb {
                verb: "ibv_post_send",
                source: std::io::Error::from_raw_os_error(rc.abs()),
            },
        })
    }

    fn post_recv(&self, wrs: &[RecvRequest<'_>]) -> Result<(), PostError<Error>> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: SmallVec<[ibv_sge; 8]> =
            wrs.iter().flat_map(|w| w.sg_list.iter().map(sge)).collect();
        let mut chain: SmallVec<[ibv_recv_wr; 8]> = SmallVec::with_capacity(wrs.len());
        let mut at = 0;
        for w in wrs {
            let mut r: ibv_recv_wr = zeroed();
            r.wr_id = w.wr_id;
            r.num_sge = w.sg_list.len() as c_int;
            r.sg_list = if w.sg_list.is_empty() {
                std::ptr::null_mut()
            } else {
                sges[at..].as_mut_ptr()
            };
            at += w.sg_list.len();
            chain.push(r);
        }
        let base = chain.as_mut_ptr();
        for i in 1..chain.len() {
            // SAFETY: `i` < len; the chain is not resized (nor moved) any more.
            chain[i - 1].next = unsafe { base.add(i) };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the chain and its SGEs live across the call.
        let rc = unsafe { (self.post_recv)(self.qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        Err(PostError {
            bad_index: bad_index(base, bad, wrs.len()),
            source: Error::Verb {
                verb: "ibv_post_recv",
                source: std::io::Error::from_raw_os_error(rc.abs()),
            },
        })
    }

    fn set_error(&self) -> Result<(), Error> {
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_ERR;
        self.modify("ibv_modify_qp(ERR)", &mut a, IBV_QP_STATE)
    }

    fn reset(&self) -> Result<(), Error> {
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_RESET;
        self.modify("ibv_modify_qp(RESET)", &mut a, IBV_QP_STATE)
    }

    fn set_access(&self, access: Access) -> Result<(), Error> {
        let mut a: ibv_qp_attr = zeroed();
        a.qp_access_flags = qp_access(access) as u32;
        self.modify("ibv_modify_qp(access)", &mut a, IBV_QP_ACCESS_FLAGS)
    }
}
