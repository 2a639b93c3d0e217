//! Where a secret would travel unencrypted: over `http://` to a host other than this one.

use axum::http::Uri;

/// Whether `url` names this host: `localhost`, or a loopback address (an IPv4-mapped one too).
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(uri) = url.parse::<Uri>() else { return false };
    let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| continuum_proto::net::unmapped(ip).is_loopback())
}

/// Whether a secret sent to `url` crosses the network in the clear: `http://` (in any case) to
/// a host that is not this one.
pub fn in_the_clear(url: &str) -> bool {
    let plain = url.parse::<Uri>().is_ok_and(|uri| uri.scheme_str().is_some_and(|s| s.eq_ignore_ascii_case("http")));
    plain && !is_loopback_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_hosts_urls_keep_a_clear_token_on_the_machine() {
        let local = ["http://127.0.0.1:50051", "http://localhost:50051", "http://[::1]:50051", "http://127.3.2.1"];
        for url in local.into_iter().chain(["http://[::ffff:127.0.0.1]:8000", "HTTP://LOCALHOST"]) {
            assert!(is_loopback_url(url), "{url}");
            assert!(!in_the_clear(url), "{url}");
        }
        for url in
            ["http://cp.other-node:50051", "http://10.0.0.7:50051", "http://[fd00::1]:1", "HTTP://mirror.internal"]
        {
            assert!(!is_loopback_url(url), "{url}");
            assert!(in_the_clear(url), "{url}");
        }
        for url in ["https://huggingface.co", "https://10.0.0.7:50051", "not a url"] {
            assert!(!in_the_clear(url), "{url}: encrypted, or nowhere");
        }
    }
}
