//! The handle layer: the public verbs objects (host and context, DMA-pool buffers,
//! PD, MR, CQ and completion channel, QP, SRQ, address handle). Each holds its parent.

pub mod ah;
pub mod context;
pub mod cq;
pub mod dma_buffer;
pub mod mr;
pub mod pd;
pub mod qp;
pub mod srq;
