//! The bounded registration cache of user-space mode (beyond the paper):
//! the temporary MRs of the two-sided path kept after their operation, up
//! to a budget of registered bytes (LRU), so a later operation over the
//! same pages needs no registration call. A cached MR never outlives the
//! residency of its pages: the cache is a swap listener and drops every
//! entry over a page *before* the pager evicts it (and over memory the
//! application unmaps or deregisters). While an operation uses an MR its
//! pages are pinned (the entry cannot be invalidated under it: eviction
//! waits for the pin), and dropping the cache's reference leaves the
//! operation's own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::backend::Backend;
use crate::nic::{Access, Nic, SwapListener};

const PS: u64 = vmem::PAGE_SIZE as u64;
/// Entries kept at most (lookups scan them).
const MAX_ENTRIES: usize = 256;

/// A temporary MR: shared between the cache and the operations using it.
pub(super) type TempMr<N> = Arc<<N as Nic>::Mr>;

struct Entry<N: Backend> {
    start: u64,
    end: u64,
    access: Access,
    /// The protection sub-domain it was registered in (`temp_mr`).
    domain: u32,
    mr: TempMr<N>,
    used: u64,
}

struct Inner<N: Backend> {
    entries: Vec<Entry<N>>,
    bytes: u64,
    tick: u64,
}

/// Counters of the cache ([`super::Stats`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CacheCounts {
    pub hits: u64,
    pub misses: u64,
    pub invalidations: u64,
}

/// The cache of one context (`budget` 0: off, every MR registered anew).
pub(crate) struct RegCache<N: Backend> {
    budget: u64,
    inner: Mutex<Inner<N>>,
    hits: AtomicU64,
    misses: AtomicU64,
    invalidations: AtomicU64,
}

impl<N: Backend> RegCache<N> {
    pub(super) fn new(budget: u64) -> Self {
        RegCache {
            budget,
            inner: Mutex::new(Inner {
                entries: Vec::new(),
                bytes: 0,
                tick: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            invalidations: AtomicU64::new(0),
        }
    }

    /// Whether the cache keeps anything.
    pub(super) fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub(super) fn counts(&self) -> CacheCounts {
        CacheCounts {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            invalidations: self.invalidations.load(Ordering::Relaxed),
        }
    }

    /// A cached MR covering `[addr, addr+len)` with exactly `access`, in
    /// sub-domain `domain`.
    pub(super) fn lookup(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        domain: u32,
    ) -> Option<TempMr<N>> {
        if !self.enabled() {
            return None;
        }
        let mut g = self.inner.lock();
        g.tick += 1;
        let tick = g.tick;
        let e = g.entries.iter_mut().find(|e| {
            e.access == access && e.domain == domain && e.start <= addr && addr + len <= e.end
        })?;
        e.used = tick;
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(e.mr.clone())
    }

    /// The page-aligned range a miss over `[addr, addr+len)` registers.
    pub(super) fn span(addr: u64, len: u64) -> (u64, u64) {
        let start = addr & !(PS - 1);
        (start, (addr + len).next_multiple_of(PS) - start)
    }

    /// Keep `mr` (over `[start, start+len)`, registered after a miss),
    /// evicting the least recently used entries beyond the budget.
    pub(super) fn insert(&self, start: u64, len: u64, access: Access, domain: u32, mr: &TempMr<N>) {
        self.misses.fetch_add(1, Ordering::Relaxed);
        if !self.enabled() || len > self.budget {
            return;
        }
        let mut victims = Vec::new();
        {
            let mut g = self.inner.lock();
            g.tick += 1;
            let used = g.tick;
            g.entries.push(Entry {
                start,
                end: start + len,
                access,
                domain,
                mr: mr.clone(),
                used,
            });
            g.bytes += len;
            while g.bytes > self.budget || g.entries.len() > MAX_ENTRIES {
                let Some(i) = (0..g.entries.len()).min_by_key(|&i| g.entries[i].used) else {
                    break;
                };
                let e = g.entries.swap_remove(i);
                g.bytes -= e.end - e.start;
                victims.push(e);
            }
        }
        // Deregistered outside the lock (a NIC may take its time).
        drop(victims);
    }

    /// Drop every entry overlapping `[start, end)`.
    pub(super) fn invalidate(&self, start: u64, end: u64) {
        if !self.enabled() {
            return;
        }
        let victims = {
            let mut g = self.inner.lock();
            let mut out = Vec::new();
            let mut i = 0;
            while i < g.entries.len() {
                if g.entries[i].start < end && start < g.entries[i].end {
                    let e = g.entries.swap_remove(i);
                    g.bytes -= e.end - e.start;
                    out.push(e);
                } else {
                    i += 1;
                }
            }
            out
        };
        if !victims.is_empty() {
            self.invalidations
                .fetch_add(victims.len() as u64, Ordering::Relaxed);
        }
        drop(victims);
    }

    /// Drop everything (context teardown).
    pub(super) fn clear(&self) {
        self.invalidate(0, u64::MAX);
    }
}

impl<N: Backend> SwapListener for RegCache<N> {
    fn before_swap_out(&self, pages: &[u64]) -> bool {
        for &p in pages {
            self.invalidate(p, p + PS);
        }
        true
    }
    fn after_unmap(&self, start: u64, end: u64) {
        self.invalidate(start, end);
    }
}
