//! `NPRDMA_MODE=nprdma`: NP-RDMA (crate `nprdma`) over a NIC and a process-wide
//! `vmem` pager. `reg_mr` registers the application's buffer with the pager and the
//! NP-RDMA layer without pinning it; QPs connect at RTR from (GID, dest_qp_num); CQs
//! are the layer's user-space CQs (eventfd channel).
//!
//! The backend is generic over the device ([`NpFlavor`]), monomorphic per device as
//! the engine is: [`Soft`] (the default, `NPRDMA_DEVICE` unset or `soft`) is the
//! software RNIC of this process (the engine's kernel-module mode, with IOMMU
//! control); `np_verbs::Verbs` (`NPRDMA_DEVICE=verbs`) is the next libibverbs in
//! the process (the paper's user-space mode, with the control channel on the data
//! QP so the application's own exchange of the data QPN suffices).

use super::np_env;
use super::np_sgl::{self, LkeyTable, MrInfo, Sgl, NP_MAX_BOUNCE, NP_MAX_SGE};
use super::np_ud::{self, UdLinks, UdShared};
use super::{Ah, Cq, Device, Mr, Pd, Qp, Result};
use crate::error::ShimError;
use np::nic::Nic;
use parking_lot::Mutex;
use rnic::{
    Access, DeviceAttr, PostError, QpAttr, QpAttrMask, QpInitAttr, QpState, RecvWr, SendFlags,
    SendWr, Wc, WcFlags, WcOpcode, WcStatus, WrOpcode,
};
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::Arc;

/// Largest inline payload (staged per QP in registered memory; the layer's inline limit).
pub const MAX_INLINE: u32 = 1024;
/// Default NIC request-ring size in this mode between trusting processes: 0. NP-RDMA runs atomics on the target's
/// CPU (two-sided), so the ring is not needed for them, and without it every READ —
/// including the page-version READs around each WRITE — is copied by the initiator
/// itself instead of waking the target's NIC thread (ib_write_lat 2 B: ~30 µs -> ~6 µs).
pub const NP_DEFAULT_RING_MAX: u32 = 0;
/// Completions converted per layer poll.
const POLL_CHUNK: usize = 32;
/// QPs per process this mode advertises (`max_qp`) and grants.
pub const NP_MAX_QP: u32 = 256;
/// MRs per process this mode advertises (`max_mr`) and grants.
pub const NP_MAX_MR: u32 = 4096;
/// CQs per process this mode advertises (`max_cq`) and grants (each is the layer's
/// own, with an eventfd: no NIC CQ behind it; the software NIC's own count).
pub const NP_MAX_CQ: u32 = 256;
/// Deepest QP of the layer (`nprdma` refuses more).
const NP_MAX_DEPTH: u32 = np::engine::MAX_QP_DEPTH;

/// Bytes of application MRs the NIC's IOMMU page table and residency map cover in all
/// (what `ibv_query_device` advertises as `max_mr_size`, in one MR or many): 1 TiB.
const NP_MR_BYTES: u64 = 1 << 40;

/// The NIC resources behind the advertised limits: an application QP is two NIC QPs
/// (data + control), two NIC MRs (control ring, read-back scratch) and a staging MR;
/// an application MR (and a staging MR) is three NIC MRs (Read, Write and Version
/// views), one tracked frame range, two IOVA pages per page (the Read and Write views)
/// and one tracked page per page; two-sided operations add short-lived NIC MRs. The
/// page table (4 B per IOVA page) and the residency map (1 bit per page) are sparse
/// shared memory: only what registrations use is ever touched.
fn np_host_limits(c: &mut rnic::HostConfig) {
    let app_mrs = NP_MAX_MR + NP_MAX_QP + NP_MAX_BOUNCE;
    let pages = NP_MR_BYTES / vmem::PAGE_SIZE as u64;
    c.max_qp = c.max_qp.max(2 * NP_MAX_QP + 64);
    // CQs as deep as pinned mode's (libfabric's rxm asks for 262144 entries).
    c.max_cqe = c.max_cqe.max(super::PINNED_MAX_CQE);
    // A QP of full depth: 4 NIC WRs per WR, 16 spare, 64 command slots.
    c.max_wr = c.max_wr.max(4 * NP_MAX_DEPTH + 16 + 64);
    // (Plus a UD view per application MR, `np_ud`.)
    c.max_mr = c.max_mr.max(4 * app_mrs + 2 * NP_MAX_QP + 4096);
    // A UD QP has a NIC CQ per direction (`np_ud`).
    c.max_cq = c.max_cq.max(256 + 2 * NP_MAX_QP);
    c.max_tracked_ranges = c.max_tracked_ranges.max(app_mrs + 64);
    c.iova_pages = c.iova_pages.max(2 * pages + (1 << 20));
    c.max_tracked_pages = c.max_tracked_pages.max(pages + (1 << 20));
}

/// A QP's SGE and inline requests within this mode's limits (RC, UC and UD alike).
fn check_sges_and_inline(attr: &QpInitAttr) -> Result<()> {
    if attr.max_send_sge > NP_MAX_SGE || attr.max_recv_sge > NP_MAX_SGE {
        return Err(ShimError::InvalidArgument(format!(
            "{} send / {} recv SGEs (max_sge {NP_MAX_SGE})",
            attr.max_send_sge, attr.max_recv_sge
        )));
    }
    if attr.max_inline_data > MAX_INLINE {
        return Err(ShimError::InvalidArgument(format!(
            "max_inline_data {} > {MAX_INLINE}",
            attr.max_inline_data
        )));
    }
    Ok(())
}

/// A counted share of an advertised per-process limit; released on drop.
struct Quota {
    used: Arc<std::sync::atomic::AtomicU32>,
}

impl Quota {
    fn take(
        used: &Arc<std::sync::atomic::AtomicU32>,
        max: u32,
        what: &'static str,
    ) -> Result<Quota> {
        use std::sync::atomic::Ordering;
        used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .map_err(|_| ShimError::Nic(rnic::Error::NoResources(what)))?;
        Ok(Quota { used: used.clone() })
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        self.used.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A device NP-RDMA mode runs on: how to open it and what the shim reports of it
/// beyond the engine's NIC seam.
pub trait NpFlavor: Send + Sync + Sized + 'static {
    /// The engine's NIC backend.
    type Nic: np::engine::Backend;
    /// Backend name for messages and the stats line.
    const MODE: &'static str;
    /// Whether each QP's control channel rides on its data QP
    /// (`np::Config::ctrl_on_data_qp`): the peer then needs only the data QPN.
    const CTRL_ON_DATA_QP: bool;
    /// Open the device: the flavor's own state and one NIC PD for the engine.
    fn open() -> Result<(Self, Self::Nic)>;
    /// Adjust the engine configuration read from the environment (`explicit_cache`:
    /// `NPRDMA_REG_CACHE_MB` was given).
    fn tune(_cfg: &mut np::Config, _explicit_cache: bool) {}
    /// The device's attributes, before NP-RDMA's own limits are applied.
    fn device_attr(&self) -> DeviceAttr;
    /// GID index 0: this host's address for peers.
    fn gid(&self) -> [u8; 16];
    /// The port's LID (0: none).
    fn lid(&self) -> u16 {
        0
    }
    /// The NIC's counters for the stats line (`key=value` pairs).
    fn nic_stats(&self, s: &<Self::Nic as Nic>::Stats) -> String;
    /// The software NIC UD QPs are made on (`np_ud`), if the device is one.
    fn ud_host(&self) -> Option<&rnic::Host> {
        None
    }
}

/// The software RNIC of this process (the default device).
pub struct Soft {
    host: rnic::Host,
}

impl NpFlavor for Soft {
    type Nic = np::engine::DefaultNic;
    const MODE: &'static str = "nprdma";
    const CTRL_ON_DATA_QP: bool = false;
    fn open() -> Result<(Soft, np::engine::DefaultNic)> {
        let mut hcfg = super::host_config_from_env()?;
        if std::env::var_os("NPRDMA_RING_MAX").is_none() && hcfg.trusted_peers {
            hcfg.ring_max = NP_DEFAULT_RING_MAX;
        }
        np_host_limits(&mut hcfg);
        let host = rnic::Host::new(hcfg)?;
        let nic = np::adapt::RnicNic::open(&host)?;
        Ok((Soft { host }, nic))
    }
    fn device_attr(&self) -> DeviceAttr {
        self.host.query_device()
    }
    fn gid(&self) -> [u8; 16] {
        self.host.addr().to_bytes()
    }
    fn lid(&self) -> u16 {
        self.host.lid()
    }
    fn ud_host(&self) -> Option<&rnic::Host> {
        Some(&self.host)
    }
    fn nic_stats(&self, n: &np::engine::NicStats) -> String {
        format!(
            "nonresident_dma={} flush_stalls={} flush_timeouts={}",
            n.nonresident_dma, n.flush_stalls, n.flush_timeouts
        )
    }
}

pub struct NpDevice<F: NpFlavor> {
    flavor: F,
    pager: vmem::Pager,
    ctx: np::Context<F::Nic>,
    /// Application QPs, MRs and CQs alive (bounded by [`NP_MAX_QP`] / [`NP_MAX_MR`]
    /// / [`NP_MAX_CQ`]).
    qps: Arc<std::sync::atomic::AtomicU32>,
    mrs: Arc<std::sync::atomic::AtomicU32>,
    cqs: Arc<std::sync::atomic::AtomicU32>,
    /// Scatter/gather support (`np_sgl`): registered MRs, mapped QPs, bounce count.
    sg: SgShared<F::Nic>,
    /// UD QPs and address handles (`np_ud`), on a software NIC.
    ud: Option<Arc<UdShared>>,
    /// The munmap wrapper waits for this device's pager (`crate::unmap`).
    _following: crate::unmap::Following,
}

/// What the device's PDs, QPs and CQs share for scatter/gather lists.
struct SgShared<N: np::engine::Backend> {
    lkeys: Arc<LkeyTable>,
    mapped: np_sgl::Registry<N>,
    bounces: Arc<std::sync::atomic::AtomicU32>,
}

impl<N: np::engine::Backend> Clone for SgShared<N> {
    fn clone(&self) -> Self {
        SgShared {
            lkeys: self.lkeys.clone(),
            mapped: self.mapped.clone(),
            bounces: self.bounces.clone(),
        }
    }
}

impl<N: np::engine::Backend> Default for SgShared<N> {
    fn default() -> Self {
        SgShared {
            lkeys: Default::default(),
            mapped: Default::default(),
            bounces: Default::default(),
        }
    }
}

impl<F: NpFlavor> NpDevice<F> {
    pub fn new() -> Result<NpDevice<F>> {
        let env = np_env::from_process_env;
        let pcfg = np_env::pager_config(&env)?;
        let mut ecfg = np_env::engine_config(&env)?;
        ecfg.ctrl_on_data_qp = F::CTRL_ON_DATA_QP;
        F::tune(&mut ecfg, env("NPRDMA_REG_CACHE_MB").is_some());
        let (flavor, nic) = F::open()?;
        let pager = vmem::Pager::new(pcfg)
            .map_err(|e| ShimError::Nic(rnic::Error::Io(format!("starting the pager: {e}"))))?;
        let ctx = np::Context::with_nic(nic, &pager, ecfg).map_err(np_err)?;
        tracing::info!(budget = ?pager.budget(), mode = F::MODE, "NP-RDMA backend up");
        let sg = SgShared::default();
        let ud = flavor
            .ud_host()
            .map(|h| {
                let engine = ctx.clone();
                let pin: super::np_ud::Pinner = Box::new(move |lkey, addr, len, write| {
                    let p = engine.pin_for_nic(lkey, addr, len, write)?;
                    Ok(Box::new(p) as Box<dyn Send + Sync>)
                });
                UdShared::new(h, &pager, pin, sg.lkeys.clone())
            })
            .transpose()?;
        Ok(NpDevice {
            _following: crate::unmap::follow(&pager),
            flavor,
            pager,
            ctx,
            qps: Default::default(),
            mrs: Default::default(),
            cqs: Default::default(),
            sg,
            ud,
        })
    }
}

/// An engine setup/verbs error as a shim error.
fn np_err(e: np::Error) -> ShimError {
    match e {
        np::Error::Nic(e) => ShimError::Nic(e),
        np::Error::Pager(e) => ShimError::InvalidArgument(format!("pager: {e}")),
        np::Error::Invalid(s) => ShimError::InvalidArgument(s.into()),
        other => ShimError::Nic(post_err(other, QpState::Rts)),
    }
}

/// A post-time engine error as the rnic error the C layer maps to an errno.
fn post_err(e: np::Error, state: QpState) -> rnic::Error {
    match e {
        np::Error::Nic(e) => e,
        np::Error::Invalid(s) => rnic::Error::InvalidArgument(s),
        np::Error::QueueFull => rnic::Error::QueueFull("NP-RDMA queue"),
        np::Error::QpState => rnic::Error::WrongQpState(state),
        np::Error::Pager(e) => rnic::Error::Io(format!("pager: {e}")),
        np::Error::Other(s) => rnic::Error::Io(s),
    }
}

impl<F: NpFlavor> Device for NpDevice<F> {
    fn mode(&self) -> &'static str {
        F::MODE
    }
    fn attr(&self) -> DeviceAttr {
        let mut a = self.flavor.device_attr();
        // An application WR becomes up to 4 NIC WRs on the data QP (plus 16 spare;
        // plus at least 64 command slots when the data QP carries the control
        // channel), and the layer's QPs are at most NP_MAX_DEPTH deep; SGE lists go
        // through bounce buffers (`np_sgl`).
        let spare = if F::CTRL_ON_DATA_QP { 16 + 64 } else { 16 };
        a.max_qp_wr = (a.max_qp_wr.saturating_sub(spare) / 4).min(NP_MAX_DEPTH);
        a.max_sge = NP_MAX_SGE;
        a.max_inline_data = MAX_INLINE;
        a.max_qp = NP_MAX_QP;
        a.max_mr = NP_MAX_MR;
        a.max_cq = NP_MAX_CQ;
        a
    }
    fn gid(&self) -> [u8; 16] {
        self.flavor.gid()
    }
    fn lid(&self) -> u16 {
        self.flavor.lid()
    }
    fn wire_peer(&self, local: [u8; 16], remote: [u8; 16]) -> Result<rnic::HostAddr> {
        match self.flavor.ud_host() {
            Some(h) => Ok(h.wire_peer(local, remote)?),
            None => Err(ShimError::Unsupported(
                "peers across the network over this device (the software NIC's RoCEv2 only)".into(),
            )),
        }
    }
    fn max_qp_wr_of(&self, qp_type: rnic::QpType) -> u32 {
        match (&self.ud, qp_type) {
            (Some(_), rnic::QpType::Ud) => np_ud::NP_UD_MAX_WR,
            _ => self.attr().max_qp_wr,
        }
    }
    fn address_handles(&self) -> bool {
        self.ud.is_some()
    }
    fn alloc_pd(&self) -> Result<Arc<dyn Pd>> {
        Ok(Arc::new(NpPd::<F::Nic> {
            ud: self.ud.clone(),
            ctrl_on_data_qp: F::CTRL_ON_DATA_QP,
            pd: self.ctx.alloc_pd(),
            max_wr: self.attr().max_qp_wr,
            qps: self.qps.clone(),
            mrs: self.mrs.clone(),
            id: NEXT_PD_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sg: self.sg.clone(),
        }))
    }
    fn create_cq(&self, depth: u32, events: bool) -> Result<Box<dyn Cq>> {
        let quota = Quota::take(&self.cqs, NP_MAX_CQ, "CQs (max_cq)")?;
        let cq = self.ctx.create_cq(depth).map_err(np_err)?;
        Ok(Box::new(NpCq::<F::Nic> {
            cq,
            events,
            depth,
            ud: Default::default(),
            mapped: self.sg.mapped.clone(),
            _quota: quota,
        }))
    }
    fn srq_limits(&self) -> Option<(u32, u32)> {
        // The engine keeps an SRQ's receives in memory (no NIC WQEs); the SGE-list
        // bounce tables are per QP, so an SRQ's receive carries one SGE.
        Some((NP_MAX_SRQ_WR, 1))
    }
    fn odp(&self) -> bool {
        true
    }
    fn stats(&self) -> String {
        let p = self.pager.stats();
        let e = self.ctx.stats();
        let n = self.ctx.nic_stats();
        format!(
            "mode={} budget_pages={} budget_slack={} resident_pages={} \
             kernel_resident_pages={} resident_high={} engine_pinned_high={} budget_waits={} \
             budget_overruns={} \
             registered_pages={} swap_outs={} \
             swap_ins={} swap_full={} swap_write_failures={} evict_vetoes={} remap_refusals={} \
             major_faults={} optimistic_ok={} versions_seen={} \
             two_sided={} local_fixups={} served={} reg_cache_hits={} reg_cache_misses={} \
             leased_ops={} leases_granted={} leases_renewed={} ud_pinned_pages={} {}",
            F::MODE,
            p.budget_pages.map_or("none".to_string(), |b| b.to_string()),
            p.budget_slack,
            p.resident_pages,
            self.pager.kernel_resident_pages(),
            p.resident_high,
            np::engine::pinned_pages().1,
            p.budget_waits,
            p.budget_overruns,
            p.registered_pages,
            p.swap_outs,
            p.swap_ins,
            p.swap_full,
            p.swap_write_failures,
            p.evict_vetoes,
            np::shadow::remap_refusals(),
            p.major_faults,
            e.optimistic_ok,
            e.versions_seen,
            e.two_sided,
            e.local_fixups,
            e.served,
            e.reg_cache_hits,
            e.reg_cache_misses,
            e.leased_ops,
            e.leases_granted,
            e.leases_renewed,
            self.ud.as_ref().map_or(0, |u| u.pinned_pages()),
            self.flavor.nic_stats(&n)
        ) + &self
            .flavor
            .ud_host()
            .and_then(|h| h.wire_stats())
            .map_or(String::new(), |w| super::roce_stats(&w))
    }
}

static NEXT_PD_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

struct NpPd<N: np::engine::Backend> {
    pd: np::Pd<N>,
    /// Connect with the peer's control channel on its data QP
    /// ([`NpFlavor::CTRL_ON_DATA_QP`]).
    ctrl_on_data_qp: bool,
    max_wr: u32,
    qps: Arc<std::sync::atomic::AtomicU32>,
    mrs: Arc<std::sync::atomic::AtomicU32>,
    /// Identifies the PD in [`LkeyTable`].
    id: u64,
    sg: SgShared<N>,
    ud: Option<Arc<UdShared>>,
}

/// Receives an NP-RDMA SRQ may hold.
const NP_MAX_SRQ_WR: u32 = 16384;

/// A shared receive queue of the NP-RDMA engine.
struct NpSrq<N: np::engine::Backend>(np::Srq<N>);

impl<N: np::engine::Backend> super::Srq for NpSrq<N> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        super::post_each(wrs, |w| {
            one_sge(w.sg_list).and_then(|sge| {
                self.0
                    .post_recv(&[np::RecvWr {
                        wr_id: w.wr_id,
                        sge,
                    }])
                    .map_err(|(_, e)| post_err(e, QpState::Rts))
            })
        })
    }
    fn max_wr(&self) -> u32 {
        self.0.depth()
    }
    fn max_sge(&self) -> u32 {
        1
    }
}

impl<N: np::engine::Backend> Pd for NpPd<N> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Box<dyn Mr>> {
        let quota = Quota::take(&self.mrs, NP_MAX_MR, "MRs (max_mr)")?;
        // SAFETY: forwarded contract: the application keeps [addr, addr+len) mapped while
        // registered (ibv_reg_mr's contract); the pager may swap its pages meanwhile.
        let mr = unsafe {
            self.pd
                .reg_mr(addr as u64, len as u64, np::Access(access.bits()))
                .map_err(np_err)?
        };
        let st = NpMrState {
            mr,
            pd: self.pd.clone(),
            pd_id: self.id,
            addr: addr as u64,
            len: len as u64,
            access,
        };
        self.sg.lkeys.insert(st.mr.lkey(), st.info());
        Ok(Box::new(NpMr::<N> {
            st: Mutex::new(st),
            lkeys: self.sg.lkeys.clone(),
            ud: self.ud.clone(),
            _quota: quota,
        }))
    }
    fn advise(&self, sges: &[rnic::Sge], fault: bool) -> Result<()> {
        for s in sges {
            if !self.sg.lkeys.covers(self.id, s, false) {
                return Err(ShimError::InvalidArgument(format!(
                    "SGE {:#x}+{} lkey {:#x} is not inside an MR of this PD",
                    s.addr, s.length, s.lkey
                )));
            }
        }
        if fault {
            let page = vmem::PAGE_SIZE as u64;
            for s in sges.iter().filter(|s| s.length > 0) {
                let end = s.addr + u64::from(s.length);
                let mut a = s.addr;
                while a < end {
                    // SAFETY: inside a registered MR (checked above), mapped while
                    // registered; a read brings the page in through the pager.
                    unsafe { std::ptr::read_volatile(a as *const u8) };
                    a = (a / page + 1) * page;
                }
            }
        }
        Ok(())
    }
    fn create_ah(&self, gid: [u8; 16]) -> Result<Box<dyn Ah>> {
        match &self.ud {
            Some(u) => u.create_ah(gid),
            None => Err(ShimError::Unsupported(
                "address handles (UD QPs) in NP-RDMA mode over NPRDMA_DEVICE=verbs".into(),
            )),
        }
    }
    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn super::Srq>> {
        // A receive an SRQ hands to any of its QPs carries its one SGE itself (the
        // SGE-list bounce tables are per QP).
        if max_sge > 1 {
            return Err(ShimError::InvalidArgument(format!(
                "SRQ max_sge {max_sge} (NP-RDMA SRQ receives carry one SGE)"
            )));
        }
        let srq = self.pd.create_srq(max_wr).map_err(np_err)?;
        Ok(Box::new(NpSrq(srq)))
    }
    fn create_qp_of(
        &self,
        qp_type: rnic::QpType,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        srq: Option<&dyn super::Srq>,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        if qp_type == rnic::QpType::Ud {
            return self.create_ud_qp(send_cq, recv_cq, srq, attr);
        }
        let srq = srq
            .map(|s| super::ours::<NpSrq<N>>(s.as_any(), "SRQ").map(|p| &p.0))
            .transpose()?;
        check_sges_and_inline(attr)?;
        let depth = attr.max_send_wr.max(attr.max_recv_wr).max(1);
        if depth > self.max_wr {
            return Err(ShimError::InvalidArgument(format!(
                "QP depth {depth} > {} (NP-RDMA uses 3 NIC WRs per WR)",
                self.max_wr
            )));
        }
        let cq_of = |c: &dyn Cq| super::ours::<NpCq<N>>(c.as_any(), "CQ").map(|p| p.cq.clone());
        let (scq, rcq) = (cq_of(send_cq)?, cq_of(recv_cq)?);
        let quota = Quota::take(&self.qps, NP_MAX_QP, "QPs (max_qp)")?;
        let stage = Staging::new(&self.pd, depth)?;
        let qp = self.pd.create_qp(&scq, &rcq, depth).map_err(np_err)?;
        // A verbs QP grants no remote access until ibv_modify_qp sets its
        // qp_access_flags (the layer's QPs start with all three rights).
        qp.set_remote_access(np::Access(0)).map_err(np_err)?;
        if qp_type == rnic::QpType::Uc {
            qp.set_unreliable().map_err(np_err)?;
        }
        if let Some(s) = srq {
            qp.attach_srq(s).map_err(np_err)?;
        }
        let cap = QpInitAttr {
            qpn: None,
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: attr.max_send_sge.max(1),
            max_recv_sge: attr.max_recv_sge.max(1),
            max_inline_data: MAX_INLINE,
            sq_sig_all: attr.sq_sig_all,
        };
        // SGE lists: the QP's WRs go through the token tables (`np_sgl`).
        let sgl = (cap.max_send_sge > 1 || cap.max_recv_sge > 1).then(|| {
            let t = Arc::new(Mutex::new(Sgl::<N>::default()));
            self.sg.mapped.lock().insert(qp.qpn(), t.clone());
            t
        });
        let a = QpAttr {
            qp_state: QpState::Reset,
            cur_qp_state: QpState::Reset,
            ..Default::default()
        };
        Ok(Box::new(NpQp::<N> {
            ctrl_on_data_qp: self.ctrl_on_data_qp,
            qp_type,
            qp: Some(qp),
            cap,
            attr: Mutex::new(a),
            stage: Mutex::new(stage),
            sgl,
            pd: self.pd.clone(),
            pd_id: self.id,
            sg: self.sg.clone(),
            _quota: quota,
        }))
    }
}

impl<N: np::engine::Backend> NpPd<N> {
    /// A UD QP (`np_ud`): on a software NIC, without an SRQ.
    fn create_ud_qp(
        &self,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        srq: Option<&dyn super::Srq>,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        let Some(ud) = &self.ud else {
            return Err(ShimError::Unsupported(
                "UD QPs in NP-RDMA mode over NPRDMA_DEVICE=verbs".into(),
            ));
        };
        if srq.is_some() {
            return Err(ShimError::Unsupported(
                "UD QPs on an SRQ in NP-RDMA mode".into(),
            ));
        }
        check_sges_and_inline(attr)?;
        let s = super::ours::<NpCq<N>>(send_cq.as_any(), "CQ")?;
        let r = super::ours::<NpCq<N>>(recv_cq.as_any(), "CQ")?;
        let quota = Quota::take(&self.qps, NP_MAX_QP, "QPs (max_qp)")?;
        np_ud::create_qp(ud, self.id, s.app_cq(), r.app_cq(), attr, Box::new(quota))
    }
}

/// What `ibv_rereg_mr` may change of an NP-RDMA MR.
struct NpMrState<N: np::engine::Backend> {
    mr: np::Mr<N>,
    pd: np::Pd<N>,
    /// The PD's id in the [`LkeyTable`].
    pd_id: u64,
    addr: u64,
    len: u64,
    access: Access,
}

impl<N: np::engine::Backend> NpMrState<N> {
    fn info(&self) -> MrInfo {
        MrInfo {
            pd: self.pd_id,
            addr: self.addr,
            len: self.len,
            local_write: self.access.contains(Access::LOCAL_WRITE),
        }
    }
}

struct NpMr<N: np::engine::Backend> {
    st: Mutex<NpMrState<N>>,
    lkeys: Arc<LkeyTable>,
    /// UD QPs reach the MR through a view (`np_ud`), revoked with it.
    ud: Option<Arc<UdShared>>,
    _quota: Quota,
}

impl<N: np::engine::Backend> Drop for NpMr<N> {
    fn drop(&mut self) {
        let lkey = self.st.get_mut().mr.lkey();
        self.lkeys.remove(lkey);
        if let Some(u) = &self.ud {
            u.revoke(lkey);
        }
    }
}

impl<N: np::engine::Backend> Mr for NpMr<N> {
    fn lkey(&self) -> u32 {
        self.st.lock().mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.st.lock().mr.rkey()
    }
    /// A new PD or rights: the layer's MR changes in place (same keys, the
    /// NIC views first). A new range: a new registration (new keys, as
    /// `ibv_rereg_mr` allows) replaces the old one once it exists.
    unsafe fn rereg(
        &self,
        pd: Option<&dyn Pd>,
        range: Option<(usize, usize)>,
        access: Option<Access>,
    ) -> Result<()> {
        let new_pd = pd
            .map(|p| super::ours::<NpPd<N>>(p.as_any(), "PD"))
            .transpose()?;
        let mut st = self.st.lock();
        let old_lkey = st.mr.lkey();
        let acc = access.unwrap_or(st.access);
        if let Some((addr, len)) = range {
            let target = new_pd.map_or(&st.pd, |p| &p.pd);
            // SAFETY: forwarded contract: the application keeps the new range
            // mapped while registered.
            let mr = unsafe {
                target
                    .reg_mr(addr as u64, len as u64, np::Access(acc.bits()))
                    .map_err(np_err)?
            };
            self.lkeys.remove(st.mr.lkey());
            // The old registration goes (fenced) as it is replaced.
            st.mr = mr;
            st.addr = addr as u64;
            st.len = len as u64;
        } else {
            st.mr
                .rereg(
                    new_pd.map(|p| p.pd.id()),
                    access.map(|a| np::Access(a.bits())),
                )
                .map_err(np_err)?;
        }
        if let Some(p) = new_pd {
            st.pd = p.pd.clone();
            st.pd_id = p.id;
        }
        st.access = acc;
        self.lkeys.insert(st.mr.lkey(), st.info());
        if let Some(u) = &self.ud {
            // UD views of the old range or rights go (new ones are made on use).
            u.revoke(old_lkey);
        }
        Ok(())
    }
}

struct NpCq<N: np::engine::Backend> {
    cq: np::Cq<N>,
    events: bool,
    /// Its size (a UD QP's NIC CQs take it, `np_ud`).
    depth: u32,
    /// The UD QPs completing here (`np_ud`).
    ud: Arc<UdLinks>,
    /// QPs with SGE lists, whose completions are translated back (`np_sgl`).
    mapped: np_sgl::Registry<N>,
    /// Its count against [`NP_MAX_CQ`].
    _quota: Quota,
}

fn wc_from(c: &np::Completion) -> Wc {
    let (opcode, imm) = match c.op {
        np::CompOp::Send => (WcOpcode::Send, None),
        np::CompOp::Write => (WcOpcode::RdmaWrite, None),
        np::CompOp::Read => (WcOpcode::RdmaRead, None),
        np::CompOp::CmpSwap => (WcOpcode::CompSwap, None),
        np::CompOp::FetchAdd => (WcOpcode::FetchAdd, None),
        np::CompOp::Recv => (WcOpcode::Recv, c.imm),
        np::CompOp::RecvWithImm => (WcOpcode::RecvRdmaWithImm, c.imm),
    };
    Wc {
        wr_id: c.wr_id,
        status: WcStatus::from_u32(c.status),
        opcode,
        vendor_err: 0,
        byte_len: c.byte_len,
        imm_data: imm.unwrap_or(0),
        qp_num: c.qp_num,
        src_qp: 0,
        wc_flags: if imm.is_some() {
            WcFlags::WITH_IMM
        } else {
            WcFlags::empty()
        },
    }
}

impl<N: np::engine::Backend> NpCq<N> {
    /// The CQ as a UD QP completing into it sees it.
    fn app_cq(&self) -> np_ud::AppCq<'_> {
        let c = self.cq.clone();
        np_ud::AppCq {
            signal: Arc::new(move || {
                // SAFETY: the CQ's own eventfd, open while `c` (a handle of it) lives.
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.event_fd()) };
                let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
            }),
            links: &self.ud,
            events: self.events,
            depth: self.depth,
        }
    }
}

impl<N: np::engine::Backend> Cq for NpCq<N> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn resize(&self, cqe: u32) -> Result<()> {
        // The UD QPs' completions waiting count too (`np_ud`).
        let ud = u32::try_from(self.ud.drain()?).unwrap_or(u32::MAX);
        if ud > 0 {
            if ud > cqe {
                return Err(ShimError::InvalidArgument(
                    "fewer CQ entries than completions waiting".into(),
                ));
            }
            self.cq.resize((cqe - ud).max(1)).map_err(np_err)?;
        }
        self.cq.resize(cqe).map_err(np_err)
    }
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        let mut buf = [np::Completion::default(); POLL_CHUNK];
        let mut got = 0;
        while got < out.len() {
            let k = (out.len() - got).min(POLL_CHUNK);
            let m = self.cq.poll(&mut buf[..k]);
            for (o, c) in out[got..].iter_mut().zip(&buf[..m]) {
                *o = wc_from(c);
            }
            if m > 0 && !self.mapped.lock().is_empty() {
                for w in &mut out[got..got + m] {
                    np_sgl::translate(&self.mapped, w);
                }
            }
            got += m;
            if m < k {
                break;
            }
        }
        got += self.ud.poll(&mut out[got..])?;
        if got == 0 && self.cq.overflowed() {
            // Overrun: what the CQ held is polled first, then it is in the
            // error state, as the pinned NIC's (the QPs that completed into it
            // are in ERR).
            return Err(ShimError::Nic(rnic::Error::CqOverflow));
        }
        Ok(got)
    }
    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if solicited_only {
            self.cq.req_notify_solicited();
        } else {
            self.cq.req_notify();
        }
        self.ud.arm(solicited_only)
    }
    fn event_fd(&self) -> Option<RawFd> {
        self.events.then(|| self.cq.event_fd())
    }
    fn take_event(&self) -> bool {
        if !self.events {
            return false;
        }
        // SAFETY: the CQ's own non-blocking eventfd, open while the CQ lives.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.cq.event_fd()) };
        let took = rustix::io::read(fd, &mut [0u8; 8]) == Ok(8);
        if took {
            // The event is handed out: the CQ is disarmed for its UD QPs too.
            self.ud.disarm();
        }
        took
    }
}

/// Per-QP registered memory for inline payloads: `depth` slots of [`MAX_INLINE`]
/// bytes, slot `n % depth` for the n-th inline post. Inline WRs are posted with
/// `order_after` (nothing of the QP issues behind them until they finish), so while
/// inline WR X is unfinished every later WR stays outstanding too (the layer finishes
/// operations out of order otherwise). Reusing X's slot takes `depth - 1` later inline
/// posts plus the current one, so X unfinished means `outstanding() >= depth`, which
/// the post refuses (ENOMEM) before touching the slot: a payload never changes in
/// flight.
struct Staging<N: np::engine::Backend> {
    // Field order = drop order: the MR before the mapping it covers.
    mr: np::Mr<N>,
    map: vmem::AnonMapping,
    depth: u32,
    next: u64,
}

impl<N: np::engine::Backend> Staging<N> {
    fn new(pd: &np::Pd<N>, depth: u32) -> Result<Staging<N>> {
        let map = vmem::AnonMapping::new(depth as usize * MAX_INLINE as usize)
            .map_err(rnic::Error::from)?;
        // SAFETY: private anonymous memory that stays mapped until after the MR is
        // dropped (field order of `Staging`).
        let mr = unsafe {
            pd.reg_mr(map.addr() as u64, map.len() as u64, np::Access::LOCAL_WRITE)
                .map_err(np_err)?
        };
        Ok(Staging {
            mr,
            map,
            depth,
            next: 0,
        })
    }

    /// Copy `data` into the next slot; its SGE.
    fn stage(&mut self, data: &[u8]) -> np::Sge {
        let slot = (self.next % self.depth as u64) as usize * MAX_INLINE as usize;
        self.next += 1;
        debug_assert!(data.len() <= MAX_INLINE as usize);
        // SAFETY: slot + len <= depth * MAX_INLINE <= the mapping's length; the slot is
        // not in flight (see the type's docs); `data` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_ptr().add(slot), data.len())
        };
        self.mr.sge(slot as u64, data.len() as u32)
    }
}

struct NpQp<N: np::engine::Backend> {
    // Dropped first (flushes its WRs), then the staging MR and memory.
    qp: Option<np::Qp<N>>,
    cap: QpInitAttr,
    attr: Mutex<QpAttr>,
    stage: Mutex<Staging<N>>,
    /// Token tables when the QP takes SGE lists (`np_sgl`).
    sgl: Option<Arc<Mutex<Sgl<N>>>>,
    pd: np::Pd<N>,
    pd_id: u64,
    sg: SgShared<N>,
    /// The peer's control channel is on its data QP (`NpFlavor::CTRL_ON_DATA_QP`).
    ctrl_on_data_qp: bool,
    /// RC or UC (the attributes each transition takes).
    qp_type: rnic::QpType,
    _quota: Quota,
}

impl<N: np::engine::Backend> Drop for NpQp<N> {
    fn drop(&mut self) {
        let qpn = self.qp.as_ref().map(|q| q.qpn());
        drop(self.qp.take());
        if let (Some(t), Some(n)) = (&self.sgl, qpn) {
            let mut m = self.sg.mapped.lock();
            if m.get(&n).is_some_and(|x| Arc::ptr_eq(x, t)) {
                m.remove(&n);
            }
        }
    }
}

fn one_sge(sg: &[rnic::Sge]) -> std::result::Result<Option<np::Sge>, rnic::Error> {
    match sg {
        [] => Ok(None),
        [s] => Ok(Some(np::Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })),
        _ => Err(rnic::Error::InvalidArgument(
            "NP-RDMA work requests carry one SGE",
        )),
    }
}

fn app_op(o: WrOpcode) -> np::Opcode {
    match o {
        WrOpcode::Write => np::Opcode::Write,
        WrOpcode::WriteImm(i) => np::Opcode::WriteImm(i),
        WrOpcode::Send => np::Opcode::Send,
        WrOpcode::SendImm(i) => np::Opcode::SendImm(i),
        WrOpcode::Read => np::Opcode::Read,
        WrOpcode::CmpSwap { compare, swap } => np::Opcode::CmpSwap { compare, swap },
        WrOpcode::FetchAdd { add } => np::Opcode::FetchAdd { add },
    }
}

impl<N: np::engine::Backend> NpQp<N> {
    fn qp(&self) -> &np::Qp<N> {
        self.qp.as_ref().expect("present until drop")
    }
    fn state(&self) -> QpState {
        let mut a = self.attr.lock();
        self.sync_error(&mut a);
        a.qp_state
    }

    /// An error completion moved the layer's QP to ERR (RC's error rule): so is the
    /// verbs QP, as a NIC moves it (`ibv_query_qp` reports ERR, as rxe/mlx5).
    fn sync_error(&self, a: &mut QpAttr) {
        if !matches!(a.qp_state, QpState::Reset | QpState::Err) && self.qp().is_error() {
            a.qp_state = QpState::Err;
            a.cur_qp_state = QpState::Err;
        }
    }

    fn post_one(&self, w: &SendWr) -> std::result::Result<(), rnic::Error> {
        let Some(sgl) = &self.sgl else {
            return self.post_one_as(w, w.wr_id, || one_sge(w.sg_list));
        };
        if w.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(rnic::Error::InvalidArgument(
                "more SGEs than the QP's max_send_sge",
            ));
        }
        let state = self.state();
        // The SGEs carry data only for a WR the QP executes (not flushed, not inline).
        let data = state == QpState::Rts && !w.flags.contains(SendFlags::INLINE);
        let into_local = matches!(
            w.opcode,
            WrOpcode::Read | WrOpcode::CmpSwap { .. } | WrOpcode::FetchAdd { .. }
        );
        let mut t = sgl.lock();
        let m = t.map(
            false,
            self.cap.max_send_wr,
            w.wr_id,
            if data { w.sg_list } else { &[] },
            into_local,
            self.pd_id,
            &self.pd,
            &self.sg.lkeys,
            &self.sg.bounces,
        )?;
        let r = self.post_one_as(w, m.token, || Ok(m.sge));
        if r.is_err() {
            t.unmap_last(false);
        }
        r
    }

    /// Post `w` to the layer as `wr_id` with the SGE `sge` gives (asked only when the
    /// WR carries data from its SGEs).
    fn post_one_as(
        &self,
        w: &SendWr,
        wr_id: u64,
        sge: impl FnOnce() -> std::result::Result<Option<np::Sge>, rnic::Error>,
    ) -> std::result::Result<(), rnic::Error> {
        let state = self.state();
        if state == QpState::Err {
            // Accepted and completed with WR_FLUSH_ERR (rdma-core providers);
            // the payload is never read, so no staging slot is taken.
            let wr = np::SendWr {
                wr_id,
                op: app_op(w.opcode),
                sge: None,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                signaled: true,
                order_before: false,
                order_after: false,
                solicited: false,
            };
            return self
                .qp()
                .post_send(&[wr])
                .map_err(|(_, e)| post_err(e, state));
        }
        if state != QpState::Rts {
            return Err(rnic::Error::WrongQpState(state));
        }
        let mut wr = np::SendWr {
            wr_id,
            op: app_op(w.opcode),
            sge: None,
            remote_addr: w.remote_addr,
            rkey: w.rkey,
            signaled: self.cap.sq_sig_all || w.flags.contains(SendFlags::SIGNALED),
            order_before: w.flags.contains(SendFlags::FENCE),
            order_after: false,
            solicited: w.flags.contains(SendFlags::SOLICITED),
        };
        if w.flags.contains(SendFlags::INLINE) {
            if w.inline_data.len() > MAX_INLINE as usize {
                return Err(rnic::Error::InvalidArgument("inline payload too long"));
            }
            let mut st = self.stage.lock();
            // The slot to be overwritten must not be in flight (see `Staging`).
            if self.qp().outstanding() >= st.depth as usize {
                return Err(rnic::Error::QueueFull("send queue"));
            }
            if !w.inline_data.is_empty() {
                wr.sge = Some(st.stage(w.inline_data));
            }
            wr.order_after = true;
            return self
                .qp()
                .post_send(&[wr])
                .map_err(|(_, e)| post_err(e, state));
        }
        wr.sge = sge()?;
        self.qp()
            .post_send(&[wr])
            .map_err(|(_, e)| post_err(e, state))
    }
}

impl<N: np::engine::Backend> NpQp<N> {
    /// A RECV of a QP with SGE lists (a bounce buffer for several SGEs).
    fn post_recv_mapped(
        &self,
        sgl: &Mutex<Sgl<N>>,
        w: &RecvWr,
        state: QpState,
    ) -> std::result::Result<(), rnic::Error> {
        if w.sg_list.len() > self.cap.max_recv_sge as usize {
            return Err(rnic::Error::InvalidArgument(
                "more SGEs than the QP's max_recv_sge",
            ));
        }
        let mut t = sgl.lock();
        let m = t.map(
            true,
            self.cap.max_recv_wr,
            w.wr_id,
            w.sg_list,
            true,
            self.pd_id,
            &self.pd,
            &self.sg.lkeys,
            &self.sg.bounces,
        )?;
        let r = self
            .qp()
            .post_recv(&[np::RecvWr {
                wr_id: m.token,
                sge: m.sge,
            }])
            .map_err(|(_, e)| post_err(e, state));
        if r.is_err() {
            t.unmap_last(true);
        }
        r
    }
}

/// The transitions NP-RDMA mode models: the connect path, any state to ERR
/// (`np::Qp::set_error`: every outstanding WR and posted RECV flushes) and any
/// state to RESET (`np::Qp::reset`: flushed the same way, then a fresh QP of the
/// same number to connect again); not SQD/SQE.
fn transition_ok(from: QpState, to: QpState) -> bool {
    use QpState::*;
    matches!(
        (from, to),
        (Reset | Init | Rtr | Rts | Err, Reset)
            | (Reset, Init)
            | (Init, Init)
            | (Init, Rtr)
            | (Rtr, Rts)
            | (Rts, Rts)
            | (Reset | Init | Rtr | Rts | Err, Err)
    )
}

impl<N: np::engine::Backend> Qp for NpQp<N> {
    fn qpn(&self) -> u32 {
        self.qp().qpn()
    }
    fn cap(&self) -> QpInitAttr {
        self.cap
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut cur = self.attr.lock();
        self.sync_error(&mut cur);
        let from = cur.qp_state;
        let to = if mask.contains(QpAttrMask::STATE) {
            attr.qp_state
        } else {
            from
        };
        // IB's state table first (EINVAL, as rxe/mlx5: an illegal transition or
        // a missing / extra attribute), then what this mode models (EOPNOTSUPP).
        let (req, opt) = rnic::qp::transition_attrs(self.qp_type, from, to)
            .ok_or(ShimError::Nic(rnic::Error::IllegalTransition { from, to }))?;
        if mask.contains(QpAttrMask::CUR_STATE) && attr.cur_qp_state != from {
            return Err(ShimError::InvalidArgument(
                "cur_qp_state does not match".into(),
            ));
        }
        let given = mask - QpAttrMask::STATE - QpAttrMask::CUR_STATE;
        if !given.contains(req) {
            return Err(ShimError::Nic(rnic::Error::InvalidMask(
                "required attribute missing",
            )));
        }
        if !(req | opt).contains(given) {
            return Err(ShimError::Nic(rnic::Error::InvalidMask(
                "attribute not allowed in this transition",
            )));
        }
        if !transition_ok(from, to) {
            return Err(ShimError::Unsupported(format!(
                "QP state {from:?} -> {to:?} in NP-RDMA mode"
            )));
        }
        if to == QpState::Reset {
            if from != QpState::Reset {
                // The layer's QP anew over the same NIC QPs (reset in place),
                // granting nothing until the next INIT sets qp_access_flags, as
                // a new QP.
                self.qp().reset().map_err(np_err)?;
                if let Some(t) = &self.sgl {
                    // Its WRs went without completions: their bounce buffers too.
                    *t.lock() = Sgl::default();
                }
                self.qp().set_remote_access(np::Access(0)).map_err(np_err)?;
            }
            *cur = QpAttr {
                qp_state: QpState::Reset,
                cur_qp_state: QpState::Reset,
                ..Default::default()
            };
            return Ok(());
        }
        if to == QpState::Err && from != QpState::Err {
            self.qp().set_error().map_err(np_err)?;
        }
        let rnr_retry = mask
            .contains(QpAttrMask::RNR_RETRY)
            .then_some(attr.rnr_retry);
        let rnr_timer = mask
            .contains(QpAttrMask::MIN_RNR_TIMER)
            .then_some(attr.min_rnr_timer);
        if rnr_retry.is_some() || rnr_timer.is_some() {
            // A SEND that finds no RECV waits at the receiver for rnr_retry x
            // its min_rnr_timer, then fails RNR_RETRY_EXC_ERR (as RC's NAKs).
            self.qp().set_rnr(rnr_retry, rnr_timer).map_err(np_err)?;
        }
        if mask.contains(QpAttrMask::ACCESS_FLAGS) {
            // Enforced by the peer-facing side of the layer (the data QP's NIC
            // and the target CPU's checks), as a NIC enforces it.
            self.qp()
                .set_remote_access(np::Access(attr.qp_access_flags.bits()))
                .map_err(np_err)?;
        }
        if from == QpState::Init && to == QpState::Rtr {
            let need = QpAttrMask::AV | QpAttrMask::DEST_QPN;
            let Some(dest) = attr.dest.filter(|_| mask.contains(need)) else {
                return Err(ShimError::InvalidArgument(
                    "INIT->RTR needs an address vector with a GID (GRH) and dest_qp_num".into(),
                ));
            };
            // The control channel: derived from the data QPN (the software
            // NIC), or on the data QP itself (a device that numbers its QPs).
            let ep = np::Endpoint {
                addr: dest.to_bytes(),
                qpn: attr.dest_qp_num,
                ctrl_qpn: if self.ctrl_on_data_qp {
                    attr.dest_qp_num
                } else {
                    0
                },
            };
            self.qp().connect(&ep).map_err(np_err)?;
            cur.dest = Some(dest);
            cur.dest_qp_num = attr.dest_qp_num;
        }
        macro_rules! take {
            ($m:ident, $($f:ident),*) => {
                if mask.contains(QpAttrMask::$m) { $(cur.$f = attr.$f;)* }
            };
        }
        take!(ACCESS_FLAGS, qp_access_flags);
        take!(PKEY_INDEX, pkey_index);
        take!(PORT, port_num);
        take!(PATH_MTU, path_mtu);
        take!(RQ_PSN, rq_psn);
        take!(SQ_PSN, sq_psn);
        take!(MAX_QP_RD_ATOMIC, max_rd_atomic);
        take!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
        take!(MIN_RNR_TIMER, min_rnr_timer);
        take!(TIMEOUT, timeout);
        take!(RETRY_CNT, retry_cnt);
        take!(RNR_RETRY, rnr_retry);
        cur.qp_state = to;
        cur.cur_qp_state = to;
        Ok(())
    }
    fn query(&self) -> QpAttr {
        let mut a = self.attr.lock();
        self.sync_error(&mut a);
        *a
    }
    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        super::post_each(wrs, |w| self.post_one(w))
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let state = self.state();
        super::post_each(wrs, |w| {
            if state == QpState::Reset {
                Err(rnic::Error::WrongQpState(state))
            } else if let Some(sgl) = &self.sgl {
                self.post_recv_mapped(sgl, w, state)
            } else {
                one_sge(w.sg_list).and_then(|sge| {
                    self.qp()
                        .post_recv(&[np::RecvWr {
                            wr_id: w.wr_id,
                            sge,
                        }])
                        .map_err(|(_, e)| post_err(e, state))
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The tests run on the default device.
    type NpDevice = super::NpDevice<Soft>;

    #[test]
    fn transitions() {
        use QpState::*;
        assert!(transition_ok(Reset, Init));
        assert!(transition_ok(Init, Rtr));
        assert!(transition_ok(Rtr, Rts));
        assert!(!transition_ok(Reset, Rts));
        assert!(transition_ok(Rts, Err));
        assert!(transition_ok(Init, Err));
        assert!(transition_ok(Err, Err));
        assert!(!transition_ok(Err, Rts));
        assert!(transition_ok(Err, Reset));
        assert!(transition_ok(Rts, Reset));
    }

    #[test]
    fn completions_convert() {
        let c = np::Completion {
            wr_id: 9,
            status: 5,
            op: np::CompOp::RecvWithImm,
            byte_len: 12,
            imm: Some(0xabc),
            qp_num: 3,
        };
        let w = wc_from(&c);
        assert_eq!(w.status, WcStatus::WrFlushErr);
        assert_eq!(w.opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!((w.imm_data, w.byte_len, w.qp_num), (0xabc, 12, 3));
        assert!(w.wc_flags.contains(WcFlags::WITH_IMM));
        let w = wc_from(&np::Completion {
            op: np::CompOp::Read,
            ..c
        });
        assert_eq!(w.opcode, WcOpcode::RdmaRead);
        assert!(!w.wc_flags.contains(WcFlags::WITH_IMM));
    }

    /// A connected loopback pair on one NP-RDMA device: `modify(ERR)` (what
    /// `ibv_modify_qp(IBV_QPS_ERR)` calls) flushes a parked two-sided SEND and every
    /// posted RECV once, `query` reports ERR, later posts are accepted and flushed.
    #[test]
    fn modify_to_err_flushes_and_is_reported() {
        const LEN: usize = 64 * 1024;
        let dev = NpDevice::new().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64, false).unwrap();
        let mem = TestMem::new(LEN);
        let addr = mem.addr() as *mut libc::c_void;
        let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        // SAFETY: the mapping outlives the MR (dropped before munmap below).
        let mr = unsafe { pd.reg_mr(addr as usize, LEN, acc).unwrap() };
        let init = QpInitAttr {
            qpn: None,
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let qa = pd.create_qp(&*cq, &*cq, &init).unwrap();
        let qb = pd.create_qp(&*cq, &*cq, &init).unwrap();
        let dest = rnic::HostAddr::from_bytes(&dev.gid());
        for (q, peer) in [(&qa, qb.qpn()), (&qb, qa.qpn())] {
            for st in [QpState::Init, QpState::Rtr, QpState::Rts] {
                let a = QpAttr {
                    qp_state: st,
                    dest: Some(dest),
                    dest_qp_num: peer,
                    // The SEND below waits for a RECV as long as it takes.
                    rnr_retry: 7,
                    min_rnr_timer: 12,
                    ..Default::default()
                };
                q.modify(&a, full_mask(st)).unwrap();
            }
        }
        let sge = |off: usize, len: u32| rnic::Sge {
            addr: addr as u64 + off as u64,
            length: len,
            lkey: mr.lkey(),
        };
        for i in 0..4u64 {
            let sg = [sge(8192 + i as usize * 256, 256)];
            qa.post_recv(&[RecvWr {
                wr_id: 100 + i,
                sg_list: &sg,
            }])
            .unwrap();
        }
        // qb has no RECV posted: the SEND waits at the peer (two-sided).
        let sg = [sge(0, 100)];
        let mut w = SendWr::new(7, WrOpcode::Send, &sg);
        w.flags |= SendFlags::SIGNALED;
        qa.post_send(&[w]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut out = [Wc::default(); 16];
        assert_eq!(cq.poll(&mut out).unwrap(), 0, "completed before ERR");
        let err = QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        };
        qa.modify(&err, QpAttrMask::STATE).unwrap();
        assert_eq!(qa.query().qp_state, QpState::Err);
        let mut got = Vec::new();
        let t0 = std::time::Instant::now();
        while got.len() < 5 && t0.elapsed().as_secs() < 5 {
            let n = cq.poll(&mut out).unwrap();
            got.extend_from_slice(&out[..n]);
        }
        let mut ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [7, 100, 101, 102, 103]);
        for w in &got {
            assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
            assert_eq!(w.qp_num, qa.qpn());
        }
        // ERR -> ERR is fine; there is no way back to RTS.
        qa.modify(&err, QpAttrMask::STATE).unwrap();
        let rts = QpAttr {
            qp_state: QpState::Rts,
            ..Default::default()
        };
        assert!(qa.modify(&rts, QpAttrMask::STATE).is_err());
        // Posting on the ERR QP: accepted, one flush completion.
        let mut w = SendWr::new(8, WrOpcode::Write, &sg);
        w.flags |= SendFlags::INLINE;
        w.inline_data = &[1, 2, 3];
        qa.post_send(&[w]).unwrap();
        let t0 = std::time::Instant::now();
        let mut n = 0;
        while n == 0 && t0.elapsed().as_secs() < 5 {
            n = cq.poll(&mut out).unwrap();
        }
        assert_eq!(n, 1);
        assert_eq!((out[0].wr_id, out[0].status), (8, WcStatus::WrFlushErr));
        drop(qa);
        drop(qb);
        drop(mr);
        drop(mem);
    }

    /// Private anonymous memory for a test, unmapped on drop (after the MRs on
    /// it): the workspace's one anonymous mapping, [`vmem::AnonMapping`].
    struct TestMem(vmem::AnonMapping);

    impl TestMem {
        fn new(len: usize) -> TestMem {
            TestMem(vmem::AnonMapping::new(len).expect("mmap"))
        }
        fn addr(&self) -> u64 {
            self.0.addr() as u64
        }
    }

    /// The attributes an RC QP's move to `st` on the connect path needs.
    fn full_mask(st: QpState) -> QpAttrMask {
        use QpAttrMask as M;
        M::STATE
            | match st {
                QpState::Init => M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
                QpState::Rtr => {
                    M::AV
                        | M::PATH_MTU
                        | M::DEST_QPN
                        | M::RQ_PSN
                        | M::MAX_DEST_RD_ATOMIC
                        | M::MIN_RNR_TIMER
                }
                QpState::Rts => {
                    M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC
                }
                _ => M::empty(),
            }
    }

    /// Connect `a` and `b` (both on `dev`), `b` granting `b_access` remotely.
    fn connect_pair(dev: &NpDevice, a: &dyn Qp, b: &dyn Qp, b_access: Access) {
        let dest = rnic::HostAddr::from_bytes(&dev.gid());
        for (q, peer, acc) in [(a, b.qpn(), Access::LOCAL_WRITE), (b, a.qpn(), b_access)] {
            for st in [QpState::Init, QpState::Rtr, QpState::Rts] {
                let attr = QpAttr {
                    qp_state: st,
                    dest: Some(dest),
                    dest_qp_num: peer,
                    qp_access_flags: acc,
                    ..Default::default()
                };
                q.modify(&attr, full_mask(st)).unwrap();
            }
        }
    }

    /// Exactly `N` completions of `cq`, however many each poll returns.
    fn wait_n<const N: usize>(cq: &dyn Cq) -> [Wc; N] {
        let mut out = [Wc::default(); N];
        let mut got = 0;
        let t0 = std::time::Instant::now();
        while got < N {
            got += cq.poll(&mut out[got..]).unwrap();
            assert!(t0.elapsed().as_secs() < 10, "{got} of {N} completions");
            std::thread::yield_now();
        }
        let mut extra = [Wc::default(); 1];
        assert_eq!(cq.poll(&mut extra).unwrap(), 0, "more than {N}: {extra:?}");
        out
    }

    fn wait_one(cq: &dyn Cq) -> Wc {
        let mut out = [Wc::default(); 4];
        let t0 = std::time::Instant::now();
        loop {
            let n = cq.poll(&mut out).unwrap();
            if n > 0 {
                assert_eq!(n, 1, "{:?}", &out[..n]);
                return out[0];
            }
            assert!(t0.elapsed().as_secs() < 10, "no completion");
            std::thread::yield_now();
        }
    }

    /// The target QP's qp_access_flags are enforced like rxe/mlx5 and pinned mode
    /// do: a READ / WRITE / atomic the QP does not grant completes with
    /// REM_INV_REQ_ERR at the initiator although the MR grants it — one-sided (pages
    /// resident: the data QP's NIC refuses) and two-sided (pages never touched: the
    /// target CPU refuses). The same operations succeed once the QP grants them,
    /// whatever the initiator's own QP grants.
    #[test]
    fn target_qp_access_flags_are_enforced() {
        const LEN: usize = 64 * 1024;
        let dev = NpDevice::new().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64, false).unwrap();
        let init = QpInitAttr {
            qpn: None,
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: true,
        };
        let all = Access::LOCAL_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_WRITE
            | Access::REMOTE_ATOMIC;
        // (op, pages touched, length): 16 KiB on untouched pages goes two-sided with a
        // reverse operation into the initiator, whose QP grants no remote access
        // (the layer's temporary MRs are reachable anyway: rnic ANY_QP).
        let cases: [(WrOpcode, bool, u32); 7] = [
            (WrOpcode::Write, true, 64),
            (WrOpcode::Read, true, 64),
            (WrOpcode::Read, false, 64),
            (WrOpcode::Write, false, 64),
            (WrOpcode::Read, false, 16384),
            (WrOpcode::Write, false, 16384),
            (WrOpcode::FetchAdd { add: 1 }, true, 8),
        ];
        // Write-only grants exercise the peer's page-version READs (the version
        // tables are ANY_QP too).
        for granted in [
            Access::LOCAL_WRITE,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            all,
        ] {
            for (op, touched, len) in cases {
                let need = match op {
                    WrOpcode::Write => Access::REMOTE_WRITE,
                    WrOpcode::Read => Access::REMOTE_READ,
                    _ => Access::REMOTE_ATOMIC,
                };
                let want = if granted.contains(need) {
                    WcStatus::Success
                } else {
                    WcStatus::RemInvReqErr
                };
                let mem = TestMem::new(LEN);
                // SAFETY: the mapping outlives the MR (dropped first, below).
                let mr = unsafe { pd.reg_mr(mem.addr() as usize, LEN, all).unwrap() };
                if touched {
                    // SAFETY: inside our mapping; makes every page resident.
                    unsafe { std::ptr::write_bytes(mem.addr() as *mut u8, 7, LEN) };
                }
                let qa = pd.create_qp(&*cq, &*cq, &init).unwrap();
                let qb = pd.create_qp(&*cq, &*cq, &init).unwrap();
                connect_pair(&dev, &*qa, &*qb, granted);
                let sg = [rnic::Sge {
                    addr: mem.addr(),
                    length: len,
                    lkey: mr.lkey(),
                }];
                let w = SendWr::new(1, op, &sg).remote(mem.addr() + 32768, mr.rkey());
                qa.post_send(&[w]).unwrap();
                let wc = wait_one(&*cq);
                assert_eq!(
                    wc.status, want,
                    "{op:?} touched={touched} len={len} granted={granted:?}: {wc:?}"
                );
                drop((qa, qb, mr));
            }
        }
    }

    /// NP-RDMA registration refuses what ibv_reg_mr refuses: REMOTE_WRITE or
    /// REMOTE_ATOMIC without LOCAL_WRITE (EINVAL).
    #[test]
    fn reg_mr_needs_local_write_for_remote_write_and_atomic() {
        let dev = NpDevice::new().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let mem = TestMem::new(8192);
        for acc in [
            Access::REMOTE_WRITE,
            Access::REMOTE_ATOMIC,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        ] {
            // SAFETY: the mapping outlives any MR (none is made).
            let r = unsafe { pd.reg_mr(mem.addr() as usize, 8192, acc) };
            let e = r.err().expect("refused");
            assert_eq!(e.errno(), libc::EINVAL, "{acc:?}: {e}");
        }
        // SAFETY: as above; dropped before the mapping.
        let ok = unsafe { pd.reg_mr(mem.addr() as usize, 8192, Access::REMOTE_READ) };
        assert!(ok.is_ok());
    }

    /// Registrations of many GiB, alone and together, fit the NIC's IOVA space and
    /// residency map (more than 2 GiB of MRs failed with EIO before they were sized
    /// to `max_mr_size`).
    #[test]
    fn mrs_of_many_gib_register() {
        let dev = NpDevice::new().unwrap();
        assert!(dev.attr().max_mr_size >= NP_MR_BYTES);
        let pd = dev.alloc_pd().unwrap();
        let big = 8usize << 30;
        let a = vmem::AnonMapping::new_noreserve(big).expect("mmap");
        let b = vmem::AnonMapping::new_noreserve(big).expect("mmap");
        let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        // SAFETY: the mappings outlive the MRs (dropped first).
        let ma = unsafe { pd.reg_mr(a.addr(), big, acc) }.expect("8 GiB MR");
        // SAFETY: as above.
        let mb = unsafe { pd.reg_mr(b.addr(), big, acc) }.expect("a second 8 GiB MR");
        drop((ma, mb));
    }

    /// The limits ibv_query_device advertises in this mode hold: max_mr MRs and then
    /// max_qp QPs (each with its staging MR) exist at once, a QP of max_qp_wr depth
    /// can be created, max_cq CQs too, and one more MR / QP / CQ than advertised is
    /// refused with ENOMEM.
    #[test]
    fn advertised_qp_mr_and_cq_limits_hold() {
        let dev = NpDevice::new().unwrap();
        let a = dev.attr();
        assert_eq!(
            (a.max_qp, a.max_mr, a.max_cq),
            (NP_MAX_QP, NP_MAX_MR, NP_MAX_CQ)
        );
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16, false).unwrap();
        let page = vmem::PAGE_SIZE;
        let n = a.max_mr as usize;
        let mem = TestMem::new((n + 1) * page);
        let acc = Access::LOCAL_WRITE | Access::REMOTE_READ;
        let mut mrs = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the mapping outlives the MRs (dropped first, below).
            let r = unsafe { pd.reg_mr(mem.addr() as usize + i * page, page, acc) };
            mrs.push(r.unwrap_or_else(|e| panic!("MR {i} of {n}: {e}")));
        }
        // SAFETY: as above.
        let extra = unsafe { pd.reg_mr(mem.addr() as usize + n * page, page, acc) };
        assert_eq!(
            extra.err().expect("max_mr + 1 refused").errno(),
            libc::ENOMEM
        );
        let small = QpInitAttr {
            qpn: None,
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        // The QPs' staging MRs are not application MRs: all max_mr stay registered.
        let mut qps = Vec::new();
        for i in 0..a.max_qp {
            let init = if i == 0 {
                QpInitAttr {
                    max_send_wr: a.max_qp_wr,
                    max_recv_wr: a.max_qp_wr,
                    ..small
                }
            } else {
                small
            };
            let q = pd.create_qp(&*cq, &*cq, &init);
            qps.push(q.unwrap_or_else(|e| panic!("QP {i} of {}: {e}", a.max_qp)));
        }
        let extra = pd.create_qp(&*cq, &*cq, &small);
        assert_eq!(
            extra.err().expect("max_qp + 1 refused").errno(),
            libc::ENOMEM
        );
        drop(qps);
        drop(mrs);
        // Released on destroy: the next ones fit again.
        assert!(pd.create_qp(&*cq, &*cq, &small).is_ok());
        // max_cq CQs in all (`cq` is one of them), then ENOMEM; one freed fits again.
        let mut cqs: Vec<_> = (1..a.max_cq)
            .map(|i| {
                dev.create_cq(4, i % 2 == 0)
                    .unwrap_or_else(|e| panic!("CQ {i} of {}: {e}", a.max_cq))
            })
            .collect();
        let extra = dev.create_cq(4, false);
        assert_eq!(
            extra.err().expect("max_cq + 1 refused").errno(),
            libc::ENOMEM
        );
        cqs.pop();
        assert!(dev.create_cq(4, false).is_ok());
    }

    /// SGE lists in NP-RDMA mode (the layer's WRs carry one SGE; `np_sgl` bounces):
    /// a 3-SGE SEND lands in a 3-SGE RECV split differently, a 2-SGE WRITE and a
    /// 3-SGE READ move exactly their bytes, an unsignaled SGE-list WRITE is retired
    /// by the next signaled WR, a bad lkey in the second SGE completes with
    /// LOC_PROT_ERR, and more SGEs than the QP's cap is refused at post (EINVAL).
    /// Every completion carries the application's wr_id.
    #[test]
    fn sge_lists_gather_and_scatter() {
        const LEN: usize = 64 * 1024;
        let dev = NpDevice::new().unwrap();
        assert_eq!(dev.attr().max_sge, NP_MAX_SGE);
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64, false).unwrap();
        let init = QpInitAttr {
            qpn: None,
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 3,
            max_recv_sge: 3,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let mem = TestMem::new(LEN);
        let base = mem.addr();
        // SAFETY: the mapping outlives the MR (dropped first, below).
        let mr = unsafe { pd.reg_mr(base as usize, LEN, all).unwrap() };
        let qa = pd.create_qp(&*cq, &*cq, &init).unwrap();
        let qb = pd.create_qp(&*cq, &*cq, &init).unwrap();
        assert_eq!(qa.cap().max_send_sge, 3);
        connect_pair(&dev, &*qa, &*qb, all);
        let at = |off: u64| (base + off) as *mut u8;
        let sge = |off: u64, len: u32| rnic::Sge {
            addr: base + off,
            length: len,
            lkey: mr.lkey(),
        };
        let fill = |off: u64, len: usize, v: &dyn Fn(usize) -> u8| {
            for i in 0..len {
                // SAFETY: inside our mapping.
                unsafe { *at(off).add(i) = v(i) };
            }
        };
        let bytes = |off: u64, len: usize| -> Vec<u8> {
            // SAFETY: inside our mapping.
            unsafe { std::slice::from_raw_parts(at(off), len).to_vec() }
        };
        let pattern = |i: usize| (i * 7 + 3) as u8;
        // SEND 100 + 50 + 150 bytes (from scattered places) into RECV 120 + 80 + 200.
        fill(0, 100, &pattern);
        fill(1000, 50, &|i| pattern(100 + i));
        fill(2000, 150, &|i| pattern(150 + i));
        let rs = [sge(8192, 120), sge(9000, 80), sge(10000, 200)];
        qb.post_recv(&[RecvWr {
            wr_id: 77,
            sg_list: &rs,
        }])
        .unwrap();
        let ss = [sge(0, 100), sge(1000, 50), sge(2000, 150)];
        let mut w = SendWr::new(1, WrOpcode::Send, &ss);
        w.flags |= SendFlags::SIGNALED;
        qa.post_send(&[w]).unwrap();
        // The SEND's and the RECV's completions share the CQ: one poll may
        // return both.
        let mut got = wait_n::<2>(&*cq);
        got.sort_by_key(|w| w.wr_id);
        assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::Success));
        assert_eq!((got[1].wr_id, got[1].status), (77, WcStatus::Success));
        assert_eq!(got[1].byte_len, 300);
        let mut recvd = bytes(8192, 120);
        recvd.extend(bytes(9000, 80));
        recvd.extend(bytes(10000, 100));
        assert_eq!(recvd, (0..300).map(pattern).collect::<Vec<_>>());
        assert_eq!(bytes(10100, 100), vec![0; 100], "past byte_len untouched");
        // Unsignaled 2-SGE WRITE, then a signaled one: one completion (wr_id 3).
        fill(3000, 64, &|i| i as u8 ^ 0x5a);
        fill(3500, 64, &|i| i as u8 ^ 0xa5);
        let ws = [sge(3000, 64), sge(3500, 64)];
        let w = SendWr::new(2, WrOpcode::Write, &ws)
            .remote(base + 20000, mr.rkey())
            .flags(SendFlags::empty());
        qa.post_send(&[w]).unwrap();
        let w2s = [sge(3000, 8)];
        let mut w2 = SendWr::new(3, WrOpcode::Write, &w2s).remote(base + 21000, mr.rkey());
        w2.flags |= SendFlags::SIGNALED;
        qa.post_send(&[w2]).unwrap();
        let c = wait_one(&*cq);
        assert_eq!((c.wr_id, c.status), (3, WcStatus::Success));
        let mut want = bytes(3000, 64);
        want.extend(bytes(3500, 64));
        assert_eq!(bytes(20000, 128), want);
        // 15 unsignaled WRs hold send-queue slots until a later signaled completion
        // is polled (as on a NIC); the READ below is the 16th (the depth).
        let one = [sge(3000, 8)];
        for i in 0..15 {
            let w = SendWr::new(100 + i, WrOpcode::Write, &one)
                .remote(base + 21000, mr.rkey())
                .flags(SendFlags::empty());
            qa.post_send(&[w]).unwrap();
        }
        // READ 128 remote bytes into 3 SGEs (its completion retires the 15).
        let rd = [sge(30000, 10), sge(31000, 100), sge(32000, 18)];
        let mut w = SendWr::new(4, WrOpcode::Read, &rd).remote(base + 20000, mr.rkey());
        w.flags |= SendFlags::SIGNALED;
        qa.post_send(&[w]).unwrap();
        let c = wait_one(&*cq);
        assert_eq!((c.wr_id, c.status), (4, WcStatus::Success));
        let mut back = bytes(30000, 10);
        back.extend(bytes(31000, 100));
        back.extend(bytes(32000, 18));
        assert_eq!(back, want);
        // Too many SGEs for the cap: refused at post.
        let four = [sge(0, 1), sge(1, 1), sge(2, 1), sge(3, 1)];
        let e = qa
            .post_send(&[SendWr::new(5, WrOpcode::Write, &four).remote(base, mr.rkey())])
            .unwrap_err();
        assert_eq!(e.err.errno(), libc::EINVAL);
        // A bad lkey in the second SGE: LOC_PROT_ERR, the application's wr_id.
        let bad = [
            sge(0, 8),
            rnic::Sge {
                lkey: mr.lkey() ^ 0x40,
                ..sge(8, 8)
            },
        ];
        let mut w = SendWr::new(6, WrOpcode::Write, &bad).remote(base + 40000, mr.rkey());
        w.flags |= SendFlags::SIGNALED;
        qa.post_send(&[w]).unwrap();
        let c = wait_one(&*cq);
        assert_eq!((c.wr_id, c.status), (6, WcStatus::LocProtErr));
        // A full queue of unsignaled WRs: the next post is ENOMEM (the application
        // must signal at least every max_send_wr WRs).
        let (qc, qd) = (
            pd.create_qp(&*cq, &*cq, &init).unwrap(),
            pd.create_qp(&*cq, &*cq, &init).unwrap(),
        );
        connect_pair(&dev, &*qc, &*qd, all);
        for i in 0..16 {
            let w = SendWr::new(300 + i, WrOpcode::Write, &one)
                .remote(base + 21000, mr.rkey())
                .flags(SendFlags::empty());
            qc.post_send(&[w]).unwrap();
        }
        let w = SendWr::new(400, WrOpcode::Write, &one).remote(base + 21000, mr.rkey());
        let e = qc.post_send(&[w]).unwrap_err();
        assert_eq!(e.err.errno(), libc::ENOMEM);
        drop((qa, qb, qc, qd, mr));
    }

    /// NP-RDMA mode offers ODP (its MRs are never pinned): `ibv_advise_mr` prefetches
    /// SGEs inside MRs of the PD (faulting swapped-out or never-touched pages in, or
    /// nothing for NO_FAULT) and refuses others with EINVAL.
    #[test]
    fn odp_advise_prefetches_registered_ranges() {
        let dev = NpDevice::new().unwrap();
        assert!(dev.odp());
        let pd = dev.alloc_pd().unwrap();
        let other = dev.alloc_pd().unwrap();
        let mem = TestMem::new(256 * 1024);
        // SAFETY: the mapping outlives the MR (dropped first, below).
        let mr = unsafe {
            pd.reg_mr(mem.addr() as usize, 256 * 1024, Access::LOCAL_WRITE)
                .unwrap()
        };
        let sge = |off: u64, len: u32, lkey: u32| rnic::Sge {
            addr: mem.addr() + off,
            length: len,
            lkey,
        };
        let resident = |off: u64| dev.pager.is_resident((mem.addr() + off) as usize);
        assert!(!resident(0) && !resident(8192), "never touched");
        // NO_FAULT: nothing is brought in.
        pd.advise(&[sge(8192, 100, mr.lkey())], false).unwrap();
        assert!(!resident(8192));
        pd.advise(&[sge(0, 32768, mr.lkey())], true).unwrap();
        assert!((0..8).all(|p| resident(p * 4096)), "prefetched");
        // Beyond the advice and the fault-around window of its pages
        // (`NPRDMA_FAULT_AROUND_PAGES`, 64 KiB by default), nothing.
        assert!(!resident(128 * 1024), "outside the advice");
        for bad in [
            sge(0, 256 * 1024 + 1, mr.lkey()),
            sge(0, 8, mr.lkey() ^ 0x40),
        ] {
            let e = pd.advise(&[bad], true).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL, "{bad:?}");
        }
        let e = other.advise(&[sge(0, 8, mr.lkey())], true).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "another PD's MR");
        drop(mr);
    }

    #[test]
    fn one_sge_only() {
        let s = rnic::Sge {
            addr: 1,
            length: 2,
            lkey: 3,
        };
        assert_eq!(one_sge(&[]).unwrap(), None);
        assert_eq!(one_sge(&[s]).unwrap().unwrap().lkey, 3);
        assert!(one_sge(&[s, s]).is_err());
    }
}
