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

/// A WRITE whose remote range wraps → REM_ACCESS_ERR; a CQ overrun → the CQ
/// fails polls once emptied and its QP is in ERR (`tests/c/overrun.c`).
#[test]
fn overrun() {
    check("overrun");
}
