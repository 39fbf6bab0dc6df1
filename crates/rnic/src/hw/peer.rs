//! A resolved peer host (or this host itself): its segment (shared in-process, or the
//! peer's memfd mapped from another process) and how to reach its memory and
//! completion-channel eventfds.

use crate::hw::dma::Port;
use crate::hw::segment::Segment;
use crate::sys;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub(crate) struct Peer {
    pub seg: Arc<Segment>,
    pub port: Port,
    fds: Mutex<HashMap<u32, OwnedFd>>,
    /// Last head seen per CQ of the peer (heads only grow): a producer rereads the
    /// consumer's `head` line only when this stale value says the ring may be full.
    cq_heads: Box<[AtomicU64]>,
}

impl Peer {
    pub fn local(seg: Arc<Segment>) -> Peer {
        Peer::new(seg, Port::Local)
    }

    /// A peer reached through `port`.
    pub fn new(seg: Arc<Segment>, port: Port) -> Peer {
        let cq_heads = (0..seg.p.max_cq).map(|_| AtomicU64::new(0)).collect();
        Peer {
            seg,
            port,
            fds: Mutex::new(HashMap::new()),
            cq_heads,
        }
    }

    /// The cached head of CQ `idx` (see `nic::cq_ring::push`).
    pub fn cq_head(&self, idx: u32) -> Option<&AtomicU64> {
        self.cq_heads.get(idx as usize)
    }

    /// Signal the peer's eventfd number `fd` (a completion channel).
    pub fn signal(&self, fd: u32) {
        let r = match self.port {
            // SAFETY: `fd` is the number of one of our own completion channels'
            // eventfds, borrowed for this one write(2) only: the same call on the
            // same number as the former raw libc::write (a closed number fails EBADF).
            Port::Local => sys::eventfd_signal(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd as i32) }),
            Port::Proc(pid) => {
                let mut m = self.fds.lock();
                let ofd = match m.entry(fd) {
                    std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => match sys::pidfd_getfd(pid, fd as i32) {
                        Ok(o) => v.insert(o),
                        Err(e) => {
                            tracing::warn!("pidfd_getfd({pid},{fd}) failed: {e}");
                            return;
                        }
                    },
                };
                sys::eventfd_signal(&*ofd)
            }
        };
        if let Err(e) = r {
            tracing::warn!("completion channel signal failed: {e}");
        }
    }
}
