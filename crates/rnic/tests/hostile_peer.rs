//! Target-enforced protection across processes (the default), tried as a hostile or
//! stalled peer would:
//! * requests forged straight into the target's request ring, bypassing every check of
//!   the requester (a WRITE outside any MR, a WRITE into a read-only MR, a shared-copy
//!   job naming unregistered memory) are refused by the target and change nothing;
//! * the target's tables (MR, QP, CQ, IOMMU) cannot be written by another process at
//!   all: its segment memfd is sealed against writable mappings and writes, whatever
//!   path the process opens it by (only the mailbox of requests is writable);
//! * an initiator stopped (SIGSTOP) in the middle of a large WRITE, resumed after the
//!   target deregistered the MR and mapped new memory at its address, reaches nothing:
//!   deregistration returns at once and the rest of the WRITE is refused.
//!
//! The test binary re-executes itself as the peer (env `RNIC_HOSTILE_CHILD`).

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::segment::{self, Segment};
use rnic::*;
use rustix::io::Errno;
use rustix::mm;
use rustix::process::{kill_process, Pid, Signal};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const RW: mm::ProtFlags = mm::ProtFlags::READ.union(mm::ProtFlags::WRITE);

const SECRET: usize = 4096;
const LEN: usize = 64 << 20;

/// The peer. `target`: a host with a read-only MR and an unregistered secret buffer.
/// `writer`: an initiator that WRITEs `LEN` bytes of 0x5a when told to.
#[test]
fn hostile_child() {
    let Ok(role) = std::env::var("RNIC_HOSTILE_CHILD") else {
        return;
    };
    let host = Host::new(HostConfig::default()).unwrap();
    let e = end(&host, &QpInitAttr::default());
    if role == "target" {
        let ro = e.pd.reg_mr_owned(vec![0x11; 4096], Access::REMOTE_READ).unwrap();
        let secret = vec![0x22u8; SECRET];
        let info = format!(
            "{} {} {} {} {}",
            host.addr().to_hex(),
            e.qp.qpn(),
            ro.addr(),
            ro.rkey(),
            secret.as_ptr() as usize
        );
        serve(&info, |w| match w {
            ["PEER", a, q] => {
                e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                    .unwrap();
                Some("READY".into())
            }
            ["CHECK"] => Some(format!(
                "STATE {} {}",
                ro.to_vec(0, 4096).iter().all(|&b| b == 0x11),
                secret.iter().all(|&b| b == 0x22)
            )),
            _ => None,
        });
        return;
    }
    let src = buf(&e.pd, LEN, 0x5a);
    let info = format!("{} {}", host.addr().to_hex(), e.qp.qpn());
    serve(&info, |w| match w {
        ["PEER", a, q] => {
            e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                .unwrap();
            Some("READY".into())
        }
        ["GO", raddr, rkey] => {
            let sge = [src.sge(0, LEN as u32)];
            e.qp.post_send(&[
                SendWr::new(1, WrOpcode::Write, &sge).remote(raddr.parse().unwrap(), rkey.parse().unwrap())
            ])
            .unwrap();
            Some(format!("WC {:?}", wait1(&e.cq).status))
        }
        _ => None,
    });
}

const REPLIES: &[&str] = &["INFO", "READY", "STATE", "WC"];

/// A connected pair: this process's end and the child's (address, QPN, info fields).
fn connect(role: &str, host: &Host) -> (Child, End, Vec<String>) {
    let mut c = Child::spawn("hostile_child", "RNIC_HOSTILE_CHILD", role, REPLIES);
    let info = c.line();
    let f: Vec<String> = info.split_whitespace().map(String::from).collect();
    let e = end(host, &QpInitAttr::default());
    e.qp.connect(
        all_access(),
        HostAddr::from_hex(&f[1]).unwrap(),
        f[2].parse().unwrap(),
        7,
    )
    .unwrap();
    assert_eq!(c.cmd(&format!("PEER {} {}", host.addr().to_hex(), e.qp.qpn())), "READY");
    (c, e, f)
}

/// Put one forged request into the next slot of the target QP's ring and wait for its
/// answer (status).
#[allow(clippy::too_many_arguments)]
fn forge(seg: &Segment, tq: u32, me: &Host, qpn: u32, op: u32, len: u32, raddr: u64, rkey: u32, data: &[u8]) -> u32 {
    let (h, area) = seg.slot(tq, 0);
    assert_eq!(h.state.load(Ordering::Acquire), segment::SLOT_FREE);
    h.op.store(op, Ordering::Relaxed);
    h.len.store(len, Ordering::Relaxed);
    h.raddr.store(raddr, Ordering::Relaxed);
    h.rkey.store(rkey, Ordering::Relaxed);
    h.src_qpn.store(qpn, Ordering::Relaxed);
    h.src_nonce.store(me.addr().nonce, Ordering::Relaxed);
    // A shared-copy job names the initiator's PID in `cmp` (for READ/WRITE it is the
    // 8-byte inline payload).
    h.cmp.store(std::process::id() as u64, Ordering::Relaxed);
    h.swp.store(u64::MAX, Ordering::Relaxed);
    h.result.store(0, Ordering::Relaxed);
    // SAFETY: the slot's data area holds ring_max (4096) bytes; data is smaller.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), area, data.len()) };
    h.state.store(segment::SLOT_REQ, Ordering::Release);
    seg.ring_doorbell(tq);
    let t = Instant::now();
    while h.state.load(Ordering::Acquire) != segment::SLOT_DONE {
        assert!(t.elapsed() < Duration::from_secs(10), "no answer to a forged request");
        std::thread::yield_now();
    }
    h.status.load(Ordering::Relaxed)
}

#[test]
fn forged_requests_are_checked_by_the_target() {
    let host = Host::new(HostConfig::default()).unwrap();
    let ours = buf(&end(&host, &QpInitAttr::default()).pd, 64, 0x99);
    type Case = (
        &'static str,
        fn(u64, u32, u64, u64) -> (u32, u64, u32, Vec<u8>),
        WcStatus,
    );
    let cases: [Case; 3] = [
        // 8 bytes at the unregistered secret, with the read-only MR's rkey.
        (
            "WRITE outside any MR",
            |_, rkey, secret, _| (segment::RING_WRITE, secret, rkey, vec![]),
            WcStatus::RemAccessErr,
        ),
        (
            "WRITE into a read-only MR",
            |ro, rkey, _, _| (segment::RING_WRITE, ro, rkey, vec![]),
            WcStatus::RemAccessErr,
        ),
        // A shared-copy job: "copy 8 bytes from my address to the target's secret".
        (
            "shared-copy job",
            |_, _, secret, mine| {
                let unit: Vec<u8> = [mine, secret, 8u64].iter().flat_map(|x| x.to_le_bytes()).collect();
                (segment::RING_HELP_WRITE, 0, 0, unit)
            },
            WcStatus::RemInvReqErr,
        ),
    ];
    for (what, make, want) in cases {
        let (mut c, e, f) = connect("target", &host);
        let taddr = HostAddr::from_hex(&f[1]).unwrap();
        let (ro, rkey, secret): (u64, u32, u64) = (f[3].parse().unwrap(), f[4].parse().unwrap(), f[5].parse().unwrap());
        let seg = Segment::open(taddr.pid, taddr.fd, taddr.nonce).unwrap();
        let tq = seg.find_qp(f[2].parse().unwrap()).unwrap();
        let (op, raddr, key, data) = make(ro, rkey, secret, ours.addr() as u64);
        let len = if op == segment::RING_HELP_WRITE { 1 } else { 8 };
        let st = forge(&seg, tq, &host, e.qp.qpn(), op, len, raddr, key, &data);
        assert_eq!(st, want as u32, "{what}");
        assert_eq!(c.cmd("CHECK"), "STATE true true", "{what}: target memory unchanged");
    }
}

#[test]
fn the_targets_tables_cannot_be_written_by_another_process() {
    let host = Host::new(HostConfig::default()).unwrap();
    let (_c, _e, f) = connect("target", &host);
    let taddr = HostAddr::from_hex(&f[1]).unwrap();
    let path = format!("/proc/{}/fd/{}", taddr.pid, taddr.fd);
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    // SAFETY: asking for a new shared writable mapping of the file (refused).
    let p = unsafe { mm::mmap(std::ptr::null_mut(), 4096, RW, mm::MapFlags::SHARED, &file, 0) };
    assert_eq!(p.err(), Some(Errno::PERM), "a writable mapping of the target's tables");
    let err = file.write_at(&[0u8; 8], 4096).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(Errno::PERM.raw_os_error()),
        "write(2) into the target's tables"
    );
    // Reading stays possible (peers look up QPs and keys' kinds), and so does the
    // mailbox (requests), which the target checks.
    let seg = Segment::open(taddr.pid, taddr.fd, taddr.nonce).unwrap();
    assert!(seg.find_qp(f[2].parse().unwrap()).is_some());
}

#[test]
fn a_stopped_writer_resumed_after_dereg_reaches_nothing() {
    let host = Host::new(HostConfig::default()).unwrap();
    // SAFETY: a fresh private anonymous mapping of LEN bytes.
    let region = unsafe { mm::mmap_anonymous(std::ptr::null_mut(), LEN, RW, mm::MapFlags::PRIVATE) }.unwrap();
    let addr = region as usize;
    let (mut c, e, _) = connect("writer", &host);
    // SAFETY: the mapping lives until the end of the test; the MR is dropped first.
    let mr = unsafe { e.pd.reg_mr(addr, LEN, all_access()).unwrap() };
    let pid = Pid::from_child(&c.child);
    use std::io::Write;
    writeln!(c.inp, "GO {addr} {}", mr.rkey()).unwrap();
    c.inp.flush().unwrap();
    // Stop the writer once its first part landed.
    // SAFETY: addr..addr+LEN is our mapping; the peer writes it, we only read bytes.
    let first = |i: usize| unsafe { std::ptr::read_volatile((addr + i) as *const u8) };
    let t = Instant::now();
    while first(0) != 0x5a {
        assert!(t.elapsed() < Duration::from_secs(20), "the WRITE never started");
        std::hint::spin_loop();
    }
    kill_process(pid, Signal::STOP).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let landed_before = first(LEN - 1) == 0x5a;
    let t = Instant::now();
    drop(mr);
    let dereg = t.elapsed();
    assert!(
        dereg < Duration::from_secs(1),
        "dereg with a stopped peer took {dereg:?}"
    );
    // New memory at the same address.
    // SAFETY: replaces our own mapping (no MR covers it any more).
    let again = unsafe { mm::mmap_anonymous(region, LEN, RW, mm::MapFlags::PRIVATE | mm::MapFlags::FIXED) };
    assert_eq!(again, Ok(region));
    // SAFETY: our fresh mapping.
    unsafe { std::ptr::write_bytes(region as *mut u8, 0xaa, LEN) };
    kill_process(pid, Signal::CONT).unwrap();
    let wc = c.line();
    if !landed_before {
        assert_ne!(wc, "WC Success", "the resumed WRITE must not succeed");
    }
    // SAFETY: our mapping, LEN bytes.
    let now = unsafe { std::slice::from_raw_parts(region as *const u8, LEN) };
    let bad = now.iter().position(|&b| b != 0xaa);
    assert_eq!(bad, None, "the resumed writer reached the new memory ({wc})");
    drop(c);
    // SAFETY: our mapping, unmapped once.
    unsafe { mm::munmap(region, LEN) }.unwrap();
}
