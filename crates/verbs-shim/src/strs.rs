//! libibverbs' enum-to-string helpers other than `ibv_wc_status_str` (in
//! `resources`): node types, port states and async event types, with rdma-core's
//! texts (libibverbs/enum_strs.c). UCX's uct_ib imports `ibv_node_type_str` and
//! `ibv_event_type_str`; without them here those calls would reach the real
//! libibverbs that uct_ib's DT_NEEDED loads.

use std::ffi::{c_char, c_int, CStr};

/// `table[v]`, or "unknown" outside it (as rdma-core, for any int the caller passes).
fn lookup(table: &[&'static CStr], v: c_int) -> *const c_char {
    usize::try_from(v)
        .ok()
        .and_then(|i| table.get(i))
        .copied()
        .unwrap_or(c"unknown")
        .as_ptr()
}

/// Indexed by `enum ibv_node_type` (0 is no node type: "unknown").
const NODE_TYPE: [&CStr; 8] = [
    c"unknown",
    c"InfiniBand channel adapter",
    c"InfiniBand switch",
    c"InfiniBand router",
    c"iWARP NIC",
    c"usNIC",
    c"usNIC UDP",
    c"unspecified",
];

#[no_mangle]
pub extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    lookup(&NODE_TYPE, node_type)
}

/// Indexed by `enum ibv_port_state`.
const PORT_STATE: [&CStr; 6] = [
    c"no state change (NOP)",
    c"down",
    c"init",
    c"armed",
    c"active",
    c"active defer",
];

#[no_mangle]
pub extern "C" fn ibv_port_state_str(port_state: c_int) -> *const c_char {
    lookup(&PORT_STATE, port_state)
}

/// Indexed by `enum ibv_event_type`.
const EVENT_TYPE: [&CStr; 20] = [
    c"CQ error",
    c"local work queue catastrophic error",
    c"invalid request local work queue error",
    c"local access violation work queue error",
    c"communication established",
    c"send queue drained",
    c"path migrated",
    c"path migration request error",
    c"local catastrophic error",
    c"port active",
    c"port error",
    c"LID change",
    c"P_Key change",
    c"SM change",
    c"SRQ catastrophic error",
    c"SRQ limit reached",
    c"last WQE reached",
    c"client reregistration",
    c"GID table change",
    c"WQ fatal",
];

#[no_mangle]
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    lookup(&EVENT_TYPE, event)
}
