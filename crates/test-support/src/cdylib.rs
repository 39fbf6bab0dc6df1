//! The project's `libnprdma.so` for tests that load it (LD_PRELOAD, or as the
//! device library of the libibverbs backend): cargo does not build a
//! cdylib-only library for integration tests, so a test binary run by cargo
//! builds it once, next to itself, with the same cargo, target dir and profile.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// `target/<profile>/libnprdma.so` beside this test binary, built once per test
/// binary when cargo runs it; why not otherwise.
pub fn libnprdma() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    // target/<profile>/deps/<test> -> target/<profile>
    BUILT
        .get_or_init(|| built_in(|profile| Some(profile.to_path_buf())))
        .clone()
}

/// `target/release/libnprdma.so`, built once per test binary when cargo runs
/// it (whatever the test's own profile): for tests whose load the unoptimised
/// library would turn from seconds into minutes (the memory-pressure stress).
pub fn libnprdma_release() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| built_in(|profile| Some(profile.parent()?.join("release"))))
        .clone()
}

/// The library built into the profile directory `dir` names (given this test
/// binary's own profile directory).
fn built_in(dir: impl Fn(&Path) -> Option<PathBuf>) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("test exe path: {e}"))?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .and_then(dir)
        .ok_or("no target dir")?;
    build(&dir)?;
    let p = dir.join("libnprdma.so");
    if !p.exists() {
        return Err(format!(
            "{} not found (build it with `cargo build -p verbs-shim`, that profile and target dir)",
            p.display()
        ));
    }
    Ok(p)
}

/// `cargo build` verbs-shim's library into `profile_dir` (nothing to do when not
/// run by cargo: what is there is used).
fn build(profile_dir: &Path) -> Result<(), String> {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(());
    };
    let name = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    let profile = if name == "debug" { "dev" } else { name };
    let target = profile_dir.parent().ok_or("no target dir")?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verbs-shim/Cargo.toml");
    let st = Command::new(cargo)
        .args(["build", "--lib", "--profile", profile, "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", target)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("run cargo: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("cargo build -p verbs-shim: {st}"))
    }
}
