//! Two-host integration tests for every operation, on the in-process transport with
//! the three data paths: direct initiator DMA, the trusted protocol's ring for small
//! ops, and target-enforced protection (every op through the target's ring, in parts).

mod common;
use common::*;
use rnic::*;

fn each_path(f: impl Fn(End, End)) {
    let (a, b) = pair();
    f(a, b);
    let (a, b) = pair_cfg(ring_cfg());
    f(a, b);
    let (a, b) = pair_cfg(secure_cfg());
    f(a, b);
}

#[test]
fn write_then_read_back() {
    each_path(|a, b| {
        for &len in &[1usize, 2, 64, 255, 256, 257, 4096, 4097, 65536, 300_000] {
            let src = buf(&a.pd, len, 0);
            let dst = buf(&b.pd, len + 16, 0xee);
            let back = buf(&a.pd, len, 0);
            let data = pattern(len, len as u8);
            src.write(0, &data);
            let sge = [src.sge(0, len as u32)];
            a.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(dst.addr() as u64 + 8, dst.rkey())])
                .unwrap();
            let wc = wait1(&a.cq);
            assert_eq!(
                (wc.status, wc.opcode, wc.byte_len, wc.wr_id),
                (WcStatus::Success, WcOpcode::RdmaWrite, len as u32, 1)
            );
            assert_eq!(dst.to_vec(8, len), data);
            assert_eq!(dst.to_vec(0, 8), vec![0xee; 8]);
            assert_eq!(dst.to_vec(len + 8, 8), vec![0xee; 8]);
            let sge = [back.sge(0, len as u32)];
            a.qp.post_send(&[SendWr::new(2, WrOpcode::Read, &sge).remote(dst.addr() as u64 + 8, dst.rkey())])
                .unwrap();
            let wc = wait1(&a.cq);
            assert_eq!(
                (wc.status, wc.opcode, wc.byte_len),
                (WcStatus::Success, WcOpcode::RdmaRead, len as u32)
            );
            assert_eq!(back.to_vec(0, len), data);
        }
        assert!(a.host.stats().wrs >= 20);
        assert_eq!(a.host.stats().nonresident_dma + b.host.stats().nonresident_dma, 0);
    });
}

#[test]
fn scatter_gather_both_sides() {
    each_path(|a, b| {
        let l1 = buf(&a.pd, 100, 0);
        let l2 = buf(&a.pd, 300, 0);
        l1.write(0, &pattern(100, 1));
        l2.write(0, &pattern(300, 2));
        let r = buf(&b.pd, 400, 0);
        let sges = [l1.sge(0, 100), l2.sge(0, 300)];
        a.qp.post_send(&[SendWr::new(7, WrOpcode::Write, &sges).remote(r.addr() as u64, r.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let mut exp = pattern(100, 1);
        exp.extend(pattern(300, 2));
        assert_eq!(r.to_vec(0, 400), exp);
        // READ scattering into two local buffers
        let d1 = buf(&a.pd, 150, 0);
        let d2 = buf(&a.pd, 250, 0);
        let sges = [d1.sge(0, 150), d2.sge(0, 250)];
        a.qp.post_send(&[SendWr::new(8, WrOpcode::Read, &sges).remote(r.addr() as u64, r.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(d1.to_vec(0, 150), exp[..150]);
        assert_eq!(d2.to_vec(0, 250), exp[150..]);
    });
}

#[test]
fn send_recv_with_and_without_imm() {
    each_path(|a, b| {
        let s = buf(&a.pd, 5000, 0);
        s.write(0, &pattern(5000, 9));
        let r1 = buf(&b.pd, 3000, 0);
        let r2 = buf(&b.pd, 3000, 0);
        let rs = [r1.sge(0, 3000), r2.sge(0, 3000)];
        b.qp.post_recv(&[RecvWr {
            wr_id: 100,
            sg_list: &rs,
        }])
        .unwrap();
        let rs2 = [r1.sge(0, 16)];
        b.qp.post_recv(&[RecvWr {
            wr_id: 101,
            sg_list: &rs2,
        }])
        .unwrap();
        let sge = [s.sge(0, 5000)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
        let rw = wait1(&b.rcq);
        assert_eq!(
            (rw.status, rw.opcode, rw.byte_len, rw.wr_id),
            (WcStatus::Success, WcOpcode::Recv, 5000, 100)
        );
        assert_eq!(rw.src_qp, a.qp.qpn());
        assert_eq!(rw.qp_num, b.qp.qpn());
        assert!(!rw.wc_flags.contains(WcFlags::WITH_IMM));
        let mut got = r1.to_vec(0, 3000);
        got.extend(r2.to_vec(0, 2000));
        assert_eq!(got, pattern(5000, 9));
        let sge = [s.sge(0, 16)];
        a.qp.post_send(&[SendWr::new(2, WrOpcode::SendImm(0xabcd), &sge)])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let rw = wait1(&b.rcq);
        assert_eq!(
            (rw.status, rw.byte_len, rw.imm_data, rw.wr_id),
            (WcStatus::Success, 16, 0xabcd, 101)
        );
        assert!(rw.wc_flags.contains(WcFlags::WITH_IMM));
    });
}

#[test]
fn write_with_imm_consumes_a_recv() {
    each_path(|a, b| {
        let s = buf(&a.pd, 1000, 0);
        s.write(0, &pattern(1000, 3));
        let dst = buf(&b.pd, 1000, 0);
        b.qp.post_recv(&[RecvWr {
            wr_id: 55,
            sg_list: &[],
        }])
        .unwrap();
        let sge = [s.sge(0, 1000)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::WriteImm(77), &sge).remote(dst.addr() as u64, dst.rkey())])
            .unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::RdmaWrite));
        let rw = wait1(&b.rcq);
        assert_eq!(
            (rw.status, rw.opcode, rw.imm_data, rw.byte_len, rw.wr_id),
            (WcStatus::Success, WcOpcode::RecvRdmaWithImm, 77, 1000, 55)
        );
        assert_eq!(dst.to_vec(0, 1000), pattern(1000, 3));
    });
}

#[test]
fn atomics() {
    each_path(|a, b| {
        let t = buf(&b.pd, 64, 0);
        t.write(8, &100u64.to_le_bytes());
        let res = buf(&a.pd, 16, 0);
        let sge = [res.sge(0, 8)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::FetchAdd { add: 5 }, &sge).remote(t.addr() as u64 + 8, t.rkey())])
            .unwrap();
        let wc = wait1(&a.cq);
        assert_eq!(
            (wc.status, wc.opcode, wc.byte_len),
            (WcStatus::Success, WcOpcode::FetchAdd, 8)
        );
        assert_eq!(res.to_vec(0, 8), 100u64.to_le_bytes());
        assert_eq!(t.to_vec(8, 8), 105u64.to_le_bytes());
        // failing compare
        let sge = [res.sge(8, 8)];
        a.qp.post_send(&[
            SendWr::new(2, WrOpcode::CmpSwap { compare: 1, swap: 9 }, &sge).remote(t.addr() as u64 + 8, t.rkey())
        ])
        .unwrap();
        assert_eq!(wait1(&a.cq).opcode, WcOpcode::CompSwap);
        assert_eq!(res.to_vec(8, 8), 105u64.to_le_bytes());
        assert_eq!(t.to_vec(8, 8), 105u64.to_le_bytes());
        // succeeding compare
        a.qp.post_send(&[
            SendWr::new(3, WrOpcode::CmpSwap { compare: 105, swap: 9 }, &sge).remote(t.addr() as u64 + 8, t.rkey())
        ])
        .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(t.to_vec(8, 8), 9u64.to_le_bytes());
    });
}

#[test]
fn concurrent_fetch_add_is_atomic() {
    each_path(|a, b| {
        let t = buf(&b.pd, 8, 0);
        let res = buf(&a.pd, 8 * 64, 0);
        let n = 64;
        let mut wrs = Vec::new();
        let sges: Vec<[Sge; 1]> = (0..n).map(|i| [res.sge(i * 8, 8)]).collect();
        for (i, s) in sges.iter().enumerate() {
            wrs.push(SendWr::new(i as u64, WrOpcode::FetchAdd { add: 1 }, s).remote(t.addr() as u64, t.rkey()));
        }
        for chunk in wrs.chunks(16) {
            a.qp.post_send(chunk).unwrap();
            a.cq.poll_wait(chunk.len(), T).unwrap();
        }
        assert_eq!(t.to_vec(0, 8), (n as u64).to_le_bytes());
        let mut olds: Vec<u64> = (0..n)
            .map(|i| u64::from_le_bytes(res.to_vec(i * 8, 8).try_into().unwrap()))
            .collect();
        olds.sort();
        assert_eq!(olds, (0..n as u64).collect::<Vec<_>>());
    });
}

#[test]
fn unsignaled_wrs_complete_silently_and_in_order() {
    each_path(|a, b| {
        let s = buf(&a.pd, 64, 1);
        let d = buf(&b.pd, 64 * 10, 0);
        let sge = [s.sge(0, 64)];
        let wrs: Vec<SendWr> = (0..10)
            .map(|i| {
                SendWr::new(i, WrOpcode::Write, &sge)
                    .remote(d.addr() as u64 + 64 * i, d.rkey())
                    .flags(if i == 9 {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    })
            })
            .collect();
        a.qp.post_send(&wrs).unwrap();
        let wc = wait1(&a.cq);
        assert_eq!(wc.wr_id, 9);
        assert_eq!(d.to_vec(0, 640), vec![1; 640]);
        assert_empty(&a.cq);
    });
}

#[test]
fn inline_send_and_write() {
    each_path(|a, b| {
        let d = buf(&b.pd, 64, 0);
        let data = pattern(40, 5);
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &[])
            .remote(d.addr() as u64, d.rkey())
            .inline(&data)])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(d.to_vec(0, 40), data);
        let r = buf(&b.pd, 64, 0);
        let rs = [r.sge(0, 64)];
        b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &rs }]).unwrap();
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Send, &[]).inline(&data[..10])])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(wait1(&b.rcq).byte_len, 10);
        assert_eq!(r.to_vec(0, 10), data[..10]);
    });
}

#[test]
fn rc_ordering_read_after_write_and_mixed_ops() {
    each_path(|a, b| {
        let r = buf(&b.pd, 4096, 0);
        let s = buf(&a.pd, 4096, 0);
        let back = buf(&a.pd, 4096, 0);
        for round in 0..20u8 {
            s.write(0, &pattern(4096, round));
            let ss = [s.sge(0, 4096)];
            let bs = [back.sge(0, 4096)];
            a.qp.post_send(&[
                SendWr::new(1, WrOpcode::Write, &ss)
                    .remote(r.addr() as u64, r.rkey())
                    .flags(SendFlags::empty()),
                SendWr::new(2, WrOpcode::Read, &bs).remote(r.addr() as u64, r.rkey()),
            ])
            .unwrap();
            assert_eq!(wait1(&a.cq).wr_id, 2);
            assert_eq!(back.to_vec(0, 4096), pattern(4096, round));
        }
    });
}

#[test]
fn rnr_retry_then_success() {
    each_path(|a, b| {
        let s = buf(&a.pd, 8, 4);
        let sge = [s.sge(0, 8)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut w = [Wc::default(); 1];
        assert_eq!(a.cq.poll(&mut w).unwrap(), 0, "rnr_retry=7 retries forever");
        let r = buf(&b.pd, 8, 0);
        let rs = [r.sge(0, 8)];
        b.qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &rs }]).unwrap();
        // the NIC thread retries even if nobody polls the send CQ
        let rw = wait1(&b.rcq);
        assert_eq!((rw.status, rw.wr_id), (WcStatus::Success, 9));
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert!(a.host.stats().rnr_naks > 0);
    });
}

#[test]
fn rnr_retry_exceeded() {
    for retries in [0u8, 3] {
        let ha = Host::new(HostConfig::default()).unwrap();
        let hb = Host::new(HostConfig::default()).unwrap();
        let a = end(&ha, &QpInitAttr::default());
        let b = end(&hb, &QpInitAttr::default());
        connect(&a, &b, all_access(), retries);
        let s = buf(&a.pd, 8, 4);
        let sge = [s.sge(0, 8)];
        a.qp.post_send(&[
            SendWr::new(1, WrOpcode::Send, &sge),
            SendWr::new(2, WrOpcode::Send, &sge),
        ])
        .unwrap();
        let w = a.cq.poll_wait(2, T).unwrap();
        assert_eq!(w[0].status, WcStatus::RnrRetryExcErr);
        assert_eq!(w[1].status, WcStatus::WrFlushErr);
        assert_eq!(a.qp.state(), QpState::Err);
        assert_eq!(a.host.stats().rnr_naks, retries as u64 + 1);
    }
}

#[test]
fn completion_channel_wakes_blocked_receiver() {
    let (a, b) = pair();
    let ch = b.ctx.create_comp_channel().unwrap();
    let rcq = b.ctx.create_cq(16, Some(&ch)).unwrap();
    let qb = b.pd.create_qp(&b.cq, &rcq, &QpInitAttr::default()).unwrap();
    let qa = a.pd.create_qp(&a.cq, &a.rcq, &QpInitAttr::default()).unwrap();
    qa.connect(all_access(), b.host.addr(), qb.qpn(), 7).unwrap();
    qb.connect(all_access(), a.host.addr(), qa.qpn(), 7).unwrap();
    let r = buf(&b.pd, 8, 0);
    let rs = [r.sge(0, 8)];
    qb.post_recv(&[RecvWr { wr_id: 3, sg_list: &rs }]).unwrap();
    rcq.req_notify(false).unwrap();
    assert!(matches!(
        ch.get_event(Some(std::time::Duration::from_millis(10))),
        Err(Error::Timeout)
    ));
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let data = [1u8; 8];
        qa.post_send(&[SendWr::new(1, WrOpcode::Send, &[]).inline(&data)])
            .unwrap();
        qa
    });
    let fired = ch.get_event(Some(T)).unwrap();
    assert_eq!(fired.depth(), 16);
    let wc = wait1(&rcq);
    assert_eq!(wc.wr_id, 3);
    let _qa = t.join().unwrap();
    // solicited-only arming ignores unsolicited sends
    qb.post_recv(&[RecvWr { wr_id: 4, sg_list: &rs }, RecvWr { wr_id: 5, sg_list: &rs }])
        .unwrap();
    rcq.req_notify(true).unwrap();
    let data = [2u8; 8];
    _qa.post_send(&[SendWr::new(2, WrOpcode::Send, &[]).inline(&data)])
        .unwrap();
    assert!(matches!(
        ch.get_event(Some(std::time::Duration::from_millis(20))),
        Err(Error::Timeout)
    ));
    _qa.post_send(&[SendWr::new(3, WrOpcode::Send, &[])
        .inline(&data)
        .flags(SendFlags::SIGNALED | SendFlags::SOLICITED | SendFlags::INLINE)])
        .unwrap();
    ch.get_event(Some(T)).unwrap();
    assert_eq!(rcq.poll_wait(2, T).unwrap().len(), 2);
}

#[test]
fn loopback_same_host() {
    let h = Host::new(HostConfig::default()).unwrap();
    let a = end(&h, &QpInitAttr::default());
    let b = end(&h, &QpInitAttr::default());
    connect(&a, &b, all_access(), 7);
    let s = buf(&a.pd, 100, 7);
    let d = buf(&b.pd, 100, 0);
    let sge = [s.sge(0, 100)];
    a.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(d.addr() as u64, d.rkey())])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::Success);
    assert_eq!(d.to_vec(0, 100), vec![7; 100]);
}

/// A WRITE posted right after a READ into the buffer it sends from sends the READ's
/// data (the requester holds the gather until the READ landed), while a WRITE from
/// other memory does not wait for the READ.
#[test]
fn write_after_read_into_its_source_sends_the_read_data() {
    each_path(|a, b| {
        for &len in &[8usize, 4096, 200_000] {
            let remote = buf(&b.pd, 2 * len, 0);
            remote.write(0, &pattern(len, 3));
            let local = buf(&a.pd, 2 * len, 0x55);
            let rs = [local.sge(0, len as u32)];
            let ws = [local.sge(0, len as u32)];
            let other = [local.sge(len, len as u32)];
            a.qp.post_send(&[
                SendWr::new(1, WrOpcode::Read, &rs).remote(remote.addr() as u64, remote.rkey()),
                SendWr::new(2, WrOpcode::Write, &ws).remote(remote.addr() as u64 + len as u64, remote.rkey()),
                SendWr::new(3, WrOpcode::Write, &other).remote(remote.addr() as u64, remote.rkey()),
            ])
            .unwrap();
            let wcs = a.cq.poll_wait(3, T).unwrap();
            assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
            assert_eq!(
                remote.to_vec(len, len),
                pattern(len, 3),
                "{len} B: the WRITE sent the READ's data"
            );
            assert_eq!(
                remote.to_vec(0, len),
                vec![0x55; len],
                "{len} B: the last WRITE landed last"
            );
        }
    });
}
