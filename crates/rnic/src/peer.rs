//! A resolved peer host (or this host itself): its segment (shared in-process, or the
//! peer's memfd mapped from another process) and how to reach its memory and
//! completion-channel eventfds.

use crate::dma::Port;
use crate::host::{local_host, HostAddr, HostInner};
use crate::segment::Segment;
use crate::{sys, Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
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

    fn new(seg: Arc<Segment>, port: Port) -> Peer {
        let cq_heads = (0..seg.p.max_cq).map(|_| AtomicU64::new(0)).collect();
        Peer {
            seg,
            port,
            fds: Mutex::new(HashMap::new()),
            cq_heads,
        }
    }

    /// The cached head of CQ `idx` (see `cq::push`).
    pub fn cq_head(&self, idx: u32) -> Option<&AtomicU64> {
        self.cq_heads.get(idx as usize)
    }

    /// Resolve `addr` as seen from `me` (cached).
    pub fn resolve(me: &HostInner, addr: HostAddr) -> Result<Arc<Peer>> {
        if addr.nonce == me.addr.nonce {
            return Ok(me.self_peer.clone());
        }
        if let Some(p) = me.peers.lock().get(&addr.nonce) {
            return Ok(p.clone());
        }
        let peer = if let Some(h) = local_host(addr.nonce) {
            Arc::new(Peer::local(h.seg.clone()))
        } else if addr.pid == std::process::id() {
            return Err(Error::Unreachable("host no longer exists".into()));
        } else {
            let seg = Segment::open(addr.pid, addr.fd, addr.nonce)?;
            Arc::new(Peer::new(Arc::new(seg), Port::Proc(addr.pid)))
        };
        me.peers.lock().insert(addr.nonce, peer.clone());
        Ok(peer)
    }

    /// Signal the peer's eventfd number `fd` (a completion channel).
    pub fn signal(&self, fd: u32) {
        let r = match self.port {
            Port::Local => sys::eventfd_signal(fd as i32),
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
                sys::eventfd_signal(ofd.as_raw_fd())
            }
        };
        if let Err(e) = r {
            tracing::warn!("completion channel signal failed: {e}");
        }
    }
}
