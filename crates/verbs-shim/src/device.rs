//! The device, port and GID verbs: device list, open/close (building the
//! `verbs_context` and its ops), query_device(_ex), query_port, GIDs, P_Keys.
//! One device, `nprdma0`: RoCE-like (Ethernet link layer); its GIDs and LID: `gid`.

use crate::datapath;
use crate::error::ShimError;
use crate::ffi::*;
use crate::gid::{check_port, GID_TBL_LEN};
use crate::objects::{device, guard, guard_rc, zeroed, ShimContext};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

pub const DEV_NAME: &str = "nprdma0";
/// A vendor id no perftest device table knows (so perftest uses `ibv_post_send`).
pub const VENDOR_ID: u32 = 0x4e50; // "NP"
pub const VENDOR_PART_ID: u32 = 0x0001;
/// Node GUID (host order).
pub const NODE_GUID: u64 = 0x4e50_5244_4d41_0001;
/// The device's uverbs name (`ibv_device.dev_name`) and its node, which `stat` and
/// `access` answer for (see `devnode`).
pub const DEV_UVERBS: &str = "uverbs0";
pub const DEV_NODE: &str = "/dev/infiniband/uverbs0";

struct DevPtr(*mut ibv_device);

/// The device as rdma-core allocates it: `struct verbs_device` begins with the
/// `ibv_device` and goes on with the provider's fields, which provider libraries
/// read from any device they are asked about (libmlx5's `mlx5dv_is_supported`, which
/// UCX calls on every device, compares `verbs_device.ops` with its own). Here they
/// are all zero (no provider ops), so such a check reads zeroed memory and says no.
#[repr(C)]
struct VerbsDevice {
    device: ibv_device,
    /// `ops`, `refcount`, `entry`, `sysfs`, `core_support` and room to spare.
    provider: [u64; 16],
}
// SAFETY: the device struct is immutable after creation and lives forever.
unsafe impl Send for DevPtr {}
// SAFETY: as above.
unsafe impl Sync for DevPtr {}

fn copy_cstr(dst: &mut [c_char], s: &str) {
    let n = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
}

/// The process's single `ibv_device` (never freed).
pub fn ibv_dev() -> *mut ibv_device {
    static DEV: OnceLock<DevPtr> = OnceLock::new();
    DEV.get_or_init(|| {
        // SAFETY: ibv_device is plain C data (see `zeroed`).
        let mut d: ibv_device = unsafe { zeroed() };
        d.node_type = IBV_NODE_CA;
        d.transport_type = IBV_TRANSPORT_IB;
        copy_cstr(&mut d.name, DEV_NAME);
        copy_cstr(&mut d.dev_name, DEV_UVERBS);
        copy_cstr(
            &mut d.dev_path,
            &format!("/sys/class/infiniband_verbs/{DEV_UVERBS}"),
        );
        copy_cstr(
            &mut d.ibdev_path,
            &format!("/sys/class/infiniband/{DEV_NAME}"),
        );
        let v = Box::into_raw(Box::new(VerbsDevice {
            device: d,
            provider: [0; 16],
        }));
        // SAFETY: `device` is the first field of the leaked allocation.
        DevPtr(unsafe { std::ptr::addr_of_mut!((*v).device) })
    })
    .0
}

#[no_mangle]
pub extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    crate::logging::init();
    let list = Box::new([ibv_dev(), std::ptr::null_mut()]);
    if !num_devices.is_null() {
        // SAFETY: caller-provided out pointer.
        unsafe { *num_devices = 1 };
    }
    Box::into_raw(list) as *mut *mut ibv_device
}

/// # Safety
/// `list` must come from `ibv_get_device_list`.
#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    if !list.is_null() {
        // SAFETY: allocated as Box<[_; 2]> by ibv_get_device_list.
        drop(unsafe { Box::from_raw(list as *mut [*mut ibv_device; 2]) });
    }
}

/// # Safety
/// `dev` must be a device from our list.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    if dev.is_null() {
        return std::ptr::null();
    }
    // SAFETY: a live ibv_device.
    unsafe { (*dev).name.as_ptr() }
}

#[no_mangle]
pub extern "C" fn ibv_get_device_guid(_dev: *mut ibv_device) -> u64 {
    NODE_GUID.to_be()
}

#[no_mangle]
pub extern "C" fn ibv_get_device_index(_dev: *mut ibv_device) -> c_int {
    0
}

/// # Safety
/// `dev` must be a device from our list.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    crate::logging::init();
    guard("ibv_open_device", std::ptr::null_mut(), || {
        if dev != ibv_dev() {
            return Err(ShimError::InvalidArgument("not a libnprdma device".into()));
        }
        // The command fd: a real, private fd standing for the device node
        // (applications dup, poll or pass it; ibv_import_device takes a dup of it).
        let cmd_fd = rustix::fs::memfd_create(CMD_FD_NAME, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| rnic::Error::from(std::io::Error::from(e)))?;
        new_context(cmd_fd)
    })
}

/// The name of a context's command fd (a memfd).
const CMD_FD_NAME: &CStr = c"nprdma-uverbs";

/// A new context of the process device owning `cmd_fd`.
fn new_context(cmd_fd: OwnedFd) -> Result<*mut ibv_context, ShimError> {
    let dev = ibv_dev();
    let d = device()?;
    let cfd = cmd_fd.as_raw_fd();
    let async_fd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::SEMAPHORE,
    )
    .map_err(|e| rnic::Error::from(std::io::Error::from(e)))?;
    // SAFETY: verbs_context is plain C data.
    let mut vctx: verbs_context = unsafe { zeroed() };
    vctx.sz = std::mem::size_of::<verbs_context>() as u64;
    vctx.query_port = Some(query_port_op);
    vctx.query_device_ex = Some(query_device_ex_op);
    vctx.create_qp_ex = Some(crate::resources::create_qp_ex_op);
    vctx.create_cq_ex = Some(crate::cq_ex::create_cq_ex_op);
    if d.odp() {
        vctx.advise_mr = Some(crate::resources::advise_mr_op);
    }
    let c = &mut vctx.context;
    c.device = dev;
    c.cmd_fd = cfd;
    c.async_fd = async_fd.as_raw_fd();
    c.num_comp_vectors = 1;
    c.abi_compat = usize::MAX as *mut c_void;
    datapath::install_ops(&mut c.ops);
    let ctx = Box::into_raw(Box::new(ShimContext {
        vctx,
        dev: d,
        async_fd,
        async_events: Default::default(),
        cmd_fd,
    }));
    // SAFETY: just allocated.
    Ok(unsafe { (*ctx).ibv() })
}

/// Whether `fd` is (a dup of) one of our contexts' command fds.
fn is_cmd_fd(fd: c_int) -> bool {
    let want = format!("/memfd:{} (deleted)", CMD_FD_NAME.to_string_lossy());
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.as_os_str() == std::ffi::OsStr::new(&want))
}

/// A second context on the device from (a dup of) a context's `cmd_fd`; the new
/// context owns `fd` and closes it with `ibv_close_device`. Its PDs and MRs are
/// reached with `ibv_import_pd` / `ibv_import_mr`.
#[no_mangle]
pub extern "C" fn ibv_import_device(fd: c_int) -> *mut ibv_context {
    guard("ibv_import_device", std::ptr::null_mut(), || {
        if fd < 0 || !is_cmd_fd(fd) {
            return Err(ShimError::InvalidArgument(format!(
                "fd {fd} is not a libnprdma command fd"
            )));
        }
        // SAFETY: the caller hands the fd over (as to rdma-core's ibv_import_device).
        new_context(unsafe { OwnedFd::from_raw_fd(fd) })
    })
}

/// # Safety
/// `ctx` must be an open context of ours; all its objects must be destroyed.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard_rc("ibv_close_device", || {
        // SAFETY: caller contract.
        let s = unsafe { ShimContext::from_ibv(ctx)? } as *const ShimContext as *mut ShimContext;
        // SAFETY: allocated by ibv_open_device with Box.
        drop(unsafe { Box::from_raw(s) });
        Ok(())
    })
}

fn fill_device_attr(dev: &dyn crate::backend::Device, a: &mut ibv_device_attr) {
    let d = dev.attr();
    let clamp = |v: u32| v.min(i32::MAX as u32) as c_int;
    copy_cstr(&mut a.fw_ver, &format!("libnprdma 0.1 ({})", dev.mode()));
    a.node_guid = NODE_GUID.to_be();
    a.sys_image_guid = NODE_GUID.to_be();
    a.max_mr_size = d.max_mr_size;
    a.page_size_cap = d.page_size as u64;
    a.vendor_id = VENDOR_ID;
    a.vendor_part_id = VENDOR_PART_ID;
    a.hw_ver = 1;
    a.max_qp = clamp(d.max_qp);
    a.max_qp_wr = clamp(d.max_qp_wr);
    a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN;
    a.max_sge = clamp(d.max_sge);
    a.max_sge_rd = clamp(d.max_sge);
    a.max_cq = clamp(d.max_cq);
    a.max_cqe = clamp(d.max_cqe);
    a.max_mr = clamp(d.max_mr);
    a.max_pd = clamp(d.max_pd);
    a.max_qp_rd_atom = clamp(d.max_qp_rd_atom);
    a.max_res_rd_atom = clamp(d.max_qp_rd_atom.saturating_mul(d.max_qp));
    a.max_qp_init_rd_atom = clamp(d.max_qp_rd_atom);
    a.atomic_cap = if d.atomic_cap == 1 {
        IBV_ATOMIC_HCA
    } else {
        IBV_ATOMIC_NONE
    };
    a.max_pkeys = 1;
    a.phys_port_cnt = 1;
    if dev.address_handles() {
        // An address handle is a destination address, nothing of the NIC's: no limit
        // but the C type's (as mlx5 reports).
        a.max_ah = c_int::MAX;
    }
    if let Some((wr, sge)) = dev.srq_limits() {
        a.max_srq = clamp(d.max_qp);
        a.max_srq_wr = clamp(wr);
        a.max_srq_sge = clamp(sge);
    }
}

/// # Safety
/// `ctx` an open context; `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    guard_rc("ibv_query_device", || {
        // SAFETY: caller contract.
        let s = unsafe { ShimContext::from_ibv(ctx)? };
        if attr.is_null() {
            return Err(ShimError::InvalidArgument("NULL attr".into()));
        }
        // SAFETY: plain C data.
        let mut a: ibv_device_attr = unsafe { zeroed() };
        fill_device_attr(&*s.dev, &mut a);
        // SAFETY: caller-provided out struct.
        unsafe { *attr = a };
        Ok(())
    })
}

unsafe extern "C" fn query_device_ex_op(
    ctx: *mut ibv_context,
    _input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: u64,
) -> c_int {
    let attr_size = attr_size as usize;
    guard_rc("ibv_query_device_ex", || {
        // SAFETY: caller contract (libibverbs inline passes its context).
        let s = unsafe { ShimContext::from_ibv(ctx)? };
        let orig = std::mem::size_of::<ibv_device_attr>();
        if attr.is_null() || attr_size < orig {
            return Err(ShimError::InvalidArgument(
                "ibv_device_attr_ex too small".into(),
            ));
        }
        // SAFETY: plain C data.
        let mut a: ibv_device_attr_ex = unsafe { zeroed() };
        fill_device_attr(&*s.dev, &mut a.orig_attr);
        a.phys_port_cnt_ex = 1;
        if s.dev.odp() {
            // Explicit (not implicit) ODP MRs on RC QPs: NP-RDMA MRs are never pinned.
            a.odp_caps.general_caps = IBV_ODP_SUPPORT as u64;
            a.odp_caps.per_transport_caps.rc_odp_caps = IBV_ODP_SUPPORT_SEND
                | IBV_ODP_SUPPORT_RECV
                | IBV_ODP_SUPPORT_WRITE
                | IBV_ODP_SUPPORT_READ
                | IBV_ODP_SUPPORT_ATOMIC;
            if s.dev.srq_limits().is_some() {
                a.odp_caps.per_transport_caps.rc_odp_caps |= IBV_ODP_SUPPORT_SRQ_RECV;
            }
        }
        let n = attr_size.min(std::mem::size_of::<ibv_device_attr_ex>());
        // SAFETY: the caller's struct has attr_size bytes; we copy at most that.
        unsafe {
            std::ptr::write_bytes(attr as *mut u8, 0, attr_size);
            std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, attr as *mut u8, n);
        }
        Ok(())
    })
}

fn port_attr(lid: u16) -> ibv_port_attr {
    // SAFETY: plain C data.
    let mut p: ibv_port_attr = unsafe { zeroed() };
    p.state = IBV_PORT_ACTIVE;
    // The port's LID in the host's subnet (its "subnet manager" is the registry:
    // LID 1 plays the SM's), 0 without one, as RoCE ports report.
    p.lid = lid;
    p.sm_lid = if lid != 0 { 1 } else { 0 };
    p.lmc = 0;
    p.max_mtu = IBV_MTU_4096;
    p.active_mtu = IBV_MTU_4096;
    p.gid_tbl_len = GID_TBL_LEN;
    p.max_msg_sz = 1 << 31;
    p.pkey_tbl_len = 1;
    p.max_vl_num = 1;
    p.active_width = 2; // 4x
    p.active_speed = 32; // EDR
    p.phys_state = 5; // LinkUp
    p.link_layer = IBV_LINK_LAYER_ETHERNET as u8;
    p
}

unsafe extern "C" fn query_port_op(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: u64,
) -> c_int {
    let len = len as usize;
    guard_rc("ibv_query_port", || {
        check_port(ctx, port)?;
        if attr.is_null() {
            return Err(ShimError::InvalidArgument("NULL port attr".into()));
        }
        // SAFETY: checked by check_port.
        let p = port_attr(crate::gid::lid(unsafe { ShimContext::from_ibv(ctx)? }));
        let n = len.min(std::mem::size_of::<ibv_port_attr>());
        // SAFETY: the caller's struct has len bytes; we write at most that.
        unsafe {
            std::ptr::write_bytes(attr as *mut u8, 0, len);
            std::ptr::copy_nonoverlapping(&p as *const _ as *const u8, attr as *mut u8, n);
        }
        Ok(())
    })
}

/// The exported `ibv_query_port` (`struct _compat_ibv_port_attr` is opaque in verbs.h;
/// libibverbs' own version lets the provider fill a whole `struct ibv_port_attr`, the
/// layout every caller allocates).
///
/// # Safety
/// `attr` points at a `struct ibv_port_attr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded; see above for the size.
    unsafe {
        query_port_op(
            ctx,
            port,
            attr as *mut ibv_port_attr,
            std::mem::size_of::<ibv_port_attr>() as u64,
        )
    }
}

/// # Safety
/// `pkey` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if check_port(ctx, port).is_err() || index != 0 || pkey.is_null() {
        crate::error::set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: caller-provided out value.
    unsafe { *pkey = 0xffffu16.to_be() };
    0
}

#[no_mangle]
pub extern "C" fn ibv_get_pkey_index(_ctx: *mut ibv_context, _port: u8, pkey: u16) -> c_int {
    if pkey == 0xffffu16.to_be() {
        0
    } else {
        -1
    }
}

/// No sysfs exists for this device: every read fails with ENOENT (callers fall back).
///
/// # Safety
/// C strings valid.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    if std::env::var_os("NPRDMA_TRACE").is_some() && !dir.is_null() && !file.is_null() {
        // SAFETY: caller passes NUL-terminated strings.
        let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        eprintln!("libnprdma: ibv_read_sysfs_file({d:?}, {f:?}): no sysfs for {DEV_NAME}");
    }
    crate::error::set_errno(libc::ENOENT);
    -1
}
