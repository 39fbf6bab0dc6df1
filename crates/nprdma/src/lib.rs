//! NP-RDMA layer (groundwork). The full design overview is written below the
//! module list once all modules exist.
#![deny(unsafe_code)]

pub mod check;
pub mod ctrl;
pub mod keymap;
pub mod nic;
pub mod ordering;
