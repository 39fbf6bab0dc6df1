//! The device state of one host: its configuration, segment, address, IOMMU,
//! frame-residency map, the index allocators of its MR/QP/CQ tables, its resolved
//! peers and the free pages of its DMA pool.

use crate::config::HostConfig;
use crate::hw::frames::FrameMap;
use crate::hw::iommu::{Iommu, RangeAlloc};
use crate::hw::peer::Peer;
use crate::hw::segment::Segment;
use crate::sys;
use crate::verbs::HostAddr;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Simple index allocator with per-index generations.
pub(crate) struct IdxAlloc {
    free: Vec<u32>,
    next: u32,
    max: u32,
    pub gen: Vec<u8>,
}

impl IdxAlloc {
    pub fn new(max: u32) -> Self {
        IdxAlloc {
            free: Vec::new(),
            next: 0,
            max,
            gen: Vec::new(),
        }
    }
    pub fn alloc(&mut self) -> Option<u32> {
        let i = if let Some(i) = self.free.pop() {
            i
        } else if self.next < self.max {
            self.next += 1;
            self.gen.push(0);
            self.next - 1
        } else {
            return None;
        };
        self.gen[i as usize] = self.gen[i as usize].wrapping_add(1);
        Some(i)
    }
    pub fn release(&mut self, i: u32) {
        self.free.push(i);
    }
}

/// The device state of one host (see the module docs).
pub(crate) struct Device {
    pub cfg: HostConfig,
    pub seg: Arc<Segment>,
    pub addr: HostAddr,
    pub iommu: Iommu,
    pub frames: FrameMap,
    pub shutdown: AtomicBool,
    pub mrs: Mutex<IdxAlloc>,
    pub qps: Mutex<IdxAlloc>,
    pub cqs: Mutex<IdxAlloc>,
    pub qpns: Mutex<(u32, std::collections::HashSet<u32>)>,
    /// The QP numbers this device hands out, `[lo, hi)` (its LID's range in a subnet).
    pub qpn_range: (u32, u32),
    /// The port's LID (0: not in a subnet).
    pub lid: u16,
    pub next_pd: AtomicU32,
    pub peers: Mutex<HashMap<u64, Arc<Peer>>>,
    pub self_peer: Arc<Peer>,
    /// Shared large copies are paused until this time (ns): see `dma::Help`.
    pub help_backoff: AtomicU64,
    /// Free pages of the NIC-shared DMA pool (see [`crate::pool`]).
    pub pool: Mutex<RangeAlloc>,
}

impl Device {
    /// The device state of a new host over its freshly created segment.
    pub fn new(cfg: HostConfig, seg: Arc<Segment>, addr: HostAddr, lid: u16) -> Device {
        let qpn_range = if lid == 0 {
            (0x100, 1 << 23)
        } else {
            crate::subnet::qpn_range(lid)
        };
        Device {
            iommu: Iommu::new(
                seg.clone(),
                cfg.transport_timeout.max(std::time::Duration::from_secs(5)),
            ),
            frames: FrameMap::new(seg.clone()),
            self_peer: Arc::new(Peer::local(seg.clone())),
            mrs: Mutex::new(IdxAlloc::new(cfg.max_mr)),
            qps: Mutex::new(IdxAlloc::new(cfg.max_qp)),
            cqs: Mutex::new(IdxAlloc::new(cfg.max_cq)),
            qpns: Mutex::new((qpn_range.0, Default::default())),
            qpn_range,
            lid,
            next_pd: AtomicU32::new(1),
            peers: Mutex::new(HashMap::new()),
            help_backoff: AtomicU64::new(0),
            pool: Mutex::new(RangeAlloc::new(
                0,
                seg.pool_file()
                    .map_or(0, |(_, _, len)| len / crate::hw::segment::PAGE as u64),
            )),
            shutdown: AtomicBool::new(false),
            cfg,
            seg,
            addr,
        }
    }

    /// Make the NIC thread re-evaluate its work (bump its futex word; wake it if it
    /// sleeps). The NIC thread reads the word before scanning, so nothing is lost.
    pub fn kick_nic(&self) {
        let h = self.seg.mbox();
        h.nic_seq.fetch_add(1, Ordering::SeqCst);
        if h.nic_sleeping.load(Ordering::SeqCst) != 0 {
            sys::futex_wake(&h.nic_seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idx_alloc_reuses_with_new_generation() {
        let mut a = IdxAlloc::new(2);
        let (x, y) = (a.alloc().unwrap(), a.alloc().unwrap());
        assert!(a.alloc().is_none());
        let g = a.gen[x as usize];
        a.release(x);
        assert_eq!(a.alloc(), Some(x));
        assert_ne!(a.gen[x as usize], g);
        assert_ne!(x, y);
    }
}
