//! Cross-process NP-RDMA: the target is a child process (this test binary
//! re-executed), reached over the software NIC's shared-memory transport.
//! READ and WRITE with remote major faults (the child swaps its MR out)
//! and a local fault on the parent side.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use nprdma::{Endpoint, Opcode, SendWr};

const LEN: usize = 256 * 1024;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn ep_from(s: &str) -> Endpoint {
    let b = unhex(s);
    Endpoint::from_bytes(b[..20].try_into().unwrap())
}

/// The child: registers a pattern MR, swaps it out, serves until stdin
/// says `check <off> <len> <seed>` (verify) or `quit`.
fn child_main() {
    let s = side();
    let mut out = std::io::stdout();
    let b = Buf::with(&s, LEN, Some(&pattern(42, LEN)));
    let qp = s.pd.create_qp(&s.cq, &s.rcq, 16).unwrap();
    writeln!(
        out,
        "NPX {} {} {}",
        hex(&qp.endpoint().to_bytes()),
        b.addr(),
        b.mr.rkey()
    )
    .unwrap();
    out.flush().unwrap();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let peer = ep_from(&lines.next().unwrap().unwrap());
    qp.connect(&peer).unwrap();
    b.swap_out();
    writeln!(out, "NPX ready").unwrap();
    out.flush().unwrap();
    for l in lines {
        let l = l.unwrap();
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.as_slice() {
            ["check", off, len, seed] => {
                let (off, len, seed): (usize, usize, u64) = (
                    off.parse().unwrap(),
                    len.parse().unwrap(),
                    seed.parse().unwrap(),
                );
                let ok = b.bytes()[off..off + len] == pattern(seed, len)[..];
                writeln!(out, "NPX {}", if ok { "ok" } else { "bad" }).unwrap();
                out.flush().unwrap();
            }
            ["u64", off] => {
                let off: usize = off.parse().unwrap();
                let v = u64::from_le_bytes(b.bytes()[off..off + 8].try_into().unwrap());
                writeln!(out, "NPX {v}").unwrap();
                out.flush().unwrap();
            }
            ["swap"] => {
                b.swap_out();
                writeln!(out, "NPX swapped").unwrap();
                out.flush().unwrap();
            }
            _ => break,
        }
    }
    assert_eq!(s.ctx.nic_stats().nonresident_dma, 0);
}

#[test]
fn xproc_child() {
    if std::env::var("NPRDMA_XPROC_CHILD").is_ok() {
        child_main();
    }
}

#[test]
fn cross_process_read_write_with_faults() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "xproc_child", "--nocapture", "--test-threads=1"])
        .env("NPRDMA_XPROC_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Watchdog: a hung child is killed, which fails the test instead of
    // hanging it.
    let pid = child.id() as i32;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d2 = done.clone();
    std::thread::spawn(move || {
        for _ in 0..600 {
            std::thread::sleep(Duration::from_millis(100));
            if d2.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
        }
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    });
    let mut cin = child.stdin.take().unwrap();
    let mut cout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut read_line = |cout: &mut BufReader<_>| -> String {
        loop {
            line.clear();
            assert!(cout.read_line(&mut line).unwrap() > 0, "child exited");
            // Skip the test harness's own output.
            if let Some(i) = line.find("NPX ") {
                return line[i + 4..].trim().to_string();
            }
        }
    };
    let first = read_line(&mut cout);
    eprintln!("parent: child said {first}");
    let w: Vec<&str> = first.split_whitespace().collect();
    let (peer, raddr, rkey): (Endpoint, u64, u32) =
        (ep_from(w[0]), w[1].parse().unwrap(), w[2].parse().unwrap());
    let a = side();
    let la = Buf::with(&a, LEN, Some(&pattern(7, LEN)));
    let qa = a.pd.create_qp(&a.cq, &a.rcq, 16).unwrap();
    qa.connect(&peer).unwrap();
    writeln!(cin, "{}", hex(&qa.endpoint().to_bytes())).unwrap();
    cin.flush().unwrap();
    assert_eq!(read_line(&mut cout), "ready");
    eprintln!("parent: child ready");

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
    writeln!(cin, "swap").unwrap();
    cin.flush().unwrap();
    assert_eq!(read_line(&mut cout), "swapped");
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
        writeln!(cin, "check {off} {len} 99").unwrap();
        cin.flush().unwrap();
        assert_eq!(
            read_line(&mut cout),
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
    writeln!(cin, "swap").unwrap();
    cin.flush().unwrap();
    assert_eq!(read_line(&mut cout), "swapped");
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
    writeln!(cin, "u64 {off}").unwrap();
    cin.flush().unwrap();
    assert_eq!(read_line(&mut cout), orig.wrapping_add(5).to_string());
    writeln!(cin, "quit").unwrap();
    drop(cin);
    let st = child.wait().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(st.success(), "child failed");
    assert!(a.ctx.stats().two_sided >= 3);
    assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
}
