//! Debian's unmodified perftest binaries, server + client as two processes over
//! libnprdma.so (pinned mode): exit 0 on both sides and a result row with the requested
//! message size and iteration count. Distinct TCP ports per test (tests run in parallel).

mod common;
use common::*;

/// Run perftest `tool` (with `extra` args on both sides) on `port`; check both sides.
fn perftest(tool: &str, port: u16, extra: &[&str], bw: bool) {
    let Some(bins) = require(&[tool]) else { return };
    let p = port.to_string();
    let mut sargs = vec!["-p", p.as_str()];
    sargs.extend_from_slice(extra);
    let mut cargs = sargs.clone();
    cargs.push("localhost");
    let (s, c) = run_pair(&bins[0], port, &sargs, &cargs, &[("NPRDMA_MODE", "pinned")]);
    assert!(c.ok(), "{tool} client failed ({:?}):\n{}", c.code, c.all());
    assert!(s.ok(), "{tool} server failed ({:?}):\n{}", s.code, s.all());
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
fn rdma_cm_fails_cleanly() {
    let Some(bins) = require(&["ib_write_lat"]) else {
        return;
    };
    let out = run(
        &bins[0],
        &["-R", "-p", "18621", "-n", "10", "localhost"],
        &[("NPRDMA_MODE", "pinned")],
    );
    assert!(
        out.code.is_some(),
        "ib_write_lat -R hung (killed):\n{}",
        out.all()
    );
    assert!(!out.ok(), "rdma_cm unexpectedly worked:\n{}", out.all());
    assert!(
        out.stderr.contains("libnprdma: rdma_") && out.stderr.contains("rdma_cm is not supported"),
        "no clear rdma_cm error:\n{}",
        out.all()
    );
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
