//! librdmacm's address and endpoint helpers: `rdma_getaddrinfo` /
//! `rdma_freeaddrinfo`, `rdma_create_ep` / `rdma_destroy_ep` (synchronous ids),
//! `rdma_get_devices` / `rdma_free_devices`; and the refusals (multicast, ECE).

use super::api_conn::{rdma_create_qp, rdma_destroy_qp, rdma_resolve_addr, rdma_resolve_route};
use super::api_id::{call, cm, create, rdma_bind_addr, rdma_destroy_id, refuse};
use super::id::EpSetup;
use super::verbs;
use crate::ffi::rdmacm::*;
use crate::ffi::*;
use std::ffi::{c_char, c_int, c_void};

/// A malloc'd copy of a C socket address (freed by `rdma_freeaddrinfo`).
unsafe fn dup_sockaddr(p: *const libc::sockaddr, len: usize) -> *mut libc::sockaddr {
    // SAFETY: allocation of len bytes; p readable for len (the caller's contract).
    unsafe {
        let q = libc::malloc(len.max(1)).cast::<libc::sockaddr>();
        if !q.is_null() {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), len);
        }
        q
    }
}

/// # Safety
/// `node`, `service` NULL or C strings; `hints` NULL or readable; `res` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() {
        crate::error::set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: per the contract.
    let h = unsafe { hints.as_ref() };
    let flags = h.map_or(0, |h| h.ai_flags);
    let passive = flags as u32 & RAI_PASSIVE != 0;
    let qp_type = h.map_or(IBV_QPT_RC as i32, |h| {
        if h.ai_qp_type != 0 {
            h.ai_qp_type
        } else {
            IBV_QPT_RC as i32
        }
    });
    let ps = h.map_or(0, |h| h.ai_port_space);
    let ps = if ps != 0 {
        ps
    } else if qp_type == IBV_QPT_UD as i32 {
        RDMA_PS_UDP as i32
    } else {
        RDMA_PS_TCP as i32
    };
    // SAFETY: zeroed libc addrinfo hints.
    let mut ah: libc::addrinfo = unsafe { std::mem::zeroed() };
    ah.ai_family = h.map_or(libc::AF_UNSPEC, |h| h.ai_family);
    ah.ai_socktype = if ps == RDMA_PS_UDP as i32 {
        libc::SOCK_DGRAM
    } else {
        libc::SOCK_STREAM
    };
    if passive {
        ah.ai_flags |= libc::AI_PASSIVE;
    }
    if flags as u32 & RAI_NUMERICHOST != 0 {
        ah.ai_flags |= libc::AI_NUMERICHOST;
    }
    let mut out: *mut libc::addrinfo = std::ptr::null_mut();
    let have_name = !node.is_null() || !service.is_null();
    if have_name {
        // SAFETY: libc getaddrinfo with the caller's strings.
        let r = unsafe { libc::getaddrinfo(node, service, &ah, &mut out) };
        if r != 0 {
            return r;
        }
    } else if !h.is_some_and(|h| !h.ai_src_addr.is_null() || !h.ai_dst_addr.is_null()) {
        crate::error::set_errno(libc::EINVAL);
        return libc::EAI_NONAME;
    }
    // SAFETY: calloc of one rdma_addrinfo.
    let ri =
        unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
    if ri.is_null() {
        // SAFETY: from getaddrinfo.
        unsafe { libc::freeaddrinfo(out) };
        return libc::EAI_MEMORY;
    }
    // SAFETY: ri allocated and zeroed; out (if any) from getaddrinfo.
    unsafe {
        let r = &mut *ri;
        r.ai_flags = flags;
        r.ai_qp_type = qp_type;
        r.ai_port_space = ps;
        if let Some(a) = out.as_ref() {
            r.ai_family = a.ai_family;
            let copy = dup_sockaddr(a.ai_addr, a.ai_addrlen as usize);
            if passive {
                r.ai_src_addr = copy.cast();
                r.ai_src_len = a.ai_addrlen;
            } else {
                r.ai_dst_addr = copy.cast();
                r.ai_dst_len = a.ai_addrlen;
            }
            libc::freeaddrinfo(out);
        }
        if let Some(h) = h {
            if r.ai_src_addr.is_null() && !h.ai_src_addr.is_null() {
                r.ai_src_addr = dup_sockaddr(h.ai_src_addr.cast(), h.ai_src_len as usize).cast();
                r.ai_src_len = h.ai_src_len;
            }
            if r.ai_dst_addr.is_null() && !h.ai_dst_addr.is_null() {
                r.ai_dst_addr = dup_sockaddr(h.ai_dst_addr.cast(), h.ai_dst_len as usize).cast();
                r.ai_dst_len = h.ai_dst_len;
            }
            if r.ai_family == 0 {
                r.ai_family = h.ai_family;
            }
        }
        if r.ai_family == 0 {
            let a = if r.ai_src_addr.is_null() {
                r.ai_dst_addr
            } else {
                r.ai_src_addr
            };
            if !a.is_null() {
                r.ai_family = i32::from((*a).sa_family);
            }
        }
        *res = ri;
    }
    0
}

/// # Safety
/// `res` NULL or from `rdma_getaddrinfo`.
#[no_mangle]
pub unsafe extern "C" fn rdma_freeaddrinfo(mut res: *mut rdma_addrinfo) {
    while !res.is_null() {
        // SAFETY: our allocation (see rdma_getaddrinfo).
        unsafe {
            let next = (*res).ai_next;
            libc::free((*res).ai_src_addr.cast());
            libc::free((*res).ai_dst_addr.cast());
            libc::free((*res).ai_src_canonname.cast());
            libc::free((*res).ai_dst_canonname.cast());
            libc::free((*res).ai_route);
            libc::free((*res).ai_connect);
            libc::free(res.cast());
            res = next;
        }
    }
}

/// # Safety
/// `idp` writable; `res` readable; `pd` NULL or ours; `attr` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_ep(
    idp: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    call(|| {
        if idp.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: per the contract.
        let r = unsafe { res.as_ref() }.ok_or(libc::EINVAL)?;
        let ps = if r.ai_port_space != 0 {
            r.ai_port_space as u32
        } else if r.ai_qp_type == IBV_QPT_UD as i32 {
            RDMA_PS_UDP
        } else {
            RDMA_PS_TCP
        };
        // SAFETY: a synchronous id.
        let id = unsafe { create(std::ptr::null_mut(), std::ptr::null_mut(), ps)? };
        let fail = |e: i32| {
            // SAFETY: our new id.
            unsafe { rdma_destroy_id(id) };
            Err(e)
        };
        let last = || {
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL)
        };
        // SAFETY: just created.
        let c = unsafe { cm(id)? };
        c.id.pd = pd;
        if r.ai_flags as u32 & RAI_PASSIVE != 0 {
            // SAFETY: the caller's address.
            if unsafe { rdma_bind_addr(id, r.ai_src_addr.cast()) } != 0 {
                return fail(last());
            }
            // SAFETY: the caller's attributes (NULL or valid).
            if let Some(a) = unsafe { attr.as_ref() } {
                c.inner.lock().ep = Some(EpSetup { pd, attr: *a });
            }
        } else {
            // SAFETY: the caller's addresses (src may be NULL) and our new id.
            let resolved = unsafe {
                rdma_resolve_addr(id, r.ai_src_addr.cast(), r.ai_dst_addr.cast(), 2000) == 0
                    && rdma_resolve_route(id, 2000) == 0
            };
            if !resolved {
                return fail(last());
            }
            // SAFETY: the caller's attributes.
            if !attr.is_null() && unsafe { rdma_create_qp(id, pd, attr) } != 0 {
                return fail(last());
            }
        }
        // SAFETY: writable per the contract.
        unsafe { *idp = id };
        Ok(())
    })
}

/// # Safety
/// `idp` from `rdma_create_ep` (or any id of ours).
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_ep(idp: *mut rdma_cm_id) {
    // SAFETY: per the contract.
    unsafe {
        if let Some(c) = super::id::CmId::from_c(idp) {
            if !c.id.qp.is_null() {
                rdma_destroy_qp(idp);
            }
            super::api_conn::rdma_destroy_srq(idp);
        }
        rdma_destroy_id(idp);
    }
}

/// # Safety
/// `n` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_devices(n: *mut c_int) -> *mut *mut ibv_context {
    let ctx = verbs::context().ok();
    // SAFETY: calloc of two pointers (the list and its NULL end).
    let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_context>()) }
        .cast::<*mut ibv_context>();
    if list.is_null() {
        crate::error::set_errno(libc::ENOMEM);
        return list;
    }
    let count = usize::from(ctx.is_some());
    if let Some(c) = ctx {
        // SAFETY: two slots allocated.
        unsafe { *list = c };
    }
    if !n.is_null() {
        // SAFETY: writable per the contract.
        unsafe { *n = count as c_int };
    }
    list
}

/// # Safety
/// `list` from `rdma_get_devices`.
#[no_mangle]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: calloc'd by rdma_get_devices (contexts stay open, as librdmacm's do).
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub extern "C" fn rdma_join_multicast(
    _id: *mut rdma_cm_id,
    _a: *mut libc::sockaddr,
    _c: *mut c_void,
) -> c_int {
    refuse("rdma_join_multicast", "multicast")
}

#[no_mangle]
pub extern "C" fn rdma_join_multicast_ex(
    _id: *mut rdma_cm_id,
    _a: *mut rdma_cm_join_mc_attr_ex,
    _c: *mut c_void,
) -> c_int {
    refuse("rdma_join_multicast_ex", "multicast")
}

#[no_mangle]
pub extern "C" fn rdma_leave_multicast(_id: *mut rdma_cm_id, _a: *mut libc::sockaddr) -> c_int {
    refuse("rdma_leave_multicast", "multicast")
}

#[no_mangle]
pub extern "C" fn rdma_set_local_ece(_id: *mut rdma_cm_id, _e: *mut c_void) -> c_int {
    refuse("rdma_set_local_ece", "ECE")
}

#[no_mangle]
pub extern "C" fn rdma_get_remote_ece(_id: *mut rdma_cm_id, _e: *mut c_void) -> c_int {
    refuse("rdma_get_remote_ece", "ECE")
}
