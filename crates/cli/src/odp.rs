//! ODP-model buffers (feature `odp`): pager memory registered with the software
//! RNIC's ON_DEMAND flag, its residency tracked in the NIC's page table, the host's
//! page-fault handler (vmem prefetch), and the MMU-notifier-style invalidation used
//! by the major-fault scenario.

use std::sync::Arc;

use crate::error::Result;
use crate::setup::rnic_access;

/// Install the host's ODP page-fault handler: bring the range in with the pager
/// (zero-fill never-touched pages, read swapped pages back), on the NIC thread.
pub fn install_handler(host: &rnic::Host, pager: &vmem::Pager) {
    let weak = pager.downgrade();
    host.set_odp_fault_handler(Arc::new(move |addr, len| {
        let p = weak
            .upgrade()
            .ok_or_else(|| rnic::Error::Io("pager gone".into()))?;
        p.prefetch(addr, len)
            .map(|_| ())
            .map_err(|e| rnic::Error::Io(e.to_string()))
    }));
}

/// A pager region registered ON_DEMAND (nothing pinned), tracked in the host's
/// residency map; untracked again on drop (after the MR is gone).
pub struct OdpBuf {
    mr: Option<rnic::Mr>,
    pub region: vmem::Region,
    host: rnic::Host,
}

impl OdpBuf {
    /// `fill`: write the pages first (resident), else leave them never-touched.
    pub fn new(
        host: &rnic::Host,
        pd: &rnic::Pd,
        pager: &vmem::Pager,
        len: usize,
        fill: Option<u8>,
    ) -> Result<OdpBuf> {
        let mut region = pager.alloc(len)?;
        if let Some(b) = fill {
            region.as_mut_slice().fill(b);
        }
        host.frames()
            .track(region.addr(), region.len(), fill.is_some())?;
        // SAFETY: the region is private anonymous memory owned by this OdpBuf; the MR
        // is dropped first (Drop below) and the NIC never touches a non-present page
        // of an ON_DEMAND MR (it faults to the handler instead).
        let mr = unsafe { pd.reg_mr(region.addr(), len, rnic_access() | rnic::Access::ON_DEMAND) };
        let mr = match mr {
            Ok(m) => m,
            Err(e) => {
                let _ = host.frames().untrack(region.addr());
                return Err(e.into());
            }
        };
        Ok(OdpBuf {
            mr: Some(mr),
            region,
            host: host.clone(),
        })
    }

    pub fn mr(&self) -> &rnic::Mr {
        self.mr.as_ref().expect("MR present until drop")
    }

    /// Invalidate `[addr, addr+len)` in the NIC's page table, then swap it out.
    pub fn swap_out(&self, addr: usize, len: usize) -> Result<usize> {
        let pager = self.region.pager();
        Ok(self
            .host
            .odp_invalidate_then(addr, len, || pager.swap_out(addr, len))??)
    }
}

impl Drop for OdpBuf {
    fn drop(&mut self) {
        drop(self.mr.take());
        let _ = self.host.frames().untrack(self.region.addr());
    }
}
