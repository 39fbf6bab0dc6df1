//! The host's IP addresses as RoCE v2 GIDs (IPv4 as IPv4-mapped IPv6, `::ffff:a.b.c.d`,
//! as rxe builds them), read once per process from the interfaces of its network
//! namespace: every interface that is up, loopback last.

use std::net::{IpAddr, Ipv6Addr};
use std::sync::OnceLock;

/// The 16-byte GID of an IP address.
pub fn gid_of_ip(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The IP address a GID is, if it has the form of one this table holds (IPv4-mapped,
/// or an IPv6 address that is not IPv4-compatible).
pub fn ip_of_gid(g: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*g);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// The addresses of the interfaces that are up (loopback last), at most `max`.
fn interface_ips(max: usize) -> Vec<IpAddr> {
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return Vec::new();
    }
    let (mut ips, mut lo) = (Vec::new(), Vec::new());
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let e = unsafe { &*p };
        p = e.ifa_next;
        let up = e.ifa_flags & libc::IFF_UP as u32 != 0;
        if e.ifa_addr.is_null() || !up {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr of the family it names.
        let ip = unsafe {
            match (*e.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let s = &*(e.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(s.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let s = &*(e.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(s.sin6_addr.s6_addr)
                }
                _ => continue,
            }
        };
        let list = if e.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 {
            &mut lo
        } else {
            &mut ips
        };
        if !list.contains(&ip) {
            list.push(ip);
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(ifa) };
    ips.extend(lo);
    ips.truncate(max);
    ips
}

/// The host's GIDs (entries 1.. of the port's GID table), read on first use.
pub fn host_gids() -> &'static [[u8; 16]] {
    static GIDS: OnceLock<Vec<[u8; 16]>> = OnceLock::new();
    GIDS.get_or_init(|| {
        interface_ips(rnic::subnet::SLOT_GIDS)
            .into_iter()
            .map(gid_of_ip)
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn ipv4_is_mapped_as_rxe_builds_it() {
        let g = gid_of_ip(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 7)));
        assert_eq!(g[..12], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(g[12..], [192, 168, 1, 7]);
        assert_eq!(ip_of_gid(&g), IpAddr::V4(Ipv4Addr::new(192, 168, 1, 7)));
        let v6 = IpAddr::V6("fe80::1".parse().unwrap());
        assert_eq!(ip_of_gid(&gid_of_ip(v6)), v6);
    }

    #[test]
    fn loopback_is_listed_last() {
        let g = host_gids();
        let lo = gid_of_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        // Every test machine has lo up with 127.0.0.1.
        let at = g.iter().position(|x| *x == lo).expect("127.0.0.1 listed");
        assert!(g[at..]
            .iter()
            .all(|x| ip_of_gid(x).is_loopback() || *x == lo));
    }
}
