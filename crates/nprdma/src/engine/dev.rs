//! The device side of one context: the NIC resources every QP of it shares
//! (the backend's PD with its completion channel, the views' IOMMU and CQs),
//! the pager, the check parameters and the configuration. Read-only after
//! creation.

use std::sync::Arc;

use super::backend::Backend;
use super::lease::Leases;
use super::regcache::RegCache;
use super::types::Config;
use super::views::Views;
use crate::adapt::VmemMm;
use crate::check::CheckConfig;
use crate::nic::{DeviceCaps, ListenerId, MemoryManager};

/// The NIC resources, pager and configuration of a context.
pub(crate) struct Dev<N: Backend> {
    /// The registration cache of the temporary MRs (user-space mode; off:
    /// budget 0). First field: its MRs go before the NIC's PD.
    pub cache: Arc<RegCache<N>>,
    /// The cache's swap listener at the pager (removed on drop).
    pub cache_listener: Option<ListenerId>,
    /// The target's leases (user-space mode; off: budget 0). Their MRs go
    /// before the NIC's PD too.
    pub leases: Arc<Leases<N>>,
    /// The leases' listener at the pager (removed on drop).
    pub lease_listener: Option<ListenerId>,
    /// Send completions of the data QPs (one-sided operations, reverse
    /// operations, read-backs).
    pub ncq: N::Cq,
    /// Completions of the control QPs: their sends and their receives
    /// (pushed by the peers).
    pub rcq: N::Cq,
    /// The IOMMU behind the MR views (the NIC's, or key-only views in
    /// user-space mode).
    pub iommu: Arc<Views<N>>,
    /// The backend's PD (dropped after the CQs).
    pub nic: N,
    /// The backend's capabilities (queried once).
    pub caps: DeviceCaps,
    pub mm: VmemMm,
    pub check: CheckConfig,
    pub cfg: Config,
}

impl<N: Backend> Drop for Dev<N> {
    fn drop(&mut self) {
        if let Some(id) = self.cache_listener.take() {
            self.mm.remove_swap_listener(id);
        }
        if let Some(id) = self.lease_listener.take() {
            self.mm.remove_swap_listener(id);
        }
        self.leases.clear();
        self.cache.clear();
    }
}

/// Bytes of the zero source buffer, and SGEs of one reverse WRITE from it:
/// one WR answers up to `ZERO_BUF * ZERO_SGES` (8 MiB).
pub(super) const ZERO_BUF: usize = 512 * 1024;
pub(super) const ZERO_SGES: usize = 16;

/// SGEs per zero-answer WR: `ZERO_SGES`, or fewer if the NIC has fewer.
pub(super) fn zero_sges<N: Backend>(sh: &Dev<N>) -> usize {
    ZERO_SGES.min(sh.caps.max_sge as usize).max(1)
}
/// Largest READ answered from the zero source (a few WRs; more goes the
/// ordinary way).
pub(super) const ZERO_READ_MAX: u64 = 64 << 20;

/// Largest READ/WRITE the two-sided path carries inline.
pub(super) fn inline_max<N: Backend>(sh: &Dev<N>) -> u64 {
    (sh.cfg.ctrl.max_inline as u64).min(sh.cfg.plan.inline_max)
}
