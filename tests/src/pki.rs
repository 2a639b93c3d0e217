//! A throwaway certificate authority for TLS tests: a CA, a server certificate for loopback and
//! a client certificate, written as PEM files into a test's temporary directory.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// The host names the server certificate is valid for.
pub const SERVER_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

/// The PEM files of one CA and the two certificates it signed.
#[derive(Clone, Debug)]
pub struct Pki {
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Pki {
    /// Generates a fresh CA and its certificates into `dir` (created if missing).
    pub fn generate(dir: &Path) -> anyhow::Result<Self> {
        Self::generate_with_client_lifetime(dir, None)
    }

    /// [`Pki::generate`], with a client certificate valid for only `lifetime` from now.
    pub fn generate_with_client_lifetime(dir: &Path, lifetime: Option<std::time::Duration>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut ca_params = CertificateParams::new(Vec::new())?;
        ca_params.distinguished_name.push(DnType::CommonName, "continuum test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let pki = Self {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server-key.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client-key.pem"),
        };
        std::fs::write(&pki.ca_cert, ca.pem())?;
        // etcd also dials itself with the server certificate (its gRPC gateway), so it may
        // act as a client too.
        let server_usages = [ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        leaf(&ca, "etcd", &SERVER_NAMES, &server_usages, &pki.server_cert, &pki.server_key, None)?;
        let client_usages = [ExtendedKeyUsagePurpose::ClientAuth];
        leaf(&ca, "router", &[], &client_usages, &pki.client_cert, &pki.client_key, lifetime)?;
        Ok(pki)
    }
}

fn leaf(
    ca: &CertifiedIssuer<'_, KeyPair>,
    common_name: &str,
    names: &[&str],
    usages: &[ExtendedKeyUsagePurpose],
    cert_path: &Path,
    key_path: &Path,
    lifetime: Option<std::time::Duration>,
) -> anyhow::Result<()> {
    let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
    if let Some(lifetime) = lifetime {
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(1);
        params.not_after = now + lifetime;
    }
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages.to_vec();
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate()?;
    std::fs::write(cert_path, params.signed_by(&key, &**ca)?.pem())?;
    std::fs::write(key_path, key.serialize_pem())?;
    Ok(())
}
