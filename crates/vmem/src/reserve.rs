//! The zero reserve: pages allocated and zeroed ahead of need by a background
//! thread, moved into place with one `UFFDIO_MOVE` when a run of never-touched
//! pages is written for the first time.
//!
//! Why: allocating and zeroing a page is the kernel's work on the faulting
//! thread's critical path (`UFFDIO_COPY` of zeroes, or a first-touch fault):
//! ~1.2–1.8 µs a page on the VMs this project runs on, 0.7–0.9 ms per 2 MiB.
//! Moving populated pages costs ~0.1 µs a page plus ~10 µs per call (the TLB
//! flush of the source range on the other CPUs), so the reserve serves runs of
//! at least [`MIN_MOVE`] pages; shorter ones are cheaper to copy.
//!
//! The reserve is `chunks` chunks of [`CHUNK`] pages in one private anonymous
//! mapping (no transparent huge pages, not inherited by a child). A chunk is
//! *ready* (populated from its `next` page on) or *empty* (waiting for the
//! refill thread, which populates it with `MADV_POPULATE_WRITE` and blocks
//! while nothing is empty). The reserve never holds more than the pager
//! could still fill: a pager of a few small buffers populates nothing. Moves happen under the reserve's lock, so a chunk
//! being refilled is never read from. Its pages hold nothing but the kernel's
//! zeroes: nobody writes them before they are moved. The refill thread runs
//! at idle priority: the reserve is filled from CPU time nobody else wants.

use crate::anon::AnonMapping;
use crate::mm::{self, PAGE};
use crate::uffd::Uffd;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};

/// Pages per chunk (2 MiB).
pub const CHUNK: usize = crate::config::RESERVE_CHUNK;
/// Shortest run worth moving (below it a `UFFDIO_COPY` of zeroes is cheaper).
pub const MIN_MOVE: usize = 32;
/// Pages populated per `madvise` call (256 KiB).
const SLICE: usize = 64;

/// Puts the calling thread in `SCHED_IDLE`: it runs only on a CPU nothing
/// else wants, so refilling the reserve never takes a core from the
/// application (a sustained stream of first touches then finds the reserve
/// empty and is served as without one). Best effort.
pub fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread (pid 0) with a valid
    // parameter block; it changes nothing but this thread's policy.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if r != 0 {
        tracing::debug!(err = %std::io::Error::last_os_error(), "SCHED_IDLE refused");
    }
}

struct Chunks {
    /// Per chunk: the first page not yet moved out (`CHUNK` = empty).
    next: Vec<usize>,
    /// Per chunk: populated (`next..CHUNK` present).
    ready: Vec<bool>,
}

pub struct ZeroReserve {
    base: usize,
    chunks: usize,
    st: Mutex<Chunks>,
    cv: Condvar,
    stop: AtomicBool,
    /// Pages moved into place from the reserve.
    pub moved: AtomicU64,
    /// Pages the refill thread populated.
    pub populated: AtomicU64,
}

impl ZeroReserve {
    /// A reserve of `pages` (rounded up to whole chunks); nothing populated
    /// until [`ZeroReserve::refill_loop`] runs.
    pub fn new(pages: usize) -> std::io::Result<ZeroReserve> {
        let chunks = pages.div_ceil(CHUNK).max(1);
        let len = chunks * CHUNK * PAGE;
        let (base, _) = AnonMapping::new_noreserve(len)?.into_raw();
        // SAFETY: our own fresh mapping. 4 KiB pages (a move of part of a
        // huge page would split it); a child of fork() does not get it (its
        // pages would be shared copy-on-write, which UFFDIO_MOVE refuses).
        unsafe {
            let _ = mm::madvise(base, len, rustix::mm::Advice::LinuxNoHugepage);
            let _ = mm::madvise(base, len, rustix::mm::Advice::LinuxDontFork);
        }
        Ok(ZeroReserve {
            base,
            chunks,
            st: Mutex::new(Chunks {
                next: vec![CHUNK; chunks],
                ready: vec![false; chunks],
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            moved: AtomicU64::new(0),
            populated: AtomicU64::new(0),
        })
    }

    /// Capacity in pages.
    pub fn pages(&self) -> usize {
        self.chunks * CHUNK
    }

    /// Moves up to `n` zeroed pages into `[dst, dst + n pages)` (registered
    /// with `uffd`, every page missing), waking threads faulting there if
    /// `wake`. Returns how many pages, from `dst` on, were moved: 0 for a
    /// run under [`MIN_MOVE`] or an empty reserve; fewer than `n` when the
    /// ready chunk holds fewer or the kernel stopped early (the caller fills
    /// the rest its own way).
    pub fn take(&self, uffd: &Uffd, dst: usize, n: usize, wake: bool) -> usize {
        if n < MIN_MOVE {
            return 0;
        }
        let mut st = self.st.lock();
        let Some(c) = (0..self.chunks)
            .filter(|&c| st.ready[c] && st.next[c] < CHUNK)
            // The fullest chunk: fewest moves (and TLB flushes) per run.
            .min_by_key(|&c| st.next[c])
        else {
            drop(st);
            self.cv.notify_one();
            return 0;
        };
        let k = n.min(CHUNK - st.next[c]);
        if k < MIN_MOVE {
            return 0;
        }
        let src = self.base + (c * CHUNK + st.next[c]) * PAGE;
        let moved = match uffd.mv(dst, src, k * PAGE, wake) {
            Ok(()) => k,
            Err(e) => {
                tracing::debug!(dst, k, err = %e.err, "move from the zero reserve stopped early");
                (e.done as usize / PAGE).min(k)
            }
        };
        // Pages of the span the kernel did not move stay behind, skipped;
        // the refill repopulates the whole chunk (present pages are kept).
        st.next[c] += k;
        if st.next[c] >= CHUNK {
            st.ready[c] = false;
            drop(st);
            self.cv.notify_one();
        }
        self.moved.fetch_add(moved as u64, Relaxed);
        moved
    }

    /// The refill thread (run it at idle priority, [`idle_priority`]):
    /// populates empty chunks while `room()` (the pages
    /// the pager could still fill: registered and not resident) exceeds
    /// what the reserve holds by a chunk; blocks otherwise, until a move
    /// empties a chunk or [`ZeroReserve::kick`] (a new registration).
    pub fn refill_loop(&self, room: impl Fn() -> usize) {
        loop {
            let c = {
                let mut st = self.st.lock();
                loop {
                    if self.stop.load(Acquire) {
                        return;
                    }
                    let held: usize = (0..self.chunks)
                        .filter(|&c| st.ready[c])
                        .map(|c| CHUNK - st.next[c])
                        .sum();
                    let empty = (0..self.chunks).find(|&c| !st.ready[c]);
                    match empty {
                        Some(c) if held + CHUNK <= room() => break c,
                        _ => self.cv.wait(&mut st),
                    }
                }
            };
            let addr = self.base + c * CHUNK * PAGE;
            // In slices, so that the address-space lock the kernel holds while
            // populating is never held long by this low-priority thread.
            let populate = (0..CHUNK).step_by(SLICE).try_for_each(|k| {
                // SAFETY: chunk `c` is ours and not ready, so no move reads it
                // while it is populated (moves happen under the lock, on ready
                // chunks only).
                unsafe {
                    mm::madvise(
                        addr + k * PAGE,
                        SLICE * PAGE,
                        rustix::mm::Advice::LinuxPopulateWrite,
                    )
                }
            });
            match populate {
                Ok(()) => {
                    self.populated.fetch_add(CHUNK as u64, Relaxed);
                    let mut st = self.st.lock();
                    st.next[c] = 0;
                    st.ready[c] = true;
                }
                Err(e) => {
                    // Out of memory (or no MADV_POPULATE_WRITE): runs are
                    // copied as before; try again when a run finds nothing.
                    tracing::debug!(%e, "populating the zero reserve failed");
                    let mut st = self.st.lock();
                    if !self.stop.load(Acquire) {
                        self.cv.wait(&mut st);
                    }
                }
            }
        }
    }

    /// Wakes the refill thread (more memory may be filled soon).
    pub fn kick(&self) {
        let _st = self.st.lock();
        self.cv.notify_one();
    }

    /// Ends [`ZeroReserve::refill_loop`].
    pub fn stop(&self) {
        self.stop.store(true, Release);
        let _st = self.st.lock();
        self.cv.notify_all();
    }
}

impl Drop for ZeroReserve {
    fn drop(&mut self) {
        // SAFETY: the reserve is ours; no thread uses it any more (they all
        // held the Arc that owned it).
        let _ = unsafe { mm::munmap(self.base, self.chunks * CHUNK * PAGE) };
    }
}
