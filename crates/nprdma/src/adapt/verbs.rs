//! The software RNIC through the narrow verbs traits ([`nic::Nic`],
//! [`nic::NicQp`], [`nic::NicCq`], [`nic::NicBuf`]): one PD of an `rnic`
//! host ([`RnicNic`]), its CQs ([`RnicCq`]), RC QPs ([`RnicQp`]) and owned
//! registered buffers ([`RnicBuf`]). Work requests and
//! completions are translated between the two vocabularies here and nowhere
//! else (`ibv` numbering on both sides).

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use super::{rnic_access, rnic_opcode, RnicIommu, RnicMr};
use crate::nic::{
    self, Access, CompOp, Completion, DeviceCaps, PeerAddr, PostError, QpSpec, RecvRequest,
    WorkRequest,
};

/// One protection domain of an `rnic` host, with its completion channel and
/// IOMMU control.
pub struct RnicNic {
    host: rnic::Host,
    _ctx: rnic::Context,
    pd: rnic::Pd,
    chan: rnic::CompChannel,
    iommu: Arc<RnicIommu>,
}

impl RnicNic {
    /// Open `host` and allocate a PD on it.
    pub fn open(host: &rnic::Host) -> Result<RnicNic, rnic::Error> {
        let ctx = host.open_context()?;
        let pd = ctx.alloc_pd()?;
        let chan = ctx.create_comp_channel()?;
        Ok(RnicNic {
            host: host.clone(),
            iommu: Arc::new(RnicIommu::new(host.clone(), pd.clone())),
            _ctx: ctx,
            pd,
            chan,
        })
    }
}

/// An owned registered buffer of an `rnic` PD: from the host's NIC-shared
/// DMA pool ([`nic::Nic::alloc_ring_buf`], so a peer's SEND into it is a
/// memcpy even across processes) or from the heap. Either way the MR goes
/// first on drop (waiting for in-flight DMA), then the memory.
pub enum RnicBuf {
    /// A DMA-pool buffer (deregistered before it is freed).
    Pool(rnic::DmaMr),
    /// A heap buffer.
    Heap(rnic::OwnedMr),
}

impl nic::NicMr for RnicBuf {
    #[inline]
    fn lkey(&self) -> u32 {
        match self {
            RnicBuf::Pool(m) => m.lkey(),
            RnicBuf::Heap(m) => m.lkey(),
        }
    }
    #[inline]
    fn rkey(&self) -> u32 {
        match self {
            RnicBuf::Pool(m) => m.rkey(),
            RnicBuf::Heap(m) => m.rkey(),
        }
    }
    #[inline]
    fn addr(&self) -> u64 {
        match self {
            RnicBuf::Pool(m) => m.addr() as u64,
            RnicBuf::Heap(m) => m.addr() as u64,
        }
    }
    #[inline]
    fn len(&self) -> u64 {
        match self {
            RnicBuf::Pool(m) => m.len() as u64,
            RnicBuf::Heap(m) => m.len() as u64,
        }
    }
}

impl nic::NicBuf for RnicBuf {
    fn read(&self, off: usize, out: &mut [u8]) {
        match self {
            RnicBuf::Pool(m) => m.buffer().read_at(off, out).expect("buffer read in bounds"),
            RnicBuf::Heap(m) => m.read(off, out),
        }
    }
}

/// An `rnic` CQ (on its [`RnicNic`]'s completion channel).
pub struct RnicCq {
    cq: rnic::Cq,
    fd: RawFd,
}

/// An `rnic` RC QP.
pub struct RnicQp(pub rnic::Qp);

/// The NIC completion `wc` in the verbs vocabulary.
#[inline]
pub fn completion(wc: &rnic::Wc) -> Completion {
    let imm = wc.wc_flags.contains(rnic::WcFlags::WITH_IMM);
    Completion {
        wr_id: wc.wr_id,
        status: wc.status as u32,
        op: match wc.opcode {
            rnic::WcOpcode::Send => CompOp::Send,
            rnic::WcOpcode::RdmaWrite => CompOp::Write,
            rnic::WcOpcode::RdmaRead => CompOp::Read,
            rnic::WcOpcode::CompSwap => CompOp::CmpSwap,
            rnic::WcOpcode::FetchAdd => CompOp::FetchAdd,
            rnic::WcOpcode::Recv => CompOp::Recv,
            rnic::WcOpcode::RecvRdmaWithImm => CompOp::RecvWithImm,
        },
        byte_len: wc.byte_len,
        imm: imm.then_some(wc.imm_data),
        qp_num: wc.qp_num,
    }
}

impl nic::NicCq for RnicCq {
    type Error = rnic::Error;
    #[inline]
    fn poll(&self, out: &mut [Completion]) -> Result<usize, rnic::Error> {
        let mut slots = out.iter_mut();
        self.cq.poll_each(slots.len(), |wc| {
            if let Some(slot) = slots.next() {
                *slot = completion(&wc);
            }
        })
    }
    fn arm(&self, solicited_only: bool) -> Result<(), rnic::Error> {
        self.cq.req_notify(solicited_only)
    }
    fn event_fd(&self) -> Option<RawFd> {
        Some(self.fd)
    }
}

/// WR `k`'s inline payload lies in memory the application unmapped: the post
/// fails there, as a NIC copying the payload at post time would.
fn gone(k: usize) -> PostError<rnic::Error> {
    PostError {
        bad_index: k,
        source: rnic::Error::InvalidArgument("inline payload memory is not mapped"),
    }
}

/// The rnic send flags of `w`.
#[inline]
fn send_flags(w: &WorkRequest<'_>) -> rnic::SendFlags {
    let mut flags = rnic::SendFlags::empty();
    if w.signaled {
        flags |= rnic::SendFlags::SIGNALED;
    }
    if w.fence {
        flags |= rnic::SendFlags::FENCE;
    }
    flags
}

/// `sg` as the rnic SGEs they are, without a copy: both types are
/// `struct ibv_sge` (`#[repr(C)]`, same fields in the same order; checked at
/// compile time below), so a posted WR borrows the engine's SGE array as is.
#[inline]
fn rnic_sges(sg: &[nic::Sge]) -> &[rnic::Sge] {
    const _: () = {
        use std::mem::{align_of, offset_of, size_of};
        assert!(size_of::<nic::Sge>() == size_of::<rnic::Sge>());
        assert!(align_of::<nic::Sge>() == align_of::<rnic::Sge>());
        assert!(offset_of!(nic::Sge, addr) == offset_of!(rnic::Sge, addr));
        assert!(offset_of!(nic::Sge, length) == offset_of!(rnic::Sge, length));
        assert!(offset_of!(nic::Sge, lkey) == offset_of!(rnic::Sge, lkey));
    };
    // SAFETY: `nic::Sge` and `rnic::Sge` are both `#[repr(C)]` with fields of
    // the same types at the same offsets and the same size and alignment (the
    // assertions above), and neither has invalid bit patterns or padding
    // (u64, u32, u32): the slice reinterpreted covers the same bytes, with
    // the same lifetime.
    #[allow(unsafe_code)]
    unsafe {
        std::slice::from_raw_parts(sg.as_ptr().cast::<rnic::Sge>(), sg.len())
    }
}

/// The rnic WR of `w` (not inline: its SGEs borrowed as they are).
#[inline]
fn rnic_wr<'a>(w: &WorkRequest<'a>) -> rnic::SendWr<'a> {
    rnic::SendWr::new(w.wr_id, rnic_opcode(w.op), rnic_sges(w.sg_list))
        .remote(w.remote_addr, w.rkey)
        .flags(send_flags(w))
}

/// The rnic WR of inline `w` carrying `data` (its payload, copied now).
fn rnic_inline_wr<'a>(w: &WorkRequest<'_>, data: &'a [u8]) -> rnic::SendWr<'a> {
    rnic::SendWr::new(w.wr_id, rnic_opcode(w.op), &[])
        .remote(w.remote_addr, w.rkey)
        .flags(send_flags(w))
        .inline(data)
}

/// The rnic receive WR of `w` (its SGEs borrowed as they are).
#[inline]
fn rwr<'a>(w: &RecvRequest<'a>) -> rnic::RecvWr<'a> {
    rnic::RecvWr {
        wr_id: w.wr_id,
        sg_list: rnic_sges(w.sg_list),
    }
}

/// A post error in the verbs vocabulary.
#[inline]
fn post_error(e: rnic::PostError) -> PostError<rnic::Error> {
    PostError {
        bad_index: e.bad_wr_index,
        source: e.err,
    }
}

impl nic::NicQp for RnicQp {
    type Error = rnic::Error;
    fn qpn(&self) -> u32 {
        self.0.qpn()
    }
    fn connect(&self, peer: PeerAddr, peer_qpn: u32, access: Access) -> Result<(), rnic::Error> {
        let acc = rnic::Access::LOCAL_WRITE | rnic_access(access);
        self.0
            .connect(acc, rnic::HostAddr::from_bytes(&peer.0), peer_qpn, 7)
    }
    fn reset(&self) -> Result<(), rnic::Error> {
        let a = rnic::QpAttr {
            qp_state: rnic::QpState::Reset,
            ..rnic::QpAttr::default()
        };
        self.0.modify(&a, rnic::QpAttrMask::STATE)
    }
    #[inline]
    fn post_send(&self, wrs: &[WorkRequest<'_>]) -> Result<(), PostError<rnic::Error>> {
        // The engine's common cases, a few WRs without inline data (their
        // SGEs borrowed as they are), or one small inline payload: the rnic
        // WRs on the stack, nothing else copied.
        if wrs.len() <= 4 && wrs.iter().all(|w| !w.inline) {
            let res = match wrs {
                [] => Ok(()),
                [a] => self.0.post_send(&[rnic_wr(a)]),
                [a, b] => self.0.post_send(&[rnic_wr(a), rnic_wr(b)]),
                [a, b, c] => self.0.post_send(&[rnic_wr(a), rnic_wr(b), rnic_wr(c)]),
                [a, b, c, d] => self
                    .0
                    .post_send(&[rnic_wr(a), rnic_wr(b), rnic_wr(c), rnic_wr(d)]),
                _ => unreachable!("at most 4 WRs"),
            };
            return res.map_err(post_error);
        }
        // (Here a single WR is inline.)
        if let [w] = wrs {
            let inline_len: u64 = w.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if inline_len <= 256 {
                let mut buf = [0u8; 256];
                let mut at = 0;
                for s in w.sg_list {
                    let n = s.length as usize;
                    crate::mem::read_into(s.addr, &mut buf[at..at + n]).map_err(|_| gone(0))?;
                    at += n;
                }
                let r = rnic_inline_wr(w, &buf[..at]);
                return self
                    .0
                    .post_send(std::slice::from_ref(&r))
                    .map_err(post_error);
            }
        }
        // Inline payloads copied now, as the NIC would, into one flat
        // buffer; the WRs borrow their spans of it.
        let mut bytes: SmallVec<[u8; 1024]> = SmallVec::new();
        let mut spans: SmallVec<[std::ops::Range<usize>; 8]> = SmallVec::new();
        for (k, w) in wrs.iter().enumerate() {
            let b = bytes.len();
            if w.inline {
                for s in w.sg_list {
                    let at = bytes.len();
                    bytes.resize(at + s.length as usize, 0);
                    crate::mem::read_into(s.addr, &mut bytes[at..]).map_err(|_| gone(k))?;
                }
            }
            spans.push(b..bytes.len());
        }
        let rwrs: SmallVec<[rnic::SendWr<'_>; 8]> = wrs
            .iter()
            .zip(&spans)
            .map(|(w, sp)| {
                if w.inline {
                    rnic_inline_wr(w, &bytes[sp.clone()])
                } else {
                    rnic_wr(w)
                }
            })
            .collect();
        self.0.post_send(&rwrs).map_err(post_error)
    }
    #[inline]
    fn post_recv(&self, wrs: &[RecvRequest<'_>]) -> Result<(), PostError<rnic::Error>> {
        if let [w] = wrs {
            return self.0.post_recv(&[rwr(w)]).map_err(post_error);
        }
        let rwrs: SmallVec<[rnic::RecvWr<'_>; 8]> = wrs.iter().map(rwr).collect();
        self.0.post_recv(&rwrs).map_err(post_error)
    }
    fn peer_gone(&self) -> bool {
        self.0.peer_gone()
    }
    fn set_error(&self) -> Result<(), rnic::Error> {
        let err = rnic::QpAttr {
            qp_state: rnic::QpState::Err,
            ..rnic::QpAttr::default()
        };
        self.0.modify(&err, rnic::QpAttrMask::STATE)
    }
    fn set_access(&self, access: Access) -> Result<(), rnic::Error> {
        let a = rnic::QpAttr {
            qp_access_flags: rnic::Access::LOCAL_WRITE | rnic_access(access),
            ..Default::default()
        };
        self.0.modify(&a, rnic::QpAttrMask::ACCESS_FLAGS)
    }
}

impl nic::Nic for RnicNic {
    type Error = rnic::Error;
    type Mr = RnicMr;
    type Cq = RnicCq;
    type Qp = RnicQp;
    type Buf = RnicBuf;
    type Iommu = RnicIommu;
    type Stats = rnic::NicStats;
    fn caps(&self) -> DeviceCaps {
        let d = self.host.query_device();
        DeviceCaps {
            max_tlp: d.max_tlp as usize,
            magic: d.signature_magic,
            page_size: d.page_size as usize,
            max_qp_wr: d.max_qp_wr,
            max_sge: d.max_sge,
            max_inline: d.max_inline_data,
            iommu: true,
            max_cqe: d.max_cqe,
        }
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<RnicMr, rnic::Error> {
        // SAFETY: forwarded contract (the memory stays mapped while the MR
        // exists).
        unsafe {
            self.pd
                .reg_mr(addr as usize, len as usize, rnic_access(access))
                .map(RnicMr)
        }
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_in_domain(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        domain: u32,
    ) -> Result<RnicMr, rnic::Error> {
        // SAFETY: forwarded contract (the memory stays mapped while the MR
        // exists).
        unsafe {
            self.pd
                .reg_mr_in_domain(addr as usize, len as usize, rnic_access(access), domain)
                .map(RnicMr)
        }
    }
    fn alloc_buf(&self, len: usize, access: Access) -> Result<RnicBuf, rnic::Error> {
        self.pd
            .reg_mr_owned(vec![0; len], rnic_access(access))
            .map(RnicBuf::Heap)
    }
    fn alloc_ring_buf(&self, len: usize, access: Access) -> Result<RnicBuf, rnic::Error> {
        match self.host.alloc_dma_buffer(len) {
            Ok(buf) => Ok(RnicBuf::Pool(
                self.pd.reg_dma_buffer(buf, rnic_access(access))?,
            )),
            Err(e) => {
                // Pool disabled or exhausted: an owned heap buffer.
                tracing::debug!(error = %e, len, "ring buffer not from the DMA pool");
                self.alloc_buf(len, access)
            }
        }
    }
    fn create_cq(&self, depth: u32) -> Result<RnicCq, rnic::Error> {
        let cq = self._ctx.create_cq(depth, Some(&self.chan))?;
        Ok(RnicCq {
            cq,
            fd: self.chan.fd(),
        })
    }
    fn create_qp(
        &self,
        spec: &QpSpec,
        send_cq: &RnicCq,
        recv_cq: &RnicCq,
    ) -> Result<RnicQp, rnic::Error> {
        self.pd
            .create_qp(
                &send_cq.cq,
                &recv_cq.cq,
                &rnic::QpInitAttr {
                    qpn: spec.qpn,
                    max_send_wr: spec.max_send_wr,
                    max_recv_wr: spec.max_recv_wr,
                    max_send_sge: spec.max_sge,
                    max_recv_sge: spec.max_sge,
                    max_inline_data: spec.max_inline,
                    sq_sig_all: false,
                },
            )
            .map(|qp| {
                qp.set_domain(spec.domain);
                RnicQp(qp)
            })
    }
    fn addr(&self) -> PeerAddr {
        PeerAddr(self.host.addr().to_bytes())
    }
    fn iommu(&self) -> Option<Arc<RnicIommu>> {
        Some(self.iommu.clone())
    }
    fn wait_event(&self, timeout: Duration) -> Result<bool, rnic::Error> {
        match self.chan.get_event_or_wake(Some(timeout)) {
            Ok(_) => Ok(true),
            Err(rnic::Error::Timeout) => Ok(false),
            Err(e) => Err(e),
        }
    }
    fn stats(&self) -> rnic::NicStats {
        self.host.stats()
    }
    fn set_ring_polling(&self, on: bool) -> bool {
        self.host.set_ring_polling(on)
    }
    fn serve_rings(&self) -> bool {
        self.host.serve_rings()
    }
    fn ring_passes(&self) -> u64 {
        self.host.ring_passes()
    }
    fn pace_own_polls(&self) {
        rnic::cq::pace_own_polls();
    }
    fn add_ring_waker(&self) -> u64 {
        self.host.add_ring_waker(Arc::new(self.chan.waker()))
    }
    fn remove_ring_waker(&self, id: u64) {
        self.host.remove_ring_waker(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::Nic;
    use crate::testutil::{buffers_and_access_contract, iommu_contract, verbs_contract};

    #[test]
    fn the_software_nic_keeps_the_verbs_contract() {
        let ha = rnic::Host::new(rnic::HostConfig::default()).expect("host a");
        let hb = rnic::Host::new(rnic::HostConfig::default()).expect("host b");
        let (a, b) = (
            RnicNic::open(&ha).expect("nic a"),
            RnicNic::open(&hb).expect("nic b"),
        );
        assert!(a.caps().iommu && a.iommu().is_some());
        assert_ne!(a.addr(), b.addr());
        verbs_contract(&a, &b);
        buffers_and_access_contract(&a, &b);
        iommu_contract(&a, &b);
    }
}
