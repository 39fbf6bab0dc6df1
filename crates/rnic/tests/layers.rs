//! The layering of `rnic`'s source files (ARCHITECTURE.md, "The software NIC's files"):
//! the bottom files (`sys`, `fault_guard`, `verbs`, `error`, `config`) <- the device (`hw/`) <- the
//! engines (`nic/`) <- the handles (`objects/`) <- `lib.rs`.
//!
//! Every file under `src/` is listed in [`ORDER`], bottom first, and may name (a
//! `crate::` path in its code; comments and `#[cfg(test)] mod` blocks are not looked
//! at) only files listed before it. So no layer imports one above it, and within a
//! layer the files form a tower: no circles. Only `lib.rs` may use the crate root's
//! re-exports (`crate::Host`, `crate::Error`, ...): everywhere else a path names its
//! module, so a file below the handles cannot name `Host`, `Pd`, `Cq` or `Qp` without
//! naming `objects`. Code outside test modules may not use `super::` paths either.
//!
//! A new file must be added to [`ORDER`] at its place; this test fails until it is.

/// The layers, bottom first, and in each its files, bottom first (paths under `src/`
/// without `.rs`).
const ORDER: &[(&str, &[&str])] = &[
    ("bottom", &["sys", "fault_guard", "verbs", "error", "config", "subnet"]),
    (
        "hw",
        &[
            "hw/mod",
            "hw/scratch",
            "hw/segment",
            "hw/iommu",
            "hw/frames",
            "hw/dma",
            "hw/peer",
            "hw/device",
            "hw/dma_pool",
        ],
    ),
    (
        "nic",
        &[
            "nic/mod",
            "nic/small",
            "nic/inbound",
            "nic/odp",
            "nic/state",
            "nic/cq_ring",
            "nic/qp_ctx",
            "nic/responder",
            "nic/requester",
            "nic/completer",
            "nic/sq",
            "nic/thread",
        ],
    ),
    (
        "wire",
        &[
            "wire/mod",
            "wire/socket",
            "wire/inject",
            "wire/conn",
            "wire/tx",
            "wire/rx",
            "wire/engine",
        ],
    ),
    (
        "objects",
        &[
            "objects/mod",
            "objects/context",
            "objects/dma_buffer",
            "objects/pd",
            "objects/mr",
            "objects/cq",
            "objects/srq",
            "objects/qp",
            "objects/ah",
        ],
    ),
    ("root", &["lib"]),
];

/// Directories of the layers (a `crate::<dir>::<file>` path names `<dir>/<file>.rs`).
const DIRS: &[&str] = &["hw", "nic", "wire", "objects"];

#[test]
fn no_file_imports_one_above_it() {
    layers::check(env!("CARGO_MANIFEST_DIR"), ORDER, DIRS, 100);
}
