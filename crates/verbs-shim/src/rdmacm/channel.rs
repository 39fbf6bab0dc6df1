//! Event channels (`struct rdma_event_channel`) and the events they queue
//! (`struct rdma_cm_event` with room for its private data): a semaphore eventfd
//! (`channel->fd`, readable while events wait; blocking or O_NONBLOCK as the
//! application sets it) counting a queue of boxed events.

use crate::ffi::rdmacm::*;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// An event as handed to the application: the C event first, then the bytes its
/// `private_data` points at, and who must hear of its acknowledgement.
#[repr(C)]
pub struct EventBox {
    /// The C event.
    pub ev: rdma_cm_event,
    /// Private data storage.
    pub private: [u8; 256],
    /// Called once when the application acknowledges the event (the id's count of
    /// events handed out and not yet acknowledged).
    pub on_ack: Option<Box<dyn FnOnce() + Send>>,
    /// What taking the event does first, in the application's thread (librdmacm
    /// moves QPs there, never on the CM's own thread).
    pub action: Action,
}

/// Work done when an event is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// A REP arrived: an id with a QP moves it to RTR/RTS and sends the RTU, and the
    /// event becomes ESTABLISHED (CONNECT_ERROR if that fails); without a QP it
    /// stays CONNECT_RESPONSE.
    Establish,
    /// DISCONNECTED: the id's QP to ERR (its outstanding work flushes).
    ErrorQp,
}

impl EventBox {
    /// A zeroed event of `kind` for `id` (and `listen_id`), `status`.
    pub fn new(kind: rdma_cm_event_type, id: *mut rdma_cm_id, status: i32) -> Box<EventBox> {
        // SAFETY: rdma_cm_event is plain C data; all-zero is valid.
        let mut ev: rdma_cm_event = unsafe { std::mem::zeroed() };
        ev.event = kind;
        ev.id = id;
        ev.status = status;
        Box::new(EventBox {
            ev,
            private: [0; 256],
            on_ack: None,
            action: Action::None,
        })
    }

    /// Copy `data` into the event's own storage; returns the pointer and length to put
    /// in `param.conn` / `param.ud` (NULL, 0 when empty).
    pub fn set_private(&mut self, data: &[u8]) -> (*const std::ffi::c_void, u8) {
        let n = data.len().min(self.private.len()).min(255);
        self.private[..n].copy_from_slice(&data[..n]);
        if n == 0 {
            (std::ptr::null(), 0)
        } else {
            (self.private.as_ptr().cast(), n as u8)
        }
    }
}

// SAFETY: the raw pointers in an event name CM ids and a private buffer that live
// until the event is acknowledged; the event moves between threads only whole.
unsafe impl Send for EventBox {}

/// The queue behind a channel; ids hold it by `Arc` (so a channel destroyed early by
/// a misbehaving application never leaves an id pointing at freed memory).
pub struct Queue {
    efd: OwnedFd,
    q: Mutex<VecDeque<Box<EventBox>>>,
}

impl Queue {
    /// The eventfd.
    pub fn fd(&self) -> i32 {
        self.efd.as_raw_fd()
    }

    /// Queue an event and make the fd readable for it.
    pub fn push(&self, ev: Box<EventBox>) {
        self.q.lock().push_back(ev);
        // The counter cannot overflow (one count per queued event).
        let _ = rustix::io::write(&self.efd, &1u64.to_ne_bytes());
    }

    /// Take one event: a read of the eventfd (blocking unless the application made the
    /// fd non-blocking: then EAGAIN when none waits), then the queue's head.
    pub fn pop(&self) -> Result<Box<EventBox>, i32> {
        loop {
            let mut b = [0u8; 8];
            match rustix::io::read(&self.efd, &mut b) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.raw_os_error()),
            }
            if let Some(ev) = self.q.lock().pop_front() {
                return Ok(ev);
            }
            // A count whose event was withdrawn (its id destroyed or migrated): read on.
        }
    }

    /// Withdraw the queued events `pick` selects, returning them. Their counts stay on
    /// the eventfd: a reader that takes one finds no event for it and reads again
    /// (so the fd may poll readable once with nothing to get: EAGAIN when non-blocking).
    #[allow(clippy::vec_box)] // the boxes are what the queue holds and hands out
    pub fn withdraw(&self, pick: impl Fn(&EventBox) -> bool) -> Vec<Box<EventBox>> {
        let mut q = self.q.lock();
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(q.len());
        while let Some(e) = q.pop_front() {
            if pick(&e) {
                out.push(e);
            } else {
                keep.push_back(e);
            }
        }
        *q = keep;
        out
    }
}

/// `struct rdma_event_channel` + its queue.
#[repr(C)]
pub struct Channel {
    /// The C channel (`fd`).
    pub ch: rdma_event_channel,
    /// Its queue.
    pub queue: Arc<Queue>,
}

impl Channel {
    /// A new channel (EMFILE etc. as errno on failure).
    pub fn new() -> Result<Box<Channel>, i32> {
        let efd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::SEMAPHORE,
        )
        .map_err(|e| e.raw_os_error())?;
        let queue = Arc::new(Queue {
            efd,
            q: Mutex::new(VecDeque::new()),
        });
        Ok(Box::new(Channel {
            ch: rdma_event_channel { fd: queue.fd() },
            queue,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_in_order_and_nonblocking_says_eagain() {
        let c = Channel::new().unwrap();
        let q = &c.queue;
        rustix::fs::fcntl_setfl(
            // SAFETY: the channel's fd lives as long as `c`.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(c.ch.fd) },
            rustix::fs::OFlags::NONBLOCK,
        )
        .unwrap();
        assert_eq!(q.pop().err(), Some(libc::EAGAIN));
        for k in [RDMA_CM_EVENT_ADDR_RESOLVED, RDMA_CM_EVENT_ROUTE_RESOLVED] {
            q.push(EventBox::new(k, std::ptr::null_mut(), 0));
        }
        q.push(EventBox::new(RDMA_CM_EVENT_ESTABLISHED, 8 as *mut _, 0));
        // Withdrawing the third leaves two events (and a stale count, read past).
        assert_eq!(q.withdraw(|e| e.ev.id as usize == 8).len(), 1);
        assert_eq!(q.pop().unwrap().ev.event, RDMA_CM_EVENT_ADDR_RESOLVED);
        assert_eq!(q.pop().unwrap().ev.event, RDMA_CM_EVENT_ROUTE_RESOLVED);
        assert_eq!(q.pop().err(), Some(libc::EAGAIN));
    }

    #[test]
    fn private_data_is_copied_and_bounded() {
        let mut e = EventBox::new(RDMA_CM_EVENT_CONNECT_REQUEST, std::ptr::null_mut(), 0);
        let (p, n) = e.set_private(&[5; 56]);
        assert_eq!(n, 56);
        assert_eq!(
            // SAFETY: p points at the event's own 256-byte storage.
            unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 56) },
            &[5; 56]
        );
        assert_eq!(e.set_private(&[]), (std::ptr::null(), 0));
    }
}
