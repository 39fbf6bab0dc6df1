//! User-space completion queues: the application's CQs, fed by the engine
//! (never by the NIC directly), with an eventfd as completion channel.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::nic::Completion;

pub(crate) struct UCq {
    pub(super) q: Mutex<VecDeque<Completion>>,
    /// Entries in `q` (updated under its lock): an empty poll reads this
    /// instead of taking the lock.
    pub(super) len: AtomicUsize,
    pub(super) depth: usize,
    pub(super) armed: AtomicBool,
    /// The context's count of armed CQs (see `Shared::armed_cqs`), this one's
    /// arming included while `armed` is set.
    pub(super) armed_total: Arc<AtomicU32>,
    pub(super) efd: OwnedFd,
    pub(super) overflowed: AtomicBool,
}

impl UCq {
    /// Empty and not armed: a completion may bypass the queue straight to
    /// the thread polling it (called under the engine lock, the only place
    /// completions are pushed).
    pub(crate) fn bypassable(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0 && !self.armed.load(Ordering::Acquire)
    }

    /// Arm: the next completion pushed signals the eventfd.
    pub(crate) fn arm(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.armed_total.fetch_add(1, Ordering::Release);
        }
    }

    pub(crate) fn push(&self, c: Completion) {
        let mut q = self.q.lock();
        if q.len() >= self.depth {
            // Kept (no completion is ever lost) but reported.
            if !self.overflowed.swap(true, Ordering::Relaxed) {
                tracing::warn!(depth = self.depth, "user CQ overflow");
            }
        }
        q.push_back(c);
        self.len.store(q.len(), Ordering::Release);
        drop(q);
        if self.armed.swap(false, Ordering::AcqRel) {
            self.armed_total.fetch_sub(1, Ordering::Release);
            let one: u64 = 1;
            #[allow(unsafe_code)]
            // SAFETY: writing 8 bytes from a local u64 to our own eventfd.
            unsafe {
                libc::write(self.efd.as_raw_fd(), &one as *const u64 as *const _, 8);
            }
        }
    }
}

impl Drop for UCq {
    fn drop(&mut self) {
        if *self.armed.get_mut() {
            self.armed_total.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Completions handed straight to the array of the application thread that
/// is polling (see `progress_app_into`).
#[derive(Default)]
pub(super) struct Direct {
    /// The user CQ being polled (by address; only compared), if any.
    pub(super) cq: usize,
    pub(super) room: usize,
    pub(super) buf: Vec<Completion>,
}

impl Direct {
    /// Take nothing (completions go through the queues).
    #[inline]
    pub(super) fn stop(&mut self) {
        self.cq = 0;
    }

    pub(super) fn begin(&mut self, cq: &Arc<UCq>, room: usize) {
        self.cq = Arc::as_ptr(cq) as usize;
        self.room = room;
        self.buf.clear();
    }

    /// Take `c` for the polling thread if it is for its CQ, there is room,
    /// and the CQ's queue is empty (nothing older is waiting there) and not
    /// armed (a notification is due then: the queue path signals it).
    #[inline]
    pub(super) fn offer(&mut self, cq: &Arc<UCq>, c: Completion) -> bool {
        if self.cq == 0
            || self.cq != Arc::as_ptr(cq) as usize
            || self.buf.len() >= self.room
            || !cq.bypassable()
        {
            return false;
        }
        self.buf.push(c);
        true
    }

    /// Copy the taken completions to `out` and stop taking.
    #[inline]
    pub(super) fn end(&mut self, out: &mut [Completion]) -> usize {
        self.cq = 0;
        let n = self.buf.len().min(out.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf.clear();
        n
    }
}
