//! The verbs objects the CM works with: the device context ids are bound to
//! (`id->verbs`, opened once per process), the default PD, the CQs and QP
//! `rdma_create_qp` makes, the attributes of each QP transition
//! (`rdma_init_qp_attr`, librdmacm's and the IB CM's rules) and applying them.

use super::id::{CmId, Phase, State};
use crate::device::{ibv_get_device_list, ibv_open_device, ibv_query_device};
use crate::ffi::*;
use crate::resources::{
    create_qp_ex_op, ibv_alloc_pd, ibv_create_comp_channel, ibv_create_cq,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_destroy_qp, ibv_modify_qp,
};

/// The Q_Key of RDMA_PS_UDP ids (librdmacm's RDMA_UDP_QKEY).
pub const UDP_QKEY: u32 = 0x0123_4567;
/// The IB CM's default local ACK timeout (4.096 µs × 2^14 ≈ 67 ms).
const ACK_TIMEOUT: u8 = 14;

struct Dev {
    ctx: usize,
    pd: usize,
    max_rd_atom: u8,
}

/// The CM's context and default PD (per process: a forked child opens its own).
static DEV: crate::per_process::PerProcess<Result<Dev, i32>> =
    crate::per_process::PerProcess::new();

fn dev() -> Result<&'static Dev, i32> {
    DEV.get_or_init(|| {
        // SAFETY: our own exports, called as an application would.
        unsafe {
            let list = ibv_get_device_list(std::ptr::null_mut());
            if list.is_null() || (*list).is_null() {
                return Err(libc::ENODEV);
            }
            let ctx = ibv_open_device(*list);
            crate::device::ibv_free_device_list(list);
            if ctx.is_null() {
                return Err(libc::ENODEV);
            }
            let pd = ibv_alloc_pd(ctx);
            if pd.is_null() {
                return Err(libc::ENOMEM);
            }
            let mut a: ibv_device_attr = std::mem::zeroed();
            let max_rd_atom = if ibv_query_device(ctx, &mut a) == 0 {
                a.max_qp_rd_atom.clamp(1, 255) as u8
            } else {
                1
            };
            Ok(Dev {
                ctx: ctx as usize,
                pd: pd as usize,
                max_rd_atom,
            })
        }
    })
    .as_ref()
    .map_err(|e| *e)
}

/// The context every id is bound to (the one device).
pub fn context() -> Result<*mut ibv_context, i32> {
    dev().map(|d| d.ctx as *mut ibv_context)
}

/// Give `c` the device (`id->verbs`) and its default PD (`id->pd`), as librdmacm's
/// `ucma_get_device` does once an id has an address.
pub fn attach(c: &mut CmId) -> Result<(), i32> {
    c.id.verbs = context()?;
    if c.id.pd.is_null() {
        c.id.pd = default_pd()?;
    }
    Ok(())
}

/// This device's GID 0 (what the peer's QP is told to address this side's QPs by).
pub fn gid0() -> [u8; 16] {
    let Ok(ctx) = context() else { return [0; 16] };
    // SAFETY: plain C data; our own export on our context.
    unsafe {
        let mut g: ibv_gid = std::mem::zeroed();
        if crate::gid::ibv_query_gid(ctx, 1, 0, &mut g) != 0 {
            return [0; 16];
        }
        g.raw
    }
}

/// The GID a connection's QPs are addressed by, from its local address `local`: the
/// IP GID of that address when the port has it (as rdma_cm over RoCE does: the peer
/// then reaches this host over whatever joins the two — the same-host transport, or
/// RoCEv2 across the network), else GID 0. With its index in the GID table.
pub fn gid_for(local: Option<&std::net::SocketAddr>) -> ([u8; 16], u8) {
    let ctx = context().ok();
    local
        .map(|a| crate::netif::gid_of_ip(a.ip()))
        .and_then(|g| {
            ctx.and_then(|c| crate::gid::index_of(c, &g))
                .map(|i| (g, i))
        })
        .unwrap_or_else(|| (gid0(), 0))
}

/// The PD a QP gets when the application names none.
pub fn default_pd() -> Result<*mut ibv_pd, i32> {
    dev().map(|d| d.pd as *mut ibv_pd)
}

/// The device's READ/atomic depth limit (`max_qp_rd_atom`).
pub fn max_rd_atom() -> u8 {
    dev().map_or(1, |d| d.max_rd_atom)
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `rdma_create_qp_ex`: a QP for `c` on `attr.pd` (or `c`'s PD, or the default),
/// with CQs (and completion channels) made for it when `attr` names none, moved to
/// INIT (UD: through to RTS), recorded in `id->qp`, `id->pd`, `id->*_cq*`.
///
/// # Safety
/// `attr` is valid; `c` is a live id whose state `st` is (locked by the caller).
pub unsafe fn create_qp(
    c: &mut CmId,
    st: &mut State,
    attr: &mut ibv_qp_init_attr_ex,
) -> Result<(), i32> {
    if !c.id.qp.is_null() {
        return Err(libc::EINVAL);
    }
    let mut pd = attr.pd;
    if pd.is_null() {
        pd = if c.id.pd.is_null() {
            default_pd()?
        } else {
            c.id.pd
        };
    }
    // SAFETY: a PD of ours (checked by ibv_create_qp below as well).
    if unsafe { (*pd).context } != context()? {
        return Err(libc::EINVAL);
    }
    let mut init = *attr;
    init.pd = pd;
    init.comp_mask |= IBV_QP_INIT_ATTR_PD;
    if init.qp_type == 0 {
        init.qp_type = c.id.qp_type;
    }
    let mut made = Vec::new();
    if init.send_cq.is_null() || init.recv_cq.is_null() {
        // librdmacm's ucma_create_cqs: one channel + CQ per direction, sized to the QP.
        for (send, n) in [(false, init.cap.max_recv_wr), (true, init.cap.max_send_wr)] {
            if (send && !init.send_cq.is_null()) || (!send && !init.recv_cq.is_null()) {
                continue;
            }
            // SAFETY: our own exports on our context.
            let ch = unsafe { ibv_create_comp_channel(context()?) };
            if ch.is_null() {
                let e = errno();
                // SAFETY: the objects made above, unused.
                unsafe { undo(&made) };
                return Err(e);
            }
            // SAFETY: our own export on our context and the channel just made.
            let cq =
                unsafe { ibv_create_cq(context()?, n.max(1) as i32, std::ptr::null_mut(), ch, 0) };
            if cq.is_null() {
                let e = errno();
                // SAFETY: the channel and objects made above, unused.
                unsafe {
                    ibv_destroy_comp_channel(ch);
                    undo(&made);
                }
                return Err(e);
            }
            made.push((cq, ch));
            if send {
                init.send_cq = cq;
                c.id.send_cq = cq;
                c.id.send_cq_channel = ch;
            } else {
                init.recv_cq = cq;
                c.id.recv_cq = cq;
                c.id.recv_cq_channel = ch;
            }
        }
    }
    // SAFETY: valid PD and attributes, our context.
    let qp = unsafe { create_qp_ex_op(context()?, &mut init) };
    if qp.is_null() {
        let e = errno();
        // SAFETY: the objects made above, unused.
        unsafe { undo(&made) };
        return Err(e);
    }
    attr.cap = init.cap;
    c.id.qp = qp;
    tracing::debug!(
        id = c as *const CmId as usize,
        qp = qp as usize,
        "rdma_create_qp"
    );
    c.id.pd = pd;
    c.id.qp_type = init.qp_type;
    for (cq, ch) in made {
        st.owned.cqs.push(cq);
        st.owned.channels.push(ch);
    }
    let r = if init.qp_type == IBV_QPT_UD {
        [IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS]
            .iter()
            // SAFETY: the QP just made, the id's state locked by the caller.
            .try_for_each(|s| unsafe { apply(c, st, *s) })
    } else {
        // SAFETY: as above.
        unsafe { apply(c, st, IBV_QPS_INIT) }
    };
    if let Err(e) = r {
        // SAFETY: as above.
        unsafe { destroy_qp(c, st) };
        return Err(e);
    }
    Ok(())
}

unsafe fn undo(made: &[(*mut ibv_cq, *mut ibv_comp_channel)]) {
    for (cq, ch) in made {
        // SAFETY: just made by us, unused.
        unsafe {
            ibv_destroy_cq(*cq);
            ibv_destroy_comp_channel(*ch);
        }
    }
}

/// `rdma_destroy_qp`: the QP, then the CQs and channels the CM made for it.
///
/// # Safety
/// `c` is a live id whose state `st` is.
pub unsafe fn destroy_qp(c: &mut CmId, st: &mut State) {
    if !c.id.qp.is_null() {
        // SAFETY: the id's QP.
        unsafe { ibv_destroy_qp(c.id.qp) };
        c.id.qp = std::ptr::null_mut();
    }
    for cq in st.owned.cqs.drain(..) {
        // SAFETY: made by create_qp, its QP gone.
        unsafe { ibv_destroy_cq(cq) };
    }
    for ch in st.owned.channels.drain(..) {
        // SAFETY: as above.
        unsafe { ibv_destroy_comp_channel(ch) };
    }
    c.id.send_cq = std::ptr::null_mut();
    c.id.recv_cq = std::ptr::null_mut();
    c.id.send_cq_channel = std::ptr::null_mut();
    c.id.recv_cq_channel = std::ptr::null_mut();
}

/// `rdma_init_qp_attr`: the attributes (and mask) that move `c`'s QP to `state`.
pub fn init_attr(c: &CmId, st: &State, state: u32) -> Result<(ibv_qp_attr, i32), i32> {
    // SAFETY: plain C data.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = state;
    let ud = c.id.qp_type == IBV_QPT_UD;
    let mask = match state {
        IBV_QPS_INIT => {
            a.pkey_index = 0;
            a.port_num = 1;
            if ud {
                a.qkey = UDP_QKEY;
                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY
            } else {
                // Before a peer exists, no remote access (the CM's INIT); once the
                // connection is negotiated, the IB CM's: WRITE, and READ/atomics
                // when this side offers responder resources.
                if st.remote.is_some() {
                    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
                    if st.mine.responder_resources > 0 {
                        a.qp_access_flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
                    }
                }
                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
            }
        }
        IBV_QPS_RTR if ud => IBV_QP_STATE,
        IBV_QPS_RTR => {
            let r = st.remote.as_ref().ok_or(libc::EINVAL)?;
            a.path_mtu = IBV_MTU_4096; // the port's active MTU
            a.dest_qp_num = r.qpn;
            a.rq_psn = r.psn;
            a.max_dest_rd_atomic = st.mine.responder_resources;
            a.min_rnr_timer = 0;
            a.ah_attr.is_global = 1;
            a.ah_attr.port_num = 1;
            a.ah_attr.grh.dgid.raw = r.gid;
            a.ah_attr.grh.sgid_index = gid_for(st.local.as_ref()).1;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = st.opts.tos;
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER
        }
        IBV_QPS_RTS => {
            a.sq_psn = st.psn;
            if ud {
                IBV_QP_STATE | IBV_QP_SQ_PSN
            } else {
                if st.remote.is_none() {
                    return Err(libc::EINVAL);
                }
                a.timeout = st.opts.ack_timeout.unwrap_or(ACK_TIMEOUT);
                a.retry_cnt = st.mine.retry_count.min(7);
                a.rnr_retry = st.mine.rnr_retry_count.min(7);
                a.max_rd_atomic = st.mine.initiator_depth;
                IBV_QP_STATE
                    | IBV_QP_SQ_PSN
                    | IBV_QP_TIMEOUT
                    | IBV_QP_RETRY_CNT
                    | IBV_QP_RNR_RETRY
                    | IBV_QP_MAX_QP_RD_ATOMIC
            }
        }
        IBV_QPS_ERR | IBV_QPS_RESET => IBV_QP_STATE,
        _ => return Err(libc::EINVAL),
    };
    Ok((a, mask as i32))
}

/// Move `c`'s QP to `state` with [`init_attr`]'s attributes (no QP: nothing to do).
///
/// # Safety
/// `c` is a live id whose state `st` is.
pub unsafe fn apply(c: &CmId, st: &State, state: u32) -> Result<(), i32> {
    // No QP, or one the application destroyed with ibv_destroy_qp: nothing to move.
    if !crate::objects::qp_live(c.id.qp) {
        return Ok(());
    }
    let (mut a, mask) = init_attr(c, st, state)?;
    // SAFETY: the id's QP and valid attributes.
    match unsafe { ibv_modify_qp(c.id.qp, &mut a, mask) } {
        0 => Ok(()),
        e => Err(e),
    }
}

/// The connected QP's way up once the peer's parameters are known: INIT again with
/// the negotiated access (as librdmacm re-applies INIT), RTR, RTS.
///
/// # Safety
/// As [`apply`].
pub unsafe fn connect_qp(c: &CmId, st: &State) -> Result<(), i32> {
    if c.id.qp_type == IBV_QPT_UD {
        return Ok(());
    }
    // SAFETY: per the contract.
    unsafe {
        apply(c, st, IBV_QPS_INIT)?;
        apply(c, st, IBV_QPS_RTR)?;
        apply(c, st, IBV_QPS_RTS)
    }
}

/// The QP to ERR (a disconnect): outstanding work flushes.
///
/// # Safety
/// As [`apply`].
pub unsafe fn error_qp(c: &CmId, st: &State) {
    if matches!(st.phase, Phase::Idle) {
        return;
    }
    // SAFETY: per the contract; a QP already in ERR or RESET answers harmlessly.
    let _ = unsafe { apply(c, st, IBV_QPS_ERR) };
}
