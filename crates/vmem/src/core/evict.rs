//! Eviction: choosing victims (CLOCK over all managed pages, or an explicit
//! range), notifying listeners, moving pages atomically out of the
//! application's mapping (UFFDIO_MOVE into a staging area), batched write-out
//! to swap, and the background evictor thread that enforces the budget.
//!
//! Race-freedom: a victim is first marked EVICTING (a pin arriving now aborts
//! it), listeners run, then it is locked BUSY (pins wait) and moved out with
//! UFFDIO_MOVE, which unmaps it atomically: a concurrent application write
//! either lands before the move (and is captured) or faults and waits on BUSY
//! until the page is in swap, then is served from swap.

use super::{EvictState, Inner};
use crate::error::{Error, Result};
use crate::mm::{self, PAGE, PAGE_SHIFT};
use crate::state::{
    self, PageArray, BUSY, EVICTING, NOEVICT, NOTIFYING, REF, RESIDENT, SWAPPED, UNTOUCHED,
};
use crate::stats::inc;
use crate::swap::{Slot, SwapDevice};
use crate::swap_io::IoOp;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Out {
    Moved,
    Hole,
    /// Not moved this time (stays resident).
    Failed,
    /// Not movable at all (stays resident, marked NOEVICT).
    Refused,
}

type Victim = (Arc<PageArray>, usize);

/// Marks a resident, unpinned, idle page EVICTING; `clock` gives referenced
/// pages a second chance. Returns whether it became a victim.
fn try_mark(arr: &PageArray, p: usize, clock: bool) -> bool {
    let w = arr.word(p);
    let v = w.load(Acquire);
    if state::kind(v) != RESIDENT
        || v & (BUSY | EVICTING | NOEVICT | NOTIFYING) != 0
        || state::pins(v) != 0
    {
        return false;
    }
    if clock && v & REF != 0 {
        let _ = w.compare_exchange(v, v & !REF, AcqRel, Acquire);
        return false;
    }
    w.compare_exchange(v, v | EVICTING, AcqRel, Acquire).is_ok()
}

fn clear_evicting(arr: &PageArray, p: usize) {
    arr.word(p).fetch_and(!EVICTING, Release);
}

impl Inner {
    /// Evicts the resident, unpinned pages of `[p0, p1)`; returns how many went
    /// to swap.
    pub fn swap_out_range(&self, p0: usize, p1: usize) -> Result<usize> {
        let segs = self.segments_for(p0, p1)?;
        let mut st = self.evict.lock();
        let cap = st.cap;
        let mut total = 0;
        let mut batch: Vec<Victim> = Vec::with_capacity(cap);
        for s in segs.iter().filter(|s| !s.arr.external) {
            for p in s.start.max(p0)..s.end.min(p1) {
                if try_mark(&s.arr, p, false) {
                    batch.push((s.arr.clone(), p));
                    if batch.len() == cap {
                        total += self.evict_batch(&mut st, &mut batch, false)?;
                    }
                }
            }
        }
        total += self.evict_batch(&mut st, &mut batch, false)?;
        Ok(total)
    }

    /// CLOCK reclaim of up to `want` pages; returns how many were swapped out.
    pub fn reclaim(&self, want: usize) -> Result<usize> {
        let segs: Vec<_> = self
            .space
            .read()
            .all()
            .filter(|s| !s.arr.external)
            .cloned()
            .collect();
        let total_pages: usize = segs.iter().map(|s| s.end - s.start).sum();
        if segs.is_empty() || want == 0 {
            return Ok(0);
        }
        let mut st = self.evict.lock();
        let cap = st.cap;
        let mut done = 0;
        let mut batch: Vec<Victim> = Vec::with_capacity(cap);
        // Start at the segment holding the hand (or the next one).
        let mut si = segs.iter().position(|s| s.end > st.hand).unwrap_or(0);
        let mut p = st.hand.max(segs[si].start);
        let mut scanned = 0;
        while scanned < 2 * total_pages && done + batch.len() < want {
            if p >= segs[si].end {
                si = (si + 1) % segs.len();
                p = segs[si].start;
            }
            if try_mark(&segs[si].arr, p, true) {
                batch.push((segs[si].arr.clone(), p));
                if batch.len() == cap || done + batch.len() >= want {
                    self.spare_young(&mut batch);
                    if batch.len() == cap || done + batch.len() >= want {
                        st.hand = p + 1;
                        done += self.evict_batch(&mut st, &mut batch, true)?;
                        self.room_made(false);
                    }
                }
            }
            p += 1;
            scanned += 1;
        }
        st.hand = p;
        self.spare_young(&mut batch);
        done += self.evict_batch(&mut st, &mut batch, true)?;
        inc(&self.stats.c.evict_runs);
        self.room_made(false);
        Ok(done)
    }

    /// The second chance of pages referenced through a secondary MMU: asks
    /// the listeners which victims of `batch` are young (accessed by their
    /// device since last asked), unmarks those and drops them from the batch.
    fn spare_young(&self, batch: &mut Vec<Victim>) {
        if batch.is_empty() {
            return;
        }
        let addrs: Vec<usize> = batch.iter().map(|(_, p)| p << PAGE_SHIFT).collect();
        let Some(young) = self.listeners.test_and_clear_young(&addrs) else {
            return;
        };
        let mut k = 0;
        let mut spared = 0;
        batch.retain(|(arr, p)| {
            let y = young[k];
            k += 1;
            if y {
                clear_evicting(arr, *p);
                spared += 1;
            }
            !y
        });
        self.stats.c.young_spared.fetch_add(spared, Relaxed);
    }

    /// Evicts the EVICTING-marked victims in `batch` (address order), emptying
    /// it. Returns how many pages went to swap.
    /// The swap device could not take a batch (or all of it): counted, and
    /// the first time logged as an error — the budget no longer holds (Linux
    /// would be out of memory here); later events only warn.
    fn report_swap_full(&self, pages: usize) {
        let n = self.stats.c.swap_full.fetch_add(1, Relaxed);
        let (used, total) = (self.swap.used(), self.swap.slots());
        if n == 0 {
            tracing::error!(
                pages,
                used,
                total,
                "swap device full: resident memory exceeds the budget (pages stay resident)"
            );
        } else {
            tracing::warn!(pages, used, total, "swap full; pages stay resident");
        }
    }

    /// Evict `batch`. `partial`: on a nearly full swap device, evict what
    /// fits (budget reclaim); otherwise all or nothing (an explicit
    /// `swap_out` fails whole with [`Error::SwapFull`]).
    fn evict_batch(
        &self,
        st: &mut EvictState,
        batch: &mut Vec<Victim>,
        partial: bool,
    ) -> Result<usize> {
        if batch.is_empty() {
            return Ok(0);
        }
        let mut victims = std::mem::take(batch);
        // 0. Swap slots first. A nearly full device takes what fits (the rest
        // stays resident, reported below); then all or nothing: on a full
        // swap device every page stays resident and no listener hears of it.
        let free = self.swap.slots().saturating_sub(self.swap.used());
        let short = partial && free < victims.len();
        if short && free > 0 {
            for (arr, p) in victims.drain(free..) {
                clear_evicting(&arr, p);
            }
        }
        let mut slots: Vec<Slot> = Vec::with_capacity(victims.len());
        let alloc = if short && free == 0 {
            Err(Error::SwapFull(self.swap.slots()))
        } else {
            self.swap.alloc(victims.len(), &mut slots)
        };
        if partial && (short || alloc.is_err()) {
            self.report_swap_full(victims.len());
        }
        if let Err(e) = alloc {
            for (arr, p) in &victims {
                clear_evicting(arr, *p);
            }
            return Err(e);
        }
        // 1. Listeners (MMU-notifier role), with no lock the fault path needs.
        // One that cannot stop reaching the pages keeps the whole batch
        // resident (a device may still be using them).
        let addrs: Vec<usize> = victims.iter().map(|(_, p)| p << PAGE_SHIFT).collect();
        if !self.listeners.before_swap_out(&addrs) {
            inc(&self.stats.c.evict_vetoes);
            for s in slots.drain(..) {
                self.swap.free(s);
            }
            let mut stay = Vec::with_capacity(victims.len());
            for (arr, p) in &victims {
                clear_evicting(arr, *p);
                stay.push(p << PAGE_SHIFT);
            }
            if self.cfg.eager_swap_in_notify {
                self.listeners.after_swap_in(&stay);
            }
            return Ok(0);
        }
        // 2. Lock: EVICTING -> BUSY unless a pin (or unmap) got there first.
        let mut locked: Vec<Victim> = Vec::with_capacity(victims.len());
        let mut aborted = Vec::new();
        for (arr, p) in victims {
            let w = arr.word(p);
            loop {
                let v = state::wait_not_busy(w);
                if state::kind(v) != RESIDENT || state::pins(v) > 0 || v & EVICTING == 0 {
                    clear_evicting(&arr, p);
                    inc(&self.stats.c.evict_aborts);
                    if state::kind(v) == RESIDENT {
                        aborted.push(p << PAGE_SHIFT);
                    }
                    break;
                }
                if w.compare_exchange(v, (v & !EVICTING) | BUSY, AcqRel, Acquire)
                    .is_ok()
                {
                    locked.push((arr.clone(), p));
                    break;
                }
            }
        }
        if self.cfg.eager_swap_in_notify {
            self.listeners.after_swap_in(&aborted);
        }
        let n = locked.len();
        for s in slots.drain(n..) {
            self.swap.free(s);
        }
        if locked.is_empty() {
            return Ok(0);
        }
        // 4. Atomically move the pages out of the application's mapping.
        let mut out = vec![Out::Failed; n];
        let mut i = 0;
        while i < n {
            let mut j = i + 1;
            while j < n
                && locked[j].1 == locked[j - 1].1 + 1
                && Arc::ptr_eq(&locked[j].0, &locked[i].0)
            {
                j += 1;
            }
            self.move_run(st, &locked, i, j, &mut out);
            i = j;
        }
        // 5. Write the staged pages to their slots (runs of consecutive
        // slots; several runs are written concurrently).
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < n {
            if out[i] != Out::Moved {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < n && out[j] == Out::Moved && slots[j] == slots[j - 1] + 1 {
                j += 1;
            }
            runs.push((i, j));
            i = j;
        }
        let mut ops: Vec<IoOp> = runs
            .iter()
            .map(|&(i, j)| {
                // SAFETY: staging pages i..j hold pages we just moved in; only
                // the evictor (serialised by the evict lock) touches the
                // staging area, and it is page-aligned (our own mapping).
                let data = unsafe {
                    std::slice::from_raw_parts((st.staging + i * PAGE) as *const u8, (j - i) * PAGE)
                };
                IoOp::write(data, SwapDevice::off(slots[i]))
            })
            .collect();
        self.swap.run_batch(&mut ops, true);
        if runs.len() > 1 {
            self.stats
                .c
                .batched_swap_writes
                .fetch_add(runs.len() as u64, Relaxed);
        }
        for (&(i, j), op) in runs.iter().zip(&ops) {
            if let Err(e) = &op.res {
                // One line, then a count (at each power of two): a full or
                // failing device fails every batch.
                let n = self.stats.c.swap_write_failures.fetch_add(1, Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::error!(%e, failures = n, "swap write failed; pages stay resident (logged at each power of two)");
                }
                for k in i..j {
                    self.put_back(locked[k].1 << PAGE_SHIFT, st.staging + k * PAGE);
                    out[k] = Out::Failed;
                }
            }
        }
        // 6. Publish the new states.
        let mut moved = 0;
        let mut stayed = Vec::new();
        for (k, (arr, p)) in locked.iter().enumerate() {
            let w = arr.word(*p);
            match out[k] {
                Out::Moved => {
                    let s = Some(slots[k]);
                    let _ = state::update(w, |cur| {
                        Some(state::with_slot(state::with_kind(cur, SWAPPED), s) & !(BUSY | REF))
                    });
                    moved += 1;
                }
                Out::Hole => {
                    self.swap.free(slots[k]);
                    let _ = state::update(w, |cur| {
                        Some(state::with_kind(cur, UNTOUCHED) & !(BUSY | REF))
                    });
                }
                Out::Failed | Out::Refused => {
                    self.swap.free(slots[k]);
                    inc(&self.stats.c.evict_failures);
                    let keep = if out[k] == Out::Refused { NOEVICT } else { 0 };
                    let _ = state::update(w, |cur| Some((cur & !BUSY) | keep));
                    stayed.push(*p << PAGE_SHIFT);
                }
            }
        }
        if self.cfg.eager_swap_in_notify {
            self.listeners.after_swap_in(&stayed);
        }
        let left = out
            .iter()
            .filter(|o| matches!(o, Out::Moved | Out::Hole))
            .count();
        self.resident.fetch_sub(left, Relaxed);
        self.stats.c.swap_outs.fetch_add(moved as u64, Relaxed);
        // 7. Empty the staging area for the next batch.
        use rustix::mm::Advice::LinuxDontNeed;
        // SAFETY: the staging area is ours; its contents are now in swap.
        if let Err(e) = unsafe { mm::madvise(st.staging, n * PAGE, LinuxDontNeed) } {
            tracing::error!(%e, "madvise(staging) failed");
        }
        Ok(moved)
    }

    /// Returns a staged page to its place after a failed swap write: move it
    /// back, or failing that copy it back.
    fn put_back(&self, addr: usize, staged: usize) {
        for attempt in 0..100 {
            match self.uffd.mv(addr, staged, PAGE, true) {
                Ok(()) => return,
                Err(e) if e.err.raw_os_error() == Some(libc::EAGAIN) => {}
                Err(_) => {
                    // SAFETY: the staged page is mapped and readable.
                    match unsafe { self.uffd.copy(addr, staged as *const u8, PAGE, true) } {
                        Ok(()) => return,
                        Err(e) if e.err.raw_os_error() == Some(libc::EAGAIN) => {}
                        Err(e) => {
                            tracing::error!(addr, err = %e.err, "page contents lost: cannot put the page back");
                            return;
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(10 << (attempt / 10).min(6)));
        }
        tracing::error!(
            addr,
            "page contents lost: kernel kept refusing to put the page back"
        );
    }

    /// Moves locked pages `i..j` (consecutive addresses) to staging `i..j`.
    fn move_run(&self, st: &EvictState, locked: &[Victim], i: usize, j: usize, out: &mut [Out]) {
        let mut k = i;
        let mut single = false;
        // The page (index) made exclusive once already: a second refusal stands.
        let mut unshared = usize::MAX;
        while k < j {
            let len = if single { 1 } else { j - k };
            let src = locked[k].1 << PAGE_SHIFT;
            match self.uffd.mv(st.staging + k * PAGE, src, len * PAGE, false) {
                Ok(()) => {
                    out[k..k + len].fill(Out::Moved);
                    k += len;
                    single = false;
                }
                Err(e) => {
                    let d = (e.done as usize) / PAGE;
                    out[k..k + d].fill(Out::Moved);
                    k += d;
                    if !single && len - d > 1 {
                        // Retry the failing page alone (e.g. runs spanning VMAs).
                        single = true;
                        continue;
                    }
                    let busy_page = src + d * PAGE;
                    if e.err.raw_os_error() == Some(libc::EBUSY) && unshared != k {
                        // A page the kernel no longer holds exclusive to us: since a
                        // fork() it is (or was) shared with the child, and only a write
                        // fault makes it ours again (a copy, if the child still maps
                        // it): one without writing, then move it again.
                        unshared = k;
                        if mm::unshare(busy_page).is_ok() {
                            single = true;
                            continue;
                        }
                    }
                    out[k] = match e.err.raw_os_error() {
                        // No page there: the application dropped it (or unmapped it).
                        Some(libc::ENOENT) => Out::Hole,
                        // Incompatible mapping (mlocked, other protection, shared).
                        Some(libc::EINVAL) => {
                            tracing::debug!(
                                addr = src + d * PAGE,
                                "page cannot be moved; no longer evicted"
                            );
                            Out::Refused
                        }
                        _ => {
                            tracing::debug!(addr = src + d * PAGE, err = %e.err, "UFFDIO_MOVE refused");
                            Out::Failed
                        }
                    };
                    k += 1;
                    single = false;
                }
            }
        }
    }

    /// Body of the background evictor thread.
    pub fn evictor_loop(self: &Arc<Self>) {
        loop {
            {
                let mut k = self.kick.lock();
                while !*k && !self.shutdown.load(Acquire) {
                    self.evictor_idle.store(true, Release);
                    if self.resident.load(Relaxed) > self.budget.load(Relaxed) {
                        break;
                    }
                    self.kick_cv.wait_for(&mut k, Duration::from_millis(200));
                }
                *k = false;
                self.evictor_idle.store(false, Release);
            }
            if self.shutdown.load(Acquire) {
                return;
            }
            self.enforce_budget();
        }
    }

    /// Reclaims until resident <= budget - slack (or nothing is evictable).
    pub fn enforce_budget(&self) {
        loop {
            let budget = self.budget.load(Relaxed);
            let r = self.resident.load(Relaxed);
            if r <= budget {
                return;
            }
            let slack = (budget / 32).clamp(1, self.cfg.evict_batch);
            match self.reclaim(r - budget + slack) {
                Ok(0) => {
                    // Everything is pinned or busy: page-ins waiting for room
                    // go on (what pins keep resident is their holders' to
                    // bound); retry shortly rather than spin.
                    self.room_made(true);
                    std::thread::sleep(Duration::from_millis(1));
                    if self.shutdown.load(Acquire) {
                        return;
                    }
                    return;
                }
                Ok(_) => {}
                Err(Error::SwapFull(_)) => {
                    // Back off: pages stay resident until slots free up
                    // (nothing can be evicted: waiting page-ins go on).
                    self.room_made(true);
                    std::thread::sleep(Duration::from_millis(100));
                    return;
                }
                Err(e) => {
                    tracing::error!(%e, "reclaim failed");
                    return;
                }
            }
        }
    }
}
