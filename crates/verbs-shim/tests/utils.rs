//! ibverbs-utils over libnprdma.so: ibv_devices, ibv_devinfo, ibv_rc_pingpong (two
//! processes, with its data check), and clean failures for unsupported setups.

mod common;
use common::*;

#[test]
fn ibv_devices_lists_nprdma0() {
    let Some(b) = require(&["ibv_devices"]) else {
        return;
    };
    let o = run(&b[0], &[], &[]);
    assert!(o.ok(), "{}", o.all());
    assert!(o.stdout.contains("nprdma0"), "{}", o.all());
    assert!(o.stdout.contains("4e5052444d410001"), "{}", o.all());
}

#[test]
fn ibv_devinfo_shows_active_ethernet_port_and_gid() {
    let Some(b) = require(&["ibv_devinfo"]) else {
        return;
    };
    let o = run(&b[0], &["-v"], &[]);
    assert!(o.ok(), "{}", o.all());
    for want in [
        "hca_id:\tnprdma0",
        "PORT_ACTIVE",
        "Ethernet",
        "ATOMIC_HCA",
        "GID[  0]",
        "RoCE v2",
    ] {
        assert!(o.stdout.contains(want), "missing {want:?}:\n{}", o.all());
    }
}

fn pingpong(port: u16, extra: &[&str]) {
    pingpong_env(port, extra, &[]);
}

/// ibv_rc_pingpong with its data check (`-c`), 200 iterations, `env` on both sides.
fn pingpong_env(port: u16, extra: &[&str], env: &[(&str, &str)]) -> Option<(Output, Output)> {
    let b = require(&["ibv_rc_pingpong"])?;
    let p = port.to_string();
    let mut sargs = vec!["-g", "0", "-p", p.as_str(), "-n", "200", "-c"];
    sargs.extend_from_slice(extra);
    let mut cargs = sargs.clone();
    cargs.push("localhost");
    let (s, c) = run_pair(&b[0], port, &sargs, &cargs, env);
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(o.ok(), "{who} failed ({:?}):\n{}", o.code, o.all());
        assert!(o.stdout.contains("200 iters in"), "{who}:\n{}", o.all());
        assert!(!o.stderr.contains("libnprdma:"), "{who}:\n{}", o.all());
        // `-c`: the receiver checks the first byte of every page (set to 0 by the
        // sender over a 0x7b-filled buffer) and prints "invalid data in page N".
        assert!(!o.stderr.contains("invalid data"), "{who}:\n{}", o.all());
    }
    Some((s, c))
}

#[test]
fn np_ibv_rc_pingpong_polling() {
    pingpong_env(18635, &[], NP);
}

#[test]
fn np_ibv_rc_pingpong_events() {
    pingpong_env(18636, &["-e"], NP);
}

#[test]
fn np_ibv_rc_pingpong_inline() {
    // <= max_inline_data (1024): ibv_rc_pingpong sends with IBV_SEND_INLINE, i.e.
    // through the QP's staging buffer; the data check covers the payload.
    pingpong_env(18638, &["-s", "1000"], NP);
}

#[test]
fn np_ibv_rc_pingpong_swapped() {
    // 64 KiB messages (16-page buffer) with a 4-page budget: the data check passes
    // while the buffers are swapped out and back.
    let mut env = NP.to_vec();
    env.push(("NPRDMA_BUDGET_PAGES", "4"));
    if let Some((s, c)) = pingpong_env(18637, &["-s", "65536"], &env) {
        for o in [&s, &c] {
            assert!(stat(o, "swap_outs") > 0, "{}", o.all());
            assert!(stat(o, "swap_ins") > 0, "{}", o.all());
            assert_eq!(stat(o, "nonresident_dma"), 0, "{}", o.all());
        }
    }
}

#[test]
fn ibv_rc_pingpong_polling() {
    pingpong(18631, &[]);
}

#[test]
fn ibv_rc_pingpong_events() {
    // Completion channel + ibv_req_notify_cq + ibv_get_cq_event.
    pingpong(18632, &["-e"]);
}

#[test]
fn ibv_rc_pingpong_larger_messages() {
    pingpong(18633, &["-s", "65536"]);
}

#[test]
fn pingpong_without_gid_fails_cleanly() {
    // No GRH in the address vector: a clear error, no hang.
    let Some(b) = require(&["ibv_rc_pingpong"]) else {
        return;
    };
    let (s, c) = run_pair(
        &b[0],
        18634,
        &["-p", "18634", "-n", "5"],
        &["-p", "18634", "-n", "5", "localhost"],
        &[],
    );
    assert!(
        c.code.is_some() && s.code.is_some(),
        "hung:\n{}\n{}",
        c.all(),
        s.all()
    );
    assert!(!c.ok() || !s.ok(), "unexpected success");
    let both = format!("{}{}", c.stderr, s.stderr);
    assert!(
        both.contains("libnprdma: ibv_modify_qp") && both.contains("GRH"),
        "{}\n{}",
        c.all(),
        s.all()
    );
}

#[test]
fn unknown_mode_fails_cleanly() {
    let Some(b) = require(&["ibv_devinfo"]) else {
        return;
    };
    let o = run(&b[0], &[], &[("NPRDMA_MODE", "bogus")]);
    assert!(!o.ok(), "{}", o.all());
    assert!(
        o.stderr.contains("libnprdma: ibv_open_device") && o.stderr.contains("bogus"),
        "{}",
        o.all()
    );
}
