//! Bringing pages in (fault thread, `pin`, `prefetch`) and pin counts: the
//! non-resident → resident transitions of the page state words.

use super::{kernel, page_range, AbsentWrite, Brought, Inner, Why, BOUNCE};
use crate::error::{Error, Result};
use crate::mm::{self, PageBuf, PAGE, PAGE_SHIFT};
use crate::state::{
    self, PageArray, BUSY, EVICTING, GONE, MAX_PINS, NOTIFYING, PIN_ONE, REF, RESIDENT, SWAPPED,
};
use crate::stats::inc;
use std::sync::atomic::Ordering::*;

/// One more pin on the page of word `w` if it is resident, idle and below
/// the pin limit (what [`Inner::bring_in`] does for a resident page, without
/// its waits and retries); `false` leaves everything to the slow path.
#[inline]
fn pin_resident(w: &std::sync::atomic::AtomicU64) -> bool {
    let v = w.load(Acquire);
    state::kind(v) == RESIDENT
        && v & BUSY == 0
        && state::pins(v) < MAX_PINS
        && w.compare_exchange(v, ((v + PIN_ONE) | REF) & !EVICTING, AcqRel, Acquire)
            .is_ok()
}

impl Inner {
    /// Brings page `p` in (or pins it if resident). `buf` is a one-page bounce
    /// buffer for swap reads. Runs in the calling thread; never takes a fault.
    pub fn bring_in(
        &self,
        arr: &PageArray,
        p: usize,
        why: Why,
        buf: &mut PageBuf,
    ) -> Result<Brought> {
        let w = arr.word(p);
        let addr = p << PAGE_SHIFT;
        loop {
            let v = state::wait_not_busy(w);
            match state::kind(v) {
                RESIDENT => match why {
                    Why::Prefetch => return Ok(Brought::Already),
                    Why::Pin { .. } => {
                        // Clearing EVICTING cancels an eviction whose listeners
                        // already ran: whoever pinned may re-establish access
                        // (e.g. a NIC mapping) even if it unpins before the
                        // evictor gets to this page.
                        if state::pins(v) >= MAX_PINS {
                            return Err(Error::PinOverflow(addr));
                        }
                        if w.compare_exchange(v, ((v + PIN_ONE) | REF) & !EVICTING, AcqRel, Acquire)
                            .is_ok()
                        {
                            return Ok(Brought::Already);
                        }
                    }
                    Why::Fault { .. } => {
                        if arr.external {
                            return Ok(Brought::Already);
                        }
                        // Spurious, or the application dropped the page itself:
                        // a zero page fills a hole and is refused if present.
                        if w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_err() {
                            continue;
                        }
                        let r = self.uffd.zeropage(addr, PAGE, false);
                        w.fetch_and(!BUSY, Release);
                        return match r {
                            Ok(()) => {
                                inc(&self.stats.c.minor_faults);
                                let _ = self.uffd.wake(addr, PAGE);
                                Ok(Brought::Hole)
                            }
                            Err(e) if e.err.raw_os_error() == Some(libc::EEXIST) => {
                                inc(&self.stats.c.spurious_faults);
                                let _ = self.uffd.wake(addr, PAGE);
                                Ok(Brought::Already)
                            }
                            Err(e) if e.err.raw_os_error() == Some(libc::ENOENT) => {
                                Err(Error::Unmapped(addr))
                            }
                            Err(e) if e.err.raw_os_error() == Some(libc::EAGAIN) => {
                                Err(Error::Retry)
                            }
                            Err(e) => Err(kernel("UFFDIO_ZEROPAGE", addr, e.err)),
                        };
                    }
                },
                // UNTOUCHED, SWAPPED, and GONE (unmapped by the application).
                // A *fault* on a GONE page proves the mapping is registered
                // with our uffd again (faults go to the VMA's own uffd), so
                // it is managed again. A fill ioctl proves nothing (the
                // kernel accepts a VMA registered with any uffd), so pin and
                // prefetch never revive a GONE page.
                _ => {
                    if state::kind(v) == GONE && !matches!(why, Why::Fault { .. }) {
                        return Err(Error::Unmapped(addr));
                    }
                    if arr.external {
                        return Err(Error::ExternalNotResident(addr));
                    }
                    if w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_err() {
                        continue;
                    }
                    return self.fill_locked(arr, p, v, why, buf);
                }
            }
        }
    }

    /// [`Self::bring_in`] for callers that may wait: retries the transient
    /// [`Error::Retry`] (released page lock, short sleeps) for up to 10 s.
    fn bring_in_wait(
        &self,
        arr: &PageArray,
        p: usize,
        why: Why,
        buf: &mut PageBuf,
    ) -> Result<Brought> {
        let t = std::time::Instant::now();
        loop {
            match self.bring_in(arr, p, why, buf) {
                Err(Error::Retry) if t.elapsed() < std::time::Duration::from_secs(10) => {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                r => return r,
            }
        }
    }

    /// Fills a non-resident page whose BUSY bit we hold (`v` = word before).
    fn fill_locked(
        &self,
        arr: &PageArray,
        p: usize,
        v: u64,
        why: Why,
        buf: &mut PageBuf,
    ) -> Result<Brought> {
        let w = arr.word(p);
        let addr = p << PAGE_SHIFT;
        let swapped = state::kind(v) == SWAPPED;
        // A faulting thread is woken only after the state and counters are
        // published, so it never observes its page as non-resident.
        let is_fault = matches!(why, Why::Fault { .. });
        let wake = !is_fault;
        let res = if swapped {
            let slot = state::slot(v).expect("swapped page has a slot");
            if let Err(e) = self.swap.read(slot, buf.as_mut_slice()) {
                w.fetch_and(!BUSY, Release);
                tracing::error!(addr, slot, %e, "swap read failed");
                return Err(Error::SwapIo(e));
            }
            // SAFETY: buf is one readable page.
            unsafe { self.uffd.copy(addr, buf.as_ptr(), PAGE, wake) }
        } else if why.reads_only() {
            self.uffd.zeropage(addr, PAGE, wake)
        } else {
            // SAFETY: self.zero is one readable page of zeroes.
            unsafe { self.uffd.copy(addr, self.zero.as_ptr(), PAGE, wake) }
        };
        let outcome = match res {
            Ok(()) => {
                if swapped {
                    Brought::Swap
                } else {
                    Brought::Zero
                }
            }
            Err(e) if e.err.raw_os_error() == Some(libc::EEXIST) => {
                // Present although recorded absent (memory the kernel holds
                // itself, e.g. its own swap entry): make sure it is populated.
                // SAFETY: the pte is not empty, so this read cannot raise a
                // userfault; the page belongs to a registered mapping.
                unsafe { mm::touch_read(addr, PAGE) };
                let _ = self.uffd.wake(addr, PAGE);
                Brought::Already
            }
            Err(e) => {
                let gone = matches!(e.err.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH));
                if gone {
                    self.release_gone(w, v);
                    return Err(Error::Unmapped(addr));
                }
                w.fetch_and(!BUSY, Release);
                if e.err.raw_os_error() == Some(libc::EAGAIN) {
                    return Err(Error::Retry);
                }
                return Err(kernel(
                    if swapped {
                        "UFFDIO_COPY"
                    } else {
                        "UFFDIO_ZEROPAGE/COPY"
                    },
                    addr,
                    e.err,
                ));
            }
        };
        self.publish_filled(w, v, why, outcome);
        if is_fault {
            let _ = self.uffd.wake(addr, PAGE);
        }
        self.check_budget();
        Ok(outcome)
    }

    /// Publishes a page we filled (its BUSY bit held, `v` = word before):
    /// resident (+ a pin for `Why::Pin`), BUSY and EVICTING cleared, its swap
    /// slot freed, counters. The caller wakes faulting threads and checks the
    /// budget.
    pub(crate) fn publish_filled(
        &self,
        w: &std::sync::atomic::AtomicU64,
        v: u64,
        why: Why,
        outcome: Brought,
    ) {
        let swapped = state::kind(v) == SWAPPED;
        let is_fault = matches!(why, Why::Fault { .. });
        let add_pin = if why.is_pin() { PIN_ONE } else { 0 };
        // Pinned pages cannot be evicted before their notification anyway;
        // the caller clears NOTIFYING after notifying (outcomes Zero/Swap).
        let notifying = if self.cfg.eager_swap_in_notify
            && !why.is_pin()
            && matches!(outcome, Brought::Zero | Brought::Swap)
        {
            NOTIFYING
        } else {
            0
        };
        if let Some(s) = state::slot(v) {
            self.swap.free(s);
        }
        let _ = state::update(w, |cur| {
            let resident = state::with_slot(state::with_kind(cur, RESIDENT), None) | REF;
            Some(((resident + add_pin) & !(BUSY | EVICTING)) | notifying)
        });
        // Every path here turns a non-resident page resident.
        let r = self.resident.fetch_add(1, Relaxed) + 1;
        self.resident_high.fetch_max(r, Relaxed);
        if swapped && outcome == Brought::Swap {
            inc(&self.stats.c.swap_ins);
            if why.is_pin() {
                inc(&self.stats.c.pin_swap_ins);
            }
        } else if outcome == Brought::Zero && !is_fault {
            inc(&self.stats.c.zero_fills);
        }
        if is_fault {
            inc(match outcome {
                Brought::Swap => &self.stats.c.major_faults,
                Brought::Already => &self.stats.c.spurious_faults,
                _ => &self.stats.c.minor_faults,
            });
        }
    }

    /// Marks a BUSY page whose mapping vanished as GONE (releasing its slot).
    fn release_gone(&self, w: &std::sync::atomic::AtomicU64, v: u64) {
        if let Some(s) = state::slot(v) {
            self.swap.free(s);
        }
        let _ = state::update(w, |cur| {
            Some(state::with_slot(state::with_kind(cur, GONE), None) & !BUSY)
        });
    }

    /// How many pages of `[p0, p1)` in `segs` are not resident (what a pin
    /// or prefetch of the range may bring in, for [`Inner::admit`]).
    fn absent_pages(&self, segs: &super::Segs, p0: usize, p1: usize) -> usize {
        if self.admit_limit().is_none() {
            return 0;
        }
        segs.iter()
            .filter(|s| !s.arr.external)
            .map(|s| {
                (s.start.max(p0)..s.end.min(p1))
                    .filter(|&p| state::kind(s.arr.word(p).load(Relaxed)) != RESIDENT)
                    .count()
            })
            .sum()
    }

    /// Runs `f` with this thread's bounce buffer.
    fn with_bounce<R>(f: impl FnOnce(&mut PageBuf) -> R) -> R {
        BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            f(b.get_or_insert_with(|| PageBuf::new(1)))
        })
    }

    /// Pins `[addr, addr+len)`; `write: false` when the pinned memory is
    /// only read (never-touched pages then map the zero page).
    pub fn pin(&self, addr: usize, len: usize, write: bool) -> Result<()> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let _room = self.admit(self.absent_pages(&segs, p0, p1));
        // No allocation on the common path (a fault's pin of a few pages):
        // a failure rolls back the first `pinned` pages of the same walk,
        // and the pages the concurrent swap-in pinned ahead of the walk.
        let notify = self.cfg.eager_swap_in_notify;
        let mut swapped_in = Vec::new();
        let mut pinned = 0usize;
        // Pages pinned by `swap_in_batch` (ascending: segments are disjoint
        // and walked in order).
        let mut ahead: Vec<usize> = Vec::new();
        let r = Self::with_bounce(|buf| -> Result<()> {
            let mut next_ahead = 0;
            for s in &segs {
                let end = s.end.min(p1);
                let mut p = s.start.max(p0);
                if end - p >= 2 {
                    // Several swapped pages: read them all at once.
                    self.swap_in_batch(&s.arr, p, end, Why::Pin { write }, &mut ahead);
                }
                while p < end {
                    if ahead.get(next_ahead) == Some(&p) {
                        next_ahead += 1;
                        pinned += 1;
                        if notify {
                            swapped_in.push(p << PAGE_SHIFT);
                        }
                        p += 1;
                        continue;
                    }
                    if pin_resident(s.arr.word(p)) {
                        // The common case of a range pin: one CAS.
                        pinned += 1;
                        p += 1;
                        continue;
                    }
                    // Runs of non-resident pages: one read + one ioctl each.
                    let n = self.pin_run(&s.arr, p, end, write, |q| {
                        if notify {
                            swapped_in.push(q << PAGE_SHIFT);
                        }
                    })?;
                    if n > 0 {
                        pinned += n;
                        p += n;
                        continue;
                    }
                    let b = self.bring_in_wait(&s.arr, p, Why::Pin { write }, buf)?;
                    pinned += 1;
                    if notify && b != Brought::Already {
                        swapped_in.push(p << PAGE_SHIFT);
                    }
                    p += 1;
                }
            }
            Ok(())
        });
        if let Err(e) = r {
            let walk = segs
                .iter()
                .flat_map(|s| (s.start.max(p0)..s.end.min(p1)).map(move |p| (s, p)));
            for (k, (s, p)) in walk.enumerate() {
                if k < pinned || ahead.binary_search(&p).is_ok() {
                    let _ = state::update(s.arr.word(p), |cur| {
                        (state::pins(cur) > 0).then(|| cur - PIN_ONE)
                    });
                }
            }
            return Err(e);
        }
        if notify {
            self.listeners.after_swap_in(&swapped_in);
        }
        Ok(())
    }

    /// Copies `out.len()` bytes at `addr` (within one page) out of the swap
    /// slot of a page the pager holds swapped out, without bringing it in.
    /// `Ok(false)`: the page is not (or not stably) swapped out here, or
    /// external — nothing copied. The page's transition lock is held for
    /// the read, so its slot cannot be freed and reused meanwhile; a
    /// swapped-out page's content cannot change, so the bytes are its
    /// content at that moment.
    pub fn read_swapped(&self, addr: usize, out: &mut [u8]) -> Result<bool> {
        let off = addr & (PAGE - 1);
        if out.is_empty() || off + out.len() > PAGE {
            return Ok(false);
        }
        let p = addr >> PAGE_SHIFT;
        let segs = self.segments_for(p, p + 1)?;
        let Some(s) = segs.first() else {
            return Ok(false);
        };
        if s.arr.external {
            return Ok(false);
        }
        let w = s.arr.word(p);
        let v = w.load(Acquire);
        if state::kind(v) != SWAPPED || v & BUSY != 0 {
            return Ok(false);
        }
        if w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_err() {
            return Ok(false);
        }
        let Some(slot) = state::slot(v) else {
            w.fetch_and(!BUSY, Release);
            return Ok(false);
        };
        let r = Self::with_bounce(|buf| {
            let page = buf.as_mut_slice();
            // Kept in the swap cache: the page's swap-in usually follows.
            self.swap.read_keep(slot, page).map(|()| {
                out.copy_from_slice(&page[off..off + out.len()]);
            })
        });
        w.fetch_and(!BUSY, Release);
        r.map(|()| true).map_err(Error::SwapIo)
    }

    /// Writes `data` at `addr` (within one page) if that page is not
    /// resident: never touched, or (with `swapped_ok`) swapped out. The page
    /// is locked (BUSY), `announce` runs (the caller's answer to the writer,
    /// so it leaves before the page fill and any swap read), then the page is
    /// filled by one `UFFDIO_COPY` of zeroes (or its swap slot's contents)
    /// with `data` over them, and published resident and unpinned.
    /// Everything that could observe the page between `announce` and the
    /// fill waits on its BUSY bit (a CPU fault, a pin, a fill, the evictor)
    /// or sees it unmapped (the NIC's views map it only after), so the write
    /// is visible to whatever follows the answer.
    pub fn write_absent_then(
        &self,
        addr: usize,
        data: &[u8],
        swapped_ok: bool,
        announce: impl FnOnce(),
    ) -> Result<AbsentWrite> {
        let off = addr & (PAGE - 1);
        if data.is_empty() || off + data.len() > PAGE {
            return Ok(AbsentWrite::Skipped);
        }
        let p = addr >> PAGE_SHIFT;
        let segs = self.segments_for(p, p + 1)?;
        let Some(s) = segs.first() else {
            return Ok(AbsentWrite::Skipped);
        };
        // Room first: never wait for the evictor while holding the page lock.
        let _room = self.admit(self.absent_pages(&segs, p, p + 1));
        let w = s.arr.word(p);
        let v = w.load(Acquire);
        let kind = state::kind(v);
        let absent = kind == state::UNTOUCHED || (swapped_ok && kind == SWAPPED);
        if s.arr.external
            || !absent
            || v & BUSY != 0
            || w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_err()
        {
            return Ok(AbsentWrite::Skipped);
        }
        announce();
        let page = p << PAGE_SHIFT;
        let slot = state::slot(v).filter(|_| kind == SWAPPED);
        let r = Self::with_bounce(|buf| {
            let b = buf.as_mut_slice();
            match slot {
                Some(slot) => self.swap.read(slot, b).map_err(Error::SwapIo)?,
                None => b.fill(0),
            }
            b[off..off + data.len()].copy_from_slice(data);
            // SAFETY: `buf` is one readable page; the destination page is
            // registered with our uffd and only filled if missing.
            unsafe { self.uffd.copy(page, buf.as_ptr(), PAGE, true) }.map_err(|e| {
                match e.err.raw_os_error() {
                    Some(libc::ENOENT) | Some(libc::ESRCH) => Error::Unmapped(page),
                    _ => kernel("UFFDIO_COPY", page, e.err),
                }
            })
        });
        match r {
            Ok(()) => {
                let brought = if slot.is_some() {
                    Brought::Swap
                } else {
                    Brought::Zero
                };
                self.publish_filled(w, v, Why::Prefetch, brought);
                if self.cfg.eager_swap_in_notify {
                    self.listeners.after_swap_in(&[page]);
                    w.fetch_and(!NOTIFYING, Release);
                }
                self.check_budget();
                Ok(AbsentWrite::Written)
            }
            Err(e @ Error::Unmapped(_)) => {
                self.release_gone(w, v);
                Ok(AbsentWrite::Refused(e))
            }
            Err(e) => {
                if let Error::SwapIo(io) = &e {
                    tracing::error!(addr = page, ?slot, %io, "swap read failed under a write");
                }
                w.fetch_and(!BUSY, Release);
                Ok(AbsentWrite::Refused(e))
            }
        }
    }

    pub fn unpin(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let walk = || {
            segs.iter()
                .flat_map(|s| (s.start.max(p0)..s.end.min(p1)).map(move |p| (s, p)))
        };
        for (k, (s, p)) in walk().enumerate() {
            let w = s.arr.word(p);
            if state::update(w, |cur| (state::pins(cur) > 0).then(|| cur - PIN_ONE)).is_err() {
                for (s, q) in walk().take(k) {
                    let _ = state::update(s.arr.word(q), |cur| Some(cur + PIN_ONE));
                }
                return Err(Error::NotPinned(p << PAGE_SHIFT));
            }
        }
        Ok(())
    }

    pub fn prefetch(&self, addr: usize, len: usize) -> Result<usize> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let _room = self.admit(self.absent_pages(&segs, p0, p1));
        let mut brought: Vec<(&PageArray, usize)> = Vec::new();
        let r = Self::with_bounce(|buf| -> Result<()> {
            let mut ahead = Vec::new();
            for s in segs.iter().filter(|s| !s.arr.external) {
                let (a, b) = (s.start.max(p0), s.end.min(p1));
                if b - a >= 2 {
                    // Several swapped pages: read them all at once.
                    ahead.clear();
                    self.swap_in_batch(&s.arr, a, b, Why::Prefetch, &mut ahead);
                    brought.extend(ahead.iter().map(|&p| (&*s.arr, p)));
                }
                for p in a..b {
                    if self.bring_in_wait(&s.arr, p, Why::Prefetch, buf)? != Brought::Already {
                        brought.push((&s.arr, p));
                    }
                }
            }
            Ok(())
        });
        if self.cfg.eager_swap_in_notify {
            let addrs: Vec<usize> = brought.iter().map(|(_, p)| p << PAGE_SHIFT).collect();
            self.listeners.after_swap_in(&addrs);
            for (arr, p) in &brought {
                arr.word(*p).fetch_and(!NOTIFYING, Release);
            }
        }
        r.map(|()| brought.len())
    }
}
