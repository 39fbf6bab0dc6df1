//! The RoCEv2 transport: the software NIC's wire to hosts across an IP network.

pub mod conn;
pub mod engine;
pub mod inject;
pub mod rx;
pub mod socket;
pub mod tx;
