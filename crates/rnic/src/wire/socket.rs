//! The UDP sockets of the RoCEv2 transport, the system-call edge of the wire: the
//! host's receive socket on port 4791 (IPv6, dual-stack, so IPv4 peers appear as
//! IPv4-mapped addresses, which is exactly their RoCE v2 GID; each datagram's
//! destination address from `IP_PKTINFO` / `IPV6_PKTINFO`) and a connection's send
//! socket, bound to the QP's source address and UDP source port, with
//! `IP_PMTUDISC_DO` (the don't-fragment bit; Linux then sends identification 0 from an
//! unconnected socket, which the receiver needs to recompute the ICRC over the IP
//! header). I/O is batched: `recvmmsg` / `sendmmsg`, one system call per batch.

use std::io;
use std::net::{Ipv6Addr, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// RoCEv2's UDP destination port.
pub const ROCE_PORT: u16 = 4791;

/// Bytes of one receive buffer: the largest RoCE packet (BTH + extension headers +
/// 4096 B payload + pad + ICRC) with room to spare; larger datagrams are truncated
/// (and then fail the ICRC).
pub const RX_BUF: usize = 4096 + 128;

/// Headroom before each received datagram, where the receiver rebuilds the IP and
/// UDP headers the ICRC covers (IPv6 40 + UDP 8).
pub const HEADROOM: usize = 48;

/// Datagrams per `recvmmsg` / `sendmmsg` call.
pub const BATCH: usize = 32;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, v: T) -> io::Result<()> {
    // SAFETY: `v` is a live value of the option's type, passed by pointer with its size.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            &v as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

fn sockaddr(a: &SocketAddrV6) -> libc::sockaddr_in6 {
    // SAFETY: sockaddr_in6 is plain data; all-zero is a valid value.
    let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    s.sin6_port = a.port().to_be();
    s.sin6_addr.s6_addr = a.ip().octets();
    s.sin6_scope_id = a.scope_id();
    s
}

fn udp6() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned from here on.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_INET6,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    setopt(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0 as libc::c_int)?;
    Ok(fd)
}

fn bind(fd: &OwnedFd, a: &SocketAddrV6) -> io::Result<()> {
    let s = sockaddr(a);
    // SAFETY: `s` is a valid sockaddr_in6 of the size passed.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &s as *const libc::sockaddr_in6 as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// One received datagram: its bytes start at [`HEADROOM`] in `buf`.
pub struct RxDatagram {
    pub buf: Box<[u8; HEADROOM + RX_BUF]>,
    pub len: usize,
    pub src: SocketAddrV6,
    /// The address it was sent to (IPv4-mapped for IPv4).
    pub dst: Ipv6Addr,
}

impl RxDatagram {
    fn new() -> RxDatagram {
        RxDatagram {
            buf: Box::new([0; HEADROOM + RX_BUF]),
            len: 0,
            src: SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0),
            dst: Ipv6Addr::UNSPECIFIED,
        }
    }
}

/// The host's receive socket (`[::]:4791`).
pub struct RxSocket {
    fd: OwnedFd,
    bufs: Vec<RxDatagram>,
}

const CMSG_SPACE: usize = 128;

impl RxSocket {
    /// Bind `[::]:port` (EADDRINUSE if another device of this network namespace
    /// holds it: one RoCE endpoint per address and port).
    pub fn bind(port: u16) -> io::Result<RxSocket> {
        let fd = udp6()?;
        setopt(&fd, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1 as libc::c_int)?;
        // IPv4 datagrams on the dual-stack socket report their destination here.
        let _ = setopt(&fd, libc::IPPROTO_IP, libc::IP_PKTINFO, 1 as libc::c_int);
        // A window of responses arrives in a burst: room for it even above
        // net.core.rmem_max where we may (root: SO_RCVBUFFORCE).
        if setopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20 as libc::c_int).is_err() {
            setopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20 as libc::c_int)?;
        }
        bind(&fd, &SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0))?;
        Ok(RxSocket {
            fd,
            bufs: (0..BATCH).map(|_| RxDatagram::new()).collect(),
        })
    }

    /// Wait up to `timeout` for datagrams and take up to [`BATCH`] of them (one
    /// `recvmmsg`). Returns the filled buffers (empty on timeout).
    pub fn recv(&mut self, timeout: Duration) -> io::Result<&mut [RxDatagram]> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(&mut [])
            } else {
                Err(e)
            };
        }
        if r == 0 {
            return Ok(&mut []);
        }
        self.recv_now()
    }

    /// Take what is queued now, without waiting.
    pub fn recv_now(&mut self) -> io::Result<&mut [RxDatagram]> {
        let n = self.bufs.len();
        // SAFETY: plain data arrays, all-zero valid.
        let mut names: Vec<libc::sockaddr_in6> = vec![unsafe { std::mem::zeroed() }; n];
        let mut ctl = vec![[0u8; CMSG_SPACE]; n];
        let mut iovs: Vec<libc::iovec> = self
            .bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.buf[HEADROOM..].as_mut_ptr() as *mut libc::c_void,
                iov_len: RX_BUF,
            })
            .collect();
        // SAFETY: mmsghdr is plain data, all-zero valid; filled below.
        let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; n];
        for i in 0..n {
            let h = &mut msgs[i].msg_hdr;
            h.msg_name = &mut names[i] as *mut libc::sockaddr_in6 as *mut libc::c_void;
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            h.msg_iov = &mut iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = ctl[i].as_mut_ptr() as *mut libc::c_void;
            h.msg_controllen = CMSG_SPACE;
        }
        // SAFETY: every header points at live buffers of the lengths it states
        // (names, one iovec into a receive buffer, control space), all outliving the call.
        let r = unsafe {
            libc::recvmmsg(
                self.fd.as_raw_fd(),
                msgs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(&mut []),
                _ => Err(e),
            };
        }
        let got = r as usize;
        for i in 0..got {
            let b = &mut self.bufs[i];
            b.len = msgs[i].msg_len as usize;
            let s = &names[i];
            b.src = SocketAddrV6::new(
                Ipv6Addr::from(s.sin6_addr.s6_addr),
                u16::from_be(s.sin6_port),
                0,
                s.sin6_scope_id,
            );
            b.dst = pktinfo_dst(&msgs[i].msg_hdr).unwrap_or(Ipv6Addr::UNSPECIFIED);
        }
        Ok(&mut self.bufs[..got])
    }
}

/// The destination address in a received message's control data.
fn pktinfo_dst(h: &libc::msghdr) -> Option<Ipv6Addr> {
    // SAFETY: `h` was filled by recvmmsg; the CMSG_* macros walk its control buffer
    // within msg_controllen, and each payload is read unaligned at its stated type.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            let (lvl, ty) = ((*c).cmsg_level, (*c).cmsg_type);
            if lvl == libc::IPPROTO_IPV6 && ty == libc::IPV6_PKTINFO {
                let p = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in6_pktinfo);
                return Some(Ipv6Addr::from(p.ipi6_addr.s6_addr));
            }
            if lvl == libc::IPPROTO_IP && ty == libc::IP_PKTINFO {
                let p = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in_pktinfo);
                return Some(std::net::Ipv4Addr::from(u32::from_be(p.ipi_addr.s_addr)).to_ipv6_mapped());
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

/// The MTU of the route from `local` to `remote` (a connected probe socket's
/// `IP_MTU` / `IPV6_MTU`), if the kernel tells.
pub fn route_mtu(local: &SocketAddrV6, remote: &SocketAddrV6) -> Option<usize> {
    let fd = udp6().ok()?;
    bind(&fd, &SocketAddrV6::new(*local.ip(), 0, 0, local.scope_id())).ok()?;
    let s = sockaddr(remote);
    // SAFETY: `s` is a valid sockaddr_in6 of the size passed.
    cvt(unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &s as *const libc::sockaddr_in6 as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    })
    .ok()?;
    let (level, name) = if remote.ip().to_ipv4_mapped().is_some() {
        (libc::IPPROTO_IP, libc::IP_MTU)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU)
    };
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `l` are live and sized for an int option.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            &mut v as *mut libc::c_int as *mut libc::c_void,
            &mut l,
        )
    })
    .ok()?;
    (v > 0).then_some(v as usize)
}

/// A connection's send socket: bound to its source address and UDP port.
pub struct TxSocket {
    fd: OwnedFd,
    pub local: SocketAddrV6,
}

impl TxSocket {
    /// Bind `local` (port 0: any free port), don't-fragment.
    pub fn bind(local: SocketAddrV6) -> io::Result<TxSocket> {
        let fd = udp6()?;
        setopt(&fd, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO)?;
        let _ = setopt(&fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
        if setopt(&fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 4 << 20 as libc::c_int).is_err() {
            setopt(&fd, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20 as libc::c_int)?;
        }
        if bind(&fd, &local).is_err() {
            // The QP's preferred source port is taken: any port will do.
            bind(&fd, &SocketAddrV6::new(*local.ip(), 0, 0, local.scope_id()))?;
        }
        // SAFETY: plain data, all-zero valid; getsockname fills it.
        let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        let mut sl = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        // SAFETY: `s` and `sl` are live and sized for an IPv6 address.
        cvt(unsafe { libc::getsockname(fd.as_raw_fd(), &mut s as *mut _ as *mut libc::sockaddr, &mut sl) })?;
        let local = SocketAddrV6::new(*local.ip(), u16::from_be(s.sin6_port), 0, local.scope_id());
        Ok(TxSocket { fd, local })
    }

    /// Send each of `pkts` to `dst` (one `sendmmsg` per [`BATCH`]). Datagrams the
    /// kernel refuses (a full buffer, an unreachable route) are lost, as on a
    /// fabric: the transport retransmits. Returns how many left.
    pub fn send(&self, dst: &SocketAddrV6, pkts: &[&[u8]]) -> usize {
        let mut name = sockaddr(dst);
        let mut sent = 0;
        for batch in pkts.chunks(BATCH) {
            let mut iovs: Vec<libc::iovec> = batch
                .iter()
                .map(|p| libc::iovec {
                    iov_base: p.as_ptr() as *mut libc::c_void,
                    iov_len: p.len(),
                })
                .collect();
            // SAFETY: plain data, all-zero valid; filled below.
            let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; batch.len()];
            for (m, iov) in msgs.iter_mut().zip(iovs.iter_mut()) {
                m.msg_hdr.msg_name = &mut name as *mut libc::sockaddr_in6 as *mut libc::c_void;
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
                m.msg_hdr.msg_iov = iov;
                m.msg_hdr.msg_iovlen = 1;
            }
            let mut off = 0;
            while off < msgs.len() {
                // SAFETY: each header names `dst` and one iovec over a live packet
                // slice; sendmmsg only reads them.
                let r = unsafe {
                    libc::sendmmsg(
                        self.fd.as_raw_fd(),
                        msgs[off..].as_mut_ptr(),
                        (msgs.len() - off) as libc::c_uint,
                        libc::MSG_DONTWAIT,
                    )
                };
                if r <= 0 {
                    // Dropped (EAGAIN: the socket buffer is full; or no route).
                    off += 1;
                    continue;
                }
                off += r as usize;
                sent += r as usize;
            }
        }
        sent
    }
}
