//! An owned private anonymous mapping: the one anonymous-memory helper of the
//! workspace (the pager's own regions, the CLI's pinned buffers, the verbs shim's
//! staging and bounce buffers, the tests' application memory).

use std::io;

/// `len` bytes (rounded up to whole pages) of private anonymous read-write memory,
/// unmapped when dropped. The pages are not populated: the first touch of each is a
/// fault (served by the kernel, or by a [`crate::Pager`] once registered with it).
#[derive(Debug)]
pub struct AnonMapping {
    addr: usize,
    len: usize,
}

impl AnonMapping {
    /// Maps `len` bytes (rounded up to pages; at least one page).
    pub fn new(len: usize) -> io::Result<AnonMapping> {
        Self::with_flags(len, rustix::mm::MapFlags::PRIVATE)
    }

    /// Like [`AnonMapping::new`], without reserving swap space for it
    /// (`MAP_NORESERVE`: large sparse ranges).
    pub fn new_noreserve(len: usize) -> io::Result<AnonMapping> {
        Self::with_flags(
            len,
            rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
        )
    }

    fn with_flags(len: usize, flags: rustix::mm::MapFlags) -> io::Result<AnonMapping> {
        let len = len
            .max(1)
            .checked_next_multiple_of(crate::mm::PAGE)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh anonymous mapping placed by the kernel aliases nothing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                flags,
            )
        }?;
        Ok(AnonMapping {
            addr: p as usize,
            len,
        })
    }

    /// Start of the mapping (page-aligned).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Start of the mapping, as a pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives the mapping up without unmapping it: `(addr, len)`, now the caller's
    /// to unmap.
    pub fn into_raw(self) -> (usize, usize) {
        let r = (self.addr, self.len);
        std::mem::forget(self);
        r
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping created in `with_flags`, owned by this value; whoever
        // reached it through the address (an MR, a registration) is gone by now, by
        // the owner's field order.
        if let Err(e) = unsafe { rustix::mm::munmap(self.addr as *mut _, self.len) } {
            tracing::warn!("munmap of an anonymous mapping failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_up_to_pages_and_is_writable() {
        let m = AnonMapping::new(10).unwrap();
        assert_eq!(m.len(), crate::mm::PAGE);
        assert_eq!(m.addr() % crate::mm::PAGE, 0);
        // SAFETY: inside the live mapping.
        unsafe { m.as_ptr().add(9).write(7) };
        // SAFETY: as above.
        assert_eq!(unsafe { m.as_ptr().add(9).read() }, 7);
        let big = AnonMapping::new_noreserve(1 << 30).unwrap();
        assert_eq!(big.len(), 1 << 30);
    }

    #[test]
    fn an_impossible_length_is_an_error() {
        assert!(AnonMapping::new(usize::MAX).is_err());
    }
}
