//! A cluster as a file (`tessera cluster up --config FILE`): what `up`'s
//! flags say, plus the tables to create with their engines and modes. The
//! dashboard's designer writes such files (docs/OPERATIONS.md, "Cluster
//! designer").

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// The file's keys; each overrides the flag of the same name.
#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Design {
    pub nodes: Option<u32>,
    pub replicas: Option<usize>,
    pub groups: Option<usize>,
    pub topology: Option<String>,
    pub consistency: Option<String>,
    pub datacenters: Option<usize>,
    pub engine: Option<String>,
    pub base_port: Option<u16>,
    pub threads: Option<usize>,
    pub lease_ms: Option<u64>,
    pub failure_timeout_ms: Option<u64>,
    pub metrics_base_port: Option<u16>,
    pub dashboard_port: Option<u16>,
    #[serde(default)]
    pub tables: Vec<DesignedTable>,
}

/// A table to create once the cluster serves.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DesignedTable {
    pub name: String,
    pub prefix: String,
    pub engine: String,
    /// Its mode, if not the cluster's.
    pub topology: Option<String>,
    pub consistency: Option<String>,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

impl Design {
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|error| format!("{}: {error}", path.display()))?;
        let design: Self = toml::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))?;
        for table in &design.tables {
            if table.name.is_empty() || table.prefix.is_empty() {
                return Err(format!("{}: every table needs a name and a prefix", path.display()));
            }
        }
        Ok(design)
    }
}

impl DesignedTable {
    /// The commands that create it: TABLE.CREATE, then TABLE.ALTER when
    /// its mode is not the cluster's.
    pub fn commands(&self) -> Vec<Vec<String>> {
        let mut create = vec!["TABLE.CREATE".into(), self.name.clone(), "PREFIX".into(), self.prefix.clone()];
        create.extend(["ENGINE".into(), self.engine.clone()]);
        for (name, value) in &self.options {
            create.extend([name.clone(), value.clone()]);
        }
        let mut commands = vec![create];
        if self.topology.is_some() || self.consistency.is_some() {
            let mut alter = vec!["TABLE.ALTER".into(), self.name.clone()];
            if let Some(topology) = &self.topology {
                alter.extend(["TOPOLOGY".into(), topology.clone()]);
            }
            if let Some(consistency) = &self.consistency {
                alter.extend(["CONSISTENCY".into(), consistency.clone()]);
            }
            commands.push(alter);
        }
        commands
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_design_reads_the_cluster_and_its_tables_and_refuses_what_it_does_not_know() {
        let text = r#"
            nodes = 4
            consistency = "eventual"
            [[tables]]
            name = "events"
            prefix = "ev:"
            engine = "lsm"
            topology = "aa"
            options = { fsync = "always" }
        "#;
        let design: Design = toml::from_str(text).unwrap();
        assert_eq!((design.nodes, design.consistency.as_deref()), (Some(4), Some("eventual")));
        assert_eq!(
            design.tables[0].commands(),
            vec![
                ["TABLE.CREATE", "events", "PREFIX", "ev:", "ENGINE", "lsm", "fsync", "always"]
                    .map(String::from)
                    .to_vec(),
                ["TABLE.ALTER", "events", "TOPOLOGY", "aa"].map(String::from).to_vec(),
            ]
        );
        assert!(toml::from_str::<Design>("nodes = 3\nnode = 4\n").is_err(), "a misspelt key");
    }
}
