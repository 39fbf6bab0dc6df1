//! Pinning runs of consecutive non-resident pages at once: one swap read of
//! consecutive slots (or a shared source of zeroes) and one `UFFDIO_COPY` for the
//! whole run (one `UFFDIO_ZEROPAGE` for never-touched pages only read),
//! instead of a read and an ioctl per page. Used by `pin` of a
//! range (a two-sided NP-RDMA fault pins whole request ranges); anything
//! that does not fit a run falls back to the page-at-a-time path.

use super::{Brought, Inner, Why};
use crate::anon::AnonMapping;
use crate::error::{Error, Result};
use crate::mm::{PageBuf, PAGE, PAGE_SHIFT};
use crate::state::{self, PageArray, BUSY, MAX_PINS, SWAPPED, UNTOUCHED};
use std::cell::RefCell;
use std::sync::atomic::Ordering::*;
use std::sync::OnceLock;

/// Longest run of swapped-out pages brought in by one read + one ioctl (128 KiB).
pub const MAX_RUN: usize = 32;
/// Longest run of never-touched pages filled by one ioctl (2 MiB).
pub const MAX_ZERO_RUN: usize = 512;

thread_local! {
    static RUN_BUF: RefCell<Option<PageBuf>> = const { RefCell::new(None) };
}

/// The source of zeroes for filling runs of never-touched pages: a private
/// anonymous mapping of [`MAX_ZERO_RUN`] pages that nobody ever writes, so
/// every read of it (the kernel's, during `UFFDIO_COPY`) finds the shared
/// zero page and it costs no memory. `None` if it could not be mapped (runs
/// then stay within [`MAX_RUN`] and are zeroed in the thread's buffer).
fn zero_source() -> Option<usize> {
    static SRC: OnceLock<Option<usize>> = OnceLock::new();
    *SRC.get_or_init(|| {
        AnonMapping::new(MAX_ZERO_RUN * PAGE)
            .ok()
            // Kept for the life of the process (it holds no memory).
            .map(|m| m.into_raw().0)
    })
}

impl Inner {
    /// Tries to bring in and pin pages `p..` (at most up to `end`) as one run:
    /// all UNTOUCHED, or all SWAPPED in consecutive slots, none busy. Returns
    /// how many pages it pinned, each counted in `swapped_in` order; 0 means
    /// "no run here" (fewer than two such pages, or the ioctl did nothing):
    /// the caller takes the page-at-a-time path, which handles every special
    /// case (resident, busy, gone, external, EEXIST, ...).
    pub(crate) fn pin_run(
        &self,
        arr: &PageArray,
        p: usize,
        end: usize,
        write: bool,
        on_page: impl FnMut(usize),
    ) -> Result<usize> {
        self.fill_run(arr, p, end, |_| Why::Pin { write }, on_page)
    }

    /// A run of never-touched pages from `p` filled by the fault thread, with
    /// one ioctl: at most `max` pages and up to `end`, published resident —
    /// `p` for `first`, the others as prefetched. For the fault-around of a
    /// first-touch fault on `p` (`first` = that fault; see
    /// `PagerConfig::fault_around`) and for the fill-ahead of a sequential
    /// write stream (`first` = [`Why::Prefetch`]: nobody touched `p` yet).
    /// Returns how many pages, `p` first (0: `p` is not never-touched or not
    /// before `end`; a fault is then resolved page by page). Wakes nobody
    /// faulting in the run of a fault: the caller notifies listeners, then
    /// wakes the faulting thread.
    pub(crate) fn fill_untouched_run(
        &self,
        arr: &PageArray,
        p: usize,
        end: usize,
        max: usize,
        first: Why,
    ) -> Result<usize> {
        let max = max.min(MAX_ZERO_RUN);
        if max < 2 || p >= end || state::kind(arr.word(p).load(Acquire)) != UNTOUCHED {
            return Ok(0);
        }
        let why = |k| if k == 0 { first } else { Why::Prefetch };
        self.fill_run(arr, p, end.min(p + max), why, |_| {})
    }

    /// Brings in pages `p..end` (at most [`MAX_RUN`] swapped-out or
    /// [`MAX_ZERO_RUN`] never-touched ones) as one run, publishing
    /// page `p + k` as brought in for `why(k)`; see [`Self::pin_run`]. For a
    /// fault (`why(0)` a fault) only never-touched pages form the run, and
    /// nobody is woken.
    fn fill_run(
        &self,
        arr: &PageArray,
        p: usize,
        end: usize,
        why: impl Fn(usize) -> Why,
        mut on_page: impl FnMut(usize),
    ) -> Result<usize> {
        if arr.external || end.saturating_sub(p) < 2 {
            return Ok(0);
        }
        let fault = matches!(why(0), Why::Fault { .. });
        // Lock the run: BUSY on each page, in order, stopping at the first
        // page that does not continue it.
        let mut words = [0u64; MAX_ZERO_RUN];
        let mut n = 0;
        let kind0 = state::kind(arr.word(p).load(Acquire));
        if kind0 != UNTOUCHED && (fault || kind0 != SWAPPED) {
            return Ok(0);
        }
        let limit = if kind0 == SWAPPED || zero_source().is_none() {
            MAX_RUN
        } else {
            MAX_ZERO_RUN
        };
        let mut slot0 = 0u32;
        while n < limit && p + n < end {
            let w = arr.word(p + n);
            let v = w.load(Acquire);
            let fits = v & BUSY == 0
                && state::kind(v) == kind0
                && state::pins(v) < MAX_PINS
                && match (kind0, state::slot(v)) {
                    (SWAPPED, Some(s)) if n == 0 => {
                        slot0 = s;
                        true
                    }
                    (SWAPPED, Some(s)) => s == slot0.wrapping_add(n as u32),
                    (SWAPPED, None) => false,
                    _ => true,
                };
            if !fits || w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_err() {
                break;
            }
            words[n] = v;
            n += 1;
        }
        let unlock = |from: usize| {
            for k in from..n {
                arr.word(p + k).fetch_and(!BUSY, Release);
            }
        };
        if n < 2 {
            unlock(0);
            return Ok(0);
        }
        let addr = p << PAGE_SHIFT;
        let copied = if kind0 != SWAPPED && why(0).reads_only() {
            // A read of never-touched pages: the zero page, nothing allocated.
            match self.uffd.zeropage(addr, n * PAGE, !fault) {
                Ok(()) => n,
                Err(e) => (e.done as usize / PAGE).min(n),
            }
        } else {
            self.copy_run(addr, n, kind0 == SWAPPED, slot0, !fault, &unlock)?
        };
        let outcome = if kind0 == SWAPPED {
            Brought::Swap
        } else {
            Brought::Zero
        };
        for (k, &v) in words.iter().enumerate().take(copied) {
            self.publish_filled(arr.word(p + k), v, why(k), outcome);
            on_page(p + k);
        }
        // Pages the ioctl did not fill (EEXIST, EAGAIN, a vanished mapping):
        // the page-at-a-time path sorts each of them out.
        unlock(copied);
        if copied > 0 {
            self.check_budget();
        }
        Ok(copied)
    }

    /// Fills the `n` locked pages at `addr` with one `UFFDIO_COPY` (waking
    /// their faulting threads if `wake`): of their `n` consecutive swap
    /// slots from `slot0` (`swapped`), else of zeroes.
    /// Returns how many pages the ioctl filled; a failed swap read unlocks
    /// the run (`unlock(0)`) and is the error.
    fn copy_run(
        &self,
        addr: usize,
        n: usize,
        swapped: bool,
        slot0: u32,
        wake: bool,
        unlock: &dyn Fn(usize),
    ) -> Result<usize> {
        if let (false, Some(src)) = (swapped, zero_source()) {
            // Pages zeroed ahead of need first (a long run), then zeroes
            // copied from the source for what the reserve did not cover.
            let moved = self
                .reserve
                .as_ref()
                .map_or(0, |r| r.take(&self.uffd, addr, n, wake));
            if moved == n {
                return Ok(n);
            }
            let rest = n - moved;
            // SAFETY: the zero source holds MAX_ZERO_RUN >= n readable pages
            // and is never written; the destination pages are registered
            // with our uffd and only filled if missing.
            return Ok(moved
                + match unsafe {
                    self.uffd
                        .copy(addr + moved * PAGE, src as *const u8, rest * PAGE, wake)
                } {
                    Ok(()) => rest,
                    Err(e) => (e.done as usize / PAGE).min(rest),
                });
        }
        RUN_BUF.with(|b| -> Result<usize> {
            let mut b = b.borrow_mut();
            let buf = b.get_or_insert_with(|| PageBuf::new(MAX_RUN));
            let bytes = &mut buf.as_mut_slice()[..n * PAGE];
            if swapped {
                // Slots of BUSY swapped pages cannot be freed or reused.
                if let Err(e) = self.swap.read(slot0, bytes) {
                    tracing::error!(addr, slot0, n, %e, "swap read of a run failed");
                    unlock(0);
                    return Err(Error::SwapIo(e));
                }
            } else {
                bytes.fill(0);
            }
            // SAFETY: `buf` holds at least n readable pages; the destination
            // pages are registered with our uffd and only filled if missing.
            Ok(
                match unsafe { self.uffd.copy(addr, buf.as_ptr(), n * PAGE, wake) } {
                    Ok(()) => n,
                    Err(e) => (e.done as usize / PAGE).min(n),
                },
            )
        })
    }
}
