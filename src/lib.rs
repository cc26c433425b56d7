//! Presentation helpers shared by the `tessera` command line. The binaries in `src/bin`
//! are thin: the work lives in the `crates/` libraries.

pub mod doctor;
pub mod engines;
pub mod render;
pub mod setup;
pub mod timespec;
