//! Every libibverbs function the supported programs import is exported by
//! libnprdma.so (otherwise the call would fall through to the real libibverbs, which
//! knows nothing of our objects). Checked with `nm -D` on the installed binaries.

mod common;
use common::*;
use std::collections::BTreeSet;
use std::process::Command;

fn nm(args: &[&str], file: &std::path::Path) -> Option<String> {
    let o = Command::new("nm").args(args).arg(file).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

#[test]
fn all_imported_verbs_are_exported() {
    let progs = [
        "ibv_devices",
        "ibv_devinfo",
        "ibv_rc_pingpong",
        "ib_read_lat",
        "ib_write_lat",
        "ib_send_lat",
        "ib_atomic_lat",
        "ib_read_bw",
        "ib_write_bw",
        "ib_send_bw",
        "ib_atomic_bw",
    ];
    // rdma_cm's programs (rdmacm-utils, qperf) are checked when installed.
    let cm_progs: Vec<&str> = [
        "rping",
        "udaddy",
        "ucmatose",
        "rdma_server",
        "rdma_client",
        "qperf",
    ]
    .into_iter()
    .filter(|p| find_bin(p).is_some())
    .collect();
    let Some(bins) = require(&progs) else { return };
    let lib = lib_path();
    let Some(defined) = nm(&["-D", "--defined-only"], &lib) else {
        skip("`nm` (binutils) not available (apt-get install -y binutils)");
        return;
    };
    let exported: BTreeSet<String> = defined
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    let mut missing = BTreeSet::new();
    let mut cm_bins: Vec<_> = cm_progs.iter().filter_map(|p| find_bin(p)).collect();
    // UCX's verbs and rdma_cm transports (ucx-utils' libucx0), when installed.
    cm_bins.extend(
        ["libuct_ib.so.0", "libuct_rdmacm.so.0"]
            .iter()
            .map(|l| std::path::Path::new("/usr/lib/x86_64-linux-gnu/ucx").join(l))
            .filter(|p| p.exists()),
    );
    for b in bins.iter().chain(&cm_bins) {
        let und = nm(&["-D", "--undefined-only"], b).expect("nm on a program");
        for l in und.lines() {
            let Some(sym) = l.split_whitespace().last() else {
                continue;
            };
            let name = sym.split('@').next().unwrap_or(sym);
            // Every libibverbs and librdmacm function (mlx5dv is reached only on
            // Mellanox devices).
            let verbs =
                name.starts_with("ibv_") || name.starts_with("_ibv_") || name.starts_with("rdma_");
            if verbs && !exported.contains(name) {
                missing.insert(format!("{name} (imported by {})", b.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not exported by libnprdma.so: {missing:#?}"
    );
    // Every function librdmacm exports is ours (a call falling through to the real
    // librdmacm would meet objects it does not know).
    if let Some(cm) = [
        "/usr/lib/x86_64-linux-gnu/librdmacm.so.1",
        "/usr/lib/librdmacm.so.1",
    ]
    .iter()
    .map(std::path::Path::new)
    .find(|p| p.exists())
    {
        let defs = nm(&["-D", "--defined-only"], cm).expect("nm on librdmacm");
        for l in defs.lines() {
            let Some(sym) = l.split_whitespace().nth(2) else {
                continue;
            };
            let name = sym.split('@').next().unwrap_or(sym);
            if name.starts_with("rdma_") {
                assert!(exported.contains(name), "librdmacm's {name} not exported");
            }
        }
    }
}
