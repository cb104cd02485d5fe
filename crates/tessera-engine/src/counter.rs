//! A counter that many threads change on every operation: each thread adds
//! to a stripe of its own cache line, so the adds never contend; reading
//! sums the stripes.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

const STRIPES: usize = 64;

#[derive(Default)]
#[repr(align(128))]
struct Stripe(AtomicI64);

pub(crate) struct StripedCounter {
    stripes: [Stripe; STRIPES],
}

/// The stripe a thread adds to, handed out round-robin as threads first count.
fn stripe_of_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<Option<usize>> = const { Cell::new(None) };
    }
    STRIPE.with(|stripe| {
        stripe.get().unwrap_or_else(|| {
            let chosen = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
            stripe.set(Some(chosen));
            chosen
        })
    })
}

impl StripedCounter {
    pub(crate) fn new(value: i64) -> Self {
        let counter = Self { stripes: std::array::from_fn(|_| Stripe::default()) };
        counter.stripes[0].0.store(value, Ordering::Relaxed);
        counter
    }

    pub(crate) fn add(&self, amount: i64) {
        self.stripes[stripe_of_thread()].0.fetch_add(amount, Ordering::Relaxed);
    }

    /// Adds without a read-modify-write instruction, for statistics on the
    /// hot path: a locked add is a full barrier on x86, which would keep the
    /// processor from starting the next operation's memory accesses while
    /// this one's are in flight. Exact while no two threads share a stripe
    /// (up to `STRIPES` threads); beyond that, racing adds may be lost.
    pub(crate) fn add_statistic(&self, amount: i64) {
        let stripe = &self.stripes[stripe_of_thread()].0;
        stripe.store(stripe.load(Ordering::Relaxed).wrapping_add(amount), Ordering::Relaxed);
    }

    /// The sum of every add so far (adds racing with the read may be missed).
    pub(crate) fn sum(&self) -> i64 {
        self.stripes.iter().map(|stripe| stripe.0.load(Ordering::Relaxed)).sum()
    }

    /// Starts again from zero; adds racing with it may be lost.
    pub(crate) fn reset(&self) {
        for stripe in &self.stripes {
            stripe.0.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_adding_at_once_sum_to_every_add() {
        let counter = StripedCounter::new(5);
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| (0..10_000).for_each(|_| counter.add(1)));
            }
        });
        assert_eq!(counter.sum(), 80_005);
        counter.add(-6);
        assert_eq!(counter.sum(), 79_999);
        counter.reset();
        assert_eq!(counter.sum(), 0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| (0..10_000).for_each(|_| counter.add_statistic(1)));
            }
        });
        assert_eq!(counter.sum(), 40_000, "threads on stripes of their own lose nothing");
    }
}
