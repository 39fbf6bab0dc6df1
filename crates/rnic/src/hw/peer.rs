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

/// The transport behind a peer across the network ([`Port::Wire`]): its requests go
/// into a local shadow of the peer's tables (`seg`), and the link carries them.
pub(crate) trait Link: Send + Sync {
    /// Requests were put in the shadow's rings: send them.
    fn doorbell(&self);
    /// Whether the peer may still answer (false once the link gave it up).
    fn alive(&self) -> bool;
    /// The shadow QP standing for the peer's QP `dest_qpn`, connected to our QP
    /// `my_qpn` of the host with nonce `my_nonce`.
    fn shadow_qp(&self, dest_qpn: u32, my_nonce: u64, my_qpn: u32) -> Option<u32>;
    /// A QP of ours connected to this peer reached RTR (`!rts`: its responder) or
    /// RTS (its requester too).
    fn connect(&self, c: &LinkConn) -> crate::error::Result<()>;
    /// Our QP `qpn` left the connection (reset, error, destroyed).
    fn disconnect(&self, qpn: u32);
}

/// A QP's connection as the link needs it (its transition attributes).
pub(crate) struct LinkConn {
    pub idx: u32,
    pub qpn: u32,
    pub dest_qpn: u32,
    /// The shadow QP (see [`Link::shadow_qp`]).
    pub tq: Option<u32>,
    pub rts: bool,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub mtu: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub max_rd_atomic: u8,
}

pub(crate) struct Peer {
    pub seg: Arc<Segment>,
    pub port: Port,
    /// The transport of a peer across the network (None: shared memory).
    pub link: Option<Arc<dyn Link>>,
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
            link: None,
            fds: Mutex::new(HashMap::new()),
            cq_heads,
        }
    }

    /// A peer across the network: `shadow` stands for its tables here, `link` carries
    /// what is put in them.
    pub fn wire(shadow: Arc<Segment>, link: Arc<dyn Link>) -> Peer {
        let mut p = Peer::new(shadow, Port::Wire);
        p.link = Some(link);
        p
    }

    /// Whether the peer's NIC may still answer: this process's own hosts always, a
    /// process by its liveness token, a peer across the network by its link.
    pub fn alive(&self) -> bool {
        match (&self.link, self.port) {
            (Some(l), _) => l.alive(),
            (None, Port::Local) => true,
            (None, _) => self.seg.alive(),
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
            // Never a CQ of ours across the network: its own NIC signals it.
            Port::Wire => return,
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
