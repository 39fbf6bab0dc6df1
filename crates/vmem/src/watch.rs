//! Following munmap / mremap of memory the pager does not manage (a pinned MR's
//! buffer): [`UnmapWatch`] registers ranges with a userfaultfd of its own in
//! write-protect mode — no page is ever write-protected, so nothing ever faults to
//! it — only to receive the kernel's UNMAP and REMAP events, and a thread that blocks
//! on that descriptor tells each watch whose bytes an event covers that its memory is
//! gone.
//!
//! The kernel holds the unmapping thread until the event has been read, so a watch
//! hears of an munmap before the application can map anything new in its place —
//! but its callback runs just after the read, when the application may already be
//! mapping. A [`Hold`] closes that window: the thread takes it when an event is
//! pending, before reading, and drops it once the callbacks have run (a NIC holds its
//! DMA that long, so no copy meets memory mapped in between). `MADV_DONTNEED` is not
//! followed: the range stays mapped (it reads as zeroes afterwards), and REMOVE
//! events would stall every such `madvise` on this thread.

use crate::mm::PAGE;
use crate::uffd::{Msg, Uffd, EVENT_REMAP, EVENT_UNMAP, FEATURE_EVENT_REMAP, FEATURE_EVENT_UNMAP};
use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags};
use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Write-protect registration of shmem / hugetlbfs ranges (linux/userfaultfd.h).
const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;

/// What a watch runs, once, on the watch thread when its memory is unmapped or moved.
/// It must not unmap watched memory itself (the kernel would wait for this very
/// thread to read the event).
pub type OnGone = Box<dyn FnOnce() + Send>;

/// Taken by the watch thread when events are pending, before it reads them; what it
/// returns is dropped once their callbacks have run.
pub type Hold = Box<dyn Fn() -> Box<dyn std::any::Any> + Send + Sync>;

/// Names one watch, for [`UnmapWatch::unwatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WatchId(u64);

struct Watch {
    start: usize,
    end: usize,
    on_gone: OnGone,
}

impl Watch {
    fn pages(&self) -> (usize, usize) {
        page_span(self.start, self.end)
    }
}

fn page_span(start: usize, end: usize) -> (usize, usize) {
    (start & !(PAGE - 1), end.div_ceil(PAGE) * PAGE)
}

struct Inner {
    uffd: Uffd,
    /// Written once to stop the thread.
    stop: OwnedFd,
    watches: Mutex<Watches>,
    hold: Option<Hold>,
}

#[derive(Default)]
struct Watches {
    next: u64,
    live: BTreeMap<WatchId, Watch>,
}

impl Watches {
    /// Unregisters the pages of `[start, end)` that no live watch still covers.
    fn release(&self, uffd: &Uffd, start: usize, end: usize) {
        let mut covered: Vec<(usize, usize)> = self
            .live
            .values()
            .map(Watch::pages)
            .filter(|&(s, e)| s < end && e > start)
            .collect();
        covered.sort_unstable();
        let mut at = start;
        for (s, e) in covered.into_iter().chain([(end, end)]) {
            if s > at {
                // Errors (a hole: the memory is already gone) leave nothing to undo.
                let _ = uffd.unregister(at, s.min(end) - at);
            }
            at = at.max(e);
            if at >= end {
                break;
            }
        }
    }
}

/// A userfaultfd that reports munmap / mremap of registered ranges (see the module
/// documentation). One per process is enough: a range can belong to one userfaultfd
/// only, so several would refuse each other's overlapping ranges.
pub struct UnmapWatch {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl UnmapWatch {
    /// Opens the userfaultfd and starts the thread that reads its events.
    pub fn new() -> io::Result<UnmapWatch> {
        Self::start(None)
    }

    /// As [`Self::new`], with `hold` taken around the reading and handling of each
    /// batch of events.
    pub fn with_hold(hold: Hold) -> io::Result<UnmapWatch> {
        Self::start(Some(hold))
    }

    fn start(hold: Option<Hold>) -> io::Result<UnmapWatch> {
        let events = FEATURE_EVENT_UNMAP | FEATURE_EVENT_REMAP;
        let uffd =
            Uffd::open(events | FEATURE_WP_HUGETLBFS_SHMEM).or_else(|_| Uffd::open(events))?;
        let stop = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        let inner = Arc::new(Inner {
            uffd,
            stop,
            watches: Mutex::new(Watches::default()),
            hold,
        });
        let thread = {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("vmem-unmap-watch".into())
                .spawn(move || inner.run())?
        };
        Ok(UnmapWatch {
            inner,
            thread: Some(thread),
        })
    }

    /// Watches `[addr, addr+len)`: `on_gone` runs once on the watch thread when any of
    /// its bytes is unmapped or moved away by mremap, unless [`Self::unwatch`] came
    /// first. Fails (and `on_gone` is dropped unrun) if the kernel refuses the range:
    /// not all mapped, not anonymous / shmem / hugetlbfs memory, or already attached
    /// to another userfaultfd (the application's own, or a pager's).
    pub fn watch(&self, addr: usize, len: usize, on_gone: OnGone) -> io::Result<WatchId> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let (ps, pe) = page_span(addr, end);
        let mut w = self.inner.watches.lock();
        // Under the lock: an unwatch of an overlapping range must not unregister
        // pages between this registration and the insertion below.
        self.inner.uffd.register_events_only(ps, pe - ps)?;
        w.next += 1;
        let id = WatchId(w.next);
        w.live.insert(
            id,
            Watch {
                start: addr,
                end,
                on_gone,
            },
        );
        Ok(id)
    }

    /// Ends a watch without running it; its pages no other watch covers leave the
    /// userfaultfd. Returns false if the watch had already fired (its `on_gone` has
    /// run or is running on the watch thread).
    pub fn unwatch(&self, id: WatchId) -> bool {
        let mut w = self.inner.watches.lock();
        match w.live.remove(&id) {
            Some(gone) => {
                let (ps, pe) = gone.pages();
                w.release(&self.inner.uffd, ps, pe);
                true
            }
            None => false,
        }
    }

    /// How many watches are live.
    pub fn len(&self) -> usize {
        self.inner.watches.lock().live.len()
    }

    /// Whether no watch is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for UnmapWatch {
    fn drop(&mut self) {
        let _ = rustix::io::write(&self.inner.stop, &1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let w = self.inner.watches.lock();
        for g in w.live.values() {
            let (ps, pe) = g.pages();
            let _ = self.inner.uffd.unregister(ps, pe - ps);
        }
    }
}

impl Inner {
    /// The watch thread: blocks in poll until an event (or the stop signal) arrives.
    fn run(&self) {
        let mut msgs = [Msg::default(); 16];
        loop {
            let mut fds = [
                PollFd::new(self.uffd.fd(), PollFlags::IN),
                PollFd::new(&self.stop, PollFlags::IN),
            ];
            match rustix::event::poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!("unmap watch: poll failed ({e}); munmap of watched memory is no longer followed");
                    return;
                }
            }
            if !fds[1].revents().is_empty() {
                return;
            }
            let held = self.hold.as_ref().map(|h| h());
            let n = match self.uffd.read_msgs(&mut msgs) {
                Ok(n) => n,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    continue
                }
                Err(e) => {
                    tracing::warn!("unmap watch: read failed ({e}); munmap of watched memory is no longer followed");
                    return;
                }
            };
            for m in &msgs[..n] {
                match m.event {
                    EVENT_UNMAP => self.gone(m.a0 as usize, m.a1 as usize, None),
                    // The moved range keeps our registration at its new place.
                    EVENT_REMAP => self.gone(
                        m.a0 as usize,
                        m.a0.saturating_add(m.a2) as usize,
                        Some((m.a1 as usize, m.a1.saturating_add(m.a2) as usize)),
                    ),
                    _ => {}
                }
            }
            drop(held);
        }
    }

    /// `[start, end)` was unmapped (or moved to `moved_to`): fire every watch that
    /// overlaps it, outside the lock.
    fn gone(&self, start: usize, end: usize, moved_to: Option<(usize, usize)>) {
        let fired: Vec<Watch> = {
            let mut w = self.watches.lock();
            let ids: Vec<WatchId> = w
                .live
                .iter()
                .filter(|(_, g)| g.start < end && g.end > start)
                .map(|(id, _)| *id)
                .collect();
            let fired = ids.iter().filter_map(|id| w.live.remove(id)).collect();
            if let Some((ts, te)) = moved_to {
                let (ps, pe) = page_span(ts, te);
                w.release(&self.uffd, ps, pe);
            }
            fired
        };
        for g in fired {
            tracing::debug!(start = g.start, end = g.end, "watched memory unmapped");
            (g.on_gone)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn map(len: usize) -> usize {
        crate::AnonMapping::new(len).unwrap().into_raw().0
    }

    fn unmap(addr: usize, len: usize) {
        // SAFETY: the test's own mapping, not referenced afterwards.
        unsafe { rustix::mm::munmap(addr as *mut _, len).unwrap() };
    }

    fn fired(tx: &mpsc::Sender<u32>, tag: u32) -> OnGone {
        let tx = tx.clone();
        Box::new(move || tx.send(tag).unwrap())
    }

    #[test]
    fn munmap_fires_the_overlapping_watches_only() {
        let w = UnmapWatch::new().unwrap();
        let (tx, rx) = mpsc::channel();
        let a = map(4 * PAGE);
        // Two watches sharing the second page, one on the last page only.
        w.watch(a + 100, PAGE, fired(&tx, 1)).unwrap();
        w.watch(a + PAGE + 8, 16, fired(&tx, 2)).unwrap();
        w.watch(a + 3 * PAGE, PAGE, fired(&tx, 3)).unwrap();
        unmap(a + PAGE, PAGE);
        let mut got = vec![
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        ];
        got.sort();
        assert_eq!(got, [1, 2]);
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        assert_eq!(w.len(), 1);
        unmap(a, PAGE);
        unmap(a + 2 * PAGE, 2 * PAGE);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 3);
        assert!(w.is_empty());
    }

    #[test]
    fn unwatch_releases_only_pages_no_other_watch_covers() {
        let w = UnmapWatch::new().unwrap();
        let (tx, rx) = mpsc::channel();
        let a = map(2 * PAGE);
        let one = w.watch(a, 8, fired(&tx, 1)).unwrap();
        w.watch(a + 64, 8, fired(&tx, 2)).unwrap();
        let three = w.watch(a + PAGE, 8, fired(&tx, 3)).unwrap();
        assert!(w.unwatch(one));
        assert!(!w.unwatch(one));
        assert!(w.unwatch(three));
        // The first page is still watched (by 2), the second is not any more.
        unmap(a + PAGE, PAGE);
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        unmap(a, PAGE);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 2);
    }

    #[test]
    fn mremap_away_fires_and_the_new_place_is_released() {
        let w = UnmapWatch::new().unwrap();
        let (tx, rx) = mpsc::channel();
        let a = map(2 * PAGE);
        let dst = map(2 * PAGE);
        w.watch(a, 2 * PAGE, fired(&tx, 1)).unwrap();
        // SAFETY: moves the test's own mapping over its other own mapping.
        let moved = unsafe {
            rustix::mm::mremap_fixed(
                a as *mut _,
                2 * PAGE,
                2 * PAGE,
                rustix::mm::MremapFlags::MAYMOVE,
                dst as *mut _,
            )
        }
        .unwrap() as usize;
        assert_eq!(moved, dst);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 1);
        // The moved memory is usable, and another watch can take it.
        // SAFETY: dst is mapped, 2 pages.
        unsafe { (dst as *mut u8).write(7) };
        let again = w.watch(dst, PAGE, fired(&tx, 2)).unwrap();
        assert!(w.unwatch(again));
        unmap(dst, 2 * PAGE);
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    }

    #[test]
    fn refused_ranges_are_errors() {
        let w = UnmapWatch::new().unwrap();
        let a = map(PAGE);
        assert!(w.watch(a, 0, Box::new(|| {})).is_err(), "empty");
        assert!(
            w.watch(usize::MAX - 8, 16, Box::new(|| {})).is_err(),
            "wraps"
        );
        // A regular file's mapping is not memory userfaultfd can follow.
        let f = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
        // SAFETY: a fresh read-only private mapping of a file we hold open.
        let m = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                PAGE,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE,
                &f,
                0,
            )
        }
        .unwrap() as usize;
        assert!(w.watch(m, PAGE, Box::new(|| {})).is_err(), "file mapping");
        assert!(w.is_empty());
        unmap(m, PAGE);
        unmap(a, PAGE);
    }

    #[test]
    fn the_hold_covers_the_read_and_the_callbacks() {
        use std::sync::atomic::{AtomicU32, Ordering};
        static HELD: AtomicU32 = AtomicU32::new(0);
        struct Guard;
        impl Drop for Guard {
            fn drop(&mut self) {
                HELD.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let w = UnmapWatch::with_hold(Box::new(|| {
            HELD.fetch_add(1, Ordering::SeqCst);
            Box::new(Guard)
        }))
        .unwrap();
        let (tx, rx) = mpsc::channel();
        let a = map(PAGE);
        w.watch(
            a,
            PAGE,
            Box::new(move || tx.send(HELD.load(Ordering::SeqCst)).unwrap()),
        )
        .unwrap();
        unmap(a, PAGE);
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            1,
            "held in the callback"
        );
        drop(w);
        assert_eq!(HELD.load(Ordering::SeqCst), 0, "released after");
    }
}
