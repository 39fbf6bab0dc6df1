//! Error types: immediate (post-time / verbs call) errors, as `errno`-like variants.

use thiserror::Error;

/// Errors returned directly by verbs calls (what libibverbs reports via errno).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    #[error("invalid argument: {0}")]
    /// A bad argument (which).
    InvalidArgument(&'static str),
    #[error("resource exhausted: {0}")]
    /// A table or queue limit reached (which).
    NoResources(&'static str),
    #[error("queue full: {0}")]
    /// A work queue is full (which).
    QueueFull(&'static str),
    #[error("QP in wrong state for this operation: {0:?}")]
    /// The QP's state does not allow the call.
    WrongQpState(crate::verbs::QpState),
    #[error("illegal QP state transition {from:?} -> {to:?}")]
    /// A QP state transition not in the verbs table.
    IllegalTransition {
        /// The current state.
        from: crate::verbs::QpState,
        /// The requested state.
        to: crate::verbs::QpState,
    },
    #[error("invalid attribute mask for transition: {0}")]
    /// Required / forbidden attributes in a modify mask.
    InvalidMask(&'static str),
    #[error("completion queue overflowed")]
    /// A CQ overflowed.
    CqOverflow,
    #[error("object busy: {0}")]
    /// The resource is still in use (which).
    Busy(&'static str),
    #[error("timed out")]
    /// A wait timed out.
    Timeout,
    #[error("remote host unreachable: {0}")]
    /// The peer host cannot be reached.
    Unreachable(String),
    #[error("I/O error: {0}")]
    /// A system call failed.
    Io(String),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl Error {
    /// The errno libibverbs would report.
    pub fn errno(&self) -> i32 {
        match self {
            Error::InvalidArgument(_)
            | Error::WrongQpState(_)
            | Error::IllegalTransition { .. }
            | Error::InvalidMask(_) => libc::EINVAL,
            Error::NoResources(_) | Error::QueueFull(_) => libc::ENOMEM,
            Error::CqOverflow => libc::EOVERFLOW,
            Error::Busy(_) => libc::EBUSY,
            Error::Timeout => libc::ETIMEDOUT,
            Error::Unreachable(_) => libc::EHOSTUNREACH,
            Error::Io(_) => libc::EIO,
        }
    }
}

/// `Result` with this crate's [`Error`](enum@Error).
pub type Result<T> = std::result::Result<T, Error>;

/// A post_send / post_recv failure: which WR of the list was rejected and why.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("work request {bad_wr_index} rejected: {err}")]
pub struct PostError {
    /// Index of the first WR not posted.
    pub bad_wr_index: usize,
    /// Why.
    pub err: Error,
}
