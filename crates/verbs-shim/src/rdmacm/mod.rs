//! # librdmacm in libnprdma.so
//!
//! The rdma_cm API (`rdma/rdma_cma.h`, `rdma/rdma_verbs.h`'s inline helpers over it)
//! for both modes, as librdmacm over a RoCE device behaves: event channels, ids in
//! the TCP (RC) and UDP (UD) port spaces, address and route resolution over the
//! host's interfaces (IPv4 and IPv6), listen / connect / accept / reject / establish /
//! disconnect with private data up to the IB CM's limits, the QP moved through
//! INIT/RTR/RTS with the negotiated depths, synchronous ids (`rdma_create_ep`,
//! `rdma_get_request`), options, `rdma_getaddrinfo`, `rdma_get_devices`. Multicast
//! and ECE are refused (EOPNOTSUPP).
//!
//! Two processes' CMs talk over one TCP connection per rdma_cm connection, to the
//! rdma_cm port number on TCP (so a listener's port is also a TCP port of the host;
//! a TCP socket of another program on the same port makes `rdma_bind_addr` fail with
//! EADDRINUSE). The connection's end is noticed as the IB CM notices it: a DREQ, or
//! the stream closing when the peer process dies (DISCONNECTED, the QP to ERR). The
//! QPs address each other by GID 0 (the device's), exchanged in the REQ and REP.
//!
//! Modules, lowest first: [`sockaddr`] (C addresses, locality, routes), [`wire`]
//! (the CM messages), [`link`] (one connection's stream), [`channel`] (event
//! channels and events), [`id`] (ids and their state), [`verbs`] (the device, PD,
//! CQs, QP and its transitions), [`reactor`] (the CM thread), then the entry points:
//! [`api_id`] (channels, ids, events, options, bind), [`api_conn`] (resolve, listen,
//! connect, accept, disconnect, QPs), [`api_ep`] (addrinfo, endpoints, devices,
//! refusals).

pub mod api_conn;
pub mod api_ep;
pub mod api_id;
pub mod channel;
pub mod id;
pub mod link;
pub mod reactor;
pub mod sockaddr;
pub mod verbs;
pub mod wire;
