//! User-space completion queues: the application's CQs, fed by the engine
//! (never by the NIC directly), with an eventfd as completion channel.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::nic::Completion;

pub(crate) struct UCq {
    pub(super) q: Mutex<VecDeque<Completion>>,
    /// Entries in `q` (updated under its lock): an empty poll reads this
    /// instead of taking the lock.
    pub(super) len: AtomicUsize,
    /// The CQ's size (`Cq::resize` changes it): a completion that finds it
    /// full overruns the CQ (see [`UCq::push_se`]).
    pub(super) depth: AtomicUsize,
    /// [`DISARMED`], [`ARMED_SOLICITED`] or [`ARMED_ANY`].
    pub(super) armed: AtomicU8,
    /// The context's armed CQs (see `Shared::armed_cqs`), this one's arming
    /// included while `armed` is set.
    pub(super) armed_total: Arc<ArmedCqs>,
    pub(super) efd: OwnedFd,
    pub(super) overflowed: AtomicBool,
}

/// How many of a context's CQs are armed, and the polling thread to wake
/// when one is: it naps while the application polls (`progress::poller`),
/// and an application that arms a CQ to wait for its event depends on it.
#[derive(Debug, Default)]
pub(crate) struct ArmedCqs {
    count: AtomicU32,
    poller: OnceLock<std::thread::Thread>,
}

impl ArmedCqs {
    /// Whether any CQ is armed.
    pub(crate) fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) != 0
    }
    /// The polling thread (set once, when it is started).
    pub(crate) fn set_poller(&self, t: std::thread::Thread) {
        let _ = self.poller.set(t);
    }
    /// Wake the polling thread from a nap (no effect if it is not napping
    /// but for one spurious wake-up later).
    pub(crate) fn wake_poller(&self) {
        if let Some(t) = self.poller.get() {
            t.unpark();
        }
    }
    fn armed(&self) {
        self.count.fetch_add(1, Ordering::Release);
        self.wake_poller();
    }
    fn disarmed(&self) {
        self.count.fetch_sub(1, Ordering::Release);
    }
    #[cfg(test)]
    fn count(&self) -> u32 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Not armed.
pub(super) const DISARMED: u8 = 0;
/// Armed for the next solicited completion (`ibv_req_notify_cq(cq, 1)`): a
/// receive of a message sent with the solicited-event bit, or any completion
/// in error.
pub(super) const ARMED_SOLICITED: u8 = 1;
/// Armed for the next completion of any kind.
pub(super) const ARMED_ANY: u8 = 2;

impl UCq {
    /// Empty and not armed: a completion may bypass the queue straight to
    /// the thread polling it (called under the engine lock, the only place
    /// completions are pushed).
    pub(crate) fn bypassable(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0 && self.armed.load(Ordering::Acquire) == DISARMED
    }

    /// Arm: the next completion pushed (`solicited_only`: the next solicited
    /// one, see [`UCq::push_se`]) signals the eventfd. Arming for any
    /// completion is not narrowed by a later solicited-only request before it
    /// fired (as on rxe).
    pub(crate) fn arm(&self, solicited_only: bool) {
        let want = if solicited_only {
            ARMED_SOLICITED
        } else {
            ARMED_ANY
        };
        if self.armed.fetch_max(want, Ordering::AcqRel) == DISARMED {
            self.armed_total.armed();
        }
    }

    /// Queue `c`, not solicited (a send completion; a receive of a message
    /// without the solicited-event bit). See [`UCq::push_se`].
    pub(crate) fn push(&self, c: Completion) -> bool {
        self.push_se(c, false)
    }

    /// Queue `c`; `solicited`: a receive completion of a message sent with the
    /// solicited-event bit. A CQ armed for any completion signals its eventfd;
    /// one armed solicited-only signals it for a solicited completion or one in
    /// error (IB's rule; rxe treats flushed receives so, mlx5 every error CQE),
    /// and stays armed otherwise.
    ///
    /// A CQ holds at most its depth: a completion that finds it full
    /// overruns it, as on hardware and rxe — the CQ enters the error state
    /// (polling it fails from then on, `Cq::overflowed`), this and later
    /// completions are dropped, and `false` tells the caller to move the
    /// completion's QP to ERR.
    pub(crate) fn push_se(&self, c: Completion, solicited: bool) -> bool {
        let mut q = self.q.lock();
        let depth = self.depth.load(Ordering::Relaxed);
        if q.len() >= depth || self.overflowed.load(Ordering::Relaxed) {
            if !self.overflowed.swap(true, Ordering::Relaxed) {
                tracing::warn!(depth, "CQ overrun: the CQ is in error, its QPs move to ERR");
            }
            return false;
        }
        q.push_back(c);
        self.len.store(q.len(), Ordering::Release);
        drop(q);
        let fire = match self.armed.load(Ordering::Acquire) {
            DISARMED => false,
            ARMED_SOLICITED => solicited || c.status != 0,
            _ => true,
        };
        if fire && self.armed.swap(DISARMED, Ordering::AcqRel) != DISARMED {
            self.armed_total.disarmed();
            let one: u64 = 1;
            #[allow(unsafe_code)]
            // SAFETY: writing 8 bytes from a local u64 to our own eventfd.
            unsafe {
                libc::write(self.efd.as_raw_fd(), &one as *const u64 as *const _, 8);
            }
        }
        true
    }
}

impl UCq {
    /// Remove the queued completions of QP `qpn` (a QP moved to RESET, as
    /// mlx5 cleans a reset QP's entries out of its CQs).
    pub(crate) fn discard_qp(&self, qpn: u32) {
        let mut q = self.q.lock();
        q.retain(|c| c.qp_num != qpn);
        self.len.store(q.len(), Ordering::Release);
    }
}

impl Drop for UCq {
    fn drop(&mut self) {
        if *self.armed.get_mut() != DISARMED {
            self.armed_total.disarmed();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// Arming a CQ wakes a napping polling thread at once: an application
    /// about to wait for an event does not wait out the nap.
    #[test]
    fn arming_wakes_the_napping_poller() {
        let u = ucq();
        let armed = u.armed_total.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let napper = std::thread::spawn(move || {
            tx.send(()).unwrap();
            let t0 = std::time::Instant::now();
            let limit = std::time::Duration::from_secs(30);
            // Park until woken (spurious wake-ups aside); a wake-up that
            // comes only with the timeout is a failure.
            loop {
                if armed.any() {
                    return t0.elapsed() < limit;
                }
                let Some(left) = limit.checked_sub(t0.elapsed()) else {
                    return false;
                };
                std::thread::park_timeout(left);
            }
        });
        u.armed_total.set_poller(napper.thread().clone());
        rx.recv().unwrap();
        u.arm(false);
        assert!(
            napper.join().unwrap(),
            "the poller was not woken by the arming"
        );
    }

    fn ucq() -> UCq {
        #[allow(unsafe_code)]
        // SAFETY: plain eventfd creation; the fd is owned by the `OwnedFd`.
        let efd = unsafe {
            let fd = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            assert!(fd >= 0);
            OwnedFd::from_raw_fd(fd)
        };
        UCq {
            q: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            depth: AtomicUsize::new(16),
            armed: AtomicU8::new(DISARMED),
            armed_total: Arc::default(),
            efd,
            overflowed: AtomicBool::new(false),
        }
    }

    /// Whether an event was signalled (and reset it).
    fn fired(u: &UCq) -> bool {
        let mut v = [0u8; 8];
        #[allow(unsafe_code)]
        // SAFETY: reading 8 bytes into a local buffer from our own eventfd.
        let n = unsafe { libc::read(u.efd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
        n == 8
    }

    fn c(status: u32) -> Completion {
        Completion {
            status,
            ..Completion::default()
        }
    }

    #[test]
    fn solicited_only_arming_fires_for_solicited_or_error_completions() {
        let u = ucq();
        // Not armed: nothing fires.
        u.push(c(0));
        assert!(!fired(&u));
        // Solicited-only: an ordinary completion leaves it armed, a solicited one
        // fires it once.
        u.arm(true);
        assert_eq!(u.armed_total.count(), 1);
        u.push(c(0));
        assert!(!fired(&u));
        u.push_se(c(0), true);
        assert!(fired(&u));
        assert_eq!(u.armed_total.count(), 0);
        u.push_se(c(0), true);
        assert!(!fired(&u), "one event per arm");
        // A completion in error fires a solicited-only arm.
        u.arm(true);
        u.push(c(5));
        assert!(fired(&u));
        // Armed for any completion, a later solicited-only request does not narrow it.
        u.arm(false);
        u.arm(true);
        u.push(c(0));
        assert!(fired(&u));
        // ... and a solicited-only arm is widened by a later request for any.
        u.arm(true);
        u.arm(false);
        u.push(c(0));
        assert!(fired(&u));
        assert_eq!(u.armed_total.count(), 0);
    }

    #[test]
    fn discard_qp_removes_only_that_qps_completions() {
        let u = ucq();
        for qpn in [1, 2, 1, 3] {
            u.push(Completion {
                qp_num: qpn,
                ..Completion::default()
            });
        }
        u.discard_qp(1);
        let left: Vec<u32> = u.q.lock().iter().map(|c| c.qp_num).collect();
        assert_eq!(left, [2, 3]);
        assert_eq!(u.len.load(Ordering::Relaxed), 2);
    }
}
