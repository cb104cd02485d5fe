//! The simulator's only source of randomness: SplitMix64, seeded once per run.
//! Small, fast, and stable across platforms and crate versions, so a seed
//! replays the same run everywhere.

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0);
        self.next_u64() % bound
    }

    /// Uniform in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }

    pub fn chance(&mut self, probability: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= probability && probability > 0.0
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A new generator for a sub-component, so that adding draws in one place
    /// does not shift every later draw elsewhere.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}
