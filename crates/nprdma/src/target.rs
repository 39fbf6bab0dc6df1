//! Target side of the two-sided path: what the polling thread does with a
//! request from the control channel *before* the reverse operation or the
//! CPU execution — check the key, the bounds and the MR's access rights
//! (the NIC checks these for one-sided verbs; on the two-sided path the
//! target CPU acts on the peer's behalf, so it must check them itself),
//! then pin the pages and map them back into the NIC's views
//! ([`MrShadow::map_in`]). The result is a [`Grant`] that keeps the pin
//! until it is dropped, so every exit path unpins exactly once. Also the
//! CPU execution of atomics and the mapping of control statuses to verbs
//! completion statuses.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ctrl::{AtomicKind, FaultKind, Repr, Status};
use crate::nic::{Access, IommuControl, MemoryManager, PinFor, Pinned};
use crate::shadow::MrShadow;

/// A local application MR as the target sees it.
pub struct LocalRegion<'a, I: IommuControl> {
    /// Access rights the application registered it with.
    pub access: Access,
    /// Its shadow (bounds, IOMMU views, versions).
    pub shadow: &'a MrShadow<I>,
}

/// Access right a request needs on the target MR (`None`: the message is
/// not a memory request).
pub fn required_access(msg: &Repr<'_>) -> Option<Access> {
    Some(match msg {
        Repr::Fault(f) if f.kind == FaultKind::Read => Access::REMOTE_READ,
        Repr::Fault(_) => Access::REMOTE_WRITE,
        Repr::ReadInline { .. } => Access::REMOTE_READ,
        Repr::WriteInline { .. } => Access::REMOTE_WRITE,
        Repr::Atomic(_) => Access::REMOTE_ATOMIC,
        _ => return None,
    })
}

/// Memory of a request, pinned and NIC-mapped until dropped.
#[derive(Debug)]
pub struct Grant<M: MemoryManager> {
    /// Start of the granted memory.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    _pin: Option<Pinned<M>>,
}

/// Validate and prepare `[addr, addr+len)` of `region` for a request
/// needing `need`; `atomic` additionally requires 8 bytes, 8-aligned.
/// Errors are the status to answer with.
pub fn admit<I: IommuControl, M: MemoryManager>(
    region: Option<&LocalRegion<'_, I>>,
    mm: M,
    addr: u64,
    len: u64,
    need: Access,
    atomic: bool,
) -> Result<Grant<M>, Status> {
    let r = validate(region, addr, len, need, atomic)?;
    if len == 0 {
        return Ok(Grant {
            addr,
            len,
            _pin: None,
        });
    }
    let pin = Pinned::new_for(mm, addr, len, PinFor::for_request(need, atomic)).map_err(|e| {
        tracing::warn!(addr, len, error = %e, "two-sided pin failed");
        Status::NoResources
    })?;
    r.shadow.map_in(addr, len).map_err(|e| {
        tracing::error!(addr, len, error = %e, "map-in failed");
        Status::RemoteOp
    })?;
    Ok(Grant {
        addr,
        len,
        _pin: Some(pin),
    })
}

/// The checks of [`admit`] without pinning: key (region present), bounds,
/// access rights, atomic size/alignment.
pub fn validate<'r, 'a, I: IommuControl>(
    region: Option<&'r LocalRegion<'a, I>>,
    addr: u64,
    len: u64,
    need: Access,
    atomic: bool,
) -> Result<&'r LocalRegion<'a, I>, Status> {
    let r = region.ok_or(Status::RemoteAccess)?;
    let end = addr.checked_add(len).ok_or(Status::RemoteAccess)?;
    if addr < r.shadow.addr() || end > r.shadow.addr() + r.shadow.len() {
        return Err(Status::RemoteAccess);
    }
    if !r.access.contains(need) {
        return Err(Status::RemoteAccess);
    }
    if atomic && (len != 8 || addr % 8 != 0) {
        return Err(Status::RemoteInvalid);
    }
    Ok(r)
}

/// Execute an atomic on the target CPU; returns the original value.
/// (The engine obtains `word` from the granted, 8-aligned address.)
pub fn apply_atomic(kind: AtomicKind, compare_add: u64, swap: u64, word: &AtomicU64) -> u64 {
    match kind {
        AtomicKind::CmpSwap => {
            match word.compare_exchange(compare_add, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            }
        }
        AtomicKind::FetchAdd => word.fetch_add(compare_add, Ordering::SeqCst),
    }
}

/// The `ibv_wc_status` an initiator reports for a two-sided request that
/// ended with `status`.
pub fn wc_status(status: Status) -> u32 {
    match status {
        Status::Ok => 0,            // IBV_WC_SUCCESS
        Status::Flushed => 5,       // IBV_WC_WR_FLUSH_ERR
        Status::RemoteInvalid => 9, // IBV_WC_REM_INV_REQ_ERR
        Status::RemoteAccess => 10, // IBV_WC_REM_ACCESS_ERR
        Status::NoResources => 11,  // IBV_WC_REM_OP_ERR
        Status::RemoteOp => 11,     // IBV_WC_REM_OP_ERR
        Status::Retry => 11,        // a retry that cannot be retried
        Status::RnrNoRecv => 13,    // IBV_WC_RNR_RETRY_EXC_ERR
        Status::RnrWait => 13,      // not an outcome (never completes an op)
    }
}

#[cfg(test)]
mod tests;
