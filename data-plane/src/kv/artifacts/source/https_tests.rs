//! The fetcher against loopback servers: one speaking TLS with a certificate from a throwaway CA,
//! one speaking plain http, each counting the HTTP requests that reached it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::{FetchError, Fetcher, Source, TlsSetupError};

const ARTIFACT: &[u8] = b"{\"model\": {\"type\": \"BPE\"}, \"artifact\": \"served over tls\"}";

/// A CA (its PEM) and a TLS server configuration for 127.0.0.1 signed by it.
fn pki() -> (String, Arc<ServerConfig>) {
    let mut ca_params = CertificateParams::new(Vec::new()).unwrap();
    ca_params.distinguished_name.push(DnType::CommonName, "continuum artifact test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "artifact mirror");
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &*ca).unwrap();

    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let chain: Vec<CertificateDer<'static>> = vec![cert.der().clone()];
    let config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    (ca.pem(), Arc::new(config))
}

type Respond = Arc<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

/// Serves HTTP/1.1 on loopback (over TLS when given an acceptor), answering each request with
/// `respond(path)`. Returns the address and the number of requests that got through.
async fn serve(tls: Option<TlsAcceptor>, respond: Respond) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (tls, respond, counted) = (tls.clone(), respond.clone(), counted.clone());
            tokio::spawn(async move {
                match tls {
                    // A client that refuses the certificate ends the handshake; nothing to answer.
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(stream).await {
                            answer(stream, &*respond, &counted).await;
                        }
                    }
                    None => answer(stream, &*respond, &counted).await,
                }
            });
        }
    });
    (addr, requests)
}

async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    respond: &(dyn Fn(&str) -> Vec<u8> + Send + Sync),
    requests: &AtomicUsize,
) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    requests.fetch_add(1, Ordering::SeqCst);
    let head = String::from_utf8_lossy(&head);
    let path = head.split(' ').nth(1).unwrap_or("/");
    let _ = stream.write_all(&respond(path)).await;
    let _ = stream.shutdown().await;
}

fn ok(body: &[u8]) -> Vec<u8> {
    let mut response =
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len()).into_bytes();
    response.extend_from_slice(body);
    response
}

fn redirect(location: &str) -> Vec<u8> {
    format!("HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").into_bytes()
}

fn not_found() -> Vec<u8> {
    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec()
}

fn artifact_server() -> Respond {
    Arc::new(|path| if path == "/tokenizer.json" { ok(ARTIFACT) } else { not_found() })
}

fn http_source(uri: &str) -> Source {
    Source::Http(uri.parse().unwrap())
}

fn fetcher() -> Fetcher {
    Fetcher::new("http://127.0.0.1:9".into(), None)
}

#[tokio::test]
async fn https_artifact_is_fetched_when_its_ca_is_trusted() {
    let (ca_pem, server) = pki();
    let (addr, requests) = serve(Some(TlsAcceptor::from(server)), artifact_server()).await;
    let fetcher = fetcher().with_extra_roots(ca_pem.as_bytes()).unwrap();

    let bytes = fetcher.fetch(&http_source(&format!("https://{addr}/tokenizer.json"))).await.unwrap();
    assert_eq!(bytes, ARTIFACT);
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn https_artifact_from_an_unknown_issuer_is_refused() {
    let (_, server) = pki();
    let (addr, requests) = serve(Some(TlsAcceptor::from(server)), artifact_server()).await;

    // Only the Mozilla roots: the test CA is nobody they know.
    let result = fetcher().fetch(&http_source(&format!("https://{addr}/tokenizer.json"))).await;
    match result {
        Err(FetchError::Failed { reason, .. }) => assert!(reason.contains("UnknownIssuer"), "{reason}"),
        other => panic!("expected a certificate failure, got {other:?}"),
    }
    assert_eq!(requests.load(Ordering::SeqCst), 0, "no request may travel over an unverified connection");
}

#[tokio::test]
async fn redirect_from_https_down_to_http_is_refused() {
    let (ca_pem, server) = pki();
    let (plain, plain_requests) = serve(None, artifact_server()).await;
    let downgrade: Respond = Arc::new(move |path| match path {
        "/tokenizer.json" => redirect(&format!("http://{plain}/tokenizer.json")),
        _ => not_found(),
    });
    let (addr, tls_requests) = serve(Some(TlsAcceptor::from(server)), downgrade).await;
    let fetcher = fetcher().with_extra_roots(ca_pem.as_bytes()).unwrap();

    // The plain server does serve the artifact over http:// when asked directly.
    let direct = fetcher.fetch(&http_source(&format!("http://{plain}/tokenizer.json"))).await.unwrap();
    assert_eq!(direct, ARTIFACT);
    assert_eq!(plain_requests.load(Ordering::SeqCst), 1);

    let result = fetcher.fetch(&http_source(&format!("https://{addr}/tokenizer.json"))).await;
    match result {
        Err(FetchError::Failed { reason, .. }) => assert!(reason.contains("from https:// down to http://"), "{reason}"),
        other => panic!("expected the downgrade to be refused, got {other:?}"),
    }
    assert_eq!(tls_requests.load(Ordering::SeqCst), 1);
    assert_eq!(plain_requests.load(Ordering::SeqCst), 1, "the redirect target must not be contacted");
}

#[test]
fn extra_roots_must_hold_a_usable_ca_certificate() {
    assert!(matches!(fetcher().with_extra_roots(b"not pem at all"), Err(TlsSetupError::NoCertificates)));
    let key_only = KeyPair::generate().unwrap().serialize_pem();
    assert!(matches!(fetcher().with_extra_roots(key_only.as_bytes()), Err(TlsSetupError::NoCertificates)));
    let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    assert!(matches!(fetcher().with_extra_roots(broken.as_bytes()), Err(TlsSetupError::Anchor { index: 0, .. })));
    let (ca_pem, _) = pki();
    assert!(fetcher().with_extra_roots(ca_pem.as_bytes()).is_ok());
}
