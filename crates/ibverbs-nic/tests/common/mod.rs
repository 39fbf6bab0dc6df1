//! Locating the device library for the tests: this repository's
//! `libnprdma.so` (the software NIC behind the libibverbs C ABI, pinned
//! mode), built by cargo next to the test binary as verbs-shim's own
//! tests do; or `None` when it cannot be had: the test skips, or fails under
//! `NPRDMA_REQUIRE_ALL=1` (as in CI; [`nprdma_test_support::skip`]).
//! `NPRDMA_TEST_VERBS_LIB` names another library instead (e.g.
//! `libibverbs.so.1` over an rxe device: `scripts/rxe-test.sh`), with the
//! device from `NPRDMA_VERBS_DEVICE`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ibverbs_nic::{Config, VerbsNic};

/// target/<profile>/libnprdma.so, built once per test binary when cargo
/// runs it; `None` (skipped, or a panic under `NPRDMA_REQUIRE_ALL=1`) when
/// it cannot be had.
pub fn lib_path() -> Option<PathBuf> {
    if let Some(l) = std::env::var_os("NPRDMA_TEST_VERBS_LIB").filter(|l| !l.is_empty()) {
        return Some(PathBuf::from(l));
    }
    nprdma_test_support::skip::or_skip(
        nprdma_test_support::cdylib::libnprdma()
            .map_err(|why| format!("libnprdma.so could not be had ({why})")),
    )
}

/// The configuration of a test NIC: libnprdma.so as the device library.
pub fn config(lib: &Path) -> Config {
    Config {
        lib: Some(lib.to_string_lossy().into_owned()),
        ..Config::default()
    }
}

/// Whether the tests run on this repository's libnprdma.so.
pub fn on_libnprdma() -> bool {
    std::env::var_os("NPRDMA_TEST_VERBS_LIB").map_or(true, |l| l.is_empty())
}

/// Two NICs (PDs of their own device contexts) on libnprdma.so.
pub fn pair() -> Option<(VerbsNic, VerbsNic)> {
    let lib = lib_path()?;
    // Pinned mode: the software NIC itself (the default, stated anyway).
    assert!(
        !on_libnprdma() || std::env::var("NPRDMA_MODE").map_or(true, |m| m == "pinned"),
        "the tests need NPRDMA_MODE unset or `pinned`"
    );
    let cfg = config(&lib);
    let a = VerbsNic::open(&cfg).expect("open a");
    let b = VerbsNic::open(&cfg).expect("open b");
    Some((a, b))
}

/// A user-space host for the shared chaos runners: a pager, a context on `nic`
/// (no IOMMU control) and a PD.
pub struct UserSide {
    pub pager: vmem::Pager,
    pub ctx: nprdma::Context<VerbsNic>,
    pub pd: nprdma::Pd<VerbsNic>,
}

impl UserSide {
    pub fn new(nic: VerbsNic) -> UserSide {
        let pager = vmem::Pager::new(vmem::PagerConfig {
            swap_size: 256 << 20,
            ..vmem::PagerConfig::default()
        })
        .expect("pager");
        let ctx = nprdma::Context::with_nic(nic, &pager, nprdma::Config::default())
            .expect("user-space context");
        let pd = ctx.alloc_pd();
        UserSide { pager, ctx, pd }
    }
}

impl nprdma_test_support::Mem<VerbsNic> for UserSide {
    fn pager(&self) -> &vmem::Pager {
        &self.pager
    }
    fn pd(&self) -> &nprdma::Pd<VerbsNic> {
        &self.pd
    }
}

impl nprdma_test_support::chaos::Side<VerbsNic> for UserSide {
    fn ctx(&self) -> &nprdma::Context<VerbsNic> {
        &self.ctx
    }
}
