//! UCX over libnprdma.so: `ucx_info -d` (Debian's UCX 1.13, package ucx-utils)
//! lists the `ib` memory domain `nprdma0` and its verbs transports on `nprdma0:1`
//! in both modes — uct_ib finds the device node it stats, opens the device, queries
//! it and its port, allocates a PD and opens the interfaces (their QPs and CQs);
//! and `ucx_perftest`'s UCP and UCT tests (tag matching eager and rendezvous,
//! stream, put, get, active messages) run over rc_verbs and over ud_verbs in both
//! modes, with UCX's registration cache and memory hooks on, and once with
//! `UCX_IB_REG_METHODS=direct`.

mod common;
use common::*;

/// The tests of this file run one at a time: each keeps both cores busy (UCX
/// polls), and a survivor's time to notice a dead peer is measured.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// The transports `ucx_info -d` lists in memory domain `md`, each with its block of
/// lines (device, capabilities, or "< failed to open interface >").
fn transports<'a>(out: &'a str, md: &str) -> Vec<(&'a str, &'a str)> {
    let start = format!("# Memory domain: {md}\n");
    let Some(at) = out.find(&start) else {
        return Vec::new();
    };
    let rest = &out[at + start.len()..];
    let end = ["# Memory domain:", "# Connection manager:"]
        .iter()
        .filter_map(|m| rest.find(m))
        .min()
        .unwrap_or(rest.len());
    rest[..end]
        .split("#      Transport: ")
        .skip(1)
        .filter_map(|t| t.split_once('\n'))
        .collect()
}

/// `ucx_info -d` under `env`; asserts the memory domain and each transport of
/// `want` opened on `nprdma0:1`.
fn ucx_info_lists(env: &[(&str, &str)], want: &[&str]) {
    let Some(b) = require(&["ucx_info"]) else {
        return;
    };
    let o = run(&b[0], &["-d"], env);
    assert!(o.ok(), "{}", o.all());
    assert!(
        o.stdout
            .contains("# Memory domain: nprdma0\n#     Component: ib\n"),
        "no ib memory domain nprdma0:\n{}",
        o.all()
    );
    let tls = transports(&o.stdout, "nprdma0");
    for tl in want {
        let Some((_, block)) = tls.iter().find(|(name, _)| name == tl) else {
            panic!("transport {tl} not listed:\n{}", o.all());
        };
        assert!(block.contains("Device: nprdma0:1\n"), "{tl}: {block}");
        assert!(
            !block.contains("failed to open interface") && block.contains("capabilities:"),
            "{tl} did not open:\n{block}\n{}",
            o.stderr
        );
    }
}

#[test]
fn ucx_info_lists_ib_md_with_rc_and_ud_verbs_pinned() {
    ucx_info_lists(&[("NPRDMA_MODE", "pinned")], &["rc_verbs", "ud_verbs"]);
}

#[test]
fn ucx_info_lists_ib_md_with_rc_and_ud_verbs_nprdma() {
    ucx_info_lists(&[("NPRDMA_MODE", "nprdma")], &["rc_verbs", "ud_verbs"]);
}

/// UCT-level tests of `ucx_perftest` (they name a transport and device with `-x`
/// and `-d`); the others are UCP's, whose transports `UCX_TLS` chooses.
const UCT_TESTS: &[&str] = &["put_lat", "put_bw", "get", "am_lat", "am_bw"];

/// `ucx_perftest -t test` between two processes on `port`, over transport `tl`
/// (`rc_verbs` or `ud_verbs`; UCP tests add `self`, and rc_verbs wires up through
/// ud_verbs, UCX's auxiliary transport: rc_verbs alone cannot wire up on any device),
/// with `args` and `env`: both exit 0 and the client prints its final figures. The
/// pair's outputs.
fn perftest(
    port: u16,
    tl: &str,
    test: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    let b = require(&["ucx_perftest"])?;
    let p = port.to_string();
    let dev = "nprdma0:1";
    let uct = UCT_TESTS.contains(&test);
    let mut server = vec!["-p", &p];
    if uct {
        server.extend(["-x", tl, "-d", dev]);
    }
    let mut client = server.clone();
    client.extend(["127.0.0.1", "-t", test]);
    client.extend(args);
    let tls = if tl == "rc_verbs" {
        "rc_v,self"
    } else {
        "ud_v,self"
    };
    let mut env = env.to_vec();
    if !uct {
        env.push(("UCX_TLS", tls));
    }
    let (s, c) = run_pair(&b[0], port, &server, &client, &env);
    assert!(
        s.ok() && c.ok(),
        "{test} over {tl}: server:\n{}\nclient:\n{}",
        s.all(),
        c.all()
    );
    assert!(c.stdout.contains("Final:"), "{test} over {tl}: {}", c.all());
    Some((s, c))
}

/// One ucx_perftest run: the test, its client arguments, extra environment.
type Run = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);

/// Each `(test, args, env)` of `runs` over `tl` in `mode`, on ports from `port0`, with
/// UCX's registration cache and memory hooks on (its defaults); in NP-RDMA mode no
/// DMA of either side met a non-resident page.
fn suite(port0: u16, mode: &str, tl: &str, runs: &[Run]) {
    let _one = one_at_a_time();
    for (k, (test, args, extra)) in runs.iter().enumerate() {
        let mut env = vec![("NPRDMA_MODE", mode), ("NPRDMA_STATS", "1")];
        env.extend_from_slice(extra);
        let Some((s, c)) = perftest(port0 + k as u16, tl, test, args, &env) else {
            return;
        };
        if mode == "nprdma" {
            for o in [&s, &c] {
                assert_eq!(stat(o, "nonresident_dma"), 0, "{test}: {}", o.all());
            }
        }
    }
}

/// Every kind of ucx_perftest run over rc_verbs: UCP tag matching (eager and, at
/// 1 MiB, rendezvous by RDMA READ, also with `UCX_IB_REG_METHODS=direct`: UCX's
/// registration cache off), stream, UCP put/get, and UCT put, get (zero-copy, 64 KiB),
/// active messages.
const RC_RUNS: &[Run] = &[
    ("tag_lat", &["-n", "1000"], &[]),
    ("tag_bw", &["-n", "100", "-s", "1048576"], &[]),
    (
        "tag_bw",
        &["-n", "100", "-s", "1048576"],
        &[("UCX_IB_REG_METHODS", "direct")],
    ),
    ("stream_bw", &["-n", "300", "-s", "65536"], &[]),
    ("ucp_put_bw", &["-n", "300", "-s", "65536"], &[]),
    ("ucp_get", &["-n", "300", "-s", "65536"], &[]),
    ("put_lat", &["-n", "1000"], &[]),
    ("put_bw", &["-n", "300", "-s", "65536", "-D", "zcopy"], &[]),
    ("get", &["-n", "300", "-s", "65536", "-D", "zcopy"], &[]),
    ("am_lat", &["-n", "1000"], &[]),
    ("am_bw", &["-n", "300", "-s", "4096", "-D", "bcopy"], &[]),
];

/// ucx_perftest over ud_verbs: UCP tag matching (eager, and rendezvous at 1 MiB),
/// stream, UCT active messages.
const UD_RUNS: &[Run] = &[
    ("tag_lat", &["-n", "1000"], &[]),
    ("tag_bw", &["-n", "50", "-s", "1048576"], &[]),
    ("stream_bw", &["-n", "300", "-s", "65536"], &[]),
    ("am_lat", &["-n", "1000"], &[]),
];

#[test]
fn ucx_perftest_rc_verbs_pinned() {
    suite(18740, "pinned", "rc_verbs", RC_RUNS);
}

/// rc_verbs in NP-RDMA mode: UCX flushes with an RDMA WRITE of no bytes to address
/// 0, rkey 0, which the target must not check (it failed REM_ACCESS_ERR before).
#[test]
fn ucx_perftest_rc_verbs_nprdma() {
    suite(18760, "nprdma", "rc_verbs", RC_RUNS);
}

#[test]
fn ucx_perftest_ud_verbs_pinned() {
    suite(18780, "pinned", "ud_verbs", UD_RUNS);
}

/// ud_verbs in NP-RDMA mode: its 4096 receives and its sends pin their pages only
/// while posted.
#[test]
fn ucx_perftest_ud_verbs_nprdma() {
    suite(18800, "nprdma", "ud_verbs", UD_RUNS);
}

/// A peer killed mid-run (`SIGKILL` of the server two seconds into a long tag_lat
/// over rc_verbs): the survivor's UCX gets an error completion (the transport
/// retry count exceeded) and ucx_perftest exits with it, within seconds, no hang
/// (pinned mode; NP-RDMA below).
fn peer_killed(port: u16, mode: &str) {
    let Some(b) = require(&["ucx_perftest"]) else {
        return;
    };
    let _one = one_at_a_time();
    // A kill that lands after the server's NIC acknowledged the client's last message
    // but before the server replied leaves the client nothing outstanding: only UCX's
    // keepalive (20 s by default) then finds the dead peer, as on hardware. A 1 s
    // keepalive keeps the check within its limit whichever moment the kill hits.
    let env = [
        ("NPRDMA_MODE", mode),
        ("UCX_TLS", "rc_v,self"),
        ("UCX_KEEPALIVE_INTERVAL", "1s"),
    ];
    let p = port.to_string();
    let mut server = spawn_listening(&b[0], port, &["-p", &p], &env);
    let client = spawn(
        &b[0],
        &["-p", &p, "127.0.0.1", "-t", "tag_lat", "-n", "1000000000"],
        &env,
    );
    std::thread::sleep(std::time::Duration::from_secs(2));
    server.kill().expect("kill the server");
    let _ = server.wait();
    let killed = std::time::Instant::now();
    let c = finish(client, killed + std::time::Duration::from_secs(30));
    let took = killed.elapsed();
    // (ucx_perftest aborts on the error: killed by SIGABRT, no exit code.)
    assert!(
        took < std::time::Duration::from_secs(20),
        "the survivor took {took:?}:\n{}",
        c.all()
    );
    assert!(!c.ok(), "the survivor did not notice:\n{}", c.all());
    // The retry count ran out on a message in flight, or the keepalive's check did.
    let all = c.all();
    assert!(
        all.contains("transport retry counter exceeded")
            || all.contains("imeout")
            || all.contains("Endpoint"),
        "{all}"
    );
}

#[test]
fn ucx_peer_killed_pinned() {
    peer_killed(18820, "pinned");
}

// Not in NP-RDMA mode yet: there the survivor passed four runs out of five, and in
// one (CI, 2026-12-02) it sat in UCX's progress for the whole 30 s with nothing of its
// own outstanding — what makes pinned mode's survivor notice within 2 s (UCX's flush
// or keepalive reaching the dead peer) does not reach it through NP-RDMA every time.
// Issue 34's closing note has what was found.
