//! Two hosts joined by nothing but a veth pair (`scripts/wire-ns.sh`: two network
//! namespaces, each process in its own PID and mount namespaces with a private
//! `/dev/shm` and `/proc`), so every byte between them is RoCEv2 on the wire (issue
//! 35). Both modes:
//!
//! * `tools_across_hosts`: `ibv_rc_pingpong` over the IPv4 and the IPv6 GID, perftest
//!   READ / WRITE / SEND latency and bandwidth and atomics, rping and perftest `-R`
//!   (rdma_cm), and the memory-pressure stress (`tests/c/stress.c`: random READ /
//!   WRITE / FETCH_ADD / CMP_SWAP, every byte checked; in NP-RDMA mode with a
//!   64-page budget on the target) — while tshark captures the veth: Wireshark's
//!   InfiniBand dissector must find no malformed packet and no expert warning or
//!   error, every opcode the transport sends must appear, and scapy's RoCE layer must
//!   recompute every packet's ICRC (`crates/roce/tests/icrc_scapy.py`).
//! * `stress_under_loss`: the stress stays byte-exact with the transport's fault
//!   injector dropping 1 %, then dropping 5 % and duplicating, reordering and
//!   corrupting 1 % each, and the requester's retransmission counter moved.
//! * `link_down_then_up`: a run whose link goes down ends in RETRY_EXC_ERR after its
//!   retries; with the link back up new QPs connect.
//!
//! Needs root (namespaces), Debian's ibverbs-utils, perftest, rdmacm-utils, tshark
//! and python3-scapy; without them the tests skip (and fail under CI=true).

mod common;
use common::*;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One test at a time: each uses both cores.
static SERIAL: Mutex<()> = Mutex::new(());

const LIMIT: Duration = Duration::from_secs(120);

/// Packets of each capture whose ICRC scapy recomputes.
const SCAPY_PACKETS: usize = 20_000;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/wire-ns.sh")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The two hosts of one test (removed on drop).
struct Hosts {
    prefix: &'static str,
    b4: String,
    b6: String,
}

impl Hosts {
    fn up(prefix: &'static str) -> Hosts {
        let o = Command::new("bash")
            .arg(script())
            .args(["up", prefix])
            .output()
            .expect("run wire-ns.sh");
        assert!(
            o.status.success(),
            "wire-ns.sh up: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let s = String::from_utf8_lossy(&o.stdout);
        let v: Vec<&str> = s.split_whitespace().collect();
        assert_eq!(v.len(), 4, "wire-ns.sh up printed {s}");
        Hosts {
            prefix,
            b4: v[1].into(),
            b6: v[3].into(),
        }
    }
    fn a(&self) -> String {
        format!("{}-a", self.prefix)
    }
    fn b(&self) -> String {
        format!("{}-b", self.prefix)
    }
    fn veth_a(&self) -> String {
        format!("{}-va", self.prefix)
    }
    fn link(&self, up: bool) {
        let st = Command::new("bash")
            .arg(script())
            .args(["link", self.prefix, if up { "up" } else { "down" }])
            .status()
            .expect("run wire-ns.sh link");
        assert!(st.success(), "wire-ns.sh link");
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", self.prefix])
            .status();
    }
}

/// `bin args` on `host` with the library preloaded and `env`.
fn on(host: &str, bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    let lib = nprdma_test_support::cdylib::libnprdma_release()
        .unwrap_or_else(|why| panic!("libnprdma.so (release): {why}"));
    let mut v: Vec<String> = vec!["run".into(), host.into(), "env".into()];
    v.push(format!("LD_PRELOAD={}", lib.display()));
    v.extend(env.iter().map(|(k, val)| format!("{k}={val}")));
    v.push(bin.display().to_string());
    v.extend(args.iter().map(|a| a.to_string()));
    let bash = find_bin("bash").expect("bash");
    let s = script();
    let mut all = vec![s.to_str().expect("utf-8 path")];
    all.extend(v.iter().map(String::as_str));
    spawn_plain(&bash, &all)
}

/// Spawn without the library (the preload is set inside the host by `env`).
fn spawn_plain(bin: &Path, args: &[&str]) -> Child {
    Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
}

/// The server (`sbin sargs`) on host b, then once it listens on `port`, the client
/// on host a; both outputs.
#[allow(clippy::too_many_arguments)]
fn pair(
    h: &Hosts,
    sbin: &Path,
    sargs: &[&str],
    cbin: &Path,
    cargs: &[&str],
    port: u16,
    senv: &[(&str, &str)],
    cenv: &[(&str, &str)],
) -> (Output, Output) {
    let deadline = Instant::now() + LIMIT;
    let server = on(&h.b(), sbin, sargs, senv);
    while !listening_in(&h.b(), port) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = finish(on(&h.a(), cbin, cargs, cenv), deadline);
    let s = finish(server, Instant::now() + Duration::from_secs(15));
    (s, c)
}

/// A counter of the client's stats line.
fn counter(o: &Output, key: &str) -> u64 {
    np_stats(&o.stderr)
        .and_then(|m| m.get(key).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn mode_env(mode: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![("NPRDMA_MODE", mode), ("NPRDMA_STATS", "1")]
}

/// The GID index of `ip` on host `host`'s port (from `ibv_devinfo -v`).
fn gid_index(h: &str, ip: &str) -> Option<String> {
    let devinfo = find_bin("ibv_devinfo")?;
    let o = finish(
        on(h, &devinfo, &["-v"], &[("NPRDMA_MODE", "pinned")]),
        Instant::now() + Duration::from_secs(20),
    );
    o.stdout.lines().find_map(|l| {
        let l = l.trim();
        let rest = l.strip_prefix("GID[")?;
        let (idx, gid) = rest.split_once("]:")?;
        let gid = gid.trim();
        let want_v4 = format!("::ffff:{ip}");
        (gid == want_v4
            || gid == ip
            || gid.starts_with(&format!("{ip},"))
            || gid.starts_with(&format!("{want_v4},")))
        .then(|| idx.trim().to_string())
    })
}

/// Run the stress between the hosts: (server, client) outputs.
fn stress(
    h: &Hosts,
    exe: &Path,
    mode: &'static str,
    port: u16,
    ops: &str,
    faults: &str,
) -> (Output, Output) {
    let p = port.to_string();
    let mut env = mode_env(mode);
    env.extend([
        ("STRESS_GID_INDEX", "1"),
        ("STRESS_OPS", ops),
        ("NPRDMA_WIRE_FAULTS", faults),
    ]);
    let mut senv = env.clone();
    if mode == "nprdma" {
        senv.push(("NPRDMA_BUDGET_PAGES", "64"));
    }
    let cargs = ["tcp-client", h.b4.as_str(), p.as_str()];
    pair(h, exe, &["tcp-server", &p], exe, &cargs, port, &senv, &env)
}

fn stress_ok(s: &Output, c: &Output) -> bool {
    s.ok() && c.ok() && c.stdout.contains(", 0 differ; errors 0")
}

#[test]
fn tools_across_hosts() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(b) = require(&[
        "ibv_rc_pingpong",
        "ib_write_lat",
        "ib_read_lat",
        "ib_send_lat",
        "ib_write_bw",
        "ib_read_bw",
        "ib_send_bw",
        "ib_atomic_lat",
        "rping",
        "tshark",
        "ip",
        "editcap",
    ]) else {
        return;
    };
    if !is_root() {
        skip("network namespaces need root");
        return;
    }
    let Some(exe) = compile("stress") else { return };
    let h = Hosts::up("nprwt");
    let mut failures = Vec::new();
    let mut port = 7500u16;
    let v6_index = gid_index(&h.b(), &h.b6);
    let mut seen = BTreeSet::new();
    for mode in ["pinned", "nprdma"] {
        let env = mode_env(mode);
        let (mut cap, pcap) = capture(&b[9], &h, mode);
        // ibv_rc_pingpong over the IPv4 GID and the IPv6 GID.
        // (The TCP exchange goes over IPv4 either way: ibv_rc_pingpong's server listens
        // on the first address family getaddrinfo gives.)
        let mut gids = vec![("1".to_string(), h.b4.clone())];
        match &v6_index {
            Some(i) => gids.push((i.clone(), h.b4.clone())),
            None => failures.push(format!("no IPv6 GID {} on host b", h.b6)),
        }
        for (gi, addr) in &gids {
            port += 1;
            let p = port.to_string();
            let args = ["-g", gi.as_str(), "-n", "200", "-p", p.as_str()];
            let mut cargs = args.to_vec();
            cargs.push(addr);
            let (s, c) = pair(&h, &b[0], &args, &b[0], &cargs, port, &env, &env);
            if !(s.ok() && c.ok() && c.stdout.contains("200 iters")) {
                failures.push(format!(
                    "ibv_rc_pingpong {mode} GID {gi}:\n{}\n{}",
                    c.all(),
                    s.all()
                ));
            } else if counter(&c, "roce_tx_packets") == 0 {
                failures.push(format!(
                    "ibv_rc_pingpong {mode}: no RoCE packet sent:\n{}",
                    c.all()
                ));
            }
        }
        // perftest: latency and bandwidth of each operation, and atomics.
        let runs: [(usize, &[&str]); 8] = [
            (2, &["-n", "300", "-s", "2"]),
            (1, &["-n", "300", "-s", "2"]),
            (3, &["-n", "300", "-s", "5000"]),
            (4, &["-n", "100", "-s", "65536"]),
            (5, &["-n", "100", "-s", "65536"]),
            (6, &["-n", "100", "-s", "65536"]),
            (7, &["-n", "300"]),
            (7, &["-n", "300", "-A", "CMP_AND_SWAP"]),
        ];
        for (tool, extra) in runs {
            port += 1;
            let p = port.to_string();
            let mut args = vec!["-x", "1", "-p", p.as_str()];
            args.extend_from_slice(extra);
            let mut cargs = args.clone();
            cargs.push(h.b4.as_str());
            let (s, c) = pair(&h, &b[tool], &args, &b[tool], &cargs, port, &env, &env);
            let n: f64 = extra[1].parse().expect("iterations");
            if !(s.ok() && c.ok() && result_rows(&c.stdout).iter().any(|r| r[1] >= n)) {
                failures.push(format!(
                    "{} {mode} {extra:?}:\n{}\n{}",
                    b[tool].display(),
                    c.all(),
                    s.all()
                ));
            }
        }
        // rdma_cm: rping (data verified) and perftest -R.
        port += 1;
        let p = port.to_string();
        let (s, c) = pair(
            &h,
            &b[8],
            &["-s", "-a", &h.b4, "-p", &p, "-C", "50", "-V"],
            &b[8],
            &["-c", "-a", &h.b4, "-p", &p, "-C", "50", "-V", "-v"],
            port,
            &env,
            &env,
        );
        let pings = c.stdout.matches("ping data: rdma-ping-").count();
        if !(s.ok() && c.ok() && pings == 50) {
            failures.push(format!(
                "rping {mode}: {pings} pings\n{}\n{}",
                c.all(),
                s.all()
            ));
        }
        // perftest's own re-listen race (tests/rdmacm.rs): up to six runs.
        let result = perftest_cm_tries(&mut port, 200.0, |port| {
            let p = port.to_string();
            let args = ["-R", "-p", p.as_str(), "-n", "200", "-s", "4096"];
            let mut cargs = args.to_vec();
            cargs.push(h.b4.as_str());
            pair(&h, &b[1], &args, &b[1], &cargs, port, &env, &env)
        });
        if let Err(e) = result {
            failures.push(format!("ib_write_lat -R {mode}:\n{e}"));
        }
        // The memory-pressure stress, every byte checked.
        port += 1;
        let (s, c) = stress(&h, &exe, mode, port, "5000", "");
        if !stress_ok(&s, &c) {
            failures.push(format!("stress {mode}:\n{}\n{}", c.all(), s.all()));
        }
        if mode == "nprdma" && counter(&s, "swap_outs") == 0 {
            failures.push(format!(
                "stress nprdma: the target swapped nothing out:\n{}",
                s.all()
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: plain kill(2) of our own child (tshark flushes its file on SIGINT).
        unsafe { libc::kill(cap.id() as i32, libc::SIGINT) };
        let _ = cap.wait();
        seen.extend(check_capture(&b[9], &pcap, mode, &mut failures));
    }
    // RC: SEND first/middle/last/only, WRITE first/middle/last/only, READ request and
    // responses, ACK, atomic ACK, CMP_SWAP, FETCH_ADD, in one mode or the other
    // (NP-RDMA carries SENDs and atomics its own way).
    let want: BTreeSet<u64> = [0, 1, 2, 4, 6, 7, 8, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20].into();
    let missing: Vec<&u64> = want.difference(&seen).collect();
    if !missing.is_empty() {
        failures.push(format!("captures: opcodes {seen:?}, missing {missing:?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Start tshark on host a's veth, writing the RoCE packets of `mode`'s runs.
fn capture(tshark: &Path, h: &Hosts, mode: &str) -> (Child, PathBuf) {
    let dir = out_dir().join("wire-capture");
    let _ = std::fs::create_dir_all(&dir);
    let pcap = dir.join(format!("veth-{mode}.pcap"));
    let _ = std::fs::remove_file(&pcap);
    let pcap_s = pcap.to_str().expect("utf-8 path").to_string();
    let cap = Command::new("ip")
        .args(["netns", "exec", &h.a(), tshark.to_str().expect("utf-8")])
        .args([
            "-i",
            &h.veth_a(),
            "-f",
            "udp port 4791",
            "-w",
            &pcap_s,
            "-q",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start tshark");
    // tshark is capturing once its file exists.
    let t0 = Instant::now();
    while !pcap.exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    (cap, pcap)
}

/// Wireshark dissects the capture cleanly and scapy recomputes every ICRC.
fn check_capture(
    tshark: &Path,
    pcap: &Path,
    mode: &str,
    failures: &mut Vec<String>,
) -> BTreeSet<u64> {
    let p = pcap.to_str().expect("utf-8 path");
    let out = Command::new(tshark)
        .args(["-r", p, "-T", "fields", "-e", "infiniband.bth.opcode"])
        .output()
        .expect("tshark");
    let ops: BTreeSet<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let frames = String::from_utf8_lossy(&out.stdout).lines().count();
    if frames < 1000 {
        failures.push(format!(
            "capture {mode}: {frames} RoCE frames, opcodes {ops:?}"
        ));
    }
    // Every malformed packet or expert warning/error counts — except where the
    // InfiniBand dissector, after the headers, hands the payload of a WRITE or SEND
    // to a protocol it guesses (an EtherType-tagged frame for EoIB, RPC-over-RDMA)
    // and application bytes (perftest's counters, NP-RDMA's messages) then fail as
    // that protocol: those bytes are the applications', not the transport's.
    let bad = Command::new(tshark)
        .args([
            "-r",
            p,
            "-Y",
            "_ws.malformed || _ws.expert.severity >= 0x00600000",
        ])
        .args([
            "-T",
            "fields",
            "-e",
            "frame.number",
            "-e",
            "frame.protocols",
        ])
        .output()
        .expect("tshark");
    let bad_lines: String = String::from_utf8_lossy(&bad.stdout)
        .lines()
        .filter(|l| !l.contains("infiniband:"))
        .map(|l| format!("{l}\n"))
        .collect();
    if !bad_lines.trim().is_empty() {
        failures.push(format!(
            "capture {mode}: malformed or expert warnings/errors:\n{}",
            bad_lines.lines().take(20).collect::<Vec<_>>().join("\n")
        ));
    }
    let python = "/usr/bin/python3";
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../roce/tests/icrc_scapy.py");
    let probe = Command::new(python)
        .args(["-c", "import scapy.contrib.roce"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        skip("no scapy.contrib.roce: install Debian package python3-scapy");
        return ops;
    }
    // scapy takes about a millisecond a packet: the first SCAPY_PACKETS of the capture
    // (every kind of run of the mode appears in them), as raw IP (the script reads
    // IP packets; the capture has Ethernet frames).
    let raw = pcap.with_extension("rawip.pcap");
    let range = format!("1-{SCAPY_PACKETS}");
    let st = Command::new("editcap")
        .args(["-r", "-C", "14", "-T", "rawip", p])
        .arg(&raw)
        .arg(&range)
        .status();
    if !st.is_ok_and(|s| s.success()) {
        failures.push(format!("capture {mode}: editcap failed"));
        return ops;
    }
    let frames = frames.min(SCAPY_PACKETS);
    let o = Command::new(python)
        .arg(&script)
        .arg(&raw)
        .output()
        .expect("run icrc_scapy.py");
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let summary = text.lines().last().unwrap_or("").to_string();
    let num = |k: &str| -> u64 {
        summary
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let n = num("packets");
    if !(o.status.success()
        && n as usize == frames
        && num("v4_matched") + num("v6_matched") == n
        && num("corrupt_caught") == n)
    {
        failures.push(format!(
            "capture {mode}: scapy ICRC check ({frames} frames): {summary}\n{}",
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    ops
}

#[test]
fn stress_under_loss() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !is_root() {
        skip("network namespaces need root");
        return;
    }
    let Some(_) = require(&["ip"]) else { return };
    let Some(exe) = compile("stress") else { return };
    let h = Hosts::up("nprwl");
    let mut failures = Vec::new();
    let mut port = 7600;
    for (mode, faults) in [
        ("pinned", "drop=0.01,seed=3"),
        (
            "pinned",
            "drop=0.05,dup=0.01,reorder=0.01,corrupt=0.01,seed=5",
        ),
        ("nprdma", "drop=0.01,seed=7"),
    ] {
        port += 1;
        let (s, c) = stress(&h, &exe, mode, port, "5000", faults);
        if !stress_ok(&s, &c) || counter(&c, "roce_retransmissions") == 0 {
            failures.push(format!("stress {mode} {faults}:\n{}\n{}", c.all(), s.all()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn link_down_then_up() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // ib_read_lat polls its send CQ for each READ (ib_write_lat spins on memory for
    // the peer's WRITE and would wait as it does on hardware).
    let Some(b) = require(&["ib_read_lat", "ibv_rc_pingpong", "ip"]) else {
        return;
    };
    if !is_root() {
        skip("network namespaces need root");
        return;
    }
    let h = Hosts::up("nprwd");
    let env = mode_env("pinned");
    // A long latency run; the link goes down under it.
    let port = 7701u16;
    let p = port.to_string();
    let args = ["-x", "1", "-p", p.as_str(), "-n", "100000000", "-s", "2"];
    let mut cargs = args.to_vec();
    cargs.push(h.b4.as_str());
    let server = on(&h.b(), &b[0], &args, &env);
    let t0 = Instant::now();
    while !listening_in(&h.b(), port) && t0.elapsed() < LIMIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = on(&h.a(), &b[0], &cargs, &env);
    std::thread::sleep(Duration::from_secs(2));
    h.link(false);
    let down = Instant::now();
    // perftest's default timeout (14: 67 ms) and retry count (7): RETRY_EXC_ERR
    // within about half a second; allow for a loaded machine.
    let c = finish(client, down + Duration::from_secs(20));
    let failed_after = down.elapsed();
    let s = finish(server, Instant::now() + Duration::from_secs(5));
    let _ = s;
    assert!(
        c.code.is_some() && !c.ok() && (c.all().contains("status 12") || c.all().contains("retry")),
        "the client did not fail with RETRY_EXC_ERR after the link went down ({failed_after:?}):\n{}",
        c.all()
    );
    assert!(failed_after < Duration::from_secs(10), "{failed_after:?}");
    h.link(true);
    std::thread::sleep(Duration::from_millis(300));
    let port = 7702u16;
    let p = port.to_string();
    let args = ["-g", "1", "-n", "50", "-p", p.as_str()];
    let mut cargs = args.to_vec();
    cargs.push(h.b4.as_str());
    let (s, c) = pair(&h, &b[1], &args, &b[1], &cargs, port, &env, &env);
    assert!(
        s.ok() && c.ok() && c.stdout.contains("50 iters"),
        "after the link came back:\n{}\n{}",
        c.all(),
        s.all()
    );
}
