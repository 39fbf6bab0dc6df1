//! What the engines of one host share: its device state, the ODP model's fault queue
//! and the request-ring server; the registry of this process's hosts (peer resolution,
//! remote ODP faults raised in-process).

use crate::error::{Error, Result};
use crate::hw::device::Device;
use crate::hw::dma::Port;
use crate::hw::peer::Peer;
use crate::hw::segment::Segment;
use crate::nic::inbound::RingServer;
use crate::nic::odp::{self, OdpState, Ranges};
use crate::verbs::HostAddr;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// One host as its engines see it: the device state (which it derefs to) plus the
/// engines' own shared state.
pub(crate) struct Nic {
    pub dev: Device,
    /// ODP model: fault handler and the raised-fault queue (served by the NIC thread).
    pub odp: OdpState,
    /// Held by whichever thread serves the doorbells (the NIC thread, or an
    /// external poller, see `Host::serve_rings`): request rings have one consumer.
    pub ring_server: Mutex<RingServer>,
    /// Serving passes over the doorbells that served requests, by any thread
    /// (see `Host::ring_passes`).
    pub ring_passes: AtomicU64,
    /// A thread polled one of this host's CQs since the NIC thread last looked
    /// (such a poll serves the request rings inline, see `Cq::poll`): the NIC
    /// thread then does not spin for them.
    pub cq_polled: AtomicBool,
    /// Times the NIC thread blocked for lack of work (`NicStats::nic_sleeps`).
    pub nic_sleeps: AtomicU64,
    /// Threads that want the request rings (`Host::add_ring_waker`): the NIC
    /// thread calls these when it starts serving after a sleep while none of
    /// them polls the rings, so a blocked poller takes them back.
    pub ring_wakers: Mutex<Vec<(u64, RingWaker)>>,
}

/// A call that wakes a blocked ring poller (see `Nic::ring_wakers`).
pub type RingWaker = Arc<dyn Fn() + Send + Sync>;

impl Deref for Nic {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.dev
    }
}

static LOCAL_HOSTS: Mutex<Option<HashMap<u64, Weak<Nic>>>> = Mutex::new(None);

/// The host of this process whose nonce is `nonce`, if it still exists.
pub(crate) fn local_nic(nonce: u64) -> Option<Arc<Nic>> {
    LOCAL_HOSTS.lock().as_ref()?.get(&nonce)?.upgrade()
}

impl Nic {
    /// The engines' state of a new host over `dev`, registered as a host of this
    /// process (until [`Nic::unregister`]).
    pub fn register(dev: Device) -> Arc<Nic> {
        let nic = Arc::new(Nic {
            odp: Default::default(),
            ring_server: Mutex::new(RingServer::new(dev.cfg.max_qp)),
            ring_passes: AtomicU64::new(0),
            cq_polled: AtomicBool::new(false),
            nic_sleeps: AtomicU64::new(0),
            ring_wakers: Mutex::new(Vec::new()),
            dev,
        });
        LOCAL_HOSTS
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(nic.addr.nonce, Arc::downgrade(&nic));
        nic
    }

    /// Forget this host in the registry (it is shutting down).
    pub fn unregister(&self) {
        if let Some(m) = LOCAL_HOSTS.lock().as_mut() {
            m.remove(&self.addr.nonce);
        }
    }

    /// Resolve the peer at `addr` as seen from this host (cached).
    pub fn resolve_peer(&self, addr: HostAddr) -> Result<Arc<Peer>> {
        let me = self;
        if addr.nonce == me.addr.nonce {
            return Ok(me.self_peer.clone());
        }
        if let Some(p) = me.peers.lock().get(&addr.nonce) {
            return Ok(p.clone());
        }
        if addr.pid == 0 {
            // A peer across the network is known once `Host::wire_peer` made it.
            return Err(Error::Unreachable("no such peer across the network".into()));
        }
        let peer = if let Some(h) = local_nic(addr.nonce) {
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
}

/// ODP model, remote fault: the responder raises it on the host owning `seg` and does
/// not wait: directly if that host is in this process, else through the mailbox in its
/// segment (one bounding range; if the mailbox is full the retransmission raises it
/// again).
pub(crate) fn fault_remote(seg: &Segment, ranges: Ranges) {
    if let Some(h) = local_nic(seg.hdr().nonce.load(Ordering::Relaxed)) {
        h.odp.enqueue(&h, ranges, None);
        return;
    }
    odp::post_mail(seg, ranges);
}
