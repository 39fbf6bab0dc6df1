//! Swap listeners (the MMU-notifier role) and their registry.

use parking_lot::RwLock;
use std::sync::Arc;

/// Receives page-residency changes. Page arguments are page-aligned virtual
/// addresses, in ascending order.
///
/// `before_swap_out` runs synchronously on the evicting thread *before* the
/// pages' contents leave memory; eviction of those pages proceeds only after it
/// returns. The pager holds no lock that the fault path, `pin`, `unpin`,
/// `is_resident`, `resident`, `prefetch` or registration need while calling it,
/// so a listener may take its own locks and may call those. It must not call
/// `swap_out` (eviction is serialised; that would self-deadlock) and must not
/// wait for a thread that is itself blocked in `swap_out`. A page announced
/// here may still stay resident (a concurrent `pin` aborts its eviction):
/// treat the call as "may be absent from now on".
///
/// `after_swap_in` is only called when `PagerConfig::eager_swap_in_notify` is
/// set (or through `Pager::notify_swapped_in`); it may run on the fault-handler
/// thread, so it must not touch non-resident pager-managed memory.
pub trait SwapListener: Send + Sync {
    fn before_swap_out(&self, pages: &[usize]);
    fn after_swap_in(&self, _pages: &[usize]) {}
}

/// Handle to remove a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u64);

type List = Arc<[(ListenerId, Arc<dyn SwapListener>)]>;

#[derive(Default)]
pub struct Listeners {
    list: RwLock<Option<List>>,
    next: std::sync::atomic::AtomicU64,
}

impl Listeners {
    pub fn add(&self, l: Arc<dyn SwapListener>) -> ListenerId {
        let id = ListenerId(self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
        let mut g = self.list.write();
        let mut v: Vec<_> = g.as_deref().unwrap_or(&[]).to_vec();
        v.push((id, l));
        *g = Some(v.into());
        id
    }

    pub fn remove(&self, id: ListenerId) -> bool {
        let mut g = self.list.write();
        let mut v: Vec<_> = g.as_deref().unwrap_or(&[]).to_vec();
        let n = v.len();
        v.retain(|(i, _)| *i != id);
        let removed = v.len() != n;
        *g = if v.is_empty() { None } else { Some(v.into()) };
        removed
    }

    /// A snapshot to call without holding the registry lock.
    fn snapshot(&self) -> Option<List> {
        self.list.read().clone()
    }

    pub fn before_swap_out(&self, pages: &[usize]) {
        if pages.is_empty() {
            return;
        }
        if let Some(l) = self.snapshot() {
            for (_, x) in l.iter() {
                x.before_swap_out(pages);
            }
        }
    }

    pub fn after_swap_in(&self, pages: &[usize]) {
        if pages.is_empty() {
            return;
        }
        if let Some(l) = self.snapshot() {
            for (_, x) in l.iter() {
                x.after_swap_in(pages);
            }
        }
    }
}
