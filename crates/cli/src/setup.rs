//! The set-up both ends of a run share: the access rights of every buffer, the
//! address a QP is reached at and its connection in any memory mode, the pager of
//! the NP-RDMA and ODP-model modes, the software RNIC's objects for either end
//! ([`Side`]), and which modes this build can run.

use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::spec::{Mode, RECV_DEPTH};

/// Access rights of every buffer of a run.
pub fn rnic_access() -> rnic::Access {
    rnic::Access::LOCAL_WRITE
        | rnic::Access::REMOTE_READ
        | rnic::Access::REMOTE_WRITE
        | rnic::Access::REMOTE_ATOMIC
}

pub fn np_access() -> nprdma::Access {
    nprdma::Access::LOCAL_WRITE
        | nprdma::Access::REMOTE_READ
        | nprdma::Access::REMOTE_WRITE
        | nprdma::Access::REMOTE_ATOMIC
}

/// A host address + QPN, exchanged out of band.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct QpAddr {
    pub host: String,
    pub qpn: u32,
}

/// A run's QP in any memory mode: an rnic QP (pinned, ODP model) or an NP-RDMA one.
pub enum RunQp<'a> {
    Rnic(&'a rnic::Qp),
    Np(&'a nprdma::Qp),
}

impl RunQp<'_> {
    /// This QP's address on `host`, for the peer.
    pub fn addr(&self, host: &rnic::Host) -> QpAddr {
        let qpn = match self {
            RunQp::Rnic(qp) => qp.qpn(),
            RunQp::Np(qp) => qp.qpn(),
        };
        QpAddr {
            host: host.addr().to_hex(),
            qpn,
        }
    }

    /// Connects this QP to the peer's QP.
    pub fn connect(&self, peer: &QpAddr) -> Result<()> {
        let addr = rnic::HostAddr::from_hex(&peer.host)?;
        match self {
            RunQp::Rnic(qp) => qp.connect(rnic_access(), addr, peer.qpn, 7)?,
            RunQp::Np(qp) => qp.connect(&nprdma::Endpoint {
                addr: addr.to_bytes(),
                qpn: peer.qpn,
                ctrl_qpn: 0,
            })?,
        }
        Ok(())
    }
}

/// `NPRDMA_SWAP_BUFFERED=1`: the target pager's swap file goes through the page
/// cache (a major fault may then be a memory copy); labelled in every row.
pub const SWAP_BUFFERED_ENV: &str = "NPRDMA_SWAP_BUFFERED";

/// Whether `NPRDMA_SWAP_BUFFERED` (its value `v`) asks for buffered swap.
pub fn swap_buffered(v: Option<&str>) -> Result<bool> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(CliError::Arg(format!(
            "{SWAP_BUFFERED_ENV}={other:?}: expected 0 or 1"
        ))),
    }
}

/// A pager with a swap file large enough for the biggest window: O_DIRECT swap
/// (like Linux swap), unless `NPRDMA_SWAP_BUFFERED=1`.
pub fn new_pager() -> Result<vmem::Pager> {
    pager_with(1 << 30, None)
}

/// Pages a first-touch fault fills at once (`vmem::PagerConfig::fault_around`):
/// 64 KiB, Linux's `fault_around_bytes`.
pub const FAULT_AROUND: usize = 16;
/// Pages a run of in-order first touches grows to
/// (`vmem::PagerConfig::fault_around_max`): 2 MiB, a transparent huge page.
pub const FAULT_AROUND_MAX: usize = 512;

/// A pager like [`new_pager`] without a zero reserve, for measurements of
/// the process's RSS (the control-plane costs): the reserve's background
/// fill would show in them, and its fixed size is not per-object state.
pub fn pager_without_reserve() -> Result<vmem::Pager> {
    let mut cfg = pager_config(1 << 30, None)?;
    cfg.zero_reserve = 0;
    Ok(vmem::Pager::new(cfg)?)
}

/// The zero reserve (`vmem::PagerConfig::zero_reserve`) by default: 32 MiB,
/// at most a sixteenth of the budget.
pub const ZERO_RESERVE_MB: usize = 32;
/// Environment variable overriding [`ZERO_RESERVE_MB`] (MiB; 0 = no reserve).
pub const ZERO_RESERVE_ENV: &str = "NPRDMA_ZERO_RESERVE_MB";

/// Pages of zero reserve for a pager of `budget_pages`: `mb` MiB (the
/// value of `NPRDMA_ZERO_RESERVE_MB`, default [`ZERO_RESERVE_MB`]), at most a
/// sixteenth of the budget.
pub fn zero_reserve_pages(mb: Option<&str>, budget_pages: Option<usize>) -> Result<usize> {
    let mb = match mb.map(str::trim) {
        None | Some("") => ZERO_RESERVE_MB,
        Some(v) => v.parse::<usize>().map_err(|_| {
            CliError::Arg(format!(
                "{ZERO_RESERVE_ENV}={v:?}: expected a number of MiB"
            ))
        })?,
    };
    Ok(vmem::PagerConfig::zero_reserve_pages(mb, budget_pages))
}

/// A pager with a `swap_size`-byte swap file and a resident budget of
/// `budget_pages` (`None`: unlimited); O_DIRECT swap unless
/// `NPRDMA_SWAP_BUFFERED=1`. It notifies swap-ins eagerly, so NP-RDMA maps
/// pages into the NIC's views in the pass that brings them in (a CPU
/// fault, pin or prefetch) rather than on their first RDMA access, and
/// faults around first touches ([`FAULT_AROUND`] pages, growing to
/// [`FAULT_AROUND_MAX`] while they come in order), the long runs of them
/// moved in from a zero reserve ([`zero_reserve_pages`]).
pub fn pager_with(swap_size: u64, budget_pages: Option<usize>) -> Result<vmem::Pager> {
    Ok(vmem::Pager::new(pager_config(swap_size, budget_pages)?)?)
}

/// The configuration of [`pager_with`].
fn pager_config(swap_size: u64, budget_pages: Option<usize>) -> Result<vmem::PagerConfig> {
    let buffered = swap_buffered(std::env::var(SWAP_BUFFERED_ENV).ok().as_deref())?;
    let zero_reserve = zero_reserve_pages(
        std::env::var(ZERO_RESERVE_ENV).ok().as_deref(),
        budget_pages,
    )?;
    Ok(vmem::PagerConfig {
        zero_reserve,
        swap_size,
        budget_pages,
        o_direct: !buffered,
        eager_swap_in_notify: true,
        fault_around: FAULT_AROUND,
        fault_around_max: FAULT_AROUND_MAX,
        ..vmem::PagerConfig::default()
    })
}

/// Which end of a run a set-up is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Posts the operations: one CQ for sends and receives, a QP of `depth`
    /// sends and a few receives.
    Initiator {
        /// Send-queue depth (the run's window).
        depth: usize,
    },
    /// Serves them: separate send and receive CQs, a QP with room for
    /// `RECV_DEPTH` posted receives.
    Target,
}

/// The software RNIC's objects of a pinned or ODP-model end of a run.
pub struct RnicQp {
    /// The QP.
    pub qp: rnic::Qp,
    /// Its send CQ (also its receive CQ on the initiator).
    pub cq: rnic::Cq,
    /// Its receive CQ (the send CQ itself on the initiator).
    pub rcq: rnic::Cq,
    /// The protection domain of the end's buffers.
    pub pd: rnic::Pd,
    /// The device context.
    pub ctx: rnic::Context,
}

/// The rnic objects of `side` on `host`.
pub fn rnic_qp(host: &rnic::Host, side: Side) -> Result<RnicQp> {
    let ctx = host.open_context()?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(4096, None)?;
    let (rcq, max_send_wr, max_recv_wr) = match side {
        Side::Initiator { depth } => (cq.clone(), depth as u32, 8),
        Side::Target => (ctx.create_cq(4096, None)?, 64, RECV_DEPTH as u32 + 8),
    };
    let attr = rnic::QpInitAttr {
        max_send_wr,
        max_recv_wr,
        ..rnic::QpInitAttr::default()
    };
    let qp = pd.create_qp(&cq, &rcq, &attr)?;
    Ok(RnicQp {
        qp,
        cq,
        rcq,
        pd,
        ctx,
    })
}

/// Whether this build can run `mode` (checked before any peer process is started).
pub fn check_mode(mode: Mode) -> Result<()> {
    match mode {
        Mode::Pinned | Mode::Nprdma => Ok(()),
        #[cfg(feature = "odp")]
        Mode::Odp => Ok(()),
        #[cfg(not(feature = "odp"))]
        Mode::Odp => Err(odp_unavailable()),
    }
}

#[cfg_attr(feature = "odp", allow(dead_code))]
pub fn odp_unavailable() -> CliError {
    CliError::Unavailable(
        "this nprdma was built without the `odp` feature (the ODP model baseline)".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_side_gets_its_queues() {
        let host = rnic::Host::new(rnic::HostConfig::default()).unwrap();
        let ini = rnic_qp(&host, Side::Initiator { depth: 16 }).unwrap();
        let cap = ini.qp.cap();
        assert_eq!((cap.max_send_wr, cap.max_recv_wr), (16, 8));
        let tgt = rnic_qp(&host, Side::Target).unwrap();
        let cap = tgt.qp.cap();
        assert_eq!(
            (cap.max_send_wr, cap.max_recv_wr),
            (64, RECV_DEPTH as u32 + 8)
        );
    }

    /// Records the pages of eager swap-in notices.
    #[derive(Default)]
    struct Ins(std::sync::Mutex<Vec<usize>>);
    impl vmem::SwapListener for Ins {
        fn before_swap_out(&self, _pages: &[usize]) -> bool {
            true
        }
        fn after_swap_in(&self, pages: &[usize]) {
            self.0.lock().unwrap().extend_from_slice(pages);
        }
    }

    /// The CLI's pagers notify swap-ins (NP-RDMA maps pages in at once) and
    /// fault around first touches.
    #[test]
    fn pagers_notify_swap_ins_and_fault_around() {
        let pager = pager_with(16 << 20, None).unwrap();
        let ins = std::sync::Arc::new(Ins::default());
        pager.add_listener(ins.clone());
        let ps = vmem::PAGE_SIZE;
        let mut r = pager.alloc(2 * FAULT_AROUND * ps).unwrap();
        r.as_mut_slice()[0] = 1;
        let s = pager.stats();
        assert_eq!((s.minor_faults, s.zero_fills), (1, FAULT_AROUND as u64 - 1));
        let t = std::time::Instant::now();
        while ins.0.lock().unwrap().len() < FAULT_AROUND && t.elapsed().as_secs() < 5 {
            std::thread::yield_now();
        }
        let want: Vec<usize> = (0..FAULT_AROUND).map(|i| r.addr() + i * ps).collect();
        assert_eq!(*ins.0.lock().unwrap(), want);
    }

    #[test]
    fn zero_reserve_is_capped_by_the_budget() {
        assert_eq!(zero_reserve_pages(None, None).unwrap(), 8192);
        assert_eq!(zero_reserve_pages(None, Some(1 << 20)).unwrap(), 8192);
        assert_eq!(zero_reserve_pages(None, Some(16 * 1024)).unwrap(), 1024);
        // Whole 2 MiB chunks: a budget under 32 MiB gets none.
        assert_eq!(zero_reserve_pages(None, Some(16 * 1000)).unwrap(), 512);
        assert_eq!(zero_reserve_pages(None, Some(16 * 100)).unwrap(), 0);
        assert_eq!(zero_reserve_pages(Some(" 0"), None).unwrap(), 0);
        assert_eq!(zero_reserve_pages(Some("4"), Some(1 << 20)).unwrap(), 1024);
        assert!(zero_reserve_pages(Some("x"), None).is_err());
    }

    #[test]
    fn swap_buffered_takes_0_or_1() {
        assert!(!swap_buffered(None).unwrap());
        assert!(!swap_buffered(Some(" 0 ")).unwrap());
        assert!(swap_buffered(Some("1")).unwrap());
        assert!(matches!(swap_buffered(Some("yes")), Err(CliError::Arg(_))));
    }
}
