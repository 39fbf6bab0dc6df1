//! Pins of application memory taken by the engine (recorded in the MR's
//! shadow and mapped into the NIC views) and the temporary NIC MRs over
//! them: the holds of two-sided operations and served requests.

use std::sync::Arc;

use super::mr::MrEntry;
use crate::adapt::{RnicIommu, VmemMm};
use crate::nic::Pinned;
use crate::shadow::MrShadow;
use crate::trace::{mark, Step};

/// Temporary NIC MR + pin of a two-sided operation (dropped in this
/// order: the MR waits for DMA, then the pages are unpinned).
#[derive(Default)]
pub(super) struct Hold {
    pub(super) mr: Option<rnic::Mr>,
    pub(super) pin: Option<EnginePin>,
}

/// A pager pin recorded in the MR's shadow: released by noting the unpin
/// in the shadow first, then unpinning.
pub(super) struct EnginePin {
    pub(super) shadow: Arc<MrShadow<RnicIommu>>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) pin: Option<Pinned<VmemMm>>,
}

impl Drop for EnginePin {
    fn drop(&mut self) {
        self.shadow.unpinned(self.addr, self.len);
        drop(self.pin.take());
    }
}

/// Pin `[addr, addr+len)` of `mr` (faulting it in on this thread) and map
/// it into the NIC views.
pub(super) fn engine_pin(mm: &VmemMm, mr: &MrEntry, addr: u64, len: u64) -> Result<EnginePin, ()> {
    let p = Pinned::new(mm.clone(), addr, len).map_err(|e| {
        tracing::warn!(addr, len, error = %e, "pin failed");
    })?;
    mark(Step::TPinned);
    let g = EnginePin {
        shadow: mr.shadow.clone(),
        addr,
        len,
        pin: Some(p),
    };
    if let Err(e) = mr.shadow.pinned_map_in(addr, len) {
        tracing::error!(error = %e, "map-in failed");
        return Err(());
    }
    mark(Step::TMapped);
    Ok(g)
}

pub(super) fn temp_mr(
    pd: &rnic::Pd,
    addr: u64,
    len: u64,
    acc: rnic::Access,
) -> Result<rnic::Mr, ()> {
    // `ANY_QP`: the peer's reverse operation reaches it whatever the
    // application's flags on the QP (the MR's own rights still apply).
    let acc = acc | rnic::Access::ANY_QP;
    #[allow(unsafe_code)]
    // SAFETY: the range is inside a registered application MR (mapped while
    // registered) and pinned by the caller for the MR's whole lifetime (the
    // `Hold` drops the MR before the pin).
    unsafe { pd.reg_mr(addr as usize, len as usize, acc) }.map_err(|e| {
        tracing::warn!(error = %e, "temporary MR failed");
    })
}
