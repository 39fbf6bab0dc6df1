//! ibverbs-utils over libnprdma.so: ibv_devices, ibv_devinfo, ibv_rc_pingpong,
//! ibv_uc_pingpong, ibv_ud_pingpong, ibv_srq_pingpong (two processes, with their data
//! check; also through the chain NP-RDMA user-space mode →
//! libibverbs C ABI → software NIC, `NPRDMA_DEVICE=verbs`), and clean failures for
//! unsupported setups.

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
    tool_pingpong("ibv_rc_pingpong", port, extra, env)
}

/// `tool` (one of ibverbs-utils' pingpongs) with its data check (`-c`), 200
/// iterations, `env` on both sides.
fn tool_pingpong(
    tool: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    tool_pingpong_at(tool, &["-g", "0"], port, extra, env)
}

/// [`tool_pingpong`] with the addressing options `addr` (`-g N`, or none: by LID).
fn tool_pingpong_at(
    tool: &str,
    addr: &[&str],
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    let b = require(&[tool])?;
    let p = port.to_string();
    let mut sargs = addr.to_vec();
    sargs.extend(["-p", p.as_str(), "-n", "200", "-c"]);
    sargs.extend_from_slice(extra);
    let mut cargs = sargs.clone();
    cargs.push("localhost");
    let (s, c) = run_pair(&b[0], port, &sargs, &cargs, env);
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(o.ok(), "{who} failed ({:?}):\n{}", o.code, o.all());
        assert!(o.stdout.contains("200 iters in"), "{who}:\n{}", o.all());
        assert!(!o.stderr.contains("libnprdma:"), "{who}:\n{}", o.all());
        // `-c`: the receiver checks the first byte of every page (set to 0 by the
        // sender over a 0x7b-filled buffer) and prints "invalid data in page N" —
        // on stdout in Debian's build, exiting 0 all the same: both streams.
        assert!(
            !o.stdout.contains("invalid data") && !o.stderr.contains("invalid data"),
            "{who}: the data check failed:\n{}",
            o.all()
        );
    }
    Some((s, c))
}

/// Unreliable connected QPs (`IBV_QPT_UC`): SEND/RECV ping-pong, polling and with
/// completion events, in pinned and NP-RDMA mode.
#[test]
fn ibv_uc_pingpong_both_modes() {
    tool_pingpong("ibv_uc_pingpong", 18683, &[], &[]);
    tool_pingpong("ibv_uc_pingpong", 18684, &["-e"], &[]);
    tool_pingpong("ibv_uc_pingpong", 18685, &[], NP);
    tool_pingpong("ibv_uc_pingpong", 18686, &["-e"], NP);
}

/// Unreliable datagram QPs (`IBV_QPT_UD`, address handles from the peer's GID 0 or
/// an IP GID, `-g 1`): ibv_ud_pingpong with its data check, polling and with
/// completion events, up to the port MTU, in pinned mode (target-enforced and
/// between trusting processes) and in NP-RDMA mode — there also with a budget
/// smaller than the buffers (the pages of posted WRs are pinned, the rest swaps:
/// no DMA reaches a non-resident page, and no pin outlives the run).
#[test]
fn ibv_ud_pingpong_both_modes() {
    tool_pingpong("ibv_ud_pingpong", 18691, &[], &[]);
    tool_pingpong("ibv_ud_pingpong", 18692, &["-e", "-s", "4096"], &[]);
    // Between trusting processes the sender delivers directly (process_vm_writev).
    tool_pingpong(
        "ibv_ud_pingpong",
        18694,
        &["-s", "4096"],
        &[("NPRDMA_TRUSTED_PEERS", "1")],
    );
    tool_pingpong("ibv_ud_pingpong", 18693, &[], NP);
    tool_pingpong("ibv_ud_pingpong", 18695, &["-e", "-s", "4096"], NP);
    tool_pingpong_at("ibv_ud_pingpong", &["-g", "1"], 18696, &["-e"], NP);
    tool_pingpong_at("ibv_ud_pingpong", &["-g", "1"], 18697, &["-s", "2048"], NP);
    // 500 receives of 2 pages each (ibv_ud_pingpong's default rx depth) over a
    // 4-page budget: the posted receives are pinned, the rest of the memory swaps.
    let mut env = NP.to_vec();
    env.push(("NPRDMA_BUDGET_PAGES", "4"));
    if let Some((s, c)) = tool_pingpong("ibv_ud_pingpong", 18698, &["-s", "4096"], &env) {
        for o in [&s, &c] {
            assert_eq!(stat(o, "nonresident_dma"), 0, "{}", o.all());
            assert_eq!(stat(o, "ud_pinned_pages"), 0, "{}", o.all());
        }
    }
}

/// Shared receive queues: ibv_srq_pingpong's 16 QPs on one SRQ, polling and with
/// completion events, in pinned and NP-RDMA mode.
#[test]
fn ibv_srq_pingpong_both_modes() {
    tool_pingpong("ibv_srq_pingpong", 18687, &[], &[]);
    tool_pingpong("ibv_srq_pingpong", 18688, &["-e"], &[]);
    tool_pingpong("ibv_srq_pingpong", 18689, &[], NP);
    tool_pingpong("ibv_srq_pingpong", 18690, &["-e"], NP);
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

// ---- The chain: NP-RDMA user-space mode -> libibverbs C ABI -> software NIC ----

/// ibv_rc_pingpong (data check) with libnprdma.so in NP-RDMA mode over the next
/// libibverbs (a second copy of libnprdma.so, pinned): the programs exchange only
/// their data QPN and GID, the control channel rides on the data QP.
fn chain_pingpong(port: u16, extra: &[&str]) {
    let env = chain_env(&[]);
    if let Some((s, c)) = pingpong_env(port, extra, &env_refs(&env)) {
        for o in [&s, &c] {
            assert_chain_stats(o);
            // Every message is a SEND: two-sided, through the control channel.
            assert!(stat(o, "two_sided") >= 200, "{}", o.all());
        }
    }
}

#[test]
fn chain_ibv_rc_pingpong_polling() {
    chain_pingpong(18671, &[]);
}

#[test]
fn chain_ibv_rc_pingpong_events_large() {
    chain_pingpong(18672, &["-e", "-s", "65536"]);
}

#[test]
fn chain_ibv_rc_pingpong_inline() {
    chain_pingpong(18681, &["-s", "1000"]);
}

#[test]
fn chain_ibv_rc_pingpong_swapped() {
    // 64 KiB messages with a 4-page budget: data checked while pages are swapped.
    let env = chain_env(&[("NPRDMA_BUDGET_PAGES", "4")]);
    if let Some((s, c)) = pingpong_env(18682, &["-s", "65536"], &env_refs(&env)) {
        for o in [&s, &c] {
            assert_chain_stats(o);
            assert!(stat(o, "swap_outs") > 0, "{}", o.all());
        }
    }
}

/// Set-ups of the chain that cannot work fail `ibv_open_device` with a clear message:
/// libnprdma.so as its own next libibverbs, a library that does not exist, and
/// pinned mode over `NPRDMA_DEVICE=verbs`.
#[test]
fn chain_misconfigurations_fail_cleanly() {
    let Some(b) = require(&["ibv_devinfo"]) else {
        return;
    };
    let own = lib_path().to_string_lossy().into_owned();
    for (env, want) in [
        (
            vec![
                ("NPRDMA_MODE", "nprdma"),
                ("NPRDMA_DEVICE", "verbs"),
                ("NPRDMA_VERBS_LIB", own.as_str()),
            ],
            "itself",
        ),
        (
            vec![
                ("NPRDMA_MODE", "nprdma"),
                ("NPRDMA_DEVICE", "verbs"),
                ("NPRDMA_VERBS_LIB", "/nonexistent/libibverbs.so.1"),
            ],
            "cannot load",
        ),
        (
            vec![("NPRDMA_MODE", "pinned"), ("NPRDMA_DEVICE", "verbs")],
            "needs NPRDMA_MODE=nprdma",
        ),
        (
            vec![("NPRDMA_MODE", "nprdma"), ("NPRDMA_DEVICE", "mlx5_0")],
            "not a known device",
        ),
    ] {
        let o = run(&b[0], &[], &env);
        assert!(!o.ok(), "{env:?}: {}", o.all());
        assert!(
            o.stderr.contains("libnprdma: ibv_open_device") && o.stderr.contains(want),
            "{env:?}: want {want:?}\n{}",
            o.all()
        );
    }
}

/// The real libibverbs as the next library (`NPRDMA_VERBS_LIB` unset) is loaded into a
/// new link-map namespace: the program's own libibverbs is bound to this preloaded
/// library's exports (it calls `ibv_reg_mr_iova2`, `ibv_read_sysfs_file`, ... through
/// its PLT), the isolated copy only to itself and its dependencies
/// (`LD_DEBUG=bindings`). There is no RDMA device here, so opening fails cleanly.
#[test]
fn chain_real_libibverbs_is_isolated() {
    let Some(b) = require(&["ibv_devinfo"]) else {
        return;
    };
    let o = run(
        &b[0],
        &[],
        &[
            ("NPRDMA_MODE", "nprdma"),
            ("NPRDMA_DEVICE", "verbs"),
            ("LD_BIND_NOW", "1"),
            ("LD_DEBUG", "bindings"),
        ],
    );
    let isolated: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.contains("binding file") && l.contains("libibverbs.so.1 [1] to"))
        .collect();
    // ibv_devinfo itself links libibverbs.so.1, so it is there: no binding of an
    // isolated copy means the real library was not loaded in a namespace of its own.
    assert!(
        !isolated.is_empty(),
        "no binding of an isolated libibverbs.so.1 (`libibverbs.so.1 [1]`): {} binding lines\n{}",
        o.stderr
            .lines()
            .filter(|l| l.contains("binding file"))
            .count(),
        o.stderr
            .lines()
            .filter(|l| !l.contains("binding"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let leaks: Vec<&&str> = isolated
        .iter()
        .filter(|l| l.contains("libnprdma"))
        .collect();
    assert!(
        leaks.is_empty(),
        "bound to the preloaded library: {leaks:#?}"
    );
    assert!(
        isolated.iter().any(|l| l.contains("`ibv_reg_mr_iova2'")),
        "the isolated copy's own references: {}",
        isolated.len()
    );
    assert!(!o.ok());
    assert!(
        o.stderr.contains("libnprdma: ibv_open_device"),
        "{}",
        o.stderr
            .lines()
            .filter(|l| !l.contains("binding"))
            .collect::<Vec<_>>()
            .join("\n")
    );
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

/// The port's LID and its IP GIDs address peers as GID 0 does: the pingpongs
/// without `-g` (address vectors without GRH: by LID, as InfiniBand software
/// addresses ports) and with `-g 1` (the host's first IP as a RoCE v2 GID: the device
/// is the one whose LID owns the destination QP number), RC and UC in both modes, UD
/// address handles by IP GID in pinned mode.
#[test]
fn pingpongs_by_lid_and_by_ip_gid() {
    let mut port = 18900;
    for env in [&[][..], NP] {
        for tool in ["ibv_rc_pingpong", "ibv_uc_pingpong"] {
            for addr in [&[][..], &["-g", "1"][..]] {
                port += 1;
                if tool_pingpong_at(tool, addr, port, &[], env).is_none() {
                    return;
                }
            }
        }
    }
    tool_pingpong_at("ibv_ud_pingpong", &["-g", "1"], 18910, &[], &[]);
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
