//! Swap listeners (the MMU-notifier role) and their registry.

use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Arc;

/// Receives page-residency changes. Page arguments are page-aligned virtual
/// addresses, in ascending order.
///
/// `before_swap_out` runs synchronously on the evicting thread *before* the
/// pages' contents leave memory; eviction of those pages proceeds only after it
/// returns. The evicting thread is the evictor, or a thread that brings pages
/// in under the budget and makes room first (a `pin`, `prefetch` or swap-in
/// caller: direct reclaim; never the fault thread). The pager holds no lock that the fault path, `pin`, `unpin`,
/// `is_resident`, `resident`, `prefetch` or registration need while calling it,
/// so a listener may take its own locks and may call those. It must not call
/// `swap_out` (eviction is serialised; that would self-deadlock) and must not
/// wait for a thread that is itself blocked in `swap_out`. A page announced
/// here may still stay resident: a `pin` after the announcement cancels its
/// eviction (so a mapping re-established under that pin stays valid, and the
/// page is announced again before any later eviction). Treat the call as
/// "may be absent from now on".
///
/// A listener that cannot stop reaching the pages (its device could not
/// confirm that no access through the old mapping is still in flight)
/// returns `false`: the pager then evicts none of the batch (the pages stay
/// resident, counted in `PagerStats::evict_vetoes`), so memory a device may
/// still be using is never reclaimed. Returning `true` lets them leave.
///
/// `after_swap_in` is only called when `PagerConfig::eager_swap_in_notify` is
/// set (or through `Pager::notify_swapped_in`); it may run on the fault-handler
/// thread, so it must not touch non-resident pager-managed memory nor call
/// `pin`/`prefetch` (they may need the fault thread to make progress).
///
/// The pager owns its listeners: a listener that needs the pager should keep
/// a [`crate::WeakPager`], not a `Pager` clone (which would keep it alive).
pub trait SwapListener: Send + Sync {
    /// `pages` (page addresses) are about to leave memory; called on the evicting
    /// thread before they leave (stop reaching them from now on). `false`:
    /// they must not leave now (see the trait's documentation).
    fn before_swap_out(&self, pages: &[usize]) -> bool;
    /// `pages` were swapped back in (only with eager swap-in notification).
    fn after_swap_in(&self, _pages: &[usize]) {}
    /// Accessed bits of a secondary MMU (Linux's `mmu_notifier`
    /// `clear_young`): `pages` are the resident pages CLOCK reclaim is about
    /// to evict (their own reference bit clear); set `young[i]` for each
    /// page the listener's device accessed since it was last asked (or
    /// mapped), clearing that record. A page any listener reports young
    /// gets a second chance, as a referenced page. Called on the evicting
    /// thread under the rules of `before_swap_out`; the default reports
    /// nothing.
    fn test_and_clear_young(&self, _pages: &[usize], _young: &mut [bool]) {}
    /// The application unmapped (or mremap moved away) managed memory
    /// `[start, end)`: whoever reaches it by address must stop now (called
    /// on the pager's fault thread as it handles the unmap event, after
    /// the pages were marked gone).
    fn after_unmap(&self, _start: usize, _end: usize) {}
}

/// Handle to remove a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u64);

struct Entry {
    id: ListenerId,
    l: Arc<dyn SwapListener>,
    /// Calls running now.
    active: AtomicUsize,
    removed: AtomicBool,
}

type List = Arc<[Arc<Entry>]>;

thread_local! {
    /// Listeners whose callback is running on this thread (to allow a
    /// listener to remove itself without waiting for itself).
    static RUNNING: std::cell::RefCell<Vec<ListenerId>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks a call as running; undone on drop (also if the listener panics).
struct Active<'a>(&'a Entry);

impl<'a> Active<'a> {
    fn enter(e: &'a Entry) -> Active<'a> {
        e.active.fetch_add(1, SeqCst);
        RUNNING.with(|r| r.borrow_mut().push(e.id));
        Active(e)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        RUNNING.with(|r| r.borrow_mut().pop());
        self.0.active.fetch_sub(1, SeqCst);
    }
}

#[derive(Default)]
pub struct Listeners {
    list: RwLock<Option<List>>,
    next: AtomicU64,
}

impl Listeners {
    pub fn add(&self, l: Arc<dyn SwapListener>) -> ListenerId {
        let id = ListenerId(self.next.fetch_add(1, Relaxed) + 1);
        let mut g = self.list.write();
        let mut v: Vec<_> = g.as_deref().unwrap_or(&[]).to_vec();
        v.push(Arc::new(Entry {
            id,
            l,
            active: AtomicUsize::new(0),
            removed: AtomicBool::new(false),
        }));
        *g = Some(v.into());
        id
    }

    /// Removes a listener and waits until no call to it is running (unless
    /// called from inside that listener's own callback).
    pub fn remove(&self, id: ListenerId) -> bool {
        let gone = {
            let mut g = self.list.write();
            let mut v: Vec<_> = g.as_deref().unwrap_or(&[]).to_vec();
            let Some(pos) = v.iter().position(|e| e.id == id) else {
                return false;
            };
            let e = v.remove(pos);
            e.removed.store(true, SeqCst);
            *g = if v.is_empty() { None } else { Some(v.into()) };
            e
        };
        if RUNNING.with(|r| r.borrow().contains(&id)) {
            return true;
        }
        let mut n = 0u32;
        while gone.active.load(SeqCst) != 0 {
            n += 1;
            if n < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        true
    }

    /// A snapshot to call without holding the registry lock.
    fn snapshot(&self) -> Option<List> {
        self.list.read().clone()
    }

    fn each(&self, mut f: impl FnMut(&dyn SwapListener)) {
        let Some(list) = self.snapshot() else { return };
        for e in list.iter() {
            let _g = Active::enter(e);
            if !e.removed.load(SeqCst) {
                f(&*e.l);
            }
        }
    }

    /// Every listener hears of `pages`; whether all of them let the pages
    /// leave (each is called even after one refused, so every listener
    /// sees the same announcements).
    pub fn before_swap_out(&self, pages: &[usize]) -> bool {
        let mut ok = true;
        if !pages.is_empty() {
            self.each(|l| ok &= l.before_swap_out(pages));
        }
        ok
    }

    /// Which of `pages` some listener reports young (every listener is
    /// asked, so each clears its records); `None` without listeners.
    pub fn test_and_clear_young(&self, pages: &[usize]) -> Option<Vec<bool>> {
        let list = self.snapshot()?;
        let mut young = vec![false; pages.len()];
        for e in list.iter() {
            let _g = Active::enter(e);
            if !e.removed.load(SeqCst) {
                e.l.test_and_clear_young(pages, &mut young);
            }
        }
        Some(young)
    }

    pub fn after_swap_in(&self, pages: &[usize]) {
        if !pages.is_empty() {
            self.each(|l| l.after_swap_in(pages));
        }
    }

    pub fn after_unmap(&self, start: usize, end: usize) {
        if start < end {
            self.each(|l| l.after_unmap(start, end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// (entered, finished)
    struct Slow(AtomicBool, AtomicBool);
    impl SwapListener for Slow {
        fn before_swap_out(&self, _pages: &[usize]) -> bool {
            self.0.store(true, SeqCst);
            std::thread::sleep(Duration::from_millis(100));
            self.1.store(true, SeqCst);
            true
        }
    }

    #[test]
    fn remove_waits_for_running_calls() {
        let ls = Arc::new(Listeners::default());
        let slow = Arc::new(Slow(AtomicBool::new(false), AtomicBool::new(false)));
        let id = ls.add(slow.clone());
        let l2 = ls.clone();
        let t = std::thread::spawn(move || l2.before_swap_out(&[4096]));
        // Remove only once the call is running (a loaded machine may start
        // the thread late).
        while !slow.0.load(SeqCst) {
            std::thread::yield_now();
        }
        assert!(ls.remove(id));
        assert!(
            slow.1.load(SeqCst),
            "remove returned while the call was running"
        );
        t.join().unwrap();
        assert!(!ls.remove(id));
    }

    struct SelfRemover(Arc<Listeners>, parking_lot::Mutex<Option<ListenerId>>);
    impl SwapListener for SelfRemover {
        fn before_swap_out(&self, _pages: &[usize]) -> bool {
            if let Some(id) = self.1.lock().take() {
                assert!(self.0.remove(id));
            }
            true
        }
    }

    #[test]
    fn a_listener_may_remove_itself() {
        let ls = Arc::new(Listeners::default());
        let me = Arc::new(SelfRemover(ls.clone(), parking_lot::Mutex::new(None)));
        let id = ls.add(me.clone());
        *me.1.lock() = Some(id);
        ls.before_swap_out(&[4096]);
        assert!(ls.snapshot().is_none());
    }
}
