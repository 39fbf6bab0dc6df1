//! The NIC-trait contract (`nprdma::nic::contract`) and the backend's own
//! promises — capability refusals, failed registrations without leaks,
//! owned buffers — over this repository's libnprdma.so (pinned mode: the
//! software NIC behind the libibverbs C ABI) as the device.

mod common;

use ibverbs_nic::{Config, Error, VerbsNic};
use nprdma::nic::{Access, Nic, NicBuf, NicMr};

#[test]
fn libnprdma_keeps_the_verbs_contract() {
    let Some((a, b)) = common::pair() else { return };
    assert!(!a.caps().iommu && a.iommu().is_none());
    if common::on_libnprdma() {
        assert_eq!(a.device_name(), "nprdma0");
    }
    assert!(a.caps().max_inline >= 64, "{:?}", a.caps());
    nprdma::nic::contract::verbs_contract(&a, &b);
    let s = a.stats();
    assert_eq!((s.live_mrs, s.reg_failures), (0, 0), "{s:?}");
    assert!(s.regs >= 1 && s.deregs == s.regs, "{s:?}");
}

#[test]
fn owned_buffers_are_zeroed_registered_and_freed() {
    let Some((a, _b)) = common::pair() else {
        return;
    };
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let buf = a.alloc_buf(5000, acc | Access::ANY_QP).expect("buf");
    assert_eq!(buf.len(), 5000);
    let mut z = vec![1u8; 5000];
    buf.read(0, &mut z);
    assert!(z.iter().all(|&x| x == 0));
    assert_eq!(buf.sge(8, 16).lkey, buf.lkey());
    assert_eq!(a.stats().live_mrs, 1);
    drop(buf);
    assert_eq!(a.stats().live_mrs, 0);
    assert!(a.alloc_buf(0, acc).is_err());
}

#[test]
fn a_device_lacking_what_the_backend_needs_is_refused_at_open() {
    let Some(lib) = common::lib_path() else {
        return;
    };
    let base = common::config(&lib);
    let refused = |cfg: Config, what: &str| {
        let e = VerbsNic::open(&cfg).expect_err("refused");
        let msg = e.to_string();
        assert!(matches!(e, Error::Unsupported { .. }), "{msg}");
        assert!(msg.contains(what), "{msg}");
        println!("refused as expected: {msg}");
    };
    refused(
        Config {
            min_qp_wr: u32::MAX,
            ..base.clone()
        },
        "max_qp_wr",
    );
    refused(
        Config {
            min_sge: u32::MAX,
            ..base.clone()
        },
        "max_sge",
    );
    refused(
        Config {
            min_cqe: u32::MAX,
            ..base.clone()
        },
        "max_cqe",
    );
    refused(
        Config {
            port: 9,
            ..base.clone()
        },
        "no port 9",
    );
    let e = VerbsNic::open(&Config {
        device: Some("mlx5_42".into()),
        ..base.clone()
    })
    .expect_err("no such device");
    assert!(e.to_string().contains("mlx5_42"), "{e}");
    let e = VerbsNic::open(&Config {
        lib: Some("/nonexistent/libibverbs.so.1".into()),
        ..base
    })
    .expect_err("no library");
    assert!(matches!(e, Error::Load { .. }), "{e}");
}

#[test]
fn a_failed_registration_is_an_error_and_leaks_nothing() {
    let Some((a, _b)) = common::pair() else {
        return;
    };
    // More than RLIMIT_MEMLOCK allows (pinned mode charges like ib_umem_get)
    // from a thread without CAP_IPC_LOCK (capabilities are per thread: this
    // test's thread only drops it from its effective set).
    drop_ipc_lock_in_this_thread();
    let mut big = vec![0u8; 1 << 16];
    // SAFETY: a huge length over a small vector: must be refused, never used.
    let r = unsafe { a.reg_mr(big.as_mut_ptr() as u64, 1 << 40, Access::LOCAL_WRITE) };
    let e = r.expect_err("a registration beyond RLIMIT_MEMLOCK fails");
    println!("refused as expected: {e}");
    assert!(
        matches!(
            e,
            Error::Verb {
                verb: "ibv_reg_mr",
                ..
            }
        ),
        "{e}"
    );
    let s = a.stats();
    assert_eq!((s.regs, s.reg_failures, s.live_mrs), (0, 1, 0), "{s:?}");
    // The NIC still registers afterwards.
    // SAFETY: `big` outlives the MR (dropped at once).
    let mr =
        unsafe { a.reg_mr(big.as_mut_ptr() as u64, 1 << 16, Access::LOCAL_WRITE) }.expect("mr");
    assert_eq!(mr.len(), 1 << 16);
    drop(mr);
    assert_eq!(a.stats().live_mrs, 0);
}

/// Clear CAP_IPC_LOCK from the calling thread's effective capabilities.
fn drop_ipc_lock_in_this_thread() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const V3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut h = Header {
        version: V3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, this thread.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()), 0);
        d[0].effective &= !(1 << CAP_IPC_LOCK);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()), 0);
    }
}
