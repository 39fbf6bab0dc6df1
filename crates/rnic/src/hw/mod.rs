//! The device layer: the host segment, the IOMMU, the frame-residency map, the DMA
//! engine, resolved peers, the NIC-shared DMA pool and per-thread scratch buffers.
//! Nothing here names a handle or an engine.

pub mod device;
pub mod dma;
pub mod dma_pool;
pub mod frames;
pub mod iommu;
pub mod peer;
pub mod scratch;
pub mod segment;
