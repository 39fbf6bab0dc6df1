//! The device side of one context: the NIC resources every QP of it shares
//! (host, PD, IOMMU control, completion channel and CQs), the pager, the
//! check parameters and the configuration. Read-only after creation.

use std::sync::Arc;

use super::types::Config;
use crate::adapt::{RnicIommu, VmemMm};
use crate::check::CheckConfig;

/// The NIC resources, pager and configuration of a context.
pub(crate) struct Dev {
    pub host: rnic::Host,
    pub iommu: Arc<RnicIommu>,
    pub pd: rnic::Pd,
    pub mm: VmemMm,
    pub chan: rnic::CompChannel,
    /// Send completions of the data QPs (one-sided operations, reverse
    /// operations, read-backs).
    pub ncq: rnic::Cq,
    /// Completions of the control QPs: their sends and their receives
    /// (pushed by the peers).
    pub rcq: rnic::Cq,
    pub check: CheckConfig,
    pub cfg: Config,
    pub _ctx: rnic::Context,
}

/// Bytes of the zero source buffer, and SGEs of one reverse WRITE from it:
/// one WR answers up to `ZERO_BUF * ZERO_SGES` (8 MiB).
pub(super) const ZERO_BUF: usize = 512 * 1024;
pub(super) const ZERO_SGES: usize = 16;

/// SGEs per zero-answer WR: `ZERO_SGES`, or fewer if the NIC has fewer.
pub(super) fn zero_sges(sh: &Dev) -> usize {
    ZERO_SGES.min(sh.host.config().max_sge as usize).max(1)
}
/// Largest READ answered from the zero source (a few WRs; more goes the
/// ordinary way).
pub(super) const ZERO_READ_MAX: u64 = 64 << 20;

/// Largest READ/WRITE the two-sided path carries inline.
pub(super) fn inline_max(sh: &Dev) -> u64 {
    (sh.cfg.ctrl.max_inline as u64).min(sh.cfg.plan.inline_max)
}
