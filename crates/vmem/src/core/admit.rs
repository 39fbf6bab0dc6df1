//! Budget admission: a thread about to bring pages in first makes room for
//! them — evicting for itself, or on the fault thread waiting (bounded) for
//! the evictor — while the pages resident and being brought in would exceed
//! the budget plus its slack, so resident memory stays within a stated bound
//! under any traffic instead of running ahead of the evictor.
//!
//! The bound. Pages a thread is admitted for count against the limit from
//! admission until its [`Admit`] drops (after the pages were published
//! resident), so concurrent page-ins cannot overshoot together. An
//! admission waits only while something can be evicted: when the evictor
//! finds every resident page pinned or busy it says so (a new `stuck`
//! generation) and waiters proceed — memory the holders of pins keep
//! resident is theirs to bound. A thread other than the pager's fault
//! thread does not wait for the evictor thread: it evicts for itself (direct
//! reclaim, Linux's answer to an evictor that does not get a core on a busy
//! machine), under the evictor's own lock and rules. No admission waits
//! for room longer than [`ADMIT_WAIT`] (then it proceeds, counted in
//! `budget_overruns`); an eviction it runs itself takes what the eviction
//! takes — at worst an IOMMU flush waiting for DMA sections until its
//! timeout, which then keeps the pages resident (`evict_vetoes`) and is
//! reported (`flush_stalls`).
//! So at every moment
//! `resident <= budget + slack`, or every page above that is pinned (or in
//! flight to the evictor), or an overrun was counted.
//!
//! Who must not call it: the evictor and every listener callback (they run
//! on an evicting thread), a thread holding a page's BUSY bit (eviction may
//! wait for it), and — since it may evict, running the listeners — a thread
//! inside a DMA section or holding a lock a listener takes (the rules of
//! `SwapListener::before_swap_out`).

use super::Inner;
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

/// The longest an admission waits for the evictor before it proceeds over
/// the limit (counted in `budget_overruns`).
pub const ADMIT_WAIT: Duration = Duration::from_millis(100);

/// Pages admitted and not yet published (see the module docs); dropping it
/// releases them from the count.
#[must_use]
pub struct Admit<'a> {
    inner: Option<&'a Inner>,
    n: usize,
}

impl Drop for Admit<'_> {
    fn drop(&mut self) {
        if let Some(i) = self.inner {
            i.admitted.fetch_sub(self.n, AcqRel);
        }
    }
}

impl Inner {
    /// The slack over the budget a page-in may use before it waits:
    /// `PagerConfig::budget_slack`, by default an eighth of the budget,
    /// at least 16 and at most 4096 pages.
    pub fn slack(&self, budget: usize) -> usize {
        self.cfg
            .budget_slack
            .unwrap_or_else(|| (budget / 8).clamp(16, 4096))
    }

    /// The resident-page limit admissions keep to (`None`: no budget).
    pub fn admit_limit(&self) -> Option<usize> {
        let b = self.budget.load(Relaxed);
        (b != usize::MAX).then(|| b.saturating_add(self.slack(b)))
    }

    /// Pages that fit under the limit now (`usize::MAX` without a budget).
    pub fn room(&self) -> usize {
        match self.admit_limit() {
            None => usize::MAX,
            Some(l) => l.saturating_sub(self.resident.load(Relaxed) + self.admitted.load(Relaxed)),
        }
    }

    /// Admits `n` pages about to be brought in: returns at once while they
    /// fit under the limit; otherwise makes room itself (direct reclaim, as
    /// Linux does, so room does not depend on the evictor thread getting a
    /// core: on the pager's fault thread, which may not run listeners,
    /// it waits for the evictor instead), until they fit, nothing is
    /// evictable, or [`ADMIT_WAIT`] passed.
    pub fn admit(&self, n: usize) -> Admit<'_> {
        if n == 0 || self.admit_limit().is_none() {
            return Admit { inner: None, n: 0 };
        }
        let direct = !super::IS_HANDLER.with(std::cell::Cell::get);
        let mut waited: Option<(Instant, u64)> = None;
        loop {
            let Some(limit) = self.admit_limit() else {
                return Admit { inner: None, n: 0 };
            };
            let a = self.admitted.load(Acquire);
            let r = self.resident.load(Acquire);
            // A request larger than the whole limit is admitted alone.
            let fits =
                r + a + n <= limit || (a == 0 && n > limit && r <= self.budget.load(Relaxed));
            if fits {
                if self
                    .admitted
                    .compare_exchange(a, a + n, AcqRel, Acquire)
                    .is_ok()
                {
                    return Admit {
                        inner: Some(self),
                        n,
                    };
                }
                continue;
            }
            let (since, stuck0) = *waited.get_or_insert_with(|| {
                self.stats.c.budget_waits.fetch_add(1, Relaxed);
                (Instant::now(), self.evict_stuck.load(Acquire))
            });
            let mut stuck = self.evict_stuck.load(Acquire) != stuck0;
            if direct && !stuck {
                // Evict what it takes to fit (and the evictor's hysteresis).
                let want =
                    (r + a + n).saturating_sub(limit) + self.slack(self.budget.load(Relaxed)) / 2;
                match self.reclaim(want.max(1)) {
                    Ok(0) | Err(_) => stuck = true,
                    Ok(_) => continue,
                }
            }
            if stuck || since.elapsed() >= ADMIT_WAIT {
                if !stuck {
                    let k = self.stats.c.budget_overruns.fetch_add(1, Relaxed) + 1;
                    if k.is_power_of_two() {
                        tracing::warn!(
                            resident = self.resident.load(Relaxed),
                            admitted = self.admitted.load(Relaxed),
                            n,
                            limit,
                            overruns = k,
                            "a page-in waited the longest for the evictor (logged at each power of two)"
                        );
                    }
                }
                self.admitted.fetch_add(n, AcqRel);
                return Admit {
                    inner: Some(self),
                    n,
                };
            }
            self.kick_evictor();
            let mut g = self.room_lock.lock();
            self.room_waiters.fetch_add(1, AcqRel);
            // Re-check under the lock: the evictor notifies under it.
            if self.resident.load(Acquire) + self.admitted.load(Acquire) + n > limit
                && self.evict_stuck.load(Acquire) == stuck0
            {
                self.room_cv.wait_for(&mut g, Duration::from_millis(2));
            }
            self.room_waiters.fetch_sub(1, AcqRel);
        }
    }

    /// Wakes admissions waiting for room (the evictor, after each batch and
    /// when it found nothing to evict).
    pub fn room_made(&self, stuck: bool) {
        if stuck {
            self.evict_stuck.fetch_add(1, AcqRel);
        }
        if self.room_waiters.load(Acquire) > 0 {
            let _g = self.room_lock.lock();
            self.room_cv.notify_all();
        }
    }
}
