//! Pinned mode charges registrations against RLIMIT_MEMLOCK as the kernel's
//! `ib_umem_get` does (ENOMEM past the limit unless the thread has CAP_IPC_LOCK);
//! NP-RDMA mode pins nothing, so the limit does not bind its MRs. Driven through
//! pyverbs (rdma-core's Python binding, Debian `python3-pyverbs`) in a child process
//! started with a 128 KiB `ulimit -l` and — for the faithful case — without
//! CAP_IPC_LOCK (dropped from its capability bounding set before exec, so even root
//! runs without it).

mod common;
use common::*;
use std::os::unix::process::CommandExt;
use std::process::Command;

const PY: &str = "/usr/bin/python3";
const LIMIT: u64 = 128 * 1024;
const CAP_IPC_LOCK: libc::c_ulong = 14;

/// Register 64 KiB (fits), then 128 KiB more (192 KiB in all), then deregister the
/// first and register 64 KiB again.
const SCRIPT: &str = r#"
import pyverbs.device as d, pyverbs.pd as p, pyverbs.mr as m, pyverbs.enums as e
from pyverbs.pyverbs_error import PyverbsRDMAError
ctx = d.Context(name='nprdma0'); pd = p.PD(ctx)
a = m.MR(pd, 64 * 1024, e.IBV_ACCESS_LOCAL_WRITE)
try:
    b = m.MR(pd, 128 * 1024, e.IBV_ACCESS_LOCAL_WRITE)
    print("second: ok")
    b.close()
except PyverbsRDMAError as ex:
    print("second: errno", ex.error_code)
a.close()
c = m.MR(pd, 64 * 1024, e.IBV_ACCESS_LOCAL_WRITE)
print("third: ok")
"#;

fn pyverbs_present() -> bool {
    let ok = Command::new(PY)
        .args(["-c", "import pyverbs.device"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        skip(format!(
            "{PY} with pyverbs not available (apt-get install -y python3-pyverbs)"
        ));
    }
    ok
}

/// The script's output with `ulimit -l` = [`LIMIT`], CAP_IPC_LOCK dropped or kept.
fn run_limited(mode: &str, drop_cap: bool) -> String {
    let mut cmd = Command::new(PY);
    cmd.args(["-c", SCRIPT])
        .env("LD_PRELOAD", lib_path())
        .env("NPRDMA_MODE", mode);
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: LIMIT,
                rlim_max: LIMIT,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Fails without CAP_SETPCAP: then the process has no CAP_IPC_LOCK to
            // lose either (not root).
            if drop_cap {
                libc::prctl(libc::PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0);
            }
            Ok(())
        });
    }
    let o = cmd.output().expect("run python3");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{mode}: {out}\n{err}");
    out + &err
}

/// Whether this process holds CAP_IPC_LOCK (read from /proc: CapEff).
fn have_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[test]
fn pinned_registration_honours_rlimit_memlock() {
    if !pyverbs_present() {
        return;
    }
    let out = run_limited("pinned", true);
    assert!(out.contains("second: errno 12"), "{out}");
    assert!(
        out.contains("RLIMIT_MEMLOCK"),
        "the refusal names the limit: {out}"
    );
    assert!(out.contains("third: ok"), "deregistration uncharges: {out}");
    if have_cap_ipc_lock() {
        // Kept CAP_IPC_LOCK (root): the kernel waives the limit, and so do we.
        let out = run_limited("pinned", false);
        assert!(out.contains("second: ok"), "{out}");
    }
}

#[test]
fn np_rdma_registration_pins_nothing() {
    if !pyverbs_present() {
        return;
    }
    let out = run_limited("nprdma", true);
    assert!(out.contains("second: ok"), "{out}");
    assert!(out.contains("third: ok"), "{out}");
}
