//! Host (NIC + IOMMU) configuration and its defaults.

use std::time::Duration;

/// Configuration of one simulated host: NIC limits, IOMMU size, NIC-thread policy.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Max TLP (DMA atom) size in bytes; power of two, 64..=4096.
    pub max_tlp: usize,
    /// Signature-page magic word.
    pub magic: u32,
    /// QP table size.
    pub max_qp: u32,
    /// MR table size.
    pub max_mr: u32,
    /// CQ table size.
    pub max_cq: u32,
    /// Max CQ depth.
    pub max_cqe: u32,
    /// Max WRs per send/recv queue.
    pub max_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// IOVA pages of the IOMMU page table (4 KiB each).
    pub iova_pages: u64,
    /// Max tracked residency ranges and total tracked pages.
    pub max_tracked_ranges: u32,
    /// Pages the residency map (`FrameMap`) can track.
    pub max_tracked_pages: u64,
    /// How long the NIC thread keeps spinning after its last piece of work.
    pub nic_spin: Duration,
    /// Outstanding READs/atomics per QP served by the target's NIC thread (ring slots).
    pub ring_slots: u32,
    /// Size of a ring slot's data area (bytes, default 64 KiB): with target-enforced
    /// protection the part size of every cross-process payload (at least 4 KiB; 64 KiB
    /// parts move 12x the bytes per request of 4 KiB ones, BENCHMARKS.md); between
    /// trusting hosts it bounds the READ/WRITE served through the target's NIC thread
    /// ring and the jobs of shared large copies (24 B per 128 KiB unit). Atomics never
    /// use it and always go through the ring. Each QP's ring takes `ring_slots` slots
    /// of the mailbox memfd (sparse: untouched slots cost no memory).
    pub ring_max: u32,
    /// Between trusting hosts, the largest READ/WRITE served through the target's NIC
    /// thread ring, if lower than `ring_max` (default 4 KiB, what it was when
    /// `ring_max` defaulted to 4 KiB; `None`: `ring_max`). Target-enforced protection
    /// ignores it (every op goes through the ring). `Some(0)` sends every
    /// READ/WRITE direct (process_vm across processes) while atomics still go through
    /// the ring and large copies can still be shared with the NIC thread.
    pub ring_rw_max: Option<u32>,
    /// Route small ops through the target NIC thread even in-process (tests the
    /// cross-process path inside one process).
    pub inproc_ring: bool,
    /// Split large cross-process READ/WRITE with the target's NIC thread (two cores copy).
    pub dma_help: bool,
    /// Bytes copied per IOMMU epoch section (bounds how long a flush waits).
    pub dma_section: usize,
    /// Transport timeout for requests served by a remote NIC thread.
    pub transport_timeout: Duration,
    /// The RNR back-off of `min_rnr_timer` code 1 (IB: 10 µs); the other codes scale
    /// with it (IB's table, `verbs::rnr_timer`).
    pub rnr_delay: Duration,
    /// ODP model: how long an initiator waits after a remote page-fault NAK before it
    /// retransmits (go-back-N). ConnectX-5 is reported at ~2 ms.
    pub odp_timeout: Duration,
    /// Trust peers in other processes with this process's memory (labelled opt-in,
    /// `false` by default). Off (the default, **target-enforced protection**): a peer
    /// never touches this process's memory or NIC state; every request of a peer
    /// (READ/WRITE of any size in slot-sized parts, atomics, SEND, WRITE_WITH_IMM) goes
    /// through the target QP's request ring and is checked (QP, rkey, bounds, rights,
    /// liveness) and executed by this host's own NIC thread (or the thread serving its
    /// rings), no `PR_SET_PTRACER_ANY`, no `process_vm_*`, no `pidfd_getfd`. On: the old,
    /// faster path between two trusting hosts — the initiator copies into the target
    /// itself with `process_vm_readv/writev` after checking the target's tables (and
    /// this process allows any process to ptrace it). Direct copies happen only when
    /// *both* hosts trust.
    pub trusted_peers: bool,
    /// Size of the host's NIC-shared DMA pool ([`crate::Host::alloc_dma_buffer`]):
    /// address space reserved in a sealed memfd that peers map too; pages are
    /// allocated (populated and mlocked) only per buffer. 0 = no pool.
    pub dma_pool_size: usize,
    /// Join the host's subnet ([`crate::subnet`]) through the registry at this path: the
    /// device takes a LID, its QP numbers come from the LID's range, and peers find it
    /// by LID or by one of `gids` with a QP number of that range. `None`: no LID
    /// (QP numbers from 0x100).
    pub subnet: Option<std::path::PathBuf>,
    /// The GIDs the device answers to besides its address (published with its LID).
    pub gids: Vec<[u8; 16]>,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            max_tlp: 256,
            magic: 0xdead_beef,
            max_qp: 256,
            max_mr: 4096,
            max_cq: 256,
            max_cqe: 65536,
            max_wr: 4096,
            max_sge: 16,
            max_inline: 1024,
            iova_pages: 1 << 20,
            max_tracked_ranges: 64,
            max_tracked_pages: 1 << 23,
            nic_spin: Duration::from_micros(100),
            ring_slots: 16,
            ring_max: 64 * 1024,
            ring_rw_max: Some(4096),
            inproc_ring: false,
            dma_help: true,
            dma_section: 1 << 20,
            transport_timeout: Duration::from_secs(2),
            rnr_delay: Duration::from_micros(10),
            odp_timeout: Duration::from_millis(2),
            dma_pool_size: 64 << 20,
            trusted_peers: false,
            subnet: None,
            gids: Vec::new(),
        }
    }
}

/// Smallest ring-slot data area with target-enforced protection (every cross-process
/// payload travels through the slots, in parts of this size).
pub const MIN_SECURE_RING_MAX: usize = 4096;

impl HostConfig {
    /// Raise `ring_max` to the minimum target-enforced protection needs (callers that
    /// shrink the ring for the trusted direct path use this when peers are not trusted).
    pub fn secure_ring_max(mut self) -> Self {
        if !self.trusted_peers {
            self.ring_max = self.ring_max.max(MIN_SECURE_RING_MAX as u32);
        }
        self
    }

    pub(crate) fn validate(&self) -> crate::error::Result<()> {
        use crate::error::Error::InvalidArgument as E;
        if !self.max_tlp.is_power_of_two() || !(64..=4096).contains(&self.max_tlp) {
            return Err(E("max_tlp must be a power of two in 64..=4096"));
        }
        if self.max_qp == 0 || self.max_qp > 1 << 16 {
            return Err(E("max_qp"));
        }
        if self.max_mr == 0 || self.max_mr > 1 << 23 {
            return Err(E("max_mr"));
        }
        if self.max_cq == 0 || self.max_cqe == 0 || self.max_wr == 0 || self.max_sge == 0 {
            return Err(E("zero limit"));
        }
        if self.max_sge > 64 || self.ring_slots == 0 || self.ring_slots > 1024 {
            return Err(E("max_sge/ring_slots"));
        }
        if self.ring_max as usize > 1 << 20 || self.max_inline as usize > 1 << 16 {
            return Err(E("ring_max/max_inline"));
        }
        if self.dma_section < self.max_tlp {
            return Err(E("dma_section"));
        }
        if !self.trusted_peers && (self.ring_max as usize) < MIN_SECURE_RING_MAX {
            return Err(E("ring_max: target-enforced protection carries data in ring slots of at least 4 KiB (see HostConfig::secure_ring_max)"));
        }
        Ok(())
    }
}
