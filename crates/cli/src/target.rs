//! The target side of a run: its host, its buffer in the run's memory mode, the
//! receives it keeps posted, and how it produces each fault scenario before a window.

use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::mem::{page_size, PinnedBuf};
use crate::setup::{new_pager, np_access, rnic_access, rnic_qp, QpAddr, RnicQp, RunQp, Side};
use crate::spec::{Fault, Mode, RECV_DEPTH};

/// Never-touched target memory handed out for minor faults before a fresh region
/// is allocated.
const MINOR_REGION: usize = 256 << 20;

/// Where the next window's operations go.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Window {
    /// First target address of the window; op i targets `base + i * stride`.
    pub base: u64,
    pub rkey: u32,
    /// A page of the same MR outside the window, for an untimed warm-up op
    /// (first-use key synchronisation) after the MR changed.
    pub sync_addr: u64,
    /// The MR changed since the previous window.
    pub renewed: bool,
    /// Pages the scenario made non-resident for this window.
    pub pages_prepared: u64,
}

/// Reads of the device baseline measured beside major-fault runs (per depth).
pub const DEVICE_READS: usize = 1000;
/// The concurrent depth of the device baseline: the pager's swap I/O threads
/// plus the calling thread, the most swap reads it keeps in flight.
pub fn device_depth() -> usize {
    vmem::PagerConfig::default().swap_io_threads + 1
}

/// The target pager's swap I/O and its device's own 4 KiB read latency,
/// measured in the same run on the same swap file (O_DIRECT random reads of
/// written slots, so the page cache is not involved).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceInfo {
    /// How the pager reads its swap file (`vmem::SwapIo::label`).
    pub swap_io: String,
    /// The baseline, or why it could not be measured.
    pub baseline: std::result::Result<DeviceBaseline, String>,
}

/// `vmem::DeviceLatency`, as exchanged and reported.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceBaseline {
    pub reads: usize,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub iops: f64,
    /// Depth 1, polled for (how NP-RDMA's polling thread waits for its reads).
    #[serde(default)]
    pub median_polled_us: Option<f64>,
    pub depth: usize,
    pub median_us_at_depth: f64,
    pub iops_at_depth: f64,
}

impl From<vmem::DeviceLatency> for DeviceBaseline {
    fn from(d: vmem::DeviceLatency) -> Self {
        DeviceBaseline {
            reads: d.reads,
            median_us: d.median_us,
            min_us: d.min_us,
            max_us: d.max_us,
            iops: d.iops,
            median_polled_us: d.median_polled_us,
            depth: d.depth,
            median_us_at_depth: d.median_us_at_depth,
            iops_at_depth: d.iops_at_depth,
        }
    }
}

/// A pager region registered with NP-RDMA; the MR is dropped before the region.
struct NpBuf {
    mr: nprdma::Mr,
    region: vmem::Region,
}

impl NpBuf {
    fn new(pd: &nprdma::Pd, pager: &vmem::Pager, len: usize, fill: Option<u8>) -> Result<NpBuf> {
        let mut region = pager.alloc(len)?;
        if let Some(b) = fill {
            region.as_mut_slice().fill(b);
        }
        // SAFETY: the region is private anonymous memory owned by this NpBuf, and
        // the MR field is declared (so dropped) before the region.
        #[allow(unsafe_code)]
        let mr = unsafe { pd.reg_mr(region.addr() as u64, len as u64, np_access()) }?;
        Ok(NpBuf { mr, region })
    }
}

/// A pinned buffer registered with the software RNIC (MR dropped first).
struct RnicBuf {
    mr: rnic::Mr,
    buf: PinnedBuf,
}

impl RnicBuf {
    fn new(pd: &rnic::Pd, len: usize) -> Result<RnicBuf> {
        let buf = PinnedBuf::new(len)?;
        // SAFETY: the mapping lives in this struct and outlives the MR (drop order).
        let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
        Ok(RnicBuf { mr, buf })
    }
}

enum Inner {
    Pinned {
        qp: rnic::Qp,
        data: RnicBuf,
        recv: RnicBuf,
        _cq: rnic::Cq,
        rcq: rnic::Cq,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
    },
    #[cfg(feature = "odp")]
    Odp {
        qp: rnic::Qp,
        data: Option<crate::odp::OdpBuf>,
        recv: RnicBuf,
        _cq: rnic::Cq,
        rcq: rnic::Cq,
        pd: rnic::Pd,
        _ctx: rnic::Context,
    },
    Np {
        qp: nprdma::Qp,
        data: Option<NpBuf>,
        recv: NpBuf,
        _cq: nprdma::Cq,
        rcq: nprdma::Cq,
        pd: nprdma::Pd,
        _ctx: nprdma::Context,
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

/// The target of a run (in this process, or in the shm peer process).
pub struct Target {
    inner: Inner,
    data_len: usize,
    recv_len: usize,
    posted: usize,
    minor_cursor: usize,
    /// The scenario the current NP-RDMA data buffer was prepared for.
    data_kind: Option<Fault>,
    pager: Option<vmem::Pager>,
    host: rnic::Host,
}

impl Target {
    /// A target whose data buffer covers `data_len` bytes and whose receives hold
    /// `recv_len` bytes each.
    pub fn new(mode: Mode, data_len: usize, recv_len: usize) -> Result<Target> {
        let host = rnic::Host::new(crate::trust::host_config())?;
        let data_len = data_len.max(8);
        let recv_len = recv_len.max(8);
        let (inner, pager) = match mode {
            Mode::Pinned => {
                let RnicQp {
                    ctx,
                    pd,
                    cq,
                    rcq,
                    qp,
                } = rnic_qp(&host, Side::Target)?;
                let data = RnicBuf::new(&pd, data_len)?;
                let recv = RnicBuf::new(&pd, recv_len)?;
                (
                    Inner::Pinned {
                        qp,
                        data,
                        recv,
                        _cq: cq,
                        rcq,
                        _pd: pd,
                        _ctx: ctx,
                    },
                    None,
                )
            }
            Mode::Nprdma => {
                let pager = new_pager()?;
                let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default())?;
                let pd = ctx.alloc_pd();
                let cq = ctx.create_cq(4096)?;
                let rcq = ctx.create_cq(4096)?;
                let qp = pd.create_qp(&cq, &rcq, RECV_DEPTH as u32 + 8)?;
                let recv = NpBuf::new(&pd, &pager, recv_len, Some(0))?;
                (
                    Inner::Np {
                        qp,
                        data: None,
                        recv,
                        _cq: cq,
                        rcq,
                        pd,
                        _ctx: ctx,
                    },
                    Some(pager),
                )
            }
            #[cfg(feature = "odp")]
            Mode::Odp => {
                let pager = new_pager()?;
                crate::odp::install_handler(&host, &pager);
                let RnicQp {
                    ctx,
                    pd,
                    cq,
                    rcq,
                    qp,
                } = rnic_qp(&host, Side::Target)?;
                let recv = RnicBuf::new(&pd, recv_len)?;
                (
                    Inner::Odp {
                        qp,
                        data: None,
                        recv,
                        _cq: cq,
                        rcq,
                        pd,
                        _ctx: ctx,
                    },
                    Some(pager),
                )
            }
            #[cfg(not(feature = "odp"))]
            Mode::Odp => return Err(crate::setup::odp_unavailable()),
        };
        Ok(Target {
            inner,
            data_len,
            recv_len,
            posted: 0,
            minor_cursor: usize::MAX,
            data_kind: None,
            pager,
            host,
        })
    }

    /// This target QP's address for the initiator.
    pub fn qp_addr(&self) -> QpAddr {
        self.inner.qp().addr(&self.host)
    }

    /// Connect to the initiator's QP.
    pub fn connect(&mut self, peer: &QpAddr) -> Result<()> {
        self.inner.qp().connect(peer)
    }

    /// Reap consumed receives and keep `RECV_DEPTH` posted.
    fn refill_recvs(&mut self) -> Result<()> {
        match &mut self.inner {
            Inner::Pinned { qp, recv, rcq, .. } => {
                refill_rnic(qp, recv, rcq, &mut self.posted, self.recv_len)?;
            }
            #[cfg(feature = "odp")]
            Inner::Odp { qp, recv, rcq, .. } => {
                refill_rnic(qp, recv, rcq, &mut self.posted, self.recv_len)?;
            }
            Inner::Np { qp, recv, rcq, .. } => {
                let mut wc = [nprdma::Completion::default(); 64];
                loop {
                    let n = rcq.poll(&mut wc);
                    for w in &wc[..n] {
                        if !w.is_ok() {
                            return Err(CliError::Completion(format!(
                                "target receive: status {}",
                                w.status
                            )));
                        }
                    }
                    self.posted -= n.min(self.posted);
                    if n == 0 {
                        break;
                    }
                }
                let sge = recv.mr.sge(0, self.recv_len as u32);
                while self.posted < RECV_DEPTH {
                    qp.post_recv(&[nprdma::RecvWr {
                        wr_id: 1,
                        sge: Some(sge),
                    }])
                    .map_err(|(_, e)| e)?;
                    self.posted += 1;
                }
            }
        }
        Ok(())
    }

    /// Prepare the next window of `bytes` under `fault` (untimed by the initiator).
    ///
    /// * `None`: the data buffer as is (resident; NP-RDMA pages mapped).
    /// * `Minor`: NP-RDMA: the next `bytes` of a fresh pager region that nobody has
    ///   touched yet (a new region + MR when the current one is used up).
    /// * `Major`: NP-RDMA: one region, written once, then `vmem` swap-out of the
    ///   window's pages before every window (they go to the swap file; the NIC
    ///   views are remapped to the signature / black-hole frames by the listener).
    /// * Pinned memory cannot fault: `Minor`/`Major` leave it resident
    ///   (`pages_prepared` = 0 tells the initiator so).
    pub fn prepare(&mut self, fault: Fault, bytes: usize) -> Result<Window> {
        self.refill_recvs()?;
        let page = page_size();
        let bytes = bytes.max(8);
        match &mut self.inner {
            Inner::Pinned { data, .. } => {
                if bytes > data.buf.len() {
                    return Err(CliError::Arg(format!(
                        "window of {bytes} B exceeds the target buffer"
                    )));
                }
                Ok(Window {
                    base: data.buf.addr() as u64,
                    rkey: data.mr.rkey(),
                    sync_addr: data.buf.addr() as u64,
                    renewed: false,
                    pages_prepared: 0,
                })
            }
            #[cfg(feature = "odp")]
            Inner::Odp { data, pd, .. } => {
                use crate::odp::OdpBuf;
                let pager = self.pager.as_ref().expect("ODP target has a pager");
                let mut renewed = false;
                if self.data_kind != Some(fault) {
                    *data = None;
                    self.data_kind = Some(fault);
                }
                let (off, pages) = match fault {
                    Fault::None => {
                        if data.as_ref().map_or(true, |d| d.region.len() < bytes) {
                            *data = None;
                            *data = Some(OdpBuf::new(
                                &self.host,
                                pd,
                                pager,
                                self.data_len.max(bytes),
                                Some(0x3c),
                            )?);
                            renewed = true;
                        }
                        (0, 0)
                    }
                    Fault::Minor => {
                        let (off, pages, r) =
                            next_minor(data, &mut self.minor_cursor, bytes, page, |len| {
                                OdpBuf::new(&self.host, pd, pager, len, None)
                            })?;
                        renewed = r;
                        (off, pages)
                    }
                    Fault::Major => {
                        if data.as_ref().map_or(true, |d| d.mr().len() < bytes + page) {
                            *data = None;
                            *data = Some(OdpBuf::new(
                                &self.host,
                                pd,
                                pager,
                                bytes + page,
                                Some(0x3c),
                            )?);
                            renewed = true;
                        }
                        let d = data.as_ref().expect("set above");
                        let n = d.swap_out(d.region.addr(), bytes)?;
                        (0, n as u64)
                    }
                };
                Ok(window(
                    data.as_ref().expect("set above"),
                    off,
                    renewed,
                    pages,
                ))
            }
            Inner::Np { data, pd, .. } => {
                let pager = self.pager.as_ref().expect("NP-RDMA target has a pager");
                let mut renewed = false;
                if self.data_kind != Some(fault) {
                    // Never reuse another scenario's buffer (untouched or swapped pages).
                    *data = None;
                    self.data_kind = Some(fault);
                }
                let (off, pages) = match fault {
                    Fault::None => {
                        if data
                            .as_ref()
                            .map_or(true, |d| (d.mr.len() as usize) < bytes)
                        {
                            *data = None;
                            *data =
                                Some(NpBuf::new(pd, pager, self.data_len.max(bytes), Some(0x3c))?);
                            renewed = true;
                        }
                        (0, 0)
                    }
                    Fault::Minor => {
                        let (off, pages, r) =
                            next_minor(data, &mut self.minor_cursor, bytes, page, |len| {
                                NpBuf::new(pd, pager, len, None)
                            })?;
                        renewed = r;
                        (off, pages)
                    }
                    Fault::Major => {
                        if data.is_none()
                            || (data.as_ref().unwrap().mr.len() as usize) < bytes + page
                        {
                            *data = None;
                            *data = Some(NpBuf::new(pd, pager, bytes + page, Some(0x3c))?);
                            renewed = true;
                        }
                        let d = data.as_ref().unwrap();
                        let n = pager.swap_out(d.region.addr(), bytes)?;
                        (0, n as u64)
                    }
                };
                Ok(window(data.as_ref().unwrap(), off, renewed, pages))
            }
        }
    }

    /// The pager's swap I/O and the device baseline (`depth`, `reads` per
    /// depth); `None` for a target without a pager (pinned memory).
    pub fn device(&self, depth: usize, reads: usize) -> Option<DeviceInfo> {
        let pager = self.pager.as_ref()?;
        Some(DeviceInfo {
            swap_io: pager.swap_io().label().to_string(),
            baseline: pager
                .device_read_latency(depth, reads)
                .map(DeviceBaseline::from)
                .map_err(|e| e.to_string()),
        })
    }

    /// Pager and NIC counters of the target, for the run's record.
    pub fn counters(&self) -> TargetCounters {
        let ps = self.pager.as_ref().map(|p| p.stats());
        let ns = self.host.stats();
        TargetCounters {
            minor_faults: ps.as_ref().map_or(0, |s| s.minor_faults + s.zero_fills),
            major_faults: ps.as_ref().map_or(0, |s| s.swap_ins),
            swap_outs: ps.as_ref().map_or(0, |s| s.swap_outs),
            nonresident_dma: ns.nonresident_dma,
        }
    }
}

/// What `prepare` needs of a target data buffer that can fault (ODP model, NP-RDMA).
trait FaultBuf {
    fn mr_addr(&self) -> u64;
    fn mr_len(&self) -> usize;
    fn rkey(&self) -> u32;
}

impl FaultBuf for NpBuf {
    fn mr_addr(&self) -> u64 {
        self.mr.addr()
    }
    fn mr_len(&self) -> usize {
        self.mr.len() as usize
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

#[cfg(feature = "odp")]
impl FaultBuf for crate::odp::OdpBuf {
    fn mr_addr(&self) -> u64 {
        self.mr().addr() as u64
    }
    fn mr_len(&self) -> usize {
        self.mr().len()
    }
    fn rkey(&self) -> u32 {
        self.mr().rkey()
    }
}

/// Minor faults: the window is the next `bytes` of never-touched memory at
/// `cursor`; once the buffer is used up, a fresh one of at least `MINOR_REGION`
/// comes from `alloc(len)`. Returns (offset, pages to fault, renewed).
fn next_minor<B: FaultBuf>(
    data: &mut Option<B>,
    cursor: &mut usize,
    bytes: usize,
    page: usize,
    alloc: impl FnOnce(usize) -> Result<B>,
) -> Result<(usize, u64, bool)> {
    let mut renewed = false;
    let cap = data.as_ref().map_or(0, |d| d.mr_len() - page);
    if data.is_none() || cursor.saturating_add(bytes) > cap {
        *data = None;
        let len = bytes.max(MINOR_REGION) + page;
        *data = Some(alloc(len)?);
        *cursor = 0;
        renewed = true;
    }
    let off = *cursor;
    *cursor += crate::mem::round_up(bytes, page);
    Ok((off, bytes.div_ceil(page) as u64, renewed))
}

/// The window at `off` in `d`; the last 8 bytes of the MR are the sync word.
fn window<B: FaultBuf>(d: &B, off: usize, renewed: bool, pages: u64) -> Window {
    let (addr, len) = (d.mr_addr(), d.mr_len());
    Window {
        base: addr + off as u64,
        rkey: d.rkey(),
        sync_addr: addr + (len - 8) as u64,
        renewed,
        pages_prepared: pages,
    }
}

/// Reap the consumed receives of an rnic QP and keep `RECV_DEPTH` posted.
fn refill_rnic(
    qp: &rnic::Qp,
    recv: &RnicBuf,
    rcq: &rnic::Cq,
    posted: &mut usize,
    recv_len: usize,
) -> Result<()> {
    let mut wc = [rnic::Wc::default(); 64];
    loop {
        let n = rcq.poll(&mut wc)?;
        for w in &wc[..n] {
            if w.status != rnic::WcStatus::Success {
                return Err(CliError::Completion(format!(
                    "target receive: {:?}",
                    w.status
                )));
            }
        }
        *posted -= n.min(*posted);
        if n == 0 {
            break;
        }
    }
    let sge = [recv.mr.sge(0, recv_len as u32)];
    while *posted < RECV_DEPTH {
        qp.post_recv(&[rnic::RecvWr {
            wr_id: 1,
            sg_list: &sge,
        }])
        .map_err(|e| e.err)?;
        *posted += 1;
    }
    Ok(())
}

/// Target-side counters reported with a run.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TargetCounters {
    /// Pages brought in as zeroes (first touch by fault, pin or prefetch).
    pub minor_faults: u64,
    /// Pages brought back from swap (fault, pin or prefetch).
    pub major_faults: u64,
    pub swap_outs: u64,
    pub nonresident_dma: u64,
}
