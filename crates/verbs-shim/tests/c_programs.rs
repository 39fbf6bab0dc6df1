//! C programs written against `<infiniband/verbs.h>` only (`tests/c/*.c`), compiled
//! with `cc -libverbs` and run under `LD_PRELOAD=libnprdma.so` in pinned and NP-RDMA
//! mode, and in NP-RDMA's user-space mode over a second copy of the library (the
//! chain): verbs semantics as rxe/mlx5 give them (QP state machine, post-time
//! refusals and `bad_wr`, completion statuses and fields, resource rules,
//! completion channels, a peer killed mid-run). Each program asserts and exits
//! non-zero on a mismatch. Skipped without libibverbs' headers (a failure under
//! `NPRDMA_REQUIRE_ALL=1`, as in CI: [`nprdma_test_support::skip`]).

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const HEADER: &str = "/usr/include/infiniband/verbs.h";

/// Where the programs are built: `target/<profile>/c-programs/` beside this test
/// binary (the temp dir if that cannot be found).
fn out_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent()?.parent().map(Path::to_path_buf))
            .unwrap_or_else(std::env::temp_dir);
        let d = profile.join("c-programs");
        std::fs::create_dir_all(&d).expect("create the programs' build dir");
        d
    })
}

/// Compile `tests/c/<name>.c`; None (skipped) without the headers.
fn compile(name: &str) -> Option<PathBuf> {
    if !Path::new(HEADER).exists() {
        skip(format!(
            "{name}: {HEADER} missing (apt-get install -y libibverbs-dev)"
        ));
        return None;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = out_dir().join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-O1", "-g", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-libverbs", "-lpthread"])
        .output()
        .unwrap_or_else(|e| panic!("run {cc}: {e}"));
    assert!(
        out.status.success(),
        "{cc} {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// Run `name` in both modes, and in NP-RDMA's user-space mode over the C ABI of a
/// second copy of the library (the chain of `perftest.rs`), with glibc's malloc
/// perturbation on; each must exit 0.
fn check(name: &str) {
    let Some(exe) = compile(name) else { return };
    let chain = chain_env(&[]);
    let runs: [(&str, Vec<(&str, &str)>); 3] = [
        ("pinned", vec![("NPRDMA_MODE", "pinned")]),
        ("nprdma", vec![("NPRDMA_MODE", "nprdma")]),
        ("user-space (chain)", env_refs(&chain)),
    ];
    for (mode, mut env) in runs {
        // Freed heap memory filled with a pattern: a use of an object the library
        // freed crashes the program every time, not on some machines only.
        env.push(("GLIBC_TUNABLES", "glibc.malloc.perturb=165"));
        let o = run(&exe, &[], &env);
        assert!(
            o.ok(),
            "{name} in {mode} mode: exit {:?}\n{}",
            o.code,
            o.all()
        );
    }
}

#[test]
fn qp_state() {
    check("qp_state");
}

#[test]
fn post_errors() {
    check("post_errors");
}

#[test]
fn wc_status() {
    check("wc_status");
}

#[test]
fn wc_fields() {
    check("wc_fields");
}

#[test]
fn resources() {
    check("resources");
}

#[test]
fn channels() {
    check("channels");
}

#[test]
fn two_proc() {
    check("two_proc");
}

#[test]
fn sge_pd() {
    check("sge_pd");
}

#[test]
fn ud() {
    check("ud");
}

#[test]
fn limits() {
    check("limits");
}

#[test]
fn threads() {
    check("threads");
}

#[test]
fn mem_kinds() {
    check("mem_kinds");
}
