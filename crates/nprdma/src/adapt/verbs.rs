//! The software RNIC through the narrow verbs traits ([`nic::Nic`],
//! [`nic::NicQp`], [`nic::NicCq`]): one PD of an `rnic` host ([`RnicNic`]),
//! its CQs ([`RnicCq`]) and RC QPs ([`RnicQp`]). Work requests and
//! completions are translated between the two vocabularies here and nowhere
//! else (`ibv` numbering on both sides).

use std::os::fd::RawFd;

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
    iommu: RnicIommu,
}

impl RnicNic {
    /// Open `host` and allocate a PD on it.
    pub fn open(host: &rnic::Host) -> Result<RnicNic, rnic::Error> {
        let ctx = host.open_context()?;
        let pd = ctx.alloc_pd()?;
        let chan = ctx.create_comp_channel()?;
        Ok(RnicNic {
            host: host.clone(),
            iommu: RnicIommu::new(host.clone(), pd.clone()),
            _ctx: ctx,
            pd,
            chan,
        })
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
            rnic::WcOpcode::Recv if imm => CompOp::RecvWithImm,
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
    fn poll(&self, out: &mut [Completion]) -> Result<usize, rnic::Error> {
        let mut wcs = [rnic::Wc::default(); 16];
        let mut n = 0;
        while n < out.len() {
            let want = (out.len() - n).min(wcs.len());
            let k = self.cq.poll(&mut wcs[..want])?;
            for (o, wc) in out[n..].iter_mut().zip(&wcs[..k]) {
                *o = completion(wc);
            }
            n += k;
            if k < want {
                break;
            }
        }
        Ok(n)
    }
    fn arm(&self, solicited_only: bool) -> Result<(), rnic::Error> {
        self.cq.req_notify(solicited_only)
    }
    fn event_fd(&self) -> Option<RawFd> {
        Some(self.fd)
    }
}

/// Where WR `k`'s SGEs and inline bytes lie in the flattened buffers.
struct Spans {
    sge: std::ops::Range<usize>,
    inline: Option<std::ops::Range<usize>>,
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
    fn post_send(&self, wrs: &[WorkRequest<'_>]) -> Result<(), PostError<rnic::Error>> {
        // The SGEs (and inline payloads, copied now as the NIC would) of
        // all WRs in two flat buffers; the WRs borrow their spans.
        let mut sges: SmallVec<[rnic::Sge; 16]> = SmallVec::new();
        let mut bytes: Vec<u8> = Vec::new();
        let mut spans: SmallVec<[Spans; 8]> = SmallVec::new();
        for w in wrs {
            let start = sges.len();
            let inline = w.inline.then(|| {
                let b = bytes.len();
                for s in w.sg_list {
                    bytes.extend_from_slice(&crate::mem::read(s.addr, s.length as usize));
                }
                b..bytes.len()
            });
            if !w.inline {
                sges.extend(w.sg_list.iter().map(|s| rnic::Sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                }));
            }
            spans.push(Spans {
                sge: start..sges.len(),
                inline,
            });
        }
        let rwrs: SmallVec<[rnic::SendWr<'_>; 8]> = wrs
            .iter()
            .zip(&spans)
            .map(|(w, sp)| {
                let mut flags = rnic::SendFlags::empty();
                if w.signaled {
                    flags |= rnic::SendFlags::SIGNALED;
                }
                if w.fence {
                    flags |= rnic::SendFlags::FENCE;
                }
                let r = rnic::SendWr::new(w.wr_id, rnic_opcode(w.op), &sges[sp.sge.clone()])
                    .remote(w.remote_addr, w.rkey)
                    .flags(flags);
                match &sp.inline {
                    Some(i) => r.inline(&bytes[i.clone()]),
                    None => r,
                }
            })
            .collect();
        self.0.post_send(&rwrs).map_err(|e| PostError {
            bad_index: e.bad_wr_index,
            source: e.err,
        })
    }
    fn post_recv(&self, wrs: &[RecvRequest<'_>]) -> Result<(), PostError<rnic::Error>> {
        let mut sges: SmallVec<[rnic::Sge; 16]> = SmallVec::new();
        let mut spans: SmallVec<[std::ops::Range<usize>; 8]> = SmallVec::new();
        for w in wrs {
            let start = sges.len();
            sges.extend(w.sg_list.iter().map(|s| rnic::Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }));
            spans.push(start..sges.len());
        }
        let rwrs: SmallVec<[rnic::RecvWr<'_>; 8]> = wrs
            .iter()
            .zip(&spans)
            .map(|(w, sp)| rnic::RecvWr {
                wr_id: w.wr_id,
                sg_list: &sges[sp.clone()],
            })
            .collect();
        self.0.post_recv(&rwrs).map_err(|e| PostError {
            bad_index: e.bad_wr_index,
            source: e.err,
        })
    }
    fn set_error(&self) -> Result<(), rnic::Error> {
        let err = rnic::QpAttr {
            qp_state: rnic::QpState::Err,
            ..rnic::QpAttr::default()
        };
        self.0.modify(&err, rnic::QpAttrMask::STATE)
    }
}

impl nic::Nic for RnicNic {
    type Error = rnic::Error;
    type Mr = RnicMr;
    type Cq = RnicCq;
    type Qp = RnicQp;
    type Iommu = RnicIommu;
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
            .map(RnicQp)
    }
    fn addr(&self) -> PeerAddr {
        PeerAddr(self.host.addr().to_bytes())
    }
    fn iommu(&self) -> Option<&RnicIommu> {
        Some(&self.iommu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::Nic;
    use crate::testutil::verbs_contract;

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
    }
}
