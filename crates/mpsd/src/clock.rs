//! The `Clock` seam of the supervisor: crash times, the crash window and restart backoff
//! are read from here, so tests drive time by hand. One implementation for the workspace,
//! in `tessera_api::time`.

pub use tessera_api::time::{Clock, ManualClock, SystemClock};
