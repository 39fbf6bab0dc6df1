//! `vmem` — the user-space pager of nprdma.
//!
//! It plays the operating system's virtual-memory role for non-pinned RDMA
//! memory, on real process memory with real page faults (userfaultfd):
//!
//! * **Regions**: [`Pager::alloc`] maps and registers fresh anonymous memory;
//!   [`Pager::register`] takes any private anonymous range the application
//!   already has (malloc'd or mmapped; unaligned ranges are covered by whole
//!   pages; overlapping registrations share page state and are reference
//!   counted). Dropping a [`Region`] unregisters it: swapped-out pages of
//!   foreign memory are restored first, swap slots are freed, the pager's own
//!   mappings are unmapped.
//! * **Page states**: never-touched (first access = minor fault, served with a
//!   zero page), resident, swapped-out (access = major fault, served from the
//!   swap file with `UFFDIO_COPY`). Kept in one atomic word per page, so
//!   [`Pager::is_resident`] / [`Pager::resident_bitmap`] are memory reads.
//! * **Swap device**: a swap file (path, size; unlinked at creation unless
//!   `keep_swap_file`; blocks reserved with fallocate), read and written with
//!   O_DIRECT by default like Linux swap, so a major fault is a device read
//!   (buffered through the page cache on request; a filesystem refusing
//!   O_DIRECT gets buffered I/O with a warning; [`Pager::swap_io`] /
//!   [`PagerStats::swap_io`] label which), low-first slot allocation, batched
//!   write-out. Several runs of one `pin`/`prefetch` range, or of one
//!   eviction batch, are read/written concurrently on up to
//!   `swap_io_threads` I/O threads (`core/pagein_batch.rs`, `swap_io.rs`); a
//!   single read (a fault) stays in the calling thread. A page read by
//!   [`Pager::read_swapped`] stays in a small swap cache until its swap-in.
//!   [`Pager::device_read_latency`] measures the device itself on the same
//!   file. Swap full is [`Error::SwapFull`] and the pages stay resident.
//! * **Eviction**: a resident-page budget enforced by a background CLOCK
//!   evictor; explicit [`Pager::swap_out`] / [`Pager::prefetch`]. A victim is
//!   moved out of the application's mapping atomically with `UFFDIO_MOVE`
//!   into a staging area before it is written to swap, so a concurrent write
//!   is never lost: it either lands before the move, or faults and waits.
//!   The reference bit is set when the pager brings a page in or pins it;
//!   later CPU accesses are invisible to a user-space pager (the accessed
//!   bits of the page tables are not exported: `PAGEMAP_SCAN` has no
//!   accessed category, idle-page tracking needs root and PFNs), but a
//!   device's are not: before evicting, CLOCK asks the listeners
//!   ([`SwapListener::test_and_clear_young`], Linux's `clear_young` for
//!   secondary MMUs) and spares the pages they report young.
//! * **Fault-around** (`PagerConfig::fault_around`, off by default): a
//!   first-touch fault zero-fills the never-touched pages after it in one
//!   ioctl (`core/pagein_run.rs`, from a never-written mapping that reads as
//!   the zero page), so fresh memory written in order costs one userfault
//!   per run; with `PagerConfig::fault_around_max` the run doubles while the
//!   faults come in order (up to 2 MiB, as a transparent huge page), the way
//!   Linux's readahead window grows (`fault.rs`). A write stream at that
//!   longest run is filled two runs ahead while the fault thread is idle
//!   (Linux's asynchronous readahead), so its writer mostly runs without
//!   userfaults. With `PagerConfig::zero_reserve` the long runs are pages
//!   zeroed ahead of need on an idle-priority thread, moved into place
//!   (`reserve.rs`) instead of allocated on the faulting thread.
//! * **Listeners** ([`SwapListener`]): called synchronously on the evicting
//!   thread with the batch of pages about to leave, before they leave (the
//!   MMU-notifier role). Optional eager swap-in notification. For memory the
//!   application manages itself: [`Pager::register_external`] plus
//!   [`Pager::notify_swapped_out`] / [`Pager::notify_swapped_in`].
//! * **Pins** ([`Pager::pin`] / [`Pager::unpin`]): reference counts in the page
//!   word; a pinned page is resident and never evicted; pinning a
//!   non-resident page resolves it *in the calling thread* (ioctl, no fault, no
//!   hand-off); a pin racing an eviction aborts it or waits for it and swaps
//!   the page back in. A pin of a range brings runs of up to 32 non-resident
//!   pages in at once (never-touched ones, or swapped ones in consecutive
//!   slots: one `pread` + one `UFFDIO_COPY`; `core/pagein_run.rs`, and for
//!   swapped runs their reads concurrently, `core/pagein_batch.rs`).
//!   [`Pager::pin_read`] pins memory the holder only reads: never-touched
//!   pages then map the kernel's zero page (`UFFDIO_ZEROPAGE`, as a CPU read
//!   fault does; a later write is the kernel's copy-on-write at the same
//!   address), not a page allocated and zeroed now. Resident pages of a
//!   range pin take one CAS each.
//! * **Batches of faults**: [`Pager::swap_in_pages`] brings in scattered
//!   swapped-out pages (the targets of a batch of remote faults) with their
//!   reads issued concurrently; [`Pager::write_untouched`] fills a
//!   never-touched page with a small write's data in one `UFFDIO_COPY`, and
//!   [`Pager::write_absent_then`] answers the writer before filling a
//!   never-touched or swapped-out page (its swap read included), with the
//!   page locked so that every access waits for the data.
//! * **Stats** ([`PagerStats`]): resident pages, minor/major faults, swap-ins
//!   and -outs, bytes moved, fault-service-time percentiles (hdrhistogram).
//!
//! # How a page moves
//!
//! Each page has one atomic state word (`state.rs`): kind (never-touched,
//! resident, swapped, gone), a BUSY lock bit held across a transition, the
//! CLOCK reference bit, EVICTING, NOEVICT and NOTIFYING bits, the pin count
//! and the swap slot. The invariant is *resident ⇔ mapped*, except while BUSY.
//!
//! * **In** (fault thread, `pin`, `prefetch`): take BUSY, fill the page with
//!   `UFFDIO_ZEROPAGE` / `UFFDIO_COPY` (zeroes, or the slot read with pread),
//!   publish RESIDENT (+1 pin for `pin`), free the slot; for a fault, only
//!   then wake the faulting thread. With eager swap-in notification the page
//!   is published NOTIFYING (not evictable) until `after_swap_in` returned,
//!   so that notification always precedes the page's next `before_swap_out`.
//! * **Out** (evictor, `swap_out`): allocate slots; mark victims EVICTING
//!   (resident, unpinned, idle); call the listeners; lock each victim
//!   EVICTING → BUSY unless a pin arrived meanwhile (that page stays, pinned);
//!   `UFFDIO_MOVE` the victims into a private staging area (atomic unmap);
//!   write the staging pages to their slots; publish SWAPPED; `MADV_DONTNEED`
//!   the staging area. A thread touching a victim after the move faults and
//!   waits on BUSY, then is served from swap.
//! * **Pins** increment the count on a resident page (or bring it in first)
//!   and never wait for a listener: a pin after a page was announced to the
//!   listeners cancels that page's eviction (even if it is released before
//!   the evictor reaches the page), so whatever the pinner re-established
//!   (e.g. a NIC mapping) stays valid; the page is announced again before any
//!   later eviction.
//!
//! The kernel refuses fills and moves with EAGAIN while an munmap/mremap of
//! managed memory is pending; faults are then deferred (the thread stays
//! blocked) and `pin`/`prefetch` retry, until the fault thread has read the
//! UNMAP/REMAP event.
//!
//! Threads: one fault-handler thread per pager (blocks in poll when idle,
//! spins for `PagerConfig::spin` after a fault, yielding its core past the
//! first 10 µs) and one evictor thread (blocks
//! on a condition variable; woken only when the budget is exceeded).
//!
//! Limits and known issues:
//! * Regions must be private anonymous memory. Pages the kernel refuses to
//!   move stay resident and count in `evict_failures`; mlocked pages or pages
//!   of a mapping with other protection are not tried again, pages the kernel
//!   reports busy (shared with a forked child, KSM) are retried later.
//! * A page only partly covered by a foreign registration (unaligned start or
//!   end) may hold other heap data, possibly the pager's own structures; it
//!   is managed and pinnable but never evicted (the fault thread must never
//!   fault on its own data).
//! * `swap_out` / `enforce_budget` must not be called from a listener.
//! * The application's own `MADV_DONTNEED` on registered memory is not
//!   reported (userfaultfd REMOVE events would stall eviction): such pages
//!   still count as resident until the next access, which is served with
//!   zeroes, or the next eviction, which notices the hole.
//! * munmap / mremap are followed (UNMAP / REMAP events): the pages leave
//!   management; a moved (mremapped) range is not managed at its new place.
//!   Registration waits until the fault thread has handled every such event
//!   already read. Residual race: if the application unmaps a range and maps
//!   new memory at the same address in the microseconds between the kernel
//!   handing over the UNMAP event and the fault thread handling it, an
//!   eviction already in flight for that address could move the new page
//!   (UFFDIO_MOVE does not check the source mapping's registration).
//! * A forked child does not inherit the registration (its copy is plain
//!   memory); it gets the parent's contents of every managed page all the
//!   same: pages swapped out at fork time are read from swap into the child's
//!   copy while the parent's evictor pauses (`fork.rs`).
//!
//! Needs userfaultfd with UFFDIO_MOVE (Linux ≥ 6.8) and either root/
//! CAP_SYS_PTRACE or `vm.unprivileged_userfaultfd = 1`.
//!
//! Tests: `cargo test -p vmem` (about 10 s); longer stress runs with
//! `VMEM_STRESS_SECS=60 cargo test -p vmem --release --test stress`.
//! Benchmarks: `cargo run --release -p vmem --example vmem_bench` (see
//! BENCHMARKS.md, section "Pager").
//!
//! ```no_run
//! let pager = vmem::Pager::new(vmem::PagerConfig::default()).unwrap();
//! let mut r = pager.alloc(1 << 20).unwrap();
//! r.as_mut_slice()[0] = 7; // minor fault
//! pager.swap_out(r.addr(), r.len()).unwrap();
//! assert!(!pager.is_resident(r.addr()));
//! assert_eq!(r.as_slice()[0], 7); // major fault
//! ```

mod anon;
mod config;
mod core;
mod error;
mod fault;
mod fork;
mod listener;
mod mm;
mod region;
mod reserve;
mod space;
mod state;
mod stats;
mod swap;
mod swap_io;
mod uffd;
mod uring;
mod watch;

pub use crate::core::AbsentWrite;
pub use anon::AnonMapping;
pub use config::PagerConfig;
pub use error::{Error, Result};
pub use listener::{ListenerId, SwapListener};
pub use mm::PAGE as PAGE_SIZE;
pub use region::Region;
pub use space::RegionId;
pub use stats::{LatencySummary, PagerStats, ThreadFaults};
pub use swap::{device_read_latency, DeviceLatency, SwapIo};
pub use uring::{poll_swap_reads, polled_swap_reads, swap_reads_can_poll};
pub use watch::{Hold, OnGone, UnmapWatch, WatchId};

/// See [`Pager::events_handled`].
#[derive(Clone)]
pub struct EventsHandled(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl EventsHandled {
    /// Returns once the fault thread has handled every event it had read when this
    /// was called. The kernel lets an munmap return as soon as its UNMAP event is
    /// read, before the pager (and its listeners) have acted on it: a wrapper around
    /// munmap that calls this after the syscall returns to the application only once
    /// the pages have left management everywhere. Returns at once on the fault
    /// thread itself.
    pub fn wait(&self) {
        core::wait_handled(&self.0);
    }
}

use crate::core::{page_range, EvictState, Inner};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::thread::JoinHandle;

struct Handle {
    inner: Arc<Inner>,
    threads: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    stop: Arc<OwnedFd>,
}

/// The pager. Cheap to clone (shared handle); the threads stop when the last
/// clone and the last [`Region`] are dropped.
#[derive(Clone)]
pub struct Pager {
    h: Arc<Handle>,
}

impl Pager {
    /// Opens a userfaultfd (with UFFDIO_MOVE and unmap/remap events), creates the
    /// swap file and starts the fault-handler and evictor threads.
    pub fn new(cfg: PagerConfig) -> Result<Pager> {
        if mm::kernel_page_size() != mm::PAGE {
            return Err(Error::Config(format!(
                "page size {} unsupported",
                mm::kernel_page_size()
            )));
        }
        if cfg.evict_batch == 0 || cfg.evict_batch > 4096 {
            return Err(Error::Config("evict_batch must be 1..=4096".into()));
        }
        let uffd = uffd::Uffd::open(
            uffd::FEATURE_MOVE
                | uffd::FEATURE_EVENT_UNMAP
                | uffd::FEATURE_EVENT_REMAP
                | uffd::FEATURE_THREAD_ID,
        )
        .map_err(Error::Userfaultfd)?;
        if uffd.features & uffd::FEATURE_MOVE == 0 {
            return Err(Error::Userfaultfd(std::io::Error::from_raw_os_error(
                libc::ENOSYS,
            )));
        }
        if cfg.swap_io_threads > 256 {
            return Err(Error::Config("swap_io_threads must be 0..=256".into()));
        }
        let swap = swap::SwapDevice::create_with(
            cfg.swap_path.as_deref(),
            cfg.swap_size,
            cfg.o_direct,
            cfg.keep_swap_file,
            cfg.swap_io_threads,
        )?;
        let cap = cfg.evict_batch;
        let (staging, _) = AnonMapping::new_noreserve(cap * mm::PAGE)
            .map_err(|e| Error::Kernel {
                op: "mmap",
                addr: 0,
                err: e,
            })?
            .into_raw();
        // SAFETY: the staging area is our own fresh mapping.
        let _ =
            unsafe { mm::madvise(staging, cap * mm::PAGE, rustix::mm::Advice::LinuxNoHugepage) };
        if let Err(e) = uffd.register(staging, cap * mm::PAGE) {
            // SAFETY: just mapped above, unused.
            let _ = unsafe { mm::munmap(staging, cap * mm::PAGE) };
            return Err(Error::Kernel {
                op: "UFFDIO_REGISTER",
                addr: staging,
                err: e,
            });
        }
        let stop = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| Error::Kernel {
            op: "eventfd",
            addr: 0,
            err: e.into(),
        })?;
        let reserve = match cfg.zero_reserve {
            0 => None,
            pages => Some(reserve::ZeroReserve::new(pages).map_err(|e| Error::Kernel {
                op: "mmap",
                addr: 0,
                err: e,
            })?),
        };
        let inner = Arc::new(Inner::new(
            cfg,
            uffd,
            swap,
            EvictState::new(staging, cap),
            reserve,
        ));
        fork::register(&inner);
        let mut threads = Vec::new();
        let stop = Arc::new(stop);
        let (i2, sfd) = (inner.clone(), stop.clone());
        threads.push(
            std::thread::Builder::new()
                .name("vmem-fault".into())
                .spawn(move || fault::run(i2, sfd))
                .map_err(|e| Error::Kernel {
                    op: "spawn",
                    addr: 0,
                    err: e,
                })?,
        );
        if inner.cfg.background_evictor {
            let i3 = inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("vmem-evict".into())
                    .spawn(move || i3.evictor_loop())
                    .map_err(|e| Error::Kernel {
                        op: "spawn",
                        addr: 0,
                        err: e,
                    })?,
            );
        }
        if inner.reserve.is_some() {
            let i4 = inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("vmem-zero".into())
                    .spawn(move || {
                        if let Some(r) = &i4.reserve {
                            reserve::idle_priority();
                            r.refill_loop(|| {
                                i4.registered
                                    .load(Relaxed)
                                    .saturating_sub(i4.resident.load(Relaxed))
                            })
                        }
                    })
                    .map_err(|e| Error::Kernel {
                        op: "spawn",
                        addr: 0,
                        err: e,
                    })?,
            );
        }
        tracing::info!(swap = ?inner.swap.path(), slots = inner.swap.slots(), "pager started");
        Ok(Pager {
            h: Arc::new(Handle {
                inner,
                threads: parking_lot::Mutex::new(threads),
                stop,
            }),
        })
    }

    fn inner(&self) -> &Inner {
        &self.h.inner
    }

    /// A handle that does not keep the pager alive (for listeners, which
    /// the pager itself holds: a strong clone there would be a cycle).
    pub fn downgrade(&self) -> WeakPager {
        WeakPager(Arc::downgrade(&self.h))
    }

    /// Maps `len` bytes (rounded up to pages) of fresh anonymous memory and
    /// registers it; the region owns the mapping.
    pub fn alloc(&self, len: usize) -> Result<Region> {
        if len == 0 {
            return Err(Error::InvalidRange {
                addr: 0,
                len,
                why: "empty",
            });
        }
        let len = len.div_ceil(mm::PAGE) * mm::PAGE;
        let (addr, len) = AnonMapping::new_noreserve(len)
            .map_err(|e| Error::Kernel {
                op: "mmap",
                addr: 0,
                err: e,
            })?
            .into_raw();
        // SAFETY: our own fresh mapping; THP would only be split by eviction.
        let _ = unsafe { mm::madvise(addr, len, rustix::mm::Advice::LinuxNoHugepage) };
        match self.inner().register(addr, len, true, false, false) {
            Ok(id) => Ok(Region::new(self.clone(), id, addr, len)),
            Err(e) => {
                // SAFETY: registration failed; nobody else knows this mapping.
                let _ = unsafe { mm::munmap(addr, len) };
                Err(e)
            }
        }
    }

    /// Registers existing private anonymous memory `[addr, addr+len)` (whole
    /// pages covering it). Its current residency is read with mincore.
    ///
    /// # Safety
    /// The range must stay mapped while registered, or be unmapped with munmap
    /// (the pager follows munmap/mremap events). Its contents are preserved but
    /// pages may be moved to swap and back at any time.
    pub unsafe fn register(&self, addr: usize, len: usize) -> Result<Region> {
        let id = self.inner().register(addr, len, false, false, true)?;
        self.region_over(id, addr, len)
    }

    /// Registration without a handle (for C shims): undo with
    /// [`Pager::unregister`].
    ///
    /// # Safety
    /// As [`Pager::register`].
    pub unsafe fn register_raw(&self, addr: usize, len: usize) -> Result<RegionId> {
        self.inner().register(addr, len, false, false, true)
    }

    /// Registers memory the pager cannot page (hugetlbfs, file mappings
    /// outside tmpfs, or a range mixing them with managed memory: what
    /// [`Pager::register_raw`] refuses with [`Error::NotAnonymous`], or with
    /// [`Error::OtherKind`] inside such a registration) the way a pinning NIC
    /// takes it: tracked as external, every page resident, never evicted or
    /// swapped. Its munmap is not reported by userfaultfd: call
    /// [`Pager::forget_foreign`] before unmapping it. Undo with
    /// [`Pager::unregister`].
    ///
    /// # Safety
    /// The range must stay mapped while registered.
    pub unsafe fn register_foreign_raw(&self, addr: usize, len: usize) -> Result<RegionId> {
        self.inner().register(addr, len, false, true, false)
    }

    /// The application is about to unmap (or move away with mremap) `[addr,
    /// addr+len)`: the pages of external and foreign registrations there,
    /// whose munmap userfaultfd does not report, are forgotten now — as
    /// managed memory's are when its unmap event arrives (the listeners'
    /// `after_unmap`: a NIC view stops reaching them, later pins fail).
    /// Returns whether there were any. Call it before the munmap, so nothing
    /// reaches memory mapped anew at the address (the verbs library's munmap
    /// wrapper does).
    pub fn forget_foreign(&self, addr: usize, len: usize) -> bool {
        self.inner().forget_external(addr, addr.saturating_add(len))
    }

    /// Undoes a registration; a second call returns [`Error::AlreadyUnregistered`].
    pub fn unregister(&self, id: RegionId) -> Result<()> {
        self.inner().unregister(id)
    }

    /// The handle of registration `id`, covering the whole pages of `[addr, addr+len)`.
    fn region_over(&self, id: RegionId, addr: usize, len: usize) -> Result<Region> {
        let (p0, p1) = page_range(addr, len)?;
        Ok(Region::new(
            self.clone(),
            id,
            p0 * mm::PAGE,
            (p1 - p0) * mm::PAGE,
        ))
    }

    /// Tracks memory the application pages itself: all pages start resident;
    /// report changes with [`Pager::notify_swapped_out`] / [`Pager::notify_swapped_in`].
    pub fn register_external(&self, addr: usize, len: usize) -> Result<Region> {
        let id = self.inner().register(addr, len, false, true, false)?;
        self.region_over(id, addr, len)
    }

    /// External API: the application is about to reclaim these pages. Calls
    /// every listener's `before_swap_out` (in this thread) and records them
    /// absent. Fails with [`Error::Pinned`] if any page is pinned.
    pub fn notify_swapped_out(&self, addr: usize, len: usize) -> Result<()> {
        self.inner().notify_swapped_out(addr, len)
    }

    /// External API: the application brought these pages back. Records them
    /// resident and calls every listener's `after_swap_in`.
    pub fn notify_swapped_in(&self, addr: usize, len: usize) -> Result<()> {
        self.inner().notify_swapped_in(addr, len)
    }

    /// Adds a swap listener (called before pages leave); see [`SwapListener`].
    pub fn add_listener(&self, l: Arc<dyn SwapListener>) -> ListenerId {
        self.inner().listeners.add(l)
    }

    /// Returns whether a listener was removed.
    pub fn remove_listener(&self, id: ListenerId) -> bool {
        self.inner().listeners.remove(id)
    }

    /// Sets (or clears) the resident-page budget; the evictor acts at once.
    pub fn set_budget(&self, pages: Option<usize>) {
        self.inner()
            .budget
            .store(pages.unwrap_or(usize::MAX), Relaxed);
        if pages.is_some() && self.inner().cfg.background_evictor {
            self.inner().kick_evictor();
        }
    }

    /// The resident-page budget (`None` = unlimited).
    pub fn budget(&self) -> Option<usize> {
        Some(self.inner().budget.load(Relaxed)).filter(|&b| b != usize::MAX)
    }

    /// Reclaims synchronously, in this thread, until within budget.
    pub fn enforce_budget(&self) {
        self.inner().enforce_budget();
    }

    /// Pins every page of the range: brings non-resident pages in (in this
    /// thread) and keeps them from eviction until unpinned. All or nothing.
    pub fn pin(&self, addr: usize, len: usize) -> Result<()> {
        self.inner().pin(addr, len, true)
    }

    /// [`Self::pin`] of memory that the pin holder only reads (a NIC that
    /// reads it, a copy out of it): never-touched pages map the kernel's
    /// zero page, as a CPU read fault does, instead of a freshly allocated
    /// page. A later write to such a page (CPU or DMA copy) is the kernel's
    /// ordinary copy-on-write at the same address; the page stays resident
    /// and pinned in the pager's books throughout.
    pub fn pin_read(&self, addr: usize, len: usize) -> Result<()> {
        self.inner().pin(addr, len, false)
    }

    /// Brings in (unpinned) the swapped-out pages among the pages holding
    /// `addrs` — scattered pages of any registered regions, e.g. the
    /// targets of a batch of faults — with their swap reads issued
    /// concurrently (up to 256 at a time), so the device's queue depth is
    /// used. Pages not swapped out, busy, external or unregistered are
    /// skipped. Returns how many pages it brought in.
    pub fn swap_in_pages(&self, addrs: &[usize]) -> usize {
        self.inner().swap_in_pages(addrs)
    }

    /// Writes `data` at `addr` (within one page) if that page was never
    /// touched: one fill of the page with zeroes and `data` (`UFFDIO_COPY`),
    /// which leaves it resident and unpinned, instead of a zero fill and a
    /// copy. `Ok(false)`: the page was not untouched and nothing was written
    /// (write it the ordinary way); [`Error::Unmapped`]: the application
    /// unmapped it.
    pub fn write_untouched(&self, addr: usize, data: &[u8]) -> Result<bool> {
        match self.inner().write_absent_then(addr, data, false, || ())? {
            AbsentWrite::Written => Ok(true),
            AbsentWrite::Refused(e @ Error::Unmapped(_)) => Err(e),
            AbsentWrite::Skipped | AbsentWrite::Refused(_) => Ok(false),
        }
    }

    /// Writes `data` at `addr` (within one page) into a page that is not
    /// resident — never touched, or swapped out — answering the writer
    /// first: once the page is locked, `announce` runs (e.g. sends the
    /// WRITE's completion), then the page is filled with zeroes or its swap
    /// slot's contents and `data` over them (one swap read, one
    /// `UFFDIO_COPY`). Between the two, every access to the page waits for
    /// the fill (CPU faults, pins and fills wait on the page lock; the
    /// evictor skips it; [`Self::is_untouched`] says no), so the data is
    /// visible to anything ordered after the answer; a swap-in's device read
    /// leaves the writer's critical path. On [`AbsentWrite::Refused`] the
    /// caller must still write the data if it can.
    pub fn write_absent_then(
        &self,
        addr: usize,
        data: &[u8],
        announce: impl FnOnce(),
    ) -> Result<AbsentWrite> {
        self.inner().write_absent_then(addr, data, true, announce)
    }

    /// Drops one pin from every page of the range. All or nothing:
    /// [`Error::NotPinned`] if any page has no pin.
    pub fn unpin(&self, addr: usize, len: usize) -> Result<()> {
        self.inner().unpin(addr, len)
    }

    /// Whether the page holding `addr` is registered, not external, and in
    /// the pager's *untouched* state: never filled since registration (or
    /// dropped by the application), so the pager would serve it as zeroes.
    /// Not a proof of zero content on its own: a page the kernel swapped out
    /// itself before registration is also recorded untouched (its pte holds
    /// the kernel's swap entry, which a fill then finds). A page being filled
    /// (locked) is not untouched. No syscall.
    pub fn is_untouched(&self, addr: usize) -> bool {
        self.inner().is_untouched(addr)
    }

    /// Whether the page holding `addr` is registered, not external, and
    /// swapped out by this pager (a read lock, no syscall; the answer may
    /// be stale at once).
    pub fn is_swapped_out(&self, addr: usize) -> bool {
        self.inner().is_swapped_out(addr)
    }

    /// Fault injection: while `on`, every swap write fails with an I/O error, as a
    /// failing swap device's would (evictions then leave their pages resident and
    /// count `evict_failures`). For tests of what a broken device does to the
    /// layers above; off by default.
    pub fn inject_swap_write_failures(&self, on: bool) {
        self.inner()
            .swap
            .fail_writes
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether any page of `[addr, addr+len)` is in a range registered with this
    /// pager. A read lock, no syscall.
    pub fn manages(&self, addr: usize, len: usize) -> bool {
        self.inner().manages(addr, len)
    }

    /// A handle on the fault thread's progress, for waiting until it has handled
    /// every event it has read (see [`EventsHandled::wait`]). Holding it keeps
    /// nothing of the pager alive.
    pub fn events_handled(&self) -> EventsHandled {
        EventsHandled(self.inner().handler_seq.clone())
    }

    /// Whether the page holding `addr` is in a registered range the
    /// application has unmapped (or moved away with mremap): the address may
    /// hold unrelated memory now. No syscall.
    pub fn is_gone(&self, addr: usize) -> bool {
        self.inner().is_gone(addr)
    }

    /// Copies `out.len()` bytes at `addr` (inside one page) from the swap
    /// slot of a page the pager holds swapped out, without swapping it in
    /// (one swap read; the page stays swapped out). The page read stays in a
    /// small swap cache until the page's swap-in, which usually follows and
    /// then costs no second device read (`PagerStats::swap_cache_hits`). `Ok(false)` if the page
    /// is not swapped out by this pager (resident, untouched, external, or
    /// in transition) or the range crosses a page: nothing was copied.
    pub fn read_swapped(&self, addr: usize, out: &mut [u8]) -> Result<bool> {
        self.inner().read_swapped(addr, out)
    }

    /// Whether the page holding `addr` is resident (false if not registered).
    pub fn is_resident(&self, addr: usize) -> bool {
        self.inner().is_resident(addr)
    }

    /// Residency bitmap of the pages covering the range (bit i = page i).
    pub fn resident_bitmap(&self, addr: usize, len: usize) -> Result<Vec<u64>> {
        self.inner().resident_bitmap(addr, len)
    }

    /// Residency of the pages covering the range, one bool per page.
    pub fn resident(&self, addr: usize, len: usize) -> Result<Vec<bool>> {
        let (p0, p1) = page_range(addr, len)?;
        let bits = self.resident_bitmap(addr, len)?;
        Ok((0..p1 - p0)
            .map(|i| bits[i / 64] & (1 << (i % 64)) != 0)
            .collect())
    }

    /// Appends the residency of the pages covering the range to `out`.
    pub fn resident_into(&self, addr: usize, len: usize, out: &mut Vec<bool>) -> Result<()> {
        let (p0, p1) = page_range(addr, len)?;
        let bits = self.resident_bitmap(addr, len)?;
        out.extend((0..p1 - p0).map(|i| bits[i / 64] & (1 << (i % 64)) != 0));
        Ok(())
    }

    /// The page size the pager works with.
    pub fn page_size(&self) -> usize {
        mm::PAGE
    }

    /// Number of resident pages covering the range.
    pub fn resident_count(&self, addr: usize, len: usize) -> Result<usize> {
        Ok(self
            .resident_bitmap(addr, len)?
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum())
    }

    /// Swaps out the resident, unpinned pages of the range (listeners first);
    /// returns how many went to swap.
    pub fn swap_out(&self, addr: usize, len: usize) -> Result<usize> {
        let (p0, p1) = page_range(addr, len)?;
        self.inner().swap_out_range(p0, p1)
    }

    /// Brings every page of the range in (in this thread); returns how many
    /// were not resident.
    pub fn prefetch(&self, addr: usize, len: usize) -> Result<usize> {
        self.inner().prefetch(addr, len)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PagerStats {
        let i = self.inner();
        let c = &i.stats.c;
        let swap_ins = c.swap_ins.load(Relaxed);
        let swap_outs = c.swap_outs.load(Relaxed);
        PagerStats {
            resident_pages: i.resident.load(Relaxed),
            resident_high: i.resident_high.load(Relaxed),
            registered_pages: i.registered.load(Relaxed),
            swap_slots_used: i.swap.used(),
            swap_slots_total: i.swap.slots(),
            budget_pages: self.budget(),
            minor_faults: c.minor_faults.load(Relaxed),
            major_faults: c.major_faults.load(Relaxed),
            spurious_faults: c.spurious_faults.load(Relaxed),
            swap_ins,
            swap_outs,
            zero_fills: c.zero_fills.load(Relaxed),
            pin_swap_ins: c.pin_swap_ins.load(Relaxed),
            evict_aborts: c.evict_aborts.load(Relaxed),
            young_spared: c.young_spared.load(Relaxed),
            evict_failures: c.evict_failures.load(Relaxed),
            swap_full: c.swap_full.load(Relaxed),
            fault_retries: c.fault_retries.load(Relaxed),
            batched_swap_reads: c.batched_swap_reads.load(Relaxed),
            batched_swap_writes: c.batched_swap_writes.load(Relaxed),
            evict_vetoes: c.evict_vetoes.load(Relaxed),
            swap_write_failures: c.swap_write_failures.load(Relaxed),
            budget_waits: c.budget_waits.load(Relaxed),
            budget_overruns: c.budget_overruns.load(Relaxed),
            budget_slack: self.budget().map_or(0, |b| i.slack(b)),
            swap_cache_hits: i.swap.cache_hits(),
            swap_io: i.swap.io(),
            bytes_swapped_in: swap_ins * mm::PAGE as u64,
            bytes_swapped_out: swap_outs * mm::PAGE as u64,
            fault_service: i.stats.latency(),
            zero_reserve_pages: i.reserve.as_ref().map_or(0, |r| r.pages()),
            zero_reserve_moved: i.reserve.as_ref().map_or(0, |r| r.moved.load(Relaxed)),
            zero_reserve_populated: i.reserve.as_ref().map_or(0, |r| r.populated.load(Relaxed)),
        }
    }

    /// Pages of the managed regions resident by the kernel's account
    /// (`mincore` over every region), beside [`PagerStats::resident_pages`],
    /// the pager's own count: a check of the budget that does not trust the
    /// pager.
    pub fn kernel_resident_pages(&self) -> usize {
        self.inner().kernel_resident()
    }

    /// Faults the fault thread resolved, per faulting thread (userfaultfd
    /// THREAD_ID), sorted by thread id.
    pub fn faults_by_thread(&self) -> Vec<ThreadFaults> {
        self.inner().stats.faults_by_thread()
    }

    /// Clears the fault-service histogram (benchmarks).
    pub fn reset_fault_histogram(&self) {
        self.inner().stats.hist.lock().reset();
    }

    /// How the swap file is read and written: O_DIRECT (the default), or
    /// buffered as configured, or buffered because the filesystem refused
    /// O_DIRECT; reports label their major faults with it.
    pub fn swap_io(&self) -> SwapIo {
        self.inner().swap.io()
    }

    /// The swap device's own 4 KiB random-read latency, measured on this
    /// pager's swap file with O_DIRECT (bypassing the page cache even when
    /// the pager itself runs buffered): up to `min(reads, 4096)` free slots
    /// are written with O_DIRECT and synced, `reads` of them are read one at
    /// a time, then `reads` more `depth` at a time; the slots are freed
    /// again. Swap I/O of the pager may run meanwhile (it shares the device).
    /// Errors: bad parameters, a full swap file, a filesystem refusing
    /// O_DIRECT.
    pub fn device_read_latency(&self, depth: usize, reads: usize) -> Result<DeviceLatency> {
        self.inner().swap.device_read_latency(depth, reads)
    }

    /// Path of the swap file (unlinked unless `keep_swap_file`).
    pub fn swap_path(&self) -> &Path {
        self.inner().swap.path()
    }
}

/// See [`Pager::downgrade`].
#[derive(Clone)]
pub struct WeakPager(std::sync::Weak<Handle>);

impl WeakPager {
    /// The pager, if it is still alive.
    pub fn upgrade(&self) -> Option<Pager> {
        self.0.upgrade().map(|h| Pager { h })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let ids: Vec<RegionId> = self.inner.space.read().regs.keys().copied().collect();
        for id in ids {
            let _ = self.inner.unregister(id);
        }
        self.inner.shutdown.store(true, Release);
        let _ = rustix::io::write(&*self.stop, &1u64.to_ne_bytes());
        {
            let _k = self.inner.kick.lock();
            self.inner.kick_cv.notify_all();
        }
        if let Some(r) = &self.inner.reserve {
            r.stop();
        }
        for t in self.threads.lock().drain(..) {
            // The last handle may be dropped by a listener on the evictor
            // thread itself: that thread exits on its own.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // The staging area goes with `Inner`, after the last thread is gone.
        tracing::info!("pager stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_swapped_copies_from_the_slot_and_leaves_the_page_out() {
        let p = Pager::new(PagerConfig {
            swap_size: 1 << 20,
            background_evictor: false,
            ..Default::default()
        })
        .unwrap();
        let mut r = p.alloc(4 * PAGE_SIZE).unwrap();
        for (i, b) in r.as_mut_slice()[..3 * PAGE_SIZE].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let a = r.addr();
        p.swap_out(a, 2 * PAGE_SIZE).unwrap();
        let ins = p.stats().swap_ins;
        let mut out = [0u8; 16];
        assert!(p.read_swapped(a + PAGE_SIZE + 100, &mut out).unwrap());
        let want: Vec<u8> = (PAGE_SIZE + 100..PAGE_SIZE + 116)
            .map(|i| (i % 251) as u8)
            .collect();
        assert_eq!(&out[..], &want[..]);
        assert!(!p.is_resident(a + PAGE_SIZE), "still swapped out");
        assert_eq!(p.stats().swap_ins, ins);
        // Not swapped out here: nothing copied.
        let mut z = [7u8; 16];
        assert!(
            !p.read_swapped(a + 2 * PAGE_SIZE, &mut z).unwrap(),
            "resident"
        );
        assert!(
            !p.read_swapped(a + 3 * PAGE_SIZE, &mut z).unwrap(),
            "untouched"
        );
        assert!(
            !p.read_swapped(a + PAGE_SIZE - 8, &mut z).unwrap(),
            "crosses a page"
        );
        assert!(!p.read_swapped(a, &mut []).unwrap(), "empty");
        assert_eq!(z, [7u8; 16]);
        assert!(
            p.read_swapped(usize::MAX & !4095, &mut z).is_err(),
            "not registered"
        );
        // The page still comes back intact afterwards.
        assert_eq!(
            r.as_slice()[PAGE_SIZE + 100],
            ((PAGE_SIZE + 100) % 251) as u8
        );
        assert_eq!(p.stats().swap_ins, ins + 1);
    }

    #[test]
    fn swap_write_failure_keeps_pages_resident_and_intact() {
        let p = Pager::new(PagerConfig {
            swap_size: 1 << 20,
            background_evictor: false,
            ..Default::default()
        })
        .unwrap();
        let mut r = p.alloc(8 * PAGE_SIZE).unwrap();
        for (i, b) in r.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        p.inner().swap.fail_writes.store(true, Relaxed);
        assert_eq!(r.swap_out().unwrap(), 0);
        let s = p.stats();
        assert_eq!(s.evict_failures, 8);
        assert_eq!(s.swap_slots_used, 0);
        assert_eq!(r.resident_count().unwrap(), 8);
        assert!(r
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 253) as u8));
        assert_eq!(
            p.stats().spurious_faults + p.stats().minor_faults + p.stats().major_faults,
            8,
            "no fault after put-back"
        );
        p.inner().swap.fail_writes.store(false, Relaxed);
        assert_eq!(
            r.swap_out().unwrap(),
            8,
            "transient failures are retried later"
        );
        assert!(r
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 253) as u8));
    }

    fn fill(r: &mut Region, seed: usize) {
        for (i, b) in r.as_mut_slice().iter_mut().enumerate() {
            *b = ((i / PAGE_SIZE) * 31 + i % 253 + seed) as u8;
        }
    }

    fn exact(r: &Region, seed: usize) -> bool {
        r.as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == ((i / PAGE_SIZE) * 31 + i % 253 + seed) as u8)
    }

    fn cfg() -> PagerConfig {
        PagerConfig {
            swap_size: 1 << 20,
            background_evictor: false,
            ..Default::default()
        }
    }

    #[test]
    fn default_swap_is_o_direct_and_round_trips_byte_exact() {
        let p = Pager::new(cfg()).unwrap();
        // O_DIRECT by default (on a memory filesystem it says so instead).
        assert!(p.swap_io().is_direct(), "{:?}", p.swap_io());
        assert_eq!(p.stats().swap_io, p.swap_io());
        let mut r = p.alloc(16 * PAGE_SIZE).unwrap();
        fill(&mut r, 1);
        assert_eq!(r.swap_out().unwrap(), 16);
        assert_eq!(r.resident_count().unwrap(), 0);
        // Faults: one page at a time, each read in the fault thread.
        assert!(exact(&r, 1));
        let s = p.stats();
        assert_eq!(s.major_faults, 16);
        assert_eq!(s.batched_swap_reads, 0);
        // Again through a pin of the whole range (one run of 16 slots).
        assert_eq!(r.swap_out().unwrap(), 16);
        p.pin(r.addr(), r.len()).unwrap();
        assert!(exact(&r, 1));
        p.unpin(r.addr(), r.len()).unwrap();
    }

    /// Swaps the pages of `r` out one at a time, last page first: page k
    /// lands in a slot below page k-1's, so no two pages form a run.
    fn swap_out_scattered(p: &Pager, r: &Region) {
        for k in (0..r.len() / PAGE_SIZE).rev() {
            assert_eq!(p.swap_out(r.addr() + k * PAGE_SIZE, PAGE_SIZE).unwrap(), 1);
        }
    }

    #[test]
    fn pin_and_prefetch_read_scattered_swapped_pages_concurrently() {
        let p = Pager::new(cfg()).unwrap();
        let mut r = p.alloc(48 * PAGE_SIZE).unwrap();
        fill(&mut r, 2);
        swap_out_scattered(&p, &r);
        p.pin(r.addr(), r.len()).unwrap();
        let s = p.stats();
        assert_eq!(s.batched_swap_reads, 48, "one concurrent read per page");
        assert_eq!(s.pin_swap_ins, 48);
        assert_eq!(r.resident_count().unwrap(), 48);
        assert_eq!(r.swap_out().unwrap(), 0, "pinned pages stay");
        p.unpin(r.addr(), r.len()).unwrap();
        assert!(
            matches!(p.unpin(r.addr(), PAGE_SIZE), Err(Error::NotPinned(_))),
            "exactly one pin per page"
        );
        assert!(exact(&r, 2));
        assert_eq!(s.major_faults, 0, "no page was faulted in");
        swap_out_scattered(&p, &r);
        assert_eq!(p.prefetch(r.addr(), r.len()).unwrap(), 48);
        assert_eq!(p.stats().batched_swap_reads, 96);
        assert_eq!(r.resident_count().unwrap(), 48);
        assert!(exact(&r, 2));
        assert_eq!(p.stats().major_faults, 0);
        assert_eq!(p.stats().swap_slots_used, 0);
    }

    #[test]
    fn eviction_batch_over_scattered_slots_writes_concurrently() {
        let p = Pager::new(cfg()).unwrap();
        let mut a = p.alloc(8 * PAGE_SIZE).unwrap();
        fill(&mut a, 3);
        assert_eq!(a.swap_out().unwrap(), 8);
        // Bring back pages 1, 3 and 5: their slots are free again.
        for k in [1, 3, 5] {
            p.pin(a.addr() + k * PAGE_SIZE, PAGE_SIZE).unwrap();
            p.unpin(a.addr() + k * PAGE_SIZE, PAGE_SIZE).unwrap();
        }
        let mut b = p.alloc(6 * PAGE_SIZE).unwrap();
        fill(&mut b, 4);
        assert_eq!(b.swap_out().unwrap(), 6);
        assert!(p.stats().batched_swap_writes >= 2, "{:?}", p.stats());
        assert!(exact(&b, 4));
        assert!(exact(&a, 3));
    }

    #[test]
    fn refused_o_direct_pager_is_buffered_labelled_and_byte_exact() {
        swap::REFUSE_O_DIRECT.with(|r| r.set(true));
        let p = Pager::new(cfg());
        swap::REFUSE_O_DIRECT.with(|r| r.set(false));
        let p = p.unwrap();
        assert_eq!(p.swap_io(), SwapIo::BufferedFallback);
        assert_eq!(p.stats().swap_io, SwapIo::BufferedFallback);
        let mut r = p.alloc(8 * PAGE_SIZE).unwrap();
        fill(&mut r, 5);
        assert_eq!(r.swap_out().unwrap(), 8);
        assert!(exact(&r, 5));
        // Explicitly buffered is labelled as such.
        let b = Pager::new(PagerConfig {
            o_direct: false,
            ..cfg()
        })
        .unwrap();
        assert_eq!(b.swap_io(), SwapIo::Buffered);
    }

    #[test]
    fn device_baseline_reads_the_swap_file_and_frees_its_slots() {
        let p = Pager::new(cfg()).unwrap();
        let mut r = p.alloc(4 * PAGE_SIZE).unwrap();
        fill(&mut r, 7);
        assert_eq!(r.swap_out().unwrap(), 4);
        let used = p.stats().swap_slots_used;
        let d = p.device_read_latency(4, 64).unwrap();
        assert_eq!((d.reads, d.depth), (64, 4));
        assert!(d.min_us > 0.0 && d.min_us <= d.median_us && d.median_us <= d.max_us);
        assert!(d.median_us <= d.p99_us && d.p99_us <= d.max_us);
        assert!(d.min_us <= d.mean_us && d.mean_us <= d.max_us);
        assert!(d.iops > 0.0 && d.iops_at_depth > 0.0 && d.median_us_at_depth > 0.0);
        assert_eq!(p.stats().swap_slots_used, used, "baseline slots freed");
        assert!(exact(&r, 7), "the pager's own slots untouched");
        assert!(p.device_read_latency(0, 64).is_err());
        // A full swap file: a clear error, nothing leaked.
        let full = Pager::new(PagerConfig {
            swap_size: 4 * PAGE_SIZE as u64,
            ..cfg()
        })
        .unwrap();
        let mut f = full.alloc(4 * PAGE_SIZE).unwrap();
        fill(&mut f, 6);
        assert_eq!(f.swap_out().unwrap(), 4);
        let e = full.device_read_latency(1, 8);
        assert!(matches!(e, Err(Error::SwapFull(4))), "{e:?}");
        assert_eq!(full.stats().swap_slots_used, 4);
    }

    /// A budget the swap device cannot hold: the pager says so (a counted,
    /// logged swap-full event) instead of silently keeping the excess, the
    /// data stays intact, and slots freed later make the budget hold again.
    #[test]
    fn a_full_swap_device_is_reported_and_the_data_stays_intact() {
        let p = Pager::new(PagerConfig {
            swap_size: 8 * PAGE_SIZE as u64,
            budget_pages: Some(4),
            background_evictor: true,
            ..cfg()
        })
        .unwrap();
        let mut r = p.alloc(32 * PAGE_SIZE).unwrap();
        fill(&mut r, 9);
        let t = std::time::Instant::now();
        while p.stats().swap_full == 0 && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let s = p.stats();
        assert!(s.swap_full > 0, "no swap-full event: {s:?}");
        assert_eq!(s.swap_slots_used, s.swap_slots_total, "{s:?}");
        assert!(
            s.resident_pages > 4,
            "over budget while the device is full: {s:?}"
        );
        assert!(exact(&r, 9), "data intact");
        // Dropping memory frees slots: the budget holds again.
        drop(r);
        assert_eq!(p.stats().swap_slots_used, 0);
    }

    #[test]
    fn read_swapped_then_swap_in_reads_the_device_once_and_never_stale() {
        let p = Pager::new(cfg()).unwrap();
        let mut r = p.alloc(2 * PAGE_SIZE).unwrap();
        fill(&mut r, 8);
        assert_eq!(r.swap_out().unwrap(), 2);
        let mut out = [0u8; 8];
        assert!(p.read_swapped(r.addr() + 16, &mut out).unwrap());
        // The pin that follows is served by the swap cache.
        p.pin(r.addr(), PAGE_SIZE).unwrap();
        p.unpin(r.addr(), PAGE_SIZE).unwrap();
        assert_eq!(p.stats().swap_cache_hits, 1);
        assert!(exact(&r, 8));
        assert_eq!(p.stats().swap_cache_hits, 1, "page 1 came from the device");
        // A freed slot's cached copy goes with it: a region dropped while
        // swapped out frees its slot, which the next swap-out reuses.
        let mut a = p.alloc(PAGE_SIZE).unwrap();
        fill(&mut a, 9);
        assert_eq!(a.swap_out().unwrap(), 1);
        assert!(p.read_swapped(a.addr(), &mut out).unwrap());
        drop(a);
        let mut b = p.alloc(PAGE_SIZE).unwrap();
        fill(&mut b, 10);
        assert_eq!(b.swap_out().unwrap(), 1);
        assert!(exact(&b, 10), "the new content, not the freed slot's");
        assert_eq!(p.stats().swap_cache_hits, 1);
    }
}
