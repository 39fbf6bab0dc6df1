//! Regression tests: separate ring limits for READ/WRITE (`ring_rw_max`) and atomics
//! (always through the target's NIC thread, whatever `ring_max`), and one CQ fed by a
//! QP's own send completions and a peer's receive pushes at the same time.

mod common;
use common::*;
use rnic::*;

/// One READ, one WRITE (`len` bytes each) and a FetchAdd + CmpSwap from a to b, all
/// verified; returns how many requests b's NIC thread served for them.
fn rw_and_atomics(cfg: HostConfig, len: usize) -> u64 {
    let (a, b) = pair_cfg(cfg);
    let t = buf(&b.pd, 16384, 0);
    t.write(0, &pattern(len, 9));
    t.write(12000, &100u64.to_le_bytes());
    let l = buf(&a.pd, 16384, 0);
    l.write(4096, &pattern(len, 4));
    let before = b.host.stats().ring_requests;
    let rs = [l.sge(0, len as u32)];
    let ws = [l.sge(4096, len as u32)];
    let fs = [l.sge(12000, 8)];
    let cs = [l.sge(12008, 8)];
    a.qp.post_send(&[
        SendWr::new(1, WrOpcode::Read, &rs).remote(t.addr() as u64, t.rkey()),
        SendWr::new(2, WrOpcode::Write, &ws).remote(t.addr() as u64 + 4096, t.rkey()),
        SendWr::new(3, WrOpcode::FetchAdd { add: 5 }, &fs).remote(t.addr() as u64 + 12000, t.rkey()),
        SendWr::new(4, WrOpcode::CmpSwap { compare: 105, swap: 7 }, &cs).remote(t.addr() as u64 + 12000, t.rkey()),
    ])
    .unwrap();
    let wcs = a.cq.poll_wait(4, T).unwrap();
    for (i, w) in wcs.iter().enumerate() {
        assert_eq!((w.wr_id, w.status), (i as u64 + 1, WcStatus::Success), "{w:?}");
    }
    assert_eq!(l.to_vec(0, len), pattern(len, 9), "READ data");
    assert_eq!(t.to_vec(4096, len), pattern(len, 4), "WRITE data");
    assert_eq!(l.to_vec(12000, 8), 100u64.to_le_bytes(), "FetchAdd result");
    assert_eq!(l.to_vec(12008, 8), 105u64.to_le_bytes(), "CmpSwap result");
    assert_eq!(t.to_vec(12000, 8), 7u64.to_le_bytes(), "atomics applied");
    b.host.stats().ring_requests - before
}

#[test]
fn default_limits_unchanged() {
    // Old behaviour: READ/WRITE up to ring_max and atomics all through the ring.
    assert_eq!(rw_and_atomics(ring_cfg(), 64), 4);
    // Larger than ring_max: READ/WRITE direct, atomics through the ring.
    let cfg = HostConfig {
        ring_max: 32,
        ..ring_cfg()
    };
    assert_eq!(rw_and_atomics(cfg, 64), 2);
}

#[test]
fn ring_max_zero_still_serves_atomics() {
    // Used to refuse the atomics (8 bytes > ring_max) with REM_INV_REQ_ERR.
    for ring_max in [0, 4] {
        let cfg = HostConfig { ring_max, ..ring_cfg() };
        assert_eq!(rw_and_atomics(cfg.clone(), 16), 2, "ring_max {ring_max}: 16 B direct");
        // Tiny READ/WRITE (payload in the slot header) above ring_max go direct too.
        assert_eq!(rw_and_atomics(cfg, 6), 2, "ring_max {ring_max}: 6 B direct");
    }
}

#[test]
fn ring_rw_max_zero_sends_read_write_direct() {
    let cfg = HostConfig {
        ring_rw_max: Some(0),
        ..ring_cfg()
    };
    for len in [4, 64, 4096] {
        assert_eq!(rw_and_atomics(cfg.clone(), len), 2, "{len} B");
    }
    let cfg = HostConfig {
        ring_rw_max: Some(128),
        ..ring_cfg()
    };
    assert_eq!(rw_and_atomics(cfg.clone(), 128), 4);
    assert_eq!(rw_and_atomics(cfg, 129), 2);
    // A threshold above ring_max is clamped to it.
    let cfg = HostConfig {
        ring_max: 64,
        ring_rw_max: Some(1 << 20),
        ..ring_cfg()
    };
    assert_eq!(rw_and_atomics(cfg, 128), 2);
}

/// The NP-RDMA layer's setup: one CQ of host b receives b's own send completions
/// (WRITEs to a) and the receive completions a's requester pushes into b's segment,
/// concurrently. Nothing may be lost, duplicated, reordered within its kind, or turn
/// into a (spurious) CQ overflow. Long form: `RNIC_SHARED_CQ_MSGS=200000`.
#[test]
fn one_cq_for_local_sends_and_remote_receives() {
    let n: u64 = std::env::var("RNIC_SHARED_CQ_MSGS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    const RQ: u64 = 16;
    const SQ: u64 = 16;
    for cfg in [HostConfig::default(), ring_cfg()] {
        let ha = Host::new(cfg.clone()).unwrap();
        let hb = Host::new(cfg).unwrap();
        let a = end(&ha, &QpInitAttr::default());
        let bctx = hb.open_context().unwrap();
        let bpd = bctx.alloc_pd().unwrap();
        let bcq = bctx.create_cq(2 * (RQ + SQ) as u32, None).unwrap();
        let bqp = bpd.create_qp(&bcq, &bcq, &QpInitAttr::default()).unwrap();
        a.qp.connect(all_access(), hb.addr(), bqp.qpn(), 7).unwrap();
        bqp.connect(all_access(), ha.addr(), a.qp.qpn(), 7).unwrap();
        let abuf = buf(&a.pd, 4096, 0);
        let bbuf = buf(&bpd, 4096, 0);
        std::thread::scope(|s| {
            // a: SENDs with their sequence number as immediate data.
            s.spawn(|| {
                let sge = [abuf.sge(0, 16)];
                let mut i = 0;
                while i < n {
                    let k = (n - i).min(8);
                    let wrs: Vec<SendWr> = (i..i + k)
                        .map(|j| SendWr::new(j, WrOpcode::SendImm(j as u32), &sge))
                        .collect();
                    a.qp.post_send(&wrs).unwrap();
                    for w in a.cq.poll_wait(k as usize, T).unwrap() {
                        assert_eq!(w.status, WcStatus::Success, "a's SEND {w:?}");
                    }
                    i += k;
                }
            });
            // b: keeps its RQ stocked, WRITEs to a, polls the shared CQ.
            let rs = [bbuf.sge(0, 64)];
            let ws = [bbuf.sge(1024, 32)];
            let (mut posted_r, mut recvd, mut posted_w, mut written) = (0u64, 0u64, 0u64, 0u64);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let mut out = [Wc::default(); 16];
            while recvd < n || written < n {
                while posted_r < n && posted_r - recvd < RQ {
                    bqp.post_recv(&[RecvWr {
                        wr_id: posted_r,
                        sg_list: &rs,
                    }])
                    .unwrap();
                    posted_r += 1;
                }
                while posted_w < n && posted_w - written < SQ {
                    bqp.post_send(&[SendWr::new(1 << 40 | posted_w, WrOpcode::Write, &ws)
                        .remote(abuf.addr() as u64 + 2048, abuf.rkey())])
                        .unwrap();
                    posted_w += 1;
                }
                let k = bcq.poll(&mut out).expect("shared CQ failed (overflow)");
                for w in &out[..k] {
                    assert_eq!(w.status, WcStatus::Success, "{w:?}");
                    if w.opcode == WcOpcode::Recv {
                        assert_eq!((w.wr_id, w.imm_data as u64), (recvd, recvd), "receive order");
                        recvd += 1;
                    } else {
                        assert_eq!(
                            (w.opcode, w.wr_id),
                            (WcOpcode::RdmaWrite, 1 << 40 | written),
                            "send order"
                        );
                        written += 1;
                    }
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "stuck at {recvd} recvs, {written} writes"
                );
            }
        });
        assert_empty(&bcq);
    }
}
