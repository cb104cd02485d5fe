//! Workload generation for `tessera bench`: the key choosers and operation mixes
//! of YCSB (Cooper et al., SoCC 2010), so that figures compare with what users
//! measure elsewhere.

pub mod cluster;
pub mod driver;
pub mod generator;
pub mod plot;
pub mod progress;
pub mod report;
pub mod workload;
