//! UCX over libnprdma.so: `ucx_info -d` (Debian's UCX 1.13, package ucx-utils)
//! lists the `ib` memory domain `nprdma0` and its verbs transports on `nprdma0:1`
//! in both modes — uct_ib finds the device node it stats, opens the device, queries
//! it and its port, allocates a PD and opens the interfaces (their QPs and CQs);
//! and `ucx_perftest tag_lat` runs over rc_verbs in pinned mode and over ud_verbs
//! in NP-RDMA mode.

mod common;
use common::*;

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

/// `ucx_perftest -t tag_lat` between two processes on `port` with `env`: both exit 0
/// and the client prints its final figures. The pair's outputs.
fn tag_lat(port: u16, env: &[(&str, &str)]) -> Option<(Output, Output)> {
    let b = require(&["ucx_perftest"])?;
    let p = port.to_string();
    let (s, c) = run_pair(
        &b[0],
        port,
        &["-p", &p],
        &["-p", &p, "127.0.0.1", "-t", "tag_lat", "-n", "1000"],
        env,
    );
    assert!(
        s.ok() && c.ok(),
        "server:\n{}\nclient:\n{}",
        s.all(),
        c.all()
    );
    assert!(c.stdout.contains("Final:"), "{}", c.all());
    Some((s, c))
}

/// `ucx_perftest -t tag_lat` over `UCX_TLS=ud_v,self` in NP-RDMA mode: ud_verbs'
/// 4096 receives and its sends pin their pages only while posted.
#[test]
fn ucx_perftest_tag_lat_ud_verbs_nprdma() {
    let env = [
        ("NPRDMA_MODE", "nprdma"),
        ("NPRDMA_STATS", "1"),
        ("UCX_TLS", "ud_v,self"),
    ];
    let Some((s, c)) = tag_lat(18736, &env) else {
        return;
    };
    for o in [&s, &c] {
        assert_eq!(stat(o, "nonresident_dma"), 0, "{}", o.all());
    }
}

/// `ucx_perftest -t tag_lat` between two processes over `UCX_TLS=rc_v,self` (rc_verbs,
/// with ud_verbs as UCX's auxiliary transport for the wireup: rc_verbs alone cannot
/// wire up, on any device), pinned mode: the tag-matching round trips complete.
#[test]
fn ucx_perftest_tag_lat_rc_verbs_pinned() {
    tag_lat(
        18734,
        &[("NPRDMA_MODE", "pinned"), ("UCX_TLS", "rc_v,self")],
    );
}
