//! Control-plane costs (the paper's Table "time cost in the control plane") and the
//! state NP-RDMA keeps per page / QP / CQ, measured for pinned RDMA and NP-RDMA.
//!
//! Per-page state is measured as resident memory of the process *outside* the
//! registered buffer's own pages (statm minus the buffer's resident pages from
//! `mincore`), after handing freed heap back to the OS, each registration on a
//! fresh device (so no IOMMU page table or heap touched by an earlier one is
//! reused), after a one-page registration of the same kind (what is per device
//! or context is not per page) — and split by owner: NP-RDMA's own (IOMMU entries of its two views,
//! version table, pins, shadow), the pager's own state for the same region
//! unregistered (what an OS keeps in its page tables anyway), and the NIC
//! model's residency map (the OS's role too).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::mem::{page_size, rss_bytes, PinnedBuf};
use crate::setup::{np_access, pager_without_reserve, rnic_access};

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
    /// Swap-out of one page nobody registered, on the same pager as
    /// `swap_out_us` and alternated with it (NP-RDMA: the baseline its
    /// listener's cost is read against; pinned: equal to `swap_out_us`).
    #[serde(default)]
    pub swap_out_unregistered_us: f64,
    /// Swap-out per page in batches of [`SWAP_BATCH`] pages (one `swap_out`
    /// call each: NP-RDMA's listener remaps the batch and flushes the IOMMU
    /// once), registered; and the same of pages nobody registered, on the
    /// same pager, alternated with it.
    #[serde(default)]
    pub swap_out_batched_us: f64,
    #[serde(default)]
    pub swap_out_batched_unregistered_us: f64,
    /// NP-RDMA's own resident bytes per registered page in the steady state
    /// (every page resident and mapped in the NIC views); pinned: resident
    /// bytes a registration adds per (pinned) page.
    pub state_per_page_b: f64,
    /// As `state_per_page_b`, right after registering never-touched memory.
    #[serde(default)]
    pub state_per_page_untouched_b: f64,
    /// NP-RDMA's per-page state by construction (element sizes of its tables).
    #[serde(default)]
    pub state_per_page_model_b: f64,
    /// The pager's own resident bytes per page of a region (not registered),
    /// every page resident / never touched (NP-RDMA only; the OS's role).
    #[serde(default)]
    pub pager_per_page_b: f64,
    #[serde(default)]
    pub pager_per_page_untouched_b: f64,
    /// The NIC model's frame-residency map per tracked page (NP-RDMA only; it
    /// stands for the OS's page-table present bit, a real IOMMU has none).
    #[serde(default)]
    pub resmap_per_page_b: f64,
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
                ("swap_out_unregistered_us", c.swap_out_unregistered_us),
                ("swap_out_batched_us", c.swap_out_batched_us),
                (
                    "swap_out_batched_unregistered_us",
                    c.swap_out_batched_unregistered_us,
                ),
                ("state_per_page_b", c.state_per_page_b),
                ("state_per_page_untouched_b", c.state_per_page_untouched_b),
                ("state_per_page_model_b", c.state_per_page_model_b),
                ("pager_per_page_b", c.pager_per_page_b),
                ("pager_per_page_untouched_b", c.pager_per_page_untouched_b),
                ("resmap_per_page_b", c.resmap_per_page_b),
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
    let pager = pager_without_reserve()?;
    c.swap_out_us = swap_out_us(&pager, None, reps)?;
    c.swap_out_unregistered_us = c.swap_out_us;
    c.swap_out_batched_us = swap_out_batched_us(&pager, None, reps)?;
    c.swap_out_batched_unregistered_us = c.swap_out_batched_us;
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
    c.state_per_page_b = pinned_page_state(big as usize)?;
    c.state_per_page_untouched_b = c.state_per_page_b;

    // ---- NP-RDMA ----
    tick("control plane: NP-RDMA");
    let c = &mut out.nprdma;
    let pager_a = pager_without_reserve()?;
    let pager_b = pager_without_reserve()?;
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
    // Registered and unregistered pages of one pager, alternated: the
    // listener's cost, not a difference between two swap files.
    (c.swap_out_us, c.swap_out_unregistered_us) =
        registered_vs_not(&pager_a, &pd, reps, swap_out_us)?;
    (c.swap_out_batched_us, c.swap_out_batched_unregistered_us) =
        registered_vs_not(&pager_a, &pd, reps, swap_out_batched_us)?;
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
    np_page_state(c, big as usize)?;
    Ok(out)
}

/// Hand freed heap memory back to the OS, so a reading counts what is
/// allocated rather than what the allocator caches (and later allocations are
/// faulted in fresh instead of reusing cached pages).
fn trim_heap() {
    // SAFETY: malloc_trim only releases free memory of the allocator's arenas. (Raw:
    // a glibc call no typed crate wraps.)
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resident pages of the mapping `[addr, addr+len)` (mincore: a raw call, rustix
/// has none).
fn resident_pages(addr: usize, len: usize) -> Result<u64> {
    let mut v = vec![0u8; len.div_ceil(page_size())];
    // SAFETY: `[addr, addr+len)` is a live page-aligned mapping of the caller's,
    // and `v` has one byte per page of it.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, v.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(v.iter().filter(|&&b| b & 1 != 0).count() as u64)
}

/// Resident bytes of the process minus the resident pages of the buffers in
/// `skip` (their own memory is not state).
fn state_rss(skip: &[(usize, usize)]) -> Result<u64> {
    trim_heap();
    let rss = rss_bytes()?;
    let mut own = 0;
    for &(a, l) in skip {
        own += resident_pages(a, l)? * page_size() as u64;
    }
    Ok(rss.saturating_sub(own))
}

/// `(after - before) / pages` in bytes per page (negative when memory went back).
fn per_page(before: u64, after: u64, pages: usize) -> f64 {
    (after as f64 - before as f64) / pages as f64
}

/// A fresh device (nothing touched in its IOMMU page table yet) sized for
/// NP-RDMA's two views of `pages` pages.
fn fresh_host(pages: usize) -> Result<rnic::Host> {
    let mut hc = rnic::HostConfig::default();
    hc.iova_pages = hc.iova_pages.max(2 * pages as u64 + 4096);
    hc.max_tracked_pages = hc.max_tracked_pages.max(pages as u64 + 4096);
    Ok(rnic::Host::new(hc)?)
}

/// Touch (write) every page of `r`.
fn touch(r: &mut vmem::Region) {
    for p in r.as_mut_slice().chunks_mut(page_size()) {
        p[0] = 1;
    }
}

/// Resident bytes a pinned registration adds per page of a `len`-byte buffer.
fn pinned_page_state(len: usize) -> Result<f64> {
    let pages = len.div_ceil(page_size());
    let host = fresh_host(pages)?;
    let ctx = host.open_context()?;
    let pd = ctx.alloc_pd()?;
    // A one-page registration first (kept until the end), so what the
    // device sets up on its first MR is not counted per page.
    let warm_buf = PinnedBuf::locked(page_size())?;
    // SAFETY: `warm_buf` outlives the MR (declared before it).
    let _warm = unsafe { pd.reg_mr(warm_buf.addr(), warm_buf.len(), rnic_access()) }?;
    let buf = PinnedBuf::locked(len)?;
    let span = [(buf.addr(), buf.len())];
    let before = state_rss(&span)?;
    // SAFETY: `buf` outlives the MR (dropped right after).
    let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
    let d = per_page(before, state_rss(&span)?, pages);
    drop(mr);
    Ok(d)
}

/// NP-RDMA's per-page state for a `len`-byte MR, split by owner (see the
/// module docs), into `c`. Per page = all the MR adds / its pages, so the
/// MR's fixed part (its records, table ends rounded up to whole pages) is in.
fn np_page_state(c: &mut CtrlCosts, len: usize) -> Result<()> {
    let pages = len.div_ceil(page_size());
    let pager = pager_without_reserve()?;
    // The first region / registration of each kind (one page, kept to the
    // end) sets up what is per pager / device / context, not per page —
    // including the fault thread's fault-around buffer (a first touch of a
    // two-page region faults both in through it).
    let mut warm = pager.alloc(2 * page_size())?;
    warm.as_mut_slice()[0] = 1;
    // The pager's own state for a region nobody registered.
    let before = state_rss(&[])?;
    let mut r = pager.alloc(len)?;
    let span = [(r.addr(), r.len())];
    c.pager_per_page_untouched_b = per_page(before, state_rss(&span)?, pages);
    touch(&mut r);
    c.pager_per_page_b = per_page(before, state_rss(&span)?, pages);
    drop(r);
    // The NIC model's residency map over the same number of pages.
    {
        let host = fresh_host(pages)?;
        host.frames().track(warm.addr(), warm.len(), true)?;
        let r = pager.alloc(len)?;
        let span = [(r.addr(), r.len())];
        let before = state_rss(&span)?;
        host.frames().track(r.addr(), r.len(), false)?;
        c.resmap_per_page_b = per_page(before, state_rss(&span)?, pages);
        host.frames().untrack(r.addr())?;
    }
    // Registrations over never-touched memory, and over memory whose every
    // page is resident (mapped in both views at registration: the steady
    // state of a used MR), each on a fresh device.
    for touched in [false, true] {
        let host = fresh_host(pages)?;
        let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default())?;
        let pd = ctx.alloc_pd();
        let warm_r = pager.alloc(page_size())?;
        // SAFETY: the region outlives the MR (declared before it).
        #[allow(unsafe_code)]
        let _warm = unsafe { pd.reg_mr(warm_r.addr() as u64, page_size() as u64, np_access()) }?;
        let before = state_rss(&[])?;
        let mut r = pager.alloc(len)?;
        if touched {
            touch(&mut r);
        }
        // SAFETY: the region outlives the MR (dropped first, below).
        #[allow(unsafe_code)]
        let mr = unsafe { pd.reg_mr(r.addr() as u64, len as u64, np_access()) }?;
        let total = per_page(before, state_rss(&[(r.addr(), r.len())])?, pages);
        let own = if touched {
            total - c.pager_per_page_b - c.resmap_per_page_b
        } else {
            total - c.pager_per_page_untouched_b - c.resmap_per_page_b
        };
        if touched {
            c.state_per_page_b = own;
        } else {
            c.state_per_page_untouched_b = own;
        }
        drop(mr);
        drop(r);
    }
    c.state_per_page_model_b = nprdma::shadow::STATE_BYTES_PER_PAGE as f64;
    Ok(())
}

/// A swap-out figure of pages registered with `pd` and of pages nobody
/// registered, on the same pager, alternated three times: the middle of each.
fn registered_vs_not(
    pager: &vmem::Pager,
    pd: &nprdma::Pd,
    reps: usize,
    measure: fn(&vmem::Pager, Option<&nprdma::Pd>, usize) -> Result<f64>,
) -> Result<(f64, f64)> {
    let (mut reg, mut unreg) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        reg.push(measure(pager, Some(pd), reps)?);
        unreg.push(measure(pager, None, reps)?);
    }
    reg.sort_by(f64::total_cmp);
    unreg.sort_by(f64::total_cmp);
    Ok((reg[1], unreg[1]))
}

/// Pages per `swap_out` call of the batched swap-out figure.
pub const SWAP_BATCH: usize = 64;

/// Median time to swap out one resident page of a fresh region, optionally
/// registered with NP-RDMA.
fn swap_out_us(pager: &vmem::Pager, pd: Option<&nprdma::Pd>, reps: usize) -> Result<f64> {
    swap_out_runs_us(pager, pd, reps, 1)
}

/// Median time per page to swap out [`SWAP_BATCH`] resident pages of a fresh
/// region in one call, optionally registered with NP-RDMA.
fn swap_out_batched_us(pager: &vmem::Pager, pd: Option<&nprdma::Pd>, reps: usize) -> Result<f64> {
    Ok(swap_out_runs_us(pager, pd, reps.clamp(1, 8), SWAP_BATCH)? / SWAP_BATCH as f64)
}

/// Median time to swap out `per` resident pages of a fresh region in one
/// call, `reps` times, optionally registered with NP-RDMA.
fn swap_out_runs_us(
    pager: &vmem::Pager,
    pd: Option<&nprdma::Pd>,
    reps: usize,
    per: usize,
) -> Result<f64> {
    let page = page_size() * per;
    let mut region = pager.alloc(page * reps)?;
    region.as_mut_slice().fill(7);
    let mr = match pd {
        #[allow(unsafe_code)]
        Some(pd) => {
            // SAFETY: the region outlives the MR (dropped below, before the region).
            Some(unsafe { pd.reg_mr(region.addr() as u64, (page * reps) as u64, np_access()) }?)
        }
        None => None,
    };
    let mut v = Vec::new();
    for i in 0..reps {
        let t = Instant::now();
        let n = pager.swap_out(region.addr() + i * page, page)?;
        v.push(us_since(t));
        if n != per {
            return Err(crate::error::CliError::Peer(format!(
                "swap_out moved {n} pages, expected {per}"
            )));
        }
    }
    drop(mr);
    Ok(median_us(v))
}

#[cfg(test)]
mod tests {
    /// NP-RDMA's per-page state of a 16 GiB MR (the size issue 11 states its
    /// 12 B target at), never touched and every page resident. Needs 16 GiB of
    /// free memory and ~1 min: run by hand (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn state_per_page_at_16_gib() {
        let mut c = super::CtrlCosts::default();
        super::np_page_state(&mut c, 16 << 30).expect("measured");
        println!(
            "16 GiB: NP-RDMA state per page {:.3} B every page resident, {:.3} B never touched \
             (pager {:.3} / {:.3} B, NIC model's residency map {:.3} B, by construction {} B)",
            c.state_per_page_b,
            c.state_per_page_untouched_b,
            c.pager_per_page_b,
            c.pager_per_page_untouched_b,
            c.resmap_per_page_b,
            c.state_per_page_model_b
        );
        assert!(c.state_per_page_b > 0.0);
    }
}
