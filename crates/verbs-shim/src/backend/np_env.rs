//! `NPRDMA_MODE=nprdma` settings from the environment: the process pager's
//! configuration (resident budget, swap file) and the NP-RDMA engine's polling.

use super::Result;
use crate::error::ShimError;
use std::path::PathBuf;
use std::time::Duration;

/// Default swap file size: 1 GiB (sparse).
pub const DEFAULT_SWAP_MB: u64 = 1024;

/// Read a variable through `get` (tests pass a map, the library `std::env::var`).
fn num(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<u64>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| ShimError::InvalidArgument(format!("{name}={v:?} is not a number"))),
    }
}

/// The pager configuration:
/// * `NPRDMA_BUDGET_PAGES` or `NPRDMA_BUDGET_MB` — resident budget of the registered
///   memory (4 KiB pages / MiB; unset = unlimited; both set = error). Below the size of
///   the application's MRs, pages are swapped out and back during the run.
/// * `NPRDMA_SWAP_PATH` (default: an unlinked file in the temp dir),
///   `NPRDMA_SWAP_MB` (swap file size, default 1024, sparse).
/// * `NPRDMA_PAGER_SPIN_US` — how long the fault thread polls after a fault (default 50).
/// * `NPRDMA_EAGER_SWAP_IN` (default 1) — map pages into the NIC's views as the pager
///   brings them in; `NPRDMA_FAULT_AROUND_PAGES` (default 16, at most budget / 8) —
///   never-touched pages filled together on a first touch.
/// * `NPRDMA_ZERO_RESERVE_MB` (default 32, at most budget / 16; 0 = none) — pages
///   zeroed ahead of need by a background thread, moved into place for long runs
///   of first touches; never more than the registered memory not yet resident.
pub fn pager_config(get: &dyn Fn(&str) -> Option<String>) -> Result<vmem::PagerConfig> {
    let mut c = vmem::PagerConfig::default();
    let pages = num(get, "NPRDMA_BUDGET_PAGES")?;
    let mb = num(get, "NPRDMA_BUDGET_MB")?;
    c.budget_pages = match (pages, mb) {
        (Some(_), Some(_)) => {
            return Err(ShimError::InvalidArgument(
                "set only one of NPRDMA_BUDGET_PAGES and NPRDMA_BUDGET_MB".into(),
            ))
        }
        (Some(p), None) => Some(p as usize),
        (None, Some(m)) => Some((m as usize).saturating_mul((1 << 20) / vmem::PAGE_SIZE)),
        (None, None) => None,
    };
    if c.budget_pages == Some(0) {
        return Err(ShimError::InvalidArgument(
            "NPRDMA budget must be at least one page".into(),
        ));
    }
    if let Some(p) = get("NPRDMA_SWAP_PATH").filter(|p| !p.trim().is_empty()) {
        c.swap_path = Some(PathBuf::from(p));
    }
    let swap_mb = num(get, "NPRDMA_SWAP_MB")?.unwrap_or(DEFAULT_SWAP_MB);
    if swap_mb == 0 {
        return Err(ShimError::InvalidArgument("NPRDMA_SWAP_MB=0".into()));
    }
    c.swap_size = swap_mb.saturating_mul(1 << 20);
    c.o_direct = num(get, "NPRDMA_SWAP_BUFFERED")?.unwrap_or(0) == 0; // 1 = page-cache swap
    if let Some(us) = num(get, "NPRDMA_PAGER_SPIN_US")? {
        c.spin = Duration::from_micros(us);
    }
    // Pages brought in by a CPU fault, pin or prefetch are mapped into the NIC's views
    // in the same pass (not on their first RDMA access, which would go two-sided).
    c.eager_swap_in_notify = num(get, "NPRDMA_EAGER_SWAP_IN")?.unwrap_or(1) != 0;
    // Fault-around of first touches (Linux's 64 KiB), at most an eighth of a budget
    // so that a small budget is not churned by the extra pages.
    let around =
        num(get, "NPRDMA_FAULT_AROUND_PAGES")?.unwrap_or(DEFAULT_FAULT_AROUND as u64) as usize;
    c.fault_around = match c.budget_pages {
        Some(b) => around.min(b / 8),
        None => around,
    };
    // In-order first touches grow the run up to 2 MiB (the pager stops growth at
    // an eighth of the budget too).
    c.fault_around_max = num(get, "NPRDMA_FAULT_AROUND_MAX_PAGES")?
        .unwrap_or(DEFAULT_FAULT_AROUND_MAX as u64) as usize;
    c.zero_reserve = vmem::PagerConfig::zero_reserve_pages(
        num(get, "NPRDMA_ZERO_RESERVE_MB")?.unwrap_or(DEFAULT_ZERO_RESERVE_MB) as usize,
        c.budget_pages,
    );
    Ok(c)
}

/// Default `NPRDMA_ZERO_RESERVE_MB`: 32 MiB.
pub const DEFAULT_ZERO_RESERVE_MB: u64 = 32;

/// Default `NPRDMA_FAULT_AROUND_MAX_PAGES`: 512 pages (2 MiB, a transparent huge page).
pub const DEFAULT_FAULT_AROUND_MAX: usize = 512;

/// Default `NPRDMA_FAULT_AROUND_PAGES`: 16 pages (64 KiB, Linux's `fault_around_bytes`).
pub const DEFAULT_FAULT_AROUND: usize = 16;

/// Default `NPRDMA_WRITE_VERSION_THRESHOLD`: 0, every WRITE is checked with page
/// versions. The layer's other check for small WRITEs READs the written range back
/// through the application's rkey, which needs REMOTE_READ on the target MR — and
/// applications register write-only MRs (perftest's WRITE tests do).
pub const DEFAULT_WRITE_VERSION_THRESHOLD: u64 = 0;

/// The engine configuration: `NPRDMA_POLL_SPIN_US` (how long the polling thread spins
/// after work before blocking, default the engine's 50), `NPRDMA_INTERRUPT=1` (the
/// polling thread never spins), `NPRDMA_WRITE_VERSION_THRESHOLD` (bytes: WRITEs up to
/// this size are checked by a read-back, which needs the target MR to grant
/// REMOTE_READ; longer ones by page versions; default 0), `NPRDMA_READ_VERSION_THRESHOLD`
/// (bytes: READs longer than this are checked with page versions instead of the
/// magic-value scan of the data; default none), `NPRDMA_REG_CACHE_MB` (the
/// registration cache of user-space mode, `NPRDMA_DEVICE=verbs`: MiB of temporary MRs
/// kept registered; 0 = off; default the engine's 64, at most half of
/// `RLIMIT_MEMLOCK`), `NPRDMA_LEASE_MS` and `NPRDMA_LEASE_MB` (user-space mode's
/// leases of a target's registration of pages a peer came back to two-sided, so its
/// next READs/WRITEs of them go one-sided: the peer uses one for half this time after
/// its request, 0 = never, default the engine's 100; and MiB lent at most, default 64,
/// at most a quarter of `RLIMIT_MEMLOCK`).
pub fn engine_config(get: &dyn Fn(&str) -> Option<String>) -> Result<np::Config> {
    let mut c = np::Config::default();
    c.plan.write_version_threshold =
        num(get, "NPRDMA_WRITE_VERSION_THRESHOLD")?.unwrap_or(DEFAULT_WRITE_VERSION_THRESHOLD);
    if let Some(t) = num(get, "NPRDMA_READ_VERSION_THRESHOLD")? {
        c.plan.read_version_threshold = Some(t);
    }
    if let Some(us) = num(get, "NPRDMA_POLL_SPIN_US")? {
        c.spin = Duration::from_micros(us);
    }
    if let Some(v) = num(get, "NPRDMA_INTERRUPT")? {
        c.interrupt_mode = v != 0;
    }
    if let Some(v) = num(get, "NPRDMA_RING_TAKEOVER")? {
        c.ring_takeover = v != 0;
    }
    if let Some(mb) = num(get, "NPRDMA_REG_CACHE_MB")? {
        c.reg_cache_bytes = mb.saturating_mul(1 << 20);
    }
    if let Some(ms) = num(get, "NPRDMA_LEASE_MS")? {
        c.lease_ms = u32::try_from(ms).map_err(|_| {
            ShimError::InvalidArgument(format!("NPRDMA_LEASE_MS={ms} is too large"))
        })?;
    }
    if let Some(mb) = num(get, "NPRDMA_LEASE_MB")? {
        c.lease_bytes = mb.saturating_mul(1 << 20);
    }
    Ok(c)
}

/// `std::env::var` as a lookup function.
pub fn from_process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn pager_defaults_and_budget() {
        let c = pager_config(&with(&[])).unwrap();
        assert_eq!(c.budget_pages, None);
        assert_eq!(c.swap_size, DEFAULT_SWAP_MB << 20);
        let c = pager_config(&with(&[("NPRDMA_BUDGET_PAGES", "64")])).unwrap();
        assert_eq!(c.budget_pages, Some(64));
        let c = pager_config(&with(&[("NPRDMA_BUDGET_MB", "2"), ("NPRDMA_SWAP_MB", "8")])).unwrap();
        assert_eq!(c.budget_pages, Some(2 * 256));
        assert_eq!(c.swap_size, 8 << 20);
        let c = pager_config(&with(&[("NPRDMA_SWAP_PATH", "/tmp/x.swap")])).unwrap();
        assert_eq!(c.swap_path, Some(PathBuf::from("/tmp/x.swap")));
    }

    #[test]
    fn pager_maps_in_eagerly_and_faults_around_within_the_budget() {
        let c = pager_config(&with(&[])).unwrap();
        assert!(c.eager_swap_in_notify);
        assert_eq!(c.fault_around, DEFAULT_FAULT_AROUND);
        assert_eq!(c.fault_around_max, DEFAULT_FAULT_AROUND_MAX);
        let c = pager_config(&with(&[("NPRDMA_FAULT_AROUND_MAX_PAGES", "0")])).unwrap();
        assert_eq!(c.fault_around_max, 0);
        assert!(pager_config(&with(&[("NPRDMA_FAULT_AROUND_MAX_PAGES", "-1")])).is_err());
        let c = pager_config(&with(&[("NPRDMA_BUDGET_PAGES", "64")])).unwrap();
        assert_eq!(c.fault_around, 8, "at most an eighth of the budget");
        let c = pager_config(&with(&[("NPRDMA_BUDGET_PAGES", "4")])).unwrap();
        assert!(c.fault_around <= 1, "off under a tiny budget");
        let c = pager_config(&with(&[
            ("NPRDMA_EAGER_SWAP_IN", "0"),
            ("NPRDMA_FAULT_AROUND_PAGES", "0"),
        ]))
        .unwrap();
        assert!(!c.eager_swap_in_notify);
        assert_eq!(c.fault_around, 0);
        assert!(pager_config(&with(&[("NPRDMA_FAULT_AROUND_PAGES", "x")])).is_err());
    }

    #[test]
    fn zero_reserve_within_the_budget() {
        assert_eq!(pager_config(&with(&[])).unwrap().zero_reserve, 8192);
        let c = pager_config(&with(&[("NPRDMA_BUDGET_MB", "64")])).unwrap();
        assert_eq!(c.zero_reserve, 1024, "at most a sixteenth of the budget");
        let c = pager_config(&with(&[("NPRDMA_ZERO_RESERVE_MB", "0")])).unwrap();
        assert_eq!(c.zero_reserve, 0);
        assert!(pager_config(&with(&[("NPRDMA_ZERO_RESERVE_MB", "x")])).is_err());
    }

    #[test]
    fn pager_rejects_bad_values() {
        for bad in [
            vec![("NPRDMA_BUDGET_PAGES", "x")],
            vec![("NPRDMA_BUDGET_PAGES", "0")],
            vec![("NPRDMA_BUDGET_PAGES", "4"), ("NPRDMA_BUDGET_MB", "1")],
            vec![("NPRDMA_SWAP_MB", "0")],
        ] {
            assert!(matches!(
                pager_config(&with(&bad)),
                Err(ShimError::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn engine_settings() {
        let c = engine_config(&with(&[
            ("NPRDMA_POLL_SPIN_US", "7"),
            ("NPRDMA_INTERRUPT", "1"),
        ]))
        .unwrap();
        assert_eq!(c.spin, Duration::from_micros(7));
        assert!(c.interrupt_mode);
        assert_eq!(
            c.plan.write_version_threshold,
            DEFAULT_WRITE_VERSION_THRESHOLD
        );
        let c = engine_config(&with(&[("NPRDMA_WRITE_VERSION_THRESHOLD", "4096")])).unwrap();
        assert_eq!(c.plan.write_version_threshold, 4096);
        assert_eq!(c.plan.read_version_threshold, None);
        let c = engine_config(&with(&[("NPRDMA_READ_VERSION_THRESHOLD", "65536")])).unwrap();
        assert_eq!(c.plan.read_version_threshold, Some(65536));
        let c = engine_config(&with(&[("NPRDMA_REG_CACHE_MB", "3")])).unwrap();
        assert_eq!(c.reg_cache_bytes, 3 << 20);
        let c =
            engine_config(&with(&[("NPRDMA_LEASE_MS", "7"), ("NPRDMA_LEASE_MB", "2")])).unwrap();
        assert_eq!((c.lease_ms, c.lease_bytes), (7, 2 << 20));
        assert!(engine_config(&with(&[("NPRDMA_LEASE_MS", "99999999999")])).is_err());
        assert!(engine_config(&with(&[("NPRDMA_INTERRUPT", "yes")])).is_err());
    }
}
