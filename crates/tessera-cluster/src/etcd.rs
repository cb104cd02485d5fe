//! The cluster map in etcd, for several coordinators with one leader.
//!
//! Spoken over etcd's JSON gateway (`/v3/kv/range`, `/v3/kv/txn`,
//! `/v3/lease/*`), over HTTP or HTTPS (the CA and a client certificate given
//! with [`Etcd::with_tls`], for etcd's `--client-cert-auth`): keys and values travel base64-encoded, 64-bit
//! numbers as strings. Under the prefix `/tessera/<cluster-id>/`:
//!
//! - `map`: the map as JSON; its version is the key's `mod_revision`.
//! - `leader`: the leading coordinator's name, attached to its lease.
//!
//! Leadership: a coordinator grants itself a lease and creates `leader` with it
//! only if the key does not exist; it keeps the lease alive while it leads.
//! Every write of the map is a transaction that also compares `leader` with its
//! own name, so a coordinator whose lease ran out (paused, partitioned) can no
//! longer write: its store call fails and it stops deciding.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Value as Json};

use crate::map::{ClusterMap, MapError};
use crate::store::{MetadataStore, StoreError, Versioned};
use crate::tls::{self, TlsError};

/// An etcd cluster's client endpoints, tried in turn.
#[derive(Clone, Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    agent: ureq::Agent,
}

impl Etcd {
    /// `endpoints`: `host:port`, `http://host:port` or `https://host:port`,
    /// comma-separated.
    pub fn new(endpoints: &str) -> Result<Self, String> {
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|endpoint| !endpoint.is_empty())
            .map(|endpoint| {
                if endpoint.contains("://") {
                    endpoint.trim_end_matches('/').to_string()
                } else {
                    format!("http://{endpoint}")
                }
            })
            .collect();
        if endpoints.is_empty() {
            return Err("no etcd endpoint given".into());
        }
        Ok(Self { endpoints, agent: Self::agent().build() })
    }

    fn agent() -> ureq::AgentBuilder {
        ureq::AgentBuilder::new().timeout_connect(Duration::from_millis(500)).timeout(Duration::from_secs(3))
    }

    /// For `https://` endpoints signed by a private CA: trusts the CAs in
    /// `ca_file` (rather than the public roots) and presents `identity`
    /// (certificate, key) if etcd asks for a client certificate.
    pub fn with_tls(mut self, ca_file: &Path, identity: Option<(&Path, &Path)>) -> Result<Self, TlsError> {
        let roots = tls::roots(ca_file)?;
        let builder = rustls::ClientConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|error| TlsError::Rustls(error.to_string()))?
            .with_root_certificates(roots);
        let config = match identity {
            Some((certificate, key)) => builder
                .with_client_auth_cert(tls::certificates(certificate)?, tls::private_key(key)?)
                .map_err(|error| TlsError::Rustls(error.to_string()))?,
            None => builder.with_no_client_auth(),
        };
        self.agent = Self::agent().tls_config(Arc::new(config)).build();
        Ok(self)
    }

    /// Calls one gateway method on the first endpoint that answers.
    fn call(&self, method: &str, body: Json) -> Result<Json, StoreError> {
        let mut last = String::new();
        for endpoint in &self.endpoints {
            let url = format!("{endpoint}/v3/{method}");
            match self.agent.post(&url).send_json(body.clone()) {
                Ok(response) => {
                    return response.into_json().map_err(|error| StoreError::Io {
                        location: url,
                        message: format!("unreadable answer: {error}"),
                    })
                }
                // etcd answered with an error: another endpoint would say the same.
                Err(ureq::Error::Status(code, response)) => {
                    let text = response.into_string().unwrap_or_default();
                    return Err(StoreError::Io { location: url, message: format!("HTTP {code}: {text}") });
                }
                Err(error) => last = format!("{url}: {error}"),
            }
        }
        Err(StoreError::Io { location: "etcd".into(), message: format!("no endpoint answered ({last})") })
    }
}

fn encode(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// A 64-bit field, which the gateway writes as a string (and leaves out when 0).
fn number(value: &Json, field: &str) -> u64 {
    match value.get(field) {
        Some(Json::String(text)) => text.parse().unwrap_or(0),
        Some(Json::Number(number)) => number.as_u64().unwrap_or(0),
        _ => 0,
    }
}

/// The map of one cluster, kept in etcd.
pub struct EtcdStore {
    etcd: Etcd,
    map_key: String,
    leader_key: String,
    /// Writes also require that this coordinator still leads (see the module).
    leader_name: Option<String>,
}

impl EtcdStore {
    pub fn new(etcd: Etcd, cluster_id: &str) -> Self {
        let prefix = format!("/tessera/{cluster_id}/");
        Self {
            etcd,
            map_key: format!("{prefix}map"),
            leader_key: format!("{prefix}leader"),
            leader_name: None,
        }
    }

    /// Makes every write conditional on `name` holding the leadership.
    pub fn fenced_by(mut self, name: &str) -> Self {
        self.leader_name = Some(name.to_string());
        self
    }

    fn location(&self) -> String {
        format!("etcd {}", self.map_key)
    }

    /// Tries once to become the leader, with a lease of `ttl_secs`. Returns the
    /// lease to keep alive, or `None` if another coordinator leads.
    pub fn campaign(&self, name: &str, ttl_secs: u64) -> Result<Option<Lease>, StoreError> {
        let granted = self.etcd.call("lease/grant", json!({ "TTL": ttl_secs }))?;
        let lease = number(&granted, "ID");
        if lease == 0 {
            return Err(StoreError::Io {
                location: "etcd lease/grant".into(),
                message: format!("{granted}"),
            });
        }
        let key = encode(self.leader_key.as_bytes());
        let answer = self.etcd.call(
            "kv/txn",
            json!({
                "compare": [{ "key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0" }],
                "success": [{ "request_put": { "key": key, "value": encode(name.as_bytes()), "lease": lease.to_string() } }],
            }),
        )?;
        if answer.get("succeeded").and_then(Json::as_bool) == Some(true) {
            return Ok(Some(Lease { etcd: self.etcd.clone(), id: lease }));
        }
        let _ = self.etcd.call("lease/revoke", json!({ "ID": lease.to_string() }));
        Ok(None)
    }

    /// The name of the current leader, if any.
    pub fn leader(&self) -> Result<Option<String>, StoreError> {
        let answer = self.etcd.call("kv/range", json!({ "key": encode(self.leader_key.as_bytes()) }))?;
        let value = answer.get("kvs").and_then(|kvs| kvs.get(0)).and_then(|kv| kv.get("value"));
        Ok(value
            .and_then(Json::as_str)
            .and_then(|text| BASE64.decode(text).ok())
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
    }
}

impl MetadataStore for EtcdStore {
    fn load(&self) -> Result<Option<Versioned>, StoreError> {
        let answer = self.etcd.call("kv/range", json!({ "key": encode(self.map_key.as_bytes()) }))?;
        let Some(kv) = answer.get("kvs").and_then(|kvs| kvs.get(0)) else { return Ok(None) };
        let corrupt = |message: String| StoreError::Corrupt {
            location: self.location(),
            source: MapError::Invalid(message),
        };
        let bytes = kv
            .get("value")
            .and_then(Json::as_str)
            .and_then(|text| BASE64.decode(text).ok())
            .ok_or_else(|| corrupt("the stored value is not base64".into()))?;
        let text = String::from_utf8(bytes).map_err(|_| corrupt("the stored map is not UTF-8".into()))?;
        let map = ClusterMap::from_json(&text)
            .map_err(|source| StoreError::Corrupt { location: self.location(), source })?;
        Ok(Some(Versioned { version: number(kv, "mod_revision"), map }))
    }

    fn store(&self, expected: Option<u64>, map: &ClusterMap) -> Result<u64, StoreError> {
        map.validate().map_err(|source| StoreError::Corrupt { location: self.location(), source })?;
        let key = encode(self.map_key.as_bytes());
        let mut compare = vec![match expected {
            Some(revision) => {
                json!({ "key": key, "result": "EQUAL", "target": "MOD", "mod_revision": revision.to_string() })
            }
            None => json!({ "key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0" }),
        }];
        if let Some(name) = &self.leader_name {
            compare.push(json!({
                "key": encode(self.leader_key.as_bytes()), "result": "EQUAL", "target": "VALUE",
                "value": encode(name.as_bytes()),
            }));
        }
        let answer = self.etcd.call(
            "kv/txn",
            json!({
                "compare": compare,
                "success": [{ "request_put": { "key": key, "value": encode(map.to_json().as_bytes()) } }],
            }),
        )?;
        if answer.get("succeeded").and_then(Json::as_bool) == Some(true) {
            return Ok(number(answer.get("header").unwrap_or(&Json::Null), "revision"));
        }
        if let Some(name) = &self.leader_name {
            if self.leader()?.as_deref() != Some(name.as_str()) {
                return Err(StoreError::NotLeader(format!("{name} no longer holds {}", self.leader_key)));
            }
        }
        let found = self.load()?.map(|stored| stored.version);
        Err(StoreError::Conflict { expected, found })
    }
}

/// A coordinator's leadership lease; it lapses unless kept alive.
pub struct Lease {
    etcd: Etcd,
    id: u64,
}

impl Lease {
    /// Renews the lease; an error or a lapsed lease means leadership is lost.
    pub fn keep_alive(&self) -> Result<(), StoreError> {
        let answer = self.etcd.call("lease/keepalive", json!({ "ID": self.id.to_string() }))?;
        let result = answer.get("result").unwrap_or(&answer);
        if number(result, "TTL") == 0 {
            return Err(StoreError::NotLeader(format!("lease {:x} expired", self.id)));
        }
        Ok(())
    }

    /// Gives the leadership up at once (a clean shutdown).
    pub fn revoke(&self) {
        let _ = self.etcd.call("lease/revoke", json!({ "ID": self.id.to_string() }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_normalised_and_checked() {
        let etcd = Etcd::new("127.0.0.1:2379, http://10.0.0.2:2379/, https://secure:2379").unwrap();
        assert_eq!(
            etcd.endpoints,
            vec!["http://127.0.0.1:2379", "http://10.0.0.2:2379", "https://secure:2379"]
        );
        assert!(Etcd::new(" , ").is_err());
    }

    #[test]
    fn numbers_come_as_strings_or_not_at_all() {
        let value = json!({ "revision": "42", "count": 7 });
        assert_eq!(number(&value, "revision"), 42);
        assert_eq!(number(&value, "count"), 7);
        assert_eq!(number(&value, "absent"), 0);
    }
}
