//! [`VerbsCq`]: a CQ on the device's completion channel, polled and armed
//! through the context's ops (libibverbs' inline `ibv_poll_cq` /
//! `ibv_req_notify_cq`).

use std::ffi::c_int;
use std::os::fd::RawFd;
use std::sync::Arc;

use nprdma::nic::{CompOp, Completion, NicCq};
use verbs_sys::*;

use crate::device::Dev;
use crate::dl::{check, errno_err};
use crate::Error;

pub(crate) struct CqInner {
    pub(crate) dev: Arc<Dev>,
    pub(crate) cq: *mut ibv_cq,
    poll: unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int,
    notify: unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int,
}

// SAFETY: libibverbs CQs may be polled and armed from any thread (the
// provider locks); the pointer is destroyed once, in Drop.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: our CQ (its QPs, which hold this, are gone), destroyed once.
        if let Err(e) = check("ibv_destroy_cq", unsafe {
            (self.dev.lib.destroy_cq)(self.cq)
        }) {
            tracing::error!(error = %e, "ibverbs-nic: leaking a CQ");
        }
    }
}

/// A completion queue (a handle: QPs keep the CQ alive).
#[derive(Clone)]
pub struct VerbsCq(pub(crate) Arc<CqInner>);

impl std::fmt::Debug for VerbsCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("VerbsCq").field(&self.0.cq).finish()
    }
}

impl VerbsCq {
    pub(crate) fn create(dev: &Arc<Dev>, depth: u32) -> Result<VerbsCq, Error> {
        let ops = dev.ops();
        let (Some(poll), Some(notify)) = (ops.poll_cq, ops.req_notify_cq) else {
            return Err(Error::Invalid(
                "the context's ops lack poll_cq / req_notify_cq",
            ));
        };
        let depth = c_int::try_from(depth.max(1)).map_err(|_| Error::Invalid("CQ depth"))?;
        // SAFETY: a live context and channel.
        let cq = unsafe { (dev.lib.create_cq)(dev.ctx, depth, std::ptr::null_mut(), dev.chan, 0) };
        if cq.is_null() {
            return Err(errno_err("ibv_create_cq"));
        }
        Ok(VerbsCq(Arc::new(CqInner {
            dev: dev.clone(),
            cq,
            poll,
            notify,
        })))
    }
}

/// A work completion in the nic vocabulary (the opcode of an error
/// completion is undefined in verbs: it reads as whatever it says).
fn convert(wc: &ibv_wc) -> Completion {
    let imm = wc.wc_flags & IBV_WC_WITH_IMM != 0;
    let op = match wc.opcode {
        IBV_WC_RDMA_WRITE => CompOp::Write,
        IBV_WC_RDMA_READ => CompOp::Read,
        IBV_WC_COMP_SWAP => CompOp::CmpSwap,
        IBV_WC_FETCH_ADD => CompOp::FetchAdd,
        IBV_WC_RECV => CompOp::Recv,
        IBV_WC_RECV_RDMA_WITH_IMM => CompOp::RecvWithImm,
        _ => CompOp::Send,
    };
    Completion {
        wr_id: wc.wr_id,
        status: wc.status,
        op,
        byte_len: wc.byte_len,
        // SAFETY: the union's immediate member (a plain u32), valid with the flag.
        imm: imm.then(|| u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })),
        qp_num: wc.qp_num,
    }
}

impl NicCq for VerbsCq {
    type Error = Error;

    fn poll(&self, out: &mut [Completion]) -> Result<usize, Error> {
        const CHUNK: usize = 16;
        // SAFETY: plain C data.
        let mut wcs: [ibv_wc; CHUNK] = unsafe { std::mem::zeroed() };
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(CHUNK);
            // SAFETY: a live CQ, `want` slots of `wcs`.
            let n = unsafe { (self.0.poll)(self.0.cq, want as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(Error::Verb {
                    verb: "ibv_poll_cq",
                    source: std::io::Error::from_raw_os_error(n.abs()),
                });
            }
            let n = n as usize;
            for (o, wc) in out[done..].iter_mut().zip(&wcs[..n]) {
                *o = convert(wc);
            }
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    fn arm(&self, solicited_only: bool) -> Result<(), Error> {
        // SAFETY: a live CQ on the channel.
        check("ibv_req_notify_cq", unsafe {
            (self.0.notify)(self.0.cq, c_int::from(solicited_only))
        })
    }

    fn event_fd(&self) -> Option<RawFd> {
        // The channel's fd is not an eventfd (an event is consumed with
        // ibv_get_cq_event): waiting goes through `Nic::wait_event`.
        None
    }
}
