//! Shim errors: each maps to the errno libibverbs callers expect and is reported on
//! stderr (prefixed `libnprdma:`) so unsupported verbs never fail silently.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
/// Why a verb failed.
pub enum ShimError {
    #[error("not supported: {0}")]
    /// The verb or option is not supported (EOPNOTSUPP).
    Unsupported(String),
    #[error("invalid argument: {0}")]
    /// A bad argument (EINVAL).
    InvalidArgument(String),
    #[error("busy: {0}")]
    /// The object is in use (EBUSY).
    Busy(String),
    #[error("bad address: {0}")]
    /// Memory that is not mapped (EFAULT, as `ib_umem_get` failing to pin it).
    Fault(String),
    #[error(transparent)]
    /// The software NIC refused (its errno).
    Nic(#[from] rnic::Error),
}

impl ShimError {
    /// The errno a libibverbs provider would set/return.
    pub fn errno(&self) -> i32 {
        match self {
            ShimError::Unsupported(_) => libc::EOPNOTSUPP,
            ShimError::InvalidArgument(_) => libc::EINVAL,
            ShimError::Busy(_) => libc::EBUSY,
            ShimError::Fault(_) => libc::EFAULT,
            ShimError::Nic(e) => e.errno(),
        }
    }
}

/// Print `err` on stderr (with the verb that failed), set errno, return the errno.
pub fn report(verb: &str, err: &ShimError) -> i32 {
    eprintln!("libnprdma: {verb}: {err}");
    let e = err.errno();
    set_errno(e);
    e
}

/// This thread's `errno`.
pub fn errno() -> i32 {
    // SAFETY: as in `set_errno`: this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() }
}

/// Set this thread's `errno`.
pub fn set_errno(e: i32) {
    // SAFETY: __errno_location returns this thread's errno slot, always valid. (Raw:
    // rustix returns errors instead of touching errno, and the C caller reads errno.)
    unsafe { *libc::__errno_location() = e };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos() {
        assert_eq!(ShimError::Unsupported("x".into()).errno(), libc::EOPNOTSUPP);
        assert_eq!(ShimError::Busy("x".into()).errno(), libc::EBUSY);
        assert_eq!(
            ShimError::from(rnic::Error::QueueFull("sq")).errno(),
            libc::ENOMEM
        );
        assert_eq!(
            report("test", &ShimError::InvalidArgument("y".into())),
            libc::EINVAL
        );
        // SAFETY: reading this thread's errno.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::EINVAL);
    }
}
