//! The CLI's error type: every failure is a message for the user, never a panic.

/// Errors of the `nprdma` command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("invalid argument: {0}")]
    Arg(String),
    #[error("software NIC: {0}")]
    Nic(#[from] rnic::Error),
    #[error("pager: {0}")]
    Pager(#[from] vmem::Error),
    #[error("NP-RDMA: {0}")]
    Np(#[from] nprdma::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("work completion failed: {0}")]
    Completion(String),
    #[error("peer: {0}")]
    Peer(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("not available: {0}")]
    Unavailable(String),
}

pub type Result<T> = std::result::Result<T, CliError>;
