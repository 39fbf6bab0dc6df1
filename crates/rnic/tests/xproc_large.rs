//! Cross-process large READ/WRITE (up to 8 MiB) ending exactly at the end of the
//! target MR: with target-enforced protection (the default: every byte through the
//! target's ring, in parts), and between trusting hosts for several `ring_max` /
//! `ring_rw_max` settings (shared copies with the target's NIC thread on and off), and
//! atomics next to them. The test binary
//! re-executes itself as the passive peer (env `RNIC_XLARGE_CHILD=<ring_max>`).
//! Long form: `RNIC_XLARGE_ROUNDS=50`.

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::*;

const MB: usize = 1 << 20;
const RLEN: usize = 8 * MB;

/// `ring_max,ring_rw_max` between trusting hosts (`-` = default), or `secure`.
fn parse_cfg(s: &str) -> HostConfig {
    if s == "secure" {
        return HostConfig::default();
    }
    let (m, rw) = s.split_once(',').expect("ring_max,rw");
    HostConfig {
        ring_max: m.parse().unwrap(),
        ring_rw_max: rw.parse().ok(),
        trusted_peers: true,
        ..HostConfig::default()
    }
}

/// The passive side. Does nothing unless run as the child.
#[test]
fn xlarge_child() {
    let Ok(c) = std::env::var("RNIC_XLARGE_CHILD") else {
        return;
    };
    let host = Host::new(parse_cfg(&c)).unwrap();
    let e = end(&host, &QpInitAttr::default());
    let big = buf(&e.pd, RLEN, 0);
    big.write(0, &pattern(RLEN, 0x3c));
    let at = buf(&e.pd, 64, 0);
    let info = format!(
        "{} {} {} {} {} {}",
        host.addr().to_hex(),
        e.qp.qpn(),
        big.addr(),
        big.rkey(),
        at.addr(),
        at.rkey()
    );
    serve(&info, |w| match w {
        ["PEER", a, q] => {
            e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                .unwrap();
            Some("READY".to_string())
        }
        ["CHECK", off, len, seed] => {
            let (off, len): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
            let ok = big.to_vec(off, len) == pattern(len, seed.parse().unwrap());
            big.write(off, &pattern(RLEN, 0x3c)[off..off + len]);
            Some(if ok { "OK" } else { "BAD" }.to_string())
        }
        ["EXIT"] => None,
        _ => Some("?".into()),
    });
}

fn spawn_child(ring_max: &str) -> Child {
    Child::spawn(
        "xlarge_child",
        "RNIC_XLARGE_CHILD",
        ring_max,
        &["INFO", "READY", "OK", "BAD"],
    )
}

fn run(c: &str) {
    let rounds: usize = std::env::var("RNIC_XLARGE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut ch = spawn_child(c);
    let info = ch.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let raddr = HostAddr::from_hex(f[1]).unwrap();
    let rqpn: u32 = f[2].parse().unwrap();
    let (big, rkey): (u64, u32) = (f[3].parse().unwrap(), f[4].parse().unwrap());
    let (at, at_rkey): (u64, u32) = (f[5].parse().unwrap(), f[6].parse().unwrap());
    let host = Host::new(parse_cfg(c)).unwrap();
    let e = end(&host, &QpInitAttr::default());
    e.qp.connect(all_access(), raddr, rqpn, 7).unwrap();
    assert_eq!(
        ch.cmd(&format!("PEER {} {}", host.addr().to_hex(), e.qp.qpn())),
        "READY"
    );
    let exp = pattern(RLEN, 0x3c);
    let local = buf(&e.pd, RLEN, 0);
    let res = buf(&e.pd, 8, 0);
    let mut wr_id = 0;
    let mut fadd = 0u64;
    for round in 0..rounds {
        let sizes: &[usize] = if rounds > 1 {
            &[8, 4096, 256 * 1024, 512 * 1024, MB, MB + 4096 + 8, 2 * MB, 4 * MB, RLEN]
        } else {
            &[8, 512 * 1024, MB, MB + 4096 + 8, RLEN]
        };
        for &len in sizes {
            // READ of the last `len` bytes of the target MR into the end of ours.
            let off = RLEN - len;
            local.fill(0);
            let sge = [local.sge(off, len as u32)];
            wr_id += 1;
            e.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Read, &sge).remote(big + off as u64, rkey)])
                .unwrap();
            let wc = wait1(&e.cq);
            assert_eq!(
                (wc.wr_id, wc.status, wc.byte_len),
                (wr_id, WcStatus::Success, len as u32),
                "{c}: round {round}: READ {len} at the end of the MR"
            );
            assert!(local.to_vec(off, len) == exp[off..], "{c}: READ {len} data");
            // WRITE of the last `len` bytes, checked by the child.
            let seed = (round * 7 + len) as u8;
            local.write(off, &pattern(len, seed));
            wr_id += 1;
            e.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Write, &sge).remote(big + off as u64, rkey)])
                .unwrap();
            let wc = wait1(&e.cq);
            assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "{c}: WRITE {len}");
            assert_eq!(
                ch.cmd(&format!("CHECK {off} {len} {seed}")),
                "OK",
                "{c}: WRITE {len} data"
            );
            // An atomic between the large transfers (always through the NIC thread).
            let s = [res.sge(0, 8)];
            wr_id += 1;
            e.qp.post_send(&[SendWr::new(wr_id, WrOpcode::FetchAdd { add: 1 }, &s).remote(at, at_rkey)])
                .unwrap();
            let wc = wait1(&e.cq);
            assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "{c}: FetchAdd");
            assert_eq!(res.to_vec(0, 8), fadd.to_le_bytes());
            fadd += 1;
        }
    }
    // One byte past the end is refused, not partly done.
    let sge = [local.sge(0, MB as u32)];
    e.qp.post_send(&[SendWr::new(0, WrOpcode::Read, &sge).remote(big + (RLEN - MB + 1) as u64, rkey)])
        .unwrap();
    assert_eq!(wait1(&e.cq).status, WcStatus::RemAccessErr, "{c}: past the end");
    assert_eq!(host.stats().nonresident_dma, 0);
}

#[test]
fn large_transfers_at_mr_end_target_enforced() {
    run("secure");
}

#[test]
fn large_transfers_at_mr_end_ring_max_8() {
    run("8,-");
}

#[test]
fn large_transfers_at_mr_end_default_ring() {
    run("4096,-");
}

#[test]
fn large_transfers_at_mr_end_ring_rw_max_0() {
    run("4096,0");
}

#[test]
fn large_transfers_at_mr_end_ring_max_0() {
    run("0,-");
}
