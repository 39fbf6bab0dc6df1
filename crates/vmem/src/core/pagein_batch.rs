//! Concurrent swap-in of a range's swapped-out pages (`pin` and `prefetch` of
//! a range): every idle swapped page is locked, the pages are grouped into
//! runs (consecutive pages in consecutive slots, at most `MAX_RUN`), all runs
//! are read at once on the swap I/O threads (one read in the calling thread,
//! so a single run never leaves it), then each run is filled with one
//! `UFFDIO_COPY`. Whatever it does not bring in (busy pages, failed reads or
//! fills) it unlocks and leaves to the page-at-a-time path.

use super::pagein_run::MAX_RUN;
use super::{Brought, Inner, Why};
use crate::mm::{PageBuf, PAGE, PAGE_SHIFT};
use crate::space::Segment;
use crate::state::{self, PageArray, BUSY, MAX_PINS, NOTIFYING, SWAPPED};
use crate::swap::{Slot, SwapDevice};
use crate::swap_io::IoOp;
use std::cell::RefCell;
use std::sync::atomic::Ordering::*;

/// Pages read by one round of concurrent reads (1 MiB of buffer).
const BATCH_PAGES: usize = 256;

thread_local! {
    static BATCH_BUF: RefCell<Option<PageBuf>> = const { RefCell::new(None) };
}

/// A run of locked swapped pages: first page, first slot, length, and each
/// page's state word before it was locked.
struct Run<'a> {
    arr: &'a PageArray,
    p: usize,
    slot: Slot,
    words: Vec<u64>,
}

/// Locks page `p` of `arr` (BUSY) if it is swapped out, idle and below the
/// pin limit; returns its slot and word before the lock.
fn lock_swapped(arr: &PageArray, p: usize) -> Option<(Slot, u64)> {
    let w = arr.word(p);
    let v = w.load(Acquire);
    match state::slot(v) {
        Some(s) if state::kind(v) == SWAPPED && v & BUSY == 0 && state::pins(v) < MAX_PINS => w
            .compare_exchange(v, v | BUSY, AcqRel, Acquire)
            .is_ok()
            .then_some((s, v)),
        _ => None,
    }
}

/// Appends locked page `p` (slot `slot`, word `v`) to the last run if it
/// continues it (next page of the same array, next slot), else starts a run.
fn extend_runs<'a>(runs: &mut Vec<Run<'a>>, arr: &'a PageArray, p: usize, slot: Slot, v: u64) {
    match runs.last_mut() {
        Some(r)
            if std::ptr::eq(r.arr, arr)
                && r.p + r.words.len() == p
                && r.slot.wrapping_add(r.words.len() as u32) == slot
                && r.words.len() < MAX_RUN =>
        {
            r.words.push(v)
        }
        _ => runs.push(Run {
            arr,
            p,
            slot,
            words: vec![v],
        }),
    }
}

impl Inner {
    /// Brings in the idle swapped pages of `[p0, p1)` with concurrent reads
    /// and publishes each with `why` (`Why::Pin` adds a pin); appends the
    /// pages it brought in, in page order, to `out`. Never fails: anything
    /// left over is still non-resident (or resident through someone else)
    /// and the caller's page-at-a-time walk sorts it out.
    pub(crate) fn swap_in_batch(
        &self,
        arr: &PageArray,
        p0: usize,
        p1: usize,
        why: Why,
        out: &mut Vec<usize>,
    ) {
        if arr.external {
            return;
        }
        let mut p = p0;
        while p < p1 {
            let mut runs: Vec<Run> = Vec::new();
            let mut pages = 0;
            while p < p1 && pages < BATCH_PAGES {
                if let Some((slot, v)) = lock_swapped(arr, p) {
                    extend_runs(&mut runs, arr, p, slot, v);
                    pages += 1;
                }
                p += 1;
            }
            if !runs.is_empty() {
                self.fill_runs(&runs, why, out);
            }
        }
    }

    /// Brings in (unpinned) the idle swapped-out pages among the pages
    /// holding `addrs` (any order, any registrations; external and
    /// unregistered ones are skipped), reading up to [`BATCH_PAGES`] of them
    /// at a time concurrently, so a batch of scattered faults uses the swap
    /// device's queue depth. Returns how many pages it brought in (listeners
    /// notified first when eager swap-in notification is on, as for
    /// `prefetch`).
    pub fn swap_in_pages(&self, addrs: &[usize]) -> usize {
        let mut pages: Vec<usize> = addrs.iter().map(|a| a >> PAGE_SHIFT).collect();
        pages.sort_unstable();
        pages.dedup();
        let sp = self.space.read();
        // Each managed page with its registration: one lookup per page, in
        // page order.
        let found: Vec<(usize, Segment)> = pages
            .iter()
            .filter_map(|&p| {
                sp.lookup(p)
                    .filter(|s| !s.arr.external)
                    .map(|s| (p, s.clone()))
            })
            .collect();
        drop(sp);
        let absent = found
            .iter()
            .filter(|(p, s)| state::kind(s.arr.word(*p).load(Relaxed)) == SWAPPED)
            .count();
        let _room = self.admit(absent);
        let mut out = Vec::new();
        let mut rest = found.iter();
        loop {
            let mut runs: Vec<Run> = Vec::new();
            let mut locked = 0;
            for (p, s) in rest.by_ref() {
                if let Some((slot, v)) = lock_swapped(&s.arr, *p) {
                    extend_runs(&mut runs, &s.arr, *p, slot, v);
                    locked += 1;
                    if locked == BATCH_PAGES {
                        break;
                    }
                }
            }
            if runs.is_empty() {
                break;
            }
            self.fill_runs(&runs, Why::Prefetch, &mut out);
        }
        if self.cfg.eager_swap_in_notify && !out.is_empty() {
            let brought: Vec<usize> = out.iter().map(|p| p << PAGE_SHIFT).collect();
            self.listeners.after_swap_in(&brought);
            for &p in &out {
                if let Ok(k) = found.binary_search_by_key(&p, |(q, _)| *q) {
                    found[k].1.arr.word(p).fetch_and(!NOTIFYING, Release);
                }
            }
        }
        out.len()
    }

    /// Reads `runs` (locked) concurrently, fills and publishes them; unlocks
    /// whatever could not be brought in.
    fn fill_runs(&self, runs: &[Run], why: Why, out: &mut Vec<usize>) {
        let unlock = |r: &Run, from: usize| {
            for k in from..r.words.len() {
                r.arr.word(r.p + k).fetch_and(!BUSY, Release);
            }
        };
        BATCH_BUF.with(|b| {
            let mut b = b.borrow_mut();
            let buf = b.get_or_insert_with(|| PageBuf::new(BATCH_PAGES));
            // One disjoint piece of the buffer per run, in run order.
            let mut rest = buf.as_mut_slice();
            let mut ops: Vec<IoOp> = Vec::with_capacity(runs.len());
            for r in runs {
                let (piece, tail) = std::mem::take(&mut rest).split_at_mut(r.words.len() * PAGE);
                ops.push(IoOp::read(piece, SwapDevice::off(r.slot)));
                rest = tail;
            }
            // Slots of BUSY swapped pages cannot be freed or reused.
            self.swap.run_batch(&mut ops, false);
            if runs.len() > 1 {
                self.stats
                    .c
                    .batched_swap_reads
                    .fetch_add(runs.len() as u64, Relaxed);
            }
            let mut filled = 0;
            for (r, op) in runs.iter().zip(&ops) {
                let n = r.words.len();
                let addr = r.p << PAGE_SHIFT;
                if let Err(e) = &op.res {
                    tracing::error!(addr, slot = r.slot, n, %e, "swap read of a batch run failed");
                    unlock(r, 0);
                    continue;
                }
                let src = op.ptr as *const u8;
                // SAFETY: `src` is n readable pages of our buffer, just read;
                // the destination pages are registered with our uffd and are
                // only filled if missing.
                let copied = match unsafe { self.uffd.copy(addr, src, n * PAGE, true) } {
                    Ok(()) => n,
                    Err(e) => (e.done as usize / PAGE).min(n),
                };
                for (k, &v) in r.words.iter().enumerate().take(copied) {
                    self.publish_filled(r.arr.word(r.p + k), v, why, Brought::Swap);
                    out.push(r.p + k);
                }
                // Pages the ioctl did not fill (EEXIST, EAGAIN, a vanished
                // mapping): the page-at-a-time path sorts each of them out.
                unlock(r, copied);
                filled += copied;
            }
            if filled > 0 {
                self.check_budget();
            }
        });
    }
}
