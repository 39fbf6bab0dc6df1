//! In-process tests of the exported C ABI, driven exactly as a C program would (the
//! data path through `ibv_context.ops` like libibverbs' inline functions): a loopback
//! RC connection moving data, completion events, and the refusal paths with errnos.

use crate::device::*;
use crate::ffi::*;
use crate::gid::*;
use crate::objects::zeroed;
use crate::resources::*;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

pub(crate) fn errno() -> i32 {
    // SAFETY: this thread's errno slot.
    unsafe { *libc::__errno_location() }
}

pub(crate) struct Env {
    pub(crate) ctx: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
}

pub(crate) fn open() -> Env {
    // SAFETY: the calls follow the libibverbs contract (valid pointers, our objects).
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        assert_eq!(n, 1);
        assert!((*list.add(1)).is_null());
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        assert!(!ctx.is_null());
        assert_eq!((*ctx).abi_compat as usize, usize::MAX);
        let pd = ibv_alloc_pd(ctx);
        assert!(!pd.is_null());
        Env { ctx, pd }
    }
}

pub(crate) unsafe fn make_qp(e: &Env, cq: *mut ibv_cq) -> *mut ibv_qp {
    // SAFETY: plain C data.
    let mut a: ibv_qp_init_attr = unsafe { zeroed() };
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 16;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = 64;
    // SAFETY: valid PD and attr.
    let qp = unsafe { ibv_create_qp(e.pd, &mut a) };
    assert!(!qp.is_null());
    qp
}

/// RESET -> INIT -> RTR (to `dest_qpn` at our own GID) -> RTS.
unsafe fn connect(e: &Env, qp: *mut ibv_qp, dest_qpn: u32) {
    // SAFETY: as in a C program.
    unsafe { connect_to(qp, own_gid(e), dest_qpn) }
}

/// This device's GID.
pub(crate) fn own_gid(e: &Env) -> ibv_gid {
    // SAFETY: as in a C program.
    unsafe {
        let mut gid: ibv_gid = zeroed();
        assert_eq!(ibv_query_gid(e.ctx, 1, 0, &mut gid), 0);
        gid
    }
}

/// RESET -> INIT -> RTR (to `dest_qpn` at `gid`) -> RTS, remote READ / WRITE /
/// atomics allowed.
pub(crate) unsafe fn connect_to(qp: *mut ibv_qp, gid: ibv_gid, dest_qpn: u32) {
    // SAFETY: as in a C program.
    unsafe {
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_INIT;
        a.port_num = 1;
        a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE
            | IBV_ACCESS_REMOTE_READ
            | IBV_ACCESS_REMOTE_ATOMIC
            | IBV_ACCESS_LOCAL_WRITE;
        let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as c_int), 0);
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = IBV_MTU_1024;
        a.dest_qp_num = dest_qpn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 1;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = gid;
        a.ah_attr.port_num = 1;
        let m = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as c_int), 0);
        let mut a: ibv_qp_attr = zeroed();
        a.qp_state = IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 1;
        let m = IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as c_int), 0);
        assert_eq!((*qp).state, IBV_QPS_RTS);
    }
}

/// Two RC QPs on `cq`, connected to each other.
unsafe fn qp_pair(e: &Env, cq: *mut ibv_cq) -> (*mut ibv_qp, *mut ibv_qp) {
    // SAFETY: as in a C program.
    unsafe {
        let (a, b) = (make_qp(e, cq), make_qp(e, cq));
        connect(e, a, (*b).qp_num);
        connect(e, b, (*a).qp_num);
        (a, b)
    }
}

/// A 64-entry CQ (no channel) and two QPs on it connected to each other.
unsafe fn loopback(e: &Env) -> (*mut ibv_cq, *mut ibv_qp, *mut ibv_qp) {
    // SAFETY: as in a C program.
    unsafe {
        let cq = ibv_create_cq(e.ctx, 64, null_mut(), null_mut(), 0);
        assert!(!cq.is_null());
        let (a, b) = qp_pair(e, cq);
        (cq, a, b)
    }
}

/// The SGE of `length` bytes at `addr` under `lkey`.
pub(crate) fn sge(addr: u64, length: u32, lkey: u32) -> ibv_sge {
    ibv_sge { addr, length, lkey }
}

/// A send WR `wr_id` of `opcode` with `flags` over the one SGE `sge` (which must
/// outlive its posts).
pub(crate) fn send_wr(wr_id: u64, opcode: u32, flags: u32, sge: &mut ibv_sge) -> ibv_send_wr {
    // SAFETY: plain C data.
    let mut wr: ibv_send_wr = unsafe { zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = flags;
    wr
}

/// A signaled RDMA WR (`opcode`) over `sge` to `remote_addr` under `rkey`.
fn rdma_wr(wr_id: u64, opcode: u32, sge: &mut ibv_sge, remote_addr: u64, rkey: u32) -> ibv_send_wr {
    let mut wr = send_wr(wr_id, opcode, IBV_SEND_SIGNALED, sge);
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    wr
}

/// Post the one-SGE receive WR `wr_id` over `sge` on `qp` (accepted).
pub(crate) unsafe fn post_recv_one(e: &Env, qp: *mut ibv_qp, wr_id: u64, mut sge: ibv_sge) {
    // SAFETY: plain C data.
    let mut rwr: ibv_recv_wr = unsafe { zeroed() };
    rwr.wr_id = wr_id;
    rwr.sg_list = &mut sge;
    rwr.num_sge = 1;
    let mut rbad = null_mut();
    // SAFETY: as in a C program (the SGE lives through the call).
    unsafe { assert_eq!((*e.ctx).ops.post_recv.unwrap()(qp, &mut rwr, &mut rbad), 0) };
}

/// Destroy `qps`, deregister `mrs`, destroy `cq`, free the PD and close the device,
/// each accepted.
unsafe fn close_all(e: Env, qps: &[*mut ibv_qp], mrs: &[*mut ibv_mr], cq: *mut ibv_cq) {
    // SAFETY: as in a C program: the caller's objects, not used after this.
    unsafe {
        for &qp in qps {
            assert_eq!(ibv_destroy_qp(qp), 0);
        }
        for &mr in mrs {
            assert_eq!(ibv_dereg_mr(mr), 0);
        }
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

pub(crate) unsafe fn poll_one(ctx: *mut ibv_context, cq: *mut ibv_cq) -> ibv_wc {
    // SAFETY: as in a C program (ibv_poll_cq inline).
    unsafe {
        let poll = (*ctx).ops.poll_cq.unwrap();
        let mut wc: ibv_wc = zeroed();
        let t = std::time::Instant::now();
        loop {
            let n = poll(cq, 1, &mut wc);
            assert!(n >= 0);
            if n == 1 {
                return wc;
            }
            assert!(t.elapsed().as_secs() < 10, "no completion");
        }
    }
}

#[test]
fn loopback_write_send_and_errors() {
    let e = open();
    // SAFETY: every call follows the libibverbs contract; buffers outlive their MRs.
    unsafe {
        let (cq, a, b) = loopback(&e);
        let mut src = vec![0u8; 8192];
        let mut dst = vec![0u8; 8192];
        for (i, x) in src.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let acc = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_RELAXED_ORDERING)
            as c_int;
        let smr = ibv_reg_mr(e.pd, src.as_mut_ptr() as *mut c_void, src.len(), acc);
        let dmr = ibv_reg_mr_iova2(
            e.pd,
            dst.as_mut_ptr() as *mut c_void,
            dst.len(),
            dst.as_ptr() as u64,
            acc as u32,
        );
        assert!(!smr.is_null() && !dmr.is_null());

        // RDMA WRITE a -> b's buffer.
        let mut wsge = sge(src.as_ptr() as u64, 8192, (*smr).lkey);
        let (daddr, rkey) = (dst.as_ptr() as u64, (*dmr).rkey);
        let mut wr = rdma_wr(7, IBV_WR_RDMA_WRITE, &mut wsge, daddr, rkey);
        let mut bad = null_mut();
        let post_send = (*e.ctx).ops.post_send.unwrap();
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (7, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE)
        );
        assert_eq!(src, dst);

        // Inline SEND with immediate into a posted receive.
        post_recv_one(&e, b, 9, sge(dst.as_ptr() as u64, 64, (*dmr).lkey));
        let msg = *b"inline hello";
        let mut isge = sge(msg.as_ptr() as u64, msg.len() as u32, 0);
        let flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
        let mut swr = send_wr(8, IBV_WR_SEND_WITH_IMM, flags, &mut isge);
        swr.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        assert_eq!(post_send(a, &mut swr, &mut bad), 0);
        let mut got = [poll_one(e.ctx, cq), poll_one(e.ctx, cq)];
        got.sort_by_key(|w| w.wr_id);
        assert_eq!((got[0].wr_id, got[0].status), (8, IBV_WC_SUCCESS));
        assert_eq!(
            (got[1].wr_id, got[1].opcode, got[1].byte_len),
            (9, IBV_WC_RECV, 12)
        );
        assert_eq!(got[1].wc_flags & IBV_WC_WITH_IMM, IBV_WC_WITH_IMM);
        assert_eq!(got[1].__bindgen_anon_1.imm_data, 0x1234_5678u32.to_be());
        assert_eq!(&dst[..12], b"inline hello");

        // Unsupported opcode: EOPNOTSUPP, bad_wr points at it, nothing completes.
        let mut wr2 = wr;
        wr2.opcode = IBV_WR_LOCAL_INV;
        wr.next = &mut wr2;
        assert_eq!(post_send(a, &mut wr, &mut bad), libc::EOPNOTSUPP);
        assert_eq!(bad, &mut wr2 as *mut _);
        let wc = poll_one(e.ctx, cq); // the first WR of the list was posted
        assert_eq!(wc.wr_id, 7);
        let mut none: ibv_wc = zeroed();
        assert_eq!((*e.ctx).ops.poll_cq.unwrap()(cq, 1, &mut none), 0);

        // query_qp reflects the connection.
        let mut qa: ibv_qp_attr = zeroed();
        let mut qi: ibv_qp_init_attr = zeroed();
        assert_eq!(ibv_query_qp(a, &mut qa, 0, &mut qi), 0);
        assert_eq!(
            (qa.qp_state, qa.dest_qp_num, qa.path_mtu),
            (IBV_QPS_RTS, (*b).qp_num, IBV_MTU_1024)
        );
        assert_eq!(qi.send_cq, cq);

        // Objects in use cannot be destroyed.
        assert_eq!(ibv_dealloc_pd(e.pd), libc::EBUSY);
        assert_eq!(ibv_destroy_cq(cq), libc::EBUSY);
        close_all(e, &[a, b], &[smr, dmr], cq);
    }
}

#[test]
fn completion_events_through_the_channel() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let ch = ibv_create_comp_channel(e.ctx);
        assert!(!ch.is_null());
        let tag = 0x55usize as *mut c_void;
        let cq = ibv_create_cq(e.ctx, 16, tag, ch, 0);
        assert!(!cq.is_null());
        let (a, b) = qp_pair(&e, cq);
        // Non-blocking channel with nothing pending: EAGAIN.
        let fl = libc::fcntl((*ch).fd, libc::F_GETFL);
        libc::fcntl((*ch).fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        let (mut ecq, mut ectx) = (null_mut(), null_mut());
        assert_eq!(ibv_get_cq_event(ch, &mut ecq, &mut ectx), -1);
        assert_eq!(errno(), libc::EAGAIN);
        libc::fcntl((*ch).fd, libc::F_SETFL, fl);
        assert_eq!((*e.ctx).ops.req_notify_cq.unwrap()(cq, 0), 0);
        let mut buf = [0u8; 8];
        let mr = ibv_reg_mr(
            e.pd,
            buf.as_mut_ptr() as *mut c_void,
            8,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        let mut msge = sge(buf.as_ptr() as u64, 8, (*mr).lkey);
        post_recv_one(&e, b, 0, msge);
        let mut swr = send_wr(0, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut msge);
        let mut bad = null_mut();
        assert_eq!((*e.ctx).ops.post_send.unwrap()(a, &mut swr, &mut bad), 0);
        // Blocking wait (the event is already pending or arrives shortly).
        assert_eq!(ibv_get_cq_event(ch, &mut ecq, &mut ectx), 0);
        assert_eq!((ecq, ectx), (cq, tag));
        ibv_ack_cq_events(cq, 1);
        assert_eq!((*cq).comp_events_completed, 1);
        poll_one(e.ctx, cq);
        poll_one(e.ctx, cq);
        assert_eq!(ibv_destroy_comp_channel(ch), libc::EBUSY);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

/// Two CQs on one channel: events come out in the order they were signalled (as the
/// kernel queues them), not in the order the CQs were created. An application that
/// re-arms only the CQ that fired relies on it.
#[test]
fn channel_events_in_signal_order() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let ch = ibv_create_comp_channel(e.ctx);
        assert!(!ch.is_null());
        let first = ibv_create_cq(e.ctx, 16, 1usize as *mut c_void, ch, 0);
        let second = ibv_create_cq(e.ctx, 16, 2usize as *mut c_void, ch, 0);
        assert!(!first.is_null() && !second.is_null());
        let (a1, b1) = qp_pair(&e, first);
        let (a2, b2) = qp_pair(&e, second);
        let mut buf = [0u8; 16];
        let mr = ibv_reg_mr(
            e.pd,
            buf.as_mut_ptr() as *mut c_void,
            16,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        let mut s1 = sge(buf.as_ptr() as u64, 8, (*mr).lkey);
        let mut s2 = sge(buf.as_ptr() as u64 + 8, 8, (*mr).lkey);
        post_recv_one(&e, b1, 0, s1);
        post_recv_one(&e, b2, 0, s2);
        for cq in [first, second] {
            assert_eq!((*e.ctx).ops.req_notify_cq.unwrap()(cq, 0), 0);
        }
        let mut bad = null_mut();
        // The CQ created second signals first: its event is on the channel (its fd
        // readable) before the other CQ has a completion at all.
        let mut w2 = send_wr(2, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut s2);
        assert_eq!((*e.ctx).ops.post_send.unwrap()(a2, &mut w2, &mut bad), 0);
        let mut pfd = libc::pollfd {
            fd: (*ch).fd,
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(
            libc::poll(&mut pfd, 1, 10_000),
            1,
            "no event from the second CQ"
        );
        let mut w1 = send_wr(1, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut s1);
        assert_eq!((*e.ctx).ops.post_send.unwrap()(a1, &mut w1, &mut bad), 0);
        let (mut ecq, mut ectx) = (null_mut(), null_mut());
        assert_eq!(ibv_get_cq_event(ch, &mut ecq, &mut ectx), 0);
        assert_eq!((ecq, ectx as usize), (second, 2), "the earlier event first");
        assert_eq!(ibv_get_cq_event(ch, &mut ecq, &mut ectx), 0);
        assert_eq!((ecq, ectx as usize), (first, 1));
        ibv_ack_cq_events(first, 1);
        ibv_ack_cq_events(second, 1);
        for cq in [first, second] {
            poll_one(e.ctx, cq);
            poll_one(e.ctx, cq);
        }
        for qp in [a1, b1, a2, b2] {
            assert_eq!(ibv_destroy_qp(qp), 0);
        }
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_cq(first), 0);
        assert_eq!(ibv_destroy_cq(second), 0);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

/// A shared receive queue through the C ABI (pinned mode): its limits, two QPs
/// taking its WQEs in post order, `ibv_post_recv` on such a QP refused, destroy
/// refused while QPs use it.
#[test]
fn shared_receive_queue_feeds_its_qps_in_order() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let mut da: ibv_device_attr = zeroed();
        assert_eq!(ibv_query_device(e.ctx, &mut da), 0);
        assert!(da.max_srq > 0 && da.max_srq_wr > 0 && da.max_srq_sge > 0);
        let mut ia: ibv_srq_init_attr = zeroed();
        ia.attr.max_wr = 0;
        assert!(ibv_create_srq(e.pd, &mut ia).is_null());
        assert_eq!(errno(), libc::EINVAL);
        ia.attr.max_wr = 8;
        ia.attr.max_sge = 1;
        ia.attr.srq_limit = 2;
        assert!(ibv_create_srq(e.pd, &mut ia).is_null());
        assert_eq!(
            errno(),
            libc::EOPNOTSUPP,
            "no SRQ limit events: a limit cannot fire"
        );
        ia.attr.srq_limit = 0;
        ia.srq_context = 0x77usize as *mut c_void;
        let srq = ibv_create_srq(e.pd, &mut ia);
        assert!(!srq.is_null());
        assert_eq!(((*srq).srq_context as usize, (*srq).pd), (0x77, e.pd));
        let mut qa: ibv_srq_attr = zeroed();
        assert_eq!(ibv_query_srq(srq, &mut qa), 0);
        assert_eq!((qa.max_wr, qa.max_sge, qa.srq_limit), (8, 1, 0));
        qa.max_wr = 16;
        assert_eq!(
            ibv_modify_srq(srq, &mut qa, IBV_SRQ_MAX_WR as c_int),
            libc::EINVAL
        );
        let cq = ibv_create_cq(e.ctx, 64, null_mut(), null_mut(), 0);
        let mk = |with_srq: bool| {
            let mut a: ibv_qp_init_attr = zeroed();
            a.send_cq = cq;
            a.recv_cq = cq;
            a.qp_type = IBV_QPT_RC;
            a.cap.max_send_wr = 16;
            a.cap.max_send_sge = 1;
            a.cap.max_recv_sge = 1;
            if with_srq {
                a.srq = srq;
            } else {
                a.cap.max_recv_wr = 16;
            }
            let qp = ibv_create_qp(e.pd, &mut a);
            assert!(!qp.is_null());
            qp
        };
        // Senders s1, s2 and their peers r1, r2 on the SRQ.
        let (s1, r1, s2, r2) = (mk(false), mk(true), mk(false), mk(true));
        assert_eq!((*r1).srq, srq);
        for (s, r) in [(s1, r1), (s2, r2)] {
            connect(&e, s, (*r).qp_num);
            connect(&e, r, (*s).qp_num);
        }
        let mut qattr: ibv_qp_attr = zeroed();
        let mut qinit: ibv_qp_init_attr = zeroed();
        assert_eq!(ibv_query_qp(r2, &mut qattr, 0, &mut qinit), 0);
        assert_eq!(qinit.srq, srq);
        let mut buf = [0u8; 64];
        let mr = ibv_reg_mr(
            e.pd,
            buf.as_mut_ptr() as *mut c_void,
            64,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        // Receives go to the SRQ, not to its QPs.
        let mut rs = sge(buf.as_ptr() as u64, 8, (*mr).lkey);
        let mut rwr: ibv_recv_wr = zeroed();
        rwr.sg_list = &mut rs;
        rwr.num_sge = 1;
        let mut rbad = null_mut();
        assert_ne!((*e.ctx).ops.post_recv.unwrap()(r1, &mut rwr, &mut rbad), 0);
        for k in 0..2u64 {
            let mut rs = sge(buf.as_ptr() as u64 + 32 + 16 * k, 16, (*mr).lkey);
            let mut rwr: ibv_recv_wr = zeroed();
            rwr.wr_id = 100 + k;
            rwr.sg_list = &mut rs;
            rwr.num_sge = 1;
            assert_eq!(
                (*e.ctx).ops.post_srq_recv.unwrap()(srq, &mut rwr, &mut rbad),
                0
            );
        }
        // s2's message takes the first WQE, s1's the second.
        for (k, s) in [(0u8, s2), (1, s1)] {
            buf[k as usize * 8..k as usize * 8 + 8].fill(0xa0 + k);
            let mut ss = sge(buf.as_ptr() as u64 + 8 * k as u64, 8, (*mr).lkey);
            let mut w = send_wr(k as u64, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut ss);
            let mut bad = null_mut();
            assert_eq!((*e.ctx).ops.post_send.unwrap()(s, &mut w, &mut bad), 0);
            let mut got = [poll_one(e.ctx, cq), poll_one(e.ctx, cq)];
            got.sort_by_key(|w| w.opcode);
            let recv = got[1];
            assert_eq!(recv.opcode, IBV_WC_RECV);
            let (want_qp, want_id) = if k == 0 { (r2, 100) } else { (r1, 101) };
            assert_eq!(
                (recv.status, recv.wr_id, recv.qp_num),
                (IBV_WC_SUCCESS, want_id, (*want_qp).qp_num)
            );
            let at = 32 + 16 * (want_id - 100) as usize;
            assert_eq!(buf[at..at + 8], [0xa0 + k; 8]);
        }
        assert_eq!(ibv_destroy_srq(srq), libc::EBUSY);
        // A QP on the SRQ moved to ERR: LAST_WQE_REACHED tells the application it may
        // destroy it (the SRQ's other QPs go on).
        let mut err: ibv_qp_attr = zeroed();
        err.qp_state = IBV_QPS_ERR;
        assert_eq!(ibv_modify_qp(r1, &mut err, IBV_QP_STATE as c_int), 0);
        let mut ev: ibv_async_event = zeroed();
        assert_eq!(ibv_get_async_event(e.ctx, &mut ev), 0);
        assert_eq!(
            (ev.event_type, ev.element.qp),
            (IBV_EVENT_QP_LAST_WQE_REACHED, r1)
        );
        ibv_ack_async_event(&mut ev);
        // Nothing else queued: a non-blocking async fd reports EAGAIN.
        let afd = (*e.ctx).async_fd;
        libc::fcntl(
            afd,
            libc::F_SETFL,
            libc::fcntl(afd, libc::F_GETFL) | libc::O_NONBLOCK,
        );
        assert_eq!(ibv_get_async_event(e.ctx, &mut ev), -1);
        assert_eq!(errno(), libc::EAGAIN);
        // A QP destroyed before its event was taken takes the event with it (as the
        // kernel drops a destroyed object's unread events): none names a freed QP.
        assert_eq!(ibv_modify_qp(r2, &mut err, IBV_QP_STATE as c_int), 0);
        assert_eq!(ibv_destroy_qp(r2), 0);
        assert_eq!(ibv_get_async_event(e.ctx, &mut ev), -1);
        assert_eq!(errno(), libc::EAGAIN);
        // An event taken and not yet acknowledged: ibv_destroy_qp waits for the ack,
        // as libibverbs' does.
        let r3 = mk(true);
        assert_eq!(ibv_modify_qp(r3, &mut err, IBV_QP_STATE as c_int), 0);
        assert_eq!(ibv_get_async_event(e.ctx, &mut ev), 0);
        assert_eq!(
            (ev.event_type, ev.element.qp),
            (IBV_EVENT_QP_LAST_WQE_REACHED, r3)
        );
        let destroyed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, r3_addr) = (destroyed.clone(), r3 as usize);
        let t = std::thread::spawn(move || {
            // A QP of ours, destroyed once (inside the test's unsafe block).
            let rc = ibv_destroy_qp(r3_addr as *mut ibv_qp);
            d.store(true, std::sync::atomic::Ordering::SeqCst);
            rc
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !destroyed.load(std::sync::atomic::Ordering::SeqCst),
            "ibv_destroy_qp returned with its event unacknowledged"
        );
        ibv_ack_async_event(&mut ev);
        assert_eq!(t.join().unwrap(), 0);
        for qp in [s1, r1, s2] {
            assert_eq!(ibv_destroy_qp(qp), 0);
        }
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

#[test]
fn refusals_set_errno() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let mut buf = vec![0u8; 4096];
        let p = buf.as_mut_ptr() as *mut c_void;
        // iova != addr and unknown access flags.
        assert!(ibv_reg_mr_iova(e.pd, p, 4096, 0x1000, IBV_ACCESS_LOCAL_WRITE as c_int).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        assert!(ibv_reg_mr(e.pd, p, 4096, IBV_ACCESS_ON_DEMAND as c_int).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        // REMOTE_WRITE without LOCAL_WRITE: the NIC's EINVAL.
        assert!(ibv_reg_mr(e.pd, p, 4096, IBV_ACCESS_REMOTE_WRITE as c_int).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // Raw-packet QPs; SRQs and AHs without attributes; an AH without GRH, for
        // an unknown GID, or for an empty GID table entry.
        let cq = ibv_create_cq(e.ctx, 4, null_mut(), null_mut(), 0);
        let mut a: ibv_qp_init_attr = zeroed();
        a.send_cq = cq;
        a.recv_cq = cq;
        a.qp_type = IBV_QPT_RAW_PACKET;
        a.cap.max_send_wr = 1;
        assert!(ibv_create_qp(e.pd, &mut a).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        assert!(ibv_create_srq(e.pd, null_mut()).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(crate::ah::ibv_create_ah(e.pd, null_mut()).is_null());
        assert_eq!(errno(), libc::EINVAL);
        let mut ah: ibv_ah_attr = zeroed();
        ah.port_num = 1;
        assert!(crate::ah::ibv_create_ah(e.pd, &mut ah).is_null());
        assert_eq!(errno(), libc::EINVAL);
        ah.is_global = 1;
        ah.grh.dgid.raw = [7; 16];
        assert!(crate::ah::ibv_create_ah(e.pd, &mut ah).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // An IPv4-mapped GID no device of the host has: EINVAL.
        ah.grh.dgid.raw = crate::netif::gid_of_ip("203.0.113.9".parse().unwrap());
        assert!(crate::ah::ibv_create_ah(e.pd, &mut ah).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_query_gid(e.ctx, 1, 0, &mut ah.grh.dgid), 0);
        ah.grh.sgid_index = GID_TBL_LEN as u8;
        assert!(crate::ah::ibv_create_ah(e.pd, &mut ah).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // By GID 0, by one of the host's IP GIDs from any source GID (UCX's GID
        // selection makes such an AH for each entry), and by LID.
        for (sgid, dgid) in [(0, 0), (1, 1), (1, 0)] {
            ah.grh.sgid_index = sgid;
            assert_eq!(ibv_query_gid(e.ctx, 1, dgid, &mut ah.grh.dgid), 0);
            let h = crate::ah::ibv_create_ah(e.pd, &mut ah);
            assert!(!h.is_null(), "sgid {sgid} dgid {dgid}");
            assert_eq!(crate::ah::ibv_destroy_ah(h), 0);
        }
        let mut pa: ibv_port_attr = zeroed();
        ibv_query_port(
            e.ctx,
            1,
            &mut pa as *mut ibv_port_attr as *mut _compat_ibv_port_attr,
        );
        assert!(pa.lid >= 1 && pa.sm_lid == 1, "a LID of the host's subnet");
        let mut by_lid: ibv_ah_attr = zeroed();
        by_lid.port_num = 1;
        by_lid.dlid = pa.lid;
        let h = crate::ah::ibv_create_ah(e.pd, &mut by_lid);
        assert!(!h.is_null());
        assert_eq!(crate::ah::ibv_destroy_ah(h), 0);
        by_lid.dlid = rnic::subnet::MAX_LID + 1;
        assert!(crate::ah::ibv_create_ah(e.pd, &mut by_lid).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(ibv_qp_to_qp_ex(null_mut()).is_null());
        // No async events: a non-blocking async fd reports EAGAIN.
        let afd = (*e.ctx).async_fd;
        libc::fcntl(
            afd,
            libc::F_SETFL,
            libc::fcntl(afd, libc::F_GETFL) | libc::O_NONBLOCK,
        );
        let mut ev: ibv_async_event = zeroed();
        assert_eq!(ibv_get_async_event(e.ctx, &mut ev), -1);
        assert_eq!(errno(), libc::EAGAIN);
        // GID table: GID 0 (the NIC's address), then the host's IPs as RoCE v2 GIDs
        // (IPv4-mapped, 127.0.0.1 among them, loopback last).
        let mut tab: [ibv_gid_entry; GID_TBL_LEN as usize] = zeroed();
        let sz = std::mem::size_of::<ibv_gid_entry>();
        let n = _ibv_query_gid_table(e.ctx, tab.as_mut_ptr(), tab.len(), 0, sz);
        let hosts = crate::netif::host_gids();
        assert_eq!(n as usize, 1 + hosts.len());
        let mut g0: ibv_gid = zeroed();
        assert_eq!(ibv_query_gid(e.ctx, 1, 0, &mut g0), 0);
        assert_eq!(
            (tab[0].gid.raw, tab[0].gid_type),
            (g0.raw, IBV_GID_TYPE_ROCE_V2)
        );
        let lo = crate::netif::gid_of_ip(std::net::Ipv4Addr::LOCALHOST.into());
        let at = tab[..n as usize]
            .iter()
            .position(|t| t.gid.raw == lo)
            .expect("127.0.0.1 in the table");
        assert_eq!(
            (tab[at].gid_index, tab[at].gid_type),
            (at as u32, IBV_GID_TYPE_ROCE_V2)
        );
        let mut ent: ibv_gid_entry = zeroed();
        assert_eq!(_ibv_query_gid_ex(e.ctx, 1, at as u32, &mut ent, 0, sz), 0);
        assert_eq!(ent.gid.raw, lo);
        // A buffer too small for the table: EINVAL, as the kernel answers.
        assert_eq!(
            _ibv_query_gid_table(e.ctx, tab.as_mut_ptr(), n as usize - 1, 0, sz),
            -(libc::EINVAL as isize)
        );
        assert!(ibv_import_pd(e.ctx, u32::MAX).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // Bad port / GID index; an entry past the populated ones is empty (zero GID,
        // ENODATA from the _ex form, RoCE v1 type), as rdma-core reports one.
        let empty = n as c_int;
        let mut gid: ibv_gid = zeroed();
        assert_eq!(ibv_query_gid(e.ctx, 2, 0, &mut gid), -1);
        assert_eq!(ibv_query_gid(e.ctx, 1, GID_TBL_LEN, &mut gid), -1);
        gid.raw = [1; 16];
        assert_eq!(ibv_query_gid(e.ctx, 1, empty, &mut gid), 0);
        assert_eq!(gid.raw, [0; 16]);
        assert_eq!(
            _ibv_query_gid_ex(e.ctx, 1, empty as u32, &mut ent, 0, sz),
            libc::ENODATA
        );
        assert_eq!(
            _ibv_query_gid_ex(e.ctx, 1, GID_TBL_LEN as u32, &mut ent, 0, sz),
            libc::EINVAL
        );
        let mut ty = 9u32;
        assert_eq!(ibv_query_gid_type(e.ctx, 1, empty as u32, &mut ty), 0);
        assert_eq!(ty, crate::ffi::IBV_GID_TYPE_SYSFS_IB_ROCE_V1);
        assert_eq!(ibv_query_gid_type(e.ctx, 1, 0, &mut ty), 0);
        assert_eq!(ty, crate::ffi::IBV_GID_TYPE_SYSFS_ROCE_V2);
        assert_eq!(ibv_query_gid_type(e.ctx, 1, at as u32, &mut ty), 0);
        assert_eq!(ty, crate::ffi::IBV_GID_TYPE_SYSFS_ROCE_V2);
        let mut pa: ibv_port_attr = zeroed();
        let compat = &mut pa as *mut ibv_port_attr as *mut _compat_ibv_port_attr;
        assert_eq!(ibv_query_port(e.ctx, 1, compat), 0);
        assert_eq!(
            (pa.state, pa.link_layer),
            (IBV_PORT_ACTIVE, IBV_LINK_LAYER_ETHERNET as u8)
        );
        assert_eq!(ibv_query_port(e.ctx, 3, compat), libc::EINVAL);
        // The verbs_context op (what the ibv_query_port inline uses) with a short struct.
        let vctx = (e.ctx as *mut u8).sub(std::mem::offset_of!(verbs_context, context))
            as *mut verbs_context;
        assert_eq!((*vctx).sz as usize, std::mem::size_of::<verbs_context>());
        let mut pb: ibv_port_attr = zeroed();
        assert_eq!((*vctx).query_port.unwrap()(e.ctx, 1, &mut pb, 8), 0);
        assert_eq!(
            (pb.state, pb.max_mtu, pb.link_layer),
            (IBV_PORT_ACTIVE, IBV_MTU_4096, 0)
        );
        assert!(ibv_create_cq(e.ctx, 0, null_mut(), null_mut(), 0).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
        assert_eq!(
            std::ffi::CStr::from_ptr(ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR)),
            c"remote access error"
        );
    }
}

/// rdma-core's test_cq / test_fork expectations: CQ sizes beyond max_cqe and
/// completion vectors beyond num_comp_vectors are EINVAL; fork needs no preparation
/// (IBV_FORK_UNNEEDED, ibv_fork_init succeeds).
#[test]
fn cq_limits_and_fork_status() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let mut attr: ibv_device_attr = zeroed();
        assert_eq!(ibv_query_device(e.ctx, &mut attr), 0);
        let max = attr.max_cqe;
        let cq = ibv_create_cq(e.ctx, max, null_mut(), null_mut(), 0);
        assert!(!cq.is_null());
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert!(ibv_create_cq(e.ctx, max + 1, null_mut(), null_mut(), 0).is_null());
        assert_eq!(errno(), libc::EINVAL);
        let vectors = (*e.ctx).num_comp_vectors;
        assert!(vectors >= 1);
        for bad in [vectors, vectors + 1, -1] {
            assert!(ibv_create_cq(e.ctx, 16, null_mut(), null_mut(), bad).is_null());
            assert_eq!(errno(), libc::EINVAL, "comp_vector {bad}");
        }
        let cq = ibv_create_cq(e.ctx, 16, null_mut(), null_mut(), vectors - 1);
        assert!(!cq.is_null());
        assert_eq!(ibv_destroy_cq(cq), 0);

        assert_eq!(ibv_fork_init(), 0);
        assert_eq!(ibv_is_fork_initialized(), IBV_FORK_UNNEEDED);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

/// test_shared_pd's path: the context's cmd_fd is a real fd; a dup of it imports a
/// second context, which imports the first one's PD and MR by handle (same keys, NULL
/// addr) and releases them with unimport; other fds and unknown or foreign handles
/// are refused (EINVAL).
#[test]
fn import_device_pd_and_mr_from_cmd_fd() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let fd = (*e.ctx).cmd_fd;
        assert!(fd >= 0);
        let dup = libc::dup(fd);
        assert!(dup >= 0, "cmd_fd {fd} is not an open fd");
        let ctx2 = ibv_import_device(dup);
        assert!(!ctx2.is_null());
        assert_eq!((*ctx2).cmd_fd, dup);
        let efd = libc::eventfd(0, libc::EFD_CLOEXEC);
        assert!(ibv_import_device(efd).is_null());
        assert_eq!(errno(), libc::EINVAL);
        libc::close(efd);
        let mut buf = vec![0u8; 8192];
        let acc = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
        let mr = ibv_reg_mr(e.pd, buf.as_mut_ptr().cast(), 8192, acc);
        assert!(!mr.is_null());
        let pd2 = ibv_import_pd(ctx2, (*e.pd).handle);
        assert!(!pd2.is_null());
        assert_eq!(((*pd2).handle, (*pd2).context), ((*e.pd).handle, ctx2));
        let mr2 = ibv_import_mr(pd2, (*mr).handle);
        assert!(!mr2.is_null());
        assert_eq!(
            ((*mr2).lkey, (*mr2).rkey, (*mr2).length),
            ((*mr).lkey, (*mr).rkey, 8192)
        );
        assert!((*mr2).addr.is_null());
        // The MR is not on another PD.
        let other = ibv_alloc_pd(ctx2);
        assert!(ibv_import_mr(other, (*mr).handle).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_dealloc_pd(other), 0);
        ibv_unimport_mr(mr2);
        ibv_unimport_pd(pd2);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(ctx2), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

/// test_shared_pd's teardown: QPs and MRs made on an imported PD outlive the PD's
/// `ibv_unimport_pd` (rdma-core allows it: the kernel PD lives on), and hold the one
/// use count of the PD and its imports, so the exporting PD cannot be deallocated
/// under them (EBUSY) and can once they are gone. Destroying them after the unimport
/// must not touch the released handle (it used to: heap corruption under pyverbs).
#[test]
fn objects_on_an_imported_pd_outlive_its_unimport() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let ctx2 = ibv_import_device(libc::dup((*e.ctx).cmd_fd));
        assert!(!ctx2.is_null());
        let pd2 = ibv_import_pd(ctx2, (*e.pd).handle);
        assert!(!pd2.is_null());
        let cq = ibv_create_cq(ctx2, 16, null_mut(), null_mut(), 0);
        assert!(!cq.is_null());
        let qp = make_qp(&Env { ctx: ctx2, pd: pd2 }, cq);
        let mut buf = vec![0u8; 4096];
        let mr = ibv_reg_mr(
            pd2,
            buf.as_mut_ptr().cast(),
            4096,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        assert!(!mr.is_null());
        assert_eq!(ibv_dealloc_pd(e.pd), libc::EBUSY);
        assert_eq!(ibv_dealloc_pd(pd2), libc::EBUSY);
        ibv_unimport_pd(pd2);
        assert_eq!(ibv_dealloc_pd(e.pd), libc::EBUSY);
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), libc::EBUSY);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(ctx2), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
    }
}

/// Extended CQs as libibverbs' `ibv_create_cq_ex` inline reaches them (the
/// verbs_context op): the standard completion fields, `ibv_start_poll` /
/// `ibv_next_poll` / `ibv_end_poll` and the `ibv_wc_read_*` ops over loopback traffic
/// (a SEND with immediate), ENOENT when empty; unsupported fields / flags are
/// EOPNOTSUPP, bad sizes and vectors EINVAL; `ibv_destroy_cq` frees it.
#[test]
fn extended_cq_polls_the_standard_fields() {
    let e = open();
    // SAFETY: as in a C program.
    unsafe {
        let vctx = (e.ctx as *mut u8).sub(std::mem::offset_of!(verbs_context, context))
            as *mut verbs_context;
        let create = (*vctx).create_cq_ex.expect("create_cq_ex op");
        let mut a: ibv_cq_init_attr_ex = zeroed();
        a.cqe = 32;
        a.wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP as u64;
        assert!(create(e.ctx, &mut a).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        a.wc_flags = IBV_WC_STANDARD_FLAGS as u64;
        a.comp_vector = (*e.ctx).num_comp_vectors as u32;
        assert!(create(e.ctx, &mut a).is_null());
        assert_eq!(errno(), libc::EINVAL);
        a.comp_vector = 0;
        a.cqe = 1 << 30;
        assert!(create(e.ctx, &mut a).is_null());
        assert_eq!(errno(), libc::EINVAL);
        a.cqe = 32;
        let cqx = create(e.ctx, &mut a);
        assert!(!cqx.is_null());
        let cq = cqx as *mut ibv_cq;
        let mut pa: ibv_poll_cq_attr = zeroed();
        assert_eq!((*cqx).start_poll.unwrap()(cqx, &mut pa), libc::ENOENT);
        let (qa, qb) = qp_pair(&e, cq);
        let mut buf = vec![0u8; 4096];
        let acc = IBV_ACCESS_LOCAL_WRITE as c_int;
        let mr = ibv_reg_mr(e.pd, buf.as_mut_ptr().cast(), 4096, acc);
        assert!(!mr.is_null());
        post_recv_one(&e, qb, 21, sge(buf.as_ptr() as u64 + 2048, 64, (*mr).lkey));
        let mut ssge = sge(buf.as_ptr() as u64, 40, (*mr).lkey);
        let mut swr = send_wr(20, IBV_WR_SEND_WITH_IMM, IBV_SEND_SIGNALED, &mut ssge);
        swr.__bindgen_anon_1.imm_data = 0xabcd_0123u32.to_be();
        let mut bad = null_mut();
        assert_eq!((*e.ctx).ops.post_send.unwrap()(qa, &mut swr, &mut bad), 0);
        // Both completions, through start_poll then next_poll (retrying on ENOENT).
        let t = std::time::Instant::now();
        let mut r = (*cqx).start_poll.unwrap()(cqx, &mut pa);
        while r == libc::ENOENT && t.elapsed().as_secs() < 10 {
            r = (*cqx).start_poll.unwrap()(cqx, &mut pa);
        }
        let mut seen = Vec::new();
        loop {
            assert_eq!(r, 0);
            assert_eq!((*cqx).status, IBV_WC_SUCCESS);
            let x = cqx;
            seen.push((
                (*x).wr_id,
                (*x).read_opcode.unwrap()(x),
                (*x).read_byte_len.unwrap()(x),
                (*x).read_qp_num.unwrap()(x),
                (*x).read_wc_flags.unwrap()(x) & IBV_WC_WITH_IMM,
                (*x).read_imm_data.unwrap()(x),
            ));
            if seen.len() == 2 {
                break;
            }
            r = (*cqx).next_poll.unwrap()(cqx);
            while r == libc::ENOENT && t.elapsed().as_secs() < 10 {
                r = (*cqx).next_poll.unwrap()(cqx);
            }
        }
        (*cqx).end_poll.unwrap()(cqx);
        seen.sort_by_key(|s| s.0);
        assert_eq!(seen[0].0, 20);
        assert_eq!((seen[0].1, seen[0].3), (IBV_WC_SEND, (*qa).qp_num));
        assert_eq!(
            seen[1],
            (
                21,
                IBV_WC_RECV,
                40,
                (*qb).qp_num,
                IBV_WC_WITH_IMM,
                0xabcd_0123u32.to_be()
            )
        );
        close_all(e, &[qa, qb], &[mr], cq);
    }
}

#[test]
fn qp_ex_work_request_builder() {
    let e = open();
    // SAFETY: as in a C program using ibv_create_qp_ex + ibv_wr_*.
    unsafe {
        let vctx = (e.ctx as *mut u8).sub(std::mem::offset_of!(verbs_context, context))
            as *mut verbs_context;
        let create_ex = (*vctx).create_qp_ex.unwrap();
        let cq = ibv_create_cq(e.ctx, 64, null_mut(), null_mut(), 0);
        let mut ax: ibv_qp_init_attr_ex = zeroed();
        ax.send_cq = cq;
        ax.recv_cq = cq;
        ax.qp_type = IBV_QPT_RC;
        ax.cap.max_send_wr = 16;
        ax.cap.max_recv_wr = 16;
        ax.cap.max_send_sge = 2;
        ax.cap.max_recv_sge = 1;
        ax.cap.max_inline_data = 64;
        ax.pd = e.pd;
        ax.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        // Unsupported send op: refused.
        ax.send_ops_flags = (IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_BIND_MW) as u64;
        assert!(create_ex(e.ctx, &mut ax).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        ax.send_ops_flags = (IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND_WITH_IMM) as u64;
        let a = create_ex(e.ctx, &mut ax);
        assert!(!a.is_null());
        let b = make_qp(&e, cq);
        assert!(ibv_qp_to_qp_ex(b).is_null());
        connect(&e, a, (*b).qp_num);
        connect(&e, b, (*a).qp_num);
        let x = ibv_qp_to_qp_ex(a);
        assert!(!x.is_null());

        let src = [5u8; 256];
        let mut dst = vec![0u8; 512];
        let acc = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
        let smr = ibv_reg_mr(e.pd, src.as_ptr() as *mut c_void, 256, acc);
        let dmr = ibv_reg_mr(e.pd, dst.as_mut_ptr() as *mut c_void, 512, acc);
        post_recv_one(&e, b, 30, sge(dst.as_ptr() as u64 + 256, 64, (*dmr).lkey));

        // One batch: a WRITE from an SGE and an inline SEND with immediate.
        (*x).wr_start.unwrap()(x);
        (*x).wr_id = 21;
        (*x).wr_flags = IBV_SEND_SIGNALED;
        (*x).wr_rdma_write.unwrap()(x, (*dmr).rkey, dst.as_ptr() as u64);
        (*x).wr_set_sge.unwrap()(x, (*smr).lkey, src.as_ptr() as u64, 256);
        (*x).wr_id = 22;
        (*x).wr_send_imm.unwrap()(x, 77u32.to_be());
        let msg = *b"built inline";
        (*x).wr_set_inline_data.unwrap()(x, msg.as_ptr() as *mut c_void, msg.len() as u64);
        assert_eq!((*x).wr_complete.unwrap()(x), 0);
        let mut got = [
            poll_one(e.ctx, cq),
            poll_one(e.ctx, cq),
            poll_one(e.ctx, cq),
        ];
        got.sort_by_key(|w| w.wr_id);
        let ids: Vec<(u64, u32)> = got.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            ids,
            vec![
                (21, IBV_WC_SUCCESS),
                (22, IBV_WC_SUCCESS),
                (30, IBV_WC_SUCCESS)
            ]
        );
        assert_eq!(got[2].__bindgen_anon_1.imm_data, 77u32.to_be());
        assert_eq!(&dst[..256], &src[..]);
        assert_eq!(&dst[256..268], b"built inline");

        // An unsupported builder fails the batch at wr_complete; nothing is posted.
        (*x).wr_start.unwrap()(x);
        (*x).wr_local_inv.unwrap()(x, 1);
        assert_eq!((*x).wr_complete.unwrap()(x), libc::EOPNOTSUPP);
        // A setter without a WR: EINVAL; wr_abort discards.
        (*x).wr_start.unwrap()(x);
        (*x).wr_set_sge.unwrap()(x, 0, 0, 0);
        assert_eq!((*x).wr_complete.unwrap()(x), libc::EINVAL);
        (*x).wr_start.unwrap()(x);
        (*x).wr_send.unwrap()(x);
        (*x).wr_abort.unwrap()(x);
        assert_eq!((*x).wr_complete.unwrap()(x), 0);
        let mut none: ibv_wc = zeroed();
        assert_eq!((*e.ctx).ops.poll_cq.unwrap()(cq, 1, &mut none), 0);

        close_all(e, &[a, b], &[smr, dmr], cq);
    }
}

/// `ibv_modify_qp(IBV_QPS_ERR)` in NP-RDMA mode, through the C ABI. The process's
/// device is chosen once from `NPRDMA_MODE`, so the test re-runs itself alone in a
/// child process with `NPRDMA_MODE=nprdma`.
#[test]
fn np_mode_modify_qp_to_err_flushes() {
    const NAME: &str = "abi_tests::np_mode_modify_qp_to_err_flushes";
    if std::env::var("NPRDMA_MODE").as_deref() != Ok("nprdma") {
        run_in_np_mode_child(NAME);
        return;
    }
    const LEN: usize = 64 * 1024;
    let e = open();
    // SAFETY: as in a C program; the mapping outlives its MR.
    unsafe {
        let (cq, a, b) = loopback(&e);
        let map = vmem::AnonMapping::new(LEN).unwrap();
        let buf = map.as_ptr().cast();
        let acc = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
        let mr = ibv_reg_mr(e.pd, buf, LEN, acc);
        assert!(!mr.is_null());
        // Four RECVs on `a`, and a SEND from `a` that waits at `b` (no RECV there).
        for i in 0..4u64 {
            let s = sge(buf as u64 + 8192 + i * 256, 256, (*mr).lkey);
            post_recv_one(&e, a, 100 + i, s);
        }
        let mut ssge = sge(buf as u64, 100, (*mr).lkey);
        let mut wr = send_wr(7, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut ssge);
        let mut bad = null_mut();
        let post_send = (*e.ctx).ops.post_send.unwrap();
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let poll = (*e.ctx).ops.poll_cq.unwrap();
        let mut none: ibv_wc = zeroed();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(poll(cq, 1, &mut none), 0, "completed before ERR");

        let mut at: ibv_qp_attr = zeroed();
        at.qp_state = IBV_QPS_ERR;
        assert_eq!(ibv_modify_qp(a, &mut at, IBV_QP_STATE as c_int), 0);
        assert_eq!((*a).state, IBV_QPS_ERR);
        let mut qa: ibv_qp_attr = zeroed();
        let mut qi: ibv_qp_init_attr = zeroed();
        assert_eq!(ibv_query_qp(a, &mut qa, 0, &mut qi), 0);
        assert_eq!(qa.qp_state, IBV_QPS_ERR);
        let mut ids: Vec<u64> = (0..5)
            .map(|_| {
                let wc = poll_one(e.ctx, cq);
                assert_eq!(wc.status, IBV_WC_WR_FLUSH_ERR, "wr {}", wc.wr_id);
                wc.wr_id
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, [7, 100, 101, 102, 103]);
        // A post on the ERR QP is accepted and flushed.
        wr.wr_id = 8;
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!((wc.wr_id, wc.status), (8, IBV_WC_WR_FLUSH_ERR));
        assert_eq!(poll(cq, 1, &mut none), 0);
        // ERR -> RTS is illegal (EINVAL, as rxe/mlx5); ERR -> RESET is the way
        // back.
        let mut rts: ibv_qp_attr = zeroed();
        rts.qp_state = IBV_QPS_RTS;
        assert_eq!(
            ibv_modify_qp(a, &mut rts, IBV_QP_STATE as c_int),
            libc::EINVAL
        );
        rts.qp_state = IBV_QPS_RESET;
        assert_eq!(ibv_modify_qp(a, &mut rts, IBV_QP_STATE as c_int), 0);
        assert_eq!((*a).state, IBV_QPS_RESET);
        close_all(e, &[a, b], &[mr], cq);
        drop(map);
    }
}

/// A fresh anonymous mapping of `len` bytes filled with `fill`, at `at` if not 0
/// (and only if nothing is mapped there).
pub(crate) fn map_at(at: usize, len: usize, fill: u8) -> usize {
    let fixed = if at != 0 {
        libc::MAP_FIXED_NOREPLACE
    } else {
        0
    };
    // SAFETY: a fresh private anonymous mapping that replaces nothing.
    let p = unsafe {
        libc::mmap(
            at as *mut c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    assert!(
        p != libc::MAP_FAILED && (at == 0 || p as usize == at),
        "mmap at {at:#x}"
    );
    // SAFETY: just mapped, `len` bytes.
    unsafe { std::ptr::write_bytes(p as *mut u8, fill, len) };
    p as usize
}

/// Re-runs test `name` alone in a child process with `NPRDMA_MODE=nprdma` (the
/// process's device is chosen once, from the environment) and checks it passed.
pub(crate) fn run_in_np_mode_child(name: &str) {
    run_in_mode_child(name, "nprdma");
}

/// Set in the children of [`run_in_mode_child`].
const CHILD_ENV: &str = "NPRDMA_ABI_TEST_CHILD";

/// Run test `name` alone (no other test thread beside it) in a child process
/// of this test binary with `NPRDMA_MODE=mode`, and require it to pass.
pub(crate) fn run_in_mode_child(name: &str, mode: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads=1"])
        .env("NPRDMA_MODE", mode)
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && so.contains("1 passed"),
        "child failed:\n{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Posts one signaled WR on `qp` and returns its completion status.
unsafe fn one_status(e: &Env, cq: *mut ibv_cq, qp: *mut ibv_qp, wr: &mut ibv_send_wr) -> u32 {
    let mut bad = null_mut();
    // SAFETY: as in a C program; the WR's SGE outlives the call.
    unsafe {
        assert_eq!((*e.ctx).ops.post_send.unwrap()(qp, wr, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!(wc.wr_id, wr.wr_id);
        wc.status
    }
}

/// Registered memory is what the MR names, not whatever is mapped at its address
/// later (issue 12, bug 4): after `munmap` (or an `mremap` away) of an MR's memory
/// and a new mapping at the same address, a remote WRITE or READ with the old rkey,
/// and a local SGE with the old lkey, fail — the new memory is never reached. Runs
/// in each mode in a child process of its own: between an `munmap` (or `mremap`
/// away) and the new mapping at that address, a test thread beside it could map
/// something there first.
#[test]
fn mr_over_unmapped_memory_reaches_nothing() {
    const NAME: &str = "abi_tests::mr_over_unmapped_memory_reaches_nothing";
    if std::env::var_os(CHILD_ENV).is_none() {
        run_in_mode_child(NAME, "pinned");
        run_in_mode_child(NAME, "nprdma");
        return;
    }
    let np = std::env::var("NPRDMA_MODE").as_deref() == Ok("nprdma");
    const LEN: usize = 2 * 4096;
    let bytes = |at: usize| -> Vec<u8> {
        // SAFETY: a live LEN-byte mapping of this test.
        unsafe { std::slice::from_raw_parts(at as *const u8, LEN).to_vec() }
    };
    let e = open();
    // SAFETY: as in a C program; every mapping is unmapped only where the test says.
    unsafe {
        let cq = ibv_create_cq(e.ctx, 64, null_mut(), null_mut(), 0);
        assert!(!cq.is_null());
        let pair = || qp_pair(&e, cq);
        let acc =
            (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) as c_int;
        let local = map_at(0, LEN, 0x22);
        let lmr = ibv_reg_mr(e.pd, local as *mut c_void, LEN, acc);
        let target = map_at(0, LEN, 0x11);
        let tmr = ibv_reg_mr(e.pd, target as *mut c_void, LEN, acc);
        let moved = map_at(0, LEN, 0x11);
        let mmr = ibv_reg_mr(e.pd, moved as *mut c_void, LEN, acc);
        assert!(!lmr.is_null() && !tmr.is_null() && !mmr.is_null());
        let mut lsge = sge(local as u64, LEN as u32, (*lmr).lkey);
        let (a, _b) = pair();
        let mut wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &mut lsge, target as u64, (*tmr).rkey);
        assert_eq!(
            one_status(&e, cq, a, &mut wr),
            IBV_WC_SUCCESS,
            "while mapped"
        );
        assert_eq!(bytes(target), vec![0x22; LEN]);

        // munmap, then new memory at the same address.
        assert_eq!(libc::munmap(target as *mut c_void, LEN), 0);
        assert_eq!(map_at(target, LEN, 0x33), target);
        // mremap away, then new memory at the old address.
        let elsewhere = map_at(0, LEN, 0);
        let p = libc::mremap(
            moved as *mut c_void,
            LEN,
            LEN,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            elsewhere as *mut c_void,
        );
        assert_eq!(p as usize, elsewhere);
        assert_eq!(map_at(moved, LEN, 0x33), moved);

        for (at, mr) in [(target, tmr), (moved, mmr)] {
            let (a, _b) = pair();
            wr.wr_id = 2;
            wr.opcode = IBV_WR_RDMA_WRITE;
            wr.wr.rdma.remote_addr = at as u64;
            wr.wr.rdma.rkey = (*mr).rkey;
            let st = one_status(&e, cq, a, &mut wr);
            assert_ne!(st, IBV_WC_SUCCESS, "WRITE with the old rkey");
            assert!(np || st == IBV_WC_REM_ACCESS_ERR, "status {st}");
            let changed = bytes(at).iter().filter(|&&x| x != 0x33).count();
            assert_eq!(changed, 0, "WRITE reached the new memory");

            let (a, _b) = pair();
            wr.wr_id = 3;
            wr.opcode = IBV_WR_RDMA_READ;
            let st = one_status(&e, cq, a, &mut wr);
            assert_ne!(st, IBV_WC_SUCCESS, "READ with the old rkey");
            assert!(np || st == IBV_WC_REM_ACCESS_ERR, "status {st}");
            // A failed READ may leave the local buffer undefined (verbs); it must
            // not carry the new memory's bytes.
            let leaked = bytes(local).iter().filter(|&&x| x == 0x33).count();
            assert_eq!(leaked, 0, "READ returned the new memory");

            // The old lkey as a local source: nothing of the new memory leaves.
            let (a, _b) = pair();
            let mut from = sge(at as u64, LEN as u32, (*mr).lkey);
            let mut lw = rdma_wr(4, IBV_WR_RDMA_WRITE, &mut from, local as u64, (*lmr).rkey);
            let st = one_status(&e, cq, a, &mut lw);
            assert_ne!(st, IBV_WC_SUCCESS, "WRITE from the old lkey");
            assert!(np || st == IBV_WC_LOC_PROT_ERR, "status {st}");
            let leaked = bytes(local).iter().filter(|&&x| x == 0x33).count();
            assert_eq!(leaked, 0, "the new memory was sent");
        }
        assert_eq!(ibv_dereg_mr(tmr), 0);
        assert_eq!(ibv_dereg_mr(mmr), 0);
        assert_eq!(ibv_dereg_mr(lmr), 0);
        for at in [local, target, moved, elsewhere] {
            assert_eq!(libc::munmap(at as *mut c_void, LEN), 0);
        }
    }
}

/// Re-runs test `name` alone in a child process with `env` (the process's device is
/// chosen once, from the environment) and checks it passed.
pub(crate) fn run_in_child_with(name: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([name, "--exact", "--test-threads=1", "--nocapture"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.contains("1 passed"),
        "child failed:\n{so}\n{se}"
    );
    print!("{so}");
}

/// A copy of this build's libnprdma.so at another path, so that `dlopen` gives a
/// second instance (the device of `NPRDMA_DEVICE=verbs` in the tests: the software
/// NIC behind the C ABI). Built first when run by cargo; `None` when it cannot be had
/// (skipped, or a failure under `NPRDMA_REQUIRE_ALL=1`: [`nprdma_test_support::skip`]).
pub(crate) fn device_lib_copy() -> Option<std::path::PathBuf> {
    use std::path::Path;
    let exe = std::env::current_exe().expect("test exe path");
    // target/<profile>/deps/<test> -> target/<profile>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    if let Some(cargo) = std::env::var_os("CARGO") {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
        let profile = if name == "debug" { "dev" } else { name };
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let st = std::process::Command::new(cargo)
            .args(["build", "--lib", "--profile", profile, "--manifest-path"])
            .arg(&manifest)
            .env("CARGO_TARGET_DIR", dir.parent().expect("target dir"))
            .stdin(std::process::Stdio::null())
            .status();
        if !st.is_ok_and(|s| s.success()) {
            nprdma_test_support::skip::skip("libnprdma.so could not be built");
            return None;
        }
    }
    let lib = dir.join("libnprdma.so");
    if !lib.exists() {
        nprdma_test_support::skip::skip(format!(
            "{} not found (cargo build -p verbs-shim)",
            lib.display()
        ));
        return None;
    }
    let copy_dir = dir.join("nprdma-chain");
    std::fs::create_dir_all(&copy_dir).expect("chain dir");
    let copy = copy_dir.join("libnprdma-device-abi.so");
    let tmp = copy_dir.join(format!("libnprdma-device-abi.so.{}", std::process::id()));
    std::fs::copy(&lib, &tmp).expect("copy libnprdma.so");
    std::fs::rename(&tmp, &copy).expect("rename the copy");
    Some(copy)
}

/// NP-RDMA mode over the next libibverbs (`NPRDMA_DEVICE=verbs`): the engine's
/// user-space mode, whose device is a second instance of libnprdma.so (a copy of
/// this build, told by `nprdma_shim_as_device` to serve in pinned mode although the
/// environment says `nprdma`/`verbs`). Through the C ABI as a program would: two QPs
/// connected by data QPN + GID only (the control channel rides on the data QPs),
/// WRITE into untouched memory, READ it back, a SEND into a posted RECV and an
/// inline SEND, with data checks; every operation two-sided with MRs registered on
/// the fly (the stats line). Runs in a child process with the environment set.
#[test]
fn np_mode_over_the_next_libibverbs() {
    const NAME: &str = "abi_tests::np_mode_over_the_next_libibverbs";
    if std::env::var("NPRDMA_DEVICE").as_deref() != Ok("verbs") {
        let Some(lib) = device_lib_copy() else { return };
        run_in_child_with(
            NAME,
            &[
                ("NPRDMA_MODE", "nprdma".as_ref()),
                ("NPRDMA_DEVICE", "verbs".as_ref()),
                ("NPRDMA_VERBS_LIB", lib.as_os_str()),
            ],
        );
        return;
    }
    const LEN: usize = 256 * 1024;
    let e = open();
    let dev = crate::backend::device().expect("device");
    assert_eq!(dev.mode(), "nprdma-verbs");
    // SAFETY: as in a C program; the mappings outlive their MRs.
    unsafe {
        let (cq, a, b) = loopback(&e);
        let (src, dst, back) = (
            vmem::AnonMapping::new(LEN).unwrap(),
            vmem::AnonMapping::new(LEN).unwrap(),
            vmem::AnonMapping::new(LEN).unwrap(),
        );
        let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
        std::ptr::copy_nonoverlapping(pattern.as_ptr(), src.as_ptr(), LEN);
        let acc =
            (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) as c_int;
        let smr = ibv_reg_mr(e.pd, src.as_ptr().cast(), LEN, acc);
        let dmr = ibv_reg_mr(e.pd, dst.as_ptr().cast(), LEN, acc);
        let bmr = ibv_reg_mr(e.pd, back.as_ptr().cast(), LEN, acc);
        assert!(!smr.is_null() && !dmr.is_null() && !bmr.is_null());
        let post_send = (*e.ctx).ops.post_send.unwrap();
        let mut bad = null_mut();
        let (daddr, drkey) = (dst.as_ptr() as u64, (*dmr).rkey);

        // WRITE 200 KiB a -> b's untouched buffer, then a small one.
        let mut wsge = sge(src.as_ptr() as u64, 200 * 1024, (*smr).lkey);
        let mut wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &mut wsge, daddr, drkey);
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!((wc.wr_id, wc.status), (1, IBV_WC_SUCCESS));
        let mut small = wsge;
        small.addr += 210_000;
        small.length = 100;
        let mut w2 = wr;
        w2.wr_id = 2;
        w2.sg_list = &mut small;
        w2.wr.rdma.remote_addr = dst.as_ptr() as u64 + 210_000;
        assert_eq!(post_send(a, &mut w2, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!((wc.wr_id, wc.status), (2, IBV_WC_SUCCESS));
        let d = std::slice::from_raw_parts(dst.as_ptr(), LEN);
        assert_eq!(&d[..200 * 1024], &pattern[..200 * 1024]);
        assert_eq!(&d[210_000..210_100], &pattern[210_000..210_100]);
        assert!(d[200 * 1024..210_000].iter().all(|&x| x == 0));

        // READ b's buffer back into a's untouched one (b's QP reads it: the
        // other direction of the connection).
        let mut rsge = sge(back.as_ptr() as u64, 200 * 1024, (*bmr).lkey);
        let mut rd = rdma_wr(3, IBV_WR_RDMA_READ, &mut rsge, daddr, drkey);
        assert_eq!(post_send(b, &mut rd, &mut bad), 0);
        let wc = poll_one(e.ctx, cq);
        assert_eq!((wc.wr_id, wc.status), (3, IBV_WC_SUCCESS));
        let k = std::slice::from_raw_parts(back.as_ptr(), LEN);
        assert_eq!(&k[..200 * 1024], &pattern[..200 * 1024]);

        // A 4 KiB SEND and an inline SEND with immediate into posted RECVs.
        for (i, off) in [(10u64, 220_000u64), (11, 230_000)] {
            post_recv_one(&e, b, i, sge(back.as_ptr() as u64 + off, 8192, (*bmr).lkey));
        }
        let mut ssge = sge(src.as_ptr() as u64 + 4096, 4096, (*smr).lkey);
        let mut sw = send_wr(4, IBV_WR_SEND, IBV_SEND_SIGNALED, &mut ssge);
        assert_eq!(post_send(a, &mut sw, &mut bad), 0);
        let msg = *b"inline over the next libibverbs";
        let mut isge = sge(msg.as_ptr() as u64, msg.len() as u32, 0);
        let flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
        let mut iw = send_wr(5, IBV_WR_SEND_WITH_IMM, flags, &mut isge);
        iw.__bindgen_anon_1.imm_data = 0x0bad_cafeu32.to_be();
        assert_eq!(post_send(a, &mut iw, &mut bad), 0);
        let mut got: Vec<ibv_wc> = (0..4).map(|_| poll_one(e.ctx, cq)).collect();
        got.sort_by_key(|w| w.wr_id);
        let ids: Vec<(u64, u32)> = got.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            ids,
            [
                (4, IBV_WC_SUCCESS),
                (5, IBV_WC_SUCCESS),
                (10, IBV_WC_SUCCESS),
                (11, IBV_WC_SUCCESS)
            ]
        );
        assert_eq!((got[2].opcode, got[2].byte_len), (IBV_WC_RECV, 4096));
        assert_eq!(got[3].byte_len as usize, msg.len());
        assert_eq!(got[3].__bindgen_anon_1.imm_data, 0x0bad_cafeu32.to_be());
        let k = std::slice::from_raw_parts(back.as_ptr(), LEN);
        assert_eq!(&k[220_000..220_000 + 4096], &pattern[4096..8192]);
        assert_eq!(&k[230_000..230_000 + msg.len()], &msg);

        // User-space mode: two-sided only, MRs registered on the fly at the device.
        let stats = dev.stats();
        println!("chain stats: {stats}");
        let stat = |k: &str| -> u64 {
            stats
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k} in {stats}"))
        };
        assert_eq!(stat("optimistic_ok"), 0, "{stats}");
        assert!(stat("two_sided") >= 3, "{stats}");
        assert!(stat("verbs_regs") > 0, "{stats}");
        assert_eq!(stat("verbs_reg_failures"), 0, "{stats}");

        close_all(e, &[a, b], &[smr, dmr, bmr], cq);
    }
}
