//! Cross-process NP-RDMA: the target is a child process (this test binary
//! re-executed), reached over the software NIC's shared-memory transport.
//! READ and WRITE with remote major faults (the child swaps its MR out)
//! and a local fault on the parent side.

mod common;

use std::io::BufRead;
use std::time::Duration;

use common::child::{ep_from, hex, say, ChildProc};
use common::*;
use nprdma::{Endpoint, Opcode, SendWr};

const LEN: usize = 256 * 1024;

/// The child: registers a pattern MR, swaps it out, serves until stdin
/// says `check <off> <len> <seed>` (verify) or `quit`.
fn child_main() {
    let s = side();
    let mut out = std::io::stdout();
    let b = Buf::with(&s, LEN, Some(&pattern(42, LEN)));
    let qp = s.pd.create_qp(&s.cq, &s.rcq, 16).unwrap();
    // A page of a second PD (resident and mapped): no QP of the peer's may reach it.
    let pd2 = s.ctx.alloc_pd();
    let mut other = s.pager.alloc(4096).unwrap();
    other.as_mut_slice().copy_from_slice(&pattern(43, 4096));
    let acc = nprdma::Access(
        nprdma::Access::LOCAL_WRITE.0
            | nprdma::Access::REMOTE_READ.0
            | nprdma::Access::REMOTE_WRITE.0,
    );
    // SAFETY: `other` outlives the MR (dropped after it, at the end of this function).
    let mr2 = unsafe { pd2.reg_mr(other.addr() as u64, 4096, acc) }.unwrap();
    say(
        &mut out,
        &format!(
            "{} {} {} {} {}",
            hex(&qp.endpoint().to_bytes()),
            b.addr(),
            b.mr.rkey(),
            other.addr(),
            mr2.rkey()
        ),
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let peer = ep_from(&lines.next().unwrap().unwrap());
    qp.connect(&peer).unwrap();
    b.swap_out();
    say(&mut out, "ready");
    nprdma_test_support::serve_checks(lines, &b.region);
    assert_eq!(s.ctx.nic_stats().nonresident_dma, 0);
    assert!(
        other.as_slice() == &pattern(43, 4096)[..],
        "the second PD's page changed"
    );
    drop(mr2);
}

#[test]
fn xproc_child() {
    if std::env::var("NPRDMA_XPROC_CHILD").is_ok() {
        child_main();
    }
}

/// This side of a cross-process test: the child target (spawned, its MR
/// swapped out, ready) and our side, buffer and connected QP.
struct Parent {
    child: ChildProc,
    a: Side,
    la: Buf,
    qa: nprdma::Qp,
    raddr: u64,
    rkey: u32,
    /// A page of the child's second PD and its rkey.
    other: (u64, u32),
}

/// Spawn the child target and connect to it with a QP of `depth`.
fn start(cfg: nprdma::Config, depth: u32) -> Parent {
    let mut child = ChildProc::spawn("xproc_child", "NPRDMA_XPROC_CHILD", Duration::from_secs(60));
    let first = child.read_line();
    let w: Vec<&str> = first.split_whitespace().collect();
    let (peer, raddr, rkey): (Endpoint, u64, u32) =
        (ep_from(w[0]), w[1].parse().unwrap(), w[2].parse().unwrap());
    let other = (w[3].parse().unwrap(), w[4].parse().unwrap());
    let a = side_with(cfg);
    let la = Buf::with(&a, LEN, Some(&pattern(7, LEN)));
    let qa = a.pd.create_qp(&a.cq, &a.rcq, depth).unwrap();
    qa.connect(&peer).unwrap();
    child.send(&hex(&qa.endpoint().to_bytes()));
    assert_eq!(child.read_line(), "ready");
    Parent {
        child,
        a,
        la,
        qa,
        raddr,
        rkey,
        other,
    }
}

/// The engine configuration of the peer-death tests: two-sided requests
/// time out after 500 ms.
fn short_timeout() -> nprdma::Config {
    nprdma::Config {
        two_sided_timeout: Duration::from_millis(500),
        ..Default::default()
    }
}

#[test]
fn cross_process_read_write_with_faults() {
    let Parent {
        mut child,
        a,
        la,
        qa,
        raddr,
        rkey,
        ..
    } = start(nprdma::Config::default(), 16);

    // READ with a remote major fault (small: inline; large: reverse WRITE).
    for &(off, len) in &[(100usize, 64usize), (8192, 20000)] {
        qa.post_send(&[SendWr::new(
            1,
            Opcode::Read,
            Some(la.mr.sge(off as u64, len as u32)),
            raddr + off as u64,
            rkey,
        )])
        .unwrap();
        let c = a.cq.poll_wait(1, Duration::from_secs(10));
        eprintln!("parent: READ {off}+{len}: {c:?}");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].status, 0, "{:?}", c[0]);
        assert_eq!(
            &la.bytes()[off..off + len],
            &pattern(42, LEN)[off..off + len]
        );
    }
    // WRITE with a local major fault and a remote fault.
    child.send("swap");
    assert_eq!(child.read_line(), "swapped");
    let mut lb = Buf::with(&a, LEN, None);
    lb.bytes_mut()[..LEN].copy_from_slice(&pattern(99, LEN));
    lb.swap_out();
    for &(off, len) in &[(0usize, 512usize), (65536, 100_000)] {
        qa.post_send(&[SendWr::new(
            2,
            Opcode::Write,
            Some(lb.mr.sge(0, len as u32)),
            raddr + off as u64,
            rkey,
        )])
        .unwrap();
        let c = a.cq.poll_wait(1, Duration::from_secs(10));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].status, 0, "{:?}", c[0]);
        child.send(&format!("check {off} {len} 99"));
        assert_eq!(
            child.read_line(),
            "ok",
            "child memory after WRITE {off}+{len}"
        );
    }
    // No-fault path across processes too (mapped now): READ it back.
    qa.post_send(&[SendWr::new(
        3,
        Opcode::Read,
        Some(la.mr.sge(0, 512)),
        raddr,
        rkey,
    )])
    .unwrap();
    assert_eq!(a.cq.poll_wait(1, Duration::from_secs(10))[0].status, 0);
    assert_eq!(&la.bytes()[..512], &pattern(99, 512)[..]);
    // Atomics across processes, executed by the child's CPU (page swapped out).
    child.send("swap");
    assert_eq!(child.read_line(), "swapped");
    let off = 200_000u64;
    let orig = u64::from_le_bytes(
        pattern(42, LEN)[off as usize..off as usize + 8]
            .try_into()
            .unwrap(),
    );
    qa.post_send(&[SendWr::new(
        4,
        Opcode::FetchAdd { add: 5 },
        Some(la.mr.sge(1024, 8)),
        raddr + off,
        rkey,
    )])
    .unwrap();
    let c = a.cq.poll_wait(1, Duration::from_secs(10));
    assert_eq!(c[0].status, 0, "{:?}", c[0]);
    assert_eq!(
        u64::from_le_bytes(la.bytes()[1024..1032].try_into().unwrap()),
        orig
    );
    child.send(&format!("u64 {off}"));
    assert_eq!(child.read_line(), orig.wrapping_add(5).to_string());
    child.send("quit");
    assert!(child.finish(), "child failed");
    assert!(a.ctx.stats().two_sided >= 3);
    assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
}

/// Protection domains across processes: the child's QP is in its first PD;
/// a WRITE through it with the rkey of a (resident, mapped) page of the
/// child's second PD is refused by the child's NIC (REM_ACCESS_ERR, the QP
/// to ERR, the WR behind it flushed) and the page keeps its bytes (the child
/// checks them when it exits).
#[test]
fn an_rkey_of_another_pd_is_refused_across_processes() {
    let Parent {
        mut child,
        a,
        la,
        qa,
        other: (addr2, rkey2),
        ..
    } = start(nprdma::Config::default(), 16);
    let wr = |id, op| SendWr::new(id, op, Some(la.mr.sge(0, 64)), addr2, rkey2);
    qa.post_send(&[wr(1, Opcode::Write), wr(2, Opcode::Read)])
        .unwrap();
    let c = a.cq.poll_wait(2, Duration::from_secs(10));
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!((c[0].wr_id, c[0].status), (1, 10), "{c:?}");
    assert_eq!((c[1].wr_id, c[1].status), (2, 5), "flushed behind: {c:?}");
    assert_eq!(&la.bytes()[..64], &pattern(7, 64)[..], "nothing read");
    child.send("quit");
    assert!(
        child.finish(),
        "child failed (its second PD's page changed?)"
    );
}

/// The target process dies with operations in flight (two-sided: its MR is
/// swapped out) and after: the survivor's WRs complete as on a fabric whose
/// peer vanished — the oldest with RETRY_EXC_ERR, the rest WR_FLUSH_ERR,
/// exactly once each, within the two-sided timeout — and its teardown
/// (MR, QP) is quick.
#[test]
fn a_dead_target_process_fails_wrs_with_retry_exceeded_then_flush() {
    let Parent {
        child,
        a,
        la,
        qa,
        raddr,
        rkey,
        ..
    } = start(short_timeout(), 16);
    qa.post_send(&[SendWr::new(
        1,
        Opcode::Read,
        Some(la.mr.sge(0, 64)),
        raddr,
        rkey,
    )])
    .unwrap();
    assert_eq!(a.cq.poll_wait(1, Duration::from_secs(10))[0].status, 0);
    child.kill();
    let t = std::time::Instant::now();
    let wrs: Vec<SendWr> = (0..4u64)
        .map(|i| {
            SendWr::new(
                10 + i,
                Opcode::Read,
                Some(la.mr.sge(i * 4096, 64)),
                raddr + 8192 + i * 4096,
                rkey,
            )
        })
        .collect();
    qa.post_send(&wrs).unwrap();
    let c = a.cq.poll_wait(4, Duration::from_secs(10));
    assert_eq!(c.len(), 4, "one completion per WR: {c:?}");
    assert_eq!(
        (c[0].wr_id, c[0].status),
        (10, 12),
        "RETRY_EXC_ERR first: {c:?}"
    );
    for x in &c[1..] {
        assert_eq!(x.status, 5, "then WR_FLUSH_ERR: {c:?}");
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(50));
    let mut more = [nprdma::Completion::default(); 4];
    assert_eq!(a.cq.poll(&mut more), 0, "extra completion {:?}", more[0]);
    let t = std::time::Instant::now();
    drop(qa);
    drop(la);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "teardown {:?}",
        t.elapsed()
    );
}

/// Fault injection: the target process is SIGKILLed at a random point of a
/// stream of READs, WRITEs and atomics (some on swapped-out pages, so on the
/// two-sided path). Every posted WR completes exactly once, with success or
/// RETRY_EXC_ERR / WR_FLUSH_ERR, within a bound; then the survivor's
/// teardown is quick and no NIC access ever reached a non-resident page; as
/// on RC, nothing completes successfully behind the first failed WR.
#[test]
fn target_killed_at_random_points_of_traffic() {
    peer_lost_at_random_points(libc::SIGKILL);
}

/// The same with the target stopped (SIGSTOP) instead of killed, and continued only
/// after the survivor gave up on it and tore its side down: a stopped peer costs a
/// bounded time (the transport and two-sided timeouts), and its resuming later touches
/// nothing of the survivor's.
#[test]
fn target_stopped_at_random_points_of_traffic() {
    peer_lost_at_random_points(libc::SIGSTOP);
}

fn peer_lost_at_random_points(sig: i32) {
    use std::collections::HashSet;
    use std::time::Instant;
    for round in 0..4u64 {
        let Parent {
            child,
            a,
            la,
            qa,
            raddr,
            rkey,
            ..
        } = start(short_timeout(), 32);
        let pid = child.pid() as i32;
        let delay = Duration::from_micros(500 + 4000 * round);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: signalling our own child process.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, sig)
            };
        });
        let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ (round + 1));
        let (mut posted, mut done) = (0u64, HashSet::new());
        let mut failed = false;
        let mut statuses = Vec::new();
        let start = Instant::now();
        let mut buf = [nprdma::Completion::default(); 16];
        while !failed || done.len() < posted as usize {
            if !failed
                && posted - (done.len() as u64) < 16
                && start.elapsed() < Duration::from_secs(2)
            {
                let len = (rand_len(&mut r) as u64).min(16 * 1024);
                let off = r.below(LEN as u64 - len) & !7;
                let op = match r.below(3) {
                    0 => Opcode::Read,
                    1 => Opcode::Write,
                    _ => Opcode::FetchAdd { add: 1 },
                };
                let l = if matches!(op, Opcode::FetchAdd { .. }) {
                    8
                } else {
                    len as u32
                };
                let wr = SendWr::new(posted, op, Some(la.mr.sge(off, l)), raddr + off, rkey);
                match qa.post_send(&[wr]) {
                    Ok(()) => posted += 1,
                    Err(_) => failed = true,
                }
            }
            let n = a.cq.poll(&mut buf);
            for c in &buf[..n] {
                assert!(
                    done.insert(c.wr_id),
                    "round {round}: two completions for wr {}",
                    c.wr_id
                );
                statuses.push(c.status);
                if c.status != 0 {
                    failed = true;
                }
            }
            if start.elapsed() > Duration::from_secs(2) {
                failed = true;
            }
            assert!(
                start.elapsed() < Duration::from_secs(12),
                "round {round}: {} of {posted} WRs completed after the peer's death",
                done.len()
            );
        }
        killer.join().unwrap();
        assert!(
            statuses.iter().all(|s| [0, 5, 12].contains(s)),
            "round {round}: statuses {statuses:?}"
        );
        assert!(
            statuses.iter().any(|&s| s != 0),
            "round {round}: the peer's death was never seen"
        );
        // RC: nothing completes successfully behind a failed WR.
        if let Some(i) = statuses.iter().position(|&s| s != 0) {
            assert!(
                statuses[i..].iter().all(|&s| s != 0),
                "round {round}: success after an error: {statuses:?}"
            );
        }
        let t = Instant::now();
        drop(qa);
        drop(la);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "round {round}: teardown {:?}",
            t.elapsed()
        );
        assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
        if sig == libc::SIGSTOP {
            // SAFETY: signalling our own child process.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, libc::SIGCONT)
            };
            std::thread::sleep(Duration::from_millis(20));
        }
        child.kill();
    }
}
