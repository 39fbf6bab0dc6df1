//! Moving QPs to RESET after an error and connecting them again: the connection works
//! as new, and the completions the QPs left queued in their CQs are gone with their
//! state (as mlx5 cleans a reset QP's entries out of its CQs) — an application that
//! resets and reconnects does not poll the old connection's flushes.

mod common;
use common::*;
use rnic::*;

#[test]
fn reset_drops_queued_completions_and_the_reconnected_pair_works() {
    for cfg in [HostConfig::default(), ring_cfg(), secure_cfg()] {
        let (a, b) = pair_cfg(cfg);
        let src = buf(&a.pd, 64, 0);
        let sge = [src.sge(0, 64)];
        // A receive with a bad lkey, and one more behind it: the SEND fails, both
        // QPs go to ERR, B's second receive is flushed into its CQ.
        let bad = [Sge {
            addr: 0x1000,
            length: 64,
            lkey: 0xdead00,
        }];
        let dst = buf(&b.pd, 64, 0);
        let rs = [dst.sge(0, 64)];
        b.qp.post_recv(&[
            RecvWr {
                wr_id: 9,
                sg_list: &bad,
            },
            RecvWr {
                wr_id: 10,
                sg_list: &rs,
            },
        ])
        .unwrap();
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        assert_ne!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(wait1(&b.rcq).wr_id, 9);
        // wr 10's flush stays queued; B is reset first, then A (as pyverbs restates).
        let r = QpAttr {
            qp_state: QpState::Reset,
            ..Default::default()
        };
        b.qp.modify(&r, QpAttrMask::STATE).unwrap();
        b.qp.connect(all_access(), a.host.addr(), a.qp.qpn(), 7).unwrap();
        a.qp.modify(&r, QpAttrMask::STATE).unwrap();
        a.qp.connect(all_access(), b.host.addr(), b.qp.qpn(), 7).unwrap();
        b.qp.post_recv(&[RecvWr {
            wr_id: 11,
            sg_list: &rs,
        }])
        .unwrap();
        src.write(0, &pattern(64, 6));
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Send, &sge)]).unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
        let wc = wait1(&b.rcq);
        assert_eq!((wc.wr_id, wc.status), (11, WcStatus::Success), "the old flush is gone");
        assert_eq!(dst.to_vec(0, 64), pattern(64, 6));
        assert_empty(&b.rcq);
        assert_empty(&a.cq);
    }
}
