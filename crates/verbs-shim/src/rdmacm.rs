//! librdmacm entry points perftest's `-R` path calls first: refused with a clear
//! message (connection setup must use the applications' own TCP exchange).

use crate::error::{report, ShimError};
use std::ffi::{c_int, c_void};

fn refuse(verb: &str) {
    report(
        verb,
        &ShimError::Unsupported(
            "rdma_cm is not supported by libnprdma (run without -R / rdma_cm)".into(),
        ),
    );
}

#[no_mangle]
pub extern "C" fn rdma_create_event_channel() -> *mut c_void {
    refuse("rdma_create_event_channel");
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn rdma_create_id(
    _ch: *mut c_void,
    _id: *mut *mut c_void,
    _ctx: *mut c_void,
    _ps: c_int,
) -> c_int {
    refuse("rdma_create_id");
    -1
}

#[no_mangle]
pub extern "C" fn rdma_getaddrinfo(
    _node: *const i8,
    _svc: *const i8,
    _hints: *const c_void,
    _res: *mut *mut c_void,
) -> c_int {
    refuse("rdma_getaddrinfo");
    -1
}
