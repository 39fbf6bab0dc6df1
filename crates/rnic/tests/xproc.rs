//! Cross-process tests: the test binary re-executes itself as a passive peer process
//! (env `RNIC_XPROC_CHILD=1`); the two exchange connection info over pipes (as
//! perftest does over TCP) and then talk through the shared-memory transport.

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::*;
use std::io::Write;

const BIG: usize = 1 << 20;

/// The passive side. Does nothing unless run as the child.
#[test]
fn xproc_child() {
    if std::env::var("RNIC_XPROC_CHILD").is_err() {
        return;
    }
    let host = Host::new(HostConfig::default()).unwrap();
    let e = end(&host, &QpInitAttr::default());
    let big = buf(&e.pd, BIG, 0);
    big.write(0, &pattern(BIG, 0x5a));
    let at = buf(&e.pd, 64, 0);
    at.write(0, &1000u64.to_le_bytes());
    let rbuf = buf(&e.pd, 8192, 0);
    // A second QP whose receive CQ has a completion channel (interrupt mode).
    let ch = e.ctx.create_comp_channel().unwrap();
    let ecq = e.ctx.create_cq(16, Some(&ch)).unwrap();
    let eqp = e.pd.create_qp(&e.cq, &ecq, &QpInitAttr::default()).unwrap();
    let info = format!(
        "{} {} {} {} {} {} {}",
        host.addr().to_hex(),
        e.qp.qpn(),
        eqp.qpn(),
        big.addr(),
        big.rkey(),
        at.addr(),
        at.rkey()
    );
    serve(&info, |w| {
        let reply = match w {
            ["PEER", a, q] => {
                e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                    .unwrap();
                let rs = [rbuf.sge(0, 8192)];
                e.qp.post_recv(&[
                    RecvWr {
                        wr_id: 11,
                        sg_list: &rs,
                    },
                    RecvWr {
                        wr_id: 12,
                        sg_list: &rs,
                    },
                ])
                .unwrap();
                "READY".to_string()
            }
            ["CHECK", off, len, seed] => {
                let (off, len): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                let ok = big.to_vec(off, len) == pattern(len, seed.parse().unwrap());
                if ok {
                    "OK".into()
                } else {
                    "BAD".into()
                }
            }
            ["RECV", len, seed] => match e.rcq.poll_wait(1, T) {
                Ok(v) => {
                    let len: usize = len.parse().unwrap();
                    let data_ok = rbuf.to_vec(0, len) == pattern(len, seed.parse().unwrap());
                    format!(
                        "WC {} {:?} {} {} {}",
                        v[0].wr_id, v[0].status, v[0].byte_len, v[0].imm_data, data_ok
                    )
                }
                Err(err) => format!("ERR {err}"),
            },
            ["PEER2", a, q] => {
                eqp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                    .unwrap();
                let rs = [rbuf.sge(0, 64)];
                eqp.post_recv(&[RecvWr {
                    wr_id: 21,
                    sg_list: &rs,
                }])
                .unwrap();
                ecq.req_notify(false).unwrap();
                "READY".to_string()
            }
            ["WAITEV"] => match ch.get_event(Some(T)) {
                Ok(cq) => {
                    let w = cq.poll_wait(1, T).unwrap()[0];
                    format!("WC {} {:?} {} {} event", w.wr_id, w.status, w.byte_len, w.imm_data)
                }
                Err(err) => format!("ERR {err}"),
            },
            ["ATOMIC"] => format!("VAL {}", u64::from_le_bytes(at.to_vec(0, 8).try_into().unwrap())),
            ["IOVA"] => {
                // An IOVA MR over 3 pages: RAM (the big buffer's first page), the
                // signature frame, the black-hole frame.
                let io = host.iommu();
                let range = io.alloc_range(3).unwrap();
                let page0 = big.addr() & !4095;
                let page0 = if page0 < big.addr() { page0 + 4096 } else { page0 };
                // SAFETY: `big` outlives the process's use of this MR (never freed).
                unsafe {
                    io.map_range(&range, 0, &[Frame::Ram(page0), Frame::Signature, Frame::BlackHole])
                        .unwrap();
                }
                // SAFETY: the VA is only used for addressing (3 pages inside `big`).
                let mr = unsafe { e.pd.reg_mr_iova(page0, 3 * 4096, all_access(), &range).unwrap() };
                let r = format!("IOVA {} {} {}", page0, mr.rkey(), page0 - big.addr());
                std::mem::forget(mr);
                r
            }
            ["STATE"] => format!("STATE {:?}", e.qp.state()),
            ["STATS"] => format!("STATS {}", host.stats().ring_requests),
            ["EXIT"] => return None,
            _ => "?".into(),
        };
        Some(reply)
    });
}

/// Reply prefixes of `xproc_child`.
const REPLIES: &[&str] = &[
    "INFO", "READY", "OK", "BAD", "WC", "ERR", "VAL", "STATE", "STATS", "IOVA",
];

fn spawn_child() -> Child {
    Child::spawn("xproc_child", "RNIC_XPROC_CHILD", "1", REPLIES)
}

/// Spawns the child, connects a fresh local QP (on a host with `cfg`) to the child's
/// QP at INFO field `qpn_field` and announces it with `peer` (`PEER` or `PEER2`).
/// Returns the child, its INFO line, the local host and the local end.
fn connect_child(cfg: HostConfig, qpn_field: usize, peer: &str) -> (Child, String, Host, End) {
    let mut c = spawn_child();
    let info = c.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let raddr = HostAddr::from_hex(f[1]).unwrap();
    let rqpn: u32 = f[qpn_field].parse().unwrap();
    let host = Host::new(cfg).unwrap();
    let e = end(&host, &QpInitAttr::default());
    e.qp.connect(all_access(), raddr, rqpn, 7).unwrap();
    assert_eq!(
        c.cmd(&format!("{peer} {} {}", host.addr().to_hex(), e.qp.qpn())),
        "READY"
    );
    (c, info, host, e)
}

#[test]
fn cross_process_all_operations() {
    let (mut c, info, host, e) = connect_child(HostConfig::default(), 2, "PEER");
    let f: Vec<&str> = info.split_whitespace().collect();
    assert_ne!(HostAddr::from_hex(f[1]).unwrap().pid, std::process::id());
    let (big_addr, big_rkey): (u64, u32) = (f[4].parse().unwrap(), f[5].parse().unwrap());
    let (at_addr, at_rkey): (u64, u32) = (f[6].parse().unwrap(), f[7].parse().unwrap());
    let exp = pattern(BIG, 0x5a);
    let local = buf(&e.pd, BIG, 0);

    // READ: small (NIC-thread ring) and large (process_vm) sizes
    for &len in &[2usize, 64, 4096, 4097, 65536, BIG] {
        local.fill(0);
        let off = if len == BIG { 0 } else { 100 };
        let sge = [local.sge(0, len as u32)];
        e.qp.post_send(&[SendWr::new(1, WrOpcode::Read, &sge).remote(big_addr + off as u64, big_rkey)])
            .unwrap();
        let wc = wait1(&e.cq);
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, len as u32), "READ {len}");
        assert_eq!(local.to_vec(0, len), exp[off..off + len], "READ {len} data");
    }
    assert!(
        c.cmd("STATS").trim_start_matches("STATS ").parse::<u64>().unwrap() >= 3,
        "small reads served by the target NIC thread"
    );

    // WRITE: small and large, verified by the child
    for (i, &len) in [8usize, 3000, 200_000, 600_000].iter().enumerate() {
        let seed = 10 + i as u8;
        local.write(0, &pattern(len, seed));
        let sge = [local.sge(0, len as u32)];
        e.qp.post_send(&[SendWr::new(2, WrOpcode::Write, &sge).remote(big_addr + 4096, big_rkey)])
            .unwrap();
        assert_eq!(wait1(&e.cq).status, WcStatus::Success);
        assert_eq!(c.cmd(&format!("CHECK 4096 {len} {seed}")), "OK", "WRITE {len}");
    }

    // SEND and SEND_WITH_IMM into the child's posted receives
    local.write(0, &pattern(5000, 33));
    let sge = [local.sge(0, 5000)];
    e.qp.post_send(&[SendWr::new(3, WrOpcode::Send, &sge)]).unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    assert_eq!(c.cmd("RECV 5000 33"), "WC 11 Success 5000 0 true");
    let sge = [local.sge(0, 100)];
    e.qp.post_send(&[SendWr::new(4, WrOpcode::SendImm(99), &sge)]).unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    assert_eq!(c.cmd("RECV 100 33"), "WC 12 Success 100 99 true");

    // atomics, executed by the child's NIC thread
    let res = buf(&e.pd, 16, 0);
    let s0 = [res.sge(0, 8)];
    let s1 = [res.sge(8, 8)];
    e.qp.post_send(&[
        SendWr::new(5, WrOpcode::FetchAdd { add: 7 }, &s0).remote(at_addr, at_rkey),
        SendWr::new(
            6,
            WrOpcode::CmpSwap {
                compare: 1007,
                swap: 42,
            },
            &s1,
        )
        .remote(at_addr, at_rkey),
    ])
    .unwrap();
    let w = e.cq.poll_wait(2, T).unwrap();
    assert!(w.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(res.to_vec(0, 8), 1000u64.to_le_bytes());
    assert_eq!(res.to_vec(8, 8), 1007u64.to_le_bytes());
    assert_eq!(c.cmd("ATOMIC"), "VAL 42");

    // error case: bad rkey -> REM_ACCESS_ERR, flush behind it, both QPs in ERR
    let sge = [local.sge(0, 8)];
    e.qp.post_send(&[
        SendWr::new(7, WrOpcode::Read, &sge).remote(big_addr, big_rkey ^ 0x4000),
        SendWr::new(8, WrOpcode::Read, &sge).remote(big_addr, big_rkey),
    ])
    .unwrap();
    let w = e.cq.poll_wait(2, T).unwrap();
    assert_eq!((w[0].wr_id, w[0].status), (7, WcStatus::RemAccessErr));
    assert_eq!((w[1].wr_id, w[1].status), (8, WcStatus::WrFlushErr));
    assert_eq!(c.cmd("STATE"), "STATE Err");
    assert_eq!(host.stats().nonresident_dma, 0);
}

#[test]
fn cross_process_large_write_error_out_of_bounds() {
    let (mut c, info, _host, e) = connect_child(HostConfig::default(), 2, "PEER");
    let f: Vec<&str> = info.split_whitespace().collect();
    let (big_addr, big_rkey): (u64, u32) = (f[4].parse().unwrap(), f[5].parse().unwrap());
    let local = buf(&e.pd, 2 * BIG, 0);
    let sge = [local.sge(0, (BIG + 1) as u32)];
    e.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(big_addr, big_rkey)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::RemAccessErr);
    assert_eq!(c.cmd(&format!("CHECK 0 {BIG} {}", 0x5a)), "OK", "target untouched");
}

#[test]
fn cross_process_completion_channel_is_signalled() {
    let (mut c, _info, _host, e) = connect_child(HostConfig::default(), 3, "PEER2");
    // The child blocks in get_event on its channel; our SEND must wake it through
    // its eventfd (pidfd_getfd).
    writeln!(c.inp, "WAITEV").unwrap();
    c.inp.flush().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(30));
    let data = [5u8; 16];
    e.qp.post_send(&[SendWr::new(1, WrOpcode::SendImm(7), &[]).inline(&data)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    assert_eq!(c.line(), "WC 21 Success 16 7 event");
}

#[test]
fn dead_peer_process_fails_wrs_instead_of_hanging() {
    let cfg = HostConfig {
        transport_timeout: std::time::Duration::from_millis(300),
        ..HostConfig::default()
    };
    let (mut c, info, host, e) = connect_child(cfg, 2, "PEER");
    let f: Vec<&str> = info.split_whitespace().collect();
    let raddr = HostAddr::from_hex(f[1]).unwrap();
    let rqpn: u32 = f[2].parse().unwrap();
    let (big_addr, big_rkey): (u64, u32) = (f[4].parse().unwrap(), f[5].parse().unwrap());
    let local = buf(&e.pd, 1 << 20, 0);
    let sge = [local.sge(0, 64)];
    e.qp.post_send(&[SendWr::new(1, WrOpcode::Read, &sge).remote(big_addr, big_rkey)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    // kill the peer process
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = std::time::Instant::now();
    e.qp.post_send(&[
        SendWr::new(2, WrOpcode::Read, &sge).remote(big_addr, big_rkey),
        SendWr::new(3, WrOpcode::Read, &sge).remote(big_addr, big_rkey),
    ])
    .unwrap();
    let w = e.cq.poll_wait(2, T).unwrap();
    assert_eq!((w[0].wr_id, w[0].status), (2, WcStatus::RetryExcErr));
    assert_eq!((w[1].wr_id, w[1].status), (3, WcStatus::WrFlushErr));
    assert!(t.elapsed() < std::time::Duration::from_secs(3));
    // a large READ (many ring parts) on a fresh QP to the dead host fails too
    let e2 = end(&host, &QpInitAttr::default());
    e2.qp.connect(all_access(), raddr, rqpn, 7).unwrap();
    // (A buffer of e2's own PD: an lkey of another PD is a local protection error.)
    let local = buf(&e2.pd, 1 << 20, 0);
    let sge = [local.sge(0, 1 << 20)];
    e2.qp
        .post_send(&[SendWr::new(4, WrOpcode::Read, &sge).remote(big_addr, big_rkey)])
        .unwrap();
    // As a vanished peer on a fabric: retries exhausted, not a key error.
    assert_eq!(wait1(&e2.cq).status, WcStatus::RetryExcErr);
}

#[test]
fn cross_process_iova_mr_special_frames() {
    let (mut c, _info, _host, e) = connect_child(HostConfig::default(), 2, "PEER");
    let io = c.cmd("IOVA");
    let g: Vec<&str> = io.split_whitespace().collect();
    let (va, rkey, off): (u64, u32, usize) = (g[1].parse().unwrap(), g[2].parse().unwrap(), g[3].parse().unwrap());
    let magic: Vec<u8> = (0..4096).map(|i| 0xdeadbeefu32.to_le_bytes()[i % 4]).collect();
    let exp0 = pattern(1 << 20, 0x5a)[off..off + 4096].to_vec();
    let local = buf(&e.pd, 3 * 4096, 0xcc);
    // small (NIC-thread) and large (direct) reads over RAM | signature | black hole
    for (wr_id, len) in [(1u64, 3 * 4096usize), (2, 4096)] {
        local.fill(0xcc);
        let sge = [local.sge(0, len as u32)];
        let at = if len == 4096 { va + 4096 } else { va };
        e.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Read, &sge).remote(at, rkey)])
            .unwrap();
        assert_eq!(wait1(&e.cq).status, WcStatus::Success);
        if len == 4096 {
            assert_eq!(local.to_vec(0, 4096), magic, "signature page through the NIC thread");
        } else {
            assert_eq!(local.to_vec(0, 4096), exp0, "RAM frame");
            assert_eq!(local.to_vec(4096, 4096), magic, "signature frame");
            assert_eq!(local.to_vec(8192, 4096), vec![0; 4096], "black-hole frame reads zeros");
        }
    }
    // writes into the special frames are dropped
    local.fill(0x11);
    let sge = [local.sge(0, 8192)];
    e.qp.post_send(&[SendWr::new(3, WrOpcode::Write, &sge).remote(va + 4096, rkey)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    let sge = [local.sge(0, 3 * 4096)];
    e.qp.post_send(&[SendWr::new(4, WrOpcode::Read, &sge).remote(va, rkey)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::Success);
    assert_eq!(local.to_vec(4096, 4096), magic);
    assert_eq!(local.to_vec(8192, 4096), vec![0; 4096]);
    assert_eq!(
        c.cmd(&format!("CHECK 0 {} {}", 1 << 20, 0x5a)),
        "OK",
        "the child's buffer is untouched"
    );
}
