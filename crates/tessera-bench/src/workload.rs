//! Operation mixes: YCSB's core workloads A–F, W (write only, as in SCID's
//! evaluation), the HPC mixes of BespoKV's evaluation, and mixes given on the
//! command line.

use rand::Rng;

use crate::generator::{Distribution, ZIPFIAN_CONSTANT};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OperationKind {
    Read,
    Update,
    Insert,
    Scan,
    ReadModifyWrite,
}

impl OperationKind {
    pub const ALL: [OperationKind; 5] = [
        OperationKind::Read,
        OperationKind::Update,
        OperationKind::Insert,
        OperationKind::Scan,
        OperationKind::ReadModifyWrite,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OperationKind::Read => "read",
            OperationKind::Update => "update",
            OperationKind::Insert => "insert",
            OperationKind::Scan => "scan",
            OperationKind::ReadModifyWrite => "rmw",
        }
    }
}

/// The share of each operation kind; the shares add up to 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Mix {
    shares: Vec<(OperationKind, f64)>,
}

impl Mix {
    pub fn new(shares: &[(OperationKind, f64)]) -> Result<Self, String> {
        if shares.iter().any(|(_, share)| !(0.0..=1.0).contains(share)) {
            return Err("each share must be between 0 and 1".into());
        }
        let total: f64 = shares.iter().map(|(_, share)| share).sum();
        if (total - 1.0).abs() > 1e-9 {
            return Err(format!("the shares add up to {total}, not 1"));
        }
        Ok(Self { shares: shares.iter().copied().filter(|(_, share)| *share > 0.0).collect() })
    }

    /// Parses `read=0.5,update=0.5` (kinds: read, update, insert, scan, rmw).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut shares = Vec::new();
        for part in text.split(',') {
            let (name, share) = part
                .split_once('=')
                .ok_or_else(|| format!("expected KIND=SHARE in the mix, got {part:?}"))?;
            let kind =
                OperationKind::ALL.into_iter().find(|kind| kind.name() == name.trim()).ok_or_else(|| {
                    format!("unknown operation {name:?}; choose read, update, insert, scan, rmw")
                })?;
            let share: f64 = share.trim().parse().map_err(|_| format!("share {share:?} is not a number"))?;
            if shares.iter().any(|(other, _)| *other == kind) {
                return Err(format!("{name} appears twice in the mix"));
            }
            shares.push((kind, share));
        }
        Self::new(&shares)
    }

    pub fn share(&self, kind: OperationKind) -> f64 {
        self.shares.iter().find(|(other, _)| *other == kind).map_or(0.0, |(_, share)| *share)
    }

    pub fn next(&self, rng: &mut impl Rng) -> OperationKind {
        let mut point: f64 = rng.gen();
        for (kind, share) in &self.shares {
            if point < *share {
                return *kind;
            }
            point -= share;
        }
        self.shares.last().expect("a mix has at least one share").0
    }
}

/// A named workload: its mix and how it picks keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub name: String,
    pub mix: Mix,
    pub distribution: Distribution,
    /// Scans read a uniform number of records in `1..=scan_length_max`.
    pub scan_length_max: u64,
}

impl Workload {
    /// YCSB's core workloads A–F and W (write only).
    pub fn named(name: &str) -> Result<Self, String> {
        use OperationKind::*;
        let zipfian = Distribution::Zipfian { constant: ZIPFIAN_CONSTANT };
        let (shares, distribution): (&[(OperationKind, f64)], Distribution) =
            match name.to_ascii_uppercase().as_str() {
                "A" => (&[(Read, 0.5), (Update, 0.5)], zipfian),
                "B" => (&[(Read, 0.95), (Update, 0.05)], zipfian),
                "C" => (&[(Read, 1.0)], zipfian),
                "D" => (&[(Read, 0.95), (Insert, 0.05)], Distribution::Latest { constant: ZIPFIAN_CONSTANT }),
                "E" => (&[(Scan, 0.95), (Insert, 0.05)], zipfian),
                "F" => (&[(Read, 0.5), (ReadModifyWrite, 0.5)], zipfian),
                "W" => (&[(Update, 1.0)], zipfian),
                // BespoKV's HPC workloads (section VIII-A): job launch's control
                // messages are gets and the compute nodes' results puts, half
                // each; I/O forwarding (file-system metadata) reads 62%.
                "JOBLAUNCH" => (&[(Read, 0.5), (Update, 0.5)], Distribution::Uniform),
                "IOFORWARD" => (&[(Read, 0.62), (Update, 0.38)], Distribution::Uniform),
                _ => {
                    return Err(format!(
                        "unknown workload {name:?}; choose A, B, C, D, E, F, W, joblaunch or ioforward, \
                         or give a --mix"
                    ))
                }
            };
        Ok(Self {
            name: name.to_ascii_uppercase(),
            mix: Mix::new(shares)?,
            distribution,
            scan_length_max: 100,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn core_workloads_have_ycsbs_mixes() {
        let a = Workload::named("a").unwrap();
        assert_eq!((a.mix.share(OperationKind::Read), a.mix.share(OperationKind::Update)), (0.5, 0.5));
        let d = Workload::named("D").unwrap();
        assert_eq!(d.mix.share(OperationKind::Insert), 0.05);
        assert!(matches!(d.distribution, Distribution::Latest { .. }));
        assert_eq!(Workload::named("E").unwrap().mix.share(OperationKind::Scan), 0.95);
        assert_eq!(Workload::named("F").unwrap().mix.share(OperationKind::ReadModifyWrite), 0.5);
        assert!(Workload::named("Z").is_err());
        let io = Workload::named("ioforward").unwrap();
        assert_eq!((io.mix.share(OperationKind::Read), io.mix.share(OperationKind::Update)), (0.62, 0.38));
        assert_eq!(Workload::named("JobLaunch").unwrap().mix.share(OperationKind::Read), 0.5);
    }

    #[test]
    fn drawn_operations_match_the_shares() {
        let mix = Mix::parse("read=0.62,update=0.38").unwrap();
        let mut rng = SmallRng::seed_from_u64(3);
        let draws = 100_000;
        let reads = (0..draws).filter(|_| mix.next(&mut rng) == OperationKind::Read).count();
        let share = reads as f64 / draws as f64;
        assert!((share - 0.62).abs() < 0.01, "read share {share}");
    }

    #[test]
    fn bad_mixes_are_clear_errors() {
        assert!(Mix::parse("read=0.5,update=0.4").unwrap_err().contains("add up"));
        assert!(Mix::parse("read=0.5,read=0.5").unwrap_err().contains("twice"));
        assert!(Mix::parse("write=1").unwrap_err().contains("unknown operation"));
        assert!(Mix::parse("read").unwrap_err().contains("KIND=SHARE"));
        assert!(Mix::parse("read=x").unwrap_err().contains("not a number"));
    }
}
