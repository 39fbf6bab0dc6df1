//! The CM's one thread per process: it waits (epoll, blocking while nothing happens)
//! on the listeners and the streams to peers' CMs and drives the connection state
//! machine on what arrives — CONNECT_REQUEST for a REQ, ESTABLISHED /
//! CONNECT_RESPONSE for a REP, REJECTED, DISCONNECTED for a DREQ or a stream that
//! ends (a peer that died) — plus the timers bounding each wait for a peer.

use super::channel::{Action, EventBox, Queue};
use super::id::{CmId, Inner, Negotiated, Phase, State};
use super::link::Link;
use super::verbs;
use super::wire::{self, Msg, QpInfo};
use crate::ffi::rdmacm::*;
use crate::ffi::*;
use parking_lot::Mutex;
use rustix::event::epoll;
use std::collections::HashMap;
use std::io::Read;
use std::net::TcpListener;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// IB CM reject reason: no listener for the service (a connect to a port nobody
/// listens on).
pub const REJ_INVALID_SERVICE_ID: u16 = 8;
/// IB CM reject reason: the consumer rejected (`rdma_reject`).
pub const REJ_CONSUMER_DEFINED: u16 = 28;
/// How long an accepted stream may take to bring its REQ.
const REQ_WAIT: Duration = Duration::from_secs(5);
/// How long a requester waits for the REP once the passive CM said it has the REQ
/// (MRA): the application's accept, bounded so a stopped peer costs bounded time.
const ACCEPT_WAIT: Duration = Duration::from_secs(30);

enum Watch {
    /// A listening id's socket.
    Listener {
        id: Weak<Inner>,
        sock: Arc<TcpListener>,
    },
    /// An accepted stream before its REQ (no id yet).
    Pending {
        listener: Weak<Inner>,
        link: Arc<Link>,
    },
    /// A connecting stream (non-blocking connect in progress).
    Connecting { id: Weak<Inner>, link: Arc<Link> },
    /// An id's stream.
    Conn { id: Weak<Inner>, link: Arc<Link> },
    /// An id in time-wait after its disconnect (a timer only).
    TimeWait { id: Weak<Inner> },
}

struct Timer {
    at: Instant,
    token: u64,
}

/// The reactor.
pub struct Reactor {
    ep: OwnedFd,
    wake: OwnedFd,
    table: Mutex<HashMap<u64, Watch>>,
    timers: Mutex<Vec<Timer>>,
    next: AtomicU64,
}

const WAKE: u64 = 0;

/// The process's reactor (a forked child starts its own: the parent's thread is not
/// there).
static REACTOR: crate::per_process::PerProcess<Result<Arc<Reactor>, i32>> =
    crate::per_process::PerProcess::new();

/// The process's reactor (started at first use).
pub fn get() -> Result<Arc<Reactor>, i32> {
    REACTOR
        .get_or_init(|| {
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| e.raw_os_error())?;
            let wake = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .map_err(|e| e.raw_os_error())?;
            epoll::add(
                &ep,
                &wake,
                epoll::EventData::new_u64(WAKE),
                epoll::EventFlags::IN,
            )
            .map_err(|e| e.raw_os_error())?;
            let r = Arc::new(Reactor {
                ep,
                wake,
                table: Mutex::new(HashMap::new()),
                timers: Mutex::new(Vec::new()),
                next: AtomicU64::new(1),
            });
            let r2 = Arc::clone(&r);
            std::thread::Builder::new()
                .name("nprdma-cm".into())
                .spawn(move || r2.run())
                .map_err(|_| libc::EAGAIN)?;
            Ok(r)
        })
        .clone()
}

fn fd_of(raw: i32) -> BorrowedFd<'static> {
    // SAFETY: only used for epoll_ctl on an fd the table's entry keeps open.
    unsafe { BorrowedFd::borrow_raw(raw) }
}

impl Reactor {
    fn token(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn add(&self, fd: i32, w: Watch, out: bool) -> Result<u64, i32> {
        let t = self.token();
        self.table.lock().insert(t, w);
        let f = if out {
            epoll::EventFlags::OUT
        } else {
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP
        };
        if let Err(e) = epoll::add(&self.ep, fd_of(fd), epoll::EventData::new_u64(t), f) {
            self.table.lock().remove(&t);
            return Err(e.raw_os_error());
        }
        Ok(t)
    }

    fn arm(&self, token: u64, after: Duration) {
        self.timers.lock().push(Timer {
            at: Instant::now() + after,
            token,
        });
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn disarm(&self, token: u64) {
        self.timers.lock().retain(|t| t.token != token);
    }

    /// Watch a listening id's socket.
    pub fn listen(&self, id: &Arc<Inner>, sock: TcpListener) -> Result<u64, i32> {
        sock.set_nonblocking(true).map_err(|_| libc::EIO)?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
        self.add(
            fd,
            Watch::Listener {
                id: Arc::downgrade(id),
                sock: Arc::new(sock),
            },
            false,
        )
    }

    /// Watch a non-blocking connect; when it completes, `req` is sent (and the answer
    /// awaited for `timeout`).
    pub fn connect(&self, id: &Arc<Inner>, link: Arc<Link>, timeout: Duration) -> Result<u64, i32> {
        tracing::debug!(fd = link.fd(), "rdma_cm connecting");
        let t = self.add(
            link.fd(),
            Watch::Connecting {
                id: Arc::downgrade(id),
                link,
            },
            true,
        )?;
        self.arm(t, timeout);
        Ok(t)
    }

    /// Bound the wait on `token`'s stream (a disconnect's DREP).
    pub fn bound(&self, token: u64, after: Duration) {
        self.arm(token, after);
    }

    /// Stop watching `token` (its socket is closed by whoever holds it last).
    pub fn forget(&self, token: u64) {
        self.disarm(token);
        if let Some(w) = self.table.lock().remove(&token) {
            let fd = match &w {
                Watch::TimeWait { .. } => return,
                Watch::Listener { sock, .. } => std::os::fd::AsRawFd::as_raw_fd(&**sock),
                Watch::Pending { link, .. }
                | Watch::Connecting { link, .. }
                | Watch::Conn { link, .. } => link.fd(),
            };
            let _ = epoll::delete(&self.ep, fd_of(fd));
        }
    }

    fn run(self: Arc<Self>) {
        let mut evs: Vec<epoll::Event> = Vec::with_capacity(64);
        loop {
            let timeout = self.next_deadline().map(|d| {
                let d = d.saturating_duration_since(Instant::now());
                rustix::time::Timespec {
                    tv_sec: d.as_secs() as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                }
            });
            evs.clear();
            match epoll::wait(
                &self.ep,
                rustix::buffer::spare_capacity(&mut evs),
                timeout.as_ref(),
            ) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
            for e in evs.iter() {
                let t = e.data.u64();
                if t == WAKE {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&self.wake, &mut b);
                    continue;
                }
                self.ready(t);
            }
            self.expire();
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.timers.lock().iter().map(|t| t.at).min()
    }

    fn expire(&self) {
        let now = Instant::now();
        let due: Vec<u64> = {
            let mut ts = self.timers.lock();
            let due = ts.iter().filter(|t| t.at <= now).map(|t| t.token).collect();
            ts.retain(|t| t.at > now);
            due
        };
        for t in due {
            let w = self.table.lock().remove(&t);
            tracing::debug!(t, present = w.is_some(), "rdma_cm timer");
            match w {
                Some(Watch::Pending { link, .. }) => {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    link.close();
                }
                Some(Watch::Connecting { id, link }) | Some(Watch::Conn { id, link }) => {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    link.close();
                    if let Some(id) = id.upgrade() {
                        let mut st = id.lock();
                        match st.phase {
                            Phase::Connecting => {
                                fail(
                                    &id,
                                    &mut st,
                                    RDMA_CM_EVENT_UNREACHABLE,
                                    -libc::ETIMEDOUT,
                                    &[],
                                );
                            }
                            // No DREP from a stopped peer: disconnected all the same.
                            Phase::Disconnecting => disconnected(&id, &mut st),
                            _ => {}
                        }
                    }
                }
                Some(Watch::TimeWait { id }) => {
                    if let Some(id) = id.upgrade() {
                        let mut st = id.lock();
                        id.post(
                            &mut st,
                            EventBox::new(RDMA_CM_EVENT_TIMEWAIT_EXIT, id.cptr as *mut _, 0),
                        );
                    }
                }
                Some(w @ Watch::Listener { .. }) => {
                    self.table.lock().insert(t, w);
                }
                None => {}
            }
        }
    }

    fn ready(&self, t: u64) {
        let w = self.table.lock().remove(&t);
        let Some(w) = w else { return };
        match w {
            Watch::TimeWait { .. } => {}
            Watch::Listener { id, sock } => {
                while let Ok((s, from)) = sock.accept() {
                    tracing::debug!(%from, "rdma_cm accepted a stream");
                    let _ = s.set_nonblocking(true);
                    let link = Arc::new(Link::new(s));
                    let fd = link.fd();
                    let w = Watch::Pending {
                        listener: id.clone(),
                        link,
                    };
                    if let Ok(pt) = self.add(fd, w, false) {
                        self.arm(pt, REQ_WAIT);
                    }
                }
                self.table.lock().insert(t, Watch::Listener { id, sock });
            }
            Watch::Connecting { id, link } => {
                tracing::debug!(t, fd = link.fd(), local = ?link.local(), peer = ?link.peer(), "rdma_cm connect completes");
                self.disarm(t);
                let Some(id) = id.upgrade() else {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    return;
                };
                let err = link.stream().take_error().ok().flatten();
                let mut st = id.lock();
                if st.destroyed || !matches!(st.phase, Phase::Connecting) {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    return;
                }
                if let Some(e) = err {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    if e.raw_os_error() == Some(libc::ECONNREFUSED) {
                        fail(
                            &id,
                            &mut st,
                            RDMA_CM_EVENT_REJECTED,
                            i32::from(REJ_INVALID_SERVICE_ID),
                            &[],
                        );
                    } else {
                        let code = e.raw_os_error().unwrap_or(libc::EHOSTUNREACH);
                        fail(&id, &mut st, RDMA_CM_EVENT_UNREACHABLE, -code, &[]);
                    }
                    return;
                }
                let req = request(&id, &st);
                if link.send(&req).is_err() {
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    fail(
                        &id,
                        &mut st,
                        RDMA_CM_EVENT_UNREACHABLE,
                        -libc::ECONNRESET,
                        &[],
                    );
                    return;
                }
                let timeout = Duration::from_millis(st.timeout_ms.max(100) as u64);
                drop(st);
                self.table.lock().insert(
                    t,
                    Watch::Conn {
                        id: Arc::downgrade(&id),
                        link: Arc::clone(&link),
                    },
                );
                let _ = epoll::modify(
                    &self.ep,
                    fd_of(link.fd()),
                    epoll::EventData::new_u64(t),
                    epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
                );
                self.arm(t, timeout);
            }
            Watch::Pending { listener, link } => {
                let (msgs, eof) = read_msgs(&link);
                tracing::debug!(n = msgs.len(), eof, "rdma_cm pending stream readable");
                let Some(Msg::Req {
                    sidr,
                    qp,
                    dst,
                    private,
                }) = msgs.into_iter().next()
                else {
                    if eof {
                        self.disarm(t);
                        let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                    } else {
                        self.table
                            .lock()
                            .insert(t, Watch::Pending { listener, link });
                    }
                    return;
                };
                self.disarm(t);
                tracing::debug!(sidr, ?qp, %dst, "rdma_cm request");
                match self.new_request(&listener, &link, t, sidr, qp, dst, &private) {
                    Some(child) => {
                        self.table.lock().insert(t, Watch::Conn { id: child, link });
                    }
                    None => {
                        tracing::debug!("rdma_cm request refused (no such listener)");
                        let _ = link.send(&Msg::Rej {
                            reason: REJ_INVALID_SERVICE_ID,
                            private: Vec::new(),
                        });
                        let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                        link.close();
                    }
                }
            }
            Watch::Conn { id, link } => {
                let (msgs, eof) = read_msgs(&link);
                let alive = id.upgrade();
                let mut done = eof;
                if let Some(id) = &alive {
                    let mut st = id.lock();
                    for m in msgs {
                        done |= self.on_msg(id, &mut st, t, &link, m);
                    }
                    if eof {
                        on_eof(id, &mut st);
                    }
                }
                if done || alive.is_none() {
                    self.disarm(t);
                    link.close();
                    let _ = epoll::delete(&self.ep, fd_of(link.fd()));
                } else {
                    self.table.lock().insert(t, Watch::Conn { id, link });
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn new_request(
        &self,
        listener: &Weak<Inner>,
        link: &Arc<Link>,
        token: u64,
        sidr: bool,
        qp: QpInfo,
        _dst: std::net::SocketAddr,
        private: &[u8],
    ) -> Option<Weak<Inner>> {
        let l = listener.upgrade()?;
        let lst = l.lock();
        if lst.destroyed || !matches!(lst.phase, Phase::Listening) {
            return None;
        }
        if sidr != (l.ps == RDMA_PS_UDP || l.ps == RDMA_PS_IPOIB) {
            return None;
        }
        // SAFETY: the listener is alive and not destroyed (checked under its lock).
        let lc = unsafe { &*(l.cptr as *const CmId) };
        let (queue, sync) = if lst.sync.is_some() {
            // A synchronous listener's requests get their own channel (librdmacm
            // migrates them); the request itself is reported on the listener's.
            match super::channel::Channel::new() {
                Ok(c) => (Arc::clone(&c.queue), Some(c)),
                Err(_) => return None,
            }
        } else {
            (Arc::clone(&lst.queue), None)
        };
        let report_to = Arc::clone(&lst.queue);
        let opts = lst.opts;
        drop(lst);
        let cp = CmId::create(queue, sync, lc.id.channel, lc.id.context, l.ps);
        // SAFETY: just created, not yet published.
        let c = unsafe { &mut *cp };
        c.id.verbs = lc.id.verbs;
        c.id.pd = lc.id.pd;
        c.id.port_num = 1;
        if let (Some(local), Some(peer)) = (link.local(), link.peer()) {
            c.set_local(&local, verbs::gid0());
            c.set_peer(&peer, qp.gid);
        }
        c.set_route();
        let child = Arc::clone(&c.inner);
        let mut st = child.lock();
        st.phase = Phase::Requested;
        st.attempted = true;
        st.opts = opts;
        st.local = link.local();
        st.peer = link.peer();
        st.link = Some(Arc::clone(link));
        st.token = Some(token);
        st.remote = Some(qp.clone());
        // The REQ's parameters for this side's QP until rdma_accept says its depths:
        // an external QP may be moved to RTS before the accept (rdma_init_qp_attr).
        let m = verbs::max_rd_atom();
        st.mine = Negotiated {
            responder_resources: qp.initiator_depth.min(m),
            initiator_depth: qp.responder_resources.min(m),
            retry_count: qp.retry_count.min(7),
            rnr_retry_count: qp.rnr_retry_count.min(7),
        };
        if link.send(&Msg::Mra).is_err() {
            drop(st);
            // SAFETY: never published.
            drop(unsafe { Box::from_raw(cp) });
            return None;
        }
        let mut ev = EventBox::new(RDMA_CM_EVENT_CONNECT_REQUEST, cp.cast(), 0);
        ev.ev.listen_id = l.cptr as *mut rdma_cm_id;
        let (p, n) = ev.set_private(private);
        if sidr {
            // SAFETY: writing the ud arm of the param union (plain C data).
            let ud = unsafe { ev.ev.param.ud.as_mut() };
            ud.private_data = p;
            ud.private_data_len = n;
            ud.ah_attr = ah_to(&qp.gid, opts.tos);
            ud.qp_num = qp.qpn;
            ud.qkey = qp.qkey;
        } else {
            // SAFETY: writing the conn arm of the param union.
            let cn = unsafe { ev.ev.param.conn.as_mut() };
            cn.private_data = p;
            cn.private_data_len = n;
            cn.responder_resources = qp.initiator_depth;
            cn.initiator_depth = qp.responder_resources;
            cn.retry_count = qp.retry_count;
            cn.rnr_retry_count = qp.rnr_retry_count;
            cn.srq = u8::from(qp.srq);
            cn.qp_num = qp.qpn;
        }
        post_on(&child, &mut st, &report_to, ev);
        Some(Arc::downgrade(&child))
    }

    /// Handle `m`; returns whether the stream is finished with (a SIDR exchange).
    fn on_msg(&self, id: &Arc<Inner>, st: &mut State, t: u64, link: &Link, m: Msg) -> bool {
        if st.destroyed {
            return false;
        }
        // SAFETY: the id is alive and not destroyed (its lock is held).
        let c = unsafe { &mut *(id.cptr as *mut CmId) };
        tracing::debug!(id = id.cptr, phase = ?st.phase, msg = ?m, "rdma_cm message");
        match (st.phase, m) {
            (Phase::Connecting, Msg::Mra) => {
                self.disarm(t);
                self.arm(t, ACCEPT_WAIT);
            }
            (Phase::Connecting, Msg::Rep { qp, private }) => {
                self.disarm(t);
                let sidr = c.id.qp_type == IBV_QPT_UD;
                if let Some(peer) = st.peer {
                    c.set_peer(&peer, qp.gid);
                }
                st.remote = Some(qp.clone());
                if sidr {
                    st.phase = Phase::Established;
                    let mut ev = EventBox::new(RDMA_CM_EVENT_ESTABLISHED, id.cptr as *mut _, 0);
                    let (p, n) = ev.set_private(&private);
                    // SAFETY: the ud arm of the param union.
                    let ud = unsafe { ev.ev.param.ud.as_mut() };
                    ud.private_data = p;
                    ud.private_data_len = n;
                    ud.ah_attr = ah_to(&qp.gid, st.opts.tos);
                    ud.qp_num = qp.qpn;
                    ud.qkey = qp.qkey;
                    id.post(st, ev);
                    st.link = None;
                    st.token = None;
                    return true;
                }
                // librdmacm's rule: the REP's depths (swapped) for this side's QP.
                st.mine.responder_resources = qp.initiator_depth;
                st.mine.initiator_depth = qp.responder_resources;
                st.mine.rnr_retry_count = qp.rnr_retry_count.min(7);
                st.phase = Phase::Responded;
                let kind = RDMA_CM_EVENT_CONNECT_RESPONSE;
                let mut ev = EventBox::new(kind, id.cptr as *mut _, 0);
                let (p, n) = ev.set_private(&private);
                // SAFETY: the conn arm of the param union.
                let cn = unsafe { ev.ev.param.conn.as_mut() };
                cn.private_data = p;
                cn.private_data_len = n;
                cn.responder_resources = qp.initiator_depth;
                cn.initiator_depth = qp.responder_resources;
                cn.rnr_retry_count = qp.rnr_retry_count;
                cn.srq = u8::from(qp.srq);
                cn.qp_num = qp.qpn;
                ev.action = Action::Establish;
                id.post(st, ev);
            }
            (Phase::Connecting, Msg::Rej { reason, private }) => {
                self.disarm(t);
                fail(id, st, RDMA_CM_EVENT_REJECTED, i32::from(reason), &private);
                return true;
            }
            (Phase::Accepting, Msg::Rtu) => {
                st.phase = Phase::Established;
                let ev = EventBox::new(RDMA_CM_EVENT_ESTABLISHED, id.cptr as *mut _, 0);
                id.post(st, ev);
            }
            (
                Phase::Established | Phase::Disconnecting | Phase::Accepting | Phase::Responded,
                Msg::Dreq,
            ) => {
                let _ = link.send(&Msg::Drep);
                disconnected(id, st);
            }
            (Phase::Disconnecting, Msg::Drep) => disconnected(id, st),
            // Anything else is out of order for this phase: ignored, as the IB CM
            // drops a duplicate or stale message.
            _ => {}
        }
        st.link.is_none()
    }
}

/// The REQ for a connecting id.
pub fn request(id: &Arc<Inner>, st: &State) -> Msg {
    // SAFETY: the id is alive (its lock is held by the caller).
    let c = unsafe { &*(id.cptr as *const CmId) };
    Msg::Req {
        sidr: c.id.qp_type == IBV_QPT_UD,
        qp: qp_info(c, st, st.qpn_hint),
        dst: st
            .peer
            .unwrap_or_else(|| "0.0.0.0:0".parse().expect("literal")),
        private: st.pending_private.clone(),
    }
}

/// This side's QP as a REQ or REP states it: the id's QP's number, or `qpn_hint`
/// (`conn_param->qp_num`) for an id without a QP.
pub fn qp_info(c: &CmId, st: &State, qpn_hint: u32) -> QpInfo {
    let qpn = if c.id.qp.is_null() {
        qpn_hint
    } else {
        // SAFETY: the id's QP (its id's lock is held by the caller).
        unsafe { (*c.id.qp).qp_num }
    };
    QpInfo {
        gid: verbs::gid_for(st.local.as_ref()).0,
        qpn,
        psn: st.psn,
        responder_resources: st.mine.responder_resources,
        initiator_depth: st.mine.initiator_depth,
        retry_count: st.mine.retry_count,
        rnr_retry_count: st.offer_rnr,
        srq: !c.id.srq.is_null(),
        qkey: verbs::UDP_QKEY,
    }
}

/// An address vector to the peer with GID `gid` (UD events).
pub fn ah_to(gid: &[u8; 16], tos: u8) -> ibv_ah_attr {
    // SAFETY: plain C data.
    let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
    a.is_global = 1;
    a.port_num = 1;
    a.grh.dgid.raw = *gid;
    a.grh.sgid_index = 0;
    a.grh.hop_limit = 64;
    a.grh.traffic_class = tos;
    a
}

fn read_msgs(link: &Link) -> (Vec<Msg>, bool) {
    let mut rx = link.rx.lock();
    let mut eof = false;
    let mut buf = [0u8; 1024];
    loop {
        match link.stream().read(&mut buf) {
            Ok(0) => {
                eof = true;
                break;
            }
            Ok(n) => rx.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(_) => {
                eof = true;
                break;
            }
        }
    }
    match wire::drain(&mut rx) {
        Ok(m) => (m, eof),
        // A peer that sends what is not the protocol: the connection is dropped.
        Err(_) => (Vec::new(), true),
    }
}

/// Post `ev` (counted on `id`) to `queue` (a synchronous listener's requests).
fn post_on(id: &Arc<Inner>, st: &mut State, queue: &Arc<Queue>, ev: Box<EventBox>) {
    let own = std::mem::replace(&mut st.queue, Arc::clone(queue));
    id.post(st, ev);
    st.queue = own;
}

/// The attempt failed: report `kind` with `status` (and private data), close.
pub fn fail(
    id: &Arc<Inner>,
    st: &mut State,
    kind: rdma_cm_event_type,
    status: i32,
    private: &[u8],
) {
    tracing::debug!(id = id.cptr, phase = ?st.phase, kind, status, "rdma_cm attempt failed");
    st.phase = Phase::Done;
    if let Some(l) = st.link.take() {
        l.close();
    }
    let mut ev = EventBox::new(kind, id.cptr as *mut _, status);
    let (p, n) = ev.set_private(private);
    // SAFETY: the conn arm of the param union.
    let cn = unsafe { ev.ev.param.conn.as_mut() };
    cn.private_data = p;
    cn.private_data_len = n;
    id.post(st, ev);
}

/// The connection ended (DREQ, DREP or the stream closing): the QP to ERR and
/// DISCONNECTED once, then TIMEWAIT_EXIT (nothing of the old connection can
/// arrive any more: the QP is in ERR and the peer's stream is closed).
pub fn disconnected(id: &Arc<Inner>, st: &mut State) {
    if st.disconnected {
        return;
    }
    st.disconnected = true;
    st.phase = Phase::Done;
    if let Some(l) = st.link.take() {
        l.close();
    }
    let mut ev = EventBox::new(RDMA_CM_EVENT_DISCONNECTED, id.cptr as *mut _, 0);
    ev.action = Action::ErrorQp;
    id.post(st, ev);
    // TIMEWAIT_EXIT once the QP's time-wait has passed (its local ACK timeout:
    // 4.096 µs × 2^timeout), as the IB CM reports it.
    let t = st.opts.ack_timeout.unwrap_or(14).min(24);
    let wait = Duration::from_nanos(4096u64 << t);
    if let Ok(r) = get() {
        let tok = r.token();
        r.table.lock().insert(
            tok,
            Watch::TimeWait {
                id: Arc::downgrade(id),
            },
        );
        r.arm(tok, wait);
    }
}

fn on_eof(id: &Arc<Inner>, st: &mut State) {
    match st.phase {
        Phase::Connecting => fail(id, st, RDMA_CM_EVENT_UNREACHABLE, -libc::ECONNRESET, &[]),
        Phase::Accepting => fail(id, st, RDMA_CM_EVENT_CONNECT_ERROR, -libc::ECONNRESET, &[]),
        Phase::Established | Phase::Disconnecting | Phase::Responded => disconnected(id, st),
        // A request not answered yet: its peer gave up; the accept will fail.
        Phase::Requested => {
            st.link = None;
        }
        _ => {}
    }
}
