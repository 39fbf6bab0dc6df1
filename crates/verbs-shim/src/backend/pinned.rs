//! `NPRDMA_MODE=pinned`: standard RDMA on the software RNIC (one rnic `Host` per
//! process over the shared-memory transport; `reg_mr` registers normally).

use super::{Cq, Device, Mr, Pd, Qp, Result};
use crate::error::ShimError;
use rnic::{Access, DeviceAttr, PostError, QpAttr, QpAttrMask, QpInitAttr, RecvWr, SendWr, Wc};
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

pub struct PinnedDevice {
    ctx: rnic::Context,
}

impl PinnedDevice {
    pub fn new() -> Result<PinnedDevice> {
        let host = rnic::Host::new(super::host_config_from_env()?)?;
        Ok(PinnedDevice {
            ctx: host.open_context()?,
        })
    }
}

impl Device for PinnedDevice {
    fn mode(&self) -> &'static str {
        "pinned"
    }
    fn attr(&self) -> DeviceAttr {
        self.ctx.query_device()
    }
    fn gid(&self) -> [u8; 16] {
        self.ctx.host().addr().to_bytes()
    }
    fn alloc_pd(&self) -> Result<Arc<dyn Pd>> {
        Ok(Arc::new(PinnedPd(self.ctx.alloc_pd()?)))
    }
    fn create_cq(&self, depth: u32, events: bool) -> Result<Box<dyn Cq>> {
        // One private channel per CQ: the C layer multiplexes them per ibv_comp_channel.
        let chan = if events {
            Some(self.ctx.create_comp_channel()?)
        } else {
            None
        };
        let cq = self.ctx.create_cq(depth, chan.as_ref())?;
        Ok(Box::new(PinnedCq { cq, chan }))
    }
}

struct PinnedPd(rnic::Pd);

impl Pd for PinnedPd {
    unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Box<dyn Mr>> {
        // SAFETY: forwarded contract: the caller keeps the memory mapped while registered.
        let mr = unsafe { self.0.reg_mr(addr, len, access)? };
        Ok(Box::new(PinnedMr(mr)))
    }
    fn create_qp(
        &self,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        let cq_of = |c: &dyn Cq| -> Result<rnic::Cq> {
            c.as_any()
                .downcast_ref::<PinnedCq>()
                .map(|p| p.cq.clone())
                .ok_or_else(|| ShimError::InvalidArgument("CQ of another backend".into()))
        };
        let qp = self.0.create_qp(&cq_of(send_cq)?, &cq_of(recv_cq)?, attr)?;
        Ok(Box::new(PinnedQp(qp)))
    }
}

struct PinnedMr(rnic::Mr);

impl Mr for PinnedMr {
    fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
}

struct PinnedCq {
    cq: rnic::Cq,
    chan: Option<rnic::CompChannel>,
}

impl Cq for PinnedCq {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        Ok(self.cq.poll(out)?)
    }
    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        Ok(self.cq.req_notify(solicited_only)?)
    }
    fn event_fd(&self) -> Option<RawFd> {
        self.chan.as_ref().map(|c| c.fd())
    }
    fn take_event(&self) -> bool {
        let Some(ch) = &self.chan else { return false };
        let mut buf = [0u8; 8];
        // SAFETY: reading 8 bytes into a local buffer from our own non-blocking eventfd.
        let _ = unsafe { libc::read(ch.fd(), buf.as_mut_ptr().cast(), 8) };
        // The CQ is this channel's only CQ: an event means it fired.
        ch.get_event(Some(Duration::ZERO)).is_ok()
    }
}

struct PinnedQp(rnic::Qp);

impl Qp for PinnedQp {
    fn qpn(&self) -> u32 {
        self.0.qpn()
    }
    fn cap(&self) -> QpInitAttr {
        self.0.cap()
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        Ok(self.0.modify(attr, mask)?)
    }
    fn query(&self) -> QpAttr {
        self.0.query()
    }
    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        self.0.post_send(wrs)
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.0.post_recv(wrs)
    }
}
