//! Adapters of the narrow [`crate::nic`] traits to the project's concrete
//! crates: the software RNIC's verbs ([`RnicNic`], [`RnicQp`], [`RnicCq`],
//! in `verbs`), its host IOMMU + frame map ([`RnicIommu`]) and the `vmem`
//! pager ([`VmemMm`], [`ListenerBridge`]).

use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};

use crate::nic::{self, Access, Frame, IommuControl, MemoryManager, NicMr};

mod verbs;
pub use verbs::{completion, RnicBuf, RnicCq, RnicNic, RnicQp};

/// The IOMMU-control capability of one `rnic` host.
pub struct RnicIommu {
    host: rnic::Host,
    pd: rnic::Pd,
}

impl RnicIommu {
    /// Control over `host`'s IOMMU; MRs made through it belong to `pd`.
    pub fn new(host: rnic::Host, pd: rnic::Pd) -> Self {
        RnicIommu { host, pd }
    }
}

/// An `rnic` MR seen through [`NicMr`].
pub struct RnicMr(pub rnic::Mr);

impl NicMr for RnicMr {
    #[inline]
    fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    #[inline]
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
    #[inline]
    fn addr(&self) -> u64 {
        self.0.addr() as u64
    }
    #[inline]
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

/// `nic::WrOp` → `rnic::WrOpcode`: the one place the engine's verbs
/// vocabulary meets the software NIC's (the same operations and operands).
#[inline]
pub fn rnic_opcode(op: nic::WrOp) -> rnic::WrOpcode {
    match op {
        nic::WrOp::Write => rnic::WrOpcode::Write,
        nic::WrOp::WriteImm(i) => rnic::WrOpcode::WriteImm(i),
        nic::WrOp::Send => rnic::WrOpcode::Send,
        nic::WrOp::SendImm(i) => rnic::WrOpcode::SendImm(i),
        nic::WrOp::Read => rnic::WrOpcode::Read,
        nic::WrOp::CmpSwap { compare, swap } => rnic::WrOpcode::CmpSwap { compare, swap },
        nic::WrOp::FetchAdd { add } => rnic::WrOpcode::FetchAdd { add },
    }
}

/// `rnic::WcStatus` → `nic::WcStatus` (same `ibv_wc_status` numbering).
pub fn nic_wc_status(s: rnic::WcStatus) -> nic::WcStatus {
    nic::WcStatus::from_code(s as u32)
}

/// `nic::Access` → `rnic::Access` (same ibverbs numbering).
pub fn rnic_access(a: Access) -> rnic::Access {
    rnic::Access::from_bits_truncate(a.0)
}

impl IommuControl for RnicIommu {
    type Error = rnic::Error;
    type Range = rnic::IovaRange;
    type Mr = RnicMr;
    const ENTRY_BYTES: usize = rnic::Iommu::ENTRY_BYTES;

    fn alloc_range(&self, npages: u64) -> Result<Self::Range, Self::Error> {
        self.host.iommu().alloc_range(npages)
    }
    fn free_range(&self, range: Self::Range) -> Result<(), Self::Error> {
        self.host.iommu().free_range(range)
    }
    fn map(&self, range: &Self::Range, index: u64, frame: Frame) -> Result<(), Self::Error> {
        let f = match frame {
            Frame::Unmapped => rnic::Frame::Unmapped,
            Frame::Ram(a) => rnic::Frame::Ram(a as usize),
            Frame::Signature => rnic::Frame::Signature,
            Frame::BlackHole => rnic::Frame::BlackHole,
        };
        #[allow(unsafe_code)]
        // SAFETY: NP-RDMA maps `Ram` only for pages of a registered
        // application MR (which must stay mapped while registered, the
        // contract of `Pd::reg_mr`), and only after the page was pinned
        // resident; the swap listener remaps it to a special frame and
        // flushes before the pager may reclaim it.
        unsafe {
            self.host.iommu().map_at(range, index, f)
        }
    }
    fn flush(&self) -> Result<(), Self::Error> {
        self.host.iommu().flush()
    }
    fn test_and_clear_young(&self, range: &Self::Range, index: u64) -> Result<bool, Self::Error> {
        self.host.iommu().test_and_clear_young(range, index)
    }
    fn set_mr_rights(
        &self,
        mr: &mut RnicMr,
        access: Access,
        domain: u32,
    ) -> Result<(), Self::Error> {
        mr.0.set_rights(rnic_access(access), domain)
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        range: &Self::Range,
        domain: u32,
    ) -> Result<Self::Mr, Self::Error> {
        // SAFETY: forwarded contract (memory stays mapped while the MR exists).
        unsafe {
            self.pd
                .reg_mr_iova_in_domain(
                    addr as usize,
                    len as usize,
                    rnic_access(access),
                    range,
                    domain,
                )
                .map(RnicMr)
        }
    }
    fn set_resident(&self, addr: u64, len: u64, resident: bool) -> Result<(), Self::Error> {
        self.host
            .frames()
            .set_resident(addr as usize, len as usize, resident);
        Ok(())
    }
    fn track_frames(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.host.frames().track(addr as usize, len as usize, false)
    }
    fn untrack_frames(&self, addr: u64) -> Result<(), Self::Error> {
        self.host.frames().untrack(addr as usize)
    }
}

/// The `vmem` pager as a [`MemoryManager`] (a cheap clone of the handle).
#[derive(Clone)]
pub struct VmemMm(pub vmem::Pager);

impl std::fmt::Debug for VmemMm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VmemMm")
    }
}

impl MemoryManager for VmemMm {
    type Error = vmem::Error;
    fn page_size(&self) -> usize {
        vmem::PAGE_SIZE
    }
    fn is_resident(&self, addr: u64) -> bool {
        self.0.is_resident(addr as usize)
    }
    fn residency(&self, addr: u64, len: u64, out: &mut Vec<bool>) -> Result<(), Self::Error> {
        out.extend(self.0.resident(addr as usize, len as usize)?);
        Ok(())
    }
    fn pin(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.0.pin(addr as usize, len as usize)
    }
    fn pin_read(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.0.pin_read(addr as usize, len as usize)
    }
    fn unpin(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.0.unpin(addr as usize, len as usize)
    }
    fn poll_own_reads(&self, on: bool) {
        vmem::poll_swap_reads(on);
    }
    fn add_swap_listener(&self, l: Arc<dyn nic::SwapListener>) -> nic::ListenerId {
        nic::ListenerId(self.0.add_listener(Arc::new(ListenerBridge(l))).0)
    }
    fn remove_swap_listener(&self, id: nic::ListenerId) {
        self.0.remove_listener(vmem::ListenerId(id.0));
    }
}

/// pagemap entry bits: page present / swapped (by the kernel).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAP: u64 = 1 << 62;

/// For each of the `npages` pages from page-aligned `first`: whether the
/// kernel's page table has neither a page nor a (kernel) swap entry for it
/// (`/proc/self/pagemap`), i.e. the page was never populated or was dropped.
/// All `false` if pagemap cannot be read. One `pread` per 8192 pages
/// (≈ 1–2 ms per GiB of registration).
pub fn unpopulated_pages(first: u64, npages: u64) -> Vec<bool> {
    let mut out = vec![false; npages as usize];
    if !scan_unpopulated(first, npages, |i, u| out[i as usize] = u) {
        out.fill(false);
    }
    out
}

/// [`unpopulated_pages`] as [`PageRuns`] (at most [`PageRuns::MAX_RUNS`]
/// runs: pages of later runs count as populated). Nothing per page.
pub fn unpopulated_runs(first: u64, npages: u64) -> PageRuns {
    let mut b = PageRuns::builder();
    if scan_unpopulated(first, npages, |i, u| b.push(i, u)) {
        b.finish()
    } else {
        PageRuns::default()
    }
}

/// Calls `f(i, unpopulated)` for page `i` of the `npages` from `first`, in
/// order; false if pagemap could not be read (some calls may have been made).
fn scan_unpopulated(first: u64, npages: u64, mut f: impl FnMut(u64, bool)) -> bool {
    const CHUNK: u64 = 8192;
    let ps = vmem::PAGE_SIZE as u64;
    let Some(pm) = pagemap() else { return false };
    let mut buf = vec![0u8; (npages.min(CHUNK) * 8) as usize];
    let mut done = 0u64;
    while done < npages {
        let n = (npages - done).min(CHUNK) as usize;
        let page = first / ps + done;
        if pm.read_exact_at(&mut buf[..n * 8], page * 8).is_err() {
            return false;
        }
        for (k, e) in buf[..n * 8].chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
            f(done + k as u64, v & (PM_PRESENT | PM_SWAP) == 0);
        }
        done += n as u64;
    }
    true
}

/// A set of page indices as sorted, disjoint runs `[start, end)`, bounded to
/// [`PageRuns::MAX_RUNS`] runs so it costs nothing per page: a set more
/// fragmented than that keeps only its first runs (callers use it for
/// "provably X" shortcuts, where leaving a page out is always safe).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRuns(Box<[(u64, u64)]>);

/// Builds [`PageRuns`] from per-page flags given for consecutive indices.
#[derive(Debug, Default)]
pub struct PageRunsBuilder {
    runs: Vec<(u64, u64)>,
    open: Option<u64>,
    next: u64,
}

impl PageRunsBuilder {
    /// Whether page `i` (the one after the previous call's) is in the set.
    pub fn push(&mut self, i: u64, member: bool) {
        debug_assert_eq!(i, self.next, "consecutive pages");
        match (self.open, member) {
            (None, true) if self.runs.len() < PageRuns::MAX_RUNS => self.open = Some(i),
            (Some(s), false) => {
                self.runs.push((s, i));
                self.open = None;
            }
            _ => {}
        }
        self.next = i + 1;
    }
    /// The set.
    pub fn finish(mut self) -> PageRuns {
        if let Some(s) = self.open {
            self.runs.push((s, self.next));
        }
        PageRuns(self.runs.into_boxed_slice())
    }
}

impl PageRuns {
    /// Most runs kept (16 B each).
    pub const MAX_RUNS: usize = 1024;
    /// An empty builder.
    pub fn builder() -> PageRunsBuilder {
        PageRunsBuilder::default()
    }
    /// The set of the pages `flags` marks, page `i` = `flags[i]`.
    pub fn from_flags(flags: impl IntoIterator<Item = bool>) -> PageRuns {
        let mut b = Self::builder();
        for (i, f) in flags.into_iter().enumerate() {
            b.push(i as u64, f);
        }
        b.finish()
    }
    /// Whether page `i` is in the set.
    pub fn contains(&self, i: u64) -> bool {
        let k = self.0.partition_point(|&(s, _)| s <= i);
        k > 0 && i < self.0[k - 1].1
    }
    /// The runs `[start, end)`, sorted.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.0
    }
}

/// `/proc/self/pagemap`, opened once (`None` if unavailable: no zero proofs).
fn pagemap() -> Option<&'static std::fs::File> {
    static PM: OnceLock<Option<std::fs::File>> = OnceLock::new();
    PM.get_or_init(|| std::fs::File::open("/proc/self/pagemap").ok())
        .as_ref()
}

/// Forwards `vmem` swap notifications to an NP-RDMA [`nic::SwapListener`].
pub struct ListenerBridge(pub Arc<dyn nic::SwapListener>);

impl vmem::SwapListener for ListenerBridge {
    fn before_swap_out(&self, pages: &[usize]) -> bool {
        let p: Vec<u64> = pages.iter().map(|&a| a as u64).collect();
        self.0.before_swap_out(&p)
    }
    fn after_swap_in(&self, pages: &[usize]) {
        let p: Vec<u64> = pages.iter().map(|&a| a as u64).collect();
        self.0.after_swap_in(&p);
    }
    fn test_and_clear_young(&self, pages: &[usize], young: &mut [bool]) {
        let p: Vec<u64> = pages.iter().map(|&a| a as u64).collect();
        self.0.test_and_clear_young(&p, young);
    }
    fn after_unmap(&self, start: usize, end: usize) {
        self.0.after_unmap(start as u64, end as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::{nic_wc_status, rnic_opcode, PageRuns};
    use crate::nic::WrOp;

    #[test]
    fn opcodes_map_one_to_one_with_their_operands() {
        let pairs = [
            (WrOp::Write, rnic::WrOpcode::Write),
            (WrOp::WriteImm(7), rnic::WrOpcode::WriteImm(7)),
            (WrOp::Send, rnic::WrOpcode::Send),
            (WrOp::SendImm(8), rnic::WrOpcode::SendImm(8)),
            (WrOp::Read, rnic::WrOpcode::Read),
            (
                WrOp::CmpSwap {
                    compare: 1,
                    swap: 2,
                },
                rnic::WrOpcode::CmpSwap {
                    compare: 1,
                    swap: 2,
                },
            ),
            (
                WrOp::FetchAdd { add: 3 },
                rnic::WrOpcode::FetchAdd { add: 3 },
            ),
        ];
        for (n, r) in pairs {
            assert_eq!(rnic_opcode(n), r);
        }
    }

    #[test]
    fn rnic_statuses_keep_their_number() {
        for code in 0..22 {
            let s = rnic::WcStatus::from_u32(code);
            assert_eq!(nic_wc_status(s).code(), s as u32);
        }
    }

    #[test]
    fn page_runs_match_their_flags() {
        let flags = [true, true, false, true, false, false, true, true, true];
        let r = PageRuns::from_flags(flags);
        assert_eq!(r.runs(), [(0, 2), (3, 4), (6, 9)]);
        for (i, f) in flags.iter().enumerate() {
            assert_eq!(r.contains(i as u64), *f, "page {i}");
        }
        assert!(!r.contains(9));
        assert_eq!(PageRuns::from_flags([false; 5]).runs(), []);
    }

    #[test]
    fn page_runs_are_bounded_and_only_ever_drop_members() {
        // Alternating pages: one run per member, more than the cap.
        let n = 4 * PageRuns::MAX_RUNS;
        let r = PageRuns::from_flags((0..n).map(|i| i % 2 == 0));
        assert_eq!(r.runs().len(), PageRuns::MAX_RUNS);
        assert!((0..n as u64).all(|i| !r.contains(i) || i % 2 == 0));
        assert!(r.contains(0) && !r.contains(n as u64 - 2));
    }
}
