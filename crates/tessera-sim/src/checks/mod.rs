//! The checkers, one property each, run on what a run recorded.

pub mod causal;
pub mod convergence;
pub mod durability;
pub mod linearizability;
