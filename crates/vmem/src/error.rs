//! The crate's error type.

use std::io;

/// Everything the pager can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("userfaultfd unavailable or lacks a needed feature: {0}")]
    /// userfaultfd could not be opened or lacks a feature the pager needs.
    Userfaultfd(io::Error),
    #[error("invalid range {addr:#x}+{len:#x}: {why}")]
    /// A range the call cannot take.
    InvalidRange {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    #[error("{addr:#x}+{len:#x} is not (all) mapped")]
    /// Registration of a range that is not all mapped.
    NotMapped {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
    },
    #[error(
        "{addr:#x}+{len:#x} is not memory the pager can page (hugetlbfs, or a file \
         mapping outside tmpfs)"
    )]
    /// Registration for paging of memory the pager cannot page (hugetlbfs, file
    /// mappings outside tmpfs, or a range mixing them with pageable memory); [`crate::Pager::register_foreign_raw`] takes it,
    /// always resident.
    NotAnonymous {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
    },
    #[error("{addr:#x}+{len:#x} overlaps a region of the other kind (external/managed)")]
    /// Registration overlapping a registered region of the other kind (an
    /// external or foreign region and a managed one).
    OtherKind {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
    },
    #[error("address {0:#x} is not in a region registered with this pager")]
    /// The address is in no registered region.
    NotRegistered(usize),
    #[error("region at {0:#x} was already unregistered")]
    /// The region was unregistered before.
    AlreadyUnregistered(usize),
    #[error("page {0:#x} is not pinned (unpin without pin)")]
    /// Unpin of a page that holds no pin.
    NotPinned(usize),
    #[error("page {0:#x} has too many pins")]
    /// The page's pin count would overflow.
    PinOverflow(usize),
    #[error("page {0:#x} is pinned and cannot be swapped out")]
    /// The page is pinned and cannot be swapped out.
    Pinned(usize),
    #[error("page {0:#x} was unmapped by the application")]
    /// The application unmapped the page.
    Unmapped(usize),
    #[error("page {0:#x} belongs to an externally managed region and is not resident")]
    /// A page of an externally managed region is not resident.
    ExternalNotResident(usize),
    #[error("swap device full ({0} slots)")]
    /// No free swap slot (the slot count).
    SwapFull(usize),
    #[error("swap device I/O error: {0}")]
    /// Reading or writing the swap file failed.
    SwapIo(io::Error),
    #[error("kernel refused {op} at {addr:#x}: {err}")]
    /// A userfaultfd / madvise call failed.
    Kernel {
        /// The call.
        op: &'static str,
        /// The page it was for.
        addr: usize,
        /// The kernel's error.
        err: io::Error,
    },
    #[error("{0}")]
    /// A bad configuration value.
    Config(String),
    /// The kernel refused a page fill because an munmap/mremap of managed
    /// memory is in flight; transient (`pin` and `prefetch` retry it
    /// internally for up to 10 s).
    #[error("transient: memory map changing, retry")]
    Retry,
}

/// `Result` with the pager's [`Error`](enum@Error).
pub type Result<T> = std::result::Result<T, Error>;
