//! Shared receive queues: an SRQ is a table entry of its host whose receive-queue
//! fields and WQE ring are shared by the QPs created on it (`Pd::create_qp_of` with
//! `Some(srq)`); a message to any of them takes the oldest WQE. Posting shares the
//! QP receive queue's code (`responder::post_wqes`).

use crate::error::{Error, PostError, Result};
use crate::hw::segment::{shm_lock, SRQ_IN_USE};
use crate::nic::responder;
use crate::objects::pd::Pd;
use crate::verbs::{QpState, RecvWr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Pd {
    /// Create a shared receive queue of `max_wr` WQEs of up to `max_sge` SGEs each.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq> {
        let h = self.host().inner().clone();
        if max_wr == 0 || max_wr > h.cfg.max_wr {
            return Err(Error::InvalidArgument("SRQ max_wr"));
        }
        if max_sge == 0 || max_sge > h.cfg.max_sge {
            return Err(Error::InvalidArgument("SRQ max_sge"));
        }
        let idx = h
            .qps
            .lock()
            .alloc()
            .ok_or(Error::NoResources("QP table entries (SRQs)"))?;
        let r = h.seg.qp(idx).expect("allocated index");
        r.qpn.store(0, Ordering::Relaxed);
        r.state.store(QpState::Reset as u32, Ordering::Relaxed);
        r.pd.store(self.id(), Ordering::Relaxed);
        r.srq.store(0, Ordering::Relaxed);
        r.unreliable.store(0, Ordering::Relaxed);
        r.max_recv_sge.store(max_sge, Ordering::Relaxed);
        r.rq_depth.store(max_wr, Ordering::Relaxed);
        let t = r.rq_tail.load(Ordering::Relaxed);
        r.rq_head.store(t, Ordering::Relaxed);
        r.in_use.store(SRQ_IN_USE, Ordering::Release);
        Ok(Srq {
            inner: Arc::new(SrqInner {
                pd: self.clone(),
                idx,
                max_wr,
                max_sge,
            }),
        })
    }
}

struct SrqInner {
    pd: Pd,
    idx: u32,
    max_wr: u32,
    max_sge: u32,
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        let h = self.pd.host().inner();
        if let Some(r) = h.seg.qp(self.idx) {
            r.in_use.store(0, Ordering::Release);
        }
        h.qps.lock().release(self.idx);
    }
}

/// A shared receive queue (kept alive by the QPs created on it).
#[derive(Clone)]
pub struct Srq {
    inner: Arc<SrqInner>,
}

impl Srq {
    /// Post receive WRs (taken by whichever of its QPs a message arrives on first).
    pub fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let i = &*self.inner;
        let h = i.pd.host().inner();
        let r = h.seg.qp(i.idx).expect("own SRQ entry");
        let _g = shm_lock(&r.rq_lock);
        responder::post_wqes(&h.seg, i.idx, r, i.max_wr, i.max_sge, wrs)
            .map_err(|(bad_wr_index, err)| PostError { bad_wr_index, err })
    }
    /// WQEs posted and not yet taken.
    pub fn outstanding(&self) -> u32 {
        let h = self.inner.pd.host().inner();
        let r = h.seg.qp(self.inner.idx).expect("own SRQ entry");
        let _g = shm_lock(&r.rq_lock);
        (r.rq_tail.load(Ordering::Acquire) - r.rq_head.load(Ordering::Acquire)) as u32
    }
    /// Capacity in WQEs.
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }
    /// SGEs per WQE.
    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }
    /// The PD it was created on.
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }
    /// Its table index (1 + this is a QP's `srq` field).
    pub(crate) fn idx(&self) -> u32 {
        self.inner.idx
    }
}
