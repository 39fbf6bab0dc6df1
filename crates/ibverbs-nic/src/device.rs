//! Opening a device: library, device, port, GID, one protection domain and
//! one completion channel ([`VerbsNic`]), with the capability checks that
//! refuse a device lacking what the backend needs, and [`VerbsNic`]'s
//! implementation of [`nprdma::nic::Nic`] and [`nprdma::engine::Backend`].

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nprdma::nic::{Access, DeviceCaps, Nic, PeerAddr, QpSpec};
use verbs_sys::*;

use crate::cq::VerbsCq;
use crate::dl::{self, check, errno_err, Lib};
use crate::iommu::NoIommu;
use crate::mr::{ibv_access, VerbsBuf, VerbsMr};
use crate::qp::VerbsQp;
use crate::Error;

/// How to open the device ([`VerbsNic::open`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The libibverbs to `dlopen` (a path or a library name). `None`: the
    /// environment's `NPRDMA_VERBS_LIB`, else [`dl::DEFAULT_LIB`]
    /// (`libibverbs.so.1`). Tests point it at this repository's
    /// `libnprdma.so` (pinned mode: the software NIC as the device).
    pub lib: Option<String>,
    /// Device name (`ibv_get_device_name`). `None`: `NPRDMA_VERBS_DEVICE`,
    /// else the first device.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: u8,
    /// GID index of the port: this host's address for peers (RoCE).
    pub gid_index: u8,
    /// The fewest WRs per QP the device must support (`max_qp_wr`).
    pub min_qp_wr: u32,
    /// The fewest SGEs per WR the device must support (`max_sge`).
    pub min_sge: u32,
    /// The fewest CQ entries the device must support (`max_cqe`).
    pub min_cqe: u32,
    /// Load the library into a new link-map namespace ([`dl::load_in`]):
    /// what the verbs shim, preloaded as libibverbs, does with the real one.
    pub isolated: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            lib: None,
            device: None,
            port: 1,
            gid_index: 0,
            min_qp_wr: 64,
            min_sge: 2,
            min_cqe: 256,
            isolated: false,
        }
    }
}

impl Config {
    /// The library this configuration opens.
    pub fn lib_name(&self) -> String {
        self.lib
            .clone()
            .or_else(|| std::env::var("NPRDMA_VERBS_LIB").ok())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| dl::DEFAULT_LIB.to_string())
    }
}

/// Registration counters of a [`VerbsNic`] ([`Nic::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerbsStats {
    /// Successful `ibv_reg_mr` calls.
    pub regs: u64,
    /// Failed `ibv_reg_mr` calls.
    pub reg_failures: u64,
    /// `ibv_dereg_mr` calls.
    pub deregs: u64,
    /// MRs registered now (`regs - deregs`).
    pub live_mrs: u64,
}

/// The opened device context, PD and channel, shared by everything made
/// through one [`VerbsNic`] (freed when the last holder goes).
pub(crate) struct Dev {
    pub(crate) lib: &'static Lib,
    pub(crate) ctx: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) chan: *mut ibv_comp_channel,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) mtu: ibv_mtu,
    pub(crate) rd_atom: u8,
    pub(crate) regs: AtomicU64,
    pub(crate) reg_failures: AtomicU64,
    pub(crate) deregs: AtomicU64,
}

// SAFETY: libibverbs objects may be used from any thread ("all verbs are
// thread safe", libibverbs(7)); the pointers are owned by `Dev` and freed
// only in its Drop.
unsafe impl Send for Dev {}
// SAFETY: as above; `Dev` has no unsynchronised interior state of its own
// (counters are atomics).
unsafe impl Sync for Dev {}

impl Dev {
    /// The context's ops table (the data path, as libibverbs' inlines).
    pub(crate) fn ops(&self) -> &ibv_context_ops {
        // SAFETY: `ctx` is live while `self` is; `ops` is part of it and
        // never changes after ibv_open_device.
        unsafe { &(*self.ctx).ops }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        // SAFETY: our objects, freed once, children (CQs, QPs, MRs hold an
        // Arc of this) already gone.
        unsafe {
            if let Err(e) = check(
                "ibv_destroy_comp_channel",
                (self.lib.destroy_comp_channel)(self.chan),
            ) {
                tracing::error!(error = %e, "ibverbs-nic: leaking the completion channel");
            }
            if let Err(e) = check("ibv_dealloc_pd", (self.lib.dealloc_pd)(self.pd)) {
                tracing::error!(error = %e, "ibverbs-nic: leaking the PD");
            }
            if let Err(e) = check("ibv_close_device", (self.lib.close_device)(self.ctx)) {
                tracing::error!(error = %e, "ibverbs-nic: leaking the device context");
            }
        }
    }
}

/// One protection domain of a libibverbs device: NP-RDMA's NIC backend
/// without IOMMU control ([`Nic::iommu`] is `None`: user-space mode).
pub struct VerbsNic {
    pub(crate) dev: Arc<Dev>,
    caps: DeviceCaps,
    gid: [u8; 16],
    name: String,
}

impl std::fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsNic")
            .field("lib", &self.dev.lib.name)
            .field("device", &self.name)
            .field("caps", &self.caps)
            .finish()
    }
}

/// Owns a raw object until handed over (`take`), destroying it otherwise:
/// the partial-failure cleanup of [`VerbsNic::open`].
struct Guard<T: Copy, F: FnMut(T)>(Option<T>, F);
impl<T: Copy, F: FnMut(T)> Guard<T, F> {
    fn take(mut self) -> T {
        self.0.take().expect("taken once")
    }
}
impl<T: Copy, F: FnMut(T)> Drop for Guard<T, F> {
    fn drop(&mut self) {
        if let Some(x) = self.0.take() {
            (self.1)(x)
        }
    }
}

impl VerbsNic {
    /// Load the library, open the configured device and port, allocate a PD
    /// and a completion channel, and check that the device offers what the
    /// backend needs (RC QPs, `min_qp_wr` WRs, `min_sge` SGEs, `min_cqe`
    /// CQ entries, an active Ethernet (RoCE) port with the GID): otherwise
    /// a clear [`Error::Unsupported`], with nothing left open.
    pub fn open(cfg: &Config) -> Result<VerbsNic, Error> {
        let lib = dl::load_in(&cfg.lib_name(), cfg.isolated)?;
        let want = cfg
            .device
            .clone()
            .or_else(|| std::env::var("NPRDMA_VERBS_DEVICE").ok())
            .filter(|s| !s.is_empty());
        let (ctx, name) = open_device(lib, want.as_deref())?;
        let ctx = Guard(Some(ctx), |c| {
            // SAFETY: the context opened above, closed once.
            unsafe { (lib.close_device)(c) };
        });
        let c = ctx.0.expect("set");
        let unsupported = |what: String| Error::Unsupported {
            device: name.clone(),
            what,
        };
        // SAFETY: plain C data.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a full attribute struct.
        check("ibv_query_device", unsafe {
            (lib.query_device)(c, &mut attr)
        })?;
        let (max_qp_wr, max_sge, max_cqe) = (
            attr.max_qp_wr.max(0) as u32,
            attr.max_sge.max(0) as u32,
            attr.max_cqe.max(0) as u32,
        );
        if max_qp_wr < cfg.min_qp_wr {
            return Err(unsupported(format!(
                "max_qp_wr {max_qp_wr} < {} WRs per QP",
                cfg.min_qp_wr
            )));
        }
        if max_sge < cfg.min_sge {
            return Err(unsupported(format!(
                "max_sge {max_sge} < {} SGEs per WR",
                cfg.min_sge
            )));
        }
        if max_cqe < cfg.min_cqe {
            return Err(unsupported(format!(
                "max_cqe {max_cqe} < {} CQ entries",
                cfg.min_cqe
            )));
        }
        if cfg.port == 0 || cfg.port > attr.phys_port_cnt {
            return Err(unsupported(format!(
                "no port {} ({} ports)",
                cfg.port, attr.phys_port_cnt
            )));
        }
        // SAFETY: plain C data, zeroed as verbs.h's inline fallback does.
        let mut pattr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context; a full (larger than the compat) struct.
        check("ibv_query_port", unsafe {
            (lib.query_port)(c, cfg.port, &mut pattr)
        })?;
        if pattr.state != IBV_PORT_ACTIVE {
            return Err(unsupported(format!(
                "port {} is not active (state {})",
                cfg.port, pattr.state
            )));
        }
        if u32::from(pattr.link_layer) != IBV_LINK_LAYER_ETHERNET {
            return Err(unsupported(format!(
                "port {} link layer {} is not Ethernet (RoCE): peers are \
                 addressed by GID only, InfiniBand needs LIDs",
                cfg.port, pattr.link_layer
            )));
        }
        // SAFETY: plain C data.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context, a GID out-parameter.
        check("ibv_query_gid", unsafe {
            (lib.query_gid)(c, cfg.port, c_int::from(cfg.gid_index), &mut gid)
        })?;
        // SAFETY: the raw bytes of the union.
        let gid = unsafe { gid.raw };
        if gid == [0; 16] {
            return Err(unsupported(format!(
                "GID {} of port {} is empty",
                cfg.gid_index, cfg.port
            )));
        }
        // SAFETY: a live context.
        let pd = unsafe { (lib.alloc_pd)(c) };
        if pd.is_null() {
            return Err(errno_err("ibv_alloc_pd"));
        }
        let pd = Guard(Some(pd), |p| {
            // SAFETY: the PD allocated above, freed once.
            unsafe { (lib.dealloc_pd)(p) };
        });
        // SAFETY: a live context.
        let chan = unsafe { (lib.create_comp_channel)(c) };
        if chan.is_null() {
            return Err(errno_err("ibv_create_comp_channel"));
        }
        let chan = Guard(Some(chan), |ch| {
            // SAFETY: the channel created above, destroyed once.
            unsafe { (lib.destroy_comp_channel)(ch) };
        });
        // The channel's fd non-blocking, so `wait_event` never blocks in
        // ibv_get_cq_event after poll(2) said readable (libibverbs allows it).
        // SAFETY: the channel is live; fcntl on its fd.
        unsafe {
            let fd = (*chan.0.expect("set")).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
                return Err(errno_err("fcntl(O_NONBLOCK) of the completion channel"));
            }
        }
        let max_inline = probe_rc(lib, c, pd.0.expect("set"))
            .map_err(|e| unsupported(format!("cannot create an RC QP: {e}")))?;
        let rd_atom = attr
            .max_qp_rd_atom
            .min(attr.max_qp_init_rd_atom)
            .clamp(1, 16) as u8;
        let dev = Dev {
            lib,
            pd: pd.take(),
            chan: chan.take(),
            ctx: ctx.take(),
            port: cfg.port,
            gid_index: cfg.gid_index,
            mtu: pattr.active_mtu,
            rd_atom,
            regs: AtomicU64::new(0),
            reg_failures: AtomicU64::new(0),
            deregs: AtomicU64::new(0),
        };
        // SAFETY: sysconf has no memory effects.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let caps = DeviceCaps {
            // Not translated by this backend's protocol (no IOMMU, no
            // optimistic checks): PCIe's common max payload, for the record.
            max_tlp: 256,
            magic: 0,
            page_size: page,
            max_qp_wr,
            max_sge,
            max_inline,
            iommu: false,
            max_cqe,
        };
        Ok(VerbsNic {
            dev: Arc::new(dev),
            caps,
            gid,
            name,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The library's path or name.
    pub fn lib_name(&self) -> &str {
        &self.dev.lib.name
    }
}

/// Open the device named `want` (or the first) of `lib`.
fn open_device(lib: &'static Lib, want: Option<&str>) -> Result<(*mut ibv_context, String), Error> {
    let mut n: c_int = 0;
    // SAFETY: an out-parameter.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(errno_err("ibv_get_device_list"));
    }
    let mut names = Vec::new();
    let mut found = None;
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` devices.
        let d = unsafe { *list.add(i) };
        // SAFETY: a listed device; the name is a C string it owns.
        let nm = unsafe { CStr::from_ptr((lib.get_device_name)(d)) }
            .to_string_lossy()
            .into_owned();
        if found.is_none() && want.map_or(true, |w| w == nm) {
            found = Some((d, nm.clone()));
        }
        names.push(nm);
    }
    let r = match found {
        None => Err(Error::NoDevice(match want {
            Some(w) => format!("no device {w:?} among {names:?}"),
            None => "no RDMA device".to_string(),
        })),
        Some((d, nm)) => {
            // SAFETY: a device of the live list.
            let c = unsafe { (lib.open_device)(d) };
            if c.is_null() {
                Err(errno_err("ibv_open_device"))
            } else {
                Ok((c, nm))
            }
        }
    };
    // SAFETY: the list we got; contexts opened from it stay valid.
    unsafe { (lib.free_device_list)(list) };
    r
}

/// Create (and destroy) a small RC QP: whether the device has RC, and the
/// largest inline size it grants (1 KiB down to none).
fn probe_rc(lib: &'static Lib, ctx: *mut ibv_context, pd: *mut ibv_pd) -> Result<u32, Error> {
    // SAFETY: a live context; no channel.
    let cq = unsafe { (lib.create_cq)(ctx, 4, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    if cq.is_null() {
        return Err(errno_err("ibv_create_cq"));
    }
    let mut last = None;
    let mut got = None;
    for inline in [1024u32, 512, 256, 128, 64, 0] {
        // SAFETY: plain C data.
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq;
        a.recv_cq = cq;
        a.qp_type = IBV_QPT_RC;
        a.cap.max_send_wr = 1;
        a.cap.max_recv_wr = 1;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a.cap.max_inline_data = inline;
        // SAFETY: a live PD and a filled attribute.
        let qp = unsafe { (lib.create_qp)(pd, &mut a) };
        if qp.is_null() {
            last = Some(errno_err("ibv_create_qp"));
            continue;
        }
        // SAFETY: the QP just created.
        unsafe { (lib.destroy_qp)(qp) };
        got = Some(a.cap.max_inline_data.max(inline));
        break;
    }
    // SAFETY: the CQ created above, no QP left on it.
    unsafe { (lib.destroy_cq)(cq) };
    got.ok_or_else(|| last.expect("tried"))
}

impl Nic for VerbsNic {
    type Error = Error;
    type Mr = VerbsMr;
    type Cq = VerbsCq;
    type Qp = VerbsQp;
    type Buf = VerbsBuf;
    type Iommu = NoIommu;
    type Stats = VerbsStats;

    fn caps(&self) -> DeviceCaps {
        self.caps
    }

    #[allow(unsafe_code)]
    unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<VerbsMr, Error> {
        // SAFETY: forwarded contract.
        unsafe { VerbsMr::register(&self.dev, addr, len, access) }
    }

    fn alloc_buf(&self, len: usize, access: Access) -> Result<VerbsBuf, Error> {
        VerbsBuf::alloc(&self.dev, len, access)
    }

    fn create_cq(&self, depth: u32) -> Result<VerbsCq, Error> {
        VerbsCq::create(&self.dev, depth)
    }

    fn create_qp(
        &self,
        spec: &QpSpec,
        send_cq: &VerbsCq,
        recv_cq: &VerbsCq,
    ) -> Result<VerbsQp, Error> {
        VerbsQp::create(&self.dev, spec, send_cq, recv_cq)
    }

    fn addr(&self) -> PeerAddr {
        PeerAddr(self.gid)
    }

    fn iommu(&self) -> Option<Arc<NoIommu>> {
        None
    }

    fn wait_event(&self, timeout: Duration) -> Result<bool, Error> {
        let d = &self.dev;
        // SAFETY: the live channel's fd.
        let fd = unsafe { (*d.chan).fd };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = nprdma::nic::poll_timeout_ms(timeout);
        // SAFETY: one pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(Error::Verb {
                verb: "poll(completion channel)",
                source: e,
            });
        }
        let mut any = false;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: the live (non-blocking) channel, out-parameters.
            if unsafe { (d.lib.get_cq_event)(d.chan, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            any = true;
            // SAFETY: the CQ the event names (still alive: a CQ is
            // destroyed only by its owner, which is not waiting here).
            unsafe { (d.lib.ack_cq_events)(cq, 1) };
        }
        Ok(any)
    }

    fn stats(&self) -> VerbsStats {
        let d = &self.dev;
        let (regs, deregs) = (
            d.regs.load(Ordering::Relaxed),
            d.deregs.load(Ordering::Relaxed),
        );
        VerbsStats {
            regs,
            reg_failures: d.reg_failures.load(Ordering::Relaxed),
            deregs,
            live_mrs: regs.saturating_sub(deregs),
        }
    }
}

impl nprdma::engine::Backend for VerbsNic {
    fn error(e: Error) -> nprdma::Error {
        nprdma::Error::Other(e.to_string())
    }
}

/// `access` in `ibv_access_flags` (re-exported for the QP's flags).
pub(crate) fn qp_access(access: Access) -> c_int {
    ibv_access(access) & !(IBV_ACCESS_LOCAL_WRITE as c_int)
}
