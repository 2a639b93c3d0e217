//! Who a replica is to the control plane: the bearer token it presents on every Fleet call
//! when the control plane asks for one (`control_plane.token` there, `--control-plane-token`
//! here), and for an `https://` control plane the CA it trusts and its own certificate.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};
use tonic::{Request, Status};

#[derive(Clone, Default)]
pub struct Credentials(Option<MetadataValue<Ascii>>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the control-plane token must be visible ASCII without spaces")]
pub struct InvalidToken;

impl Credentials {
    /// `authorization: Bearer <token>`; the control plane refuses a token it could not have
    /// been configured with, so one is refused here before it is ever sent.
    pub fn bearer(token: &str) -> Result<Self, InvalidToken> {
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidToken);
        }
        let mut value = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| InvalidToken)?;
        value.set_sensitive(true);
        Ok(Self(Some(value)))
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    /// Its text carries the cause, so it names no source of its own.
    #[error("cannot read {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{path} holds no PEM {what}")]
    Content { path: PathBuf, what: &'static str },
}

/// How long a TLS handshake with the control plane may take.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// TLS to the control plane: trusting `ca` (the CA that signed its certificate), and presenting
/// `identity` (certificate and key PEM files) when it accepts only replicas it knows. Each file
/// is read and checked for what it must hold now, so a wrong one is named at start rather than
/// found at every connection. (Whether the key matches the certificate shows when a connection's
/// TLS is built from it, which a replica does at start.)
pub fn client_tls(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<ClientTlsConfig, TlsFileError> {
    let read = |path: &Path| std::fs::read(path).map_err(|error| TlsFileError::Read { path: path.into(), error });
    let lacks = |path: &Path, what| TlsFileError::Content { path: path.into(), what };
    let certificates = |path: &Path| {
        let pem = read(path)?;
        let any = CertificateDer::pem_slice_iter(&pem).any(|certificate| certificate.is_ok());
        if any { Ok(pem) } else { Err(lacks(path, "certificate")) }
    };
    // tonic's connect timeout bounds the TCP connect only: without this, a peer that accepts
    // and then says nothing (a frozen process, a silent middlebox) holds the handshake, and the
    // reconnect loop with it, until the kernel gives up on the connection.
    let mut tls =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(certificates(ca)?)).timeout(TLS_HANDSHAKE_TIMEOUT);
    if let Some((cert, key)) = identity {
        let key_pem = read(key)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| lacks(key, "private key"))?;
        tls = tls.identity(Identity::from_pem(certificates(cert)?, key_pem));
    }
    Ok(tls)
}

/// The replica's TLS files: the CA it trusts, and its own certificate and key when the control
/// plane asks for one. Read again at every connection, so renewed files are used without a
/// restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    pub fn load(&self) -> Result<ClientTlsConfig, TlsFileError> {
        client_tls(&self.ca, self.identity.as_ref().map(|(cert, key)| (cert.as_path(), key.as_path())))
    }

    /// What tells a renewal: each file's modification time and length (following links, as a
    /// kubelet's Secret volume swaps them).
    pub fn stamp(&self) -> Vec<Option<(SystemTime, u64)>> {
        let identity = self.identity.iter().flat_map(|(cert, key)| [cert, key]);
        std::iter::once(&self.ca)
            .chain(identity)
            .map(|path| std::fs::metadata(path).ok().and_then(|m| Some((m.modified().ok()?, m.len()))))
            .collect()
    }
}

/// TLS to the control plane: a configuration built once, or files read at every connection.
#[derive(Clone)]
pub enum ClientTls {
    Fixed(ClientTlsConfig),
    Files(TlsFiles),
}

impl ClientTls {
    pub fn config(&self) -> Result<ClientTlsConfig, TlsFileError> {
        match self {
            ClientTls::Fixed(config) => Ok(config.clone()),
            ClientTls::Files(files) => files.load(),
        }
    }
}

impl From<ClientTlsConfig> for ClientTls {
    fn from(config: ClientTlsConfig) -> Self {
        ClientTls::Fixed(config)
    }
}

/// Never prints the key (tonic's own Debug of a configuration would).
impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientTls::Fixed(_) => f.write_str("ClientTls::Fixed(..)"),
            ClientTls::Files(files) => f.debug_tuple("ClientTls::Files").field(files).finish(),
        }
    }
}

/// Never prints the token.
impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Credentials(Bearer ***)" } else { "Credentials(none)" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_sent_as_a_bearer_and_never_printed() {
        let mut credentials = Credentials::bearer("s3cret").expect("a valid token");
        let request = credentials.call(Request::new(())).expect("passed on");
        assert_eq!(request.metadata().get("authorization").and_then(|v| v.to_str().ok()), Some("Bearer s3cret"));
        assert!(!format!("{credentials:?}").contains("s3cret"));
        let request = Credentials::default().call(Request::new(())).expect("passed on");
        assert!(request.metadata().get("authorization").is_none(), "no token, no header");
        for bad in ["", "two words", "tab\t", "é"] {
            assert_eq!(Credentials::bearer(bad).map(|_| ()), Err(InvalidToken), "{bad:?}");
        }
    }
}
