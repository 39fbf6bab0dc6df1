//! Control-plane costs (the paper's Table "time cost in the control plane") and the
//! state NP-RDMA keeps per page / QP / CQ, measured for pinned RDMA and NP-RDMA.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::mem::{page_size, rss_bytes, PinnedBuf};
use crate::target::{new_pager, np_access, rnic_access};

/// Median of the samples in µs.
fn median_us(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn us_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// Median over `reps` runs of `f`, timed up to its return; what it returns is
/// dropped after the clock stops.
fn median_timed<T>(reps: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let v = (0..reps)
        .map(|_| {
            let t = Instant::now();
            let _v = f()?;
            Ok(us_since(t))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(median_us(v))
}

/// MR registration cost from `reg(len)` (µs per registration): the median over
/// `reps` one-page registrations, and the per-GiB slope (ms) of one `big`-byte one.
fn mr_costs(
    reps: usize,
    page: usize,
    big: u64,
    reg: impl Fn(usize) -> Result<f64>,
) -> Result<(f64, f64)> {
    let base_us = median_us((0..reps).map(|_| reg(page)).collect::<Result<Vec<_>>>()?);
    let big_us = reg(big as usize)?;
    Ok((
        base_us,
        (big_us - base_us) / 1e3 / (big as f64 / (1u64 << 30) as f64),
    ))
}

/// Control-plane figures of one mode (times in µs unless named otherwise).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
pub struct CtrlCosts {
    pub library_init_us: f64,
    pub mr_base_us: f64,
    pub mr_per_gib_ms: f64,
    pub create_qp_us: f64,
    pub create_cq_us: f64,
    pub qp_init_us: f64,
    /// Extra latency of the first operation on a new QP (NP-RDMA: key sync).
    pub first_op_extra_us: f64,
    pub swap_out_us: f64,
    /// Resident bytes added per registered (untouched) page.
    pub state_per_page_b: f64,
    pub state_per_qp_b: f64,
    pub state_per_cq_b: f64,
}

/// Both modes' control-plane figures.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
pub struct CtrlPlane {
    pub pinned: CtrlCosts,
    pub nprdma: CtrlCosts,
    /// Bytes of the large MR used for the per-GiB slope.
    pub big_mr_bytes: u64,
    pub reps: usize,
}

impl CtrlPlane {
    pub fn figures(&self) -> Vec<(String, f64)> {
        let mut v = Vec::new();
        for (m, c) in [("pinned", &self.pinned), ("nprdma", &self.nprdma)] {
            for (k, x) in [
                ("library_init_us", c.library_init_us),
                ("mr_base_us", c.mr_base_us),
                ("mr_per_gib_ms", c.mr_per_gib_ms),
                ("create_qp_us", c.create_qp_us),
                ("create_cq_us", c.create_cq_us),
                ("qp_init_us", c.qp_init_us),
                ("first_op_extra_us", c.first_op_extra_us),
                ("swap_out_us", c.swap_out_us),
                ("state_per_page_b", c.state_per_page_b),
                ("state_per_qp_b", c.state_per_qp_b),
                ("state_per_cq_b", c.state_per_cq_b),
            ] {
                v.push((format!("{m}.{k}"), x));
            }
        }
        v
    }
}

/// Measure everything with `reps` repetitions (medians) and a `big`-byte MR.
pub fn measure(reps: usize, big: u64, mut tick: impl FnMut(&str)) -> Result<CtrlPlane> {
    let reps = reps.max(1);
    let page = page_size();
    let mut out = CtrlPlane {
        big_mr_bytes: big,
        reps,
        ..CtrlPlane::default()
    };
    let pages = big.div_ceil(page as u64);
    let mut hc = rnic::HostConfig::default();
    hc.iova_pages = hc.iova_pages.max(2 * pages + 65536);
    let host_a = rnic::Host::new(hc.clone())?;
    let host_b = rnic::Host::new(hc)?;

    // ---- pinned ----
    tick("control plane: pinned RDMA");
    let c = &mut out.pinned;
    // (pd, ctx, host): dropped in that order, after the clock stops.
    c.library_init_us = median_timed(reps, || {
        let host = rnic::Host::new(rnic::HostConfig::default())?;
        let ctx = host.open_context()?;
        let pd = ctx.alloc_pd()?;
        Ok((pd, ctx, host))
    })?;
    let ctx = host_a.open_context()?;
    let pd = ctx.alloc_pd()?;
    let reg_pinned = |len: usize| -> Result<f64> {
        let t = Instant::now();
        let buf = PinnedBuf::locked(len)?;
        // SAFETY: `buf` outlives the MR (dropped right after, MR first).
        let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
        let us = us_since(t);
        drop(mr);
        drop(buf);
        Ok(us)
    };
    (c.mr_base_us, c.mr_per_gib_ms) = mr_costs(reps, page, big, reg_pinned)?;
    let cq = ctx.create_cq(1024, None)?;
    c.create_cq_us = median_timed(reps, || Ok(ctx.create_cq(1024, None)?))?;
    c.create_qp_us = median_timed(reps, || {
        Ok(pd.create_qp(&cq, &cq, &rnic::QpInitAttr::default())?)
    })?;
    {
        let ctx_b = host_b.open_context()?;
        let pd_b = ctx_b.alloc_pd()?;
        let cq_b = ctx_b.create_cq(1024, None)?;
        let buf_b = PinnedBuf::new(page)?;
        // SAFETY: `buf_b` outlives `mr_b` (declared before it, so dropped after).
        let mr_b = unsafe { pd_b.reg_mr(buf_b.addr(), buf_b.len(), rnic_access()) }?;
        let buf_a = PinnedBuf::new(page)?;
        // SAFETY: as above.
        let mr_a = unsafe { pd.reg_mr(buf_a.addr(), buf_a.len(), rnic_access()) }?;
        let mut init = Vec::new();
        let mut first = Vec::new();
        for _ in 0..reps {
            let qa = pd.create_qp(&cq, &cq, &rnic::QpInitAttr::default())?;
            let qb = pd_b.create_qp(&cq_b, &cq_b, &rnic::QpInitAttr::default())?;
            let t = Instant::now();
            qa.connect(rnic_access(), host_b.addr(), qb.qpn(), 7)?;
            init.push(us_since(t));
            qb.connect(rnic_access(), host_a.addr(), qa.qpn(), 7)?;
            let mut lat = Vec::new();
            for _ in 0..5 {
                let sge = [mr_a.sge(0, 8)];
                let t = Instant::now();
                qa.post_send(&[rnic::SendWr::new(1, rnic::WrOpcode::Read, &sge)
                    .remote(buf_b.addr() as u64, mr_b.rkey())])
                    .map_err(|e| e.err)?;
                let wc = cq.poll_wait(1, std::time::Duration::from_secs(10))?;
                if wc.len() != 1 || wc[0].status != rnic::WcStatus::Success {
                    return Err(crate::error::CliError::Completion(format!("{wc:?}")));
                }
                lat.push(us_since(t));
            }
            first.push(lat[0] - median_us(lat[1..].to_vec()));
        }
        c.qp_init_us = median_us(init);
        c.first_op_extra_us = median_us(first);
    }
    // Swap-out of one page of pager memory nobody registered (no listener).
    let pager = new_pager()?;
    c.swap_out_us = swap_out_us(&pager, None, reps)?;
    let before = rss_bytes()?;
    let qps: Vec<_> = (0..16)
        .map(|_| pd.create_qp(&cq, &cq, &rnic::QpInitAttr::default()))
        .collect::<std::result::Result<_, _>>()?;
    c.state_per_qp_b = rss_bytes()?.saturating_sub(before) as f64 / 16.0;
    drop(qps);
    let before = rss_bytes()?;
    let cqs: Vec<_> = (0..16)
        .map(|_| ctx.create_cq(1024, None))
        .collect::<std::result::Result<_, _>>()?;
    c.state_per_cq_b = rss_bytes()?.saturating_sub(before) as f64 / 16.0;
    drop(cqs);
    // Pinned registration adds no per-page state beyond the (resident) page itself.
    c.state_per_page_b = {
        let buf = PinnedBuf::locked(64 << 20)?;
        let before = rss_bytes()?;
        // SAFETY: `buf` outlives the MR.
        let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
        let d = rss_bytes()?.saturating_sub(before) as f64 / ((64 << 20) / page) as f64;
        drop(mr);
        d
    };

    // ---- NP-RDMA ----
    tick("control plane: NP-RDMA");
    let c = &mut out.nprdma;
    let pager_a = new_pager()?;
    let pager_b = new_pager()?;
    // (ctx, host): dropped in that order, after the clock stops.
    c.library_init_us = median_timed(reps, || {
        let host = rnic::Host::new(rnic::HostConfig::default())?;
        let ctx = nprdma::Context::new(&host, &pager_a, nprdma::Config::default())?;
        Ok((ctx, host))
    })?;
    let ctx = nprdma::Context::new(&host_a, &pager_a, nprdma::Config::default())?;
    let pd = ctx.alloc_pd();
    let reg_np = |len: usize| -> Result<f64> {
        let t = Instant::now();
        let region = pager_a.alloc(len)?;
        // SAFETY: the region is private anonymous memory that outlives the MR.
        #[allow(unsafe_code)]
        let mr = unsafe { pd.reg_mr(region.addr() as u64, len as u64, np_access()) }?;
        let us = us_since(t);
        drop(mr);
        drop(region);
        Ok(us)
    };
    (c.mr_base_us, c.mr_per_gib_ms) = mr_costs(reps, page, big, reg_np)?;
    let cq = ctx.create_cq(1024)?;
    c.create_cq_us = median_timed(reps, || Ok(ctx.create_cq(1024)?))?;
    c.create_qp_us = median_timed(reps, || Ok(pd.create_qp(&cq, &cq, 128)?))?;
    {
        let ctx_b = nprdma::Context::new(&host_b, &pager_b, nprdma::Config::default())?;
        let pd_b = ctx_b.alloc_pd();
        let cq_b = ctx_b.create_cq(1024)?;
        let mut rb = pager_b.alloc(page)?;
        rb.as_mut_slice().fill(1);
        // SAFETY: the region outlives the MR (dropped at the end of this block, MR first).
        #[allow(unsafe_code)]
        let mr_b = unsafe { pd_b.reg_mr(rb.addr() as u64, page as u64, np_access()) }?;
        let mut ra = pager_a.alloc(page)?;
        ra.as_mut_slice().fill(1);
        // SAFETY: as above.
        #[allow(unsafe_code)]
        let mr_a = unsafe { pd.reg_mr(ra.addr() as u64, page as u64, np_access()) }?;
        let mut init = Vec::new();
        let mut first = Vec::new();
        for _ in 0..reps {
            let qa = pd.create_qp(&cq, &cq, 128)?;
            let qb = pd_b.create_qp(&cq_b, &cq_b, 128)?;
            let t = Instant::now();
            qa.connect(&qb.endpoint())?;
            init.push(us_since(t));
            qb.connect(&qa.endpoint())?;
            let mut lat = Vec::new();
            for i in 0..5 {
                let t = Instant::now();
                qa.post_send(&[nprdma::SendWr::new(
                    i,
                    nprdma::Opcode::Read,
                    Some(mr_a.sge(0, 8)),
                    mr_b.addr(),
                    mr_b.rkey(),
                )])
                .map_err(|(_, e)| e)?;
                let wc = cq.poll_wait(1, std::time::Duration::from_secs(10));
                if wc.len() != 1 || !wc[0].is_ok() {
                    return Err(crate::error::CliError::Completion(format!("{wc:?}")));
                }
                lat.push(us_since(t));
            }
            first.push(lat[0] - median_us(lat[1..].to_vec()));
        }
        c.qp_init_us = median_us(init);
        c.first_op_extra_us = median_us(first);
        drop(mr_a);
        drop(mr_b);
    }
    // Swap-out of one page of a region registered with NP-RDMA (listener remaps the
    // NIC views and flushes the IOMMU before the page leaves).
    c.swap_out_us = swap_out_us(&pager_a, Some(&pd), reps)?;
    let before = rss_bytes()?;
    let qps: Vec<_> = (0..16)
        .map(|_| pd.create_qp(&cq, &cq, 128))
        .collect::<std::result::Result<_, _>>()?;
    c.state_per_qp_b = rss_bytes()?.saturating_sub(before) as f64 / 16.0;
    drop(qps);
    let before = rss_bytes()?;
    let cqs: Vec<_> = (0..16)
        .map(|_| ctx.create_cq(1024))
        .collect::<std::result::Result<_, _>>()?;
    c.state_per_cq_b = rss_bytes()?.saturating_sub(before) as f64 / 16.0;
    drop(cqs);
    c.state_per_page_b = {
        let len = 64usize << 20;
        let region = pager_a.alloc(len)?;
        let before = rss_bytes()?;
        // SAFETY: the region outlives the MR.
        #[allow(unsafe_code)]
        let mr = unsafe { pd.reg_mr(region.addr() as u64, len as u64, np_access()) }?;
        let d = rss_bytes()?.saturating_sub(before) as f64 / (len / page) as f64;
        drop(mr);
        d
    };
    Ok(out)
}

/// Median time to swap out one resident page of a fresh region, optionally
/// registered with NP-RDMA.
fn swap_out_us(pager: &vmem::Pager, pd: Option<&nprdma::Pd>, reps: usize) -> Result<f64> {
    let page = page_size();
    let mut region = pager.alloc(page * reps)?;
    region.as_mut_slice().fill(7);
    let mr = match pd {
        // SAFETY: the region outlives the MR (dropped below, before the region).
        #[allow(unsafe_code)]
        Some(pd) => {
            Some(unsafe { pd.reg_mr(region.addr() as u64, (page * reps) as u64, np_access()) }?)
        }
        None => None,
    };
    let mut v = Vec::new();
    for i in 0..reps {
        let t = Instant::now();
        let n = pager.swap_out(region.addr() + i * page, page)?;
        v.push(us_since(t));
        if n != 1 {
            return Err(crate::error::CliError::Peer(format!(
                "swap_out moved {n} pages, expected 1"
            )));
        }
    }
    drop(mr);
    Ok(median_us(v))
}
