//! TLS on the client port, with Redis's settings: `tls_port` (a second
//! listener beside the plain one), `tls_cert_file` and `tls_key_file` (the
//! node's certificate chain and key, PEM), `tls_ca_cert_file` (the CA whose
//! client certificates are accepted) and `tls_auth_clients` (`yes`: clients
//! must present one, `optional`: they may, `no`: they are not asked).
//! rustls with the `ring` provider; TLS 1.2 and 1.3.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::config::{AuthClients, Config};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls_port needs {0}")]
    Missing(&'static str),
    #[error("cannot read {path}: {error}")]
    Pem { path: String, error: String },
    #[error("{0} holds no certificate")]
    NoCertificate(String),
    #[error("TLS settings refused: {0}")]
    Rustls(String),
}

fn pem_error(path: &Path) -> impl FnOnce(rustls::pki_types::pem::Error) -> TlsError + '_ {
    move |error| TlsError::Pem { path: path.display().to_string(), error: error.to_string() }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(pem_error(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error(path))?;
    if certificates.is_empty() {
        return Err(TlsError::NoCertificate(path.display().to_string()));
    }
    Ok(certificates)
}

/// The acceptor for the TLS port, from the config's files; `None` without a
/// TLS port.
pub fn acceptor(config: &Config) -> Result<Option<TlsAcceptor>, TlsError> {
    if config.tls_port == 0 {
        return Ok(None);
    }
    let cert_file = config.tls_cert_file.as_deref().ok_or(TlsError::Missing("tls_cert_file"))?;
    let key_file = config.tls_key_file.as_deref().ok_or(TlsError::Missing("tls_key_file"))?;
    let chain = certificates(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(pem_error(key_file))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| TlsError::Rustls(error.to_string()))?;
    let verifier = match (config.tls_auth_clients, config.tls_ca_cert_file.as_deref()) {
        (AuthClients::No, _) => WebPkiClientVerifier::no_client_auth(),
        (_, None) => return Err(TlsError::Missing("tls_ca_cert_file (or tls_auth_clients = \"no\")")),
        (auth, Some(ca_file)) => {
            let mut roots = RootCertStore::empty();
            for certificate in certificates(ca_file)? {
                roots.add(certificate).map_err(|error| TlsError::Rustls(error.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier =
                if auth == AuthClients::Optional { verifier.allow_unauthenticated() } else { verifier };
            verifier.build().map_err(|error| TlsError::Rustls(error.to_string()))?
        }
    };
    let server = builder
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|error| TlsError::Rustls(error.to_string()))?;
    Ok(Some(TlsAcceptor::from(Arc::new(server))))
}

/// A client's connection, plain or under TLS.
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl ClientStream {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            ClientStream::Plain(stream) => stream,
            ClientStream::Tls(stream) => stream.get_ref().0,
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            ClientStream::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            ClientStream::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            ClientStream::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            ClientStream::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
