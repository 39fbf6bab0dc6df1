//! Address handles (UD destinations): `ibv_create_ah`, `ibv_destroy_ah`,
//! `ibv_init_ah_from_wc`, `ibv_create_ah_from_wc`. An address names a device by LID
//! (no GRH), by its GID 0, or by one of the host's IP GIDs: the backend resolves the
//! first two when the AH is created; an IP GID names a device only with the QP
//! number of each datagram (`gid::resolve`).

use crate::error::ShimError;
use crate::ffi::*;
use crate::objects::{guard, guard_rc, shim, zeroed, AhRoute, ShimAh, ShimContext, ShimPd};
use std::ffi::c_int;

/// A UD send's destination through address handle `ah` (one of ours, or NULL:
/// EINVAL) to QP `qpn`.
///
/// # Safety
/// `ah` is NULL or an address handle this library created and has not destroyed.
pub unsafe fn ud_dest(ah: *mut ibv_ah, qpn: u32, qkey: u32) -> Result<rnic::UdDest, ShimError> {
    // SAFETY: forwarded contract.
    let a: &ShimAh = unsafe { shim(ah, "address handle")? };
    let dest = match &a.inner {
        AhRoute::Device(d) => d.dest(),
        AhRoute::ByQpn(gid) => crate::gid::by_gid_and_qpn(gid, qpn)?,
    };
    Ok(rnic::UdDest {
        dest,
        remote_qpn: qpn,
        remote_qkey: qkey,
    })
}

/// # Safety
/// `pd` ours (or NULL); `attr` NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    guard("ibv_create_ah", std::ptr::null_mut(), || {
        // SAFETY: caller contract.
        let p: &ShimPd = unsafe { shim(pd, "PD")? };
        if attr.is_null() {
            return Err(ShimError::InvalidArgument("NULL ah_attr".into()));
        }
        // SAFETY: our PD's context.
        let c = unsafe { ShimContext::from_ibv(p.pd.context)? };
        // SAFETY: checked non-null; caller-provided.
        let a = unsafe { &*attr };
        if a.is_global == 0 && !crate::gid::in_subnet(c) {
            return Err(ShimError::InvalidArgument(
                "address without GRH: this device has no LID here (set is_global=1 and \
                 the peer's GID, e.g. ibv_ud_pingpong -g 0)"
                    .into(),
            ));
        }
        // SAFETY: the byte view of the GID union.
        let gid = unsafe { a.grh.dgid.raw };
        let inner = match crate::gid::resolve(c, a, None)? {
            Some(h) => match p.inner.create_ah(h.to_bytes()) {
                Ok(ah) => AhRoute::Device(ah),
                // Not a device's address: an IP GID of another namespace's device.
                Err(_)
                    if a.is_global != 0
                        && crate::gid::in_subnet(c)
                        && crate::gid::known_gid(&gid) =>
                {
                    AhRoute::ByQpn(gid)
                }
                Err(e) => return Err(e),
            },
            None if crate::gid::known_gid(&gid) => AhRoute::ByQpn(gid),
            None => {
                return Err(ShimError::InvalidArgument(format!(
                    "no device of this host answers to GID {}",
                    crate::netif::ip_of_gid(&gid)
                )))
            }
        };
        // SAFETY: plain C data.
        let mut ah: ibv_ah = unsafe { zeroed() };
        ah.context = p.pd.context;
        ah.pd = pd;
        let b = Box::into_raw(Box::new(ShimAh {
            ah,
            inner,
            pd_use: p.take_use(),
        }));
        // SAFETY: just allocated; the handle is the object's address (unique while it lives).
        unsafe { (*b).ah.handle = b as usize as u32 };
        Ok(b as *mut ibv_ah)
    })
}

/// # Safety
/// `ah` ours (or NULL).
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    guard_rc("ibv_destroy_ah", || {
        // SAFETY: caller contract.
        unsafe { shim::<_, ShimAh>(ah, "address handle")? };
        // SAFETY: allocated by ibv_create_ah; dropping releases the PD's use.
        drop(unsafe { Box::from_raw(ah as *mut ShimAh) });
        Ok(())
    })
}

/// The address to answer a received datagram (libibverbs' `ibv_init_ah_from_wc` on
/// RoCE): with a GRH, the sender's GID (`grh->sgid`) as the destination, the GID
/// index of ours the datagram was sent to (`grh->dgid`), its flow label and traffic
/// class, hop limit 0xff.
///
/// # Safety
/// `ctx` ours; `wc`, `grh` readable, `ah_attr` writable (NULL: EINVAL).
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    ctx: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    let rc = guard_rc("ibv_init_ah_from_wc", || {
        // SAFETY: caller contract.
        let c = unsafe { ShimContext::from_ibv(ctx)? };
        if wc.is_null() || ah_attr.is_null() {
            return Err(ShimError::InvalidArgument("NULL wc or ah_attr".into()));
        }
        if port_num != 1 {
            return Err(ShimError::InvalidArgument(format!("port_num {port_num}")));
        }
        // SAFETY: checked non-null; caller-provided.
        let w = unsafe { &*wc };
        // SAFETY: plain C data.
        let mut a: ibv_ah_attr = unsafe { zeroed() };
        a.dlid = w.slid;
        a.sl = w.sl;
        a.src_path_bits = w.dlid_path_bits;
        a.port_num = port_num;
        if w.wc_flags & IBV_WC_GRH != 0 {
            if grh.is_null() {
                return Err(ShimError::InvalidArgument("NULL grh".into()));
            }
            // SAFETY: checked non-null; the 40 bytes the receive got first.
            let g = unsafe { &*grh };
            // SAFETY: byte views of the GID unions.
            let (sgid, dgid) = unsafe { (g.sgid.raw, g.dgid.raw) };
            if dgid != c.dev.gid() && !crate::netif::host_gids().contains(&dgid) {
                return Err(ShimError::InvalidArgument(
                    "the GRH's destination GID is none of this device's".into(),
                ));
            }
            let flow = u32::from_be(g.version_tclass_flow);
            a.is_global = 1;
            a.grh.dgid.raw = sgid;
            a.grh.sgid_index = 0;
            a.grh.flow_label = flow & 0xf_ffff;
            a.grh.traffic_class = (flow >> 20) as u8;
            a.grh.hop_limit = 0xff;
        }
        // SAFETY: checked non-null; caller-provided.
        unsafe { *ah_attr = a };
        Ok(())
    });
    if rc == 0 {
        0
    } else {
        -1
    }
}

/// # Safety
/// As [`ibv_init_ah_from_wc`] and [`ibv_create_ah`].
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    if pd.is_null() {
        crate::error::set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: plain C data.
    let mut a: ibv_ah_attr = unsafe { zeroed() };
    // SAFETY: a PD of ours knows its context; the rest is the caller's contract.
    if unsafe { ibv_init_ah_from_wc((*pd).context, port_num, wc, grh, &mut a) } != 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: as above.
    unsafe { ibv_create_ah(pd, &mut a) }
}
