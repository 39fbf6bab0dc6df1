//! Debian's unmodified perftest binaries, server + client as two processes over
//! libnprdma.so, in pinned mode and in NP-RDMA mode (`np_*` tests; `np_swapped_*` with a
//! pager budget below the buffers, so pages are swapped during the run; `chain_*`: NP-RDMA
//! in user-space mode over the next libibverbs, a second copy of libnprdma.so in pinned
//! mode, `NPRDMA_DEVICE=verbs`): exit 0 on both
//! sides and a result row with the requested message size and iteration count.
//! Distinct TCP ports per test (tests run in parallel).

mod common;
use common::*;

/// Run perftest `tool` (with `extra` args on both sides) on `port` in pinned mode.
fn perftest(tool: &str, port: u16, extra: &[&str], bw: bool) {
    perftest_env(tool, port, extra, bw, &[("NPRDMA_MODE", "pinned")]);
}

/// Run perftest `tool` with `env` on both sides; check both sides; their outputs
/// (server, client), or None when the tool is not installed.
fn perftest_env(
    tool: &str,
    port: u16,
    extra: &[&str],
    bw: bool,
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    let bins = require(&[tool])?;
    let p = port.to_string();
    let mut sargs = vec!["-p", p.as_str()];
    sargs.extend_from_slice(extra);
    let mut cargs = sargs.clone();
    cargs.push("localhost");
    let (s, c) = run_pair(&bins[0], port, &sargs, &cargs, env);
    // Either side's failure can be the other's cause: show both.
    assert!(
        c.ok() && s.ok(),
        "{tool}: client exit {:?}, server exit {:?}\n== client\n{}\n== server\n{}",
        c.code,
        s.code,
        c.all(),
        s.all()
    );
    assert!(
        !c.stderr.contains("libnprdma:"),
        "shim complained:\n{}",
        c.all()
    );
    let iters: f64 = extra
        .windows(2)
        .find(|w| w[0] == "-n")
        .map(|w| w[1].parse().unwrap())
        .unwrap();
    let size: f64 = extra
        .windows(2)
        .find(|w| w[0] == "-s")
        .map(|w| w[1].parse().unwrap())
        .unwrap();
    let rows = result_rows(&c.stdout);
    let row = rows
        .iter()
        .find(|r| r[0] == size && r[1] == iters)
        .unwrap_or_else(|| panic!("{tool}: no result row for {size} B x {iters}:\n{}", c.all()));
    if bw {
        // #bytes #iterations BW_peak BW_average MsgRate
        assert!(
            row.len() >= 5 && row[3] > 0.0,
            "{tool}: no bandwidth in {row:?}"
        );
    } else {
        // #bytes #iterations t_min t_max t_typical t_avg ...
        assert!(
            row.len() >= 6 && row[2] > 0.0 && row[2] <= row[3],
            "{tool}: bad latencies {row:?}"
        );
    }
    Some((s, c))
}

#[test]
fn ib_write_lat() {
    perftest("ib_write_lat", 18611, &["-n", "200", "-s", "2"], false);
}

#[test]
fn ib_read_lat() {
    perftest("ib_read_lat", 18612, &["-n", "200", "-s", "2"], false);
}

#[test]
fn ib_send_lat() {
    perftest("ib_send_lat", 18613, &["-n", "200", "-s", "2"], false);
}

#[test]
fn ib_atomic_lat() {
    perftest("ib_atomic_lat", 18614, &["-n", "200", "-s", "8"], false);
}

#[test]
fn ib_write_bw() {
    perftest("ib_write_bw", 18615, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn ib_read_bw() {
    perftest("ib_read_bw", 18616, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn ib_send_bw() {
    perftest("ib_send_bw", 18617, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn ib_atomic_bw() {
    perftest("ib_atomic_bw", 18618, &["-n", "200", "-s", "8"], true);
}

#[test]
fn ib_write_lat_larger_message() {
    // Above the NIC ring size and spanning pages.
    perftest("ib_write_lat", 18619, &["-n", "100", "-s", "8192"], false);
}

#[test]
fn ib_read_bw_large_message() {
    // 1 MiB: the large-transfer path (shared with the target NIC thread).
    perftest("ib_read_bw", 18620, &["-n", "20", "-s", "1048576"], true);
}

#[test]
fn ib_atomic_lat_cmp_and_swap() {
    perftest(
        "ib_atomic_lat",
        18622,
        &["-A", "CMP_AND_SWAP", "-n", "200", "-s", "8"],
        false,
    );
}

#[test]
fn ib_write_bw_bidirectional() {
    perftest(
        "ib_write_bw",
        18623,
        &["-b", "-n", "200", "-s", "4096"],
        true,
    );
}

/// A ping-pong of SENDs, each side blocked on its completion channel between
/// messages (perftest's event loop re-arms only the CQ that fired and polls once, so it
/// hangs if a reply's receive completion is signalled before the send completion of
/// the message it answers — a real responder's ACK leaves before the reply). Hung in
/// about half the runs of 3000 iterations before the fix.
#[test]
fn ib_send_lat_with_completion_events() {
    perftest(
        "ib_send_lat",
        18700,
        &["-e", "-n", "3000", "-s", "2"],
        false,
    );
}

/// `--use-srq`: every QP's receives come from one shared receive queue.
#[test]
fn ib_send_with_a_shared_receive_queue() {
    perftest(
        "ib_send_bw",
        18702,
        &["--use-srq", "-n", "500", "-s", "4096"],
        true,
    );
    perftest(
        "ib_send_lat",
        18703,
        &["--use-srq", "-n", "500", "-s", "2"],
        false,
    );
}

/// `-c UD`: unreliable datagram QPs, address handles from the peer's GID, messages
/// up to the MTU; the bandwidth run's bursts fill the receiver's ring (the sender
/// waits, nothing is lost).
#[test]
fn ib_send_over_ud_qps() {
    perftest(
        "ib_send_lat",
        18780,
        &["-c", "UD", "-n", "500", "-s", "2"],
        false,
    );
    perftest(
        "ib_send_bw",
        18781,
        &["-c", "UD", "-n", "1000", "-s", "4096"],
        true,
    );
}

#[test]
fn ib_send_bw_with_completion_events() {
    // -e: completion channel, ibv_req_notify_cq, ibv_get_cq_event, ibv_ack_cq_events.
    perftest(
        "ib_send_bw",
        18624,
        &["-e", "-n", "200", "-s", "4096"],
        true,
    );
}

#[test]
fn ib_send_lat_inline_and_sizes() {
    perftest(
        "ib_send_lat",
        18625,
        &["-I", "128", "-n", "200", "-s", "100"],
        false,
    );
    perftest("ib_send_lat", 18626, &["-n", "100", "-s", "65536"], false);
}

// ---- NP-RDMA mode ----

/// `tool` in NP-RDMA mode; both sides ran the NP-RDMA backend and the NIC never touched
/// a non-resident page.
fn np(tool: &str, port: u16, extra: &[&str], bw: bool) -> Option<(Output, Output)> {
    let (s, c) = perftest_env(tool, port, extra, bw, NP)?;
    for o in [&s, &c] {
        assert_eq!(
            np_stats(&o.stderr).and_then(|m| m.get("mode").cloned()),
            Some("nprdma".to_string()),
            "{}",
            o.all()
        );
        assert_eq!(stat(o, "nonresident_dma"), 0, "{}", o.all());
    }
    Some((s, c))
}

#[test]
fn np_ib_write_lat() {
    if let Some((_, c)) = np("ib_write_lat", 18641, &["-n", "200", "-s", "2"], false) {
        // The client's WRITEs went through the NP-RDMA engine (checked one-sided or
        // two-sided), not around it.
        assert!(
            stat(&c, "optimistic_ok") + stat(&c, "two_sided") >= 200,
            "{}",
            c.all()
        );
    }
}

#[test]
fn np_ib_read_lat() {
    np("ib_read_lat", 18642, &["-n", "200", "-s", "2"], false);
}

#[test]
fn np_ib_send_lat() {
    // Small SENDs go inline on the control channel (two-sided).
    np("ib_send_lat", 18643, &["-n", "200", "-s", "2"], false);
}

/// The SEND ping-pong with completion events in NP-RDMA mode: the engine's user CQs
/// signal only completions that arrive after arming (perftest re-arms before it
/// polls the completion that fired; a second event for it sent each side to the
/// wrong CQ), and the polling thread does not step aside for an application that
/// waits on an armed CQ.
#[test]
fn np_ib_send_lat_with_completion_events() {
    np(
        "ib_send_lat",
        18701,
        &["-e", "-n", "1000", "-s", "2"],
        false,
    );
}

#[test]
fn np_ib_send_with_a_shared_receive_queue() {
    np(
        "ib_send_bw",
        18704,
        &["--use-srq", "-n", "500", "-s", "4096"],
        true,
    );
    np(
        "ib_send_lat",
        18705,
        &["--use-srq", "-n", "500", "-s", "2"],
        false,
    );
}

#[test]
fn np_ib_atomic_lat() {
    // Atomics are always two-sided (the target CPU executes them).
    if let Some((s, c)) = np("ib_atomic_lat", 18644, &["-n", "200", "-s", "8"], false) {
        assert!(stat(&c, "two_sided") >= 200, "{}", c.all());
        assert!(stat(&s, "served") >= 200, "{}", s.all());
    }
}

#[test]
fn np_ib_write_bw() {
    np("ib_write_bw", 18645, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn np_ib_read_bw() {
    np("ib_read_bw", 18646, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn np_ib_send_bw() {
    // 64 KiB SENDs: rendezvous (the receiver READs from the pinned sender buffer).
    np("ib_send_bw", 18647, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn np_ib_atomic_bw() {
    np("ib_atomic_bw", 18648, &["-n", "200", "-s", "8"], true);
}

/// NP-RDMA mode with a 4-page (16 KiB) resident budget per process, far below the
/// registered buffers (64 KiB messages): pages are swapped out and back during the run.
fn np_swapped(tool: &str, port: u16, extra: &[&str], bw: bool) {
    let mut env = NP.to_vec();
    env.push(("NPRDMA_BUDGET_PAGES", "4"));
    let Some((s, c)) = perftest_env(tool, port, extra, bw, &env) else {
        return;
    };
    for (who, o) in [("server", &s), ("client", &c)] {
        assert_eq!(stat(o, "budget_pages"), 4, "{who}: {}", o.all());
        assert_eq!(stat(o, "nonresident_dma"), 0, "{who}: {}", o.all());
        assert!(
            stat(o, "swap_outs") > 0,
            "{who}: nothing swapped out\n{}",
            o.all()
        );
        assert!(
            stat(o, "swap_ins") > 0,
            "{who}: nothing swapped in\n{}",
            o.all()
        );
    }
}

// ---- The chain: NP-RDMA user-space mode -> libibverbs C ABI -> software NIC ----

/// `tool` with libnprdma.so in NP-RDMA mode over the next libibverbs (a second copy
/// of libnprdma.so in pinned mode as the device), `env` added; both sides ran the
/// chain (user-space mode: nothing optimistic, no failed registration). Outputs
/// (server, client), or None when the tool is not installed.
fn chain_run(
    tool: &str,
    port: u16,
    extra: &[&str],
    bw: bool,
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    let env = chain_env(env);
    let (s, c) = perftest_env(tool, port, extra, bw, &env_refs(&env))?;
    for o in [&s, &c] {
        assert_chain_stats(o);
    }
    Some((s, c))
}

/// [`chain_run`] of a READ/WRITE/atomic tool: every operation of the client went
/// two-sided and was served by the server (over MRs registered at the device on the
/// fly, or found in the registration cache), or went one-sided on a lease the server
/// lent it (READs and WRITEs of a range it reached two-sided shortly before).
fn chain(tool: &str, port: u16, extra: &[&str], bw: bool, env: &[(&str, &str)]) {
    let Some((s, c)) = chain_run(tool, port, extra, bw, env) else {
        return;
    };
    let iters: u64 = extra
        .windows(2)
        .find(|w| w[0] == "-n")
        .map(|w| w[1].parse().unwrap())
        .unwrap();
    let leased = stat(&c, "leased_ops");
    assert!(stat(&c, "two_sided") + leased >= iters, "{}", c.all());
    assert!(stat(&s, "served") + leased >= iters, "{}", s.all());
    if leased > 0 {
        assert!(stat(&s, "leases_granted") > 0, "{}", s.all());
    }
}

#[test]
fn chain_ib_write_bw() {
    chain(
        "ib_write_bw",
        18673,
        &["-n", "200", "-s", "65536"],
        true,
        &[],
    );
}

#[test]
fn chain_ib_read_lat() {
    chain("ib_read_lat", 18674, &["-n", "200", "-s", "2"], false, &[]);
}

#[test]
fn chain_swapped_ib_read_bw() {
    // A 4-page resident budget: pages swapped out and back under the two-sided path.
    chain(
        "ib_read_bw",
        18675,
        &["-n", "200", "-s", "65536"],
        true,
        &[("NPRDMA_BUDGET_PAGES", "4")],
    );
}

#[test]
fn chain_ib_write_lat() {
    // ib_write_lat: each side WRITEs into the other (both initiate and serve).
    chain("ib_write_lat", 18676, &["-n", "200", "-s", "2"], false, &[]);
}

#[test]
fn chain_ib_atomic_lat() {
    chain(
        "ib_atomic_lat",
        18677,
        &["-n", "200", "-s", "8"],
        false,
        &[],
    );
}

/// perftest's READs of one buffer: after the first, the server lends its
/// registration and the rest go one-sided; without leases (`NPRDMA_LEASE_MS=0`)
/// every one is two-sided.
#[test]
fn chain_ib_read_bw_on_a_lease() {
    let args = ["-n", "200", "-s", "65536"];
    if let Some((_, c)) = chain_run("ib_read_bw", 18681, &args, true, &[]) {
        assert!(stat(&c, "leased_ops") >= 100, "{}", c.all());
    }
    let off = [("NPRDMA_LEASE_MS", "0")];
    if let Some((s, c)) = chain_run("ib_read_bw", 18682, &args, true, &off) {
        assert_eq!(stat(&c, "leased_ops"), 0, "{}", c.all());
        assert_eq!(stat(&s, "leases_granted"), 0, "{}", s.all());
        assert!(stat(&c, "two_sided") >= 200, "{}", c.all());
    }
}

#[test]
fn chain_ib_read_bw_large_message() {
    // 1 MiB READs: registrations of 1 MiB at the device (cached up to half of
    // RLIMIT_MEMLOCK).
    chain(
        "ib_read_bw",
        18678,
        &["-n", "20", "-s", "1048576"],
        true,
        &[],
    );
}

#[test]
fn chain_ib_send_lat_and_bw() {
    // SENDs: small ones inline on the control channel (the data QP), large ones by
    // rendezvous.
    chain_run("ib_send_lat", 18679, &["-n", "200", "-s", "2"], false, &[]);
    chain_run(
        "ib_send_bw",
        18680,
        &["-n", "200", "-s", "65536"],
        true,
        &[],
    );
}

#[test]
fn np_swapped_ib_write_bw() {
    np_swapped("ib_write_bw", 18649, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn np_swapped_ib_read_bw() {
    np_swapped("ib_read_bw", 18650, &["-n", "200", "-s", "65536"], true);
}

#[test]
fn np_swapped_ib_read_lat() {
    np_swapped("ib_read_lat", 18651, &["-n", "200", "-s", "65536"], false);
}

#[test]
fn np_swapped_ib_write_lat() {
    np_swapped("ib_write_lat", 18652, &["-n", "200", "-s", "65536"], false);
}

#[test]
fn np_ib_send_lat_inline_and_rendezvous() {
    // -I 128: inline SENDs staged in the QP's registered buffer; 64 KiB: rendezvous.
    np(
        "ib_send_lat",
        18654,
        &["-I", "128", "-n", "200", "-s", "100"],
        false,
    );
    np("ib_send_lat", 18655, &["-n", "100", "-s", "65536"], false);
}

#[test]
fn np_ib_write_lat_larger_message() {
    // Two pages per WRITE: two version words around it.
    np("ib_write_lat", 18656, &["-n", "100", "-s", "8192"], false);
}

#[test]
fn np_ib_atomic_lat_cmp_and_swap() {
    np(
        "ib_atomic_lat",
        18657,
        &["-A", "CMP_AND_SWAP", "-n", "200", "-s", "8"],
        false,
    );
}

#[test]
fn np_ib_write_bw_bidirectional() {
    np(
        "ib_write_bw",
        18658,
        &["-b", "-n", "200", "-s", "4096"],
        true,
    );
}

#[test]
fn np_ib_send_bw_with_completion_events() {
    // -e: the layer's CQ eventfd behind ibv_comp_channel / ibv_get_cq_event.
    np(
        "ib_send_bw",
        18659,
        &["-e", "-n", "200", "-s", "4096"],
        true,
    );
}

#[test]
fn np_ib_write_bw_inline() {
    // 128 inline WRITEs in flight through the QP's staging slots.
    np(
        "ib_write_bw",
        18660,
        &["-I", "64", "-n", "500", "-s", "64"],
        true,
    );
}
