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

use crate::error::{Error, Result};
use crate::hw::dma_pool;
use crate::objects::context::Host;

impl Host {
    /// Allocate `len` bytes (rounded up to pages) of pinned host memory from the
    /// NIC-shared DMA pool: populated, mlocked, reachable by every peer's software
    /// NIC by memcpy. For control rings and message slots only (see [`crate::pool`]).
    pub fn alloc_dma_buffer(&self, len: usize) -> Result<DmaBuffer> {
        DmaBuffer::alloc(self, len)
    }
}

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
        let (page, npages) = dma_pool::alloc(host.inner(), len)?;
        Ok(DmaBuffer {
            host: host.clone(),
            page,
            npages,
            len,
        })
    }

    /// First byte (page aligned), as an address in this process (for `Sge`s and MRs).
    pub fn addr(&self) -> usize {
        dma_pool::addr(self.host.inner(), self.page)
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
        // SAFETY: our pages of the pool; every MR over them is gone (the registration
        // contract), so no DMA uses them any more.
        unsafe { dma_pool::free(self.host.inner(), self.page, self.npages) };
    }
}
