//! The initiating side of a run: its host, a local buffer in the run's memory mode,
//! one QP, and post / poll in that mode's verbs.

use crate::error::{CliError, Result};
use crate::mem::PinnedBuf;
use crate::setup::{new_pager, np_access, rnic_access, rnic_qp, QpAddr, RnicQp, RunQp, Side};
use crate::spec::{Mode, Op};

enum Inner {
    Pinned {
        qp: rnic::Qp,
        mr: rnic::Mr,
        cq: rnic::Cq,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
        _buf: PinnedBuf,
    },
    #[cfg(feature = "odp")]
    Odp {
        qp: rnic::Qp,
        buf: crate::odp::OdpBuf,
        cq: rnic::Cq,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
        _pager: vmem::Pager,
    },
    Np {
        qp: nprdma::Qp,
        mr: nprdma::Mr,
        cq: nprdma::Cq,
        _rcq: nprdma::Cq,
        _pd: nprdma::Pd,
        ctx: nprdma::Context,
        _region: vmem::Region,
        _pager: vmem::Pager,
    },
}

impl Inner {
    fn qp(&self) -> RunQp<'_> {
        match self {
            Inner::Pinned { qp, .. } => RunQp::Rnic(qp),
            #[cfg(feature = "odp")]
            Inner::Odp { qp, .. } => RunQp::Rnic(qp),
            Inner::Np { qp, .. } => RunQp::Np(qp),
        }
    }
}

/// The initiator of a run.
pub struct Initiator {
    inner: Inner,
    wc: Vec<rnic::Wc>,
    nwc: Vec<nprdma::Completion>,
    host: rnic::Host,
}

impl Initiator {
    /// An initiator with a `buf_len`-byte local buffer (resident, and for NP-RDMA
    /// written before registration so its pages start mapped) and a QP of `depth`.
    pub fn new(
        mode: Mode,
        buf_len: usize,
        depth: usize,
        np_cfg: nprdma::Config,
    ) -> Result<Initiator> {
        let host = rnic::Host::new(crate::trust::host_config())?;
        let buf_len = buf_len.max(8);
        let inner = match mode {
            Mode::Pinned => {
                let RnicQp {
                    ctx, pd, cq, qp, ..
                } = rnic_qp(&host, Side::Initiator { depth })?;
                let buf = PinnedBuf::new(buf_len)?;
                // SAFETY: `buf` outlives `mr` (declared after it in `Inner::Pinned`).
                let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
                Inner::Pinned {
                    qp,
                    mr,
                    cq,
                    _pd: pd,
                    _ctx: ctx,
                    _buf: buf,
                }
            }
            Mode::Nprdma => {
                let pager = new_pager()?;
                let ctx = nprdma::Context::new(&host, &pager, np_cfg)?;
                let pd = ctx.alloc_pd();
                let cq = ctx.create_cq(4096)?;
                let rcq = ctx.create_cq(64)?;
                let qp = pd.create_qp(&cq, &rcq, depth as u32)?;
                let mut region = pager.alloc(buf_len)?;
                region.as_mut_slice().fill(0xa5);
                // SAFETY: private anonymous pager memory that outlives the MR
                // (`_region` is declared after `mr`).
                #[allow(unsafe_code)]
                let mr = unsafe { pd.reg_mr(region.addr() as u64, buf_len as u64, np_access()) }?;
                Inner::Np {
                    qp,
                    mr,
                    cq,
                    _rcq: rcq,
                    _pd: pd,
                    ctx,
                    _region: region,
                    _pager: pager,
                }
            }
            #[cfg(feature = "odp")]
            Mode::Odp => {
                let pager = new_pager()?;
                crate::odp::install_handler(&host, &pager);
                let RnicQp {
                    ctx, pd, cq, qp, ..
                } = rnic_qp(&host, Side::Initiator { depth })?;
                let buf = crate::odp::OdpBuf::new(&host, &pd, &pager, buf_len, Some(0xa5))?;
                Inner::Odp {
                    qp,
                    buf,
                    cq,
                    _pd: pd,
                    _ctx: ctx,
                    _pager: pager,
                }
            }
            #[cfg(not(feature = "odp"))]
            Mode::Odp => return Err(crate::setup::odp_unavailable()),
        };
        Ok(Initiator {
            inner,
            wc: vec![rnic::Wc::default(); 64],
            nwc: vec![nprdma::Completion::default(); 64],
            host,
        })
    }

    pub fn qp_addr(&self) -> QpAddr {
        self.inner.qp().addr(&self.host)
    }

    pub fn connect(&mut self, peer: &QpAddr) -> Result<()> {
        self.inner.qp().connect(peer)
    }

    /// Post one WR of `len` bytes from/to local offset 0.
    pub fn post(
        &mut self,
        op: Op,
        wr_id: u64,
        len: usize,
        raddr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<()> {
        match &mut self.inner {
            Inner::Pinned { qp, mr, .. } => {
                rnic_post(qp, mr.sge(0, len as u32), op, wr_id, raddr, rkey, signaled)
            }
            #[cfg(feature = "odp")]
            Inner::Odp { qp, buf, .. } => rnic_post(
                qp,
                buf.mr().sge(0, len as u32),
                op,
                wr_id,
                raddr,
                rkey,
                signaled,
            ),
            Inner::Np { qp, mr, .. } => {
                let opcode = match op {
                    Op::Read => nprdma::Opcode::Read,
                    Op::Write => nprdma::Opcode::Write,
                    Op::Send => nprdma::Opcode::Send,
                    Op::Atomic => nprdma::Opcode::FetchAdd { add: 1 },
                };
                let mut wr =
                    nprdma::SendWr::new(wr_id, opcode, Some(mr.sge(0, len as u32)), raddr, rkey);
                wr.signaled = signaled;
                qp.post_send(&[wr]).map_err(|(_, e)| CliError::Np(e))
            }
        }
    }

    /// Poll the send CQ once (non-blocking); returns the number of successful
    /// completions, or an error for a failed one.
    pub fn poll(&mut self) -> Result<usize> {
        match &mut self.inner {
            Inner::Pinned { cq, .. } => rnic_poll(cq, &mut self.wc),
            #[cfg(feature = "odp")]
            Inner::Odp { cq, .. } => rnic_poll(cq, &mut self.wc),
            Inner::Np { cq, .. } => {
                let n = cq.poll(&mut self.nwc);
                for w in &self.nwc[..n] {
                    if !w.is_ok() {
                        return Err(CliError::Completion(format!(
                            "wr {} status {}",
                            w.wr_id, w.status
                        )));
                    }
                }
                Ok(n)
            }
        }
    }

    /// NP-RDMA engine counters (None for other modes).
    pub fn np_stats(&self) -> Option<nprdma::Stats> {
        match &self.inner {
            Inner::Np { ctx, .. } => Some(ctx.stats()),
            _ => None,
        }
    }
}

fn rnic_post(
    qp: &rnic::Qp,
    sge: rnic::Sge,
    op: Op,
    wr_id: u64,
    raddr: u64,
    rkey: u32,
    signaled: bool,
) -> Result<()> {
    let sge = [sge];
    let opcode = match op {
        Op::Read => rnic::WrOpcode::Read,
        Op::Write => rnic::WrOpcode::Write,
        Op::Send => rnic::WrOpcode::Send,
        Op::Atomic => rnic::WrOpcode::FetchAdd { add: 1 },
    };
    let flags = if signaled {
        rnic::SendFlags::SIGNALED
    } else {
        rnic::SendFlags::empty()
    };
    let mut wr = rnic::SendWr::new(wr_id, opcode, &sge).flags(flags);
    if op != Op::Send {
        wr = wr.remote(raddr, rkey);
    }
    qp.post_send(&[wr]).map_err(|e| CliError::Nic(e.err))
}

fn rnic_poll(cq: &rnic::Cq, wc: &mut [rnic::Wc]) -> Result<usize> {
    let n = cq.poll(wc)?;
    for w in &wc[..n] {
        if w.status != rnic::WcStatus::Success {
            return Err(CliError::Completion(format!(
                "wr {} {:?}",
                w.wr_id, w.status
            )));
        }
    }
    Ok(n)
}
