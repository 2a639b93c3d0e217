//! Where an artifact URL may lead. The URL comes from a worker's model card, so the router must
//! not become the fleet's way into its own network: link-local addresses (the cloud metadata
//! service at 169.254.169.254 among them), AWS's and GCP's IPv6, Alibaba's and Azure's
//! WireServer metadata addresses,
//! unspecified, multicast and broadcast addresses are never connected to, whether a URL names
//! them (an IPv4-mapped or NAT64 IPv6 address is judged as the IPv4 one it leads to), a redirect
//! does, or a host name resolves to them. Loopback and private networks stay reachable: an operator's
//! mirror may live there.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::{GaiResolver, Name};
use tower_service::Service;

/// AWS's instance metadata service over IPv6.
const AWS_METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254);
/// Google Cloud's metadata server over IPv6.
const GCP_METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd20, 0x00ce, 0, 0, 0, 0, 0, 0x0254);
/// Alibaba Cloud's instance metadata service, outside the link-local range.
const ALIBABA_METADATA: Ipv4Addr = Ipv4Addr::new(100, 100, 100, 200);
/// Azure's WireServer (a VM's agent channel, credentials among what it serves), outside the
/// link-local range.
const AZURE_WIRESERVER: Ipv4Addr = Ipv4Addr::new(168, 63, 129, 16);

/// Whether an artifact fetch may connect to `ip`.
pub fn reachable(ip: IpAddr) -> bool {
    let forbidden = match continuum_proto::net::unmapped(ip) {
        IpAddr::V4(v4) => {
            v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4 == ALIBABA_METADATA
                || v4 == AZURE_WIRESERVER
        }
        IpAddr::V6(v6) => {
            // fe80::/10, not yet stable as `is_unicast_link_local`.
            let link_local = v6.segments()[0] & 0xffc0 == 0xfe80;
            link_local || v6.is_unspecified() || v6.is_multicast() || [AWS_METADATA_V6, GCP_METADATA_V6].contains(&v6)
        }
    };
    !forbidden
}

/// The system resolver, less the addresses [`reachable`] refuses; a name with none left fails.
#[derive(Clone, Debug)]
pub struct ReachableResolver(GaiResolver);

impl Default for ReachableResolver {
    fn default() -> Self {
        Self(GaiResolver::new())
    }
}

impl Service<Name> for ReachableResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let resolving = self.0.call(name);
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = resolving.await?.filter(|addr| reachable(addr.ip())).collect();
            if addrs.is_empty() {
                let why = "the host resolves only to addresses artifact URLs may not reach (link-local, metadata, unspecified, multicast)";
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
            }
            Ok(addrs.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_link_local_addresses_are_out_of_reach_and_private_ones_are_not() {
        let refused = [
            "169.254.169.254",
            "fe80::1",
            "fd00:ec2::254",
            "fd20:ce::254",
            "168.63.129.16",
            "::ffff:169.254.169.254",
            "0.0.0.0",
            "224.0.0.1",
        ];
        let elsewhere = ["64:ff9b::a9fe:a9fe", "100.100.100.200", "::ffff:100.100.100.200"];
        for refused in refused.into_iter().chain(elsewhere) {
            assert!(!reachable(refused.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))), "{refused}");
        }
        for allowed in ["127.0.0.1", "10.0.0.7", "192.168.1.2", "fd00::7", "::1", "140.82.112.3", "64:ff9b::8c52:7003"]
        {
            assert!(reachable(allowed.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))), "{allowed}");
        }
    }

    #[tokio::test]
    async fn a_name_resolving_only_out_of_reach_fails_to_resolve() -> anyhow::Result<()> {
        let mut resolver = ReachableResolver::default();
        // getaddrinfo answers an address written as a name with that address.
        let metadata = resolver.call("169.254.169.254".parse()?).await.map(Iterator::count);
        assert_eq!(metadata.map_err(|e| e.kind()), Err(io::ErrorKind::PermissionDenied));
        let loopback: Vec<SocketAddr> = resolver.call("localhost".parse()?).await?.collect();
        assert!(!loopback.is_empty() && loopback.iter().all(|a| a.ip().is_loopback()), "{loopback:?}");
        Ok(())
    }
}
