//! The internal verbs interface the C ABI layer talks to, and the selection of the
//! implementation behind it (`NPRDMA_MODE`, `NPRDMA_DEVICE`). One device per process,
//! created lazily.
//!
//! The vocabulary (work requests, completions, QP attributes, access flags) is rnic's
//! verbs value types, which are numerically libibverbs'. A backend implements the
//! object traits below; `pinned` is standard RDMA on the software RNIC, `np` is NP-RDMA
//! (crate `nprdma`, configured by `np_env`) over the software RNIC or, with
//! `NPRDMA_DEVICE=verbs`, over the next libibverbs (`np_verbs`).

mod np;
pub mod np_env;
mod np_sgl;
mod np_ud;
mod np_verbs;
mod pinned;
pub use pinned::pinned_pages;
pub use pinned::{PINNED_MAX_CQE, PINNED_MAX_SGE};

use crate::error::ShimError;
use rnic::{
    Access, DeviceAttr, PostError, QpAttr, QpAttrMask, QpInitAttr, QpType, RecvWr, SendWr, Wc,
};
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::{Arc, OnceLock};

/// `Result` with the shim's error.
pub type Result<T> = std::result::Result<T, ShimError>;

/// The process's device (one NIC).
pub trait Device: Send + Sync {
    /// Backend name for messages ("pinned").
    fn mode(&self) -> &'static str;
    /// `ibv_query_device` attributes.
    fn attr(&self) -> DeviceAttr;
    /// GID index 0: the 16-byte address peers connect to.
    fn gid(&self) -> [u8; 16];
    /// The port's LID in the host's subnet (`rnic::subnet`); 0: none (peers are
    /// addressed by GID 0 only).
    fn lid(&self) -> u16 {
        0
    }
    /// The address of the host with GID `remote` across the network (RoCEv2),
    /// reached from our GID `local`.
    fn wire_peer(&self, _local: [u8; 16], _remote: [u8; 16]) -> Result<rnic::HostAddr> {
        Err(ShimError::Unsupported(format!(
            "peers across the network in {} mode",
            self.mode()
        )))
    }
    /// A protection domain.
    fn alloc_pd(&self) -> Result<Arc<dyn Pd>>;
    /// A CQ; with `events` it can signal completion events (see [`Cq::event_fd`]).
    fn create_cq(&self, depth: u32, events: bool) -> Result<Box<dyn Cq>>;
    /// Whether MRs may be registered on demand (`IBV_ACCESS_ON_DEMAND`, RC ODP caps,
    /// `ibv_advise_mr`): NP-RDMA mode, whose MRs are never pinned anyway.
    fn odp(&self) -> bool {
        false
    }
    /// Whether PDs create shared receive queues ([`Pd::create_srq`]): the WQEs one
    /// may hold and the SGEs each may have, or `None`.
    fn srq_limits(&self) -> Option<(u32, u32)> {
        None
    }
    /// The work requests a queue of a QP of `qp_type` may hold: `ibv_query_device`'s
    /// `max_qp_wr` unless the backend grants a type more.
    fn max_qp_wr_of(&self, _qp_type: QpType) -> u32 {
        self.attr().max_qp_wr
    }
    /// Whether PDs create address handles ([`Pd::create_ah`]) for UD QPs.
    fn address_handles(&self) -> bool {
        false
    }
    /// One line of counters for `NPRDMA_STATS=1` (printed at process exit).
    fn stats(&self) -> String {
        format!("mode={}", self.mode())
    }
}

/// The RoCEv2 transport's counters as `key=value` pairs of the stats line.
pub(crate) fn roce_stats(w: &rnic::WireStats) -> String {
    format!(
        " roce_tx_packets={} roce_rx_packets={} roce_retransmissions={} roce_timeouts={} \
         roce_naks_sent={} roce_naks_received={} roce_duplicates={} roce_bad_packets={} \
         roce_stray_packets={} roce_out_of_sequence={}",
        w.tx_packets,
        w.rx_packets,
        w.retransmissions,
        w.timeouts,
        w.naks_sent,
        w.naks_received,
        w.duplicates,
        w.bad_packets,
        w.stray_packets,
        w.out_of_sequence
    )
}

/// `x` (a backend object's `as_any`) as this backend's `T`; an object of another
/// backend (`what` names it) is an invalid argument.
pub(crate) fn ours<'a, T: 'static>(x: &'a dyn Any, what: &str) -> Result<&'a T> {
    x.downcast_ref::<T>()
        .ok_or_else(|| ShimError::InvalidArgument(format!("{what} of another backend")))
}

/// A protection domain.
pub trait Pd: Send + Sync {
    /// For downcasting to the backend's own PD.
    fn as_any(&self) -> &dyn Any;
    /// Register `[addr, addr+len)` (addresses used as the MR's IOVA).
    ///
    /// # Safety
    /// The memory must stay mapped until the returned MR is dropped.
    unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Box<dyn Mr>>;
    /// `ibv_advise_mr` prefetch of `sges` (registered MRs of this PD): with `fault`,
    /// bring their pages in now; without, nothing to do.
    fn advise(&self, _sges: &[rnic::Sge], _fault: bool) -> Result<()> {
        Err(ShimError::Unsupported("ibv_advise_mr (no ODP)".into()))
    }
    /// An RC QP completing on `send_cq` / `recv_cq` (CQs of this device).
    fn create_qp(
        &self,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        self.create_qp_of(QpType::Rc, send_cq, recv_cq, None, attr)
    }
    /// A QP of `qp_type` (RC, UC, or UD where the backend offers it) completing on `send_cq` / `recv_cq`,
    /// taking its receives from `srq` (an SRQ of this PD's device) if given.
    fn create_qp_of(
        &self,
        qp_type: QpType,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        srq: Option<&dyn Srq>,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>>;
    /// An address handle for the host whose GID is `gid` (UD destinations):
    /// refused (EINVAL) for a GID no device of this backend can reach.
    fn create_ah(&self, _gid: [u8; 16]) -> Result<Box<dyn Ah>> {
        Err(ShimError::Unsupported(
            "address handles (UD QPs) in this mode (NPRDMA_MODE=pinned has them)".into(),
        ))
    }
    /// A shared receive queue of `max_wr` WQEs of up to `max_sge` SGEs.
    fn create_srq(&self, _max_wr: u32, _max_sge: u32) -> Result<Box<dyn Srq>> {
        Err(ShimError::Unsupported("shared receive queues (SRQ)".into()))
    }
}

/// An address handle: a resolved UD destination host.
pub trait Ah: Send + Sync {
    /// The destination host (its GID).
    fn dest(&self) -> rnic::HostAddr;
}

/// A shared receive queue.
pub trait Srq: Send + Sync {
    /// For downcasting to the backend's own SRQ.
    fn as_any(&self) -> &dyn Any;
    /// `ibv_post_srq_recv`.
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError>;
    /// Capacity in WQEs.
    fn max_wr(&self) -> u32;
    /// SGEs per WQE.
    fn max_sge(&self) -> u32;
}

/// A registered memory region; dropping it deregisters.
pub trait Mr: Send + Sync {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// `ibv_rereg_mr`: move the MR to `pd`, to `[addr, addr+len)` (`range`), to
    /// `access` — each if given — keeping its keys; nothing changes on error.
    ///
    /// # Safety
    /// A new range must stay mapped while registered.
    unsafe fn rereg(
        &self,
        _pd: Option<&dyn Pd>,
        _range: Option<(usize, usize)>,
        _access: Option<Access>,
    ) -> Result<()> {
        Err(ShimError::Unsupported(
            "MR re-registration (ibv_rereg_mr)".into(),
        ))
    }
}

/// A completion queue.
pub trait Cq: Send + Sync {
    /// For downcasting to the backend's own CQ.
    fn as_any(&self) -> &dyn Any;
    /// Non-blocking poll; `Err` once the CQ overflowed.
    fn poll(&self, out: &mut [Wc]) -> Result<usize>;
    /// Arm the CQ for one completion event.
    fn req_notify(&self, solicited_only: bool) -> Result<()>;
    /// A non-blocking fd that becomes readable when an event may be pending.
    fn event_fd(&self) -> Option<RawFd>;
    /// Consume this CQ's pending completion event, if any (clears `event_fd`'s
    /// readiness first; the fd is the CQ's own).
    fn take_event(&self) -> bool;
    /// `ibv_resize_cq` to `cqe` entries (1..=max_cqe, checked by the caller),
    /// keeping the completions it holds; refused (EINVAL) below their count.
    fn resize(&self, cqe: u32) -> Result<()>;
}

/// An RC queue pair.
pub trait Qp: Send + Sync {
    /// QP number.
    fn qpn(&self) -> u32;
    /// The capacities the QP was created with.
    fn cap(&self) -> QpInitAttr;
    /// `ibv_modify_qp`.
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()>;
    /// `ibv_query_qp`.
    fn query(&self) -> QpAttr;
    /// `ibv_post_send`.
    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError>;
    /// `ibv_post_recv`.
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError>;
}

/// Backend selected by `NPRDMA_MODE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Standard RDMA on the software RNIC (`reg_mr` registers and pins normally).
    Pinned,
    /// NP-RDMA: `reg_mr` registers with a process-wide pager, nothing is pinned.
    NpRdma,
}

impl Mode {
    /// The backend's name ([`Device::mode`]) on the software RNIC.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Pinned => "pinned",
            Mode::NpRdma => "nprdma",
        }
    }

    /// Parse `NPRDMA_MODE` (unset or empty = pinned).
    pub fn from_env_value(v: Option<&str>) -> Result<Mode> {
        match v.map(str::trim) {
            None | Some("") | Some("pinned") => Ok(Mode::Pinned),
            Some("nprdma") | Some("np") | Some("np-rdma") => Ok(Mode::NpRdma),
            Some(other) => Err(ShimError::InvalidArgument(format!(
                "NPRDMA_MODE={other:?} is not a known mode (known: pinned, nprdma)"
            ))),
        }
    }
}

/// The device NP-RDMA mode runs on (`NPRDMA_DEVICE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NpDevice {
    /// This process's software RNIC (the default): the engine's kernel-module mode.
    Soft,
    /// The next libibverbs in the process (`NPRDMA_VERBS_LIB`, default
    /// `libibverbs.so.1`): the paper's user-space mode, on any RDMA device.
    Verbs,
}

impl NpDevice {
    /// Parse `NPRDMA_DEVICE` (unset or empty = the software RNIC).
    pub fn from_env_value(v: Option<&str>) -> Result<NpDevice> {
        match v.map(str::trim) {
            None | Some("") | Some("soft") | Some("rnic") => Ok(NpDevice::Soft),
            Some("verbs") | Some("ibverbs") => Ok(NpDevice::Verbs),
            Some(other) => Err(ShimError::InvalidArgument(format!(
                "NPRDMA_DEVICE={other:?} is not a known device (known: soft, verbs)"
            ))),
        }
    }
}

/// The mode an enclosing libnprdma.so set for this instance, which it loaded as its
/// libibverbs ([`nprdma_shim_as_device`]): it overrides `NPRDMA_MODE` and
/// `NPRDMA_DEVICE`, which are the enclosing instance's (one process environment).
static AS_DEVICE: OnceLock<Mode> = OnceLock::new();

/// Make this instance of libnprdma.so the device of another one: called through
/// `dlsym` by an instance in NP-RDMA mode with `NPRDMA_DEVICE=verbs` that loaded this
/// one (a second copy of the library, `NPRDMA_VERBS_LIB`) as the next libibverbs,
/// before its first verb. `mode` is `"pinned"` (also NULL: the software NIC with
/// standard RDMA) or `"nprdma"` (NP-RDMA over the software NIC); this instance then
/// ignores `NPRDMA_MODE` and `NPRDMA_DEVICE` (which configure the caller), so it never
/// loads a further library itself. Returns 0, or -1 for an unknown mode, a mode
/// asking for another library, or a device that already exists in another mode.
///
/// # Safety
/// `mode` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn nprdma_shim_as_device(mode: *const std::ffi::c_char) -> std::ffi::c_int {
    let m = if mode.is_null() {
        Some(Mode::Pinned)
    } else {
        // SAFETY: a NUL-terminated string (the caller's contract).
        let s = unsafe { std::ffi::CStr::from_ptr(mode) };
        s.to_str()
            .ok()
            .and_then(|s| Mode::from_env_value(Some(s)).ok())
    };
    let Some(m) = m else { return -1 };
    if *AS_DEVICE.get_or_init(|| m) != m {
        return -1;
    }
    match DEVICE.get() {
        Some(Ok(d)) if d.mode() != m.name() => -1,
        _ => 0,
    }
}

/// Default `ring_max` of the shim's NIC between trusting processes
/// (`NPRDMA_TRUSTED_PEERS=1`): 8 bytes, the least that still carries atomics (rnic
/// refuses ring requests longer than `ring_max`, atomics included). Larger READ/WRITE
/// are then copied by the initiator itself, so no NIC thread has to spin while both
/// applications spin (ib_write_lat: 2 processes x (app + NIC thread) spinning on 2
/// cores gave ~3 ms latencies with rnic's 4 KiB default). With target-enforced
/// protection (the default) every request is served by the target's NIC thread, in
/// parts of rnic's default slot size.
pub const DEFAULT_RING_MAX: u32 = 8;
/// Default NIC-thread spin window: 0 (it sleeps right after serving; see above).
/// `NPRDMA_NIC_SPIN_US=100` (rnic's window, under its rule: only once no
/// application thread of the process polled a CQ for 1 ms) serves a passive
/// target (ib_read_lat's server) without a wake-up per request: 8 KiB READs at
/// 1.1–1.4 µs against 3–15 µs over 10 000 iterations. It is not the default:
/// over ib_read_lat's default 1 000 iterations it gave 49 µs against 6–8 µs on
/// this 2-core VM (the spinning target shared a core with the spinning
/// initiator; BENCHMARKS.md, session 16). In NP-RDMA mode the engine's polling
/// thread is the spinner (and `NPRDMA_RING_TAKEOVER=1` the matching opt-in).
pub const DEFAULT_NIC_SPIN_US: u64 = 0;

/// Whether `NPRDMA_TRUSTED_PEERS=1` (the labelled opt-in: peers copy into this
/// process themselves, see `rnic::HostConfig::trusted_peers`).
pub fn trusted_peers_from_env() -> Result<bool> {
    Ok(env_num("NPRDMA_TRUSTED_PEERS")?.is_some_and(|v| v != 0))
}

fn env_num(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| ShimError::InvalidArgument(format!("{name}={v:?} is not a number"))),
    }
}

/// Post `wrs` in order with `post`: the first that fails stops the list and is
/// reported by its index, as `ibv_post_send`'s `bad_wr`.
pub fn post_each<W>(
    wrs: &[W],
    mut post: impl FnMut(&W) -> std::result::Result<(), rnic::Error>,
) -> std::result::Result<(), PostError> {
    for (i, w) in wrs.iter().enumerate() {
        post(w).map_err(|err| PostError {
            bad_wr_index: i,
            err,
        })?;
    }
    Ok(())
}

/// The NIC configuration: rnic defaults, tunable through the environment:
/// `NPRDMA_TRUSTED_PEERS=1` (the labelled opt-in to the direct path between trusting
/// processes; default: target-enforced protection), `NPRDMA_RING_MAX` (bytes; the
/// request-ring slot size: with trusted peers READ/WRITE up to this size are served by
/// the target's NIC thread, larger ones copied by the initiator itself; otherwise every
/// payload travels in parts of this size, at least 4096), `NPRDMA_NIC_SPIN_US` (how long
/// an idle NIC thread spins before sleeping), `NPRDMA_DMA_HELP` (0 = large transfers
/// are not shared with the target's NIC thread).
pub fn host_config_from_env() -> Result<rnic::HostConfig> {
    let trusted_peers = trusted_peers_from_env()?;
    let mut c = rnic::HostConfig {
        trusted_peers,
        nic_spin: std::time::Duration::from_micros(DEFAULT_NIC_SPIN_US),
        // The port takes a LID of the host's subnet and answers to the host's IPs.
        subnet: Some(rnic::subnet::default_path()),
        gids: crate::netif::host_gids().to_vec(),
        ..Default::default()
    };
    if trusted_peers {
        c.ring_max = DEFAULT_RING_MAX;
    }
    if let Some(v) = env_num("NPRDMA_RING_MAX")? {
        c.ring_max = u32::try_from(v)
            .map_err(|_| ShimError::InvalidArgument("NPRDMA_RING_MAX too large".into()))?;
    }
    if let Some(v) = env_num("NPRDMA_NIC_SPIN_US")? {
        c.nic_spin = std::time::Duration::from_micros(v);
    }
    if let Some(v) = env_num("NPRDMA_DMA_HELP")? {
        c.dma_help = v != 0;
    }
    Ok(c)
}

/// The process's device (a forked child makes its own: `per_process`).
static DEVICE: crate::per_process::PerProcess<std::result::Result<Arc<dyn Device>, ShimError>> =
    crate::per_process::PerProcess::new();

/// `atexit` handler of `NPRDMA_STATS=1`: one `nprdma-stats: key=value ...` line on
/// stderr (not every application closes its device before exiting), written with
/// one `write` so that the lines of processes sharing the stream (a server and
/// its clients, a program and its children) never interleave.
extern "C" fn print_stats() {
    if let Some(Ok(d)) = DEVICE.get() {
        use std::io::Write;
        let line = format!("nprdma-stats: {}\n", d.stats());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// The process's device, created on first use from the environment.
pub fn device() -> Result<Arc<dyn Device>> {
    DEVICE
        .get_or_init(|| {
            // (An instance serving another as its device leaves the line to that one.)
            if AS_DEVICE.get().is_none()
                && std::env::var("NPRDMA_STATS").is_ok_and(|v| v.trim() == "1")
            {
                // SAFETY: registering a plain extern "C" fn that only reads a static. (A raw
                // libc call: no typed crate registers C exit handlers.)
                unsafe { libc::atexit(print_stats) };
            }
            // An instance serving another as its device takes the mode it was given
            // and the software NIC, whatever the (shared) environment says.
            let (mode, dev) = match AS_DEVICE.get() {
                Some(m) => (*m, NpDevice::Soft),
                None => (
                    Mode::from_env_value(std::env::var("NPRDMA_MODE").ok().as_deref())?,
                    NpDevice::from_env_value(std::env::var("NPRDMA_DEVICE").ok().as_deref())?,
                ),
            };
            match (mode, dev) {
                (Mode::Pinned, NpDevice::Soft) => {
                    Ok(Arc::new(pinned::PinnedDevice::new()?) as Arc<dyn Device>)
                }
                (Mode::Pinned, NpDevice::Verbs) => Err(ShimError::InvalidArgument(
                    "NPRDMA_DEVICE=verbs needs NPRDMA_MODE=nprdma (pinned mode over the \
                     next libibverbs is that library itself: do not preload libnprdma.so)"
                        .into(),
                )),
                (Mode::NpRdma, NpDevice::Soft) => {
                    Ok(Arc::new(np::NpDevice::<np::Soft>::new()?) as Arc<dyn Device>)
                }
                (Mode::NpRdma, NpDevice::Verbs) => {
                    Ok(Arc::new(np::NpDevice::<np_verbs::Verbs>::new()?) as Arc<dyn Device>)
                }
            }
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_parsing() {
        assert_eq!(Mode::from_env_value(None).unwrap(), Mode::Pinned);
        assert_eq!(
            Mode::from_env_value(Some(" pinned ")).unwrap(),
            Mode::Pinned
        );
        assert_eq!(Mode::from_env_value(Some("nprdma")).unwrap(), Mode::NpRdma);
        assert!(matches!(
            Mode::from_env_value(Some("bogus")),
            Err(ShimError::InvalidArgument(_))
        ));
    }

    #[test]
    fn device_parsing() {
        assert_eq!(NpDevice::from_env_value(None).unwrap(), NpDevice::Soft);
        assert_eq!(NpDevice::from_env_value(Some("")).unwrap(), NpDevice::Soft);
        assert_eq!(
            NpDevice::from_env_value(Some(" verbs")).unwrap(),
            NpDevice::Verbs
        );
        assert!(matches!(
            NpDevice::from_env_value(Some("mlx5_0")),
            Err(ShimError::InvalidArgument(_))
        ));
    }
}
