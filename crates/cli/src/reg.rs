//! `nprdma reg`: the cost of registering a large MR (time and resident memory),
//! pinned versus NP-RDMA — the paper's Spark-initialisation experiment.

use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::mem::{mem_available, parse_size, rss_bytes, PinnedBuf};
use crate::setup::{np_access, pager_without_reserve, rnic_access};
use crate::spec::Mode;

#[derive(Args, Debug)]
pub struct RegArgs {
    /// MR size (e.g. 1G, 16G). Pinned mode needs that much free RAM.
    #[arg(long, value_parser = parse_size, default_value = "16G")]
    pub size: u64,
    /// pinned (mmap + mlock + rnic reg_mr) or nprdma (pager region + nprdma reg_mr).
    #[arg(long, value_enum, default_value_t = Mode::Nprdma)]
    pub mode: Mode,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One registration measurement.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RegResult {
    pub mode: Mode,
    pub bytes: u64,
    /// Memory preparation: pinned = mmap + mlock (faults every page in); NP-RDMA =
    /// pager region (mmap + userfaultfd registration).
    pub prepare_ms: f64,
    /// The verbs registration call itself.
    pub reg_mr_ms: f64,
    /// prepare + reg_mr: what the application waits for.
    pub total_ms: f64,
    pub ms_per_gib: f64,
    pub rss_before: u64,
    pub rss_after: u64,
    pub rss_delta: u64,
}

/// Register `bytes` in `mode` and measure it; the memory is released afterwards.
pub fn measure(mode: Mode, bytes: u64) -> Result<RegResult> {
    let len = usize::try_from(bytes).map_err(|_| CliError::Arg("size too large".into()))?;
    if len == 0 {
        return Err(CliError::Arg("--size must be > 0".into()));
    }
    // NP-RDMA maps each MR page twice (Read and Write views): size the IOMMU for it.
    let pages = bytes.div_ceil(crate::mem::page_size() as u64);
    let mut hc = rnic::HostConfig::default();
    hc.iova_pages = hc.iova_pages.max(2 * pages + 4096);
    let host = rnic::Host::new(hc)?;
    let r =
        match mode {
            Mode::Pinned => {
                let avail = mem_available()?;
                if bytes > avail.saturating_sub(1 << 30) {
                    return Err(CliError::Arg(format!(
                        "pinning {} GiB needs that much free RAM; MemAvailable is {:.1} GiB",
                        bytes as f64 / (1u64 << 30) as f64,
                        avail as f64 / (1u64 << 30) as f64
                    )));
                }
                let ctx = host.open_context()?;
                let pd = ctx.alloc_pd()?;
                let rss_before = rss_bytes()?;
                let t0 = Instant::now();
                let buf = PinnedBuf::locked(len)?;
                let t1 = Instant::now();
                // SAFETY: `buf` outlives the MR (dropped at the end of this block, after `mr`).
                let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
                let t2 = Instant::now();
                let rss_after = rss_bytes()?;
                drop(mr);
                drop(buf);
                result(mode, bytes, t0, t1, t2, rss_before, rss_after)
            }
            Mode::Nprdma => {
                let pager = pager_without_reserve()?;
                let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default())?;
                let pd = ctx.alloc_pd();
                let rss_before = rss_bytes()?;
                let t0 = Instant::now();
                let region = pager.alloc(len)?;
                let t1 = Instant::now();
                // SAFETY: the region is private anonymous memory that outlives the MR.
                #[allow(unsafe_code)]
                let mr = unsafe { pd.reg_mr(region.addr() as u64, len as u64, np_access()) }?;
                let t2 = Instant::now();
                let rss_after = rss_bytes()?;
                drop(mr);
                drop(region);
                result(mode, bytes, t0, t1, t2, rss_before, rss_after)
            }
            Mode::Odp => return Err(CliError::Arg(
                "reg compares pinned and nprdma (an ODP registration pins nothing, like nprdma)"
                    .into(),
            )),
        };
    Ok(r)
}

fn result(
    mode: Mode,
    bytes: u64,
    t0: Instant,
    t1: Instant,
    t2: Instant,
    before: u64,
    after: u64,
) -> RegResult {
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let total = ms(t0, t2);
    RegResult {
        mode,
        bytes,
        prepare_ms: ms(t0, t1),
        reg_mr_ms: ms(t1, t2),
        total_ms: total,
        ms_per_gib: total / (bytes as f64 / (1u64 << 30) as f64),
        rss_before: before,
        rss_after: after,
        rss_delta: after.saturating_sub(before),
    }
}

pub fn cmd_reg(a: RegArgs) -> Result<()> {
    let r = measure(a.mode, a.size)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!("# MR registration, mode {}", r.mode.label());
        println!(
            "{:>14} {:>12} {:>12} {:>12} {:>12} {:>14} {:>14}",
            "#bytes",
            "prepare[ms]",
            "reg_mr[ms]",
            "total[ms]",
            "ms/GiB",
            "RSS before[MiB]",
            "RSS after[MiB]"
        );
        println!(
            "{:>14} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>14.1} {:>14.1}",
            r.bytes,
            r.prepare_ms,
            r.reg_mr_ms,
            r.total_ms,
            r.ms_per_gib,
            mib(r.rss_before),
            mib(r.rss_after)
        );
    }
    Ok(())
}
