//! The pager core: shared state, and the page transitions that bring pages in
//! (fault, pin, prefetch), pin/unpin, residency queries and registration.

use crate::config::PagerConfig;
use crate::error::{Error, Result};
use crate::listener::Listeners;
use crate::space::{RegInfo, RegionId, Segment, Space};
use crate::state::{
    self, PageArray, BUSY, EVICTING, GONE, MAX_PINS, NOEVICT, NOTIFYING, PIN_ONE, REF, RESIDENT,
    SWAPPED, UNTOUCHED,
};
use crate::stats::{inc, Stats};
use crate::swap::SwapDevice;
use crate::sys::{self, PageBuf, PAGE, PAGE_SHIFT};
use crate::uffd::Uffd;
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::RefCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Arc;

/// Why a page is being brought in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Why {
    Fault { write: bool },
    Pin,
    Prefetch,
}

/// What bringing a page in did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Brought {
    /// Already resident (spurious fault, or pin of a resident page).
    Already,
    /// First touch, filled with zeroes.
    Zero,
    /// Read back from swap.
    Swap,
    /// The application had dropped the page (e.g. MADV_DONTNEED); zero-filled.
    Hole,
}

pub struct Inner {
    pub cfg: PagerConfig,
    pub uffd: Uffd,
    pub swap: SwapDevice,
    pub space: RwLock<Space>,
    pub listeners: Listeners,
    pub stats: Stats,
    /// usize::MAX = no budget.
    pub budget: AtomicUsize,
    pub resident: AtomicUsize,
    pub registered: AtomicUsize,
    pub evict: Mutex<crate::evict::EvictState>,
    pub kick: Mutex<bool>,
    pub kick_cv: Condvar,
    pub evictor_idle: AtomicBool,
    pub shutdown: AtomicBool,
    /// Odd while the fault thread is inside a read-and-handle cycle.
    pub handler_seq: AtomicU64,
    zero: PageBuf,
}

thread_local! {
    static BOUNCE: RefCell<Option<PageBuf>> = const { RefCell::new(None) };
    /// Set on the fault-handler thread.
    pub static IS_HANDLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for Inner {
    fn drop(&mut self) {
        let st = self.evict.get_mut();
        let _ = self.uffd.unregister(st.staging, st.cap * PAGE);
        // SAFETY: the staging area is ours; no thread can use it any more
        // (they all held an Arc<Inner>).
        let _ = unsafe { sys::munmap(st.staging, st.cap * PAGE) };
    }
}

/// The segments covering a range (usually one).
pub enum Segs {
    One(Segment),
    Many(Vec<Segment>),
}

impl std::ops::Deref for Segs {
    type Target = [Segment];
    fn deref(&self) -> &[Segment] {
        match self {
            Segs::One(s) => std::slice::from_ref(s),
            Segs::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a Segs {
    type Item = &'a Segment;
    type IntoIter = std::slice::Iter<'a, Segment>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Page range `[p0, p1)` covering `[addr, addr+len)`.
pub fn page_range(addr: usize, len: usize) -> Result<(usize, usize)> {
    if len == 0 {
        return Err(Error::InvalidRange {
            addr,
            len,
            why: "empty",
        });
    }
    let end = addr.checked_add(len).ok_or(Error::InvalidRange {
        addr,
        len,
        why: "wraps around",
    })?;
    if addr == 0 || end > 0x7fff_ffff_f000 {
        return Err(Error::InvalidRange {
            addr,
            len,
            why: "outside user address space",
        });
    }
    Ok((addr >> PAGE_SHIFT, end.div_ceil(PAGE)))
}

fn kernel(op: &'static str, addr: usize, err: io::Error) -> Error {
    Error::Kernel { op, addr, err }
}

impl Inner {
    pub fn new(
        cfg: PagerConfig,
        uffd: Uffd,
        swap: SwapDevice,
        evict: crate::evict::EvictState,
    ) -> Inner {
        Inner {
            budget: AtomicUsize::new(cfg.budget_pages.unwrap_or(usize::MAX)),
            cfg,
            uffd,
            swap,
            space: RwLock::new(Space::default()),
            listeners: Listeners::default(),
            stats: Stats::default(),
            resident: AtomicUsize::new(0),
            registered: AtomicUsize::new(0),
            evict: Mutex::new(evict),
            kick: Mutex::new(false),
            kick_cv: Condvar::new(),
            evictor_idle: AtomicBool::new(true),
            shutdown: AtomicBool::new(false),
            handler_seq: AtomicU64::new(0),
            zero: PageBuf::new(1),
        }
    }

    /// Segments covering all of `[p0, p1)`, or `NotRegistered`.
    pub fn segments_for(&self, p0: usize, p1: usize) -> Result<Segs> {
        let sp = self.space.read();
        // Fast path (pins of a few pages): one segment, no allocation.
        if let Some(s) = sp.lookup(p0) {
            if s.end >= p1 {
                return Ok(Segs::One(s.clone()));
            }
        }
        let segs = sp.overlapping(p0, p1);
        let mut cur = p0;
        for s in &segs {
            if s.start > cur {
                break;
            }
            cur = s.end;
        }
        if cur < p1 {
            return Err(Error::NotRegistered(cur << PAGE_SHIFT));
        }
        Ok(Segs::Many(segs))
    }

    fn check_budget(&self) {
        if self.resident.load(Relaxed) > self.budget.load(Relaxed) && self.cfg.background_evictor {
            self.kick_evictor();
        }
    }

    pub fn kick_evictor(&self) {
        if self.evictor_idle.swap(false, AcqRel) {
            *self.kick.lock() = true;
            self.kick_cv.notify_one();
        }
    }

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
                    Why::Pin => {
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
        } else if why == (Why::Fault { write: false }) {
            self.uffd.zeropage(addr, PAGE, wake)
        } else {
            // SAFETY: self.zero is one readable page of zeroes.
            unsafe { self.uffd.copy(addr, self.zero.as_ptr(), PAGE, wake) }
        };
        let add_pin = if why == Why::Pin { PIN_ONE } else { 0 };
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
                unsafe { sys::touch_read(addr, PAGE) };
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
        // Pinned pages cannot be evicted before their notification anyway;
        // the caller clears NOTIFYING after notifying (outcomes Zero/Swap).
        let notifying = if self.cfg.eager_swap_in_notify
            && why != Why::Pin
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
        self.resident.fetch_add(1, Relaxed);
        if swapped && outcome == Brought::Swap {
            inc(&self.stats.c.swap_ins);
            if why == Why::Pin {
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
            let _ = self.uffd.wake(addr, PAGE);
        }
        self.check_budget();
        Ok(outcome)
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

    /// Runs `f` with this thread's bounce buffer.
    fn with_bounce<R>(f: impl FnOnce(&mut PageBuf) -> R) -> R {
        BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            f(b.get_or_insert_with(|| PageBuf::new(1)))
        })
    }

    pub fn pin(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let mut swapped_in = Vec::new();
        let mut done: Vec<(&PageArray, usize)> = Vec::with_capacity(p1 - p0);
        let r = Self::with_bounce(|buf| -> Result<()> {
            for s in &segs {
                for p in s.start.max(p0)..s.end.min(p1) {
                    let b = self.bring_in_wait(&s.arr, p, Why::Pin, buf)?;
                    done.push((&s.arr, p));
                    if b != Brought::Already {
                        swapped_in.push(p << PAGE_SHIFT);
                    }
                }
            }
            Ok(())
        });
        if let Err(e) = r {
            for (arr, p) in done {
                let _ = state::update(arr.word(p), |cur| {
                    (state::pins(cur) > 0).then(|| cur - PIN_ONE)
                });
            }
            return Err(e);
        }
        if self.cfg.eager_swap_in_notify {
            self.listeners.after_swap_in(&swapped_in);
        }
        Ok(())
    }

    pub fn unpin(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let mut done: Vec<(&PageArray, usize)> = Vec::new();
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let w = s.arr.word(p);
                if state::update(w, |cur| (state::pins(cur) > 0).then(|| cur - PIN_ONE)).is_err() {
                    for (arr, q) in done {
                        let _ = state::update(arr.word(q), |cur| Some(cur + PIN_ONE));
                    }
                    return Err(Error::NotPinned(p << PAGE_SHIFT));
                }
                done.push((&s.arr, p));
            }
        }
        Ok(())
    }

    pub fn prefetch(&self, addr: usize, len: usize) -> Result<usize> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        let mut brought: Vec<(&PageArray, usize)> = Vec::new();
        let r = Self::with_bounce(|buf| -> Result<()> {
            for s in segs.iter().filter(|s| !s.arr.external) {
                for p in s.start.max(p0)..s.end.min(p1) {
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

    pub fn is_resident(&self, addr: usize) -> bool {
        let p = addr >> PAGE_SHIFT;
        let sp = self.space.read();
        sp.lookup(p)
            .is_some_and(|s| state::is_resident(s.arr.word(p).load(Acquire)))
    }

    /// Residency bitmap of `[addr, addr+len)` (bit i of word i/64 = page i).
    pub fn resident_bitmap(&self, addr: usize, len: usize) -> Result<Vec<u64>> {
        let (p0, p1) = page_range(addr, len)?;
        let mut bits = vec![0u64; (p1 - p0).div_ceil(64)];
        for s in self.segments_for(p0, p1)?.iter() {
            let (a, b) = (s.start.max(p0), s.end.min(p1));
            let states = &s.arr.states[a - s.arr.base..b - s.arr.base];
            for (k, st) in states.iter().enumerate() {
                if state::is_resident(st.load(Relaxed)) {
                    let i = a - p0 + k;
                    bits[i / 64] |= 1 << (i % 64);
                }
            }
        }
        Ok(bits)
    }

    // ----- registration -----

    /// Waits until the fault thread has handled every event it has read. The
    /// kernel lets munmap return once its UNMAP event is *read*; waiting for
    /// the handler's current cycle orders that event before a registration
    /// that reuses the addresses.
    fn quiesce_events(&self) {
        if IS_HANDLER.with(|h| h.get()) {
            return;
        }
        let s = self.handler_seq.load(SeqCst);
        if s % 2 == 0 {
            return;
        }
        let t = std::time::Instant::now();
        while self.handler_seq.load(SeqCst) == s {
            if t.elapsed() > std::time::Duration::from_secs(5) {
                tracing::warn!("fault thread busy for >5 s; registering anyway");
                return;
            }
            std::thread::yield_now();
        }
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
            sys::mincore(base_addr, n * PAGE, &mut v).map_err(|e| match e.raw_os_error() {
                Some(libc::ENOMEM) => Error::InvalidRange {
                    addr,
                    len,
                    why: "not mapped",
                },
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
            return Err(Error::InvalidRange {
                addr,
                len,
                why: "overlaps a region of the other kind (external/managed)",
            });
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
                if let Err(e) = self.uffd.register(a << PAGE_SHIFT, (b - a) * PAGE) {
                    for &(a2, b2) in &runs[..i] {
                        let _ = self.uffd.unregister(a2 << PAGE_SHIFT, (b2 - a2) * PAGE);
                    }
                    return Err(match e.raw_os_error() {
                        Some(libc::EINVAL) | Some(libc::ENOMEM) => Error::InvalidRange {
                            addr,
                            len,
                            why: "not private anonymous memory (or not mapped)",
                        },
                        _ => kernel("UFFDIO_REGISTER", a << PAGE_SHIFT, e),
                    });
                }
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
            self.resident.fetch_add(resident, Relaxed);
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
                    if let Err(e) = unsafe { sys::munmap(a, l) } {
                        tracing::error!(%e, "munmap of pager-owned region failed");
                    }
                }
            }
        }
    }

    /// The application unmapped `[start, end)`: forget those pages.
    pub fn forget(&self, start: usize, end: usize) {
        let (p0, p1) = (start >> PAGE_SHIFT, end.div_ceil(PAGE));
        let segs = self.space.read().overlapping(p0, p1);
        for s in segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let w = s.arr.word(p);
                loop {
                    let v = state::wait_not_busy(w);
                    if state::kind(v) == GONE {
                        break;
                    }
                    let nv = state::with_slot(state::with_kind(v, GONE), None);
                    if w.compare_exchange(v, nv, AcqRel, Acquire).is_ok() {
                        if state::kind(v) == RESIDENT {
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
        tracing::debug!(start, end, "application unmapped managed memory");
    }

    // ----- external notification API -----

    fn external_segments(&self, addr: usize, len: usize) -> Result<(usize, usize, Segs)> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        if segs.iter().any(|s| !s.arr.external) {
            return Err(Error::InvalidRange {
                addr,
                len,
                why: "not an externally managed region",
            });
        }
        Ok((p0, p1, segs))
    }

    pub fn notify_swapped_out(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1, segs) = self.external_segments(addr, len)?;
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                if state::pins(s.arr.word(p).load(Acquire)) > 0 {
                    return Err(Error::Pinned(p << PAGE_SHIFT));
                }
            }
        }
        let pages: Vec<usize> = (p0..p1).map(|p| p << PAGE_SHIFT).collect();
        self.listeners.before_swap_out(&pages);
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let _ = state::update(s.arr.word(p), |cur| Some(state::with_kind(cur, SWAPPED)));
            }
        }
        Ok(())
    }

    pub fn notify_swapped_in(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1, segs) = self.external_segments(addr, len)?;
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let _ = state::update(s.arr.word(p), |cur| Some(state::with_kind(cur, RESIDENT)));
            }
        }
        let pages: Vec<usize> = (p0..p1).map(|p| p << PAGE_SHIFT).collect();
        self.listeners.after_swap_in(&pages);
        Ok(())
    }
}
