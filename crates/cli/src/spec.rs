//! What one perf run measures: operation, mode (pinned / NP-RDMA / ODP model), fault
//! scenario, sizes and loop shape. Shared by `perf`, `eval` and the shm peer.

use serde::{Deserialize, Serialize};

/// The RDMA operation measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA READ from the target's buffer.
    Read,
    /// RDMA WRITE into the target's buffer.
    Write,
    /// SEND into a receive posted by the target.
    Send,
    /// 8-byte FETCH_AND_ADD on the target's buffer (size is always 8).
    Atomic,
}

/// Memory mode of both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Standard RDMA: buffers mlock'ed (every page resident), plain rnic MRs.
    Pinned,
    /// NP-RDMA: pager-managed (unpinned) buffers, the `nprdma` layer.
    Nprdma,
    /// ODP model: on-demand MRs of the software RNIC (a model, not hardware).
    Odp,
}

/// Page-fault scenario at the target buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// Target pages resident and mapped (steady state).
    None,
    /// Every operation hits never-touched target pages.
    Minor,
    /// Every operation hits target pages swapped out to the swap file.
    Major,
}

/// Latency or bandwidth test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Test {
    Lat,
    Bw,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Send => "send",
            Op::Atomic => "atomic",
        }
    }
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Pinned => "pinned",
            Mode::Nprdma => "nprdma",
            Mode::Odp => "odp",
        }
    }
    /// How reports label the mode (ODP is always marked as a model).
    pub fn label(self) -> &'static str {
        match self {
            Mode::Pinned => "pinned RDMA",
            Mode::Nprdma => "NP-RDMA",
            Mode::Odp => "ODP (model)",
        }
    }
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Minor => "minor",
            Fault::Major => "major",
        }
    }
}

/// One run: one size, one loop shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    pub op: Op,
    pub mode: Mode,
    pub fault: Fault,
    pub test: Test,
    pub size: usize,
    pub iters: usize,
    pub tx_depth: usize,
    pub signal_every: usize,
}

/// Largest target window prepared at once for a fault scenario.
pub const WINDOW_BYTES: usize = 64 << 20;
/// Receives the target keeps posted (SEND), also the SEND window limit.
pub const RECV_DEPTH: usize = 256;

impl Spec {
    /// Message size actually used (atomics are 8 bytes).
    pub fn msg_len(&self) -> usize {
        if self.op == Op::Atomic {
            8
        } else {
            self.size
        }
    }
    /// Distance between the targets of consecutive operations of a window.
    pub fn stride(&self, page: usize) -> usize {
        match self.fault {
            Fault::None => 0,
            _ => crate::mem::round_up(self.msg_len(), page),
        }
    }
    /// Operations per prepared window.
    pub fn window_ops(&self, page: usize) -> usize {
        let mut n = self.iters.max(1);
        if self.fault != Fault::None {
            n = n.min((WINDOW_BYTES / self.stride(page)).max(1));
        }
        if self.op == Op::Send {
            n = n.min(RECV_DEPTH);
        }
        n
    }
    /// Bytes of target memory one window covers.
    pub fn window_bytes(&self, page: usize) -> usize {
        match self.fault {
            Fault::None => self.msg_len().max(8),
            _ => self.window_ops(page) * self.stride(page),
        }
    }
    /// Check the loop shape.
    pub fn validate(&self) -> Result<(), String> {
        if self.size == 0 || self.size > (1 << 30) {
            return Err(format!("--size must be 1 B .. 1 GiB (got {})", self.size));
        }
        if self.iters == 0 {
            return Err("--iters must be at least 1".into());
        }
        if self.tx_depth == 0 || self.tx_depth > 1024 {
            return Err(format!(
                "--tx-depth must be 1..=1024 (got {})",
                self.tx_depth
            ));
        }
        if self.signal_every == 0 || self.signal_every > self.tx_depth {
            return Err(format!(
                "--signal-every must be 1..=tx-depth ({}), got {} (an unsignaled batch longer than the queue would never complete)",
                self.tx_depth, self.signal_every
            ));
        }
        if self.op == Op::Send && self.fault != Fault::None {
            return Err("--fault applies to the target buffer of READ/WRITE/atomic; a SEND lands in a posted receive (use --fault none)".into());
        }
        if self.op == Op::Send && self.size > (64 << 20) {
            return Err("SEND messages are limited to 64 MiB here".into());
        }
        Ok(())
    }
}
