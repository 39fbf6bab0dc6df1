//! The crate's error type.

use std::io;

/// Everything the pager can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("userfaultfd unavailable or lacks a needed feature: {0}")]
    Userfaultfd(io::Error),
    #[error("invalid range {addr:#x}+{len:#x}: {why}")]
    InvalidRange {
        addr: usize,
        len: usize,
        why: &'static str,
    },
    #[error("address {0:#x} is not in a region registered with this pager")]
    NotRegistered(usize),
    #[error("region at {0:#x} was already unregistered")]
    AlreadyUnregistered(usize),
    #[error("page {0:#x} is not pinned (unpin without pin)")]
    NotPinned(usize),
    #[error("page {0:#x} has too many pins")]
    PinOverflow(usize),
    #[error("page {0:#x} is pinned and cannot be swapped out")]
    Pinned(usize),
    #[error("page {0:#x} was unmapped by the application")]
    Unmapped(usize),
    #[error("page {0:#x} belongs to an externally managed region and is not resident")]
    ExternalNotResident(usize),
    #[error("swap device full ({0} slots)")]
    SwapFull(usize),
    #[error("swap device I/O error: {0}")]
    SwapIo(io::Error),
    #[error("kernel refused {op} at {addr:#x}: {err}")]
    Kernel {
        op: &'static str,
        addr: usize,
        err: io::Error,
    },
    #[error("{0}")]
    Config(String),
    /// The kernel refused a page fill because an munmap/mremap of managed
    /// memory is in flight; transient (`pin` and `prefetch` retry it
    /// internally for up to 10 s).
    #[error("transient: memory map changing, retry")]
    Retry,
}

pub type Result<T> = std::result::Result<T, Error>;
