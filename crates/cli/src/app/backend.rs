//! The back-end process of an application run: its memory pool in the run's
//! design (pinned / NP-RDMA / copy-through), one QP per front-end thread, the
//! copy-through RPC server, the pool's physical-memory sampler (/proc), the
//! shuffle's map stage, and the JSON-line session with one front-end.

use std::io::BufReader;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::app::item;
use crate::app::proto::{
    App, BackendStats, Design, PoolSpec, Ready, Req, Resp, RPC_GET, RPC_HDR, RPC_PUT,
};
use crate::error::{CliError, Result};
use crate::mem::{page_size, rss_bytes, PinnedBuf};
use crate::setup::{np_access, pager_with, rnic_access, QpAddr, RunQp};
use crate::wire::{recv, send};

/// Samples this process's RSS every 2 ms: peak and mean above `base` since the
/// last `mark`.
struct Sampler {
    base: u64,
    peak: Arc<AtomicU64>,
    sum: Arc<AtomicU64>,
    n: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    fn start(base: u64) -> Sampler {
        let (peak, sum, n) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s, c, st) = (peak.clone(), sum.clone(), n.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("app-rss".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    if let Ok(r) = rss_bytes() {
                        let v = r.saturating_sub(base);
                        p.fetch_max(v, Ordering::Relaxed);
                        s.fetch_add(v >> 10, Ordering::Relaxed);
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
            .ok();
        Sampler {
            base,
            peak,
            sum,
            n,
            stop,
            thread,
        }
    }
    fn mark(&self) {
        self.peak.store(0, Ordering::Relaxed);
        self.sum.store(0, Ordering::Relaxed);
        self.n.store(0, Ordering::Relaxed);
    }
    /// (now, peak, mean, samples) in bytes above the base.
    fn read(&self) -> (u64, u64, u64, u64) {
        let now = rss_bytes().map_or(0, |r| r.saturating_sub(self.base));
        let n = self.n.load(Ordering::Relaxed);
        let mean = (self.sum.load(Ordering::Relaxed) << 10)
            .checked_div(n)
            .unwrap_or(now);
        (now, self.peak.load(Ordering::Relaxed).max(now), mean, n)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The copy-through design's RPC server: pinned receive slots and a pinned
/// send buffer per QP, the CPU copying between them and the pool.
struct CopyServer {
    stop: Arc<AtomicBool>,
    rpcs: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<()>>>,
}

/// Receive slots per front-end QP (a front-end has one request outstanding).
const SLOTS: usize = 2;

struct CopyQp {
    qp: rnic::Qp,
    scq: rnic::Cq,
    /// Armed on the server's completion channel when it goes idle.
    rcq: rnic::Cq,
    /// SLOTS receive slots then one send buffer, each `slot` bytes.
    mr: rnic::Mr,
    buf: PinnedBuf,
}

/// The copy-through back-end's verbs objects shared by its QPs (dropped after them).
struct CopyVerbs {
    chan: rnic::CompChannel,
    pd: rnic::Pd,
    _ctx: rnic::Context,
}

impl CopyServer {
    /// Serve `qps` over the pool at `[pool, pool + pool_len)` with `item`-byte
    /// items. The pool must outlive the server (`stop` joins it).
    fn start(
        qps: Vec<CopyQp>,
        chan: rnic::CompChannel,
        pool: usize,
        pool_len: usize,
        item: usize,
    ) -> Result<CopyServer> {
        let stop = Arc::new(AtomicBool::new(false));
        let rpcs = Arc::new(AtomicU64::new(0));
        let slot = RPC_HDR + item;
        for (i, q) in qps.iter().enumerate() {
            for s in 0..SLOTS {
                post_slot(q, i, s, slot)?;
            }
        }
        let (st, rc) = (stop.clone(), rpcs.clone());
        let thread = std::thread::Builder::new()
            .name("copy-server".into())
            .spawn(move || serve_copy(qps, chan, pool, pool_len, item, st, rc))?;
        Ok(CopyServer {
            stop,
            rpcs,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(CliError::Peer("copy-through server panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for CopyServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn post_slot(q: &CopyQp, qi: usize, s: usize, slot: usize) -> Result<()> {
    let sge = [q.mr.sge(s * slot, slot as u32)];
    q.qp.post_recv(&[rnic::RecvWr {
        wr_id: ((qi as u64) << 8) | s as u64,
        sg_list: &sge,
    }])
    .map_err(|e| CliError::Nic(e.err))
}

/// The server loop: like a polling RPC server (and NP-RDMA's own polling
/// thread), it spins for 50 µs after work, then arms the receive CQs and
/// blocks on the completion channel (so it leaves the CPU to the others).
fn serve_copy(
    qps: Vec<CopyQp>,
    chan: rnic::CompChannel,
    pool: usize,
    pool_len: usize,
    item: usize,
    stop: Arc<AtomicBool>,
    rpcs: Arc<AtomicU64>,
) -> Result<()> {
    let slot = RPC_HDR + item;
    let items = pool_len / item;
    let mut wc = [rnic::Wc::default(); 16];
    let mut idle = Instant::now();
    let mut armed = false;
    while !stop.load(Ordering::Relaxed) {
        let mut any = false;
        for (qi, q) in qps.iter().enumerate() {
            // Reap send completions (the buffer is reused only after the
            // front-end got the reply, so they only need draining).
            let n = q.scq.poll(&mut wc)?;
            for w in &wc[..n] {
                if w.status != rnic::WcStatus::Success {
                    return Err(CliError::Completion(format!(
                        "copy-through reply to front-end {qi}: {:?}",
                        w.status
                    )));
                }
            }
            let n = q.rcq.poll(&mut wc)?;
            for w in &wc[..n] {
                any = true;
                if w.status != rnic::WcStatus::Success {
                    return Err(CliError::Completion(format!(
                        "copy-through request from front-end {qi}: {:?}",
                        w.status
                    )));
                }
                let s = (w.wr_id & 0xff) as usize;
                let base = q.buf.addr() + s * slot;
                // SAFETY: the slot lies in `q.buf` (registered, owned by this
                // thread's CopyQp); the NIC finished writing it (its receive
                // completed) and it is reposted only below, after this use.
                let req = unsafe { std::slice::from_raw_parts(base as *const u8, slot) };
                let op = u64::from_le_bytes(req[0..8].try_into().unwrap_or([0; 8]));
                let key = u64::from_le_bytes(req[8..16].try_into().unwrap_or([0; 8]));
                let send_at = SLOTS * slot;
                let reply_len = if key as usize >= items {
                    // Out of range: a 16-byte error reply.
                    // SAFETY: the send buffer is the last slot of `q.buf`.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut((q.buf.addr() + send_at) as *mut u8, 16)
                    };
                    out.copy_from_slice(&[0xee; 16]);
                    16
                } else {
                    let at = pool + key as usize * item;
                    match op {
                        RPC_GET => {
                            // SAFETY: [at, at+item) lies in the pool (key < items),
                            // which outlives this thread; the send buffer is the
                            // last slot of `q.buf`. The copy may fault the pool's
                            // pages in from swap: that is this design's fault path.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    at as *const u8,
                                    (q.buf.addr() + send_at) as *mut u8,
                                    item,
                                )
                            };
                            item
                        }
                        RPC_PUT => {
                            // SAFETY: as above; the request's payload follows its header.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    (base + RPC_HDR) as *const u8,
                                    at as *mut u8,
                                    item,
                                )
                            };
                            8
                        }
                        _ => 16,
                    }
                };
                post_slot(q, qi, s, slot)?;
                let sge = [q.mr.sge(send_at, reply_len as u32)];
                let wr = rnic::SendWr::new(1, rnic::WrOpcode::Send, &sge)
                    .flags(rnic::SendFlags::SIGNALED);
                q.qp.post_send(&[wr]).map_err(|e| CliError::Nic(e.err))?;
                rpcs.fetch_add(1, Ordering::Relaxed);
            }
        }
        if any {
            idle = Instant::now();
            armed = false;
        } else if idle.elapsed() > Duration::from_micros(50) {
            if !armed {
                // Arm, then poll once more: a request that arrived before the
                // arming is found by that poll, one after it fires the channel.
                for q in &qps {
                    q.rcq.req_notify(false)?;
                }
                armed = true;
                continue;
            }
            match chan.get_event(Some(Duration::from_millis(20))) {
                Ok(_) | Err(rnic::Error::Timeout) => {}
                Err(e) => return Err(e.into()),
            }
            armed = false;
            idle = Instant::now();
        }
    }
    Ok(())
}

/// The ODP model's MMU notifier: pages the pager is about to evict are
/// marked non-present in the NIC's page table first (and in-flight DMA
/// flushed), so the NIC faults on them instead of touching them.
#[cfg(feature = "odp")]
struct OdpNotifier(rnic::Host);

#[cfg(feature = "odp")]
impl vmem::SwapListener for OdpNotifier {
    fn before_swap_out(&self, pages: &[usize]) -> bool {
        let page = page_size();
        // Ascending page addresses: invalidate each contiguous run at once.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + page {
                j += 1;
            }
            if let Err(e) = self.0.odp_invalidate(pages[i], (j - i) * page) {
                tracing::error!("ODP model: invalidation failed: {e}");
            }
            i = j;
        }
        true
    }
}

/// Removes a swap listener when dropped (before the memory it watches goes).
#[cfg(feature = "odp")]
struct ListenerGuard(vmem::Pager, vmem::ListenerId);

#[cfg(feature = "odp")]
impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.remove_listener(self.1);
    }
}

/// The pool and its QPs, per design (MRs declared before their memory).
enum Pool {
    Pinned {
        qps: Vec<(rnic::Qp, rnic::Cq)>,
        mr: rnic::Mr,
        buf: PinnedBuf,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
    },
    Np {
        qps: Vec<nprdma::Qp>,
        _cqs: (nprdma::Cq, nprdma::Cq),
        mr: nprdma::Mr,
        region: vmem::Region,
        _pd: nprdma::Pd,
        ctx: nprdma::Context,
    },
    #[cfg(feature = "odp")]
    Odp {
        qps: Vec<(rnic::Qp, rnic::Cq)>,
        _notifier: ListenerGuard,
        buf: crate::odp::OdpBuf,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
    },
    Copy {
        /// Started once the QPs are connected (`pending` until then).
        server: Option<CopyServer>,
        pending: Vec<CopyQp>,
        verbs: CopyVerbs,
        qp_addrs: Vec<QpAddr>,
        item: usize,
        region: vmem::Region,
    },
}

/// A back-end: host, pager, pool, sampler.
pub struct Backend {
    spec: PoolSpec,
    pool: Pool,
    pager: Option<vmem::Pager>,
    sampler: Sampler,
    host: rnic::Host,
    stats0: Option<vmem::PagerStats>,
    served0: u64,
    init_us: f64,
    fill_us: f64,
}

/// `n` rnic QPs, each with its own CQ (one-sided designs: the back-end
/// posts nothing).
fn rnic_qps(ctx: &rnic::Context, pd: &rnic::Pd, n: usize) -> Result<Vec<(rnic::Qp, rnic::Cq)>> {
    (0..n)
        .map(|_| {
            let cq = ctx.create_cq(256, None)?;
            let attr = rnic::QpInitAttr {
                max_send_wr: 64,
                max_recv_wr: 8,
                ..rnic::QpInitAttr::default()
            };
            Ok((pd.create_qp(&cq, &cq, &attr)?, cq))
        })
        .collect()
}

fn np_qp(pd: &nprdma::Pd, cqs: &(nprdma::Cq, nprdma::Cq)) -> Result<nprdma::Qp> {
    Ok(pd.create_qp(&cqs.0, &cqs.1, 64)?)
}

impl Backend {
    /// Build the pool of `spec` (validated again here: the back-end may be a
    /// `--server` reached by any client).
    pub fn new(spec: PoolSpec) -> Result<Backend> {
        spec.validate()?;
        let page = page_size();
        let pool_len = crate::mem::round_up(spec.pool as usize, page);
        let budget_pages = (spec.budget as usize / page).max(1);
        // NP-RDMA maps every pool page in two IOVA views (Read and Write MRs):
        // size the NIC's IOVA space for them (the default covers 4 GiB).
        let dflt = crate::trust::host_config();
        let iova_pages = dflt
            .iova_pages
            .max(2 * (pool_len / page) as u64 + (1 << 16));
        let host = rnic::Host::new(rnic::HostConfig { iova_pages, ..dflt })?;
        let base = rss_bytes()?;
        let sampler = Sampler::start(base);
        let t0 = Instant::now();
        let (mut pool, pager) = match spec.design {
            Design::Pinned => {
                let ctx = host.open_context()?;
                let pd = ctx.alloc_pd()?;
                // mlock faults every page in: the pinning cost of a registration.
                let buf = PinnedBuf::locked(pool_len)?;
                // SAFETY: `buf` outlives `mr` (declared after it in `Pool::Pinned`).
                let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
                let qps = rnic_qps(&ctx, &pd, spec.qps)?;
                (
                    Pool::Pinned {
                        qps,
                        mr,
                        buf,
                        _pd: pd,
                        _ctx: ctx,
                    },
                    None,
                )
            }
            Design::Nprdma => {
                let pager = pager_with(spec.swap, Some(budget_pages))?;
                let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default())?;
                let pd = ctx.alloc_pd();
                let cqs = (ctx.create_cq(1024)?, ctx.create_cq(1024)?);
                let region = pager.alloc(pool_len)?;
                // SAFETY: private anonymous pager memory owned by `Pool::Np`,
                // whose `mr` field is declared (so dropped) before `region`.
                #[allow(unsafe_code)]
                let mr = unsafe { pd.reg_mr(region.addr() as u64, pool_len as u64, np_access()) }?;
                let qps = (0..spec.qps)
                    .map(|_| np_qp(&pd, &cqs))
                    .collect::<Result<Vec<_>>>()?;
                (
                    Pool::Np {
                        qps,
                        _cqs: cqs,
                        mr,
                        region,
                        _pd: pd,
                        ctx,
                    },
                    Some(pager),
                )
            }
            #[cfg(feature = "odp")]
            Design::Odp => {
                let pager = pager_with(spec.swap, Some(budget_pages))?;
                crate::odp::install_handler(&host, &pager);
                let ctx = host.open_context()?;
                let pd = ctx.alloc_pd()?;
                let buf = crate::odp::OdpBuf::new(&host, &pd, &pager, pool_len, None)?;
                let id = pager.add_listener(Arc::new(OdpNotifier(host.clone())));
                let qps = rnic_qps(&ctx, &pd, spec.qps)?;
                (
                    Pool::Odp {
                        qps,
                        _notifier: ListenerGuard(pager.clone(), id),
                        buf,
                        _pd: pd,
                        _ctx: ctx,
                    },
                    Some(pager),
                )
            }
            #[cfg(not(feature = "odp"))]
            Design::Odp => return Err(crate::setup::odp_unavailable()),
            Design::CopyThrough => {
                let item = match spec.app {
                    App::Cache { item } => item,
                    App::Shuffle => return Err(CliError::Arg(
                        "the shuffle runs pinned or nprdma (copy-through is the cache's baseline)"
                            .into(),
                    )),
                };
                let pager = pager_with(spec.swap, Some(budget_pages))?;
                let region = pager.alloc(pool_len)?;
                let slot = RPC_HDR + item;
                let ctx = host.open_context()?;
                let verbs = CopyVerbs {
                    chan: ctx.create_comp_channel()?,
                    pd: ctx.alloc_pd()?,
                    _ctx: ctx,
                };
                let mut qps = Vec::new();
                let mut qp_addrs = Vec::new();
                for _ in 0..spec.qps {
                    let scq = verbs._ctx.create_cq(64, None)?;
                    let rcq = verbs._ctx.create_cq(64, Some(&verbs.chan))?;
                    let attr = rnic::QpInitAttr {
                        max_send_wr: 16,
                        max_recv_wr: SLOTS as u32 + 2,
                        ..rnic::QpInitAttr::default()
                    };
                    let qp = verbs.pd.create_qp(&scq, &rcq, &attr)?;
                    let buf = PinnedBuf::new((SLOTS + 1) * slot)?;
                    // SAFETY: `buf` outlives `mr` (declared after it in `CopyQp`).
                    let mr = unsafe { verbs.pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
                    qp_addrs.push(RunQp::Rnic(&qp).addr(&host));
                    qps.push(CopyQp {
                        qp,
                        scq,
                        rcq,
                        mr,
                        buf,
                    });
                }
                (
                    Pool::Copy {
                        server: None,
                        pending: qps,
                        verbs,
                        qp_addrs,
                        item,
                        region,
                    },
                    Some(pager),
                )
            }
        };
        let init_us = t0.elapsed().as_secs_f64() * 1e6;
        let t1 = Instant::now();
        if let App::Cache { item } = spec.app {
            let mem = match &mut pool {
                Pool::Pinned { buf, .. } => buf.as_mut_slice(),
                Pool::Np { region, .. } | Pool::Copy { region, .. } => region.as_mut_slice(),
                #[cfg(feature = "odp")]
                Pool::Odp { buf, .. } => buf.region.as_mut_slice(),
            };
            for (k, chunk) in mem.chunks_exact_mut(item).enumerate() {
                item::fill(chunk, k as u64, 0);
            }
        }
        let fill_us = t1.elapsed().as_secs_f64() * 1e6;
        let stats0 = pager.as_ref().map(|p| p.stats());
        Ok(Backend {
            spec,
            pool,
            pager,
            sampler,
            host,
            stats0,
            served0: 0,
            init_us,
            fill_us,
        })
    }

    pub fn ready(&self) -> Ready {
        let (qps, base, rkey) = match &self.pool {
            Pool::Pinned { qps, mr, buf, .. } => (
                qps.iter()
                    .map(|q| RunQp::Rnic(&q.0).addr(&self.host))
                    .collect(),
                buf.addr() as u64,
                mr.rkey(),
            ),
            Pool::Np {
                qps, mr, region, ..
            } => (
                qps.iter().map(|q| RunQp::Np(q).addr(&self.host)).collect(),
                region.addr() as u64,
                mr.rkey(),
            ),
            #[cfg(feature = "odp")]
            Pool::Odp { qps, buf, .. } => (
                qps.iter()
                    .map(|q| RunQp::Rnic(&q.0).addr(&self.host))
                    .collect(),
                buf.region.addr() as u64,
                buf.mr().rkey(),
            ),
            Pool::Copy { qp_addrs, .. } => (qp_addrs.clone(), 0, 0),
        };
        Ready {
            qps,
            base,
            rkey,
            init_us: self.init_us,
            fill_us: self.fill_us,
        }
    }

    pub fn connect(&mut self, peers: &[QpAddr]) -> Result<()> {
        if peers.len() != self.spec.qps {
            return Err(CliError::Peer(format!(
                "{} front-end QPs for {} back-end QPs",
                peers.len(),
                self.spec.qps
            )));
        }
        for (i, p) in peers.iter().enumerate() {
            match &self.pool {
                Pool::Pinned { qps, .. } => RunQp::Rnic(&qps[i].0).connect(p)?,
                Pool::Np { qps, .. } => RunQp::Np(&qps[i]).connect(p)?,
                #[cfg(feature = "odp")]
                Pool::Odp { qps, .. } => RunQp::Rnic(&qps[i].0).connect(p)?,
                Pool::Copy { pending, .. } => match pending.get(i) {
                    Some(q) => RunQp::Rnic(&q.qp).connect(p)?,
                    None => {
                        return Err(CliError::Peer("copy-through server already running".into()))
                    }
                },
            }
        }
        if let Pool::Copy {
            server,
            pending,
            verbs,
            item,
            region,
            ..
        } = &mut self.pool
        {
            let qps = std::mem::take(pending);
            let chan = verbs.chan.clone();
            *server = Some(CopyServer::start(
                qps,
                chan,
                region.addr(),
                region.len(),
                *item,
            )?);
        }
        Ok(())
    }

    /// The shuffle's map stage: every partition written by the CPU (block
    /// (m·parts + r), `version`); returns its time (µs).
    pub fn map(
        &mut self,
        maps: usize,
        parts: usize,
        part_bytes: usize,
        version: u64,
    ) -> Result<f64> {
        let need = maps
            .checked_mul(parts)
            .and_then(|n| n.checked_mul(part_bytes))
            .ok_or_else(|| CliError::Arg("shuffle size overflows".into()))?;
        let mem = match &mut self.pool {
            Pool::Pinned { buf, .. } => buf.as_mut_slice(),
            Pool::Np { region, .. } | Pool::Copy { region, .. } => region.as_mut_slice(),
            #[cfg(feature = "odp")]
            Pool::Odp { buf, .. } => buf.region.as_mut_slice(),
        };
        if need > mem.len() || part_bytes < item::HEADER {
            return Err(CliError::Arg(format!(
                "the shuffle's {need} B (maps × partitions × partition size) do not fit the pool of {} B, or a partition is under {} B",
                mem.len(),
                item::HEADER
            )));
        }
        let t = Instant::now();
        for (b, chunk) in mem[..need].chunks_exact_mut(part_bytes).enumerate() {
            item::fill(chunk, b as u64, version);
        }
        Ok(t.elapsed().as_secs_f64() * 1e6)
    }

    pub fn mark(&mut self) {
        self.stats0 = self.pager.as_ref().map(|p| p.stats());
        self.served0 = self.np_served();
        self.sampler.mark();
    }

    /// Two-sided requests served by the NP-RDMA engine since start (0 otherwise).
    fn np_served(&self) -> u64 {
        match &self.pool {
            Pool::Np { ctx, .. } => ctx.stats().served,
            _ => 0,
        }
    }

    pub fn stats(&self) -> BackendStats {
        let (now, peak, mean, n) = self.sampler.read();
        let ps = self.pager.as_ref().map(|p| p.stats());
        let d = |f: fn(&vmem::PagerStats) -> u64| match (&ps, &self.stats0) {
            (Some(a), Some(b)) => f(a).saturating_sub(f(b)),
            _ => 0,
        };
        BackendStats {
            pool_rss_now: now,
            pool_rss_peak: peak,
            pool_rss_mean: mean,
            rss_samples: n,
            swap_ins: d(|s| s.swap_ins),
            swap_outs: d(|s| s.swap_outs),
            major_faults: d(|s| s.major_faults),
            resident_pages: ps.as_ref().map_or(0, |s| s.resident_pages as u64),
            evict_aborts: d(|s| s.evict_aborts),
            young_spared: d(|s| s.young_spared),
            np_served: self.np_served().saturating_sub(self.served0),
            rpcs: match &self.pool {
                Pool::Copy {
                    server: Some(server),
                    ..
                } => server.rpcs.load(Ordering::Relaxed),
                _ => 0,
            },
            nonresident_dma: self.host.stats().nonresident_dma,
        }
    }

    /// Stop the copy-through server (its error, if it failed).
    fn shutdown(&mut self) -> Result<()> {
        if let Pool::Copy {
            server: Some(server),
            ..
        } = &mut self.pool
        {
            server.stop()?;
        }
        Ok(())
    }
}

/// `nprdma app-peer` / `app … --server`: serve one front-end on `listener`,
/// building the back-end it asks for; returns when it says goodbye or goes away.
pub fn serve_one(listener: &TcpListener) -> Result<()> {
    let (s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut wr = s.try_clone()?;
    let mut rd = BufReader::new(s);
    let mut be: Option<Backend> = None;
    loop {
        let req: Req = match recv(&mut rd) {
            Ok(r) => r,
            Err(CliError::Peer(_)) => break,
            Err(e) => return Err(e),
        };
        let resp = match (req, be.as_mut()) {
            (Req::Bye, _) => break,
            (Req::Hello { spec }, _) => {
                be = None;
                match Backend::new(spec) {
                    Ok(b) => {
                        let r = b.ready();
                        be = Some(b);
                        Resp::Ready { r }
                    }
                    Err(e) => Resp::Error { msg: e.to_string() },
                }
            }
            (_, None) => Resp::Error {
                msg: "hello first".into(),
            },
            (Req::Connect { peers }, Some(b)) => match b.connect(&peers) {
                Ok(()) => Resp::Ok,
                Err(e) => Resp::Error { msg: e.to_string() },
            },
            (
                Req::Map {
                    maps,
                    parts,
                    part_bytes,
                    version,
                },
                Some(b),
            ) => match b.map(maps, parts, part_bytes, version) {
                Ok(us) => Resp::Mapped { us },
                Err(e) => Resp::Error { msg: e.to_string() },
            },
            (Req::Mark, Some(b)) => {
                b.mark();
                Resp::Ok
            }
            (Req::Stats, Some(b)) => Resp::Stats { s: b.stats() },
        };
        send(&mut wr, &resp)?;
    }
    if let Some(mut b) = be {
        b.shutdown()?;
    }
    Ok(())
}
