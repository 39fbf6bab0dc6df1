//! The layering of `roce`'s source files: the bottom files (`error`, `field`, `checksum`)
//! <- the transport headers (`opcode`, `bth`, the extension headers, `exts`) <- the IP/UDP
//! framing and the ICRC <- `packet` <- `lib.rs`.
//!
//! Every file under `src/` is listed in [`ORDER`], bottom first, and may name (a
//! `crate::` path in its code; comments and `#[cfg(test)] mod` blocks are not looked
//! at) only files listed before it. So no layer imports one above it, and within a
//! layer the files form a tower: no circles. Only `lib.rs` may use the crate root's
//! re-exports (`crate::Error`, `crate::Repr`, ...): everywhere else a path names its
//! module. Code outside test modules may not use `super::` paths either.
//!
//! A new file must be added to [`ORDER`] at its place; this test fails until it is.
//! (The scanner is the `layers` crate's, shared by every crate's `tests/layers.rs`.)

/// The layers, bottom first, and in each its files, bottom first (paths under `src/`
/// without `.rs`).
const ORDER: &[(&str, &[&str])] = &[
    ("bottom", &["error", "field", "checksum"]),
    (
        "transport",
        &[
            "opcode",
            "bth",
            "reth",
            "aeth",
            "atomic_eth",
            "atomic_ack_eth",
            "deth",
            "immdt",
            "ieth",
            "exts",
        ],
    ),
    ("framing", &["ipv4", "ipv6", "ip", "udp", "icrc"]),
    ("packet", &["packet"]),
    ("root", &["lib"]),
];

/// Directories of the layers (a `crate::<dir>::<file>` path names `<dir>/<file>.rs`):
/// none, this crate's files are flat.
const DIRS: &[&str] = &[];

#[test]
fn no_file_imports_one_above_it() {
    layers::check(env!("CARGO_MANIFEST_DIR"), ORDER, DIRS, 40);
}
