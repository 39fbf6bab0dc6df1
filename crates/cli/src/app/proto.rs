//! What an application run asks of its back-end (the pool's design, size, DRAM
//! budget and swap device), the checks of that request (bad input is a clear
//! error before anything starts), and the JSON-line messages between the
//! front-end and the back-end process (over the TCP handshake connection; the
//! data path is the software RNIC's shared-memory transport).

use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::setup::QpAddr;

/// How the back-end's memory pool is built and served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Design {
    /// Today's design, in memory: a pinned pool (every page resident and
    /// registered), read and written with one-sided READ/WRITE. Its capacity
    /// is the DRAM: the pool is not limited by the budget.
    Pinned,
    /// NP-RDMA: the pool registered without pinning, at most the budget
    /// resident, the rest on the swap device; one-sided READ/WRITE.
    Nprdma,
    /// The traditional design NP-RDMA replaces: small pinned send/receive
    /// buffers at the back-end, a two-sided RPC per request, the back-end CPU
    /// copying between them and its (swappable, unregistered) pool.
    CopyThrough,
    /// ODP **model**: the pool registered ON_DEMAND with the software RNIC (a
    /// model of an on-demand-paging NIC: a remote fault is NAKed and retried
    /// after its 2 ms timeout while the host brings the page in), at most the
    /// budget resident, evictions invalidating the NIC's page table first (the
    /// MMU-notifier role); one-sided READ/WRITE. A model, not hardware.
    Odp,
}

impl Design {
    pub fn label(self) -> &'static str {
        match self {
            Design::Pinned => "in-memory pinned",
            Design::Nprdma => "NP-RDMA",
            Design::CopyThrough => "copy-through (pinned bufs + RPC)",
            Design::Odp => "ODP (model)",
        }
    }
    /// Whether the pool is limited to the budget (the rest swapped).
    pub fn swaps(self) -> bool {
        self != Design::Pinned
    }
}

/// The application a back-end serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "app", rename_all = "lowercase")]
pub enum App {
    /// A key-value cache of `item`-byte items filling the pool (written once
    /// at start-up, version 0).
    Cache { item: usize },
    /// A shuffle pool: registered at start-up, written by map tasks later.
    Shuffle,
}

/// A back-end's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSpec {
    pub app: App,
    pub design: Design,
    /// Pool bytes.
    pub pool: u64,
    /// Resident budget of the pool's pager (the DRAM the back-end may use).
    pub budget: u64,
    /// Swap device (file) bytes.
    pub swap: u64,
    /// Front-end QPs to serve (one per front-end thread).
    pub qps: usize,
}

/// Largest pool accepted (the CLI's own sanity limit).
const MAX_POOL: u64 = 64 << 30;

impl PoolSpec {
    /// Items of a cache pool.
    pub fn items(&self) -> u64 {
        match self.app {
            App::Cache { item } => self.pool / item.max(1) as u64,
            App::Shuffle => 0,
        }
    }

    /// Check the request: a clear message for every impossible one.
    pub fn validate(&self) -> Result<()> {
        let page = crate::mem::page_size() as u64;
        if self.pool == 0 || self.pool > MAX_POOL {
            return Err(CliError::Arg(format!(
                "--pool must be 1 page .. 64 GiB (got {} B)",
                self.pool
            )));
        }
        if self.budget == 0 {
            return Err(CliError::Arg(
                "--budget must be at least one page (a budget of 0 leaves the pool no memory)"
                    .into(),
            ));
        }
        if self.budget < 16 * page {
            return Err(CliError::Arg(format!(
                "--budget of {} B is below 16 pages: the pager could not keep a request's pages resident",
                self.budget
            )));
        }
        if self.qps == 0 || self.qps > 64 {
            return Err(CliError::Arg(format!(
                "--threads must be 1..=64 (got {})",
                self.qps
            )));
        }
        if let App::Cache { item } = self.app {
            if !(64..=(1 << 20)).contains(&item) || item % 8 != 0 {
                return Err(CliError::Arg(format!(
                    "--item must be a multiple of 8 in 64 B .. 1 MiB (got {item})"
                )));
            }
            if self.pool < item as u64 {
                return Err(CliError::Arg("--pool is smaller than one item".into()));
            }
        }
        if self.design.swaps() {
            if self.pool > self.swap {
                return Err(CliError::Arg(format!(
                    "the pool ({}) is larger than the swap device ({}): its cold part would have nowhere to go (raise --swap or lower --pool)",
                    human(self.pool),
                    human(self.swap)
                )));
            }
            let free = disk_free(&std::env::temp_dir())?;
            if self.swap > free {
                return Err(CliError::Arg(format!(
                    "the swap device ({}) is larger than the free space of {} ({}): a swap-out would fail mid-run",
                    human(self.swap),
                    std::env::temp_dir().display(),
                    human(free)
                )));
            }
        } else {
            let avail = crate::mem::mem_available()?;
            if self.pool > avail / 10 * 9 {
                return Err(CliError::Arg(format!(
                    "a pinned pool of {} does not fit in DRAM ({} available): pinned memory cannot be swapped",
                    human(self.pool),
                    human(avail)
                )));
            }
        }
        Ok(())
    }
}

/// Free bytes of the filesystem holding `dir` (statvfs).
fn disk_free(dir: &std::path::Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| CliError::Arg(format!("bad path {}", dir.display())))?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid
    // NUL-terminated string for the duration of the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(CliError::Io(std::io::Error::last_os_error()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// `1.5 GiB`, `64 MiB`, `8 KiB`.
pub fn human(b: u64) -> String {
    let (v, u) = if b >= 1 << 30 {
        (b as f64 / (1u64 << 30) as f64, "GiB")
    } else if b >= 1 << 20 {
        (b as f64 / (1u64 << 20) as f64, "MiB")
    } else if b >= 1 << 10 {
        (b as f64 / 1024.0, "KiB")
    } else {
        (b as f64, "B")
    };
    if v.fract() == 0.0 {
        format!("{v:.0} {u}")
    } else {
        format!("{v:.1} {u}")
    }
}

/// What the back-end tells the front-end once its pool is ready.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Ready {
    /// One QP per front-end thread.
    pub qps: Vec<QpAddr>,
    /// The pool's address and rkey (one-sided designs; 0 for copy-through).
    pub base: u64,
    pub rkey: u32,
    /// Time to allocate, register (pin or not) and — for the cache — fill the
    /// pool, split: allocation + registration, then the fill.
    pub init_us: f64,
    pub fill_us: f64,
}

/// Back-end counters over the current mark (see `Req::Mark`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BackendStats {
    /// Pool physical memory (back-end RSS above its level before the pool
    /// existed, from /proc/self/statm), sampled every 2 ms: now, peak and mean
    /// since the mark.
    pub pool_rss_now: u64,
    pub pool_rss_peak: u64,
    pub pool_rss_mean: u64,
    pub rss_samples: u64,
    /// Pager counters since the mark (0 for the pinned pool).
    pub swap_ins: u64,
    pub swap_outs: u64,
    pub major_faults: u64,
    pub resident_pages: u64,
    /// Evictions the pager aborted since the mark (a pin or access raced them).
    #[serde(default)]
    pub evict_aborts: u64,
    /// CLOCK victims the pager spared since the mark because a listener
    /// (NP-RDMA: the IOMMU's accessed bits) reported them young.
    #[serde(default)]
    pub young_spared: u64,
    /// Two-sided requests (fault path) the back-end's NP-RDMA engine served
    /// since the mark.
    #[serde(default)]
    pub np_served: u64,
    /// Requests the copy-through server handled since start.
    pub rpcs: u64,
    /// Non-resident DMA attempts seen by the back-end's NIC (must be 0).
    pub nonresident_dma: u64,
}

/// Front-end → back-end.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum Req {
    Hello {
        spec: PoolSpec,
    },
    Connect {
        peers: Vec<QpAddr>,
    },
    /// Shuffle map stage: `maps` tasks each write `parts` partitions of
    /// `part_bytes` into the pool, partition (m, r) at `(m * parts + r) * part_bytes`,
    /// as block version `version`.
    Map {
        maps: usize,
        parts: usize,
        part_bytes: usize,
        /// The round (block version) written.
        version: u64,
    },
    /// Restart the counters and the RSS sampling window.
    Mark,
    Stats,
    Bye,
}

/// Back-end → front-end.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum Resp {
    Ready { r: Ready },
    Ok,
    Mapped { us: f64 },
    Stats { s: BackendStats },
    Error { msg: String },
}

/// The copy-through RPC header: `[op u64][key u64]`, then for a PUT the item.
pub const RPC_HDR: usize = 16;
/// RPC op codes.
pub const RPC_GET: u64 = 1;
pub const RPC_PUT: u64 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(design: Design, pool: u64, budget: u64, swap: u64) -> PoolSpec {
        PoolSpec {
            app: App::Cache { item: 8192 },
            design,
            pool,
            budget,
            swap,
            qps: 1,
        }
    }

    #[test]
    fn bad_pools_are_refused_with_a_reason() {
        let m = 1u64 << 20;
        assert!(spec(Design::Nprdma, 64 * m, 8 * m, 64 * m)
            .validate()
            .is_ok());
        let e = spec(Design::Nprdma, 64 * m, 0, 64 * m)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("budget"), "{e}");
        let e = spec(Design::Nprdma, 64 * m, 8 * m, 32 * m)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("larger than the swap device"), "{e}");
        let e = spec(Design::CopyThrough, 64 * m, 8 * m, 1 << 50)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("free space"), "{e}");
        let e = spec(Design::Pinned, 60 << 30, 8 * m, 0)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("DRAM"), "{e}");
        assert_eq!(human(8 << 10), "8 KiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
