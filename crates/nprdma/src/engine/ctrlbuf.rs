//! The pinned buffers of a QP's control channel (the command-slot receive
//! ring): taken from rnic's NIC-shared DMA pool when the host has one, so a
//! peer's control SEND into them is a memcpy even across processes; else
//! (pool disabled or exhausted) an owned heap buffer, as before.
//!
//! Either way the buffer is registered for the QP's whole life and freed on
//! drop, MR first (which waits for in-flight DMA), then the memory.

/// A registered control buffer (see the module docs).
pub(crate) enum CtrlBuf {
    /// Owns the pool buffer; deregisters before freeing it.
    Pool(rnic::DmaMr),
    Heap(rnic::OwnedMr),
}

impl CtrlBuf {
    /// `len` zeroed bytes registered with `access`, from the DMA pool if it
    /// can serve them.
    pub fn new(
        host: &rnic::Host,
        pd: &rnic::Pd,
        len: usize,
        access: rnic::Access,
    ) -> Result<CtrlBuf, rnic::Error> {
        match host.alloc_dma_buffer(len) {
            Ok(buf) => Ok(CtrlBuf::Pool(pd.reg_dma_buffer(buf, access)?)),
            Err(e) => {
                tracing::debug!(error = %e, len, "control buffer not from the DMA pool");
                Ok(CtrlBuf::Heap(pd.reg_mr_owned(vec![0; len], access)?))
            }
        }
    }

    pub fn sge(&self, off: usize, len: u32) -> rnic::Sge {
        match self {
            CtrlBuf::Pool(m) => m.sge(off, len),
            CtrlBuf::Heap(m) => m.sge(off, len),
        }
    }

    /// Copy `out.len()` bytes at `off` out of the buffer.
    ///
    /// # Panics
    /// If the range is out of bounds (an engine bug: slot offsets are
    /// derived from the ring size).
    pub fn read(&self, off: usize, out: &mut [u8]) {
        match self {
            CtrlBuf::Pool(m) => m
                .buffer()
                .read_at(off, out)
                .expect("control slot read in bounds"),
            CtrlBuf::Heap(m) => m.read(off, out),
        }
    }
}
