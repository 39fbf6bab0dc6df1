//! The software NIC configuration of the CLI's hosts: rnic's defaults (target-enforced
//! protection between processes), or the labelled opt-in to the direct path between
//! trusting processes with `NPRDMA_TRUSTED_PEERS=1` (as in `libnprdma.so`).

/// Ring-slot size with target-enforced protection: every payload crosses in parts of
/// this size, so larger parts mean fewer requests per byte (`BENCHMARKS.md`, "target-
/// enforced protection").
pub const SECURE_RING_MAX: u32 = 64 * 1024;

/// rnic's default host configuration, with `trusted_peers` from `NPRDMA_TRUSTED_PEERS`
/// (and [`SECURE_RING_MAX`]-byte ring slots when peers are not trusted).
pub fn host_config() -> rnic::HostConfig {
    let trusted_peers = trusted_peers();
    let d = rnic::HostConfig::default();
    rnic::HostConfig {
        trusted_peers,
        ring_max: if trusted_peers {
            d.ring_max
        } else {
            SECURE_RING_MAX
        },
        ..d
    }
}

/// Whether `NPRDMA_TRUSTED_PEERS` is set to a non-zero number.
pub fn trusted_peers() -> bool {
    std::env::var("NPRDMA_TRUSTED_PEERS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|v| v != 0)
}
