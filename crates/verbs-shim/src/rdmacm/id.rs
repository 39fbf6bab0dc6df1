//! CM ids (`struct rdma_cm_id`): the C struct the application reads, first field of a
//! boxed [`CmId`], and the state behind it ([`Inner`]: the phase of the connection
//! state machine, addresses, the negotiated QP parameters, the stream to the peer's
//! CM), plus how an event for an id is queued, counted and acknowledged.

use super::channel::{Channel, EventBox, Queue};
use super::link::Link;
use super::sockaddr;
use super::wire::QpInfo;
use crate::ffi::rdmacm::*;
use crate::ffi::*;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::net::SocketAddr;
use std::sync::Arc;

/// Where an id is in the rdma_cm state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Created.
    Idle,
    /// `rdma_bind_addr` done.
    Bound,
    /// ADDR_RESOLVED.
    AddrResolved,
    /// ROUTE_RESOLVED.
    RouteResolved,
    /// `rdma_listen` done.
    Listening,
    /// REQ sent, waiting for the REP (or REJ).
    Connecting,
    /// A passive id made for a REQ (CONNECT_REQUEST), not yet answered.
    Requested,
    /// REP sent, waiting for the RTU.
    Accepting,
    /// REP received on an id without a QP (CONNECT_RESPONSE): `rdma_establish` next.
    Responded,
    /// Connected.
    Established,
    /// DREQ sent, waiting for the DREP.
    Disconnecting,
    /// Disconnected (DISCONNECTED reported), rejected, or failed.
    Done,
}

/// The `rdma_set_option` values an id carries.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// RDMA_OPTION_ID_TOS.
    pub tos: u8,
    /// RDMA_OPTION_ID_REUSEADDR.
    pub reuseaddr: bool,
    /// RDMA_OPTION_ID_AFONLY (unset: dual-stack for an IPv6 wildcard).
    pub afonly: Option<bool>,
    /// RDMA_OPTION_ID_ACK_TIMEOUT (the QP's local ACK timeout).
    pub ack_timeout: Option<u8>,
}

/// What this side asked for or accepted (`rdma_conn_param`), kept for the QP's
/// RTR/RTS attributes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Negotiated {
    /// Incoming READ/atomic depth (RTR `max_dest_rd_atomic`).
    pub responder_resources: u8,
    /// Outgoing READ/atomic depth (RTS `max_rd_atomic`).
    pub initiator_depth: u8,
    /// RTS `retry_cnt`.
    pub retry_count: u8,
    /// RTS `rnr_retry`.
    pub rnr_retry_count: u8,
}

/// An endpoint's set-up kept for `rdma_get_request` (`rdma_create_ep` on a passive
/// address): the PD and QP attributes each request's new id gets a QP with.
#[derive(Clone, Copy)]
pub struct EpSetup {
    /// The PD (NULL: the default PD).
    pub pd: *mut ibv_pd,
    /// The QP attributes.
    pub attr: ibv_qp_init_attr,
}

/// Verbs objects the CM made for an id (freed with its QP).
#[derive(Default)]
pub struct Owned {
    /// CQs made by `rdma_create_qp` (send, recv).
    pub cqs: Vec<*mut ibv_cq>,
    /// Their completion channels.
    pub channels: Vec<*mut ibv_comp_channel>,
}

/// The mutable state of an id.
pub struct State {
    /// Phase.
    pub phase: Phase,
    /// The queue it reports to (its channel's, or its private one's).
    pub queue: Arc<Queue>,
    /// A synchronous id's private channel (`rdma_create_id` with no channel).
    pub sync: Option<Box<Channel>>,
    /// Local address (bound or resolved).
    pub local: Option<SocketAddr>,
    /// Peer address.
    pub peer: Option<SocketAddr>,
    /// The bound socket (listening or to connect from), until handed to a link.
    pub sock: Option<socket2::Socket>,
    /// The stream to the peer's CM.
    pub link: Option<Arc<Link>>,
    /// The reactor's registration (a listener's or the link's token).
    pub token: Option<u64>,
    /// A connection began on this id (REQ sent or received): from then on
    /// `rdma_disconnect` succeeds, as the kernel's does once a CM id exists.
    pub attempted: bool,
    /// Options.
    pub opts: Options,
    /// The resolve timeout (ms), which bounds a connection attempt's first answer.
    pub timeout_ms: i32,
    /// This side's first PSN.
    pub psn: u32,
    /// The peer's QP (from its REQ or REP).
    pub remote: Option<QpInfo>,
    /// This side's QP's parameters (IB CM's rules, as the kernel's `cm_init_qp_*_attr`:
    /// a passive side's retry and RNR retry counts are the REQ's, an active side's RNR
    /// retry count the REP's).
    pub mine: Negotiated,
    /// The RNR retry count this side's REQ or REP states (its `conn_param`'s): the
    /// peer's QP takes it.
    pub offer_rnr: u8,
    /// Events queued or handed out, not yet acknowledged.
    pub unacked: u32,
    /// `rdma_destroy_id` began.
    pub destroyed: bool,
    /// DISCONNECTED was reported.
    pub disconnected: bool,
    /// A passive endpoint's set-up.
    pub ep: Option<EpSetup>,
    /// CM-made verbs objects.
    pub owned: Owned,
    /// The QP number an id without a QP connects with (`conn_param->qp_num`).
    pub qpn_hint: u32,
    /// The private data of the REQ to send.
    pub pending_private: Vec<u8>,
    /// A synchronous id's current event (`id->event`), acknowledged by the next call.
    pub current: *mut rdma_cm_event,
}

/// The shared part of an id.
pub struct Inner {
    /// State.
    pub st: Mutex<State>,
    /// Signalled when `unacked` drops.
    pub acked: Condvar,
    /// The C id's address (`event->id`).
    pub cptr: usize,
    /// Port space (`RDMA_PS_*`).
    pub ps: u32,
}

// SAFETY: the raw pointers in State name verbs objects and C memory owned by the id,
// used under its lock by whichever thread holds it.
unsafe impl Send for State {}
// SAFETY: as above; all access goes through the mutex.
unsafe impl Sync for Inner {}
// SAFETY: as above.
unsafe impl Send for Inner {}

/// `struct rdma_cm_id` + its state + the path record `route.path_rec` points at.
#[repr(C)]
pub struct CmId {
    /// The C id.
    pub id: rdma_cm_id,
    /// The state.
    pub inner: Arc<Inner>,
    path: ibv_sa_path_rec,
}

impl CmId {
    /// A new id reporting to `queue` (and owning `sync`, a synchronous id's channel).
    pub fn create(
        queue: Arc<Queue>,
        sync: Option<Box<Channel>>,
        channel: *mut rdma_event_channel,
        context: *mut std::ffi::c_void,
        ps: u32,
    ) -> *mut CmId {
        // SAFETY: plain C data; all-zero is valid.
        let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
        id.context = context;
        id.ps = ps;
        id.qp_type = if ps == RDMA_PS_UDP || ps == RDMA_PS_IPOIB {
            IBV_QPT_UD
        } else {
            IBV_QPT_RC
        };
        let channel = match &sync {
            Some(c) => (&**c as *const Channel)
                .cast_mut()
                .cast::<rdma_event_channel>(),
            None => channel,
        };
        id.channel = channel;
        let st = State {
            phase: Phase::Idle,
            queue,
            sync,
            local: None,
            peer: None,
            sock: None,
            link: None,
            token: None,
            attempted: false,
            opts: Options::default(),
            timeout_ms: 2000,
            psn: rand_psn(),
            remote: None,
            mine: Negotiated::default(),
            offer_rnr: 7,
            unacked: 0,
            destroyed: false,
            disconnected: false,
            ep: None,
            owned: Owned::default(),
            qpn_hint: 0,
            pending_private: Vec::new(),
            current: std::ptr::null_mut(),
        };
        let b = Box::new(CmId {
            id,
            inner: Arc::new(Inner {
                st: Mutex::new(st),
                acked: Condvar::new(),
                cptr: 0,
                ps,
            }),
            // SAFETY: plain C data.
            path: unsafe { std::mem::zeroed() },
        });
        let p = Box::into_raw(b);
        // SAFETY: just allocated; no other reference exists yet.
        unsafe {
            Arc::get_mut(&mut (*p).inner).expect("fresh").cptr = p as usize;
            (*p).id.route.path_rec = &mut (*p).path;
        }
        p
    }

    /// The id behind an application pointer.
    ///
    /// # Safety
    /// `p` is NULL or an id from [`CmId::create`] not yet destroyed.
    pub unsafe fn from_c<'a>(p: *mut rdma_cm_id) -> Option<&'a mut CmId> {
        // SAFETY: per the contract (the C id is the first field).
        unsafe { p.cast::<CmId>().as_mut() }
    }

    /// Record the local address in `route.addr.src_addr` (and the GIDs).
    pub fn set_local(&mut self, a: &SocketAddr, sgid: [u8; 16]) {
        // SAFETY: the source union is sockaddr_storage-sized.
        unsafe {
            sockaddr::write(
                a,
                std::ptr::addr_of_mut!(self.id.route.addr.__bindgen_anon_1).cast::<u8>(),
            )
        };
        self.path.sgid.raw = sgid;
        self.path.pkey = 0xffff;
        self.path.mtu = IBV_MTU_4096 as u8;
        self.path.hop_limit = 64;
        // SAFETY: writing the ibaddr arm of the address union (plain bytes).
        unsafe {
            let ib = self.id.route.addr.addr.ibaddr.as_mut();
            ib.sgid.raw = sgid;
            ib.pkey = 0xffff;
        }
    }

    /// Record the peer address in `route.addr.dst_addr` and its GID.
    pub fn set_peer(&mut self, a: &SocketAddr, dgid: [u8; 16]) {
        // SAFETY: the destination union is sockaddr_storage-sized.
        unsafe {
            sockaddr::write(
                a,
                std::ptr::addr_of_mut!(self.id.route.addr.__bindgen_anon_2).cast::<u8>(),
            )
        };
        self.path.dgid.raw = dgid;
        // SAFETY: as in set_local.
        unsafe { self.id.route.addr.addr.ibaddr.as_mut().dgid.raw = dgid };
    }

    /// Record a resolved route (one path).
    pub fn set_route(&mut self) {
        self.id.route.num_paths = 1;
        self.path.numb_path = 1;
        self.path.reversible = 1;
    }
}

impl Inner {
    /// Lock the state.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock()
    }

    /// Queue `ev` (for this id) unless the id is being destroyed; counted until it
    /// is acknowledged.
    pub fn post(self: &Arc<Self>, st: &mut State, mut ev: Box<EventBox>) {
        if st.destroyed {
            return;
        }
        st.unacked += 1;
        let me = Arc::clone(self);
        ev.on_ack = Some(Box::new(move || me.ack_one()));
        st.queue.push(ev);
    }

    /// One of this id's events was acknowledged (or withdrawn).
    pub fn ack_one(&self) {
        let mut st = self.st.lock();
        st.unacked = st.unacked.saturating_sub(1);
        drop(st);
        self.acked.notify_all();
    }
}

/// A random 24-bit first PSN.
pub fn rand_psn() -> u32 {
    let mut b = [0u8; 4];
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.subsec_nanos());
        b = t.to_ne_bytes();
    }
    u32::from_ne_bytes(b) & 0xff_ffff
}

/// Acknowledge an event: run its hook and free it.
///
/// # Safety
/// `ev` is an event from a channel's queue, not yet acknowledged.
pub unsafe fn ack(ev: *mut rdma_cm_event) {
    // SAFETY: per the contract (the C event is the first field of its box).
    let mut b = unsafe { Box::from_raw(ev.cast::<EventBox>()) };
    if let Some(f) = b.on_ack.take() {
        f();
    }
}
