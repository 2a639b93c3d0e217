//! Addresses as both planes judge them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The IPv4 address `ip` stands for when it is one in IPv6 dress: IPv4-mapped
/// (`::ffff:a.b.c.d`) or behind a NAT64 gateway's well-known prefix (`64:ff9b::/96`); else `ip`.
/// A check of where an address leads must judge the IPv4 address it reaches.
pub fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().or_else(|| nat64(v6)).map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

fn nat64(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let [a, b, c, d, e, f, _, _] = v6.segments();
    let [.., w, x, y, z] = v6.octets();
    ([a, b, c, d, e, f] == [0x64, 0xff9b, 0, 0, 0, 0]).then_some(Ipv4Addr::new(w, x, y, z))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_in_ipv6_dress_is_judged_as_the_ipv4_address_it_reaches() {
        let ip = |text: &str| text.parse::<IpAddr>().expect("an address");
        assert_eq!(unmapped(ip("::ffff:169.254.169.254")), ip("169.254.169.254"));
        assert_eq!(unmapped(ip("64:ff9b::a9fe:a9fe")), ip("169.254.169.254"));
        assert_eq!(
            unmapped(ip("64:ff9b:1::a9fe:a9fe")),
            ip("64:ff9b:1::a9fe:a9fe"),
            "a local-use prefix is not the well-known one"
        );
        assert_eq!(unmapped(ip("fd00::1")), ip("fd00::1"));
        assert_eq!(unmapped(ip("10.0.0.1")), ip("10.0.0.1"));
    }
}
