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
    use std::time::{Duration, Instant};

    use super::*;
    use crate::nic::{Nic, NicCq, NicMr, NicQp, Sge, WcStatus, WrOp};

    /// Wait for one completion on `cq` (panics after 5 s).
    fn one<C: NicCq>(cq: &C) -> Completion {
        let t0 = Instant::now();
        let mut c = [Completion::default(); 1];
        while t0.elapsed() < Duration::from_secs(5) {
            if cq.poll(&mut c).expect("poll") == 1 {
                return c[0];
            }
            std::thread::yield_now();
        }
        panic!("no completion within 5 s");
    }

    fn wr(wr_id: u64, op: WrOp, sg: &[Sge], raddr: u64, rkey: u32) -> WorkRequest<'_> {
        WorkRequest {
            wr_id,
            op,
            sg_list: sg,
            remote_addr: raddr,
            rkey,
            signaled: true,
            fence: false,
            inline: false,
        }
    }

    /// The verbs contract NP-RDMA relies on, for any [`Nic`]: one-sided
    /// WRITE/READ/atomic, SEND with immediate (gathered and inline) into
    /// posted RECVs, remote access errors as completions, flush on ERR.
    fn verbs_contract<N: Nic>(a: &N, b: &N) {
        let spec = QpSpec {
            qpn: None,
            max_send_wr: 16,
            max_recv_wr: 16,
            max_sge: 2,
            max_inline: 64,
        };
        let (ca, cb) = (
            a.create_cq(64).expect("cq a"),
            b.create_cq(64).expect("cq b"),
        );
        let qa = a.create_qp(&spec, &ca, &ca).expect("qp a");
        let qb = b.create_qp(&spec, &cb, &cb).expect("qp b");
        let rights = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        qa.connect(b.addr(), qb.qpn(), rights).expect("connect a");
        qb.connect(a.addr(), qa.qpn(), rights).expect("connect b");
        let mut la = vec![0u8; 4096];
        let mut lb = vec![0u8; 4096];
        let acc = Access::LOCAL_WRITE | rights;
        // SAFETY: both vectors outlive their MRs (dropped at the end of
        // this function, MRs first: declared later).
        #[allow(unsafe_code)]
        let (ma, mb) = unsafe {
            (
                a.reg_mr(la.as_mut_ptr() as u64, 4096, acc).expect("mr a"),
                b.reg_mr(lb.as_mut_ptr() as u64, 4096, acc).expect("mr b"),
            )
        };
        let sge = |m: &N::Mr, off: u64, len: u32| Sge {
            addr: m.addr() + off,
            length: len,
            lkey: m.lkey(),
        };
        for (i, x) in la.iter_mut().enumerate().take(64) {
            *x = i as u8 + 1;
        }
        // WRITE a[0..64] → b[100..164].
        let s = [sge(&ma, 0, 64)];
        qa.post_send(&[wr(1, WrOp::Write, &s, mb.addr() + 100, mb.rkey())])
            .expect("post write");
        let c = one(&ca);
        assert_eq!((c.wr_id, c.status, c.op), (1, 0, CompOp::Write));
        assert_eq!(&lb[100..164], &la[..64]);
        // READ b[100..164] → a[1000..1064], gathered into two SGEs.
        let s = [sge(&ma, 1000, 32), sge(&ma, 2000, 32)];
        qa.post_send(&[wr(2, WrOp::Read, &s, mb.addr() + 100, mb.rkey())])
            .expect("post read");
        let c = one(&ca);
        assert_eq!(
            (c.wr_id, c.status, c.op, c.byte_len),
            (2, 0, CompOp::Read, 64)
        );
        assert_eq!(&la[1000..1032], &la[..32]);
        assert_eq!(&la[2000..2032], &la[32..64]);
        // FETCH_ADD on b[512] (8-aligned in the MR).
        lb[512..520].copy_from_slice(&5u64.to_le_bytes());
        let s = [sge(&ma, 3000, 8)];
        qa.post_send(&[wr(
            3,
            WrOp::FetchAdd { add: 2 },
            &s,
            mb.addr() + 512,
            mb.rkey(),
        )])
        .expect("post atomic");
        let c = one(&ca);
        assert_eq!((c.wr_id, c.status, c.op), (3, 0, CompOp::FetchAdd));
        assert_eq!(la[3000..3008], 5u64.to_le_bytes());
        assert_eq!(lb[512..520], 7u64.to_le_bytes());
        // SEND with immediate into a posted RECV, then an inline SEND.
        let r = [sge(&mb, 1024, 128)];
        let r2 = [sge(&mb, 2048, 128)];
        qb.post_recv(&[
            RecvRequest {
                wr_id: 40,
                sg_list: &r,
            },
            RecvRequest {
                wr_id: 41,
                sg_list: &r2,
            },
        ])
        .expect("post recv");
        let s = [sge(&ma, 0, 16)];
        // Inline: no lkey, the bytes are copied at post time.
        let data = [Sge {
            addr: la.as_ptr() as u64 + 16,
            length: 8,
            lkey: 0,
        }];
        let inline = WorkRequest {
            inline: true,
            ..wr(5, WrOp::Send, &data, 0, 0)
        };
        qa.post_send(&[wr(4, WrOp::SendImm(99), &s, 0, 0), inline])
            .expect("post sends");
        let (c1, c2) = (one(&ca), one(&ca));
        assert_eq!((c1.wr_id, c1.status, c2.wr_id, c2.status), (4, 0, 5, 0));
        let r1 = one(&cb);
        assert_eq!(
            (r1.wr_id, r1.status, r1.op, r1.byte_len, r1.imm),
            (40, 0, CompOp::RecvWithImm, 16, Some(99))
        );
        let r2 = one(&cb);
        assert_eq!(
            (r2.wr_id, r2.status, r2.op, r2.byte_len),
            (41, 0, CompOp::Recv, 8)
        );
        assert_eq!(&lb[1024..1040], &la[..16]);
        assert_eq!(&lb[2048..2056], &la[16..24]);
        // In ERR, posted RECVs flush (a second pair: ERR is for good).
        let qa2 = a.create_qp(&spec, &ca, &ca).expect("qp a2");
        let qb2 = b.create_qp(&spec, &cb, &cb).expect("qp b2");
        qa2.connect(b.addr(), qb2.qpn(), rights)
            .expect("connect a2");
        qb2.connect(a.addr(), qa2.qpn(), rights)
            .expect("connect b2");
        qb2.post_recv(&[RecvRequest {
            wr_id: 42,
            sg_list: &r,
        }])
        .expect("post recv");
        qb2.set_error().expect("to ERR");
        let c = one(&cb);
        assert_eq!((c.wr_id, c.status), (42, Completion::WR_FLUSH_ERR));
        // A bad rkey fails at the responder: an error completion.
        let s = [sge(&ma, 0, 8)];
        qa.post_send(&[wr(6, WrOp::Write, &s, mb.addr(), mb.rkey() ^ 0x4000)])
            .expect("post bad write");
        let c = one(&ca);
        assert_eq!(c.wr_id, 6);
        assert_eq!(WcStatus::from_code(c.status), WcStatus::RemAccessErr);
        drop((ma, mb));
    }

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
