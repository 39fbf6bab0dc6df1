//! The pager core: shared state (`Inner`, the evictor's `EvictState`), segment
//! lookup, residency queries and the evictor kick. The transitions are further
//! `impl Inner` blocks in the files of this folder, each importing this file and
//! nothing above it: `admit` (making room under the budget before a page-in;
//! it may run `evict`'s reclaim), `pagein` (bringing one page in), `pagein_run` and
//! `pagein_batch` (runs of pages, concurrent swap reads), `registry` (register /
//! unregister, application unmaps), `evict` (victims, listeners, move-out,
//! write-out, the evictor thread) and `external` (application-managed regions).

use crate::config::PagerConfig;
use crate::error::{Error, Result};
use crate::listener::Listeners;
use crate::mm::{self, PageBuf, PAGE, PAGE_SHIFT};
use crate::reserve::ZeroReserve;
use crate::space::{Segment, Space};
use crate::state;
use crate::stats::Stats;
use crate::swap::SwapDevice;
use crate::uffd::Uffd;
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::RefCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};

mod admit;
mod evict;
mod external;
mod pagein;
mod pagein_batch;
mod pagein_run;
mod registry;
pub(crate) use registry::wait_handled;

/// Why a page is being brought in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Why {
    Fault {
        write: bool,
    },
    /// A pin; `write: false` when the pinned memory is only read (a
    /// never-touched page then maps the zero page, as a CPU read fault does).
    Pin {
        write: bool,
    },
    Prefetch,
}

impl Why {
    /// A pin (either kind).
    fn is_pin(self) -> bool {
        matches!(self, Why::Pin { .. })
    }

    /// Whether a never-touched page brought in for this may be the kernel's
    /// shared zero page: a read (fault or pin) that writes nothing. A later
    /// write to it is an ordinary copy-on-write in the kernel, for the CPU and
    /// for a DMA copy alike (the page's address does not change).
    fn reads_only(self) -> bool {
        matches!(
            self,
            Why::Fault { write: false } | Why::Pin { write: false }
        )
    }
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

/// What [`crate::Pager::write_absent_then`] did.
#[derive(Debug)]
pub enum AbsentWrite {
    /// The page was resident (or busy, or of a kind not asked for, or the
    /// range not within one page): nothing written, `announce` not run.
    Skipped,
    /// `announce` ran, then the page was filled with the data.
    Written,
    /// `announce` ran, but the page could not be filled: the kernel refused
    /// the fill (the page is left as it was, or [`Error::Unmapped`] if the
    /// application unmapped it; the caller writes the data the ordinary
    /// way), or its swap slot could not be read ([`Error::SwapIo`]: the
    /// page stays swapped out and its contents are lost to the device).
    Refused(Error),
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
    /// The most pages `resident` counted at once.
    pub resident_high: AtomicUsize,
    /// Pages admitted under the budget and not yet published (`admit`).
    pub admitted: AtomicUsize,
    /// Admissions waiting for room (`admit`), and what they wait on.
    pub room_waiters: AtomicUsize,
    pub room_lock: Mutex<()>,
    pub room_cv: Condvar,
    /// Bumped each time the evictor finds nothing it can evict while over
    /// the budget (everything pinned or busy): waiting admissions proceed.
    pub evict_stuck: AtomicU64,

    pub registered: AtomicUsize,
    pub evict: Mutex<EvictState>,
    pub kick: Mutex<bool>,
    pub kick_cv: Condvar,
    pub evictor_idle: AtomicBool,
    pub shutdown: AtomicBool,
    /// Odd while the fault thread is inside a read-and-handle cycle.
    pub handler_seq: std::sync::Arc<AtomicU64>,
    pub zero: PageBuf,
    /// Pages zeroed ahead of need (`PagerConfig::zero_reserve`).
    pub reserve: Option<ZeroReserve>,
}

thread_local! {
    pub static BOUNCE: RefCell<Option<PageBuf>> = const { RefCell::new(None) };
    /// Set on the fault-handler thread.
    pub static IS_HANDLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The evictor's private resources (serialised by `Inner::evict`).
pub struct EvictState {
    /// Staging area (`cap` pages, registered with our uffd, normally empty).
    pub staging: usize,
    pub cap: usize,
    /// CLOCK hand (page number).
    hand: usize,
}

impl EvictState {
    pub fn new(staging: usize, cap: usize) -> EvictState {
        EvictState {
            staging,
            cap,
            hand: 0,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let st = self.evict.get_mut();
        let _ = self.uffd.unregister(st.staging, st.cap * PAGE);
        // SAFETY: the staging area is ours; no thread can use it any more
        // (they all held an Arc<Inner>).
        let _ = unsafe { mm::munmap(st.staging, st.cap * PAGE) };
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

pub(crate) fn kernel(op: &'static str, addr: usize, err: io::Error) -> Error {
    Error::Kernel { op, addr, err }
}

impl Inner {
    pub fn new(
        cfg: PagerConfig,
        uffd: Uffd,
        swap: SwapDevice,
        evict: EvictState,
        reserve: Option<ZeroReserve>,
    ) -> Inner {
        Inner {
            reserve,
            budget: AtomicUsize::new(cfg.budget_pages.unwrap_or(usize::MAX)),
            cfg,
            uffd,
            swap,
            space: RwLock::new(Space::default()),
            listeners: Listeners::default(),
            stats: Stats::default(),
            resident: AtomicUsize::new(0),
            resident_high: AtomicUsize::new(0),
            admitted: AtomicUsize::new(0),
            room_waiters: AtomicUsize::new(0),
            room_lock: Mutex::new(()),
            room_cv: Condvar::new(),
            evict_stuck: AtomicU64::new(0),

            registered: AtomicUsize::new(0),
            evict: Mutex::new(evict),
            kick: Mutex::new(false),
            kick_cv: Condvar::new(),
            evictor_idle: AtomicBool::new(true),
            shutdown: AtomicBool::new(false),
            handler_seq: std::sync::Arc::new(AtomicU64::new(0)),
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

    pub fn check_budget(&self) {
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

    /// Whether the page holding `addr` is a managed (non-external) page the
    /// pager has never filled, or dropped as a hole: no content of its own
    /// (see [`crate::Pager::is_untouched`]).
    pub fn is_untouched(&self, addr: usize) -> bool {
        // A BUSY never-touched page is being filled, perhaps with data
        // already announced to its writer (`write_absent_then`).
        self.managed_word(addr)
            .is_some_and(|v| state::kind(v) == state::UNTOUCHED && v & state::BUSY == 0)
    }

    /// The state word of the page holding `addr` if it is registered and
    /// not external (a read lock, no syscall).
    fn managed_word(&self, addr: usize) -> Option<u64> {
        let p = addr >> PAGE_SHIFT;
        let sp = self.space.read();
        sp.lookup(p)
            .filter(|s| !s.arr.external)
            .map(|s| s.arr.word(p).load(Acquire))
    }

    /// Whether the page holding `addr` is a managed (non-external) page the
    /// pager holds swapped out (see [`crate::Pager::is_swapped_out`]).
    pub fn is_swapped_out(&self, addr: usize) -> bool {
        self.managed_word(addr).map(state::kind) == Some(state::SWAPPED)
    }

    /// Whether the page holding `addr` belongs to a registered range the
    /// application unmapped (its address may hold other memory now).
    pub fn manages(&self, addr: usize, len: usize) -> bool {
        let p0 = addr >> PAGE_SHIFT;
        let p1 = addr.saturating_add(len).div_ceil(1 << PAGE_SHIFT);
        p1 > p0 && !self.space.read().overlapping(p0, p1).is_empty()
    }

    pub fn is_gone(&self, addr: usize) -> bool {
        let p = addr >> PAGE_SHIFT;
        let sp = self.space.read();
        sp.lookup(p)
            .is_some_and(|s| state::kind(s.arr.word(p).load(Acquire)) == state::GONE)
    }

    pub fn is_resident(&self, addr: usize) -> bool {
        let p = addr >> PAGE_SHIFT;
        let sp = self.space.read();
        sp.lookup(p)
            .is_some_and(|s| state::is_resident(s.arr.word(p).load(Acquire)))
    }

    /// Pages of the managed (non-external) regions the kernel holds
    /// resident now, by `mincore` over each region (the pager's own count,
    /// `resident`, measured independently; a page the kernel still maps
    /// through a forked child's copy-on-write share counts too).
    pub fn kernel_resident(&self) -> usize {
        let segs: Vec<(usize, usize)> = self
            .space
            .read()
            .all()
            .filter(|s| !s.arr.external)
            .map(|s| (s.start, s.end))
            .collect();
        const CHUNK: usize = 1 << 16;
        let mut vec = vec![0u8; CHUNK];
        let mut n = 0;
        for (mut p, end) in segs {
            while p < end {
                let k = (end - p).min(CHUNK);
                // An unmapped piece (the application unmapped it) counts none.
                if mm::mincore(p << PAGE_SHIFT, k * PAGE, &mut vec[..k]).is_ok() {
                    n += vec[..k].iter().filter(|&&b| b & 1 != 0).count();
                }
                p += k;
            }
        }
        n
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
}
