//! Unreliable-connected QPs on every data path: SEND and WRITE work as on RC; READ
//! and atomics are refused at post; what the responder refuses (no receive posted, a
//! bad rkey, a receive too small) is dropped there — the requester completes the WR
//! successfully, the responder's QP stays up, its receive stays posted — as an IB
//! UC responder (rxe's class D errors) drops a message it cannot take.

mod common;
use common::*;
use rnic::*;

/// Two connected UC QPs on hosts made with `cfg`.
fn uc_pair(cfg: HostConfig) -> (End, End) {
    let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg).unwrap());
    let a = end_of(&ha, &QpInitAttr::default(), QpType::Uc);
    let b = end_of(&hb, &QpInitAttr::default(), QpType::Uc);
    connect(&a, &b, all_access(), 0);
    (a, b)
}

fn each_path(f: impl Fn(End, End)) {
    for cfg in [HostConfig::default(), ring_cfg(), secure_cfg()] {
        let (a, b) = uc_pair(cfg);
        assert_eq!(a.qp.qp_type(), QpType::Uc);
        f(a, b);
    }
}

fn recv(b: &End, wr_id: u64, m: &OwnedMr, len: u32) {
    let sge = [m.sge(0, len)];
    b.qp.post_recv(&[RecvWr { wr_id, sg_list: &sge }]).unwrap();
}

#[test]
fn send_and_write_work_read_and_atomics_are_refused() {
    each_path(|a, b| {
        let src = buf(&a.pd, 8192, 0);
        let data = pattern(8192, 3);
        src.write(0, &data);
        let dst = buf(&b.pd, 8192, 0);
        recv(&b, 5, &dst, 8192);
        let sge = [src.sge(0, 8192)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let wc = wait1(&b.rcq);
        assert_eq!((wc.status, wc.wr_id, wc.byte_len), (WcStatus::Success, 5, 8192));
        assert_eq!(dst.to_vec(0, 8192), data);
        let w = buf(&b.pd, 100, 0);
        let sge = [src.sge(0, 100)];
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Write, &sge).remote(w.addr() as u64, w.rkey())])
            .unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 100));
        assert_eq!(w.to_vec(0, 100), data[..100]);
        for op in [
            WrOpcode::Read,
            WrOpcode::FetchAdd { add: 1 },
            WrOpcode::CmpSwap { compare: 0, swap: 1 },
        ] {
            let sge = [src.sge(0, 8)];
            let e =
                a.qp.post_send(&[SendWr::new(3, op, &sge).remote(w.addr() as u64, w.rkey())])
                    .unwrap_err();
            assert!(matches!(e.err, Error::InvalidArgument(_)), "{op:?}: {e:?}");
        }
        assert_empty(&a.cq);
        assert_eq!(a.qp.state(), QpState::Rts);
    });
}

#[test]
fn refused_messages_are_dropped_not_reported() {
    each_path(|a, b| {
        let src = buf(&a.pd, 64, 0);
        src.write(0, &pattern(64, 9));
        let sge = [src.sge(0, 64)];
        // No receive posted: dropped (no RNR retries), the sender completes.
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        // A bad rkey: dropped; a receive too small: dropped, the receive stays.
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Write, &sge).remote(0x1000, 0xdead_0000)])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let small = buf(&b.pd, 16, 0xaa);
        recv(&b, 7, &small, 16);
        a.qp.post_send(&[SendWr::new(3, WrOpcode::Send, &sge)]).unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_empty(&b.rcq);
        assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
        // The receive still posted takes the next message that fits.
        let sge8 = [src.sge(0, 8)];
        a.qp.post_send(&[SendWr::new(4, WrOpcode::Send, &sge8)]).unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let wc = wait1(&b.rcq);
        assert_eq!((wc.status, wc.wr_id, wc.byte_len), (WcStatus::Success, 7, 8));
        assert_eq!(small.to_vec(0, 8), pattern(64, 9)[..8]);
    });
}

#[test]
fn uc_transitions_take_uc_attributes_only() {
    let h = Host::new(HostConfig::default()).unwrap();
    let ctx = h.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let qp = pd
        .create_qp_of(QpType::Uc, &cq, &cq, None, &QpInitAttr::default())
        .unwrap();
    let (a, m) = QpAttr::init(all_access());
    qp.modify(&a, m).unwrap();
    // RC's responder resources are not a UC attribute.
    let (a, m) = QpAttr::rtr(h.addr(), qp.qpn());
    assert!(matches!(qp.modify(&a, m), Err(Error::InvalidMask(_))));
    qp.modify(&a, m - QpAttrMask::MAX_DEST_RD_ATOMIC - QpAttrMask::MIN_RNR_TIMER)
        .unwrap();
    let (a, _) = QpAttr::rts(7);
    qp.modify(&a, QpAttrMask::STATE | QpAttrMask::SQ_PSN).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
}
