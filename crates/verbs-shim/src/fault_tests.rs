//! Fault injection through the C ABI, in two processes and both modes: a server (this
//! test binary re-run in the server role) registers memory and serves; a client (the
//! binary re-run in the client role, in the mode under test) drives READ, WRITE,
//! FETCH_ADD and SEND traffic at it and, at a random point, kills the server
//! (SIGKILL), stops it for a random time (SIGSTOP … SIGCONT), or has it unmap its
//! registered memory (munmap, or mremap away) and map new memory at the same address. Asserted: exactly one
//! completion per WR, in RC's shape (successes, then at most one error of the kind
//! hardware gives, then flushes); the client's progress and its teardown within
//! bounds; no crash of either side; no byte of the memory mapped after the unmap
//! reached.

use crate::abi_tests::{
    connect_to, make_qp, map_at, open, own_gid, post_recv_one, send_wr, sge, Env,
};
use crate::device::*;
use crate::ffi::*;
use crate::objects::zeroed;
use crate::resources::*;
use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Which side this process plays (unset: the test orchestrating its client).
const ROLE: &str = "NPRDMA_FI_ROLE";
/// The server's registered target memory.
const TARGET: usize = 256 * 1024;
/// WRs the client posts in all.
const TOTAL: u64 = 3000;
/// The client's send-queue window (`make_qp`'s 16).
const DEPTH: u64 = 16;
/// Longest a survivor may go without a completion after the fault.
const WEDGE: Duration = Duration::from_secs(10);
/// The byte the server's new memory holds after an unmap and remap.
const FRESH: u8 = 0x33;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill,
    Stop,
    Unmap,
    /// mremap the target away, then new memory at the old address.
    Move,
}

/// This test binary re-run for test `name` alone, in `role`.
fn rerun(name: &str, role: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        name,
        "--exact",
        "--include-ignored",
        "--test-threads=1",
        "--nocapture",
    ])
    .env(ROLE, role);
    c
}

/// Runs test `name` as the client in mode `mode`, in a child, and checks it passed.
fn orchestrate(name: &str, mode: &str) {
    let out = rerun(name, "client")
        .env("NPRDMA_MODE", mode)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("1 passed"),
        "client failed:\n{so}\n{se}"
    );
    // What the client measured, for the test log.
    for l in so
        .lines()
        .filter_map(|l| l.find("FI-RESULT").map(|k| &l[k..]))
    {
        println!("{mode}: {l}");
    }
}

fn run(name: &str, mode: &str, fault: Fault) {
    match std::env::var(ROLE).as_deref() {
        Ok("server") => server(),
        Ok("client") => client(name, fault),
        _ => orchestrate(name, mode),
    }
}

fn hex(g: &ibv_gid) -> String {
    // SAFETY: every bit pattern of the 16-byte union is a valid byte array.
    unsafe { g.raw.iter().map(|b| format!("{b:02x}")).collect() }
}

fn unhex(s: &str) -> ibv_gid {
    // SAFETY: plain C data.
    let mut g: ibv_gid = unsafe { zeroed() };
    for i in 0..16 {
        // SAFETY: writing the byte view of the union.
        unsafe { g.raw[i] = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap() };
    }
    g
}

/// The server: one QP, target memory, receives reposted as they complete; commands
/// on stdin (`UNMAP`, `CHECK`, `EXIT`), answers on stdout prefixed `FI `.
fn server() {
    let e = open();
    // SAFETY: as in a C program; the mappings outlive their MRs (or are unmapped
    // deliberately, which is what the test is about).
    unsafe {
        let cq = ibv_create_cq(e.ctx, 256, null_mut(), null_mut(), 0);
        let qp = make_qp(&e, cq);
        let target = map_at(0, TARGET, 0);
        let all = (IBV_ACCESS_LOCAL_WRITE
            | IBV_ACCESS_REMOTE_WRITE
            | IBV_ACCESS_REMOTE_READ
            | IBV_ACCESS_REMOTE_ATOMIC) as c_int;
        let tmr = ibv_reg_mr(e.pd, target as *mut c_void, TARGET, all);
        let recv = map_at(0, 16 * 64, 0);
        let rmr = ibv_reg_mr(
            e.pd,
            recv as *mut c_void,
            16 * 64,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        assert!(!cq.is_null() && !tmr.is_null() && !rmr.is_null());
        let repost = |slot: u64| {
            let s = sge((recv + slot as usize * 64) as u64, 64, (*rmr).lkey);
            post_recv_one(&e, qp, slot, s);
        };
        println!(
            "FI READY {} {} {} {}",
            hex(&own_gid(&e)),
            (*qp).qp_num,
            target,
            (*tmr).rkey
        );
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for l in std::io::stdin().lock().lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let peer = rx.recv().unwrap();
        let (g, n) = peer.split_once(' ').unwrap();
        connect_to(qp, unhex(g), n.trim().parse().unwrap());
        (0..16).for_each(repost);
        println!("FI CONNECTED");
        let poll = (*e.ctx).ops.poll_cq.unwrap();
        let mut wc: ibv_wc = zeroed();
        loop {
            while poll(cq, 1, &mut wc) == 1 {
                if wc.status == IBV_WC_SUCCESS {
                    repost(wc.wr_id);
                }
            }
            match rx.try_recv() {
                Ok(c) if c == "UNMAP" => {
                    assert_eq!(libc::munmap(target as *mut c_void, TARGET), 0);
                    map_at(target, TARGET, FRESH);
                    println!("FI REMAPPED");
                }
                Ok(c) if c == "MOVE" => {
                    let to = map_at(0, TARGET, 0);
                    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
                    let p = libc::mremap(
                        target as *mut c_void,
                        TARGET,
                        TARGET,
                        flags,
                        to as *mut c_void,
                    );
                    assert_eq!(p as usize, to, "mremap");
                    map_at(target, TARGET, FRESH);
                    println!("FI REMAPPED");
                }
                Ok(c) if c == "CHECK" => {
                    let s = std::slice::from_raw_parts(target as *const u8, TARGET);
                    println!("FI CHECK {}", s.iter().filter(|&&b| b != FRESH).count());
                }
                Ok(_) | Err(mpsc::TryRecvError::Disconnected) => break,
                Err(mpsc::TryRecvError::Empty) => std::thread::sleep(Duration::from_micros(50)),
            }
        }
        std::process::exit(0);
    }
}

/// The server process and its protocol lines.
struct Server {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Server {
    fn spawn(name: &str) -> Server {
        let mut child = rerun(name, "server")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                // The harness may print its "test … ..." on the same line first.
                if let Some(k) = l.find("FI ") {
                    if tx.send(l[k + 3..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        Server {
            child,
            stdin,
            lines,
        }
    }

    fn expect(&mut self, what: &str) -> String {
        let Ok(l) = self.lines.recv_timeout(Duration::from_secs(20)) else {
            std::thread::sleep(Duration::from_millis(100));
            panic!(
                "server never said {what} (server: {:?})",
                self.child.try_wait()
            );
        };
        assert!(l.starts_with(what), "server said {l:?}, expected {what}");
        l
    }

    fn say(&mut self, l: &str) {
        writeln!(self.stdin, "{l}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn signal(&self, sig: c_int) {
        // SAFETY: signalling our own child, which has not been reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }
}

/// This process's threads, memfd descriptors and memlock-charged pages.
fn resources() -> (usize, usize, u64) {
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0);
    let memfds = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"))
                })
                .count()
        })
        .unwrap_or(0);
    (threads, memfds, crate::backend::pinned_pages())
}

/// A seed from the clock, printed so a failure can be told from its point.
fn seed() -> u64 {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    n ^ (n >> 29) ^ u64::from(std::process::id())
}

/// The client: traffic, the fault at a random point, then the checks.
fn client(name: &str, fault: Fault) {
    let seed = seed();
    let fault_at = 200 + seed % 1300;
    let stop_for = Duration::from_millis(if seed & 1 == 0 { 30 } else { 1500 });
    println!(
        "FI-RESULT seed {seed} fault {fault:?} after {fault_at} completions (stop {stop_for:?})"
    );
    let mut srv = Server::spawn(name);
    let ready = srv.expect("READY");
    let f: Vec<&str> = ready.split(' ').collect();
    let (sgid, sqpn) = (unhex(f[1]), f[2].parse::<u32>().unwrap());
    let (raddr, rkey) = (f[3].parse::<u64>().unwrap(), f[4].parse::<u32>().unwrap());
    let before = resources();
    let e: Env = open();
    // SAFETY: as in a C program; the local mapping outlives its MR.
    unsafe {
        let cq = ibv_create_cq(e.ctx, 64, null_mut(), null_mut(), 0);
        let qp = make_qp(&e, cq);
        let local = map_at(0, 64 * 1024, 0x5a);
        let lmr = ibv_reg_mr(
            e.pd,
            local as *mut c_void,
            64 * 1024,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        assert!(!cq.is_null() && !lmr.is_null());
        srv.say(&format!("{} {}", hex(&own_gid(&e)), (*qp).qp_num));
        connect_to(qp, sgid, sqpn);
        srv.expect("CONNECTED");

        let post_send = (*e.ctx).ops.post_send.unwrap();
        let poll = (*e.ctx).ops.poll_cq.unwrap();
        let mut status: Vec<Option<u32>> = vec![None; TOTAL as usize];
        let (mut posted, mut done) = (0u64, 0u64);
        let mut faulted: Option<Instant> = None;
        let mut stopped = false;
        let mut last = Instant::now();
        let mut wcs: [ibv_wc; 16] = zeroed();
        while done < TOTAL {
            while posted < TOTAL && posted - done < DEPTH {
                let i = posted;
                let slot = (i % 8) as usize * 4096;
                let (opcode, at, length) = match i % 4 {
                    0 => (IBV_WR_RDMA_WRITE, local + slot, 4096),
                    1 => (IBV_WR_RDMA_READ, local + 32 * 1024 + slot, 4096),
                    2 => (IBV_WR_ATOMIC_FETCH_AND_ADD, local + 32 * 1024 + slot, 8),
                    _ => (IBV_WR_SEND, local + slot, 64),
                };
                let mut s = sge(at as u64, length, (*lmr).lkey);
                let mut wr = send_wr(i, opcode, IBV_SEND_SIGNALED, &mut s);
                let remote = raddr + (i % 64) * 4096;
                if opcode == IBV_WR_ATOMIC_FETCH_AND_ADD {
                    wr.wr.atomic.remote_addr = remote;
                    wr.wr.atomic.rkey = rkey;
                    wr.wr.atomic.compare_add = 1;
                } else if opcode != IBV_WR_SEND {
                    wr.wr.rdma.remote_addr = remote;
                    wr.wr.rdma.rkey = rkey;
                }
                let mut bad = null_mut();
                assert_eq!(post_send(qp, &mut wr, &mut bad), 0, "post of WR {i}");
                posted += 1;
            }
            let n = poll(cq, 16, wcs.as_mut_ptr());
            assert!(n >= 0);
            for wc in &wcs[..n as usize] {
                let slot = &mut status[wc.wr_id as usize];
                assert!(slot.is_none(), "WR {} completed twice", wc.wr_id);
                *slot = Some(wc.status);
                done += 1;
                last = Instant::now();
            }
            if faulted.is_none() && done >= fault_at {
                match fault {
                    Fault::Kill => srv.signal(libc::SIGKILL),
                    Fault::Stop => {
                        srv.signal(libc::SIGSTOP);
                        stopped = true;
                    }
                    Fault::Unmap => {
                        srv.say("UNMAP");
                        srv.expect("REMAPPED");
                    }
                    Fault::Move => {
                        srv.say("MOVE");
                        srv.expect("REMAPPED");
                    }
                }
                faulted = Some(Instant::now());
                last = Instant::now();
            }
            if stopped && faulted.is_some_and(|t| t.elapsed() >= stop_for) {
                srv.signal(libc::SIGCONT);
                stopped = false;
            }
            if last.elapsed() >= WEDGE {
                let oldest = status.iter().position(Option::is_none).unwrap_or(0);
                panic!(
                    "no completion for {WEDGE:?}: {done} of {TOTAL} done, {posted} posted, fault at {fault_at} ({}), oldest open WR {oldest} (kind {})",
                    if faulted.is_some() { "injected" } else { "not yet injected" },
                    oldest % 4
                );
            }
        }
        let fault_to_end = faulted.map(|t| t.elapsed()).unwrap_or_default();
        if fault == Fault::Kill {
            // A vanished peer (its liveness token) fails the WRs once the QPs'
            // retries (8 x 67 ms) would have run out, well before the transport (2 s)
            // or engine (5 s) timeout.
            assert!(
                fault_to_end < Duration::from_millis(1500),
                "WRs to a dead peer took {fault_to_end:?} to complete"
            );
        }
        if stopped {
            srv.signal(libc::SIGCONT);
        }

        // RC's shape: successes, at most one error of the fault's kind, flushes.
        let st: Vec<u32> = status
            .iter()
            .map(|s| s.expect("every WR completed"))
            .collect();
        let first_err = st.iter().position(|&s| s != IBV_WC_SUCCESS);
        if let Some(k) = first_err {
            let allowed: &[u32] = match fault {
                Fault::Kill | Fault::Stop => &[IBV_WC_RETRY_EXC_ERR],
                Fault::Unmap | Fault::Move => &[IBV_WC_REM_ACCESS_ERR],
            };
            assert!(
                allowed.contains(&st[k]),
                "WR {k} failed with status {}",
                st[k]
            );
            assert!(
                k as u64 >= fault_at.saturating_sub(DEPTH),
                "WR {k} failed before the fault"
            );
            let bad: Vec<(usize, u32)> = st[k + 1..]
                .iter()
                .enumerate()
                .filter(|&(_, &s)| s != IBV_WC_WR_FLUSH_ERR)
                .map(|(j, &s)| (k + 1 + j, s))
                .take(5)
                .collect();
            assert!(
                bad.is_empty(),
                "after the first error, not flushed: {bad:?}"
            );
        }
        match fault {
            Fault::Kill | Fault::Unmap | Fault::Move => {
                assert!(first_err.is_some(), "the fault was not noticed")
            }
            Fault::Stop => {}
        }

        let t = Instant::now();
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_dereg_mr(lmr), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
        let teardown = t.elapsed();
        println!(
            "FI-RESULT {fault:?}: first error at WR {first_err:?}, fault to last completion {fault_to_end:?}, teardown {teardown:?}"
        );
        assert!(
            teardown < Duration::from_secs(1),
            "teardown took {teardown:?}"
        );
        let after = resources();
        assert_eq!(
            after.2, 0,
            "pinned pages still charged after every MR was deregistered"
        );
        // The device keeps its NIC thread and segments for the process (as a
        // provider library stays loaded); a second open / use / close cycle must not
        // add to them.
        let e = open();
        let cq = ibv_create_cq(e.ctx, 16, null_mut(), null_mut(), 0);
        let qp = make_qp(&e, cq);
        let m = map_at(0, 4096, 0);
        let mr = ibv_reg_mr(
            e.pd,
            m as *mut c_void,
            4096,
            IBV_ACCESS_LOCAL_WRITE as c_int,
        );
        assert!(!mr.is_null());
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(e.pd), 0);
        assert_eq!(ibv_close_device(e.ctx), 0);
        assert_eq!(libc::munmap(m as *mut c_void, 4096), 0);
        let again = resources();
        println!(
            "FI-RESULT {fault:?}: (threads, memfds, pinned pages) before open {before:?}, after close {after:?}, after a second cycle {again:?}"
        );
        assert!(
            again.0 <= after.0 && again.1 <= after.1 && again.2 == 0,
            "a second open/close cycle leaked: {after:?} -> {again:?}"
        );

        if matches!(fault, Fault::Unmap | Fault::Move) {
            srv.say("CHECK");
            let c = srv.expect("CHECK");
            assert_eq!(c, "CHECK 0", "bytes of the new memory were changed");
        }
        if fault != Fault::Kill {
            srv.say("EXIT");
        }
        let t = Instant::now();
        loop {
            if let Some(s) = srv.child.try_wait().unwrap() {
                assert!(fault == Fault::Kill || s.success(), "server ended with {s}");
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "server did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

macro_rules! fault_test {
    ($name:ident, $mode:literal, $fault:expr) => {
        #[test]
        fn $name() {
            run(concat!("fault_tests::", stringify!($name)), $mode, $fault);
        }
    };
}

fault_test!(pinned_server_killed_mid_traffic, "pinned", Fault::Kill);
fault_test!(pinned_server_stopped_mid_traffic, "pinned", Fault::Stop);
fault_test!(
    pinned_server_unmaps_target_mid_traffic,
    "pinned",
    Fault::Unmap
);
fault_test!(np_server_killed_mid_traffic, "nprdma", Fault::Kill);
fault_test!(np_server_stopped_mid_traffic, "nprdma", Fault::Stop);
fault_test!(np_server_unmaps_target_mid_traffic, "nprdma", Fault::Unmap);
fault_test!(
    pinned_server_moves_target_mid_traffic,
    "pinned",
    Fault::Move
);
fault_test!(np_server_moves_target_mid_traffic, "nprdma", Fault::Move);
