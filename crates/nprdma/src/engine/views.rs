//! The IOMMU behind the MR views (`shadow::MrShadow`): the NIC's own
//! ([`Views::Nic`], kernel-module mode: the Read and Write MRs reach the
//! pages their IOVA entries name) or, on a NIC without IOMMU control,
//! bookkeeping only ([`Views::User`], the paper's user-space mode: a view
//! MR is a key the engine hands out and *no NIC ever sees* — every
//! READ/WRITE goes two-sided, and only temporary MRs over pinned memory,
//! and the control rings, are registered with the NIC).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::backend::Backend;
use crate::nic::{Access, Frame, IommuControl, NicMr};

/// The views' IOMMU of a context.
pub(crate) enum Views<N: Backend> {
    /// The NIC's IOMMU control.
    Nic(Arc<N::Iommu>),
    /// No IOMMU: key-only views (user-space mode).
    User(UserKeys),
}

/// The key numbers of user-space mode's views (never given to a NIC).
pub(crate) struct UserKeys {
    next: AtomicU32,
}

impl UserKeys {
    pub(crate) fn new() -> Self {
        // Keys are per context; start away from 0 (an invalid key).
        UserKeys {
            next: AtomicU32::new(0x100),
        }
    }
}

/// An IOVA range of [`Views`].
#[derive(Debug)]
pub(crate) enum ViewRange<R> {
    /// The NIC's.
    Nic(R),
    /// A key-only range.
    User,
}

impl<R: Copy> Clone for ViewRange<R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: Copy> Copy for ViewRange<R> {}

/// A view MR of [`Views`].
pub(crate) enum ViewMr<M> {
    /// The NIC's MR over an IOVA range.
    Nic(M),
    /// A key-only MR (no NIC registration).
    User {
        /// The key (local and remote).
        key: u32,
        /// The registered address.
        addr: u64,
        /// The registered length.
        len: u64,
    },
}

impl<M: NicMr> NicMr for ViewMr<M> {
    fn lkey(&self) -> u32 {
        match self {
            ViewMr::Nic(m) => m.lkey(),
            ViewMr::User { key, .. } => *key,
        }
    }
    fn rkey(&self) -> u32 {
        match self {
            ViewMr::Nic(m) => m.rkey(),
            ViewMr::User { key, .. } => *key,
        }
    }
    fn addr(&self) -> u64 {
        match self {
            ViewMr::Nic(m) => m.addr(),
            ViewMr::User { addr, .. } => *addr,
        }
    }
    fn len(&self) -> u64 {
        match self {
            ViewMr::Nic(m) => m.len(),
            ViewMr::User { len, .. } => *len,
        }
    }
}

impl<N: Backend> Views<N> {
    /// Whether this is user-space mode (no IOMMU control).
    pub(crate) fn is_user(&self) -> bool {
        matches!(self, Views::User(_))
    }
}

type NicRange<N> = <<N as crate::nic::Nic>::Iommu as IommuControl>::Range;
type NicIommuMr<N> = <<N as crate::nic::Nic>::Iommu as IommuControl>::Mr;

impl<N: Backend> IommuControl for Views<N> {
    type Error = N::Error;
    type Range = ViewRange<NicRange<N>>;
    type Mr = ViewMr<NicIommuMr<N>>;
    const ENTRY_BYTES: usize = <N::Iommu as IommuControl>::ENTRY_BYTES;

    fn alloc_range(&self, npages: u64) -> Result<Self::Range, N::Error> {
        match self {
            Views::Nic(io) => io.alloc_range(npages).map(ViewRange::Nic),
            Views::User(_) => Ok(ViewRange::User),
        }
    }
    fn free_range(&self, range: Self::Range) -> Result<(), N::Error> {
        match (self, range) {
            (Views::Nic(io), ViewRange::Nic(r)) => io.free_range(r),
            _ => Ok(()),
        }
    }
    fn map(&self, range: &Self::Range, index: u64, frame: Frame) -> Result<(), N::Error> {
        match (self, range) {
            (Views::Nic(io), ViewRange::Nic(r)) => io.map(r, index, frame),
            _ => Ok(()),
        }
    }
    fn flush(&self) -> Result<(), N::Error> {
        match self {
            Views::Nic(io) => io.flush(),
            Views::User(_) => Ok(()),
        }
    }
    fn test_and_clear_young(&self, range: &Self::Range, index: u64) -> Result<bool, N::Error> {
        match (self, range) {
            (Views::Nic(io), ViewRange::Nic(r)) => io.test_and_clear_young(r, index),
            _ => Ok(false),
        }
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        range: &Self::Range,
        domain: u32,
    ) -> Result<Self::Mr, N::Error> {
        match (self, range) {
            (Views::Nic(io), ViewRange::Nic(r)) => {
                // SAFETY: forwarded contract.
                unsafe { io.reg_mr_iova(addr, len, access, r, domain) }.map(ViewMr::Nic)
            }
            (Views::User(k), _) => Ok(ViewMr::User {
                key: k.next.fetch_add(1, Ordering::Relaxed),
                addr,
                len,
            }),
            (Views::Nic(_), ViewRange::User) => {
                unreachable!("a key-only range only comes from key-only views")
            }
        }
    }
    fn set_mr_rights(
        &self,
        mr: &mut Self::Mr,
        access: Access,
        domain: u32,
    ) -> Result<(), N::Error> {
        match (self, mr) {
            (Views::Nic(io), ViewMr::Nic(m)) => io.set_mr_rights(m, access, domain),
            // Key-only views: the rights live in the engine's MR entry.
            _ => Ok(()),
        }
    }
    fn set_resident(&self, addr: u64, len: u64, resident: bool) -> Result<(), N::Error> {
        match self {
            Views::Nic(io) => io.set_resident(addr, len, resident),
            Views::User(_) => Ok(()),
        }
    }
    fn track_frames(&self, addr: u64, len: u64) -> Result<(), N::Error> {
        match self {
            Views::Nic(io) => io.track_frames(addr, len),
            Views::User(_) => Ok(()),
        }
    }
    fn untrack_frames(&self, addr: u64) -> Result<(), N::Error> {
        match self {
            Views::Nic(io) => io.untrack_frames(addr),
            Views::User(_) => Ok(()),
        }
    }
}
