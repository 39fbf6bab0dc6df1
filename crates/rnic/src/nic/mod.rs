//! The engine layer: what the engines of a host share (`state`), the CQ ring, the ODP
//! model, the request-ring server's private state (`inbound`), QP contexts and their
//! send queues, the requester, the responder, the completer and the NIC thread.

pub mod completer;
pub mod cq_ring;
pub mod inbound;
pub mod odp;
pub mod qp_ctx;
pub mod requester;
pub mod responder;
pub mod small;
pub mod sq;
pub mod state;
pub mod thread;
