//! `tessera tls-certs`: a private CA and certificates signed by it, for TLS
//! on a node's client port (`tls_port`) in tests and local deployments.
//! Production deployments bring certificates from their own CA.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

fn params(names: Vec<String>, common_name: &str) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::new(names).map_err(|error| error.to_string())?;
    let mut subject = DistinguishedName::new();
    subject.push(DnType::CommonName, common_name);
    params.distinguished_name = subject;
    Ok(params)
}

/// Writes a file readable by its owner only (keys) or by anyone (certificates).
fn write(dir: &Path, name: &str, text: &str, private: bool) -> Result<(), String> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(|error| format!("{}: {error}", path.display()))?;
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|error| format!("{}: {error}", path.display()))?;
    }
    Ok(())
}

/// `ca.crt`/`ca.key`, `server.crt`/`server.key` for `hosts` (names and IP
/// addresses), and `client.crt`/`client.key` for a client to present.
pub fn generate(dir: &Path, hosts: &[String]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
    let failed = |error: rcgen::Error| error.to_string();
    let ca_key = KeyPair::generate().map_err(failed)?;
    let mut ca_params = params(Vec::new(), "Tessera CA")?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = ca_params.self_signed(&ca_key).map_err(failed)?;

    let server_key = KeyPair::generate().map_err(failed)?;
    let mut server_params = params(hosts.to_vec(), "Tessera node")?;
    server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server = server_params.signed_by(&server_key, &ca, &ca_key).map_err(failed)?;

    let client_key = KeyPair::generate().map_err(failed)?;
    let mut client_params = params(Vec::new(), "Tessera client")?;
    client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = client_params.signed_by(&client_key, &ca, &ca_key).map_err(failed)?;

    write(dir, "ca.crt", &ca.pem(), false)?;
    write(dir, "ca.key", &ca_key.serialize_pem(), true)?;
    write(dir, "server.crt", &server.pem(), false)?;
    write(dir, "server.key", &server_key.serialize_pem(), true)?;
    write(dir, "client.crt", &client.pem(), false)?;
    write(dir, "client.key", &client_key.serialize_pem(), true)?;
    Ok(())
}
