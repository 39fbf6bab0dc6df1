//! The port's addresses: its GID table (`ibv_query_gid`, `_ibv_query_gid_ex`,
//! `_ibv_query_gid_table`, `ibv_query_gid_type`) and what an address vector names.
//!
//! GID 0 is the NIC's own address. On the software NIC the port also has a LID (the
//! host's subnet, `rnic::subnet`) and entries 1.. hold the host's IP addresses as
//! RoCE v2 GIDs (`netif`), as rxe builds them. An address vector reaches a device by
//! LID (no GRH: `dlid`), by GID 0, or by one of its IP GIDs together with the QP
//! number it is sent to (the host's devices share IPs; a QP number's range names its
//! device's LID), the GID checked against that device's own table.

use crate::error::ShimError;
use crate::ffi::*;
use crate::objects::{zeroed, ShimContext};
use rnic::subnet::{self, Directory};
use rnic::HostAddr;
use std::ffi::c_int;
use std::sync::OnceLock;

/// GID table entries of the port: entry 0, the host's IPs (up to
/// `rnic::subnet::SLOT_GIDS`), the rest empty, as on real RoCE ports with
/// unpopulated entries (queries of them give what rdma-core gives for an empty entry).
pub const GID_TBL_LEN: c_int = 32;

/// The port's LID (0: not in a subnet).
pub fn lid(s: &ShimContext) -> u16 {
    s.dev.lid()
}

/// Check that `ctx` is ours and `port` its port.
pub fn check_port(ctx: *mut ibv_context, port: u8) -> Result<(), ShimError> {
    // SAFETY: caller contract of the enclosing verb.
    unsafe { ShimContext::from_ibv(ctx)? };
    if port != 1 {
        return Err(ShimError::InvalidArgument(format!(
            "port {port} (the device has port 1)"
        )));
    }
    Ok(())
}

/// The populated entries of the port's GID table.
fn table(s: &ShimContext) -> Vec<[u8; 16]> {
    let mut t = vec![s.dev.gid()];
    if lid(s) != 0 {
        t.extend_from_slice(crate::netif::host_gids());
    }
    t
}

/// The index of `gid` in the GID table of `ctx`'s port, if it has it.
pub fn index_of(ctx: *mut ibv_context, gid: &[u8; 16]) -> Option<u8> {
    // SAFETY: caller contract (`ctx` is one of our contexts or null).
    let s = unsafe { ShimContext::from_ibv(ctx).ok()? };
    table(s)
        .iter()
        .position(|g| g == gid)
        .and_then(|i| u8::try_from(i).ok())
}

/// Entry `index`: `Ok(Some)` populated, `Ok(None)` empty, `Err` no such port/index.
fn entry(ctx: *mut ibv_context, port: u8, index: c_int) -> Result<Option<[u8; 16]>, ShimError> {
    check_port(ctx, port)?;
    if !(0..GID_TBL_LEN).contains(&index) {
        return Err(ShimError::InvalidArgument(format!(
            "GID index {index} (the table has {GID_TBL_LEN})"
        )));
    }
    // SAFETY: checked by check_port.
    let s = unsafe { ShimContext::from_ibv(ctx)? };
    Ok(table(s).get(index as usize).copied())
}

/// # Safety
/// `gid` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    match (gid.is_null(), entry(ctx, port, index)) {
        (false, Ok(g)) => {
            // An empty entry: a zero GID, as rdma-core's ibv_query_gid.
            // SAFETY: caller-provided out struct.
            unsafe { (*gid).raw = g.unwrap_or([0; 16]) };
            0
        }
        _ => {
            crate::error::set_errno(libc::EINVAL);
            -1
        }
    }
}

fn gid_entry(g: [u8; 16], index: u32) -> ibv_gid_entry {
    // SAFETY: plain C data.
    let mut e: ibv_gid_entry = unsafe { zeroed() };
    e.gid.raw = g;
    e.gid_index = index;
    e.port_num = 1;
    e.gid_type = IBV_GID_TYPE_ROCE_V2;
    e
}

/// # Safety
/// `entry` has `entry_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    out: *mut ibv_gid_entry,
    _flags: u32,
    entry_size: usize,
) -> c_int {
    let (port8, index_c) = (port.min(255) as u8, index.min(i32::MAX as u32) as c_int);
    let e = match entry(ctx, port8, index_c) {
        Ok(Some(g)) if !out.is_null() && entry_size >= std::mem::size_of::<ibv_gid_entry>() => {
            // SAFETY: checked size; caller-provided.
            unsafe { *out = gid_entry(g, index) };
            return 0;
        }
        // An empty entry is ENODATA (the kernel's answer); past the table, EINVAL.
        Ok(Some(_)) | Err(_) => libc::EINVAL,
        Ok(None) => libc::ENODATA,
    };
    crate::error::set_errno(e);
    e
}

/// The GID table's populated entries; the number written (EINVAL if they do not fit,
/// as the kernel answers).
///
/// # Safety
/// `entries` has `max_entries` entries of `entry_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    _flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: caller contract.
    let t = match unsafe { ShimContext::from_ibv(ctx) } {
        Ok(s) => table(s),
        Err(_) => Vec::new(),
    };
    if t.is_empty()
        || entries.is_null()
        || max_entries < t.len()
        || entry_size < std::mem::size_of::<ibv_gid_entry>()
    {
        crate::error::set_errno(libc::EINVAL);
        return -(libc::EINVAL as isize);
    }
    for (i, g) in t.iter().enumerate() {
        // SAFETY: entry i of the caller's array (i < max_entries, entry_size each).
        unsafe {
            let p = (entries as *mut u8).add(i * entry_size) as *mut ibv_gid_entry;
            *p = gid_entry(*g, i as u32);
        }
    }
    t.len() as isize
}

/// rdma-core private helper perftest imports.
///
/// # Safety
/// `ty` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: u32,
    ty: *mut u32,
) -> c_int {
    let t = match entry(ctx, port, index.min(i32::MAX as u32) as c_int) {
        _ if ty.is_null() => None,
        Ok(Some(_)) => Some(IBV_GID_TYPE_SYSFS_ROCE_V2),
        // rdma-core keeps its API behaviour for an empty GID: RoCE v1 / IB, success.
        Ok(None) => Some(IBV_GID_TYPE_SYSFS_IB_ROCE_V1),
        Err(_) => None,
    };
    match t {
        Some(t) => {
            // SAFETY: caller-provided out value.
            unsafe { *ty = t };
            0
        }
        None => {
            crate::error::set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `NPRDMA_TRANSPORT=udp`: reach peers named by an IP GID over RoCEv2 even when they
/// share this host's segment directory (to test the wire on one machine, across
/// network namespaces).
fn force_wire() -> bool {
    static F: OnceLock<bool> = OnceLock::new();
    *F.get_or_init(|| {
        std::env::var("NPRDMA_TRANSPORT").is_ok_and(|v| v.eq_ignore_ascii_case("udp"))
    })
}

/// The host's subnet registry, opened on first use (`None` if it cannot be).
fn directory() -> Option<&'static Directory> {
    static DIR: OnceLock<Option<Directory>> = OnceLock::new();
    DIR.get_or_init(|| Directory::open(&subnet::default_path()).ok())
        .as_ref()
}

/// The live device with `lid`.
fn by_lid(lid: u16) -> Option<subnet::Entry> {
    directory()?.lookup(lid).ok().flatten()
}

/// Whether a live device of the host answers to `gid` (one of its IP GIDs).
pub fn known_gid(gid: &[u8; 16]) -> bool {
    crate::netif::host_gids().contains(gid) || directory().is_some_and(|d| d.any_with_gid(gid))
}

/// Whether `s`'s port is in a subnet (LIDs and IP GIDs mean something).
pub fn in_subnet(s: &ShimContext) -> bool {
    lid(s) != 0
}

/// The device a GID names together with the QP number it is sent to: the device
/// whose LID owns `qpn`, if `gid` is in its table (EINVAL if none).
pub fn by_gid_and_qpn(gid: &[u8; 16], qpn: u32) -> Result<HostAddr, ShimError> {
    by_lid(subnet::lid_of_qpn(qpn))
        .filter(|e| e.gids.contains(gid) || e.addr.to_bytes() == *gid)
        .map(|e| e.addr)
        .ok_or_else(|| {
            ShimError::InvalidArgument(format!(
                "no device of this host with GID {} has QP {qpn:#x}",
                crate::netif::ip_of_gid(gid)
            ))
        })
}

/// What an address vector names (`dest_qpn`: the QP it reaches; none for an AH):
/// the device by LID without a GRH, else by GID (an IP GID with the QP number, or a
/// device address). `Ok(None)`: an IP GID whose device only a QP number can tell
/// (an address handle: resolved per datagram, [`by_gid_and_qpn`]).
pub fn resolve(
    s: &ShimContext,
    av: &ibv_ah_attr,
    dest_qpn: Option<u32>,
) -> Result<Option<HostAddr>, ShimError> {
    if av.port_num != 1 {
        return Err(ShimError::InvalidArgument(format!(
            "port_num {}",
            av.port_num
        )));
    }
    if av.is_global == 0 {
        if !in_subnet(s) {
            return Err(ShimError::Unsupported(
                "address vector without GRH: this device has no LID here (set is_global=1 \
                 and the peer's GID)"
                    .into(),
            ));
        }
        return match by_lid(av.dlid) {
            Some(e) => Ok(Some(e.addr)),
            None => Err(ShimError::InvalidArgument(format!(
                "no port has LID {} on this host",
                av.dlid
            ))),
        };
    }
    if av.grh.sgid_index as c_int >= GID_TBL_LEN {
        return Err(ShimError::InvalidArgument(format!(
            "sgid_index {} (the table has {GID_TBL_LEN})",
            av.grh.sgid_index
        )));
    }
    // SAFETY: the byte view of the GID union; every bit pattern is valid.
    let gid = unsafe { av.grh.dgid.raw };
    if !in_subnet(s) {
        return Ok(Some(HostAddr::from_bytes(&gid)));
    }
    // An IPv4-mapped GID is never a device address (whose first bytes are a PID);
    // neither is an IPv6 address with a nonzero byte 3, 6 or 7 (a device address
    // has a PID below 2^24 there and a descriptor below 2^16) or a link-local one.
    let ip_form = gid[..10] == [0; 10]
        || gid[3] != 0
        || gid[6] != 0
        || gid[7] != 0
        || gid[..2] == [0xfe, 0x80];
    let ours = crate::netif::host_gids().contains(&gid);
    if ip_form || ours {
        let Some(q) = dest_qpn else { return Ok(None) };
        if !force_wire() || ours {
            match by_gid_and_qpn(&gid, q) {
                Ok(a) => return Ok(Some(a)),
                // One of this host's addresses names a device of this host.
                Err(e) if ours => return Err(e),
                Err(_) => {}
            }
        }
        // Another host's address: across the network, from the GID the AV names.
        let sgid = table(s)
            .get(av.grh.sgid_index as usize)
            .copied()
            .filter(|g| crate::netif::host_gids().contains(g))
            .or_else(|| crate::netif::host_gids().first().copied())
            .ok_or_else(|| {
                ShimError::Unsupported(
                    "no IP address to reach a peer across the network from".into(),
                )
            })?;
        return s.dev.wire_peer(sgid, gid).map(Some);
    }
    // Another namespace's IP GID, else a device address.
    if let Some(a) = dest_qpn.and_then(|q| by_gid_and_qpn(&gid, q).ok()) {
        return Ok(Some(a));
    }
    Ok(Some(HostAddr::from_bytes(&gid)))
}
