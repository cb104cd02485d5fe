//! TLS for the cluster plane (Redis's `tls-cluster`): peer links run inside
//! mutual TLS, both sides presenting a certificate from the cluster's CA,
//! before the cluster-secret handshake. Also the PEM loading the node's
//! client port shares, and certificates for tests and local use. rustls
//! with the `ring` provider.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{0} is needed")]
    Missing(&'static str),
    #[error("cannot read {path}: {error}")]
    Pem { path: String, error: String },
    #[error("{0} holds no certificate")]
    NoCertificate(String),
    #[error("TLS settings refused: {0}")]
    Rustls(String),
    #[error("no TLS server name in {0}")]
    NoServerName(String),
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
}

fn rustls_error(error: impl std::fmt::Display) -> TlsError {
    TlsError::Rustls(error.to_string())
}

fn pem_error(path: &Path) -> impl FnOnce(rustls::pki_types::pem::Error) -> TlsError + '_ {
    move |error| TlsError::Pem { path: path.display().to_string(), error: error.to_string() }
}

/// Every certificate in a PEM file; at least one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(pem_error(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error(path))?;
    if certificates.is_empty() {
        return Err(TlsError::NoCertificate(path.display().to_string()));
    }
    Ok(certificates)
}

pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(pem_error(path))
}

/// The CAs of a PEM file, as trust anchors.
pub fn roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in certificates(path)? {
        roots.add(certificate).map_err(rustls_error)?;
    }
    Ok(Arc::new(roots))
}

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Both ends of mutual TLS for peer links, from a node's certificate and key
/// and the cluster's CA.
#[derive(Clone)]
pub struct PeerTls {
    pub acceptor: TlsAcceptor,
    pub connector: TlsConnector,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerTls")
    }
}

impl PeerTls {
    pub fn from_files(cert_file: &Path, key_file: &Path, ca_file: &Path) -> Result<Self, TlsError> {
        let (chain, roots) = (certificates(cert_file)?, roots(ca_file)?);
        let key = private_key(key_file)?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(rustls_error)?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(rustls_error)?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(rustls_error)?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }
}

impl PeerTls {
    /// TLS as the connecting side: the other side's certificate must name
    /// the host of `address`.
    pub async fn connect(&self, stream: TcpStream, address: &str) -> Result<MaybeTls, TlsError> {
        let name = server_name(address).ok_or_else(|| TlsError::NoServerName(address.to_string()))?;
        let stream = self.connector.connect(name, stream).await.map_err(TlsError::Handshake)?;
        Ok(MaybeTls::Tls(Box::new(stream.into())))
    }

    /// TLS as the accepting side: the other side must present a certificate
    /// from the cluster's CA.
    pub async fn accept(&self, stream: TcpStream) -> Result<MaybeTls, TlsError> {
        let stream = self.acceptor.accept(stream).await.map_err(TlsError::Handshake)?;
        Ok(MaybeTls::Tls(Box::new(stream.into())))
    }
}

/// `stream` under `tls` as the connecting side, or as it is without.
pub async fn connecting(
    tls: Option<&PeerTls>,
    stream: TcpStream,
    address: &str,
) -> Result<MaybeTls, TlsError> {
    match tls {
        Some(tls) => tls.connect(stream, address).await,
        None => Ok(MaybeTls::Plain(stream)),
    }
}

/// `stream` under `tls` as the accepting side, or as it is without.
pub async fn accepting(tls: Option<&PeerTls>, stream: TcpStream) -> Result<MaybeTls, TlsError> {
    match tls {
        Some(tls) => tls.accept(stream).await,
        None => Ok(MaybeTls::Plain(stream)),
    }
}

/// The name a peer's certificate must carry: the host part of its address.
pub fn server_name(address: &str) -> Option<ServerName<'static>> {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).ok()
}

fn certificate_params(names: Vec<String>, common_name: &str) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(names)?;
    let mut subject = DistinguishedName::new();
    subject.push(DnType::CommonName, common_name);
    params.distinguished_name = subject;
    Ok(params)
}

/// Writes a private CA and certificates it signed, PEM, for tests and local
/// deployments (`tessera tls-certs`): `ca.crt`/`ca.key`; `server.crt`/
/// `server.key` for `hosts` (names and IP addresses), good for a node's
/// client port and for both ends of a peer link (`tls_cluster`); and
/// `client.crt`/`client.key` for a client to present. Keys are mode 0600.
pub fn write_certificates(dir: &Path, hosts: &[String]) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
    let failed = |error: rcgen::Error| error.to_string();
    let ca_key = KeyPair::generate().map_err(failed)?;
    let mut ca_params = certificate_params(Vec::new(), "Tessera CA").map_err(failed)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = ca_params.self_signed(&ca_key).map_err(failed)?;
    let signed = |names: Vec<String>, common_name: &str, usages: Vec<ExtendedKeyUsagePurpose>| {
        let key = KeyPair::generate()?;
        let mut params = certificate_params(names, common_name)?;
        params.extended_key_usages = usages;
        Ok::<_, rcgen::Error>((params.signed_by(&key, &ca, &ca_key)?, key))
    };
    // A node accepts clients and peers, and connects to peers.
    let both = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let (server, server_key) = signed(hosts.to_vec(), "Tessera node", both).map_err(failed)?;
    let (client, client_key) =
        signed(Vec::new(), "Tessera client", vec![ExtendedKeyUsagePurpose::ClientAuth]).map_err(failed)?;
    for (name, text, private) in [
        ("ca.crt", ca.pem(), false),
        ("ca.key", ca_key.serialize_pem(), true),
        ("server.crt", server.pem(), false),
        ("server.key", server_key.serialize_pem(), true),
        ("client.crt", client.pem(), false),
        ("client.key", client_key.serialize_pem(), true),
    ] {
        let path = dir.join(name);
        let written = std::fs::write(&path, text).and_then(|()| {
            let mode = if private { 0o600 } else { 0o644 };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
        });
        written.map_err(|error| format!("{}: {error}", path.display()))?;
    }
    Ok(())
}

/// A connection, plain or under TLS (either side's).
pub enum MaybeTls {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl MaybeTls {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            MaybeTls::Plain(stream) => stream,
            MaybeTls::Tls(stream) => stream.get_ref().0,
        }
    }
}

impl AsyncRead for MaybeTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            MaybeTls::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MaybeTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            MaybeTls::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(stream) => Pin::new(stream).poll_flush(cx),
            MaybeTls::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            MaybeTls::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
