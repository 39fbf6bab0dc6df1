//! Socket addresses at the rdma_cm C boundary: `struct sockaddr` <-> [`SocketAddr`],
//! which addresses are this host's, the source address the routing table picks for a
//! destination, and the IPv4-mapped GID form of an IP address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};

/// Why an address was refused (the errno librdmacm sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrError {
    /// A family other than AF_INET / AF_INET6 (AF_IB): EAFNOSUPPORT.
    Family,
    /// A NULL or short address: EINVAL.
    Invalid,
    /// No route to the destination: ENETUNREACH.
    Unreachable,
}

impl AddrError {
    /// The errno for this refusal.
    pub fn errno(self) -> i32 {
        match self {
            AddrError::Family => libc::EAFNOSUPPORT,
            AddrError::Invalid => libc::EINVAL,
            AddrError::Unreachable => libc::ENETUNREACH,
        }
    }
}

/// Read a C socket address (AF_INET or AF_INET6).
///
/// # Safety
/// `p` is NULL or points at a readable `sockaddr` of its family's size.
pub unsafe fn read(p: *const libc::sockaddr) -> Result<SocketAddr, AddrError> {
    if p.is_null() {
        return Err(AddrError::Invalid);
    }
    // SAFETY: readable per the contract; the family field comes first in every form.
    let family = unsafe { (*p).sa_family } as i32;
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in (contract); unaligned read.
            let s = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6 (contract).
            let s = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => Err(AddrError::Family),
    }
}

/// Write `a` as a C socket address into `out` (at least `sockaddr_storage` bytes,
/// zeroed first); returns the address's length.
///
/// # Safety
/// `out` points at `size_of::<sockaddr_storage>()` writable bytes.
pub unsafe fn write(a: &SocketAddr, out: *mut u8) -> usize {
    // SAFETY: writable per the contract.
    unsafe { std::ptr::write_bytes(out, 0, std::mem::size_of::<libc::sockaddr_storage>()) };
    match a {
        SocketAddr::V4(v) => {
            let s = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in the storage (contract); unaligned write.
            unsafe { std::ptr::write_unaligned(out.cast::<libc::sockaddr_in>(), s) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v) => {
            let s = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v.port().to_be(),
                sin6_flowinfo: v.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v.ip().octets(),
                },
                sin6_scope_id: v.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(out.cast::<libc::sockaddr_in6>(), s) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    }
}

/// Whether `ip` is an address of this host (or the wildcard): a socket binds to it.
pub fn is_local(ip: IpAddr) -> bool {
    ip.is_unspecified() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The source address the routing table picks to reach `dst` (a UDP socket connected
/// to it, no packet sent).
pub fn source_for(dst: &SocketAddr) -> Result<IpAddr, AddrError> {
    let any: IpAddr = match dst {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let s = UdpSocket::bind(SocketAddr::new(any, 0)).map_err(|_| AddrError::Unreachable)?;
    let port = if dst.port() == 0 { 9 } else { dst.port() };
    s.connect(SocketAddr::new(dst.ip(), port))
        .map_err(|_| AddrError::Unreachable)?;
    Ok(s.local_addr().map_err(|_| AddrError::Unreachable)?.ip())
}

/// The RoCE v2 GID of an IP address (IPv4-mapped for IPv4, as rxe builds them).
pub use crate::netif::gid_of_ip as gid_of;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_v4_v6() {
        let mut buf = [0u8; 128];
        for a in [
            "127.0.0.1:7174".parse::<SocketAddr>().unwrap(),
            "[::1]:18515".parse().unwrap(),
        ] {
            // SAFETY: 128 writable bytes = sockaddr_storage.
            let n = unsafe { write(&a, buf.as_mut_ptr()) };
            assert_eq!(n, if a.is_ipv4() { 16 } else { 28 });
            // SAFETY: just written.
            let b = unsafe { read(buf.as_ptr().cast()) }.unwrap();
            assert_eq!(a, b);
        }
        buf[0] = 27; // AF_IB
        buf[1] = 0;
        // SAFETY: readable.
        assert_eq!(unsafe { read(buf.as_ptr().cast()) }, Err(AddrError::Family));
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { read(std::ptr::null()) }, Err(AddrError::Invalid));
    }

    #[test]
    fn locality_and_routes() {
        assert!(is_local("127.0.0.1".parse().unwrap()));
        assert!(is_local("0.0.0.0".parse().unwrap()));
        // TEST-NET-3 is nobody's address here.
        assert!(!is_local("203.0.113.7".parse().unwrap()));
        let dst: SocketAddr = "127.0.0.1:7174".parse().unwrap();
        assert!(source_for(&dst).unwrap().is_loopback());
        assert_eq!(
            gid_of("10.0.0.1".parse().unwrap())[10..],
            [0xff, 0xff, 10, 0, 0, 1]
        );
    }
}
