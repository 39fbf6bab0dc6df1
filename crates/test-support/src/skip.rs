//! Tests that cannot run for want of a prerequisite (a Debian package's
//! program, libibverbs' headers, libnprdma.so itself): one rule for every
//! test crate.
//!
//! With `NPRDMA_REQUIRE_ALL=1` (what `scripts/test-all.sh` exports when
//! `CI=true`, and `.ci/run` sets `CI=true`) a missing prerequisite **fails**
//! the test: [`skip`] panics with the reason, so a CI run never passes on a
//! test that did not run. Otherwise (`cargo test` by hand) the test skips: a
//! `SKIP: <binary>::<test>: <reason>` line is written to stderr past the
//! test harness's output capture (so it shows in the run's output even for a
//! passing test), and appended to the file `NPRDMA_SKIP_LOG` names, if set
//! (`scripts/test-all.sh` counts and lists those at the end).

use std::fmt::Display;
use std::io::Write;

/// The variable that turns a skip into a failure.
pub const REQUIRE_ALL: &str = "NPRDMA_REQUIRE_ALL";

/// The variable naming the file every skip is appended to.
pub const SKIP_LOG: &str = "NPRDMA_SKIP_LOG";

/// Whether a missing prerequisite fails the test (`NPRDMA_REQUIRE_ALL=1`).
pub fn required() -> bool {
    std::env::var(REQUIRE_ALL).is_ok_and(|v| v == "1")
}

/// The running test, as `<binary>::<test>` (libtest names each test's thread
/// after the test).
fn test_name() -> String {
    let bin = std::env::current_exe()
        .ok()
        .and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| match s.rsplit_once('-') {
            // cargo's test binaries end in -<hash>.
            Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
            _ => s,
        })
        .unwrap_or_else(|| "test".into());
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed thread>")
        .to_string();
    format!("{bin}::{test}")
}

/// The running test cannot run: `why` names the missing prerequisite (and
/// how to get it). Panics when [`required`]; otherwise records the skip
/// (stderr and `NPRDMA_SKIP_LOG`) and returns, and the caller returns
/// without checking anything.
pub fn skip(why: impl Display) {
    let name = test_name();
    if required() {
        panic!("{name}: a prerequisite is missing: {why} ({REQUIRE_ALL}=1: a test that cannot run fails)");
    }
    let line = format!("SKIP: {name}: {why}\n");
    // Straight to the process's stderr: libtest captures only the print macros.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(log) = std::env::var_os(SKIP_LOG).filter(|l| !l.is_empty()) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            // One write per line: lines of concurrent tests do not interleave.
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// `r`'s value, or `None` after [`skip`] with its error.
pub fn or_skip<T, E: Display>(r: Result<T, E>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(why) => {
            skip(why);
            None
        }
    }
}
