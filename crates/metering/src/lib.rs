//! Tessera metering: a durable per-container GPU-seconds ledger in SQLite, roll-ups up
//! the tenant tree (`org/team/project/user`), and usage reports.
//!
//! - [`Ledger`]: one row per (container, device) interval. The daemon calls
//!   [`Ledger::open_interval`] at prestart, [`Ledger::close_container`] at poststop (or
//!   from its reconciler) and [`Ledger::checkpoint`] every <= 5 s. A node crash loses at
//!   most one checkpoint period (<= 10 s) of GPU-seconds per running interval; reopening
//!   the ledger closes every interval left open at its last checkpoint, exactly once.
//! - Durations are monotonic (CLOCK_BOOTTIME) deltas within one boot, wall deltas across
//!   boots; GPU-seconds = duration x [`fraction()`] of the device.
//! - [`Ledger::usage`] clips intervals to a window, groups them by a level of the tenant
//!   tree and bills them ([`bill`]: floors by reservation, bursts by consumption, the
//!   topology premium, showback or chargeback per path); [`UsageReport::to_json`] and
//!   [`UsageReport::to_csv`] are byte-stable. [`idle`] names the whole GPUs held far below
//!   what they offer, with the MIG profile that fits.
//! - Closed intervals form a hash chain ([`chain`]); [`Ledger::verify_chain`] names the
//!   first row that does not verify.
//! - Time comes only from the [`Clock`] seam: [`SystemClock`] in the daemon,
//!   [`ManualClock`] in tests.
//!
//! ```
//! use std::sync::Arc;
//! use metering::{Class, GroupBy, IntervalStart, Ledger, ManualClock, Prices, UsageQuery};
//! use tessera_api::Isolation;
//!
//! let clock = Arc::new(ManualClock::new(1_767_225_600_000, 0));
//! let mut ledger = Ledger::open_in_memory(clock.clone())?;
//! ledger.open_interval(&IntervalStart {
//!     container_id: "c1".into(),
//!     tenant: "acme/ml/vision/alice".into(),
//!     node: "node-a".into(),
//!     gpu_uuid: "GPU-0".into(),
//!     gpu_model: "H100-80GB".into(),
//!     device_uuid: "MIG-0".into(),
//!     isolation: Isolation::Mig,
//!     mig_profile: Some("3g.40gb".into()),
//!     fraction: metering::fraction(Isolation::Mig, Some(3), None, None, None),
//!     class: Class::Guaranteed,
//!     workload: None,
//!     nvlink_domain: None,
//! })?;
//! clock.advance(70_000);
//! ledger.checkpoint()?;
//! let closed = ledger.close_container("c1", "poststop")?;
//! assert_eq!(closed[0].gpu_seconds, 30.0); // 70 s x 3/7
//! let report = ledger.usage(&UsageQuery::new(
//!     1_767_225_600_000,
//!     1_767_225_600_000 + 3_600_000,
//!     GroupBy::Team,
//!     Prices::default(),
//! ))?;
//! assert_eq!(report.rows[0].group, "acme/ml");
//! assert_eq!(report.total.gpu_seconds, 30.0);
//! # Ok::<(), metering::LedgerError>(())
//! ```

pub mod bill;
pub mod chain;
mod clock;
mod error;
mod fraction;
pub mod idle;
mod interval;
mod ledger;
mod report;
mod span;

pub use bill::{Mode, Preempted, Terms};
pub use chain::{ChainBreak, ChainHead, ChainLink};
pub use clock::{read_boot_id, Clock, ManualClock, SystemClock, BOOT_ID_PATH};
pub use error::LedgerError;
pub use fraction::{fraction, try_fraction, FractionError, MIG_SLICES_PER_GPU};
pub use idle::Suggestion;
pub use interval::{
    validate_tenant, Class, ClosedInterval, IntervalEnd, IntervalId, IntervalRecord, IntervalStart,
    Utilization, MAX_TENANT_SEGMENTS, POSTSTOP_REASON, RECOVERED_REASON,
};
pub use ledger::{
    ChainReport, Ledger, LedgerOptions, Synchronous, APPLICATION_ID, MAX_PROBLEMS, SCHEMA_VERSION,
};
pub use report::{
    aggregate, floor_group, GroupBy, LevelTotal, Prices, Rate, Span, UsageQuery, UsageReport,
    UsageRow, CSV_HEADER,
};
