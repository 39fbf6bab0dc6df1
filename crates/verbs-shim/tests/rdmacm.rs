//! rdma_cm through libnprdma.so, both modes: the semantics program `c/cm_events.c`
//! (REJECTED for a port nobody listens on, private data both ways at the IB CM
//! limits, reject, SEND, DISCONNECTED, a killed peer, bad arguments, connect /
//! disconnect cycles leaking no fd or thread), and the unmodified clients users run:
//! rping (data validated), perftest's `-R`, rdmacm-utils' udaddy,
//! ucmatose and rdma_server/rdma_client, libfabric's `fi_pingpong` over the verbs
//! provider's MSG endpoints. Distinct ports per test (tests run in parallel).

mod common;
use common::*;
use std::time::Duration;

const MODES: [&str; 2] = ["pinned", "nprdma"];

fn cm_events(mode: &str, port: u16, cycles: &str) {
    let Some(exe) = compile("cm_events") else {
        return;
    };
    let p = port.to_string();
    let o = run(&exe, &[p.as_str(), cycles], &[("NPRDMA_MODE", mode)]);
    assert!(
        o.ok() && o.stdout.contains("cm_events: ok"),
        "{mode}:\n{}",
        o.all()
    );
}

#[test]
fn cm_semantics_pinned_1000_cycles() {
    cm_events("pinned", 19610, "1000");
}

#[test]
fn cm_semantics_np() {
    cm_events("nprdma", 19620, "300");
}

/// A server and a client of `bin` on `port` (the server listens on TCP `port`: the
/// CM's stream rides the rdma_cm port), both checked.
fn pair(
    bin: &str,
    port: u16,
    sargs: &[&str],
    cargs: &[&str],
    env: &[(&str, &str)],
) -> Option<(Output, Output)> {
    let b = require(&[bin])?;
    let (s, c) = run_pair(&b[0], port, sargs, cargs, env);
    check_pair(bin, cargs, &s, &c);
    Some((s, c))
}

fn check_pair(bin: &str, cargs: &[&str], s: &Output, c: &Output) {
    assert!(
        c.ok() && s.ok(),
        "{bin} {cargs:?}: client {:?} server {:?}\n== client\n{}\n== server\n{}",
        c.code,
        s.code,
        c.all(),
        s.all()
    );
}

#[test]
fn rping_validates_data_both_modes() {
    for (i, m) in MODES.iter().enumerate() {
        let port = (19630 + i).to_string();
        let p = port.as_str();
        let env = [("NPRDMA_MODE", *m)];
        let Some((s, c)) = pair(
            "rping",
            19630 + i as u16,
            &["-s", "-a", "127.0.0.1", "-p", p, "-C", "200", "-V"],
            &["-c", "-a", "127.0.0.1", "-p", p, "-C", "200", "-V", "-v"],
            &env,
        ) else {
            return;
        };
        assert_eq!(
            c.stdout.matches("ping data: rdma-ping-").count(),
            200,
            "{m}: {}",
            c.all()
        );
        assert!(
            !s.all().contains("data mismatch") && !c.all().contains("error"),
            "{m}: {}",
            c.all()
        );
    }
}

/// perftest 4.5-0.17's `-R` has a race of its own: after the sync over its first
/// rdma_cm connection the client connects the data QP while the server may not yet
/// listen again, which IB's CM answers with REJECTED (8, no such service) on any
/// device; its retry loop then reuses the ids it just destroyed and crashes or hangs
/// (fixed upstream in perftest 3d9d8d0, "Fix crashes and logical flaws in RDMA CM
/// connection retry"). Here the server lags most in NP-RDMA mode (its last SEND of
/// the sync completes a round trip after the client's receive), where about one run
/// in three meets the race. A run that ends that way is run again, on another port,
/// up to six times; any other failure fails at once.
fn perftest_pair(tool: &str, port: u16, args: &[&str], env: &[(&str, &str)]) -> Option<Output> {
    let b = require(&[tool])?;
    const ATTEMPTS: u16 = 6;
    for attempt in 0..ATTEMPTS {
        let p = (port + 1000 * attempt).to_string();
        let mut sargs = args.to_vec();
        sargs.extend(["-p", p.as_str()]);
        let mut cargs = sargs.clone();
        cargs.push("127.0.0.1");
        let (s, c) = run_pair(&b[0], port + 1000 * attempt, &sargs, &cargs, env);
        let raced = !c.ok() && c.stderr.contains("RDMA_CM_EVENT_REJECTED; error: 8.");
        if raced && attempt + 1 < ATTEMPTS {
            eprintln!("{tool} {cargs:?}: perftest's re-listen race (REJECTED 8); again");
            continue;
        }
        check_pair(tool, &cargs, &s, &c);
        return Some(c);
    }
    unreachable!("the last attempt returns")
}

#[test]
fn perftest_rdma_cm_both_modes() {
    let mut port = 19640;
    for m in MODES {
        for (tool, bw) in [
            ("ib_read_lat", false),
            ("ib_write_lat", false),
            ("ib_send_lat", false),
            ("ib_write_bw", true),
            ("ib_read_bw", true),
        ] {
            port += 1;
            let size = if bw { "65536" } else { "2" };
            let args = ["-R", "-n", "200", "-s", size];
            let Some(c) = perftest_pair(tool, port, &args, &[("NPRDMA_MODE", m)]) else {
                return;
            };
            let rows = result_rows(&c.stdout);
            assert!(
                rows.iter().any(|r| r[1] == 200.0 && r.len() >= 5),
                "{m} {tool}: no result row\n{}",
                c.all()
            );
            assert!(
                c.stdout.contains("rdma_cm"),
                "{m} {tool}: not over rdma_cm\n{}",
                c.all()
            );
        }
    }
}

#[test]
fn rdmacm_utils() {
    for (i, m) in MODES.iter().enumerate() {
        let env = [("NPRDMA_MODE", *m)];
        let port = 19670 + 10 * i as u16;
        let p = port.to_string();
        // Many connections at once, data exchanged on each.
        if pair(
            "ucmatose",
            port,
            &["-p", p.as_str(), "-c", "4", "-C", "20"],
            &["-s", "127.0.0.1", "-p", p.as_str(), "-c", "4", "-C", "20"],
            &env,
        )
        .is_none()
        {
            return;
        }
        // Synchronous endpoints (rdma_create_ep, rdma_get_request).
        let p1 = (port + 1).to_string();
        let b = require(&["rdma_server", "rdma_client"]).expect("rdmacm-utils");
        let server = spawn(&b[0], &["-p", p1.as_str()], &env);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !listening(port + 1) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let c = run(&b[1], &["-s", "127.0.0.1", "-p", p1.as_str()], &env);
        let s = finish(server, std::time::Instant::now() + Duration::from_secs(10));
        assert!(
            c.ok() && s.ok() && s.stdout.contains("end 0"),
            "rdma_server/client:\n{}\n{}",
            c.all(),
            s.all()
        );
        // UD (SIDR): pinned mode only (NP-RDMA has no UD QPs yet).
        if *m == "pinned" {
            let p2 = (port + 2).to_string();
            let b = require(&["udaddy"]).expect("rdmacm-utils");
            // udaddy's default port (its -p is not applied to the listener).
            let _ = &p2;
            let server = spawn(&b[0], &[], &env);
            std::thread::sleep(Duration::from_millis(300));
            let c = run(&b[0], &["-s", "127.0.0.1"], &env);
            let s = finish(server, std::time::Instant::now() + Duration::from_secs(10));
            assert!(
                c.ok() && s.ok() && c.stdout.contains("return status 0"),
                "udaddy:\n{}\n{}",
                c.all(),
                s.all()
            );
        }
    }
}

/// libfabric's verbs provider: MSG endpoints (`-p verbs -e msg`) and RDM endpoints
/// over them (`-p "verbs;ofi_rxm" -e rdm`, the utility provider MPI and storage
/// stacks use), message sizes up to 1 MiB. RDM in pinned mode only: in NP-RDMA mode
/// the transfers complete, then fi_pingpong crashes inside libfabric 1.17 at close
/// (undiagnosed: Debian's libfabric has no symbols here; issue 33's closing note).
#[test]
fn libfabric_msg_endpoints_over_verbs() {
    let Some(b) = require(&["fi_pingpong"]) else {
        return;
    };
    let mut port = 19690;
    for (prov, ep, modes) in [
        ("verbs", "msg", &MODES[..]),
        ("verbs;ofi_rxm", "rdm", &MODES[..1]),
    ] {
        for &m in modes {
            port += 1;
            let env = [("NPRDMA_MODE", m), ("FI_PROVIDER", prov)];
            let p = port.to_string();
            let args = ["-p", prov, "-e", ep, "-B", p.as_str(), "-I", "20"];
            let server = spawn(&b[0], &args, &env);
            std::thread::sleep(Duration::from_millis(500));
            let cargs = [
                "-p",
                prov,
                "-e",
                ep,
                "-P",
                p.as_str(),
                "-I",
                "20",
                "127.0.0.1",
            ];
            let c = run(&b[0], &cargs, &env);
            let s = finish(server, std::time::Instant::now() + Duration::from_secs(10));
            assert!(
                c.ok() && s.ok(),
                "{m} {prov}: fi_pingpong\n{}\n{}",
                c.all(),
                s.all()
            );
            assert!(
                c.stdout.contains("1m"),
                "{m} {prov}: no 1 MiB row\n{}",
                c.all()
            );
        }
    }
}
