//! The NIC-shared DMA pool: pinned host memory for buffers the software NIC reaches
//! by plain memcpy from every process (control rings, RECV slots).
//!
//! Each host reserves `HostConfig::dma_pool_size` bytes of a sealed memfd; peers map
//! the same memfd when they connect (next to the host segment). A [`DmaBuffer`] is a
//! page-granular piece of it, populated and mlocked at allocation (it is pinned host
//! memory, like a driver's DMA-coherent buffer) and freed (munlocked, pages punched
//! out of the memfd) on drop. MRs registered over it (plain or IOVA) are ordinary MRs
//! with the usual key, bounds, residency and epoch checks; the only difference is in
//! the DMA engine of *another process*: it recognises a frame inside the target's
//! pool and copies through its own mapping of the memfd instead of
//! `process_vm_readv/writev` (same epoch sections; a dead target still fails the WR,
//! see `Segment::alive`).
//!
//! The pool changes only *how the software NIC reaches* the memory: a real NIC DMAs
//! every registered buffer at the same cost. Use it only for buffers that are pinned
//! anyway (control rings, message slots), never as a way around the pager for
//! application memory: pool pages are never paged out.

use crate::host::Host;
use crate::segment::PAGE;
use crate::{sys, Error, Result};

/// A pinned buffer from the host's NIC-shared DMA pool (see the module docs).
/// Register it with `Pd::reg_mr(buf.addr(), buf.len(), ..)` (or `reg_mr_iova` over
/// IOVA pages mapped to its frames); drop every MR over it before the buffer.
pub struct DmaBuffer {
    host: Host,
    page: u64,
    npages: u64,
    len: usize,
}

impl std::fmt::Debug for DmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

impl DmaBuffer {
    pub(crate) fn alloc(host: &Host, len: usize) -> Result<DmaBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length DMA buffer"));
        }
        let h = host.inner();
        let Some((_, base, _)) = h.seg.pool_file() else {
            return Err(Error::NoResources("DMA pool disabled (dma_pool_size = 0)"));
        };
        let npages = len.div_ceil(PAGE) as u64;
        let page = h.pool.lock().alloc(npages).ok_or(Error::NoResources("DMA pool"))?;
        let buf = DmaBuffer {
            host: host.clone(),
            page,
            npages,
            len,
        };
        // SAFETY: the range is a page-aligned part of the pool mapping that the
        // allocator just handed to us alone.
        if let Err(e) = unsafe { sys::populate_and_lock((base + page * PAGE as u64) as *mut u8, buf.span()) } {
            // Drop frees the range (munlock of unlocked pages is harmless).
            drop(buf);
            return Err(Error::Io(format!("DMA pool: pinning {len} bytes failed: {e}")));
        }
        Ok(buf)
    }

    fn span(&self) -> usize {
        self.npages as usize * PAGE
    }

    /// First byte (page aligned), as an address in this process (for `Sge`s and MRs).
    pub fn addr(&self) -> usize {
        let (_, base, _) = self.host.inner().seg.pool_file().expect("pool exists");
        (base + self.page * PAGE as u64) as usize
    }

    /// Usable length (as requested).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.addr() as *const u8
    }

    /// Start of the buffer, writable (the memory is shared with the NIC).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.addr() as *mut u8
    }

    /// Copy `src` into the buffer at `off`.
    pub fn write_at(&self, off: usize, src: &[u8]) -> Result<()> {
        if off.checked_add(src.len()).map_or(true, |e| e > self.len) {
            return Err(Error::InvalidArgument("DMA buffer write out of bounds"));
        }
        // SAFETY: in bounds of the live, mapped buffer (checked above); `src` cannot
        // overlap it mutably (it is a shared borrow of other memory or of this buffer
        // read through `as_ptr`, and copy handles overlap).
        unsafe { std::ptr::copy(src.as_ptr(), self.as_mut_ptr().add(off), src.len()) };
        Ok(())
    }

    /// Copy `dst.len()` bytes of the buffer at `off` into `dst`.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        if off.checked_add(dst.len()).map_or(true, |e| e > self.len) {
            return Err(Error::InvalidArgument("DMA buffer read out of bounds"));
        }
        // SAFETY: in bounds of the live, mapped buffer (checked above).
        unsafe { std::ptr::copy(self.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The host whose pool holds the buffer.
    pub fn host(&self) -> &Host {
        &self.host
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        let h = self.host.inner();
        if let Some((fd, base, _)) = h.seg.pool_file() {
            let off = self.page as usize * PAGE;
            // SAFETY: our range of the pool mapping / memfd; every MR over it is gone
            // (the registration contract), so no DMA uses it any more.
            unsafe { sys::unlock_and_free(fd, off, (base as usize + off) as *mut u8, self.span()) };
        }
        h.pool.lock().release(self.page, self.npages);
    }
}
