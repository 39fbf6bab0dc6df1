//! Shared receive queues on every data path: the QPs created on an SRQ take its WQEs
//! in post order, whichever QP a message arrives on (each completion on its own QP's
//! receive CQ); messages arriving in parts on two QPs at once each fill the WQE they
//! took first; an empty SRQ is RNR until a WQE is posted; a QP that fails leaves the
//! SRQ's WQEs to the others; `post_recv` on such a QP is refused.

mod common;
use common::*;
use rnic::*;

const NQ: usize = 3;

/// Host A with `NQ` QPs, host B with `NQ` QPs on one SRQ (depth 64), connected
/// pairwise; B's QPs complete receives on one CQ.
struct Rig {
    a: Vec<End>,
    b_pd: Pd,
    b_rcq: Cq,
    b_qps: Vec<Qp>,
    srq: Srq,
    _b_ctx: Context,
    _b_cq: Cq,
}

fn rig(cfg: HostConfig) -> Rig {
    let ha = Host::new(cfg.clone()).unwrap();
    let hb = Host::new(cfg).unwrap();
    let ctx = hb.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None).unwrap();
    let rcq = ctx.create_cq(256, None).unwrap();
    let srq = pd.create_srq(64, 2).unwrap();
    let mut a = Vec::new();
    let mut b_qps = Vec::new();
    for _ in 0..NQ {
        let e = end(&ha, &QpInitAttr::default());
        let q = pd
            .create_qp_of(QpType::Rc, &cq, &rcq, Some(&srq), &QpInitAttr::default())
            .unwrap();
        e.qp.connect(all_access(), hb.addr(), q.qpn(), 7).unwrap();
        q.connect(all_access(), ha.addr(), e.qp.qpn(), 7).unwrap();
        a.push(e);
        b_qps.push(q);
    }
    Rig {
        a,
        b_pd: pd,
        b_rcq: rcq,
        b_qps,
        srq,
        _b_ctx: ctx,
        _b_cq: cq,
    }
}

fn each_path(f: impl Fn(Rig)) {
    for cfg in [HostConfig::default(), ring_cfg(), secure_cfg()] {
        f(rig(cfg));
    }
}

fn send(e: &End, wr_id: u64, m: &OwnedMr, len: usize) {
    let sge = [m.sge(0, len as u32)];
    e.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Send, &sge)]).unwrap();
}

#[test]
fn messages_on_any_qp_take_the_srq_wqes_in_order() {
    each_path(|r| {
        let bufs: Vec<OwnedMr> = (0..6).map(|_| buf(&r.b_pd, 256, 0)).collect();
        for (i, b) in bufs.iter().enumerate() {
            let sge = [b.sge(0, 256)];
            r.srq
                .post_recv(&[RecvWr {
                    wr_id: 100 + i as u64,
                    sg_list: &sge,
                }])
                .unwrap();
        }
        assert_eq!(r.srq.outstanding(), 6);
        // QP 2, 0, 1, 2, 0, 1: the k-th message fills the k-th WQE.
        for (k, dst) in bufs.iter().enumerate() {
            let qi = (k + 2) % NQ;
            let src = buf(&r.a[qi].pd, 200, 0);
            src.write(0, &pattern(200, k as u8));
            send(&r.a[qi], k as u64, &src, 200);
            assert_eq!(wait1(&r.a[qi].cq).status, WcStatus::Success);
            let wc = wait1(&r.b_rcq);
            assert_eq!(
                (wc.status, wc.wr_id, wc.byte_len, wc.qp_num),
                (WcStatus::Success, 100 + k as u64, 200, r.b_qps[qi].qpn())
            );
            assert_eq!(dst.to_vec(0, 200), pattern(200, k as u8));
        }
        assert_eq!(r.srq.outstanding(), 0);
        // Receives go to the SRQ, not to its QPs.
        let sge = [bufs[0].sge(0, 8)];
        let e = r.b_qps[0]
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: &sge,
            }])
            .unwrap_err();
        assert!(matches!(e.err, Error::InvalidArgument(_)), "{e:?}");
    });
}

#[test]
fn long_messages_in_parts_on_two_qps_each_fill_their_own_wqe() {
    // 4 KiB parts on the target-enforced path (16 ring slots): two 256 KiB messages
    // arrive in 64 parts each, side by side.
    let cfg = HostConfig {
        ring_max: 4096,
        ..secure_cfg()
    };
    let r = rig(cfg);
    const LEN: usize = 256 * 1024;
    let bufs: Vec<OwnedMr> = (0..2).map(|_| buf(&r.b_pd, LEN, 0)).collect();
    for (i, b) in bufs.iter().enumerate() {
        let sge = [b.sge(0, LEN as u32)];
        r.srq
            .post_recv(&[RecvWr {
                wr_id: 10 + i as u64,
                sg_list: &sge,
            }])
            .unwrap();
    }
    let srcs: Vec<OwnedMr> = (0..2).map(|i| buf(&r.a[i].pd, LEN, 0)).collect();
    for (i, s) in srcs.iter().enumerate() {
        s.write(0, &pattern(LEN, 40 + i as u8));
    }
    send(&r.a[0], 0, &srcs[0], LEN);
    send(&r.a[1], 1, &srcs[1], LEN);
    for i in 0..2 {
        assert_eq!(wait1(&r.a[i].cq).status, WcStatus::Success);
    }
    let mut got = r.b_rcq.poll_wait(2, T).unwrap();
    got.sort_by_key(|w| w.qp_num);
    for w in &got {
        assert_eq!((w.status, w.byte_len), (WcStatus::Success, LEN as u32));
        let from = r.b_qps.iter().position(|q| q.qpn() == w.qp_num).unwrap();
        let at = (w.wr_id - 10) as usize;
        assert_eq!(
            bufs[at].to_vec(0, LEN),
            pattern(LEN, 40 + from as u8),
            "QP {from} into WQE {at}"
        );
    }
    assert_ne!(got[0].wr_id, got[1].wr_id);
}

#[test]
fn an_empty_srq_is_rnr_until_a_wqe_is_posted() {
    each_path(|r| {
        let src = buf(&r.a[1].pd, 64, 0);
        src.write(0, &pattern(64, 7));
        send(&r.a[1], 1, &src, 64);
        assert_empty(&r.a[1].cq);
        let dst = buf(&r.b_pd, 64, 0);
        let sge = [dst.sge(0, 64)];
        r.srq
            .post_recv(&[RecvWr {
                wr_id: 9,
                sg_list: &sge,
            }])
            .unwrap();
        assert_eq!(wait1(&r.a[1].cq).status, WcStatus::Success);
        let wc = wait1(&r.b_rcq);
        assert_eq!((wc.wr_id, wc.qp_num), (9, r.b_qps[1].qpn()));
        assert_eq!(dst.to_vec(0, 64), pattern(64, 7));
    });
}

#[test]
fn a_failing_qp_leaves_the_srq_to_the_others() {
    each_path(|r| {
        let small = buf(&r.b_pd, 16, 0);
        let big = buf(&r.b_pd, 256, 0);
        let s1 = [small.sge(0, 16)];
        let s2 = [big.sge(0, 256)];
        r.srq
            .post_recv(&[RecvWr { wr_id: 1, sg_list: &s1 }, RecvWr { wr_id: 2, sg_list: &s2 }])
            .unwrap();
        // Too long for the first WQE: it completes in error on QP 0, which fails.
        let src = buf(&r.a[0].pd, 100, 0);
        send(&r.a[0], 0, &src, 100);
        assert_eq!(wait1(&r.a[0].cq).status, WcStatus::RemInvReqErr);
        let wc = wait1(&r.b_rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.qp_num),
            (1, WcStatus::LocLenErr, r.b_qps[0].qpn())
        );
        assert_eq!(r.b_qps[0].state(), QpState::Err);
        // The second WQE is still there for QP 2 (not flushed with QP 0).
        let src = buf(&r.a[2].pd, 100, 0);
        src.write(0, &pattern(100, 3));
        send(&r.a[2], 0, &src, 100);
        assert_eq!(wait1(&r.a[2].cq).status, WcStatus::Success);
        let wc = wait1(&r.b_rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.qp_num),
            (2, WcStatus::Success, r.b_qps[2].qpn())
        );
        assert_eq!(big.to_vec(0, 100), pattern(100, 3));
        assert_empty(&r.b_rcq);
    });
}
