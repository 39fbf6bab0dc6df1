//! Error types: immediate (post-time / verbs call) errors, as `errno`-like variants.

use thiserror::Error;

/// Errors returned directly by verbs calls (what libibverbs reports via errno).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    #[error("resource exhausted: {0}")]
    NoResources(&'static str),
    #[error("queue full: {0}")]
    QueueFull(&'static str),
    #[error("QP in wrong state for this operation: {0:?}")]
    WrongQpState(crate::QpState),
    #[error("illegal QP state transition {from:?} -> {to:?}")]
    IllegalTransition { from: crate::QpState, to: crate::QpState },
    #[error("invalid attribute mask for transition: {0}")]
    InvalidMask(&'static str),
    #[error("completion queue overflowed")]
    CqOverflow,
    #[error("object busy: {0}")]
    Busy(&'static str),
    #[error("timed out")]
    Timeout,
    #[error("remote host unreachable: {0}")]
    Unreachable(String),
    #[error("I/O error: {0}")]
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

pub type Result<T> = std::result::Result<T, Error>;

/// A post_send / post_recv failure: which WR of the list was rejected and why.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("work request {bad_wr_index} rejected: {err}")]
pub struct PostError {
    pub bad_wr_index: usize,
    pub err: Error,
}
