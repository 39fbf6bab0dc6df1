//! The memory-management edge of the crate: the page size, thin memory syscalls
//! (munmap, madvise through rustix; mincore, which rustix lacks, raw) and a
//! page-aligned bounce buffer. New mappings come from [`crate::AnonMapping`].

use std::io;

/// The page size this crate works with (checked against the kernel at start).
pub const PAGE: usize = 4096;
pub const PAGE_SHIFT: u32 = 12;

/// The kernel's page size.
pub fn kernel_page_size() -> usize {
    rustix::param::page_size()
}

/// Unmaps a mapping this crate created (from an [`crate::AnonMapping`] given up
/// with `into_raw`).
///
/// # Safety
/// Nobody may use `[addr, addr+len)` afterwards.
pub unsafe fn munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe { rustix::mm::munmap(addr as *mut _, len) }?;
    Ok(())
}

/// `madvise(addr, len, advice)`.
///
/// # Safety
/// For destructive advice (`LinuxDontNeed`) the caller owns the contents.
pub unsafe fn madvise(addr: usize, len: usize, advice: rustix::mm::Advice) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe { rustix::mm::madvise(addr as *mut _, len, advice) }?;
    Ok(())
}

/// Makes the present page at `addr` exclusive to this process again, as a
/// write to it would (`MADV_POPULATE_WRITE`: a write fault without writing;
/// after a fork the page is shared with the child, or marked possibly so,
/// until then). Contents are unchanged. Fails (no signal) on a mapping that
/// is not writable.
pub fn unshare(addr: usize) -> io::Result<()> {
    // SAFETY: POPULATE_WRITE changes no byte of the range (it faults pages in
    // for writing); the caller names a page of its own mapping.
    unsafe { madvise(addr, PAGE, rustix::mm::Advice::LinuxPopulateWrite) }
}

/// `mincore` over page-aligned `[addr, addr+len)`: one byte per page, bit 0 =
/// resident. (A raw call: rustix does not offer mincore.)
pub fn mincore(addr: usize, len: usize, out: &mut [u8]) -> io::Result<()> {
    let pages = len.div_ceil(PAGE);
    assert!(out.len() >= pages);
    // SAFETY: `out` holds at least one byte per page of the range; mincore only
    // inspects page tables and fails with ENOMEM for unmapped ranges.
    if unsafe { libc::mincore(addr as *mut _, len, out.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A page-aligned heap buffer of whole pages (usable with O_DIRECT).
pub struct PageBuf {
    ptr: *mut u8,
    pages: usize,
}

// SAFETY: PageBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for PageBuf {}
// SAFETY: shared access only reads (`as_slice`); mutation needs `&mut self`.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    pub fn new(pages: usize) -> PageBuf {
        let layout = Self::layout(pages);
        // SAFETY: layout has non-zero size (pages >= 1 enforced by layout()).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        PageBuf { ptr, pages }
    }
    fn layout(pages: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(pages.max(1) * PAGE, PAGE).expect("layout")
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for pages*PAGE bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.pages * PAGE) }
    }
    #[cfg(test)]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for pages*PAGE bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.pages * PAGE) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.pages)) }
    }
}

/// Reads one byte of every page in `[addr, addr+len)` so the kernel populates
/// anything it holds itself (e.g. a page it swapped out on its own).
///
/// # Safety
/// The range must be mapped readable.
pub unsafe fn touch_read(addr: usize, len: usize) {
    let mut a = addr;
    while a < addr + len {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::read_volatile(a as *const u8) };
        a += PAGE;
    }
}
