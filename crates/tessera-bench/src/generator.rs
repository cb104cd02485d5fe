//! Key choosers, as YCSB defines them, so that a "zipfian workload A" here means
//! what it means in YCSB's reports.
//!
//! - uniform: every record equally likely.
//! - zipfian: Gray et al.'s method ("Quickly generating billion-record synthetic
//!   databases", SIGMOD 1994), as in YCSB's ZipfianGenerator: item i (0-based)
//!   has probability proportional to 1 / (i + 1)^θ.
//! - scrambled zipfian: the zipfian popularity, spread over the key space by a
//!   64-bit FNV hash so that popular keys are not neighbours (YCSB's default).
//! - latest: the newest records are the most popular (YCSB workload D).
//! - hotspot: a fraction of the keys receives a fraction of the operations.

use rand::Rng;

/// YCSB's default zipfian constant.
pub const ZIPFIAN_CONSTANT: f64 = 0.99;

/// The item count YCSB's scrambled zipfian draws from before hashing, and the
/// ζ of that count for θ = 0.99 (computing it takes 10^10 terms).
const SCRAMBLED_ITEMS: u64 = 10_000_000_000;
const SCRAMBLED_ZETA: f64 = 26.469_028_201_783_02;

/// ζ(n, θ) = Σ_{i=1..n} 1 / i^θ.
fn zeta(items: u64, theta: f64) -> f64 {
    (1..=items).map(|i| 1.0 / (i as f64).powf(theta)).sum()
}

/// YCSB's 64-bit FNV hash of an integer (its eight bytes, low first).
pub fn fnv_hash_64(mut value: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for _ in 0..8 {
        hash ^= value & 0xff;
        hash = hash.wrapping_mul(1_099_511_628_211);
        value >>= 8;
    }
    hash
}

/// Draws item numbers in `0..items` with zipfian popularity (0 the most popular).
#[derive(Clone, Debug)]
pub struct Zipfian {
    items: u64,
    theta: f64,
    alpha: f64,
    zeta_n: f64,
    eta: f64,
}

impl Zipfian {
    pub fn new(items: u64, theta: f64) -> Self {
        Self::with_zeta(items, theta, zeta(items, theta))
    }

    fn with_zeta(items: u64, theta: f64, zeta_n: f64) -> Self {
        assert!(items >= 2, "a zipfian needs at least two items");
        assert!(theta > 0.0 && theta < 1.0, "the zipfian constant must be in (0, 1)");
        let zeta_2 = zeta(2, theta);
        let eta = (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta_2 / zeta_n);
        Self { items, theta, alpha: 1.0 / (1.0 - theta), zeta_n, eta }
    }

    pub fn next(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.gen();
        let uz = u * self.zeta_n;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1;
        }
        let item = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        item.min(self.items - 1)
    }
}

/// How keys are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    Uniform,
    Zipfian { constant: f64 },
    Latest { constant: f64 },
    Hotspot { hot_keys: f64, hot_operations: f64 },
}

impl std::str::FromStr for Distribution {
    type Err = String;

    /// `uniform`, `zipfian[:θ]`, `latest[:θ]`, `hotspot[:keys,operations]`
    /// (fractions, default 0.2,0.8).
    fn from_str(text: &str) -> Result<Self, String> {
        let (name, argument) = text.split_once(':').map_or((text, None), |(name, arg)| (name, Some(arg)));
        let fraction = |text: &str| -> Result<f64, String> {
            text.trim()
                .parse::<f64>()
                .ok()
                .filter(|value| *value > 0.0 && *value < 1.0)
                .ok_or_else(|| format!("{text:?} must be a number strictly between 0 and 1"))
        };
        match name {
            "uniform" if argument.is_none() => Ok(Distribution::Uniform),
            "zipfian" => Ok(Distribution::Zipfian { constant: argument.map(fraction).transpose()?.unwrap_or(ZIPFIAN_CONSTANT) }),
            "latest" => Ok(Distribution::Latest { constant: argument.map(fraction).transpose()?.unwrap_or(ZIPFIAN_CONSTANT) }),
            "hotspot" => {
                let (hot_keys, hot_operations) = match argument {
                    None => (0.2, 0.8),
                    Some(argument) => {
                        let (keys, operations) = argument
                            .split_once(',')
                            .ok_or("hotspot takes two fractions: hotspot:KEYS,OPERATIONS")?;
                        (fraction(keys)?, fraction(operations)?)
                    }
                };
                Ok(Distribution::Hotspot { hot_keys, hot_operations })
            }
            _ => Err(format!(
                "unknown key distribution {text:?}; choose uniform, zipfian[:θ], latest[:θ] or hotspot[:keys,operations]"
            )),
        }
    }
}

/// Chooses record numbers for operations on existing records.
#[derive(Clone, Debug)]
pub enum KeyChooser {
    Uniform,
    /// Scrambled zipfian over the records.
    Zipfian(Zipfian),
    /// The newest records first: `records - 1 - zipfian`, the zipfian drawn over
    /// a window of the newest records. (YCSB recomputes ζ as the record count
    /// grows; a fixed window gives the same skew without a pass per insert.)
    Latest(Zipfian),
    Hotspot {
        hot_keys: u64,
        hot_operations: f64,
    },
}

impl KeyChooser {
    pub fn new(distribution: Distribution, records: u64) -> Self {
        assert!(records >= 2, "a workload needs at least two records");
        match distribution {
            Distribution::Uniform => KeyChooser::Uniform,
            Distribution::Zipfian { constant } if constant == ZIPFIAN_CONSTANT => {
                KeyChooser::Zipfian(Zipfian::with_zeta(SCRAMBLED_ITEMS, constant, SCRAMBLED_ZETA))
            }
            // ζ for another constant is computed over the records themselves.
            Distribution::Zipfian { constant } => KeyChooser::Zipfian(Zipfian::new(records, constant)),
            Distribution::Latest { constant } => KeyChooser::Latest(Zipfian::new(LATEST_WINDOW, constant)),
            Distribution::Hotspot { hot_keys, hot_operations } => KeyChooser::Hotspot {
                hot_keys: ((records as f64 * hot_keys) as u64).clamp(1, records - 1),
                hot_operations,
            },
        }
    }

    /// A record number in `0..records` (`records` may grow as inserts land).
    pub fn next(&self, records: u64, rng: &mut impl Rng) -> u64 {
        match self {
            KeyChooser::Uniform => rng.gen_range(0..records),
            KeyChooser::Zipfian(zipfian) => fnv_hash_64(zipfian.next(rng)) % records,
            KeyChooser::Latest(zipfian) => loop {
                let age = zipfian.next(rng);
                if age < records {
                    return records - 1 - age;
                }
            },
            KeyChooser::Hotspot { hot_keys, hot_operations } => {
                let hot = (*hot_keys).min(records - 1);
                if rng.gen_bool(*hot_operations) {
                    rng.gen_range(0..hot)
                } else {
                    rng.gen_range(hot..records)
                }
            }
        }
    }
}

/// "latest" draws its popularity over the newest this many records.
const LATEST_WINDOW: u64 = 10_000;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn histogram(chooser: &KeyChooser, records: u64, draws: usize) -> Vec<u64> {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut counts = vec![0u64; records as usize];
        for _ in 0..draws {
            let key = chooser.next(records, &mut rng);
            assert!(key < records);
            counts[key as usize] += 1;
        }
        counts
    }

    /// Pearson's χ² against expected counts.
    fn chi_squared(observed: &[u64], expected: &[f64]) -> f64 {
        observed.iter().zip(expected).map(|(o, e)| (*o as f64 - e).powi(2) / e).sum()
    }

    #[test]
    fn uniform_passes_a_chi_squared_test() {
        let records = 100;
        let draws = 200_000;
        let counts = histogram(&KeyChooser::new(Distribution::Uniform, records), records, draws);
        let expected = vec![draws as f64 / records as f64; records as usize];
        // 99 degrees of freedom: the 99.9th percentile of χ² is about 148.
        assert!(chi_squared(&counts, &expected) < 148.0);
    }

    #[test]
    fn zipfian_frequencies_follow_the_power_law() {
        let items = 1_000;
        let theta = 0.99;
        let zipfian = Zipfian::new(items, theta);
        let mut rng = SmallRng::seed_from_u64(11);
        let draws = 500_000;
        let mut counts = vec![0u64; items as usize];
        for _ in 0..draws {
            counts[zipfian.next(&mut rng) as usize] += 1;
        }
        let zeta_n = zeta(items, theta);
        // Gray et al.'s method is exact for the two most popular items ...
        for rank in [0usize, 1] {
            let expected = draws as f64 / ((rank + 1) as f64).powf(theta) / zeta_n;
            let observed = counts[rank] as f64;
            assert!(
                (observed - expected).abs() < 5.0 * expected.sqrt(),
                "rank {rank}: {observed} vs {expected:.0}"
            );
        }
        // ... and follows the distribution function closely for the rest.
        for top in [10u64, 100, 500] {
            let expected = zeta(top, theta) / zeta_n;
            let observed = counts[..top as usize].iter().sum::<u64>() as f64 / draws as f64;
            assert!(
                (observed - expected).abs() < 0.03,
                "top {top}: share {observed:.3}, expected {expected:.3}"
            );
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[10] > counts[500]);
    }

    #[test]
    fn scrambled_zipfian_is_skewed_but_spread_over_the_key_space() {
        let records = 1_000;
        let counts =
            histogram(&KeyChooser::new(Distribution::Zipfian { constant: 0.99 }, records), records, 200_000);
        let mut sorted = counts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top_ten: u64 = sorted[..10].iter().sum();
        assert!(top_ten > 200_000 / 10, "the hottest 1% of keys take over 10% of operations ({top_ten})");
        let hottest = counts.iter().enumerate().max_by_key(|(_, count)| **count).map(|(key, _)| key).unwrap();
        assert_ne!(hottest, 0, "scrambling moves the hottest item away from record 0");
        let untouched = counts.iter().filter(|count| **count == 0).count();
        assert!(untouched < 500, "the tail still reaches much of the key space ({untouched} untouched)");
    }

    #[test]
    fn latest_favours_the_newest_records() {
        let records = 10_000;
        let counts =
            histogram(&KeyChooser::new(Distribution::Latest { constant: 0.99 }, records), records, 100_000);
        let newest: u64 = counts[(records - 100) as usize..].iter().sum();
        let oldest: u64 = counts[..100].iter().sum();
        assert!(newest > 30_000, "the newest 1% take a large share ({newest})");
        assert!(oldest < newest / 20);
    }

    #[test]
    fn hotspot_sends_the_configured_share_to_the_hot_keys() {
        let records = 1_000;
        let chooser = KeyChooser::new(Distribution::Hotspot { hot_keys: 0.2, hot_operations: 0.8 }, records);
        let counts = histogram(&chooser, records, 100_000);
        let hot: u64 = counts[..200].iter().sum();
        let share = hot as f64 / 100_000.0;
        assert!((share - 0.8).abs() < 0.01, "hot share {share}");
    }

    #[test]
    fn distributions_parse_and_reject_nonsense() {
        assert_eq!("zipfian".parse::<Distribution>().unwrap(), Distribution::Zipfian { constant: 0.99 });
        assert_eq!("zipfian:0.5".parse::<Distribution>().unwrap(), Distribution::Zipfian { constant: 0.5 });
        assert_eq!(
            "hotspot:0.1,0.9".parse::<Distribution>().unwrap(),
            Distribution::Hotspot { hot_keys: 0.1, hot_operations: 0.9 }
        );
        for bad in ["zipf", "zipfian:1.5", "hotspot:0.1", "uniform:3", "latest:-1"] {
            assert!(bad.parse::<Distribution>().is_err(), "{bad}");
        }
    }

    #[test]
    fn fnv_spreads_neighbouring_integers() {
        let hashes: std::collections::BTreeSet<u64> = (0..10_000).map(fnv_hash_64).collect();
        assert_eq!(hashes.len(), 10_000);
        let low_buckets: std::collections::BTreeSet<u64> =
            (0..100).map(|value| fnv_hash_64(value) % 1000).collect();
        assert!(low_buckets.len() > 90, "neighbours land in different places");
    }
}
