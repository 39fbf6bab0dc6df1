//! The seam between the engine and its NIC: [`Backend`], the [`crate::nic`]
//! traits plus the one thing the engine adds (how a backend's errors become
//! engine errors), and the default backend, the software RNIC through
//! [`crate::adapt`] — the only backend-specific names of the engine
//! besides the public error payload (`types`).
//!
//! Generic, not `dyn`: every engine type and function takes the backend as
//! a parameter `N: Backend` (the public types default it to
//! [`DefaultNic`], so `Context`, `Pd`, `Qp`, `Mr`, `Cq` keep their names for
//! the verbs shim and the CLI). Each backend gets its own monomorphic copy
//! of the engine: a WR post or a CQ poll is a direct (inlinable) call into
//! the backend, as before the seam, with no virtual call per operation on
//! the hot path; and the backend's associated types (QP, CQ, MRs, buffers,
//! IOMMU ranges) are stored by value, without boxing.

use super::types::Error;
use crate::nic::Nic;

/// A NIC the engine runs on: the verbs traits (with IOMMU control, until the
/// user-space mode is wired) and the conversion of the NIC's errors.
pub trait Backend: Nic + 'static {
    /// `e` as an engine error (setup steps the NIC refused).
    fn error(e: Self::Error) -> Error;
}

/// The default backend: one PD of the software RNIC.
pub type DefaultNic = crate::adapt::RnicNic;

/// The device a default context opens ([`super::Context::new`]).
pub type Device = rnic::Host;

impl Backend for DefaultNic {
    fn error(e: rnic::Error) -> Error {
        Error::Nic(e)
    }
}

/// Open one protection domain of `dev` with the default backend.
pub(crate) fn open(dev: &Device) -> Result<DefaultNic, Error> {
    DefaultNic::open(dev).map_err(Error::Nic)
}

/// The default backend's counters (public: [`super::Context::nic_stats`]).
pub type NicStats = <DefaultNic as Nic>::Stats;
