//! TLS on the client port, with Redis's settings: `tls_port` (a second
//! listener beside the plain one), `tls_cert_file` and `tls_key_file` (the
//! node's certificate chain and key, PEM), `tls_ca_cert_file` (the CA whose
//! client certificates are accepted) and `tls_auth_clients` (`yes`: clients
//! must present one, `optional`: they may, `no`: they are not asked).
//! rustls with the `ring` provider; TLS 1.2 and 1.3.

use std::path::Path;
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
pub use tessera_cluster::tls::TlsError;
use tessera_cluster::tls::{certificates, private_key, provider, roots, PeerTls};
use tokio_rustls::TlsAcceptor;

use crate::config::{AuthClients, Config};

/// The acceptor for the TLS port, from the config's files; `None` without a
/// TLS port.
pub fn acceptor(config: &Config) -> Result<Option<TlsAcceptor>, TlsError> {
    if config.tls_port == 0 {
        return Ok(None);
    }
    let rustls_error = |error: rustls::Error| TlsError::Rustls(error.to_string());
    let (cert_file, key_file) = identity_files(config)?;
    let (chain, key) = (certificates(cert_file)?, private_key(key_file)?);
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(rustls_error)?;
    let verifier = match (config.tls_auth_clients, config.tls_ca_cert_file.as_deref()) {
        (AuthClients::No, _) => WebPkiClientVerifier::no_client_auth(),
        (_, None) => return Err(TlsError::Missing("tls_ca_cert_file (or tls_auth_clients = \"no\")")),
        (auth, Some(ca_file)) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(roots(ca_file)?, provider());
            let verifier =
                if auth == AuthClients::Optional { verifier.allow_unauthenticated() } else { verifier };
            verifier.build().map_err(|error| TlsError::Rustls(error.to_string()))?
        }
    };
    let server =
        builder.with_client_cert_verifier(verifier).with_single_cert(chain, key).map_err(rustls_error)?;
    Ok(Some(TlsAcceptor::from(Arc::new(server))))
}

/// Mutual TLS for the cluster plane from the same files, with
/// `tls_cluster`; `None` without.
pub fn peer_tls(config: &Config) -> Result<Option<PeerTls>, TlsError> {
    if !config.tls_cluster {
        return Ok(None);
    }
    let (cert_file, key_file) = identity_files(config)?;
    let ca_file = config.tls_ca_cert_file.as_deref().ok_or(TlsError::Missing("tls_ca_cert_file"))?;
    Ok(Some(PeerTls::from_files(cert_file, key_file, ca_file)?))
}

/// The node's certificate chain and key files.
fn identity_files(config: &Config) -> Result<(&Path, &Path), TlsError> {
    let cert_file = config.tls_cert_file.as_deref().ok_or(TlsError::Missing("tls_cert_file"))?;
    let key_file = config.tls_key_file.as_deref().ok_or(TlsError::Missing("tls_key_file"))?;
    Ok((cert_file, key_file))
}

/// A client's connection, plain or under TLS.
pub use tessera_cluster::tls::MaybeTls as ClientStream;
