//! librdmacm's entry points for channels, ids and events: `rdma_create_event_channel`
//! .. `rdma_destroy_id`, `rdma_get_cm_event` / `rdma_ack_cm_event`, `rdma_migrate_id`,
//! `rdma_set_option`, `rdma_bind_addr`, the port getters, `rdma_event_str`; and the
//! calling convention they share (0, or -1 with errno; synchronous ids waiting for
//! their event).

use super::channel::{Action, Channel, EventBox};
use super::id::{self, CmId, Inner, Phase, State};
use super::reactor::{self, REJ_INVALID_SERVICE_ID};
use super::sockaddr;
use super::verbs;
use super::wire::Msg;
use crate::error::{errno, set_errno};
use crate::ffi::rdmacm::*;
use std::ffi::{c_char, c_int, c_void};
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Run an entry point: `Ok` → 0, `Err(errno)` → -1 with errno set; a panic is EIO.
pub fn call(f: impl FnOnce() -> Result<(), i32>) -> c_int {
    // A call that succeeds leaves errno as it found it (librdmacm's do; the
    // non-blocking connect inside rdma_connect would leave EINPROGRESS).
    let before = errno();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_errno(before);
            0
        }
        Ok(Err(e)) => {
            set_errno(e);
            -1
        }
        Err(_) => {
            eprintln!("libnprdma: rdma_cm: internal error (panic)");
            set_errno(libc::EIO);
            -1
        }
    }
}

/// A refusal printed on stderr (an unsupported feature), as the verbs refusals are.
pub fn refuse(verb: &str, what: &str) -> c_int {
    eprintln!("libnprdma: {verb}: not supported: {what}");
    set_errno(libc::EOPNOTSUPP);
    -1
}

/// The id behind a C pointer (EINVAL for NULL).
///
/// # Safety
/// `p` is NULL or a live id of ours.
pub unsafe fn cm<'a>(p: *mut rdma_cm_id) -> Result<&'a mut CmId, i32> {
    // SAFETY: per the contract.
    unsafe { CmId::from_c(p) }.ok_or(libc::EINVAL)
}

/// What taking `ev` does in the application's thread (see [`Action`]).
fn take(ev: &mut EventBox) {
    let action = std::mem::replace(&mut ev.action, Action::None);
    if action == Action::None {
        return;
    }
    // SAFETY: an event's id lives until its events are acknowledged.
    let Some(c) = (unsafe { CmId::from_c(ev.ev.id) }) else {
        return;
    };
    let inner = Arc::clone(&c.inner);
    let mut st = inner.lock();
    match action {
        Action::None => {}
        Action::ErrorQp => {
            // SAFETY: the id's QP (checked live), under its lock.
            unsafe { verbs::error_qp(c, &st) };
        }
        Action::Establish => {
            if c.id.qp.is_null() || !matches!(st.phase, Phase::Responded) {
                return;
            }
            // SAFETY: as above.
            let up = unsafe { verbs::connect_qp(c, &st) };
            let link = st.link.clone();
            let sent = up.is_ok() && link.as_ref().is_some_and(|l| l.send(&Msg::Rtu).is_ok());
            if sent {
                st.phase = Phase::Established;
                ev.ev.event = RDMA_CM_EVENT_ESTABLISHED;
            } else {
                if let Some(l) = link {
                    let _ = l.send(&Msg::Rej {
                        reason: reactor::REJ_CONSUMER_DEFINED,
                        private: Vec::new(),
                    });
                    l.close();
                }
                st.link = None;
                st.phase = Phase::Done;
                ev.ev.event = RDMA_CM_EVENT_CONNECT_ERROR;
                ev.ev.status = -up.err().unwrap_or(libc::ECONNRESET);
            }
        }
    }
}

/// A synchronous id's wait for the event its call caused (librdmacm's
/// `ucma_complete`): the previous `id->event` acknowledged, the next taken from its
/// private channel into `id->event`; its status as the call's result.
pub fn complete(c: &mut CmId) -> Result<(), i32> {
    let inner = Arc::clone(&c.inner);
    let queue = {
        let mut st = inner.lock();
        let Some(ch) = st.sync.as_ref() else {
            return Ok(());
        };
        let q = Arc::clone(&ch.queue);
        let cur = std::mem::replace(&mut st.current, std::ptr::null_mut());
        drop(st);
        if !cur.is_null() {
            // SAFETY: the id's own current event, handed out and not yet acknowledged.
            unsafe { id::ack(cur) };
        }
        q
    };
    let mut ev = loop {
        match queue.pop() {
            Ok(e) => break e,
            Err(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    };
    take(&mut ev);
    let status = ev.ev.status;
    let kind = ev.ev.event;
    let p = Box::into_raw(ev).cast::<rdma_cm_event>();
    inner.lock().current = p;
    c.id.event = p;
    if status == 0 {
        return Ok(());
    }
    Err(if kind == RDMA_CM_EVENT_REJECTED {
        libc::ECONNREFUSED
    } else if status < 0 {
        -status
    } else {
        status
    })
}

#[no_mangle]
pub extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    match Channel::new() {
        Ok(c) => Box::into_raw(c).cast(),
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

/// # Safety
/// `ch` is NULL or a channel of ours whose ids are destroyed.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    if !ch.is_null() {
        // SAFETY: per the contract (the C channel is the first field of its box).
        drop(unsafe { Box::from_raw(ch.cast::<Channel>()) });
    }
}

/// # Safety
/// `ch` NULL or ours; `id` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    ch: *mut rdma_event_channel,
    idp: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
) -> c_int {
    call(|| {
        if idp.is_null() {
            return Err(libc::EINVAL);
        }
        if ![RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IPOIB, RDMA_PS_IB].contains(&ps) {
            return Err(libc::EINVAL);
        }
        // SAFETY: per the contract.
        unsafe { *idp = create(ch, context, ps)? };
        Ok(())
    })
}

/// A new id on `ch` (NULL: synchronous, with its own channel).
///
/// # Safety
/// `ch` NULL or ours.
pub unsafe fn create(
    ch: *mut rdma_event_channel,
    context: *mut c_void,
    ps: u32,
) -> Result<*mut rdma_cm_id, i32> {
    reactor::get()?;
    let (queue, sync) = if ch.is_null() {
        let c = Channel::new()?;
        (Arc::clone(&c.queue), Some(c))
    } else {
        // SAFETY: a channel of ours (the C channel is the first field).
        (Arc::clone(&unsafe { &*ch.cast::<Channel>() }.queue), None)
    };
    Ok(CmId::create(queue, sync, ch, context, ps).cast())
}

/// Withdraw `inner`'s queued events (and, for a listener, the requests not yet taken,
/// whose ids are refused). Called with its state locked; returns the events to
/// acknowledge once the lock is dropped and the refused ids to free after that.
#[allow(clippy::vec_box)] // the queue's boxes, acknowledged whole
fn withdraw(inner: &Arc<Inner>, st: &mut State) -> (Vec<Box<EventBox>>, Vec<usize>) {
    let me = inner.cptr;
    let mut out = st.queue.withdraw(|e| e.ev.id as usize == me);
    let reqs = st.queue.withdraw(|e| e.ev.listen_id as usize == me);
    let mut children = Vec::new();
    for e in reqs {
        // SAFETY: a request's new id, never handed to the application.
        let child = unsafe { &*(e.ev.id as *const CmId) };
        {
            let mut cs = child.inner.lock();
            cs.destroyed = true;
            if let Some(l) = cs.link.take() {
                let _ = l.send(&Msg::Rej {
                    reason: REJ_INVALID_SERVICE_ID,
                    private: Vec::new(),
                });
                l.close();
            }
            if let (Some(t), Ok(r)) = (cs.token.take(), reactor::get()) {
                r.forget(t);
            }
        }
        children.push(e.ev.id as usize);
        out.push(e);
    }
    (out, children)
}

/// # Safety
/// `idp` is a live id of ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(idp: *mut rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if st.destroyed {
            return Err(libc::EINVAL);
        }
        st.destroyed = true;
        let (dropped, children) = withdraw(&inner, &mut st);
        if let (Some(t), Ok(r)) = (st.token.take(), reactor::get()) {
            r.forget(t);
        }
        if let Some(l) = st.link.take() {
            let m = match st.phase {
                Phase::Requested => Some(Msg::Rej {
                    reason: reactor::REJ_CONSUMER_DEFINED,
                    private: Vec::new(),
                }),
                Phase::Established | Phase::Accepting | Phase::Responded => Some(Msg::Dreq),
                _ => None,
            };
            if let Some(m) = m {
                let _ = l.send(&m);
            }
            l.close();
        }
        st.sock = None;
        let cur = std::mem::replace(&mut st.current, std::ptr::null_mut());
        drop(st);
        for mut e in dropped {
            if let Some(f) = e.on_ack.take() {
                f();
            }
        }
        for p in children {
            // SAFETY: a withdrawn request's id (see `withdraw`), now unreferenced.
            drop(unsafe { Box::from_raw(p as *mut CmId) });
        }
        if !cur.is_null() {
            // SAFETY: this synchronous id's current event.
            unsafe { id::ack(cur) };
        }
        // librdmacm's rule: wait until every event handed out for the id is acknowledged.
        let mut st = inner.lock();
        while st.unacked > 0 {
            inner.acked.wait(&mut st);
        }
        drop(st);
        // SAFETY: destroyed and unreferenced by the reactor (it checks `destroyed`
        // under the lock before touching the C id).
        drop(unsafe { Box::from_raw(idp.cast::<CmId>()) });
        Ok(())
    })
}

/// # Safety
/// `ch` ours; `event` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(
    ch: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    call(|| {
        if ch.is_null() || event.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a channel of ours.
        let q = Arc::clone(&unsafe { &*ch.cast::<Channel>() }.queue);
        let mut ev = q.pop()?;
        take(&mut ev);
        // SAFETY: writable per the contract.
        unsafe { *event = Box::into_raw(ev).cast() };
        Ok(())
    })
}

/// # Safety
/// `event` from `rdma_get_cm_event`, not yet acknowledged.
#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    call(|| {
        if event.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: per the contract.
        unsafe { id::ack(event) };
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `ch` NULL or ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(
    idp: *mut rdma_cm_id,
    ch: *mut rdma_event_channel,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        let (queue, sync, cptr) = if ch.is_null() {
            let n = Channel::new()?;
            let cp = (&*n as *const Channel)
                .cast_mut()
                .cast::<rdma_event_channel>();
            (Arc::clone(&n.queue), Some(n), cp)
        } else {
            // SAFETY: a channel of ours.
            (
                Arc::clone(&unsafe { &*ch.cast::<Channel>() }.queue),
                None,
                ch,
            )
        };
        let me = inner.cptr;
        let moving = st.queue.withdraw(|e| e.ev.id as usize == me);
        for e in moving {
            queue.push(e);
        }
        st.queue = queue;
        st.sync = sync;
        c.id.channel = cptr;
        Ok(())
    })
}

/// # Safety
/// `idp` ours; `optval` readable for `optlen` bytes.
#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    idp: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        if optval.is_null() {
            return Err(libc::EINVAL);
        }
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        // SAFETY: readable for optlen bytes (checked per option below).
        let byte = || unsafe { *optval.cast::<u8>() };
        // SAFETY: as above.
        let int = || unsafe { std::ptr::read_unaligned(optval.cast::<c_int>()) };
        match (level as u32, optname as u32) {
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS) if optlen == 1 => st.opts.tos = byte(),
            (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) if optlen == 1 => {
                st.opts.ack_timeout = Some(byte().min(31));
            }
            (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR) if optlen == 4 => {
                if !matches!(st.phase, Phase::Idle) {
                    return Err(libc::EINVAL);
                }
                st.opts.reuseaddr = int() != 0;
            }
            (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY) if optlen == 4 => {
                if !matches!(st.phase, Phase::Idle) {
                    return Err(libc::EINVAL);
                }
                st.opts.afonly = Some(int() != 0);
            }
            // IB path records: the route is taken as given (RoCE here has one path).
            (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => {
                if !matches!(st.phase, Phase::AddrResolved) || optlen == 0 {
                    return Err(libc::EINVAL);
                }
                c.set_route();
                st.phase = Phase::RouteResolved;
            }
            (RDMA_OPTION_ID | RDMA_OPTION_IB, _) => return Err(libc::EINVAL),
            _ => return Err(libc::ENOSYS),
        }
        Ok(())
    })
}

/// Bind `c` to `a` (a socket reserving the port; port 0 takes an ephemeral one).
pub fn bind(c: &mut CmId, st: &mut State, a: SocketAddr) -> Result<(), i32> {
    if !sockaddr::is_local(a.ip()) {
        return Err(libc::EADDRNOTAVAIL);
    }
    let dom = match a {
        SocketAddr::V4(_) => socket2::Domain::IPV4,
        SocketAddr::V6(_) => socket2::Domain::IPV6,
    };
    let s = socket2::Socket::new(dom, socket2::Type::STREAM.cloexec(), None)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    // rdma_cm ports have no TIME_WAIT: a port is free again once its id is destroyed.
    s.set_reuse_address(true).map_err(|_| libc::EIO)?;
    if a.is_ipv6() {
        let _ = s.set_only_v6(st.opts.afonly.unwrap_or(false));
    }
    s.bind(&a.into())
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EADDRINUSE))?;
    let local = s.local_addr().ok().and_then(|l| l.as_socket()).unwrap_or(a);
    st.sock = Some(s);
    st.local = Some(local);
    c.set_local(&local, verbs::gid0());
    verbs::attach(c)?;
    c.id.port_num = 1;
    st.phase = Phase::Bound;
    Ok(())
}

/// # Safety
/// `idp` ours; `addr` a readable socket address.
#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(idp: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    call(|| {
        // SAFETY: per the contract.
        let c = unsafe { cm(idp)? };
        // SAFETY: per the contract.
        let a = unsafe { sockaddr::read(addr) }.map_err(|e| e.errno())?;
        let inner = Arc::clone(&c.inner);
        let mut st = inner.lock();
        if !matches!(st.phase, Phase::Idle) {
            return Err(libc::EINVAL);
        }
        bind(c, &mut st, a)
    })
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_src_port(idp: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the contract.
    match unsafe { CmId::from_c(idp) } {
        Some(c) => c.inner.lock().local.map_or(0, |a| a.port().to_be()),
        None => 0,
    }
}

/// # Safety
/// `idp` ours.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_dst_port(idp: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the contract.
    match unsafe { CmId::from_c(idp) } {
        Some(c) => c.inner.lock().peer.map_or(0, |a| a.port().to_be()),
        None => 0,
    }
}

#[no_mangle]
pub extern "C" fn rdma_event_str(event: rdma_cm_event_type) -> *const c_char {
    let s: &'static [u8] = match event {
        RDMA_CM_EVENT_ADDR_RESOLVED => b"RDMA_CM_EVENT_ADDR_RESOLVED\0",
        RDMA_CM_EVENT_ADDR_ERROR => b"RDMA_CM_EVENT_ADDR_ERROR\0",
        RDMA_CM_EVENT_ROUTE_RESOLVED => b"RDMA_CM_EVENT_ROUTE_RESOLVED\0",
        RDMA_CM_EVENT_ROUTE_ERROR => b"RDMA_CM_EVENT_ROUTE_ERROR\0",
        RDMA_CM_EVENT_CONNECT_REQUEST => b"RDMA_CM_EVENT_CONNECT_REQUEST\0",
        RDMA_CM_EVENT_CONNECT_RESPONSE => b"RDMA_CM_EVENT_CONNECT_RESPONSE\0",
        RDMA_CM_EVENT_CONNECT_ERROR => b"RDMA_CM_EVENT_CONNECT_ERROR\0",
        RDMA_CM_EVENT_UNREACHABLE => b"RDMA_CM_EVENT_UNREACHABLE\0",
        RDMA_CM_EVENT_REJECTED => b"RDMA_CM_EVENT_REJECTED\0",
        RDMA_CM_EVENT_ESTABLISHED => b"RDMA_CM_EVENT_ESTABLISHED\0",
        RDMA_CM_EVENT_DISCONNECTED => b"RDMA_CM_EVENT_DISCONNECTED\0",
        RDMA_CM_EVENT_DEVICE_REMOVAL => b"RDMA_CM_EVENT_DEVICE_REMOVAL\0",
        RDMA_CM_EVENT_MULTICAST_JOIN => b"RDMA_CM_EVENT_MULTICAST_JOIN\0",
        RDMA_CM_EVENT_MULTICAST_ERROR => b"RDMA_CM_EVENT_MULTICAST_ERROR\0",
        RDMA_CM_EVENT_ADDR_CHANGE => b"RDMA_CM_EVENT_ADDR_CHANGE\0",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => b"RDMA_CM_EVENT_TIMEWAIT_EXIT\0",
        _ => b"UNKNOWN EVENT\0",
    };
    s.as_ptr().cast()
}
