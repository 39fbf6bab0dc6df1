//! Pager statistics: counters and the fault-service-time histogram.

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default)]
pub struct Counters {
    pub minor_faults: AtomicU64,
    pub major_faults: AtomicU64,
    pub spurious_faults: AtomicU64,
    pub swap_ins: AtomicU64,
    pub swap_outs: AtomicU64,
    pub zero_fills: AtomicU64,
    pub pin_swap_ins: AtomicU64,
    pub evict_aborts: AtomicU64,
    pub evict_failures: AtomicU64,
    pub swap_full: AtomicU64,
    pub evict_runs: AtomicU64,
    pub young_spared: AtomicU64,
    pub fault_retries: AtomicU64,
    pub batched_swap_reads: AtomicU64,
    pub batched_swap_writes: AtomicU64,
    pub evict_vetoes: AtomicU64,
    pub swap_write_failures: AtomicU64,
    pub budget_waits: AtomicU64,
    pub budget_overruns: AtomicU64,
}

pub struct Stats {
    pub c: Counters,
    pub hist: Mutex<Histogram<u64>>,
    by_thread: Mutex<std::collections::HashMap<u32, (u64, u64)>>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            c: Counters::default(),
            hist: Mutex::new(
                Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid bounds"),
            ),
            by_thread: Mutex::default(),
        }
    }
}

impl Stats {
    /// Records one resolved fault: service time, and the faulting thread.
    pub fn record_fault(&self, ns: u64, tid: u32, major: bool) {
        let _ = self.hist.lock().record(ns.max(1));
        let mut t = self.by_thread.lock();
        let e = t.entry(tid).or_default();
        if major {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
    }

    pub fn faults_by_thread(&self) -> Vec<ThreadFaults> {
        let mut v: Vec<ThreadFaults> = self
            .by_thread
            .lock()
            .iter()
            .map(|(&tid, &(minor, major))| ThreadFaults { tid, minor, major })
            .collect();
        v.sort_by_key(|t| t.tid);
        v
    }
}

/// Faults resolved by the fault thread for one faulting thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadFaults {
    /// Kernel thread id (gettid) of the faulting thread.
    pub tid: u32,
    /// Minor faults (zero-filled first touches).
    pub minor: u64,
    /// Major faults (read from swap).
    pub major: u64,
}

#[inline]
pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

/// Percentiles of the fault-service time (from reading the fault message to
/// the resolving ioctl's return), in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencySummary {
    /// Faults measured.
    pub count: u64,
    /// Mean.
    pub mean_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Maximum.
    pub max_ns: u64,
}

/// A snapshot of the pager's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PagerStats {
    /// Pager-managed pages resident now.
    pub resident_pages: usize,
    /// The most pages `resident_pages` counted at once since the pager
    /// started.
    pub resident_high: usize,
    /// Pages in registered (managed) regions.
    pub registered_pages: usize,
    /// Swap slots in use.
    pub swap_slots_used: usize,
    /// Swap slots in the file.
    pub swap_slots_total: usize,
    /// The resident-page budget (`None` = unlimited).
    pub budget_pages: Option<usize>,
    /// First touches served with zeroes (by the fault handler).
    pub minor_faults: u64,
    /// Faults served from swap.
    pub major_faults: u64,
    /// Fault messages for pages already present.
    pub spurious_faults: u64,
    /// Pages read back from swap (faults, pins, prefetch).
    pub swap_ins: u64,
    /// Pages written to swap and reclaimed.
    pub swap_outs: u64,
    /// Pages brought in as zeroes by pin/prefetch.
    pub zero_fills: u64,
    /// Swap-ins done by `pin` in the calling thread.
    pub pin_swap_ins: u64,
    /// Evictions aborted by a racing pin.
    pub evict_aborts: u64,
    /// CLOCK victims spared because a listener reported them young
    /// (accessed through a secondary MMU, e.g. a NIC's IOMMU, since the
    /// last question): the second chance of a referenced page.
    pub young_spared: u64,
    /// Pages the kernel refused to move out (stayed resident).
    pub evict_failures: u64,
    /// Eviction batches refused because the swap device was full (their
    /// pages stayed resident, over the budget).
    pub swap_full: u64,
    /// Fault resolutions postponed because the kernel asked to retry (an
    /// munmap/mremap of managed memory in flight) or failed transiently.
    pub fault_retries: u64,
    /// Swap reads issued together in concurrent batches (`pin`/`prefetch`
    /// of a range holding several runs of swapped pages).
    pub batched_swap_reads: u64,
    /// Swap writes issued together in concurrent batches (an eviction batch
    /// whose slots form several runs).
    pub batched_swap_writes: u64,
    /// Eviction batches a listener refused (its device could not confirm
    /// that no access through the old mapping was in flight): the pages
    /// stayed resident.
    pub evict_vetoes: u64,
    /// Swap writes that failed (their pages stayed resident; the first is
    /// logged as an error, later ones at each power of two).
    pub swap_write_failures: u64,
    /// Page-ins that waited for the evictor to make room under the budget
    /// plus its slack.
    pub budget_waits: u64,
    /// Page-ins that went over the limit after waiting the longest
    /// (`ADMIT_WAIT`) for an evictor that could not keep up.
    pub budget_overruns: u64,
    /// The slack over the budget page-ins may use before they wait (see
    /// `PagerConfig::budget_slack`; 0 without a budget).
    pub budget_slack: usize,
    /// Swap-ins served by the swap cache: the page had just been read for
    /// `read_swapped`, so its swap-in cost no second device read.
    pub swap_cache_hits: u64,
    /// How the swap file is read and written (O_DIRECT, buffered, fallback).
    pub swap_io: crate::swap::SwapIo,
    /// Bytes read from swap.
    pub bytes_swapped_in: u64,
    /// Bytes written to swap.
    pub bytes_swapped_out: u64,
    /// Fault-service time percentiles.
    pub fault_service: LatencySummary,
    /// The zero reserve's capacity in pages (`PagerConfig::zero_reserve`,
    /// rounded up to 2 MiB chunks; 0 = none).
    pub zero_reserve_pages: usize,
    /// Never-touched pages filled by a move from the zero reserve.
    pub zero_reserve_moved: u64,
    /// Pages the reserve's thread allocated and zeroed (this process's
    /// memory until they are moved into a region).
    pub zero_reserve_populated: u64,
}

impl Stats {
    pub fn latency(&self) -> LatencySummary {
        let h = self.hist.lock();
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            mean_ns: h.mean(),
            p50_ns: h.value_at_quantile(0.5),
            p99_ns: h.value_at_quantile(0.99),
            max_ns: h.max(),
        }
    }
}
