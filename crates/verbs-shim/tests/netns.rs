//! rdma_cm between two network namespaces joined by a veth pair (`scripts/netns.sh`:
//! nprdma-a 10.77.0.1 / fd77::1, nprdma-b 10.77.0.2 / fd77::2): rping (data
//! verified, IPv4 and IPv6) and perftest `-R`, both modes, the server in one
//! namespace, the client in the other, connecting by the namespaces' own addresses.
//! The CM's stream crosses the veth; the data still travels over the same-host
//! transport (no network transport yet). Needs root (the namespaces); one test, so
//! that the namespaces are set up and removed once.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const A: &str = "nprdma-a";
const B: &str = "nprdma-b";

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/netns.sh")
}

/// `bin sargs` in A, then once it listens on `port`, `bin cargs` in B.
fn across(
    ip: &Path,
    bin: &Path,
    port: u16,
    sargs: &[&str],
    cargs: &[&str],
    mode: &str,
) -> (Output, Output) {
    let b = bin.to_str().expect("utf-8 path");
    let env = [("NPRDMA_MODE", mode)];
    let with = |ns: &'static str, args: &[&str]| {
        let mut v = vec!["netns", "exec", ns, b];
        v.extend_from_slice(args);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let sv = with(A, sargs);
    let cv = with(B, cargs);
    let deadline = Instant::now() + LIMIT;
    let server = spawn(ip, &refs(&sv), &env);
    while !listening_in(A, port) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = finish(spawn(ip, &refs(&cv), &env), deadline);
    let s = finish(server, Instant::now() + Duration::from_secs(10));
    (s, c)
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn rping_and_perftest_across_namespaces() {
    let Some(b) = require(&["rping", "ib_write_lat", "ib_read_bw", "ip"]) else {
        return;
    };
    if !is_root() {
        skip("network namespaces need root");
        return;
    }
    let up = Command::new("bash").arg(script()).arg("up").status();
    assert!(up.is_ok_and(|s| s.success()), "scripts/netns.sh up failed");
    let mut port = 7400;
    let mut failures = Vec::new();
    for mode in ["pinned", "nprdma"] {
        for addr in ["10.77.0.1", "fd77::1"] {
            port += 1;
            let p = port.to_string();
            let (s, c) = across(
                &b[3],
                &b[0],
                port,
                &["-s", "-a", addr, "-p", &p, "-C", "100", "-V"],
                &["-c", "-a", addr, "-p", &p, "-C", "100", "-V", "-v"],
                mode,
            );
            let pings = c.stdout.matches("ping data: rdma-ping-").count();
            if !(s.ok() && c.ok() && pings == 100) {
                failures.push(format!(
                    "rping {mode} {addr}: {pings} pings\n{}\n{}",
                    c.all(),
                    s.all()
                ));
            }
        }
        for (i, tool) in [&b[1], &b[2]].into_iter().enumerate() {
            // perftest's own re-listen race (tests/rdmacm.rs): up to six runs.
            let result = perftest_cm_tries(&mut port, 200.0, |port| {
                let p = port.to_string();
                let size = if i == 0 { "2" } else { "65536" };
                let args = ["-R", "-p", p.as_str(), "-n", "200", "-s", size];
                let mut cargs = args.to_vec();
                cargs.push("10.77.0.1");
                across(&b[3], tool, port, &args, &cargs, mode)
            });
            if let Err(e) = result {
                failures.push(format!("{} {mode}:\n{e}", tool.display()));
            }
        }
    }
    let _ = Command::new("bash").arg(script()).arg("down").status();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
