//! The application's completion queue handle ([`Cq`]): polling progresses
//! the engine in the calling thread.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::backend::{Backend, DefaultNic};
use super::progress;
use super::state::Shared;
use super::types::Error;
#[cfg(doc)]
use super::types::SendWr;
use super::ucq::{UCq, DISARMED};
use crate::nic::Completion;

/// An application completion queue.
pub struct Cq<N: Backend = DefaultNic> {
    pub(super) sh: Arc<Shared<N>>,
    pub(super) u: Arc<UCq>,
}

impl<N: Backend> Clone for Cq<N> {
    fn clone(&self) -> Self {
        Cq {
            sh: self.sh.clone(),
            u: self.u.clone(),
        }
    }
}

impl<N: Backend> Cq<N> {
    pub(crate) fn new(sh: Arc<Shared<N>>, depth: u32) -> Result<Cq<N>, Error> {
        if depth == 0 {
            return Err(Error::Invalid("CQ depth 0"));
        }
        #[allow(unsafe_code)]
        // SAFETY: plain eventfd creation; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Error::Other(std::io::Error::last_os_error().to_string()));
        }
        #[allow(unsafe_code)]
        // SAFETY: fd was just created and is owned by nobody else.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        let armed_total = sh.armed_cqs.clone();
        Ok(Cq {
            sh,
            u: Arc::new(UCq {
                q: Mutex::new(VecDeque::new()),
                len: AtomicUsize::new(0),
                depth: AtomicUsize::new(depth as usize),
                armed: AtomicU8::new(DISARMED),
                armed_total,
                efd,
                overflowed: AtomicBool::new(false),
            }),
        })
    }

    pub(crate) fn inner(&self) -> Arc<UCq> {
        self.u.clone()
    }

    /// Non-blocking poll; also progresses the engine in this thread (so a
    /// polling application never waits for the polling thread).
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        // Even a poll served from the queue: otherwise, once the polling
        // thread is the one filling it, it never steps aside and fights the
        // application's posts for the context lock.
        self.sh.mark_app_active();
        let n = self.take(out);
        if n > 0 {
            return n;
        }
        if let Some(mut st) = self.sh.st.try_lock() {
            let k = progress::progress_app_into(&self.sh, &mut st, &self.u, out);
            drop(st);
            if k > 0 {
                // Anything queued meanwhile was completed after these.
                return k + self.take(&mut out[k..]);
            }
        }
        self.take(out)
    }

    pub(super) fn take(&self, out: &mut [Completion]) -> usize {
        if self.u.len.load(Ordering::Acquire) == 0 || out.is_empty() {
            return 0;
        }
        let mut q = self.u.q.lock();
        let n = out.len().min(q.len());
        for o in out.iter_mut().take(n) {
            *o = q.pop_front().expect("counted");
        }
        self.u.len.store(q.len(), Ordering::Release);
        n
    }

    /// Poll until `n` completions arrived or `timeout` passed.
    pub fn poll_wait(&self, n: usize, timeout: Duration) -> Vec<Completion> {
        let t0 = Instant::now();
        let mut v = Vec::with_capacity(n);
        let mut buf = [Completion::default(); 16];
        while v.len() < n && t0.elapsed() < timeout {
            let want = (n - v.len()).min(buf.len());
            let k = self.poll(&mut buf[..want]);
            v.extend_from_slice(&buf[..k]);
            if k == 0 {
                std::hint::spin_loop();
            }
        }
        v
    }

    /// Arm: the next completion makes [`Cq::event_fd`] readable. Completions already
    /// queued do not (as `ibv_req_notify_cq` on rxe or mlx5: the application polls
    /// after arming to find them); an application that re-arms before polling the
    /// completion that fired gets no second event for it.
    pub fn req_notify(&self) {
        self.u.arm(false);
    }

    /// Arm for the next *solicited* completion (`ibv_req_notify_cq(cq, 1)`): a
    /// receive of a message its sender posted with [`SendWr::solicited`], or a
    /// completion in error; other completions are queued without an event and
    /// leave the CQ armed. A [`Cq::req_notify`] not yet fired is not narrowed.
    pub fn req_notify_solicited(&self) {
        self.u.arm(true);
    }

    /// Resize to `depth` entries (`ibv_resize_cq`): the completions it holds
    /// stay; `Error::Invalid` for 0 or fewer entries than are waiting. (The
    /// queue is the engine's own memory: only the overflow limit changes.)
    pub fn resize(&self, depth: u32) -> Result<(), Error> {
        let q = self.u.q.lock();
        if depth == 0 || (depth as usize) < q.len() {
            return Err(Error::Invalid("fewer CQ entries than completions waiting"));
        }
        self.u.depth.store(depth as usize, Ordering::Release);
        Ok(())
    }

    /// The completion channel (eventfd; read it to reset).
    pub fn event_fd(&self) -> RawFd {
        self.u.efd.as_raw_fd()
    }

    /// Block (no spinning) until an event or `timeout` (rounded up to whole
    /// milliseconds, as poll(2) counts them); drains the eventfd.
    pub fn wait_event(&self, timeout: Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.event_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = crate::nic::poll_timeout_ms(timeout);
        #[allow(unsafe_code)]
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            let mut v: u64 = 0;
            #[allow(unsafe_code)]
            // SAFETY: reading 8 bytes into a local u64 from our own eventfd.
            unsafe {
                libc::read(self.event_fd(), &mut v as *mut u64 as *mut _, 8);
            }
            return true;
        }
        false
    }

    /// Whether more completions arrived than the depth at some point.
    pub fn overflowed(&self) -> bool {
        self.u.overflowed.load(Ordering::Relaxed)
    }
}
