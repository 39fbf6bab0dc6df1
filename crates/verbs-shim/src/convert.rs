//! Conversions between libibverbs C structs and the backend's verbs values: QP
//! attributes (the address vector's GID carries the peer NIC's address), work
//! requests and work completions.

use crate::error::ShimError;
use crate::ffi::*;
use rnic::{Access, HostAddr, QpAttr, QpAttrMask, QpState, Sge, Wc, WrOpcode};

/// `enum ibv_mtu` -> bytes.
pub fn mtu_bytes(m: u32) -> Result<u32, ShimError> {
    match m {
        1..=5 => Ok(128 << m),
        _ => Err(ShimError::InvalidArgument(format!("path_mtu {m}"))),
    }
}

/// Bytes -> `enum ibv_mtu` (0 when unset).
pub fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        4096 => 5,
        _ => 0,
    }
}

/// All mask bits up to `IBV_QP_DEST_QPN` (the ones rnic's QP model knows).
const KNOWN_MASK: u32 = (1 << 21) - 1;

/// `ibv_modify_qp` arguments -> backend attributes + mask.
pub fn qp_attr_from_c(
    a: &ibv_qp_attr,
    mask: i32,
    resolve: impl FnOnce(&ibv_ah_attr, u32) -> Result<HostAddr, ShimError>,
) -> Result<(QpAttr, QpAttrMask), ShimError> {
    let mask = mask as u32;
    if mask & !KNOWN_MASK != 0 {
        return Err(ShimError::Unsupported(format!(
            "ibv_modify_qp attribute mask bits {:#x} (rate limit / extended attributes)",
            mask & !KNOWN_MASK
        )));
    }
    let m = QpAttrMask::from_bits_truncate(mask);
    if m.intersects(QpAttrMask::ALT_PATH | QpAttrMask::PATH_MIG_STATE) {
        return Err(ShimError::Unsupported(
            "alternate paths / path migration".into(),
        ));
    }
    let mut out = QpAttr {
        qp_state: QpState::from_u32(a.qp_state),
        cur_qp_state: QpState::from_u32(a.cur_qp_state),
        qp_access_flags: Access::from_bits_truncate(a.qp_access_flags),
        pkey_index: a.pkey_index,
        port_num: a.port_num,
        dest_qp_num: a.dest_qp_num,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        qkey: a.qkey,
        ..Default::default()
    };
    if m.contains(QpAttrMask::STATE) && a.qp_state > IBV_QPS_ERR {
        return Err(ShimError::InvalidArgument(format!(
            "qp_state {}",
            a.qp_state
        )));
    }
    if m.contains(QpAttrMask::PATH_MTU) {
        out.path_mtu = mtu_bytes(a.path_mtu)?;
    }
    if m.contains(QpAttrMask::PORT) && a.port_num != 1 {
        return Err(ShimError::InvalidArgument(format!(
            "port_num {}",
            a.port_num
        )));
    }
    if m.contains(QpAttrMask::AV) {
        out.dest = Some(resolve(&a.ah_attr, a.dest_qp_num)?);
    }
    Ok((out, m))
}

/// Backend attributes -> `ibv_qp_attr` (for `ibv_query_qp`).
pub fn qp_attr_to_c(a: &QpAttr, cap: ibv_qp_cap) -> ibv_qp_attr {
    // SAFETY: plain C data.
    let mut o: ibv_qp_attr = unsafe { crate::objects::zeroed() };
    o.qp_state = a.qp_state as u32;
    o.cur_qp_state = a.cur_qp_state as u32;
    o.path_mtu = mtu_enum(a.path_mtu);
    o.rq_psn = a.rq_psn;
    o.sq_psn = a.sq_psn;
    o.dest_qp_num = a.dest_qp_num;
    o.qp_access_flags = a.qp_access_flags.bits();
    o.cap = cap;
    if let Some(d) = a.dest {
        o.ah_attr.is_global = 1;
        o.ah_attr.grh.dgid.raw = d.to_bytes();
        o.ah_attr.grh.hop_limit = 1;
    }
    o.ah_attr.port_num = 1;
    o.pkey_index = a.pkey_index;
    o.max_rd_atomic = a.max_rd_atomic;
    o.max_dest_rd_atomic = a.max_dest_rd_atomic;
    o.min_rnr_timer = a.min_rnr_timer;
    o.port_num = a.port_num;
    o.timeout = a.timeout;
    o.retry_cnt = a.retry_cnt;
    o.rnr_retry = a.rnr_retry;
    o.qkey = a.qkey;
    o
}

/// The backend opcode of a send WR.
///
/// # Safety
/// `w` must be a valid `ibv_send_wr` (the unions are read per its opcode).
pub unsafe fn wr_opcode(w: &ibv_send_wr) -> Result<(WrOpcode, u64, u32), ShimError> {
    // SAFETY: the opcode says which member the caller filled; all members are plain integers.
    let imm = unsafe { w.__bindgen_anon_1.imm_data };
    // SAFETY: the opcode says which member the caller filled; all members are plain integers.
    let (rdma_addr, rdma_rkey) = unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) };
    // SAFETY: the opcode says which member the caller filled; all members are plain integers.
    let at = unsafe { w.wr.atomic };
    Ok(match w.opcode {
        IBV_WR_RDMA_WRITE => (WrOpcode::Write, rdma_addr, rdma_rkey),
        IBV_WR_RDMA_WRITE_WITH_IMM => (WrOpcode::WriteImm(imm), rdma_addr, rdma_rkey),
        IBV_WR_SEND => (WrOpcode::Send, 0, 0),
        IBV_WR_SEND_WITH_IMM => (WrOpcode::SendImm(imm), 0, 0),
        IBV_WR_RDMA_READ => (WrOpcode::Read, rdma_addr, rdma_rkey),
        IBV_WR_ATOMIC_CMP_AND_SWP => (
            WrOpcode::CmpSwap {
                compare: at.compare_add,
                swap: at.swap,
            },
            at.remote_addr,
            at.rkey,
        ),
        IBV_WR_ATOMIC_FETCH_AND_ADD => (WrOpcode::FetchAdd { add: at.compare_add }, at.remote_addr, at.rkey),
        op => {
            return Err(ShimError::Unsupported(format!(
                "send opcode {op} (supported: RDMA_WRITE[_WITH_IMM], SEND[_WITH_IMM], RDMA_READ, ATOMIC_CMP_AND_SWP, ATOMIC_FETCH_AND_ADD)"
            )))
        }
    })
}

/// Copy `n` C SGEs into `out` (at most `out.len()`).
///
/// # Safety
/// `sg` must point at `n` valid `ibv_sge`s (or `n == 0`).
pub unsafe fn sges(sg: *const ibv_sge, n: i32, out: &mut [Sge]) -> Result<&[Sge], ShimError> {
    if n < 0 || n as usize > out.len() {
        return Err(ShimError::InvalidArgument(format!("num_sge {n}")));
    }
    if n > 0 && sg.is_null() {
        return Err(ShimError::InvalidArgument("NULL sg_list".into()));
    }
    for (i, o) in out.iter_mut().take(n as usize).enumerate() {
        // SAFETY: i < n, per the contract.
        let s = unsafe { &*sg.add(i) };
        *o = Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        };
    }
    Ok(&out[..n as usize])
}

/// A backend completion -> `ibv_wc`.
pub fn wc_to_c(w: &Wc) -> ibv_wc {
    // SAFETY: plain C data.
    let mut o: ibv_wc = unsafe { crate::objects::zeroed() };
    o.wr_id = w.wr_id;
    o.status = w.status as u32;
    o.opcode = w.opcode as u32;
    o.vendor_err = w.vendor_err;
    o.byte_len = w.byte_len;
    o.__bindgen_anon_1.imm_data = w.imm_data;
    o.qp_num = w.qp_num;
    o.src_qp = w.src_qp;
    o.slid = slid(w);
    o.wc_flags = w.wc_flags.bits();
    o
}

/// The sender's LID of a received datagram: the LID whose range holds its QP number
/// (`rnic::subnet`; 0 for other completions and senders in no subnet).
pub fn slid(w: &Wc) -> u16 {
    if w.src_qp != 0 {
        rnic::subnet::lid_of_qpn(w.src_qp)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_roundtrip() {
        for e in 1..=5 {
            assert_eq!(mtu_enum(mtu_bytes(e).unwrap()), e);
        }
        assert!(mtu_bytes(0).is_err() && mtu_bytes(6).is_err());
    }

    #[test]
    fn modify_attr_av_carries_host_addr() {
        // SAFETY: plain C data.
        let mut a: ibv_qp_attr = unsafe { crate::objects::zeroed() };
        let h = HostAddr {
            pid: 42,
            fd: 7,
            nonce: 0x1122_3344_5566_7788,
        };
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = IBV_MTU_1024;
        a.dest_qp_num = 0x123;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = h.to_bytes();
        let mask = (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN) as i32;
        let by_gid = |av: &ibv_ah_attr, _qpn: u32| {
            // SAFETY: byte view of the GID union.
            Ok(HostAddr::from_bytes(unsafe { &av.grh.dgid.raw }))
        };
        let (r, m) = qp_attr_from_c(&a, mask, by_gid).unwrap();
        assert_eq!(r.dest, Some(h));
        assert_eq!(
            (r.path_mtu, r.dest_qp_num, r.qp_state),
            (1024, 0x123, QpState::Rtr)
        );
        assert!(m.contains(QpAttrMask::AV | QpAttrMask::DEST_QPN));
        let back = qp_attr_to_c(&r, a.cap);
        // SAFETY: byte view of the GID union.
        assert_eq!(unsafe { back.ah_attr.grh.dgid.raw }, h.to_bytes());
        assert_eq!(back.path_mtu, IBV_MTU_1024);
        // The resolver's refusal is the verb's; it sees the destination QP.
        let refuse = |_: &ibv_ah_attr, qpn: u32| {
            assert_eq!(qpn, 0x123);
            Err(ShimError::InvalidArgument("no such LID".into()))
        };
        assert!(matches!(
            qp_attr_from_c(&a, mask, refuse),
            Err(ShimError::InvalidArgument(_))
        ));
        // Rate limit: refused.
        assert!(matches!(
            qp_attr_from_c(&a, (IBV_QP_STATE | IBV_QP_RATE_LIMIT) as i32, by_gid),
            Err(ShimError::Unsupported(_))
        ));
    }

    #[test]
    fn send_wr_opcodes() {
        // SAFETY: plain C data.
        let mut w: ibv_send_wr = unsafe { crate::objects::zeroed() };
        w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
        w.wr.atomic = ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: 0x1000,
            compare_add: 5,
            swap: 0,
            rkey: 9,
        };
        // SAFETY: a valid WR.
        let (op, addr, rkey) = unsafe { wr_opcode(&w) }.unwrap();
        assert_eq!((op, addr, rkey), (WrOpcode::FetchAdd { add: 5 }, 0x1000, 9));
        w.opcode = IBV_WR_LOCAL_INV;
        assert!(matches!(
            // SAFETY: a valid WR.
            unsafe { wr_opcode(&w) },
            Err(ShimError::Unsupported(_))
        ));
    }

    #[test]
    fn sge_bounds() {
        let c = [ibv_sge {
            addr: 1,
            length: 2,
            lkey: 3,
        }; 3];
        let mut out = [Sge::default(); 2];
        // SAFETY: c has 3 entries.
        assert!(unsafe { sges(c.as_ptr(), 3, &mut out) }.is_err());
        // SAFETY: as above.
        let s = unsafe { sges(c.as_ptr(), 2, &mut out) }.unwrap();
        assert_eq!(
            s[1],
            Sge {
                addr: 1,
                length: 2,
                lkey: 3
            }
        );
        // SAFETY: n = -1 is rejected before any read.
        assert!(unsafe { sges(c.as_ptr(), -1, &mut out) }.is_err());
    }
}
