//! The engine's modes, each over READ/WRITE with remote and local faults:
//! retry mode (Receiver-Ready), page-versioning READ, interrupt mode, and
//! no inline path (every fault through a reverse operation).

mod common;

use std::time::Duration;

use common::*;
use nprdma::{Config, Opcode, SendWr};

const LEN: usize = 128 * 1024;

fn exercise(cfg: Config) -> (nprdma::Stats, nprdma::Stats) {
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    let (qa, _qb) = connect(&a, &b, 16);
    let cases: [(usize, usize); 4] = [(0, 8), (300, 3000), (4096, 20000), (1000, 70000)];
    for (k, &(off, len)) in cases.iter().enumerate() {
        for fault in 0..4 {
            let pa = pattern(10 + k as u64, LEN);
            let pb = pattern(20 + k as u64, LEN);
            let la = Buf::with(&a, LEN, Some(&pa));
            let rb = Buf::with(&b, LEN, if fault == 2 { None } else { Some(&pb[..]) });
            match fault {
                1 => rb.swap_out(),
                3 => la.swap_out(),
                _ => {}
            }
            let pb = if fault == 2 { vec![0; LEN] } else { pb };
            qa.post_send(&[SendWr::new(
                1,
                Opcode::Read,
                Some(la.mr.sge(off as u64, len as u32)),
                rb.addr() + off as u64,
                rb.mr.rkey(),
            )])
            .unwrap();
            let c = a.cq.poll_wait(1, Duration::from_secs(10));
            assert_eq!(c.len(), 1);
            assert_eq!(c[0].status, 0, "READ {off}+{len} fault {fault}");
            assert!(la.bytes()[off..off + len] == pb[off..off + len]);
            if fault == 1 {
                rb.swap_out();
            }
            let src = LEN - len;
            qa.post_send(&[SendWr::new(
                2,
                Opcode::Write,
                Some(la.mr.sge(src as u64, len as u32)),
                rb.addr() + off as u64,
                rb.mr.rkey(),
            )])
            .unwrap();
            let c = a.cq.poll_wait(1, Duration::from_secs(10));
            assert_eq!(c.len(), 1);
            assert_eq!(c[0].status, 0, "WRITE {off}+{len} fault {fault}");
            let mut want = pb.clone();
            want[off..off + len].copy_from_slice(&la.bytes()[src..src + len]);
            assert!(
                rb.bytes() == &want[..],
                "WRITE data {off}+{len} fault {fault}"
            );
        }
    }
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
    (a.ctx.stats(), b.ctx.stats())
}

#[test]
fn retry_mode() {
    let (sa, sb) = exercise(Config {
        retry_mode: true,
        ..Config::default()
    });
    assert!(sa.retries > 0 && sb.served > 0, "{sa:?} {sb:?}");
}

#[test]
fn versioned_read() {
    let mut cfg = Config::default();
    cfg.plan.read_version_threshold = Some(0);
    let (sa, _) = exercise(cfg);
    assert!(sa.optimistic_ok > 0 && sa.two_sided > 0, "{sa:?}");
}

#[test]
fn interrupt_mode() {
    exercise(Config {
        interrupt_mode: true,
        ..Config::default()
    });
}

#[test]
fn no_inline_path() {
    let mut cfg = Config::default();
    cfg.plan.inline_max = 0;
    exercise(cfg);
}

#[test]
fn readback_only_writes() {
    let mut cfg = Config::default();
    cfg.plan.write_version_threshold = 1 << 20;
    exercise(cfg);
}
