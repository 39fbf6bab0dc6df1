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
    for b in &bins {
        let und = nm(&["-D", "--undefined-only"], b).expect("nm on a program");
        for l in und.lines() {
            let Some(sym) = l.split_whitespace().last() else {
                continue;
            };
            let name = sym.split('@').next().unwrap_or(sym);
            // rdma_cm beyond its entry points and mlx5dv are only reached after those
            // entry points succeeded / on Mellanox devices.
            let verbs = name.starts_with("ibv_") || name.starts_with("_ibv_");
            if verbs && !exported.contains(name) {
                missing.insert(format!("{name} (imported by {})", b.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not exported by libnprdma.so: {missing:#?}"
    );
    for entry in [
        "rdma_create_event_channel",
        "rdma_create_id",
        "rdma_getaddrinfo",
    ] {
        assert!(exported.contains(entry), "{entry} not exported");
    }
}
