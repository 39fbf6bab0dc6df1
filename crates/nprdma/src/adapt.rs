//! Adapters of the narrow [`crate::nic`] traits to the project's concrete
//! crates: the software RNIC's host IOMMU + frame map ([`RnicIommu`]) and
//! the `vmem` pager ([`VmemMm`], [`ListenerBridge`]).

use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};

use crate::nic::{self, Access, Frame, IommuControl, MemoryManager, NicMr};

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
    fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
    fn addr(&self) -> u64 {
        self.0.addr() as u64
    }
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

/// `nic::Access` → `rnic::Access` (same ibverbs numbering).
pub fn rnic_access(a: Access) -> rnic::Access {
    rnic::Access::from_bits_truncate(a.0)
}

impl IommuControl for RnicIommu {
    type Error = rnic::Error;
    type Range = rnic::IovaRange;
    type Mr = RnicMr;

    fn alloc_range(&self, npages: u64) -> Result<Self::Range, Self::Error> {
        self.host.iommu().alloc_range(npages)
    }
    fn free_range(&self, range: Self::Range) -> Result<(), Self::Error> {
        self.host.iommu().free_range(range)
    }
    fn map(&self, range: &Self::Range, index: u64, frame: Frame) -> Result<(), Self::Error> {
        if index >= range.npages {
            return Err(rnic::Error::InvalidArgument("IOVA index outside the range"));
        }
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
            self.host.iommu().map(range.base + index, f)
        }
    }
    fn flush(&self) -> Result<(), Self::Error> {
        self.host.iommu().flush()
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        range: &Self::Range,
    ) -> Result<Self::Mr, Self::Error> {
        // SAFETY: forwarded contract (memory stays mapped while the MR exists).
        unsafe {
            self.pd
                .reg_mr_iova(addr as usize, len as usize, rnic_access(access), range)
                .map(RnicMr)
        }
    }
    fn set_resident(&self, addr: u64, len: u64, resident: bool) -> Result<(), Self::Error> {
        self.host
            .frames()
            .set_resident(addr as usize, len as usize, resident);
        Ok(())
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
    fn unpin(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.0.unpin(addr as usize, len as usize)
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
    const CHUNK: u64 = 8192;
    let ps = vmem::PAGE_SIZE as u64;
    let mut out = vec![false; npages as usize];
    let Some(pm) = pagemap() else { return out };
    let mut buf = vec![0u8; (npages.min(CHUNK) * 8) as usize];
    let mut done = 0u64;
    while done < npages {
        let n = (npages - done).min(CHUNK) as usize;
        let page = first / ps + done;
        if pm.read_exact_at(&mut buf[..n * 8], page * 8).is_err() {
            return vec![false; npages as usize];
        }
        for (k, e) in buf[..n * 8].chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
            out[done as usize + k] = v & (PM_PRESENT | PM_SWAP) == 0;
        }
        done += n as u64;
    }
    out
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
    fn before_swap_out(&self, pages: &[usize]) {
        let p: Vec<u64> = pages.iter().map(|&a| a as u64).collect();
        self.0.before_swap_out(&p);
    }
    fn after_swap_in(&self, pages: &[usize]) {
        let p: Vec<u64> = pages.iter().map(|&a| a as u64).collect();
        self.0.after_swap_in(&p);
    }
    fn after_unmap(&self, start: usize, end: usize) {
        self.0.after_unmap(start as u64, end as u64);
    }
}
