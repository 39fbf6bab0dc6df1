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
    let Some(b) = require(&["ibv_rc_pingpong"]) else {
        return;
    };
    let p = port.to_string();
    let mut sargs = vec!["-g", "0", "-p", p.as_str(), "-n", "200", "-c"];
    sargs.extend_from_slice(extra);
    let mut cargs = sargs.clone();
    cargs.push("localhost");
    let (s, c) = run_pair(&b[0], port, &sargs, &cargs, &[]);
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(o.ok(), "{who} failed ({:?}):\n{}", o.code, o.all());
        assert!(o.stdout.contains("200 iters in"), "{who}:\n{}", o.all());
        assert!(!o.stderr.contains("libnprdma:"), "{who}:\n{}", o.all());
        assert!(
            !o.stdout.contains("Data check failed"),
            "{who}:\n{}",
            o.all()
        );
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
