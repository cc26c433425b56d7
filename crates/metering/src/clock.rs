//! The `Clock` seam: every timestamp the ledger stores comes from here, so tests drive
//! time by hand and GPU-seconds come out exact and instant.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// Where Linux publishes the id of the current boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// A source of time for the ledger.
///
/// Two readings: `wall_ms` (Unix milliseconds, what reports are windowed by; may jump when
/// NTP steps the clock) and `mono_ms` (milliseconds since boot, never jumps, counts
/// suspend; only comparable within one boot). A duration is taken from `mono_ms` when both
/// ends were read in the same boot, so `boot_id` is part of the seam too.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Unix time in milliseconds.
    fn wall_ms(&self) -> u64;
    /// Monotonic milliseconds since boot (CLOCK_BOOTTIME-like: comparable across
    /// process restarts within one boot, not across boots).
    fn mono_ms(&self) -> u64;
    /// An id that changes on every boot, so the ledger can tell whether two `mono_ms`
    /// readings are comparable. The default reads the kernel's boot id.
    fn boot_id(&self) -> String {
        read_boot_id(Path::new(BOOT_ID_PATH))
    }
}

/// Reads a boot id file (`/proc/sys/kernel/random/boot_id` or a test fixture). When it
/// cannot be read the result is `unknown-boot-<wall-ms>-<pid>`, fixed for the life of the
/// process and unique per process start, so durations then fall back to wall-clock deltas
/// instead of trusting mono readings that might come from different boots.
pub fn read_boot_id(path: &Path) -> String {
    use std::sync::OnceLock;
    static FALLBACK: OnceLock<String> = OnceLock::new();
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
        _ => FALLBACK
            .get_or_init(|| format!("unknown-boot-{}-{}", system_wall_ms(), std::process::id()))
            .clone(),
    }
}

fn system_wall_ms() -> u64 {
    tessera_api::time::now_ms()
}

/// The real clock: `SystemTime` for wall time, `CLOCK_BOOTTIME` for monotonic time, the
/// kernel's boot id from [`BOOT_ID_PATH`]. (To inject another boot id, implement [`Clock`]
/// on a wrapper; [`ManualClock`] carries its own.)
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn wall_ms(&self) -> u64 {
        system_wall_ms()
    }

    fn mono_ms(&self) -> u64 {
        boottime_ms()
    }
}

/// Milliseconds of CLOCK_BOOTTIME: monotonic, counts suspend, shared by every process of
/// this boot (unlike `Instant`, whose origin is unspecified).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn boottime_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, exclusively borrowed timespec that lives across the call;
    // clock_gettime only writes into it. CLOCK_BOOTTIME exists since Linux 2.6.39.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return fallback_mono_ms();
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1000).saturating_add(nanos / 1_000_000)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn boottime_ms() -> u64 {
    fallback_mono_ms()
}

/// Monotonic within this process only. Used where CLOCK_BOOTTIME is unavailable; the
/// boot id then is per process too (see `read_boot_id`), so no cross-process mono delta
/// is ever trusted.
fn fallback_mono_ms() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static ANCHOR: OnceLock<Instant> = OnceLock::new();
    let anchor = ANCHOR.get_or_init(Instant::now);
    u64::try_from(anchor.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A clock moved by hand, for tests and simulations.
#[derive(Debug)]
pub struct ManualClock {
    wall: AtomicU64,
    mono: AtomicU64,
    boot: Mutex<String>,
}

impl ManualClock {
    /// A clock reading `wall_ms` / `mono_ms`, in boot `manual-boot-0`.
    pub fn new(wall_ms: u64, mono_ms: u64) -> Self {
        ManualClock {
            wall: AtomicU64::new(wall_ms),
            mono: AtomicU64::new(mono_ms),
            boot: Mutex::new("manual-boot-0".to_string()),
        }
    }

    /// Moves both readings forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.wall.fetch_add(ms, Ordering::SeqCst);
        self.mono.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets both readings.
    pub fn set(&self, wall_ms: u64, mono_ms: u64) {
        self.wall.store(wall_ms, Ordering::SeqCst);
        self.mono.store(mono_ms, Ordering::SeqCst);
    }

    /// Steps only the wall clock (an NTP step), leaving monotonic time alone.
    pub fn set_wall(&self, wall_ms: u64) {
        self.wall.store(wall_ms, Ordering::SeqCst);
    }

    /// Simulates a reboot: a new boot id and monotonic time restarting at `mono_ms`.
    pub fn reboot(&self, boot_id: &str, mono_ms: u64) {
        *self.boot.lock().unwrap_or_else(PoisonError::into_inner) = boot_id.to_string();
        self.mono.store(mono_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn wall_ms(&self) -> u64 {
        self.wall.load(Ordering::SeqCst)
    }

    fn mono_ms(&self) -> u64 {
        self.mono.load(Ordering::SeqCst)
    }

    fn boot_id(&self) -> String {
        self.boot.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_by_hand() {
        let c = ManualClock::new(1_000, 5);
        c.advance(250);
        assert_eq!((c.wall_ms(), c.mono_ms()), (1_250, 255));
        c.set_wall(9_000);
        assert_eq!((c.wall_ms(), c.mono_ms()), (9_000, 255));
        assert_eq!(c.boot_id(), "manual-boot-0");
        c.reboot("b1", 0);
        assert_eq!((c.boot_id().as_str(), c.mono_ms()), ("b1", 0));
    }

    #[test]
    fn system_clock_is_monotonic_and_boot_ids_are_read() {
        let c = SystemClock;
        let a = c.mono_ms();
        let b = c.mono_ms();
        assert!(b >= a);
        assert!(c.wall_ms() > 1_600_000_000_000);
        assert!(!c.boot_id().is_empty());
        assert_eq!(c.boot_id(), c.boot_id(), "stable within a boot");
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("boot_id");
        std::fs::write(&p, "abc-123\n").expect("write");
        assert_eq!(read_boot_id(&p), "abc-123");
        assert!(read_boot_id(&dir.path().join("nope")).starts_with("unknown-boot-"));
    }
}
