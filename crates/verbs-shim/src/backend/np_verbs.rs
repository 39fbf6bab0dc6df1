//! `NPRDMA_MODE=nprdma` with `NPRDMA_DEVICE=verbs`: NP-RDMA over the *next*
//! libibverbs in the process (crate `ibverbs-nic`), so an unmodified program gets
//! non-pinned memory on any RDMA device. That NIC has no IOMMU control, so the engine
//! runs the paper's user-space mode (every READ/WRITE two-sided, MRs registered on the
//! fly, a bounded registration cache).
//!
//! * **Which library.** `NPRDMA_VERBS_LIB` (default `libibverbs.so.1`: the real one,
//!   which the program links and libnprdma.so, preloaded, shadows), `dlopen`ed with
//!   `RTLD_LOCAL`; `NPRDMA_VERBS_DEVICE` (default the first device),
//!   `NPRDMA_VERBS_PORT` (default 1), `NPRDMA_VERBS_GID_INDEX` (default 0: the GID the
//!   program exchanges must be the one this index names).
//! * **A copy of libnprdma.so as the device** (the tests: the software NIC behind the
//!   C ABI). A copy at another path is a separate instance, but it shares the process
//!   environment, whose `NPRDMA_MODE=nprdma NPRDMA_DEVICE=verbs` would make it load a
//!   library in turn. So before the first verb the copy is told its mode through its
//!   exported `nprdma_shim_as_device` (`NPRDMA_VERBS_MODE`, default `pinned`), which
//!   overrides both variables there. The library that *is* this instance (the same
//!   path) is refused: it would be its own device.
//! * **The real libibverbs is loaded into a new link-map namespace** (`dlmopen`,
//!   `LM_ID_NEWLM`; a library without that symbol). The program links libibverbs,
//!   and libibverbs calls several of its own exported functions through its PLT
//!   (`ibv_reg_mr_iova2`, `ibv_read_sysfs_file`, `ibv_query_gid_type`, ...): in the
//!   program's namespace those calls bind to this preloaded library's exports of the
//!   same names (`LD_DEBUG=bindings` shows it), which know nothing of the real
//!   device's objects. A fresh copy in its own namespace binds among itself and its
//!   providers.
//! * **Control-QP discovery.** An unmodified program exchanges only its data QPN and
//!   GID, and a real device numbers QPs itself, so the control QP's number cannot be
//!   derived as on the software NIC. The engine carries the control channel on the data
//!   QP instead (`np::Config::ctrl_on_data_qp`): the command-ring RECVs are posted on
//!   the data QP, whose receive queue NP-RDMA does not otherwise use (application
//!   RECVs are the engine's own), and the control SENDs share its send queue. No
//!   handshake runs before the application's traffic, so `ibv_modify_qp(RTR)` never
//!   waits for the peer (ibv_rc_pingpong's server connects before it even tells the
//!   client its QPN; a handshake there would deadlock), and a control SEND that
//!   arrives before the peer posted its ring is retried by RC's RNR retry (infinite).
//!   Both sides must run this way (the engine refuses a mixed pair at connect).

use super::np::NpFlavor;
use super::Result;
use crate::error::ShimError;
use ibverbs_nic::{Config, VerbsNic, VerbsStats};
use np::nic::Nic;
use rnic::DeviceAttr;
use std::ffi::{c_char, c_int, CString};

/// The next libibverbs in the process, opened through `ibverbs-nic`.
pub struct Verbs {
    gid: [u8; 16],
    caps: np::nic::DeviceCaps,
}

/// An `ibverbs-nic` error as a shim error (errno EIO, or the verb's own).
fn verbs_err(e: ibverbs_nic::Error) -> ShimError {
    match e {
        ibverbs_nic::Error::Unsupported { .. } => ShimError::Unsupported(e.to_string()),
        ibverbs_nic::Error::Invalid(_) => ShimError::InvalidArgument(e.to_string()),
        e => ShimError::Nic(rnic::Error::Io(format!("NPRDMA_DEVICE=verbs: {e}"))),
    }
}

/// A numeric setting (`None` when unset or empty).
fn env_u8(name: &str) -> Result<Option<u8>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u8>()
            .map(Some)
            .map_err(|_| ShimError::InvalidArgument(format!("{name}={v:?} is not a number"))),
    }
}

/// If the library `lib` is another instance of libnprdma.so, make it a device in
/// `NPRDMA_VERBS_MODE` (default pinned) before anything else calls it and say
/// `false`; refuse this very instance; say `true` (load it isolated, in a new
/// link-map namespace) for any other library: a libibverbs the program links is
/// bound to this library's exports of the names it calls internally.
fn prepare_inner(lib: &str) -> Result<bool> {
    let c = CString::new(lib)
        .map_err(|_| ShimError::InvalidArgument("NPRDMA_VERBS_LIB contains NUL".into()))?;
    // SAFETY: a valid C string; the handle is kept (ibverbs-nic opens the same library
    // and never closes it either: providers keep state for the process's life).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Ok(true); // ibverbs-nic reports why when it opens it
    }
    let sym = c"nprdma_shim_as_device";
    // SAFETY: a live handle and a C string.
    let p = unsafe { libc::dlsym(h, sym.as_ptr()) };
    if p.is_null() {
        return Ok(true); // not libnprdma.so: a real libibverbs
    }
    type AsDevice = unsafe extern "C" fn(*const c_char) -> c_int;
    let own: AsDevice = super::nprdma_shim_as_device;
    if p as usize == own as usize {
        return Err(ShimError::InvalidArgument(format!(
            "NPRDMA_VERBS_LIB={lib} is this libnprdma.so itself; point it at a copy \
             at another path (or at the real libibverbs)"
        )));
    }
    let mode = std::env::var("NPRDMA_VERBS_MODE").unwrap_or_default();
    let mode = if mode.trim().is_empty() {
        "pinned".to_string()
    } else {
        mode.trim().to_string()
    };
    if super::Mode::from_env_value(Some(&mode)).is_err() {
        return Err(ShimError::InvalidArgument(format!(
            "NPRDMA_VERBS_MODE={mode:?} is not a known mode (known: pinned, nprdma)"
        )));
    }
    let cm = CString::new(mode.clone()).expect("no NUL in a known mode");
    // SAFETY: the symbol is `nprdma_shim_as_device` of another instance of this
    // library, whose prototype `AsDevice` spells; `cm` is a C string.
    let rc = unsafe {
        let f: AsDevice = std::mem::transmute::<*mut libc::c_void, AsDevice>(p);
        f(cm.as_ptr())
    };
    if rc != 0 {
        return Err(ShimError::InvalidArgument(format!(
            "{lib} refused to serve as a device in mode {mode:?} (already open in another mode)"
        )));
    }
    Ok(false)
}

impl NpFlavor for Verbs {
    type Nic = VerbsNic;
    const MODE: &'static str = "nprdma-verbs";
    const CTRL_ON_DATA_QP: bool = true;

    fn open() -> Result<(Verbs, VerbsNic)> {
        let mut cfg = Config::default();
        if let Some(p) = env_u8("NPRDMA_VERBS_PORT")? {
            cfg.port = p;
        }
        if let Some(g) = env_u8("NPRDMA_VERBS_GID_INDEX")? {
            cfg.gid_index = g;
        }
        cfg.isolated = prepare_inner(&cfg.lib_name())?;
        let nic = VerbsNic::open(&cfg).map_err(verbs_err)?;
        tracing::info!(
            lib = nic.lib_name(),
            device = nic.device_name(),
            "NP-RDMA over libibverbs"
        );
        Ok((
            Verbs {
                gid: nic.addr().0,
                caps: nic.caps(),
            },
            nic,
        ))
    }

    /// The registration cache keeps at most half of `RLIMIT_MEMLOCK` registered
    /// (a device charges registrations against it, as `ib_umem_get` does), unless
    /// `NPRDMA_REG_CACHE_MB` says otherwise, and leases lend at most a quarter.
    fn tune(cfg: &mut np::Config, explicit_cache: bool) {
        if explicit_cache {
            return;
        }
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: an out-parameter of the right type.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0
            && r.rlim_cur != libc::RLIM_INFINITY
        {
            cfg.reg_cache_bytes = cfg.reg_cache_bytes.min(r.rlim_cur / 2);
            // Leased registrations are charged too.
            cfg.lease_bytes = cfg.lease_bytes.min(r.rlim_cur / 4);
        }
    }

    fn device_attr(&self) -> DeviceAttr {
        let c = &self.caps;
        DeviceAttr {
            // Overridden by NP-RDMA's own limits (`NP_MAX_QP`, `NP_MAX_MR`, ...).
            max_qp: c.max_qp_wr,
            max_qp_wr: c.max_qp_wr,
            max_sge: c.max_sge,
            // The application's CQs are the engine's (in memory).
            max_cq: 1 << 16,
            max_cqe: c.max_cqe,
            max_mr: 1 << 16,
            max_pd: u32::MAX,
            max_inline_data: c.max_inline,
            max_qp_rd_atom: 16,
            max_mr_size: 1 << 40,
            // Atomics run on the target's CPU under the engine's lock.
            atomic_cap: 1,
            max_tlp: c.max_tlp as u32,
            signature_magic: c.magic,
            page_size: c.page_size as u32,
            iova_pages: 0,
        }
    }

    fn gid(&self) -> [u8; 16] {
        self.gid
    }

    fn nic_stats(&self, s: &VerbsStats) -> String {
        format!(
            "verbs_regs={} verbs_reg_failures={} verbs_deregs={} verbs_live_mrs={}",
            s.regs, s.reg_failures, s.deregs, s.live_mrs
        )
    }
}
