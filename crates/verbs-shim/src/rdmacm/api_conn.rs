//! librdmacm's entry points that resolve, listen, connect, accept, reject and
//! disconnect, and those that manage an id's QP (`rdma_create_qp[_ex]`,
//! `rdma_destroy_qp`, `rdma_init_qp_attr`) and SRQ.

use super::api_id::{bind, call, cm, complete};
use super::channel::EventBox;
use super::id::{CmId, Negotiated, Phase, State};
use super::link::Link;
use super::reactor;
use super::sockaddr;
use super::verbs;
use super::wire::{self, Msg};
use crate::ffi::rdmacm::*;
use crate::ffi::*;
use std::ffi::{c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// A call's private data (NULL or empty: none), refused with EINVAL beyond `max`.
///
/// # Safety
/// `data` is NULL or readable for `len` bytes.
unsafe fn private_of(data: *const c_void, len: u8, max: usize) -> Result<Vec<u8>, i32> {
    if data.is_null() || len == 0 {
        return Ok(Vec::new());
    }
    if usize::from(len) > max {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }.to_vec())
}

fn post(c: &CmId, st: &mut State, kind: rdma_cm_event_type, status: i32) {
    let ev = EventBox::new(kind, (c as *const CmId).cast_mut().cast(), status);
    c.inner.post(st, ev);
}

/// # Safety
/// `idp` ours; `src` NULL or readable; `dst` readable.
#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    idp: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    timeout_ms: c_int,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        // SAFETY: per the contract.
        let d = unsafe { sockaddr::read(dst) }.map_err(|e| e.errno())?;
        if d.ip().is_unspecified() {
            return Err(libc::EINVAL);
        }
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if !matches!(st.phase, Phase::Idle | Phase::Bound) {
            return Err(libc::EINVAL);
        }
        st.timeout_ms = if timeout_ms > 0 { timeout_ms } else { 2000 };
        if matches!(st.phase, Phase::Idle) {
            let from = if src.is_null() {
                None
            } else {
                // SAFETY: per the contract.
                Some(unsafe { sockaddr::read(src) }.map_err(|e| e.errno())?)
            };
            let ip = match from {
                Some(a) if !a.ip().is_unspecified() => Ok(a.ip()),
                _ => sockaddr::source_for(&d).map(|ip| match (ip, d) {
                    // An IPv4 peer named as IPv4-mapped IPv6 is reached from IPv6.
                    (IpAddr::V4(v), SocketAddr::V6(_)) => IpAddr::V6(v.to_ipv6_mapped()),
                    (ip, _) => ip,
                }),
            };
            match ip {
                Ok(ip) => bind(
                    c,
                    &mut st,
                    SocketAddr::new(ip, from.map_or(0, |a| a.port())),
                )?,
                Err(e) => {
                    post(c, &mut st, RDMA_CM_EVENT_ADDR_ERROR, -e.errno());
                    drop(st);
                    return complete(c);
                }
            }
        }
        st.peer = Some(d);
        c.set_peer(&d, sockaddr::gid_of(d.ip()));
        verbs::attach(c)?;
        st.phase = Phase::AddrResolved;
        post(c, &mut st, RDMA_CM_EVENT_ADDR_RESOLVED, 0);
        drop(st);
        complete(c)
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(idp: *mut rdma_cm_id, timeout_ms: c_int) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if !matches!(st.phase, Phase::AddrResolved) {
            return Err(libc::EINVAL);
        }
        if timeout_ms > 0 {
            st.timeout_ms = timeout_ms;
        }
        c.set_route();
        st.phase = Phase::RouteResolved;
        post(c, &mut st, RDMA_CM_EVENT_ROUTE_RESOLVED, 0);
        drop(st);
        complete(c)
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_listen(idp: *mut rdma_cm_id, backlog: c_int) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if matches!(st.phase, Phase::Idle) {
            // The kernel's rule: an unbound id listens on the wildcard.
            bind(
                c,
                &mut st,
                SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
            )
            .or_else(|_| {
                bind(
                    c,
                    &mut st,
                    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                )
            })?;
        }
        if !matches!(st.phase, Phase::Bound) {
            return Err(libc::EINVAL);
        }
        let s = st.sock.take().ok_or(libc::EINVAL)?;
        // IB's CM queues every request whatever the backlog (the kernel uses it for
        // iWARP only): the stream listener takes the most the kernel allows, so a
        // burst of connects never waits on a dropped SYN's one-second retry.
        let _ = backlog;
        if let Err(e) = s.listen(libc::SOMAXCONN.max(4096)) {
            st.sock = Some(s);
            return Err(e.raw_os_error().unwrap_or(libc::EADDRINUSE));
        }
        let t = reactor::get()?.listen(&inner, s.into())?;
        st.token = Some(t);
        st.phase = Phase::Listening;
        Ok(())
    })
}

fn clamp_depth(v: u8) -> u8 {
    v.min(verbs::max_rd_atom())
}

/// # Safety
/// `idp` ours; `p` NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn rdma_connect(idp: *mut rdma_cm_id, p: *mut rdma_conn_param) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if !matches!(st.phase, Phase::RouteResolved) {
            return Err(libc::EINVAL);
        }
        let ud = c.id.qp_type == IBV_QPT_UD;
        // SAFETY: readable per the contract.
        let p = unsafe { p.as_ref() };
        let max = if ud {
            wire::SIDR_REQ_PRIVATE_MAX
        } else {
            wire::REQ_PRIVATE_MAX
        };
        let (data, len) = p.map_or((std::ptr::null(), 0), |p| {
            (p.private_data, p.private_data_len)
        });
        // SAFETY: private_data readable for its length (the caller's contract).
        let private = unsafe { private_of(data, len, max)? };
        let m = verbs::max_rd_atom();
        st.mine = match p {
            Some(p) => Negotiated {
                responder_resources: clamp_depth(p.responder_resources),
                initiator_depth: clamp_depth(p.initiator_depth),
                retry_count: p.retry_count.min(7),
                rnr_retry_count: p.rnr_retry_count.min(7),
            },
            None => Negotiated {
                responder_resources: m,
                initiator_depth: m,
                retry_count: 7,
                rnr_retry_count: 7,
            },
        };
        // The REP's count replaces this one for the QP; this one goes in the REQ.
        st.offer_rnr = st.mine.rnr_retry_count;
        st.qpn_hint = p.map_or(0, |p| p.qp_num);
        st.pending_private = private;
        let peer = st.peer.ok_or(libc::EINVAL)?;
        if peer.port() == 0 {
            return Err(libc::EINVAL);
        }
        let s = st.sock.take().ok_or(libc::EINVAL)?;
        s.set_nonblocking(true).map_err(|_| libc::EIO)?;
        st.attempted = true;
        match s.connect(&peer.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                st.phase = Phase::Done;
                post(
                    c,
                    &mut st,
                    RDMA_CM_EVENT_REJECTED,
                    i32::from(reactor::REJ_INVALID_SERVICE_ID),
                );
                drop(st);
                return complete(c);
            }
            Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO)),
        }
        let link = Arc::new(Link::new(s.into()));
        st.link = Some(Arc::clone(&link));
        st.phase = Phase::Connecting;
        let timeout = Duration::from_millis(st.timeout_ms.max(100) as u64);
        let t = reactor::get()?.connect(&inner, link, timeout)?;
        st.token = Some(t);
        drop(st);
        complete(c)
    })
}

/// # Safety
/// `idp` ours; `p` NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn rdma_accept(idp: *mut rdma_cm_id, p: *mut rdma_conn_param) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if !matches!(st.phase, Phase::Requested) {
            return Err(libc::EINVAL);
        }
        let link = st.link.clone().ok_or(libc::ECONNRESET)?;
        let ud = c.id.qp_type == IBV_QPT_UD;
        // SAFETY: readable per the contract.
        let p = unsafe { p.as_ref() };
        let max = if ud {
            wire::SIDR_REP_PRIVATE_MAX
        } else {
            wire::REP_PRIVATE_MAX
        };
        let (data, len) = p.map_or((std::ptr::null(), 0), |p| {
            (p.private_data, p.private_data_len)
        });
        // SAFETY: private_data readable for its length (the caller's contract).
        let private = unsafe { private_of(data, len, max)? };
        let remote = st.remote.clone().ok_or(libc::EINVAL)?;
        // The accept's depths; the retry counts stay the REQ's (IB CM); the accept's
        // RNR retry count goes in the REP, for the peer's QP.
        st.mine = match p {
            Some(p) => Negotiated {
                responder_resources: clamp_depth(p.responder_resources),
                initiator_depth: clamp_depth(p.initiator_depth),
                retry_count: remote.retry_count.min(7),
                rnr_retry_count: remote.rnr_retry_count.min(7),
            },
            None => Negotiated {
                responder_resources: clamp_depth(remote.initiator_depth),
                initiator_depth: clamp_depth(remote.responder_resources),
                retry_count: remote.retry_count.min(7),
                rnr_retry_count: remote.rnr_retry_count.min(7),
            },
        };
        st.offer_rnr = p
            .map_or(remote.rnr_retry_count, |p| p.rnr_retry_count)
            .min(7);
        // SAFETY: the id's QP, under its lock.
        unsafe { verbs::connect_qp(c, &st)? };
        let rep = Msg::Rep {
            qp: reactor::qp_info(c, &st, p.map_or(0, |p| p.qp_num)),
            private,
        };
        link.send(&rep).map_err(|_| libc::ECONNRESET)?;
        if ud {
            // SIDR ends with the REP: nothing more comes on the stream.
            st.phase = Phase::Established;
            if let (Some(t), Ok(r)) = (st.token.take(), reactor::get()) {
                r.forget(t);
            }
            st.link = None;
            link.close();
            return Ok(());
        }
        st.phase = Phase::Accepting;
        drop(st);
        complete(c)
    })
}

/// Send a REJ for a request not yet answered.
fn reject(idp: *mut rdma_cm_id, data: *const c_void, len: u8, reason: u16) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { cm(idp)? };
        let mut st = c.inner.lock();
        if !matches!(st.phase, Phase::Requested) {
            return Err(libc::EINVAL);
        }
        // SAFETY: readable for len bytes (the caller's contract).
        let private = unsafe { private_of(data, len, wire::REP_PRIVATE_MAX)? };
        st.phase = Phase::Done;
        if let (Some(t), Ok(r)) = (st.token.take(), reactor::get()) {
            r.forget(t);
        }
        if let Some(l) = st.link.take() {
            let _ = l.send(&Msg::Rej { reason, private });
            l.close();
        }
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `data` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn rdma_reject(idp: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    reject(idp, data, len, reactor::REJ_CONSUMER_DEFINED)
}

/// # Safety
/// As [`rdma_reject`].
#[no_mangle]
pub unsafe extern "C" fn rdma_reject_ece(
    idp: *mut rdma_cm_id,
    data: *const c_void,
    len: u8,
) -> c_int {
    // IB CM reason 35: vendor option not supported.
    reject(idp, data, len, 35)
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_establish(idp: *mut rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let mut st = c.inner.lock();
        if !matches!(st.phase, Phase::Responded) {
            return Err(libc::EINVAL);
        }
        let l = st.link.clone().ok_or(libc::ECONNRESET)?;
        l.send(&Msg::Rtu).map_err(|_| libc::ECONNRESET)?;
        st.phase = Phase::Established;
        Ok(())
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_notify(idp: *mut rdma_cm_id, _event: u32) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let mut st = c.inner.lock();
        match st.phase {
            // Traffic before the RTU: the connection is up (the IB CM's rule).
            Phase::Accepting => {
                st.phase = Phase::Established;
                post(c, &mut st, RDMA_CM_EVENT_ESTABLISHED, 0);
                Ok(())
            }
            Phase::Established => Ok(()),
            _ => Err(libc::EINVAL),
        }
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(idp: *mut rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if c.id.qp_type == IBV_QPT_UD {
            return Err(libc::EINVAL);
        }
        // A connection already going or gone (the peer's DREQ came first, or it
        // was rejected): the kernel's rdma_disconnect moves the QP to ERR, finds no
        // DREQ or DREP to send and succeeds; an id that never connected: EINVAL.
        if matches!(st.phase, Phase::Disconnecting | Phase::Done) && st.attempted {
            // SAFETY: the id's QP, under its lock.
            unsafe { verbs::error_qp(c, &st) };
            return Ok(());
        }
        if !matches!(
            st.phase,
            Phase::Established | Phase::Accepting | Phase::Responded
        ) {
            return Err(libc::EINVAL);
        }
        // SAFETY: the id's QP, under its lock (librdmacm moves it to ERR first).
        unsafe { verbs::error_qp(c, &st) };
        let sent = st.link.as_ref().is_some_and(|l| l.send(&Msg::Dreq).is_ok());
        if sent {
            st.phase = Phase::Disconnecting;
            let bound = Duration::from_millis(st.timeout_ms.max(100) as u64);
            if let (Some(t), Ok(r)) = (st.token, reactor::get()) {
                r.bound(t, bound);
            }
        } else {
            reactor::disconnected(&inner, &mut st);
        }
        Ok(())
    })
}

/// # Safety
/// `listen` ours; `idp` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    idp: *mut *mut rdma_cm_id,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let l = unsafe { cm(listen)? };
        if idp.is_null() {
            return Err(libc::EINVAL);
        }
        let (queue, ep) = {
            let st = l.inner.lock();
            let q = st
                .sync
                .as_ref()
                .map(|c| Arc::clone(&c.queue))
                .ok_or(libc::EINVAL)?;
            (q, st.ep)
        };
        let ev = loop {
            match queue.pop() {
                Ok(e) => break e,
                Err(libc::EINTR) => {}
                Err(e) => return Err(e),
            }
        };
        if ev.ev.event != RDMA_CM_EVENT_CONNECT_REQUEST {
            let status = ev.ev.status;
            // SAFETY: an event of ours, handed to nobody.
            unsafe { super::id::ack(Box::into_raw(ev).cast()) };
            return Err(if status < 0 { -status } else { libc::EINVAL });
        }
        let child = ev.ev.id;
        // SAFETY: a request's new id.
        let c = unsafe { cm(child)? };
        let p = Box::into_raw(ev).cast::<rdma_cm_event>();
        c.id.event = p;
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        st.current = p;
        if let Some(ep) = ep {
            let mut a = to_ex(&ep.attr, ep.pd);
            // SAFETY: valid attributes; the new id's state is locked.
            if let Err(e) = unsafe { verbs::create_qp(c, &mut st, &mut a) } {
                drop(st);
                // SAFETY: our new id.
                unsafe { super::api_id::rdma_destroy_id(child) };
                return Err(e);
            }
        }
        // SAFETY: writable per the contract.
        unsafe { *idp = child };
        Ok(())
    })
}

/// The extended form of basic QP attributes.
pub fn to_ex(a: &ibv_qp_init_attr, pd: *mut ibv_pd) -> ibv_qp_init_attr_ex {
    // SAFETY: plain C data.
    let mut x: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    x.qp_context = a.qp_context;
    x.send_cq = a.send_cq;
    x.recv_cq = a.recv_cq;
    x.srq = a.srq;
    x.cap = a.cap;
    x.qp_type = a.qp_type;
    x.sq_sig_all = a.sq_sig_all;
    x.pd = pd;
    x
}

/// # Safety
/// `idp` ours; `pd` NULL or ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(
    idp: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        // SAFETY: per the contract.
        let a = unsafe { attr.as_mut() }.ok_or(libc::EINVAL)?;
        let mut x = to_ex(a, pd);
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        // SAFETY: valid attributes; the state is locked.
        unsafe { verbs::create_qp(c, &mut st, &mut x)? };
        a.cap = x.cap;
        a.send_cq = x.send_cq;
        a.recv_cq = x.recv_cq;
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(
    idp: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        // SAFETY: per the contract.
        let a = unsafe { attr.as_mut() }.ok_or(libc::EINVAL)?;
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
            a.pd = c.id.pd;
        }
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        // SAFETY: valid attributes; the state is locked.
        unsafe { verbs::create_qp(c, &mut st, a) }
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_qp(idp: *mut rdma_cm_id) {
    // SAFETY: per the contract.
    if let Some(c) = unsafe { CmId::from_c(idp) } {
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        tracing::debug!(id = idp as usize, qp = c.id.qp as usize, "rdma_destroy_qp");
        // SAFETY: the id's QP; state locked.
        unsafe { verbs::destroy_qp(c, &mut st) };
    }
}

/// # Safety
/// `idp` ours; `attr`, `mask` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_init_qp_attr(
    idp: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        if attr.is_null() || mask.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: readable/writable per the contract.
        let want = unsafe { (*attr).qp_state };
        let st = c.inner.lock();
        let (a, m) = verbs::init_attr(c, &st, want)?;
        // SAFETY: as above.
        unsafe {
            *attr = a;
            *mask = m;
        }
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `pd` NULL or ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq(
    idp: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        if attr.is_null() || !c.id.srq.is_null() {
            return Err(libc::EINVAL);
        }
        let pd = if !pd.is_null() {
            pd
        } else if !c.id.pd.is_null() {
            c.id.pd
        } else {
            verbs::default_pd()?
        };
        // SAFETY: valid PD and attributes.
        let srq = unsafe { crate::resources::ibv_create_srq(pd, attr) };
        if srq.is_null() {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL));
        }
        c.id.srq = srq;
        c.id.pd = pd;
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq_ex(
    idp: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let a = unsafe { attr.as_ref() }.ok_or(libc::EINVAL)?;
        if a.srq_type != IBV_SRQT_BASIC {
            return Err(libc::EOPNOTSUPP);
        }
        let mut b = ibv_srq_init_attr {
            srq_context: a.srq_context,
            attr: a.attr,
        };
        let pd = if a.comp_mask & IBV_SRQ_INIT_ATTR_PD != 0 {
            a.pd
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: per the contract.
        match unsafe { rdma_create_srq(idp, pd, &mut b) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL)),
        }
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_srq(idp: *mut rdma_cm_id) {
    // SAFETY: per the contract.
    if let Some(c) = unsafe { CmId::from_c(idp) } {
        if !c.id.srq.is_null() {
            // SAFETY: the id's SRQ.
            unsafe { crate::resources::ibv_destroy_srq(c.id.srq) };
            c.id.srq = std::ptr::null_mut();
        }
    }
}
