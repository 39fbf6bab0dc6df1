//! The NIC-shared DMA pool's pages: allocation (populated and mlocked), their
//! addresses in this process, and freeing (munlocked, punched out of the memfd). The
//! handle over them, and the pool's documentation, is `crate::pool::DmaBuffer`.

use crate::error::{Error, Result};
use crate::hw::device::Device;
use crate::hw::segment::PAGE;
use crate::sys;

/// Claim `len` bytes (whole pages) of `dev`'s pool, populated and locked: the first
/// page and the page count.
pub(crate) fn alloc(dev: &Device, len: usize) -> Result<(u64, u64)> {
    if len == 0 {
        return Err(Error::InvalidArgument("zero-length DMA buffer"));
    }
    let Some((_, base, _)) = dev.seg.pool_file() else {
        return Err(Error::NoResources("DMA pool disabled (dma_pool_size = 0)"));
    };
    let npages = len.div_ceil(PAGE) as u64;
    let page = dev.pool.lock().alloc(npages).ok_or(Error::NoResources("DMA pool"))?;
    // SAFETY: the range is a page-aligned part of the pool mapping that the
    // allocator just handed to us alone.
    if let Err(e) = unsafe { sys::populate_and_lock((base + page * PAGE as u64) as *mut u8, npages as usize * PAGE) } {
        // SAFETY: the pages were just claimed and nobody registered them yet
        // (munlock of unlocked pages is harmless).
        unsafe { free(dev, page, npages) };
        return Err(Error::Io(format!("DMA pool: pinning {len} bytes failed: {e}")));
    }
    Ok((page, npages))
}

/// The address in this process of pool page `page` of `dev`.
pub(crate) fn addr(dev: &Device, page: u64) -> usize {
    let (_, base, _) = dev.seg.pool_file().expect("pool exists");
    (base + page * PAGE as u64) as usize
}

/// Give back pages `page..page + npages` of `dev`'s pool.
///
/// # Safety
/// The pages came from [`alloc`] and no DMA may use them any more.
pub(crate) unsafe fn free(dev: &Device, page: u64, npages: u64) {
    if let Some((fd, base, _)) = dev.seg.pool_file() {
        let off = page as usize * PAGE;
        // SAFETY: our range of the pool mapping / memfd; the caller guarantees no DMA
        // uses it any more.
        unsafe { sys::unlock_and_free(fd, off, (base as usize + off) as *mut u8, npages as usize * PAGE) };
    }
    dev.pool.lock().release(page, npages);
}
