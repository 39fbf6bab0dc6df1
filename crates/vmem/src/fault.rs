//! The fault-handler thread: reads userfaultfd messages, resolves missing
//! faults (zero page or swap read + UFFDIO_COPY) and follows the application's
//! munmap/mremap. It spins on non-blocking reads for `PagerConfig::spin` after
//! the last message, then blocks in poll(2).

use crate::core::{Brought, Inner, Why};
use crate::error::Error;
use crate::mm::{PageBuf, PAGE, PAGE_SHIFT};
use crate::stats::inc;
use crate::uffd::{self, Msg};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::Instant;

/// The sequential first-touch streams the fault thread follows (Linux's
/// readahead window, applied to fault-around): for each of the last few
/// streams, the page its next in-order fault would hit and the run its
/// last fault got. A fault there gets twice that run (up to the maximum);
/// any other fault starts a stream at `PagerConfig::fault_around`.
struct Streams {
    s: [(usize, usize); 4],
    next_slot: usize,
    /// The first run of a stream (`PagerConfig::fault_around`).
    base: usize,
    /// The longest (`PagerConfig::fault_around_max`, at most an eighth of
    /// the budget).
    max: usize,
}

impl Streams {
    fn new(cfg: &crate::PagerConfig) -> Streams {
        Streams {
            s: [(0, 0); 4],
            next_slot: 0,
            base: cfg.fault_around,
            max: match cfg.budget_pages {
                Some(b) => cfg.fault_around_max.min(b / 8),
                None => cfg.fault_around_max,
            },
        }
    }

    /// The run for a first-touch fault at page `p`.
    fn window(&self, p: usize) -> usize {
        match self.s.iter().find(|s| s.0 == p && s.1 > 0) {
            Some(&(_, w)) if self.max > self.base => (w * 2).clamp(self.base, self.max),
            _ => self.base,
        }
    }

    /// Whether a run of `w` pages is a grown stream's longest (one worth
    /// filling ahead of).
    fn at_max(&self, w: usize) -> bool {
        self.max > self.base && w >= self.max
    }

    /// A fault at `p` got a run of `w` pages of which `n` were filled.
    fn ran(&mut self, p: usize, n: usize, w: usize) {
        let i = match self.s.iter().position(|s| s.0 == p) {
            Some(i) => i,
            None => {
                self.next_slot = (self.next_slot + 1) % self.s.len();
                self.next_slot
            }
        };
        self.s[i] = (p + n, w);
    }
}

/// Runs a write stream at its longest run is filled ahead of the writer
/// (while no fault waits): the writer then runs through them without a
/// userfault, instead of one hand-off to this thread per run.
const AHEAD_RUNS: usize = 2;

/// Fill-ahead still to do for a stream: `runs` runs of `window` pages from
/// page `next` of segment `arr` (ending at `end`).
struct Ahead {
    arr: Arc<crate::state::PageArray>,
    next: usize,
    end: usize,
    window: usize,
    runs: usize,
}

/// The fault thread's own state between messages.
struct Handler {
    /// A page of buffer for page-at-a-time fills.
    buf: PageBuf,
    streams: Streams,
    ahead: Option<Ahead>,
}

/// Spinning without a fault longer than this yields the core at every turn.
const YIELD_AFTER: std::time::Duration = std::time::Duration::from_micros(10);

pub fn run(inner: Arc<Inner>, stop: Arc<OwnedFd>) {
    let mut msgs = [Msg::default(); 32];
    let mut h = Handler {
        buf: PageBuf::new(1),
        streams: Streams::new(&inner.cfg),
        ahead: None,
    };
    let spin = inner.cfg.spin;
    let mut last = Instant::now();
    // Faults the kernel asked us to retry (an munmap/mremap in flight); their
    // threads stay blocked until served.
    let mut deferred: Vec<Msg> = Vec::new();
    crate::core::IS_HANDLER.with(|h| h.set(true));
    loop {
        // Odd while reading and handling (see Inner::quiesce_events).
        inner.handler_seq.fetch_add(1, SeqCst);
        let r = inner.uffd.read_msgs(&mut msgs);
        let fresh = if let Ok(n) = r {
            &msgs[..n]
        } else {
            &msgs[..0]
        };
        let retry = std::mem::take(&mut deferred);
        let nretry = retry.len();
        for (i, m) in retry.iter().chain(fresh).enumerate() {
            let first = i >= nretry;
            // A bug must not leave faulting threads hanging forever.
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                handle(&inner, m, &mut h, first)
            }));
            match res {
                Ok(true) => {}
                Ok(false) => deferred.push(*m),
                Err(_) => {
                    tracing::error!(event = m.event, "panic while handling a userfaultfd event")
                }
            }
        }
        inner.handler_seq.fetch_add(1, SeqCst);
        match r {
            Ok(_) => last = Instant::now(),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if inner.shutdown.load(Acquire) {
                    return;
                }
                // No fault waiting: one run of fill-ahead, then look again.
                if let Some(a) = h.ahead.take() {
                    // The writer we just woke may be queued behind us on this
                    // core: let it run first (the fill is meant to overlap it).
                    std::thread::yield_now();
                    // Inside a handling cycle (odd), as a fault would be: a
                    // registration reusing the addresses waits for it.
                    inner.handler_seq.fetch_add(1, SeqCst);
                    h.ahead = fill_ahead(&inner, a, &mut h.streams);
                    inner.handler_seq.fetch_add(1, SeqCst);
                    last = Instant::now();
                    continue;
                }
                let idle_for = last.elapsed();
                if idle_for < spin {
                    if idle_for < YIELD_AFTER {
                        std::hint::spin_loop();
                    } else {
                        // Spin yielding: a thread we woke may be queued behind us
                        // on this core (the scheduler does not move a cache-hot
                        // thread to the idle core for milliseconds).
                        std::thread::yield_now();
                    }
                    continue;
                }
                // With deferred faults, poll with a short timeout to retry them.
                const RETRY: rustix::event::Timespec = rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: 1_000_000,
                };
                let timeout = if deferred.is_empty() {
                    None
                } else {
                    Some(&RETRY)
                };
                let mut fds = [
                    rustix::event::PollFd::new(inner.uffd.fd(), rustix::event::PollFlags::IN),
                    rustix::event::PollFd::new(&*stop, rustix::event::PollFlags::IN),
                ];
                match rustix::event::poll(&mut fds, timeout) {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => {
                        tracing::error!(err = %e, "poll on userfaultfd failed");
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                if !fds[1].revents().is_empty() || inner.shutdown.load(Acquire) {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::error!(%e, "reading userfaultfd failed");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// One run of fill-ahead; what is left of it.
fn fill_ahead(inner: &Inner, a: Ahead, streams: &mut Streams) -> Option<Ahead> {
    // The segment must still be the one the fault was in (not unregistered,
    // its addresses not registered again); the stream's writer may already
    // be past this point (it faulted there: nothing left to fill).
    let same = inner
        .space
        .read()
        .lookup(a.next)
        .is_some_and(|s| Arc::ptr_eq(&s.arr, &a.arr));
    // Filling ahead is a guess: only into room the budget has now, never
    // waiting for the evictor.
    if !same || inner.room() < a.window {
        return None;
    }
    let _room = inner.admit(a.window);
    let n = match inner.fill_untouched_run(&a.arr, a.next, a.end, a.window, Why::Prefetch) {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!(%e, "fill-ahead failed");
            0
        }
    };
    if n == 0 {
        return None;
    }
    streams.ran(a.next, n, a.window);
    notify_filled(inner, &a.arr, a.next, n);
    inner.check_budget();
    (a.runs > 1).then(|| Ahead {
        next: a.next + n,
        runs: a.runs - 1,
        ..a
    })
}

/// Tells the listeners about pages `p..p + n` just filled (eager swap-in
/// notification), then lets them be evicted.
fn notify_filled(inner: &Inner, arr: &crate::state::PageArray, p: usize, n: usize) {
    if inner.cfg.eager_swap_in_notify {
        // Published NOTIFYING (not evictable) by the fill; released once the
        // listeners know.
        let addrs: Vec<usize> = (p..p + n).map(|q| q << PAGE_SHIFT).collect();
        inner.listeners.after_swap_in(&addrs);
        for q in p..p + n {
            arr.word(q).fetch_and(!crate::state::NOTIFYING, Release);
        }
    }
}

/// Handles one message; `false` = retry it later.
fn handle(inner: &Inner, m: &Msg, h: &mut Handler, first: bool) -> bool {
    match m.event {
        uffd::EVENT_PAGEFAULT => return fault(inner, m, h, first),
        uffd::EVENT_UNMAP => inner.forget(m.a0 as usize, m.a1 as usize),
        uffd::EVENT_REMOVE => {}
        uffd::EVENT_REMAP => {
            let (from, to, len) = (m.a0 as usize, m.a1 as usize, m.a2 as usize);
            inner.forget(from, from + len);
            // The moved VMA carries our registration; we do not manage it.
            let _ = inner.uffd.unregister(to, len);
        }
        ev => tracing::warn!(ev, "unexpected userfaultfd event"),
    }
    true
}

/// Resolves one fault; `false` = retry later (the thread stays blocked).
/// A write fault that continues a stream at its longest run schedules
/// fill-ahead after it (`h.ahead`).
fn fault(inner: &Inner, m: &Msg, h: &mut Handler, first: bool) -> bool {
    let Handler {
        buf,
        streams,
        ahead,
    } = h;
    let t0 = Instant::now();
    let addr = m.pf_address() as usize & !(PAGE - 1);
    let p = addr >> PAGE_SHIFT;
    let write = m.pf_flags() & uffd::PAGEFAULT_FLAG_WRITE != 0;
    let seg = inner.space.read().lookup(p).map(|s| (s.arr.clone(), s.end));
    let Some((arr, seg_end)) = seg else {
        // A range being unregistered right now: UFFDIO_UNREGISTER wakes the
        // faulting thread, which then faults normally.
        tracing::debug!(addr, "fault outside any registered segment");
        return true;
    };
    // Under the budget: a fault-around run shrinks to the room left, and the
    // faulting page itself waits (bounded) for the evictor to make room.
    let window = streams.window(p).min(inner.room().max(1));
    let _room = inner.admit(window.max(1));
    match inner.fill_untouched_run(&arr, p, seg_end, window, Why::Fault { write }) {
        Ok(0) => {}
        Ok(n) => {
            streams.ran(p, n, window);
            // The listeners know before the threads run on.
            notify_filled(inner, &arr, p, n);
            let _ = inner.uffd.wake(addr, n * PAGE);
            if write && n == window && streams.at_max(window) {
                *ahead = Some(Ahead {
                    arr: arr.clone(),
                    next: p + n,
                    end: seg_end,
                    window,
                    runs: AHEAD_RUNS,
                });
            }
            inner.check_budget();
            inner
                .stats
                .record_fault(t0.elapsed().as_nanos() as u64, m.pf_tid(), false);
            return true;
        }
        Err(e) => tracing::debug!(addr, %e, "fault-around failed; page by page"),
    }
    match inner.bring_in(&arr, p, Why::Fault { write }, buf) {
        Ok(b) => {
            if matches!(b, Brought::Swap | Brought::Zero | Brought::Hole) {
                if inner.cfg.eager_swap_in_notify && b != Brought::Hole {
                    // The page was published NOTIFYING (not evictable) by
                    // this fill; release it once the listeners know.
                    inner.listeners.after_swap_in(&[addr]);
                    arr.word(p).fetch_and(!crate::state::NOTIFYING, Release);
                }
                inner.stats.record_fault(
                    t0.elapsed().as_nanos() as u64,
                    m.pf_tid(),
                    b == Brought::Swap,
                );
            }
        }
        Err(Error::Unmapped(_)) => {
            // Gone under the faulting thread: let it retry its access (and get
            // the kernel's answer for an unmapped address).
            tracing::debug!(addr, "fault on unmapped page");
            let _ = inner.uffd.wake(addr, PAGE);
        }
        Err(Error::Retry) => {
            inc(&inner.stats.c.fault_retries);
            return false;
        }
        Err(e) => {
            // Unexpected (e.g. swap I/O error): keep the thread blocked and
            // retry rather than hand it a wrong page.
            if first {
                tracing::error!(addr, %e, "could not resolve fault; will retry");
            }
            inc(&inner.stats.c.fault_retries);
            return false;
        }
    }
    true
}
