//! Choosing an engine by name, with options given as text (from a config file or
//! `TABLE.CREATE ... ENGINE name option value ...`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Capabilities, Engine, EngineError, FsyncPolicy, HybridEngine, HybridOptions, LogEngine, LogOptions,
    LsmEngine, MemoryEngine, OrderedEngine,
};
use crate::{RedisEngine, RedisOptions, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Memory,
    Ordered,
    Log,
    Lsm,
    Hybrid,
    Redis,
}

impl EngineKind {
    pub const ALL: [EngineKind; 6] =
        [Self::Memory, Self::Ordered, Self::Log, Self::Lsm, Self::Hybrid, Self::Redis];

    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Ordered => "ordered",
            Self::Log => "log",
            Self::Lsm => "lsm",
            Self::Hybrid => "hybrid",
            Self::Redis => "redis",
        }
    }

    /// What an engine of this kind can do, known before one is opened (a
    /// node decides from it whether its state outlives a restart).
    pub fn capabilities(self) -> Capabilities {
        match self {
            Self::Memory => MemoryEngine::CAPABILITIES,
            Self::Ordered => OrderedEngine::CAPABILITIES,
            Self::Log => LogEngine::CAPABILITIES,
            Self::Lsm => LsmEngine::CAPABILITIES,
            Self::Hybrid => HybridEngine::CAPABILITIES,
            Self::Redis => RedisEngine::CAPABILITIES,
        }
    }

    /// The options this engine accepts.
    pub fn option_names(self) -> &'static [&'static str] {
        match self {
            Self::Memory | Self::Ordered => &[],
            Self::Log => &["fsync", "segment-bytes"],
            Self::Lsm => &["fsync"],
            Self::Hybrid => &["fsync", "memory-bytes"],
            Self::Redis => &["addr", "db", "password", "pool", "timeout-ms", "owns-database"],
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = EngineError;

    fn from_str(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|kind| kind.name().eq_ignore_ascii_case(name)).ok_or_else(|| {
            EngineError::InvalidOption(format!(
                "unknown engine {name:?}; choose one of memory, ordered, log, lsm, hybrid, redis"
            ))
        })
    }
}

/// An engine and its options, checked when built so that opening cannot fail on
/// a typo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpec {
    pub kind: EngineKind,
    pub options: BTreeMap<String, String>,
}

fn parse_option<T: std::str::FromStr>(options: &BTreeMap<String, String>, name: &str) -> Result<Option<T>> {
    options
        .get(name)
        .map(|text| {
            text.parse()
                .map_err(|_| EngineError::InvalidOption(format!("option {name}: cannot use {text:?}")))
        })
        .transpose()
}

/// Parses a size as Redis's config does: bytes, or with a unit (`kb`, `mb`,
/// `gb` are 1024-based; `k`, `m`, `g` 1000-based), any case.
pub fn parse_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let digits_end = lower.find(|c: char| !c.is_ascii_digit()).unwrap_or(lower.len());
    let (number, unit) = lower.split_at(digits_end);
    let multiplier: u64 = match unit {
        "" | "b" => 1,
        "k" => 1_000,
        "kb" => 1 << 10,
        "m" => 1_000_000,
        "mb" => 1 << 20,
        "g" => 1_000_000_000,
        "gb" => 1 << 30,
        _ => return None,
    };
    number.parse::<u64>().ok()?.checked_mul(multiplier)
}

impl EngineSpec {
    pub fn new(kind: EngineKind, options: BTreeMap<String, String>) -> Result<Self> {
        let options: BTreeMap<String, String> =
            options.into_iter().map(|(name, value)| (name.to_ascii_lowercase(), value)).collect();
        if let Some(unknown) = options.keys().find(|name| !kind.option_names().contains(&name.as_str())) {
            return Err(EngineError::InvalidOption(format!(
                "engine {} has no option {unknown:?} (it takes: {})",
                kind.name(),
                kind.option_names().join(", ")
            )));
        }
        let spec = Self { kind, options };
        spec.log_options()?;
        spec.hybrid_options()?;
        spec.redis_options()?;
        Ok(spec)
    }

    fn fsync(&self) -> Result<FsyncPolicy> {
        Ok(parse_option(&self.options, "fsync")?.unwrap_or(FsyncPolicy::EveryMs(1000)))
    }

    fn log_options(&self) -> Result<LogOptions> {
        let defaults = LogOptions::default();
        Ok(LogOptions {
            fsync: self.fsync()?,
            segment_bytes_max: parse_option(&self.options, "segment-bytes")?
                .unwrap_or(defaults.segment_bytes_max),
            ..defaults
        })
    }

    fn hybrid_options(&self) -> Result<HybridOptions> {
        let defaults = HybridOptions::default();
        let memory_bytes = match self.options.get("memory-bytes") {
            None => defaults.memory_bytes,
            Some(text) => parse_size(text).ok_or_else(|| {
                EngineError::InvalidOption(format!(
                    "option memory-bytes: cannot use {text:?} (a size such as 64mb or 2gb)"
                ))
            })?,
        };
        let options = HybridOptions { memory_bytes, fsync: self.fsync()? };
        options.check()?;
        Ok(options)
    }

    fn redis_options(&self) -> Result<RedisOptions> {
        let defaults = RedisOptions::default();
        Ok(RedisOptions {
            address: self.options.get("addr").cloned().unwrap_or(defaults.address),
            database: parse_option(&self.options, "db")?.unwrap_or(defaults.database),
            password: self.options.get("password").cloned(),
            pool_size: parse_option(&self.options, "pool")?.unwrap_or(defaults.pool_size),
            timeout: parse_option(&self.options, "timeout-ms")?
                .map(Duration::from_millis)
                .unwrap_or(defaults.timeout),
            owns_database: match self.options.get("owns-database").map(|text| text.to_ascii_lowercase()) {
                None => defaults.owns_database,
                Some(text) if text == "yes" => true,
                Some(text) if text == "no" => false,
                Some(text) => {
                    return Err(EngineError::InvalidOption(format!(
                        "option owns-database: yes or no, not {text:?}"
                    )))
                }
            },
        })
    }

    /// Opens the engine, keeping any files in `dir`.
    pub fn open(&self, dir: &Path) -> Result<Arc<dyn Engine>> {
        Ok(match self.kind {
            EngineKind::Memory => Arc::new(MemoryEngine::new()),
            EngineKind::Ordered => Arc::new(OrderedEngine::new()),
            EngineKind::Log => Arc::new(LogEngine::open(dir, self.log_options()?)?),
            EngineKind::Lsm => Arc::new(LsmEngine::open(dir, self.fsync()?)?),
            EngineKind::Hybrid => Arc::new(HybridEngine::open(dir, self.hybrid_options()?)?),
            EngineKind::Redis => Arc::new(RedisEngine::open(self.redis_options()?)?),
        })
    }

    /// The address and database of a `redis` engine, which must not be shared
    /// by two tables.
    pub fn remote_database(&self) -> Option<(String, u32)> {
        let options = self.redis_options().ok()?;
        (self.kind == EngineKind::Redis).then_some((options.address, options.database))
    }
}
