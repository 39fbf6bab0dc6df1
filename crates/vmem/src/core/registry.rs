//! Registration: overlapping, reference-counted registrations of page ranges
//! with userfaultfd, retiring segments nobody references, and following the
//! application's munmap.

use super::{kernel, page_range, Inner, IS_HANDLER};
use crate::error::{Error, Result};
use crate::mm::{self, PageBuf, PAGE, PAGE_SHIFT};
use crate::space::{RegInfo, RegionId, Segment};
use crate::state::{self, PageArray, BUSY, GONE, NOEVICT, REF, RESIDENT, SWAPPED, UNTOUCHED};
use crate::uffd;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

impl Inner {
    /// Waits until the fault thread has handled every event it has read. The
    /// kernel lets munmap return once its UNMAP event is *read*; waiting for
    /// the handler's current cycle orders that event before a registration
    /// that reuses the addresses.
    pub(crate) fn quiesce_events(&self) {
        wait_handled(&self.handler_seq);
    }

    /// Registers `[addr, addr+len)` (whole pages). `scan`: read the current
    /// residency with mincore (foreign memory); otherwise all pages start
    /// never-touched.
    pub fn register(
        &self,
        addr: usize,
        len: usize,
        owned: bool,
        external: bool,
        scan: bool,
    ) -> Result<RegionId> {
        let (p0, p1) = page_range(addr, len)?;
        let base_addr = p0 << PAGE_SHIFT;
        let n = p1 - p0;
        let scanned = if scan || external {
            let mut v = vec![0u8; n];
            mm::mincore(base_addr, n * PAGE, &mut v).map_err(|e| match e.raw_os_error() {
                Some(libc::ENOMEM) => Error::NotMapped { addr, len },
                _ => kernel("mincore", addr, e),
            })?;
            Some(v)
        } else {
            None
        };
        self.quiesce_events();
        let res_at = |p: usize| external || scanned.as_ref().is_some_and(|v| v[p - p0] & 1 != 0);
        let build = |a: usize, b: usize| {
            let arr = PageArray::new(
                a,
                b - a,
                |i| {
                    if res_at(a + i) {
                        RESIDENT | REF
                    } else {
                        UNTOUCHED
                    }
                },
                external,
            );
            let resident = (a..b).filter(|&p| res_at(p)).count();
            (a, b, Arc::new(arr), resident)
        };
        // Build the state arrays of the new runs before taking the write lock
        // (many GiB = millions of words), so faults elsewhere do not stall;
        // rebuilt under the lock only if the gaps changed meanwhile.
        let prebuilt_gaps = self.space.read().gaps(p0, p1);
        let mut prebuilt: Vec<_> = prebuilt_gaps.iter().map(|&(a, b)| build(a, b)).collect();
        let mut sp = self.space.write();
        let existing = sp.overlapping(p0, p1);
        if existing.iter().any(|s| s.arr.external != external) {
            return Err(Error::OtherKind { addr, len });
        }
        // Runs that need a userfaultfd registration: gaps, and pages left GONE by
        // an earlier munmap whose address range was mapped again.
        let gaps = sp.gaps(p0, p1);
        let mut revive: Vec<(Arc<PageArray>, usize, usize)> = Vec::new();
        for s in &existing {
            let (a, b) = (s.start.max(p0), s.end.min(p1));
            let mut p = a;
            while p < b {
                if state::kind(s.arr.word(p).load(Acquire)) == GONE {
                    let q0 = p;
                    while p < b && state::kind(s.arr.word(p).load(Acquire)) == GONE {
                        p += 1;
                    }
                    revive.push((s.arr.clone(), q0, p));
                } else {
                    p += 1;
                }
            }
        }
        if !external {
            let runs: Vec<(usize, usize)> = gaps
                .iter()
                .copied()
                .chain(revive.iter().map(|r| (r.1, r.2)))
                .collect();
            for (i, &(a, b)) in runs.iter().enumerate() {
                let (start, n) = (a << PAGE_SHIFT, (b - a) * PAGE);
                let err = match self.uffd.register(start, n) {
                    Ok(ops) if ops & uffd::RANGE_MOVE != 0 => continue,
                    // hugetlbfs memory registers too, but the kernel offers no
                    // UFFDIO_MOVE there (nor 4 KiB fills): it is not paged.
                    Ok(_) => {
                        let _ = self.uffd.unregister(start, n);
                        Error::NotAnonymous { addr, len }
                    }
                    Err(e) => match e.raw_os_error() {
                        Some(libc::EINVAL) => Error::NotAnonymous { addr, len },
                        Some(libc::ENOMEM) => Error::NotMapped { addr, len },
                        _ => kernel("UFFDIO_REGISTER", start, e),
                    },
                };
                for &(a2, b2) in &runs[..i] {
                    let _ = self.uffd.unregister(a2 << PAGE_SHIFT, (b2 - a2) * PAGE);
                }
                return Err(err);
            }
        }
        let mut resident = 0;
        for (arr, a, b) in &revive {
            for p in *a..*b {
                let r = res_at(p);
                resident += r as usize;
                let _ = state::update(arr.word(p), |cur| {
                    (state::kind(cur) == GONE)
                        .then(|| state::with_kind(cur, if r { RESIDENT } else { UNTOUCHED }))
                });
            }
        }
        sp.split_at(p0);
        sp.split_at(p1);
        let _ = sp.add_refs(p0, p1, 1);
        let mut new_pages = 0;
        if gaps != prebuilt_gaps {
            prebuilt = gaps.iter().map(|&(a, b)| build(a, b)).collect();
        }
        for (a, b, arr, res) in prebuilt {
            resident += res;
            new_pages += b - a;
            sp.insert(Segment {
                start: a,
                end: b,
                arr,
                refs: 1,
            });
        }
        if scan && !external {
            // A page only partly covered by foreign memory also holds other
            // heap data (malloc headers, neighbours, possibly the pager's own
            // structures, which its fault thread must never fault on): it is
            // managed and pinnable but never evicted.
            let end = addr + len;
            for (edge, partial) in [(p0, addr % PAGE != 0), (p1 - 1, end % PAGE != 0)] {
                if partial {
                    if let Some(s) = sp.lookup(edge) {
                        s.arr.word(edge).fetch_or(NOEVICT, AcqRel);
                    }
                }
            }
        }
        let id = sp.new_id();
        sp.regs.insert(id, RegInfo { p0, p1, owned });
        drop(sp);
        if !external {
            self.registered.fetch_add(new_pages, Relaxed);
            let r = self.resident.fetch_add(resident, Relaxed) + resident;
            self.resident_high.fetch_max(r, Relaxed);
            if let Some(r) = &self.reserve {
                r.kick();
            }
            if self.resident.load(Relaxed) > self.budget.load(Relaxed)
                && self.cfg.background_evictor
            {
                self.kick_evictor();
            }
        }
        tracing::debug!(addr, len, ?id, owned, external, "registered");
        Ok(id)
    }

    pub fn unregister(&self, id: RegionId) -> Result<()> {
        let (info, dead) = {
            let mut sp = self.space.write();
            let info = sp
                .regs
                .remove(&id)
                .ok_or(Error::AlreadyUnregistered(id.0 as usize))?;
            sp.split_at(info.p0);
            sp.split_at(info.p1);
            let dead = sp.add_refs(info.p0, info.p1, -1);
            (info, dead)
        };
        for s in dead {
            self.retire(&s, info.owned);
        }
        tracing::debug!(?id, "unregistered");
        Ok(())
    }

    /// Takes a segment no registration references any more out of management:
    /// foreign memory gets its swapped pages back, the pager's own mapping is
    /// discarded; slots are freed; the range is unregistered (and unmapped if
    /// the pager created it).
    fn retire(&self, s: &Segment, owned: bool) {
        let mut buf = PageBuf::new(1);
        let mut was_resident = 0usize;
        // Runs of pages still mapped by the registration (not unmapped by the
        // application): only those are unregistered / unmapped, so memory
        // mapped anew at an unmapped address is never touched.
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut mark_live = |p: usize| match live.last_mut() {
            Some((_, e)) if *e == p => *e = p + 1,
            _ => live.push((p, p + 1)),
        };
        for p in s.start..s.end {
            let w = s.arr.word(p);
            // Fast path: a never-touched idle page has nothing to clean up.
            if w.compare_exchange(UNTOUCHED, GONE, AcqRel, Acquire).is_ok() {
                mark_live(p);
                continue;
            }
            let t = std::time::Instant::now();
            let v = loop {
                let v = loop {
                    let v = state::wait_not_busy(w);
                    if w.compare_exchange(v, v | BUSY, AcqRel, Acquire).is_ok() {
                        break v;
                    }
                };
                if state::kind(v) != SWAPPED || owned || s.arr.external {
                    break v;
                }
                // Foreign memory: put the contents back before letting go.
                let slot = state::slot(v).expect("slot");
                if let Err(e) = self.swap.read(slot, buf.as_mut_slice()) {
                    tracing::error!(%e, "swap read failed while restoring page on unregister");
                    break v;
                }
                // SAFETY: buf is one readable page.
                match unsafe { self.uffd.copy(p << PAGE_SHIFT, buf.as_ptr(), PAGE, true) } {
                    Err(e)
                        if e.err.raw_os_error() == Some(libc::EAGAIN)
                            && t.elapsed().as_secs() < 10 =>
                    {
                        // An munmap/mremap is in flight: let go of the page
                        // (the fault thread may need it) and try again.
                        w.store(v, Release);
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    Err(e) => {
                        tracing::debug!(addr = p << PAGE_SHIFT, err = %e.err, "restore on unregister skipped");
                        break v;
                    }
                    Ok(()) => break v,
                }
            };
            if state::kind(v) == RESIDENT {
                was_resident += 1;
            }
            if let Some(sl) = state::slot(v) {
                self.swap.free(sl);
            }
            if state::kind(v) != GONE {
                mark_live(p);
            }
            w.store(GONE, Release);
        }
        if !s.arr.external {
            self.resident.fetch_sub(was_resident, Relaxed);
            self.registered.fetch_sub(s.end - s.start, Relaxed);
            for (a, b) in live {
                let (a, l) = (a << PAGE_SHIFT, (b - a) * PAGE);
                let _ = self.uffd.unregister(a, l);
                if owned {
                    // SAFETY: the pager created this mapping in alloc(); no
                    // registration references these pages any more, and the
                    // application did not unmap them.
                    if let Err(e) = unsafe { mm::munmap(a, l) } {
                        tracing::error!(%e, "munmap of pager-owned region failed");
                    }
                }
            }
        }
    }

    /// The application unmapped `[start, end)`: forget those pages.
    pub fn forget(&self, start: usize, end: usize) {
        self.forget_where(start, end, |_| true);
        self.unmapped(start, end);
    }

    /// The application is about to unmap `[start, end)`: forget the pages
    /// of external regions there now (no userfaultfd event will tell);
    /// whether there were any.
    pub fn forget_external(&self, start: usize, end: usize) -> bool {
        let any = end.div_ceil(PAGE) > start >> PAGE_SHIFT
            && self.forget_where(start, end, |s| s.arr.external);
        if any {
            self.unmapped(start, end);
        }
        any
    }

    /// Marks the pages of `[start, end)` in the segments `pick` chooses GONE
    /// (their swap slots freed); whether it chose any.
    fn forget_where(&self, start: usize, end: usize, pick: impl Fn(&Segment) -> bool) -> bool {
        let (p0, p1) = (start >> PAGE_SHIFT, end.div_ceil(PAGE));
        let segs = self.space.read().overlapping(p0, p1);
        let mut any = false;
        for s in segs.iter().filter(|s| pick(s)) {
            any = true;
            for p in s.start.max(p0)..s.end.min(p1) {
                let w = s.arr.word(p);
                loop {
                    let v = state::wait_not_busy(w);
                    if state::kind(v) == GONE {
                        break;
                    }
                    let nv = state::with_slot(state::with_kind(v, GONE), None);
                    if w.compare_exchange(v, nv, AcqRel, Acquire).is_ok() {
                        // External pages are not counted (see `register`).
                        if state::kind(v) == RESIDENT && !s.arr.external {
                            self.resident.fetch_sub(1, Relaxed);
                        }
                        if let Some(sl) = state::slot(v) {
                            self.swap.free(sl);
                        }
                        break;
                    }
                }
            }
        }
        any
    }

    /// Tells the listeners that `[start, end)` was (or is about to be) unmapped.
    fn unmapped(&self, start: usize, end: usize) {
        tracing::debug!(start, end, "application unmapped registered memory");
        self.listeners.after_unmap(start, end);
    }
}

/// Waits until the fault thread whose cycle counter is `seq` (odd while it handles
/// what it read) has finished the cycle in progress; at once on the fault thread.
pub(crate) fn wait_handled(seq: &std::sync::atomic::AtomicU64) {
    if IS_HANDLER.with(|h| h.get()) {
        return;
    }
    let s = seq.load(SeqCst);
    if s % 2 == 0 {
        return;
    }
    let t = std::time::Instant::now();
    while seq.load(SeqCst) == s {
        if t.elapsed() > std::time::Duration::from_secs(5) {
            tracing::warn!("fault thread busy for >5 s; going on");
            return;
        }
        std::thread::yield_now();
    }
}
