//! Where an artifact's bytes come from. Classifying a card's `path` is pure: a local path or
//! `file://` is always allowed, `http(s)://` only under `allow_http_artifacts`, `hf://` only
//! under `allow_hf_artifacts`. Fetching is the effect: over plain http or TLS (certificates
//! verified against the Mozilla roots, plus an operator's CA bundle for private mirrors), bounded
//! to [`MAX_ARTIFACT_BYTES`] while the body streams, with a deadline.

#[cfg(test)]
mod https_tests;
mod tls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, StatusCode, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;

use super::cache::MAX_ARTIFACT_BYTES;
use super::reach::{ReachableResolver, reachable};
pub use tls::TlsSetupError;

/// An artifact fetch (connect, head and whole body) must finish within this.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Redirects followed for one fetch (the Hub redirects `resolve/` URLs to its CDN).
pub const MAX_REDIRECTS: usize = 5;
/// The Hub, when `HF_ENDPOINT` is unset.
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Local(PathBuf),
    Http(Uri),
    /// `hf://<org>/<repo>[@<revision>]/<file>`.
    Hf {
        repo: String,
        revision: String,
        file: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("{0}:// artifacts are disabled by configuration (kv.allow_{0}_artifacts: false)")]
    Refused(&'static str),
    #[error("the artifact path {0:?} uses a scheme the router cannot fetch")]
    Unsupported(String),
    #[error("the artifact URI {0:?} is malformed")]
    Malformed(String),
}

/// The scheme switches of the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schemes {
    pub allow_http: bool,
    pub allow_hf: bool,
}

impl Source {
    pub fn classify(path: &str, schemes: Schemes) -> Result<Self, SourceError> {
        let malformed = || SourceError::Malformed(shown(path));
        if let Some(rest) = path.strip_prefix("file://") {
            // `file:///p` and `file://localhost/p`; a host elsewhere would be read here as the
            // relative path `host/p`, from wherever the replica runs.
            let local = rest.strip_prefix("localhost").unwrap_or(rest);
            return if local.starts_with('/') { Ok(Source::Local(PathBuf::from(local))) } else { Err(malformed()) };
        }
        if path.starts_with("http://") || path.starts_with("https://") {
            if !schemes.allow_http {
                return Err(SourceError::Refused("http"));
            }
            return path.parse::<Uri>().map(Source::Http).map_err(|_| malformed());
        }
        if let Some(rest) = path.strip_prefix("hf://") {
            if !schemes.allow_hf {
                return Err(SourceError::Refused("hf"));
            }
            return parse_hf(rest).ok_or_else(malformed);
        }
        if path.contains("://") {
            return Err(SourceError::Unsupported(path.chars().take(200).collect()));
        }
        Ok(Source::Local(PathBuf::from(path)))
    }
}

fn parse_hf(rest: &str) -> Option<Source> {
    let mut segments = rest.splitn(3, '/');
    let (org, repo_rev, file) = (segments.next()?, segments.next()?, segments.next()?);
    let (repo, revision) = repo_rev.split_once('@').unwrap_or((repo_rev, "main"));
    // No dot segments anywhere: a server normalizing `..` would serve a path of the card's
    // choosing on the Hub's host, with the Hub token attached.
    let name_ok = |s: &str| {
        !s.is_empty() && s != "." && s != ".." && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    let file_ok = !file.is_empty() && file.split('/').all(name_ok);
    (name_ok(org) && name_ok(repo) && name_ok(revision) && file_ok).then(|| Source::Hf {
        repo: format!("{org}/{repo}"),
        revision: revision.to_string(),
        file: file.to_string(),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the artifact is larger than the {MAX_ARTIFACT_BYTES}-byte cap")]
    TooLarge,
    #[error("fetching {uri} failed: {reason}")]
    Failed { uri: String, reason: String },
}

/// Read by [`Fetcher::from_env`]: a PEM bundle of CA certificates trusted in addition to the
/// Mozilla roots (a private mirror's CA).
pub const ARTIFACT_CA_FILE_ENV: &str = "CONTINUUM_ARTIFACT_CA_FILE";
/// Connecting (TCP only) must finish within this; the whole fetch within [`FETCH_TIMEOUT`].
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

type HttpsClient = Client<HttpsConnector<HttpConnector<ReachableResolver>>, Empty<Bytes>>;

/// Fetches `http://` and `https://` artifacts, and the Hub at `HF_ENDPOINT`, with a hyper
/// client that verifies server certificates against the Mozilla roots (compiled in, no system
/// store) and any extra roots added with [`Fetcher::with_extra_roots`].
#[derive(Clone)]
pub struct Fetcher {
    /// `Err` only if rustls refused the configuration (it cannot with ring's default provider);
    /// then every fetch fails with the reason instead of the router failing to start.
    client: Result<HttpsClient, Arc<str>>,
    roots: Arc<RootCertStore>,
    hf_endpoint: String,
    hf_token: Option<String>,
}

/// Never prints `HF_TOKEN`, only whether one is set.
impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("hf_endpoint", &self.hf_endpoint)
            .field("hf_token", &self.hf_token.as_ref().map(|_| "***"))
            .finish_non_exhaustive()
    }
}

impl Fetcher {
    /// Reads `HF_ENDPOINT`, `HF_TOKEN` and [`ARTIFACT_CA_FILE_ENV`]. A CA file that cannot be
    /// read or parsed is logged and ignored: the fetcher then trusts only the Mozilla roots, so
    /// a private mirror fails closed (`fetch_failed`) rather than being trusted blindly.
    pub fn from_env() -> Self {
        let hf_endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| DEFAULT_HF_ENDPOINT.to_string());
        let hf_token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        if hf_token.is_some() && crate::clear_text::in_the_clear(&hf_endpoint) {
            tracing::warn!(
                hf_endpoint = %shown(&hf_endpoint),
                "HF_TOKEN goes in the clear over http:// to a host that is not this one when tokenizer files are \
                 fetched; use an https:// HF_ENDPOINT unless the network to it is trusted"
            );
        }
        let fetcher = Self::new(hf_endpoint, hf_token);
        let Some(path) = std::env::var_os(ARTIFACT_CA_FILE_ENV).filter(|p| !p.is_empty()) else {
            return fetcher;
        };
        let pem = match std::fs::read(&path) {
            Ok(pem) => pem,
            Err(e) => {
                tracing::error!(path = %path.to_string_lossy(), error = %e, "{ARTIFACT_CA_FILE_ENV}: cannot read the CA bundle; trusting only the Mozilla roots");
                return fetcher;
            }
        };
        match fetcher.clone().with_extra_roots(&pem) {
            Ok(extended) => extended,
            Err(e) => {
                tracing::error!(path = %path.to_string_lossy(), error = %e, "{ARTIFACT_CA_FILE_ENV}: unusable CA bundle; trusting only the Mozilla roots");
                fetcher
            }
        }
    }

    pub fn new(hf_endpoint: String, hf_token: Option<String>) -> Self {
        let roots = Arc::new(tls::mozilla_roots());
        Self {
            client: build_client(&roots).map_err(|e| Arc::from(e.to_string())),
            roots,
            hf_endpoint: hf_endpoint.trim_end_matches('/').to_string(),
            hf_token,
        }
    }

    /// Also trusts the CA certificates of a PEM bundle (every `CERTIFICATE` block; other blocks
    /// are skipped). Fails, changing nothing, if the bundle holds no usable CA certificate.
    pub fn with_extra_roots(self, pem: &[u8]) -> Result<Self, TlsSetupError> {
        let mut roots = RootCertStore::clone(&self.roots);
        tls::add_pem_roots(&mut roots, pem)?;
        let client = build_client(&roots)?;
        Ok(Self { client: Ok(client), roots: Arc::new(roots), ..self })
    }

    /// The Hub URL of an `hf://` artifact.
    pub fn hf_url(&self, repo: &str, revision: &str, file: &str) -> String {
        format!("{}/{repo}/resolve/{revision}/{file}", self.hf_endpoint)
    }

    /// Fetches a remote source; local sources are read on the blocking pool by the caller.
    pub async fn fetch(&self, source: &Source) -> Result<Vec<u8>, FetchError> {
        let (uri, token) = match source {
            Source::Http(uri) => (uri.to_string(), None),
            Source::Hf { repo, revision, file } => (self.hf_url(repo, revision, file), self.hf_token.clone()),
            Source::Local(path) => {
                return Err(FetchError::Failed { uri: path.display().to_string(), reason: "not remote".into() });
            }
        };
        let failed = |reason: String| FetchError::Failed { uri: shown(&uri), reason };
        tokio::time::timeout(FETCH_TIMEOUT, self.follow(&uri, token.as_deref()))
            .await
            .map_err(|_| failed(format!("no complete response within {FETCH_TIMEOUT:?}")))?
    }

    async fn follow(&self, uri: &str, token: Option<&str>) -> Result<Vec<u8>, FetchError> {
        let client = self.client.as_ref().map_err(|reason| fail(uri, reason))?;
        let mut current: Uri = uri.parse().map_err(|_| fail(uri, "malformed URI"))?;
        // The token's origin is scheme and authority: the same host over http is another origin.
        let origin = (current.scheme().cloned(), current.authority().cloned());
        for _ in 0..=MAX_REDIRECTS {
            if !matches!(current.scheme_str(), Some("http" | "https")) {
                return Err(fail(uri, &format!("{} is neither http:// nor https://", shown(&current.to_string()))));
            }
            // A name goes through the resolver, which drops such addresses; an address written
            // in the URL (or a redirect) never does.
            let literal = current.host().and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok());
            if literal.is_some_and(|ip| !reachable(ip)) {
                return Err(fail(
                    uri,
                    &format!("{} names an address artifact URLs may not reach", shown(&current.to_string())),
                ));
            }
            let mut request = Request::get(current.clone());
            // The token goes to the configured endpoint only, never to where it redirects.
            let at_origin = current.scheme() == origin.0.as_ref() && current.authority() == origin.1.as_ref();
            if let Some(token) = token.filter(|_| at_origin) {
                request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
            }
            let request = request.body(Empty::new()).map_err(|e| fail(uri, &e.to_string()))?;
            let response = client.request(request).await.map_err(|e| fail(uri, &crate::error_chain(&e)))?;
            let status = response.status();
            if status.is_redirection() {
                let location = response.headers().get(header::LOCATION).and_then(|l| l.to_str().ok());
                let next = resolve_redirect(&current, location.ok_or_else(|| fail(uri, "redirect without Location"))?)
                    .ok_or_else(|| fail(uri, "unusable redirect Location"))?;
                // What TLS protected must not be re-fetched in the clear (and tampered with).
                if current.scheme_str() == Some("https") && next.scheme_str() != Some("https") {
                    return Err(fail(
                        uri,
                        &format!("refused a redirect from https:// down to {}", shown(&next.to_string())),
                    ));
                }
                current = next;
                continue;
            }
            if status != StatusCode::OK {
                return Err(fail(uri, &format!("status {status}")));
            }
            return read_body(response.into_body(), uri).await;
        }
        Err(fail(uri, &format!("more than {MAX_REDIRECTS} redirects")))
    }
}

/// http:// and https:// (TLS 1.2 / 1.3, HTTP/1.1) with the given trust anchors.
fn build_client(roots: &RootCertStore) -> Result<HttpsClient, TlsSetupError> {
    let config = tls::client_config(roots.clone())?;
    let mut http = HttpConnector::new_with_resolver(ReachableResolver::default());
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    // The https connector wraps this one and needs it to accept https:// URIs.
    http.enforce_http(false);
    let connector =
        HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http1().wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

fn fail(uri: &str, reason: &str) -> FetchError {
    FetchError::Failed { uri: shown(uri), reason: reason.to_string() }
}

/// `uri` as errors and logs show it: without userinfo or query, where a card's URL may carry a
/// password or a presigned URL's signature, which no log should.
pub(crate) fn shown(uri: &str) -> String {
    let shown = match uri.parse::<Uri>() {
        Ok(parsed) => {
            let port = parsed.port_u16().map(|port| format!(":{port}")).unwrap_or_default();
            let query = if parsed.query().is_some() { "?…" } else { "" };
            let (scheme, host) = (parsed.scheme_str().unwrap_or_default(), parsed.host().unwrap_or_default());
            format!("{scheme}://{host}{port}{}{query}", parsed.path())
        }
        Err(_) => {
            let before_query = uri.split(['?', '#']).next().unwrap_or_default();
            before_query.rsplit('@').next().unwrap_or_default().to_owned()
        }
    };
    shown.chars().take(200).collect()
}

fn resolve_redirect(base: &Uri, location: &str) -> Option<Uri> {
    if location.starts_with('/') {
        let authority = base.authority()?;
        return format!("{}://{authority}{location}", base.scheme_str()?).parse().ok();
    }
    location.parse().ok()
}

/// Streams the body, refusing it the moment it passes the cap (or declares that it will).
async fn read_body(mut body: hyper::body::Incoming, uri: &str) -> Result<Vec<u8>, FetchError> {
    if http_body::Body::size_hint(&body).lower() > MAX_ARTIFACT_BYTES {
        return Err(FetchError::TooLarge);
    }
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| fail(uri, &e.to_string()))?;
        if let Some(data) = frame.data_ref() {
            if (bytes.len() + data.len()) as u64 > MAX_ARTIFACT_BYTES {
                return Err(FetchError::TooLarge);
            }
            bytes.extend_from_slice(data);
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetcher_never_prints_its_hub_token() {
        let fetcher = Fetcher::new("https://hub.example".into(), Some("hf_s3cret".into()));
        let shown = format!("{fetcher:?}");
        assert!(!shown.contains("hf_s3cret") && shown.contains("***") && shown.contains("hub.example"), "{shown}");
    }

    const ALL: Schemes = Schemes { allow_http: true, allow_hf: true };
    const DEFAULTS: Schemes = Schemes { allow_http: true, allow_hf: false };

    #[test]
    fn local_paths_are_always_allowed() {
        let none = Schemes { allow_http: false, allow_hf: false };
        assert_eq!(Source::classify("/m/tokenizer.json", none), Ok(Source::Local("/m/tokenizer.json".into())));
        assert_eq!(Source::classify("file:///m/t.json", none), Ok(Source::Local("/m/t.json".into())));
        assert_eq!(Source::classify("file://localhost/m/t.json", none), Ok(Source::Local("/m/t.json".into())));
        // Read here, a host elsewhere would make `w/m/t.json` a path relative to the replica.
        assert!(matches!(Source::classify("file://w/m/t.json", none), Err(SourceError::Malformed(_))));
    }

    /// A card's URL may carry a password or a presigned query: errors and logs show neither.
    #[test]
    fn a_url_is_shown_without_userinfo_or_query() {
        let rows = [
            (
                "https://user:p4ss@mirror.internal:8443/m/t.json?X-Amz-Signature=abc",
                "https://mirror.internal:8443/m/t.json?…",
            ),
            ("http://w/t.json", "http://w/t.json"),
            ("not a uri user:p4ss@host/x?sig=abc", "host/x"),
        ];
        for (uri, expected) in rows {
            assert_eq!(shown(uri), expected);
        }
        let failed = fail("https://user:p4ss@mirror.internal/t.json?sig=abc", "status 403").to_string();
        assert!(!failed.contains("p4ss") && !failed.contains("sig=abc"), "{failed}");
    }

    #[test]
    fn remote_schemes_follow_the_policy() {
        assert!(matches!(Source::classify("http://10.0.0.1:9090/t.json", DEFAULTS), Ok(Source::Http(_))));
        let no_http = Schemes { allow_http: false, allow_hf: false };
        assert_eq!(Source::classify("https://w/t.json", no_http), Err(SourceError::Refused("http")));
        assert_eq!(Source::classify("hf://Qwen/Qwen3-0.6B/tokenizer.json", DEFAULTS), Err(SourceError::Refused("hf")));
        assert!(matches!(Source::classify("nats://x/bucket/t.json", ALL), Err(SourceError::Unsupported(_))));
    }

    #[tokio::test]
    async fn an_artifact_url_naming_the_metadata_service_is_not_fetched() {
        let fetcher = Fetcher::new(DEFAULT_HF_ENDPOINT.into(), None);
        for url in
            ["http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/latest", "http://[fe80::1]:80/t"]
        {
            let Ok(source) = Source::classify(url, DEFAULTS) else { panic!("{url} is an http:// artifact") };
            let refused = fetcher.fetch(&source).await.map(|bytes| bytes.len());
            assert!(
                matches!(&refused, Err(FetchError::Failed { reason, .. }) if reason.contains("may not reach")),
                "{url}: {refused:?}"
            );
        }
    }

    #[test]
    fn hf_uris_name_a_repo_revision_and_file() {
        assert_eq!(
            Source::classify("hf://Qwen/Qwen3-0.6B@a1b2/sub/tokenizer.json", ALL),
            Ok(Source::Hf {
                repo: "Qwen/Qwen3-0.6B".into(),
                revision: "a1b2".into(),
                file: "sub/tokenizer.json".into()
            })
        );
        for bad in [
            "hf://Qwen/tokenizer.json",
            "hf://Qwen/Q/../etc/passwd",
            "hf://Q w/r/f",
            "hf://a/b/",
            "hf://../..@../api/whoami-v2",
            "hf://Qwen/..@main/t.json",
            "hf://Qwen/Q@../t.json",
            "hf://./Q/t.json",
        ] {
            assert!(matches!(Source::classify(bad, ALL), Err(SourceError::Malformed(_))), "{bad}");
        }
        let fetcher = Fetcher::new("http://mirror:8080/".into(), None);
        assert_eq!(fetcher.hf_url("Qwen/Q", "main", "t.json"), "http://mirror:8080/Qwen/Q/resolve/main/t.json");
    }
}
