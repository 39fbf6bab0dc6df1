//! Memory regions: registration on a PD writes an MR table entry (key, PD, access, MTT
//! kind) in the host segment; `Drop` deregisters and waits (IOMMU flush epoch) until no DMA
//! still uses the MR.

use crate::error::{Error, Result};
use crate::hw::dma::{MR_IOVA, MR_PASSTHROUGH};
use crate::hw::iommu::IovaRange;
use crate::hw::segment::{PAGE, PAGE_SHIFT};
use crate::objects::dma_buffer::DmaBuffer;
use crate::objects::pd::Pd;
use crate::verbs::{Access, Sge};
use std::sync::atomic::Ordering;

impl Pd {
    fn reg(&self, addr: usize, len: usize, access: Access, iova: Option<&IovaRange>, domain: u32) -> Result<Mr> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length MR"));
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument("MR wraps the address space"));
        }
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument("REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"));
        }
        if let Some(r) = iova {
            let pages = (((addr + len - 1) >> PAGE_SHIFT) - (addr >> PAGE_SHIFT) + 1) as u64;
            if pages > r.npages || r.base + r.npages > self.host().config().iova_pages {
                return Err(Error::InvalidArgument("IOVA range smaller than the MR"));
            }
            self.host().iommu().check(r)?;
        }
        let hi = self.host().inner();
        let (idx, gen) = {
            let mut a = hi.mrs.lock();
            let i = a.alloc().ok_or(Error::NoResources("MRs"))?;
            (i, a.gen[i as usize])
        };
        let key = ((idx + 1) << 8) | gen as u32;
        let rec = hi.seg.mr(idx).expect("allocated index in range");
        rec.pd.store(self.id(), Ordering::Relaxed);
        rec.access.store(access.bits(), Ordering::Relaxed);
        rec.domain.store(domain, Ordering::Relaxed);
        rec.kind
            .store(if iova.is_some() { MR_IOVA } else { MR_PASSTHROUGH }, Ordering::Relaxed);
        rec.va.store(addr as u64, Ordering::Relaxed);
        rec.len.store(len as u64, Ordering::Relaxed);
        rec.iova_base
            .store(iova.map(|r| r.base).unwrap_or(0), Ordering::Relaxed);
        rec.iova_slot
            .store(iova.map(|r| r.slot).unwrap_or(0), Ordering::Relaxed);
        rec.key.store(key, Ordering::Release);
        Ok(Mr {
            pd: self.clone(),
            idx,
            key,
            addr,
            len,
            access,
        })
    }

    /// Register `[addr, addr+len)` as a standard MR: identity MTT, IOMMU passthrough.
    ///
    /// # Safety
    /// The memory must stay valid (mapped) while the MR is registered; the NIC may read
    /// or write it (per `access`) at any time until the `Mr` is dropped.
    pub unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Mr> {
        self.reg(addr, len, access, None, 0)
    }

    /// [`Pd::reg_mr`] in protection sub-domain `domain` (nonzero: of the QPs of this
    /// PD only those set to the same domain reach it with its rkey; see
    /// [`Pd::reg_mr_iova_in_domain`]).
    ///
    /// # Safety
    /// As [`Pd::reg_mr`].
    pub unsafe fn reg_mr_in_domain(&self, addr: usize, len: usize, access: Access, domain: u32) -> Result<Mr> {
        self.reg(addr, len, access, None, domain)
    }

    /// Register `[addr, addr+len)` with its MTT going through IOVA range `range`:
    /// MR page i -> IOVA page `range.base + i` -> IOMMU -> frame.
    ///
    /// # Safety
    /// The NIC touches whatever frames the IOMMU maps (see `Iommu::map`'s contract).
    pub unsafe fn reg_mr_iova(&self, addr: usize, len: usize, access: Access, range: &IovaRange) -> Result<Mr> {
        self.reg(addr, len, access, Some(range), 0)
    }

    /// [`Pd::reg_mr_iova`] in protection sub-domain `domain` (nonzero): of the QPs
    /// of this PD, only those set to the same domain ([`Qp::set_domain`]) reach it
    /// with its rkey, as if it were registered in a PD of its own.
    ///
    /// # Safety
    /// As [`Pd::reg_mr_iova`].
    ///
    /// [`Qp::set_domain`]: crate::qp::Qp::set_domain
    pub unsafe fn reg_mr_iova_in_domain(
        &self,
        addr: usize,
        len: usize,
        access: Access,
        range: &IovaRange,
        domain: u32,
    ) -> Result<Mr> {
        self.reg(addr, len, access, Some(range), domain)
    }

    /// Register an owned buffer (safe: the MR keeps the buffer alive).
    pub fn reg_mr_owned(&self, buf: Vec<u8>, access: Access) -> Result<OwnedMr> {
        let len = buf.len();
        let ptr = Box::into_raw(buf.into_boxed_slice()) as *mut u8;
        // SAFETY: the heap memory is owned by the returned OwnedMr and freed only in its
        // Drop, after the Mr has been deregistered (and in-flight DMA flushed).
        match unsafe { self.reg_mr(ptr as usize, len, access) } {
            Ok(mr) => Ok(OwnedMr { mr: Some(mr), ptr, len }),
            Err(e) => {
                // SAFETY: ptr/len came from Box::into_raw above and were never shared.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) });
                Err(e)
            }
        }
    }

    /// Register a NIC-shared DMA pool buffer (safe: the returned [`DmaMr`] owns the
    /// buffer and deregisters before freeing it).
    pub fn reg_dma_buffer(&self, buf: DmaBuffer, access: Access) -> Result<DmaMr> {
        // SAFETY: the buffer moves into the DmaMr, whose field order drops the MR
        // (deregistration + flush) before the buffer.
        let mr = unsafe { self.reg_mr(buf.addr(), buf.len(), access)? };
        Ok(DmaMr { mr, buf })
    }
}

/// A registered memory region. Dropping it deregisters it (waits for in-flight DMA).
pub struct Mr {
    pd: Pd,
    idx: u32,
    key: u32,
    addr: usize,
    len: usize,
    access: Access,
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Registered address.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Registered length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.access
    }
    /// The PD.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }
    /// `ibv_rereg_mr`: move the MR to PD `pd`, to the range `[addr, addr+len)`
    /// (`range`), to `access` — each if given — keeping its keys. Like deregistration,
    /// it first fences the NIC off the old registration (no DMA under the old
    /// translation or rights after it returns), then publishes the new one. Invalid
    /// input changes nothing.
    ///
    /// # Safety
    /// A new range must stay mapped while registered (as for [`Pd::reg_mr`]).
    pub unsafe fn rereg(
        &mut self,
        pd: Option<&Pd>,
        range: Option<(usize, usize)>,
        access: Option<Access>,
    ) -> Result<()> {
        let hi = self.pd.host().inner().clone();
        let rec = hi.seg.mr(self.idx).expect("own MR entry");
        if rec.kind.load(Ordering::Relaxed) != MR_PASSTHROUGH && range.is_some() {
            return Err(Error::InvalidArgument("an IOVA-mapped MR keeps its translation"));
        }
        if let Some(p) = pd {
            if p.host().addr() != self.pd.host().addr() {
                return Err(Error::InvalidArgument("PD of another host"));
            }
        }
        if let Some((addr, len)) = range {
            if len == 0 {
                return Err(Error::InvalidArgument("zero-length MR"));
            }
            if addr.checked_add(len).is_none() {
                return Err(Error::InvalidArgument("MR wraps the address space"));
            }
        }
        let acc = access.unwrap_or(self.access);
        if acc.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) && !acc.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument("REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"));
        }
        // Fence: the key stops resolving, and the DMA already inside finishes.
        rec.key.store(0, Ordering::Release);
        let flushed = hi.iommu.flush();
        if let Some(p) = pd {
            rec.pd.store(p.id(), Ordering::Relaxed);
            self.pd = p.clone();
        }
        if let Some((addr, len)) = range {
            rec.va.store(addr as u64, Ordering::Relaxed);
            rec.len.store(len as u64, Ordering::Relaxed);
            self.addr = addr;
            self.len = len;
        }
        rec.access.store(acc.bits(), Ordering::Relaxed);
        self.access = acc;
        rec.key.store(self.key, Ordering::Release);
        flushed
    }

    /// Change the MR's rights and protection sub-domain in place, keeping its keys
    /// and translation (a layer above the NIC re-registering an MR whose views it
    /// keeps in sub-domains): fenced as [`Mr::rereg`] is (the key stops resolving
    /// and the DMA already inside finishes first).
    pub fn set_rights(&mut self, access: Access, domain: u32) -> Result<()> {
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument("REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"));
        }
        let hi = self.pd.host().inner().clone();
        let rec = hi.seg.mr(self.idx).expect("own MR entry");
        rec.key.store(0, Ordering::Release);
        let flushed = hi.iommu.flush();
        rec.access.store(access.bits(), Ordering::Relaxed);
        rec.domain.store(domain, Ordering::Relaxed);
        self.access = access;
        rec.key.store(self.key, Ordering::Release);
        flushed
    }

    /// An SGE covering `[off, off+len)` of this MR.
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: (self.addr + off) as u64,
            length: len,
            lkey: self.key,
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let hi = self.pd.host().inner();
        if let Some(rec) = hi.seg.mr(self.idx) {
            rec.key.store(0, Ordering::Release);
        }
        if let Err(e) = hi.iommu.flush() {
            tracing::error!("flush on MR deregistration failed: {e}");
        }
        hi.mrs.lock().release(self.idx);
    }
}

/// An MR over a NIC-shared DMA pool buffer that it owns (see [`Pd::reg_dma_buffer`]).
/// Derefs to the [`Mr`] (`lkey`, `rkey`, `addr`, `sge`, ...).
pub struct DmaMr {
    // Field order matters: the MR is dropped (deregistered) before the buffer.
    mr: Mr,
    buf: DmaBuffer,
}

impl DmaMr {
    /// The pinned buffer (`write_at`, `read_at`, `as_ptr`).
    pub fn buffer(&self) -> &DmaBuffer {
        &self.buf
    }
}

impl std::ops::Deref for DmaMr {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        &self.mr
    }
}

/// An MR that owns its buffer.
pub struct OwnedMr {
    mr: Option<Mr>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain heap memory owned by this object; all access goes through
// raw-pointer copies (the NIC writes it concurrently anyway).
unsafe impl Send for OwnedMr {}
// SAFETY: as above.
unsafe impl Sync for OwnedMr {}

impl Drop for OwnedMr {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: ptr/len came from Box::into_raw in reg_mr_owned; the MR is gone so no
        // DMA can reach the memory any more.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

impl OwnedMr {
    /// The registration.
    pub fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("present until drop")
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr().key
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr().key
    }
    /// Address of the owned buffer.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }
    /// Length of the owned buffer.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// An SGE of `len` bytes at offset `off`.
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        self.mr().sge(off, len)
    }
    /// Copy bytes out of the buffer (a plain snapshot; the NIC may write concurrently).
    pub fn read(&self, off: usize, out: &mut [u8]) {
        assert!(
            off.checked_add(out.len()).is_some_and(|e| e <= self.len),
            "read out of bounds"
        );
        // SAFETY: bounds checked; the buffer is live; concurrent NIC writes only produce
        // torn bytes (u8 has no invalid values).
        unsafe { std::ptr::copy(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
    }
    /// A copy of `len` bytes at offset `off`.
    pub fn to_vec(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.read(off, &mut v);
        v
    }
    /// Copy bytes into the buffer.
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(
            off.checked_add(data.len()).is_some_and(|e| e <= self.len),
            "write out of bounds"
        );
        // SAFETY: bounds checked; the buffer is owned by us, live, and only ever accessed
        // through raw pointers.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
    /// Fill the buffer with `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: whole live buffer.
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) };
    }
    /// Page size.
    pub const PAGE: usize = PAGE;
}
