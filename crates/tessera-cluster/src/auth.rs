//! Who may speak on the cluster plane (docs/ARCHITECTURE.md, "Who may speak on
//! the cluster plane"): a secret every node and coordinator of a cluster
//! shares, and the mutual challenge–response that opens every peer link,
//! coordinator session and forwarding link between nodes.
//!
//! ```text
//! connecting side                          accepting side
//!   hello: cluster, who, nonce_c   ──►
//!                                  ◄──   challenge: who, nonce_a, proof_a
//!   proof_c                        ──►
//! proof_a = HMAC(secret, "accept" | cluster | who_c | who_a | nonce_c | nonce_a)
//! proof_c = HMAC(secret, "connect" | ...the same transcript...)
//! ```
//!
//! Each side's proof is over both nonces, so neither can be replayed on
//! another connection, and under its own label, so neither side's proof
//! serves as the other's. Comparisons take constant time.

use std::io::Write as _;
use std::path::Path;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tessera_wire::Value;

/// Bytes of a nonce and of a proof.
pub const NONCE_BYTES: usize = 32;
pub const PROOF_BYTES: usize = 32;
const SECRET_BYTES: usize = 32;

/// The secret a cluster's processes share.
#[derive(Clone)]
pub struct ClusterSecret([u8; SECRET_BYTES]);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not a cluster secret (64 hexadecimal digits)")]
    Malformed { path: String },
    #[error("{path}: readable by others (mode {mode:o}); chmod 600 it")]
    Exposed { path: String, mode: u32 },
}

impl ClusterSecret {
    pub fn generate() -> Self {
        let mut bytes = [0; SECRET_BYTES];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self(bytes)
    }

    /// Reads a secret written by [`Self::save`]; a file others may read is
    /// refused, as ssh refuses such a key.
    pub fn load(path: &Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let io = |source| SecretError::Io { path: shown.clone(), source };
        let mode = std::fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed { path: shown, mode });
        }
        let text = std::fs::read(path).map_err(io)?;
        from_hex::<SECRET_BYTES>(text.trim_ascii()).map(Self).ok_or(SecretError::Malformed { path: shown })
    }

    /// Writes the secret to a new file only its owner may read.
    pub fn save(&self, path: &Path) -> Result<(), SecretError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| SecretError::Io { path: path.display().to_string(), source };
        let mut file =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io)?;
        writeln!(file, "{}", to_hex(&self.0)).and_then(|()| file.sync_all()).map_err(io)
    }

    fn proof(&self, label: &[u8], transcript: &Transcript) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(label);
        for part in
            [transcript.cluster.as_bytes(), transcript.connecting.as_bytes(), transcript.accepting.as_bytes()]
        {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac.update(&transcript.connecting_nonce);
        mac.update(&transcript.accepting_nonce);
        mac
    }

    /// The accepting side's proof.
    pub fn accepting_proof(&self, transcript: &Transcript) -> [u8; PROOF_BYTES] {
        self.proof(ACCEPTING, transcript).finalize().into_bytes().into()
    }

    /// The connecting side's proof.
    pub fn connecting_proof(&self, transcript: &Transcript) -> [u8; PROOF_BYTES] {
        self.proof(CONNECTING, transcript).finalize().into_bytes().into()
    }

    /// Whether `proof` is the accepting side's, in constant time.
    pub fn verify_accepting(&self, transcript: &Transcript, proof: &[u8]) -> bool {
        self.proof(ACCEPTING, transcript).verify_slice(proof).is_ok()
    }

    /// Whether `proof` is the connecting side's, in constant time.
    pub fn verify_connecting(&self, transcript: &Transcript, proof: &[u8]) -> bool {
        self.proof(CONNECTING, transcript).verify_slice(proof).is_ok()
    }
}

impl ClusterSecret {
    fn token_seal(&self, datacenter: u32, context: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(CAUSAL_TOKEN);
        mac.update(&[TOKEN_FORMAT]);
        mac.update(&datacenter.to_le_bytes());
        mac.update(context);
        mac
    }

    /// A causal session's context (as [`tessera_protocol::CausalContext::encode`]
    /// writes it) sealed for the clients of `datacenter`, whose stable times
    /// it names: hex of format | datacenter | context | seal.
    pub fn seal_token(&self, datacenter: u32, context: &[u8]) -> String {
        let seal = self.token_seal(datacenter, context).finalize().into_bytes();
        let mut token = vec![TOKEN_FORMAT];
        token.extend_from_slice(&datacenter.to_le_bytes());
        token.extend_from_slice(context);
        token.extend_from_slice(&seal[..TOKEN_SEAL_BYTES]);
        to_hex(&token)
    }

    /// The context a token sealed for `datacenter` carries: one this
    /// cluster's secret did not seal, or sealed for another datacenter, is
    /// refused.
    pub fn open_token(&self, datacenter: u32, token: &[u8]) -> Result<Vec<u8>, TokenError> {
        if token.len() > 2 * TOKEN_BYTES_MAX {
            return Err(TokenError::Malformed);
        }
        let raw = hex_to_bytes(token).ok_or(TokenError::Malformed)?;
        if raw.len() < 1 + 4 + TOKEN_SEAL_BYTES || raw[0] != TOKEN_FORMAT {
            return Err(TokenError::Malformed);
        }
        let (sealed, seal) = raw.split_at(raw.len() - TOKEN_SEAL_BYTES);
        let sealed_for = u32::from_le_bytes(sealed[1..5].try_into().expect("4 bytes"));
        let context = &sealed[5..];
        if self.token_seal(sealed_for, context).verify_truncated_left(seal).is_err() {
            return Err(TokenError::Forged);
        }
        if sealed_for != datacenter {
            return Err(TokenError::OtherDatacenter(sealed_for));
        }
        Ok(context.to_vec())
    }
}

/// Why a causal token is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a causal token")]
    Malformed,
    #[error("a causal token this cluster did not make")]
    Forged,
    #[error("a causal token from datacenter {0}, whose stable times mean nothing here")]
    OtherDatacenter(u32),
}

const CAUSAL_TOKEN: &[u8] = b"tessera causal token";
const TOKEN_FORMAT: u8 = 1;
/// Bytes of a token's seal: a truncated HMAC-SHA256.
const TOKEN_SEAL_BYTES: usize = 16;
/// The longest token taken, in bytes before hex.
pub const TOKEN_BYTES_MAX: usize = 1 << 20;

const ACCEPTING: &[u8] = b"tessera cluster plane: accepting side";
const CONNECTING: &[u8] = b"tessera cluster plane: connecting side";

/// What both proofs of one handshake are over. Identities are names a side
/// goes by: a node id in decimal, or `admin`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transcript {
    pub cluster: String,
    pub connecting: String,
    pub accepting: String,
    pub connecting_nonce: [u8; NONCE_BYTES],
    pub accepting_nonce: [u8; NONCE_BYTES],
}

impl Transcript {
    /// The accepting side's half of a handshake, on a hello from
    /// `connecting` with `connecting_nonce`: a fresh nonce of its own.
    pub fn answering(
        cluster: &str,
        connecting: &str,
        accepting: &str,
        connecting_nonce: [u8; NONCE_BYTES],
    ) -> Self {
        Self {
            cluster: cluster.to_string(),
            connecting: connecting.to_string(),
            accepting: accepting.to_string(),
            connecting_nonce,
            accepting_nonce: nonce(),
        }
    }
}

/// The name the coordinator goes by in a handshake.
pub const COORDINATOR: &str = "coordinator";
/// The name an operator's tool goes by with the coordinator.
pub const ADMIN: &str = "admin";
/// The name a node goes by when another node's forwarding link logs in to it.
pub const RELAY_TARGET: &str = "relay-target";

/// Where a RESP login goes: the coordinator (`COORD.HELLO`, `COORD.AUTH`),
/// or a node that runs what another node forwards (`RELAY.HELLO`,
/// `RELAY.AUTH`: a relay acts for the cluster, its clients checked where
/// they connected).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginTo {
    Coordinator,
    Relay,
}

impl LoginTo {
    /// The hello and the auth command.
    fn commands(self) -> (&'static [u8], &'static [u8]) {
        match self {
            LoginTo::Coordinator => (b"COORD.HELLO", b"COORD.AUTH"),
            LoginTo::Relay => (b"RELAY.HELLO", b"RELAY.AUTH"),
        }
    }

    /// The name the accepting side goes by.
    pub fn accepting(self) -> &'static str {
        match self {
            LoginTo::Coordinator => COORDINATOR,
            LoginTo::Relay => RELAY_TARGET,
        }
    }
}

/// The connecting side of a RESP login: the hello, then, once the other
/// side has proved it knows the secret, the auth.
pub struct Login {
    to: LoginTo,
    cluster: String,
    identity: String,
    nonce: [u8; NONCE_BYTES],
}

#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("refused: {0}")]
    Refused(String),
    #[error("answered the login with something else")]
    Malformed,
    #[error("could not prove it knows the cluster secret")]
    Unproven,
}

impl Login {
    /// `identity`: a node id, or [`ADMIN`] with the coordinator.
    pub fn new(to: LoginTo, cluster: &str, identity: &str) -> Self {
        Self { to, cluster: cluster.to_string(), identity: identity.to_string(), nonce: nonce() }
    }

    pub fn hello(&self) -> Vec<Vec<u8>> {
        vec![
            self.to.commands().0.to_vec(),
            self.cluster.as_bytes().to_vec(),
            self.identity.as_bytes().to_vec(),
            to_hex(&self.nonce).into_bytes(),
        ]
    }

    /// The auth command answering the challenge, if the challenge proves the
    /// other side knows `secret`.
    pub fn auth(&self, secret: &ClusterSecret, challenge: Value) -> Result<Vec<Vec<u8>>, LoginError> {
        let items = match challenge {
            Value::Error(message) => return Err(LoginError::Refused(message)),
            other => other.into_items().ok_or(LoginError::Malformed)?,
        };
        let [nonce, proof] = items.as_slice() else { return Err(LoginError::Malformed) };
        let accepting_nonce =
            nonce.as_bytes().and_then(from_hex::<NONCE_BYTES>).ok_or(LoginError::Malformed)?;
        let proof = proof.as_bytes().and_then(from_hex::<PROOF_BYTES>).ok_or(LoginError::Malformed)?;
        let transcript = Transcript {
            cluster: self.cluster.clone(),
            connecting: self.identity.clone(),
            accepting: self.to.accepting().to_string(),
            connecting_nonce: self.nonce,
            accepting_nonce,
        };
        if !secret.verify_accepting(&transcript, &proof) {
            return Err(LoginError::Unproven);
        }
        Ok(vec![self.to.commands().1.to_vec(), to_hex(&secret.connecting_proof(&transcript)).into_bytes()])
    }

    /// Whether the answer to the auth opened the session.
    pub fn accepted(answer: Value) -> Result<(), LoginError> {
        match answer {
            Value::Simple(_) => Ok(()),
            Value::Error(message) => Err(LoginError::Refused(message)),
            _ => Err(LoginError::Malformed),
        }
    }
}

/// A fresh nonce from the operating system.
pub fn nonce() -> [u8; NONCE_BYTES] {
    let mut bytes = [0; NONCE_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes
}

/// Lowercase hex, for nonces and proofs in RESP.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(2 * bytes.len());
    for byte in bytes {
        text.push(DIGITS[usize::from(byte >> 4)] as char);
        text.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
    text
}

/// The bytes of `N` written as lowercase hex (as [`to_hex`] writes them), if
/// that is exactly what `text` is.
pub fn from_hex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    hex_to_bytes(text)?.try_into().ok()
}

/// The bytes `text` writes in lowercase hex, if that is what it is.
fn hex_to_bytes(text: &[u8]) -> Option<Vec<u8>> {
    let digit = |byte: u8| match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    };
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_open_only_with_the_secret_and_in_their_datacenter() {
        let (secret, other) = (ClusterSecret::generate(), ClusterSecret::generate());
        let token = secret.seal_token(1, b"context");
        assert_eq!(secret.open_token(1, token.as_bytes()), Ok(b"context".to_vec()));
        assert_eq!(secret.open_token(0, token.as_bytes()), Err(TokenError::OtherDatacenter(1)));
        assert_eq!(other.open_token(1, token.as_bytes()), Err(TokenError::Forged));
        let mut raw = hex_to_bytes(token.as_bytes()).unwrap();
        raw[6] ^= 1;
        assert_eq!(
            secret.open_token(1, to_hex(&raw).as_bytes()),
            Err(TokenError::Forged),
            "a changed context"
        );
        raw[6] ^= 1;
        raw[1] = 0;
        assert_eq!(secret.open_token(0, to_hex(&raw).as_bytes()), Err(TokenError::Forged), "a moved token");
        for malformed in [&b""[..], b"zz", b"01", &token.as_bytes()[..token.len() - 1]] {
            assert_eq!(secret.open_token(1, malformed), Err(TokenError::Malformed), "{malformed:?}");
        }
    }

    fn transcript() -> Transcript {
        Transcript {
            cluster: "c1".into(),
            connecting: "3".into(),
            accepting: "coordinator".into(),
            connecting_nonce: nonce(),
            accepting_nonce: nonce(),
        }
    }

    #[test]
    fn each_side_proves_only_its_own_part_of_one_handshake() {
        let secret = ClusterSecret::generate();
        let transcript = transcript();
        let accepting = secret.accepting_proof(&transcript);
        let connecting = secret.connecting_proof(&transcript);
        assert!(secret.verify_accepting(&transcript, &accepting));
        assert!(secret.verify_connecting(&transcript, &connecting));
        assert!(!secret.verify_connecting(&transcript, &accepting), "one side's proof is not the other's");
        assert!(!secret.verify_accepting(&transcript, &connecting));
        let other = ClusterSecret::generate();
        assert!(!other.verify_accepting(&transcript, &accepting), "another secret");
        for changed in [
            Transcript { cluster: "c2".into(), ..transcript.clone() },
            Transcript { connecting: "4".into(), ..transcript.clone() },
            Transcript { accepting_nonce: nonce(), ..transcript.clone() },
            // Parts are length-prefixed: moving a byte between them changes the proof.
            Transcript { cluster: "c13".into(), connecting: "".into(), ..transcript.clone() },
        ] {
            assert!(!secret.verify_accepting(&changed, &accepting), "{changed:?}");
        }
        assert!(!secret.verify_accepting(&transcript, &accepting[..31]), "a truncated proof");
    }

    #[test]
    fn secrets_are_kept_private_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.secret");
        let secret = ClusterSecret::generate();
        secret.save(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let transcript = transcript();
        let loaded = ClusterSecret::load(&path).unwrap();
        assert!(loaded.verify_accepting(&transcript, &secret.accepting_proof(&transcript)));
        assert!(secret.save(&path).is_err(), "an existing secret is never overwritten");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(ClusterSecret::load(&path), Err(SecretError::Exposed { mode: 0o644, .. })));
        let short = dir.path().join("short");
        std::fs::write(&short, "abcd\n").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(ClusterSecret::load(&short), Err(SecretError::Malformed { .. })));
        assert!(matches!(ClusterSecret::load(&dir.path().join("none")), Err(SecretError::Io { .. })));
        assert_eq!(format!("{secret:?}"), "ClusterSecret(..)", "never printed");
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let bytes = nonce();
        assert_eq!(from_hex::<NONCE_BYTES>(to_hex(&bytes).as_bytes()), Some(bytes));
        assert_eq!(from_hex::<2>(b"0g00"), None);
        assert_eq!(from_hex::<2>(b"+f00"), None, "a sign is not a digit");
        assert_eq!(from_hex::<2>(b"AB00"), None, "lowercase only");
        assert_eq!(from_hex::<2>(b"000"), None);
        assert_eq!(from_hex::<2>("é00".as_bytes()), None);
    }
}
