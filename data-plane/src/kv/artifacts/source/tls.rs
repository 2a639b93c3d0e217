//! Whom the artifact client trusts: the Mozilla roots compiled in (webpki-roots, so no system
//! certificate store is read) plus, for private mirrors, the CA certificates of an operator's
//! PEM bundle. The crypto provider is ring, named explicitly so the choice never depends on
//! which rustls providers other crates in the binary happen to enable.

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};

#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("the extra CA bundle is not valid PEM: {0}")]
    Pem(String),
    #[error("the extra CA bundle holds no CERTIFICATE block")]
    NoCertificates,
    #[error("certificate {index} of the extra CA bundle cannot be a trust anchor: {reason}")]
    Anchor { index: usize, reason: String },
    #[error("the artifact client's TLS configuration was refused: {0}")]
    Config(String),
}

/// The Mozilla roots.
pub fn mozilla_roots() -> RootCertStore {
    RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() }
}

/// Adds every `CERTIFICATE` block of `pem` to `roots`; other blocks (a key pasted into the
/// bundle by mistake) are skipped. All or nothing: on error `roots` is left as it was.
pub fn add_pem_roots(roots: &mut RootCertStore, pem: &[u8]) -> Result<(), TlsSetupError> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsSetupError::Pem(e.to_string()))?;
    if certificates.is_empty() {
        return Err(TlsSetupError::NoCertificates);
    }
    let mut extended = roots.clone();
    for (index, certificate) in certificates.into_iter().enumerate() {
        extended.add(certificate).map_err(|e| TlsSetupError::Anchor { index, reason: e.to_string() })?;
    }
    *roots = extended;
    Ok(())
}

/// TLS 1.2 and 1.3 with ring, certificates verified against `roots`, no client certificate.
pub fn client_config(roots: RootCertStore) -> Result<ClientConfig, TlsSetupError> {
    let config = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}
