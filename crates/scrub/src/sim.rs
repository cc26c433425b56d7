//! The simulated scrubber: device memory is a file in the simulated backend's state
//! (`<state>/sim/mem/<uuid>.bin`), which sim-mode injection bind-mounts into a container at
//! `/dev/tessera-sim-mem`. A tenant writes into it; the scrub must erase it.
//!
//! The file is opened with `O_NOFOLLOW` and checked to be a regular file on the opened
//! descriptor, so a symlink or a device node planted in its place is refused, never
//! followed; its size must be the same after the scrub.
//!
//! Faults are injected per device uuid, from [`FaultInjection`] given at construction and
//! from a JSON file re-read at every scrub (`<state>/sim/scrub-faults.json`, see
//! [`SimScrubber::FAULTS_FILE`]) so an operator or a test can toggle them at run time:
//!
//! ```json
//! {"devices": {"MIG-…": "leave_nonzero", "GPU-…": "error"}}
//! ```

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::ScrubError;
use crate::report::{ScrubReport, BACKEND_SIM};
use crate::Scrubber;

/// How an injected fault shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Zero the memory, then leave a word non-zero (a stuck cell): the verify pass finds it.
    LeaveNonzero,
    /// Fail before touching the memory.
    Error,
    /// Zero and verify only the first half: a clean report whose coverage is too low.
    Partial,
    /// Sleep for an hour before scrubbing: only useful through the scrub child, whose
    /// timeout must kill it.
    Hang,
}

/// Faults to inject, by device uuid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultInjection {
    #[serde(default)]
    pub devices: BTreeMap<String, FaultMode>,
}

impl FaultInjection {
    /// Read a faults file; a missing file injects nothing, a malformed one is an error
    /// (and so fails the scrub: better a quarantined device than a skipped fault).
    pub fn load(path: &Path) -> Result<FaultInjection, ScrubError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(FaultInjection::default()),
            Err(e) => return Err(ScrubError::io(path)(e)),
        };
        serde_json::from_str(&text)
            .map_err(|e| ScrubError::Faults { path: path.to_path_buf(), message: e.to_string() })
    }

    /// Write a faults file atomically (for tests and operators' tools).
    pub fn save(&self, path: &Path) -> Result<(), ScrubError> {
        let json = serde_json::to_vec_pretty(self)
            .map_err(|e| ScrubError::Faults { path: path.to_path_buf(), message: e.to_string() })?;
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, json).map_err(ScrubError::io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(ScrubError::io(path))
    }

    pub fn mode_for(&self, device: &str) -> Option<FaultMode> {
        self.devices.get(device).copied()
    }
}

type Locator = Arc<dyn Fn(&str) -> PathBuf + Send + Sync>;

/// Scrubs simulated device memory files.
#[derive(Clone)]
pub struct SimScrubber {
    locate: Locator,
    faults: FaultInjection,
    faults_file: Option<PathBuf>,
}

impl std::fmt::Debug for SimScrubber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimScrubber")
            .field("faults", &self.faults)
            .field("faults_file", &self.faults_file)
            .finish_non_exhaustive()
    }
}

/// The file name of the memory of `uuid` under `mem_dir`, as the simulated backend names
/// it (`slicer::sim::SimBackend::memory_file`): characters other than ASCII letters,
/// digits and `-` become `_`, so the path never leaves `mem_dir`.
pub fn sim_memory_file(mem_dir: &Path, uuid: &str) -> PathBuf {
    let safe: String =
        uuid.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    mem_dir.join(format!("{safe}.bin"))
}

impl SimScrubber {
    /// The faults file's name inside the simulated backend's `sim` directory.
    pub const FAULTS_FILE: &'static str = "scrub-faults.json";

    /// A scrubber for the simulated backend whose state is `sim_dir` (`<state>/sim`):
    /// memory files in `sim_dir/mem`, faults from `sim_dir/scrub-faults.json`.
    pub fn in_sim_dir(sim_dir: &Path) -> SimScrubber {
        let mem_dir = sim_dir.join("mem");
        SimScrubber {
            locate: Arc::new(move |uuid| sim_memory_file(&mem_dir, uuid)),
            faults: FaultInjection::default(),
            faults_file: Some(sim_dir.join(Self::FAULTS_FILE)),
        }
    }

    /// A scrubber that finds each device's file with `locate` (pass the backend's
    /// `memory_file`), with no faults file.
    pub fn with_locator(locate: impl Fn(&str) -> PathBuf + Send + Sync + 'static) -> SimScrubber {
        SimScrubber {
            locate: Arc::new(locate),
            faults: FaultInjection::default(),
            faults_file: None,
        }
    }

    /// A scrubber for one file whatever the device (`tessera scrub --sim-mem FILE`).
    pub fn single_file(path: &Path) -> SimScrubber {
        let path = path.to_path_buf();
        SimScrubber::with_locator(move |_| path.clone())
    }

    /// Faults injected whatever the faults file says (the file's entries win).
    pub fn with_faults(mut self, faults: FaultInjection) -> SimScrubber {
        self.faults = faults;
        self
    }

    /// Re-read faults from `path` at every scrub.
    pub fn with_faults_file(mut self, path: Option<PathBuf>) -> SimScrubber {
        self.faults_file = path;
        self
    }

    /// The memory file of `uuid`.
    pub fn memory_file(&self, uuid: &str) -> PathBuf {
        (self.locate)(uuid)
    }

    fn fault_for(&self, uuid: &str) -> Result<Option<FaultMode>, ScrubError> {
        if let Some(path) = &self.faults_file {
            if let Some(mode) = FaultInjection::load(path)?.mode_for(uuid) {
                return Ok(Some(mode));
            }
        }
        Ok(self.faults.mode_for(uuid))
    }
}

impl Scrubber for SimScrubber {
    fn backend(&self) -> &'static str {
        BACKEND_SIM
    }

    fn scrub(&self, device_uuid: &str) -> Result<ScrubReport, ScrubError> {
        let fault = self.fault_for(device_uuid)?;
        match fault {
            Some(FaultMode::Error) => {
                return Err(ScrubError::Injected { device: device_uuid.to_string() })
            }
            Some(FaultMode::Hang) => std::thread::sleep(Duration::from_secs(3600)),
            _ => {}
        }
        let path = self.memory_file(device_uuid);
        let started = Instant::now();
        let file = open_memory_file(&path)?;
        let total = file.metadata().map_err(ScrubError::io(&path))?.len();
        let covered = if fault == Some(FaultMode::Partial) { (total / 2) & !3 } else { total };

        let t0 = Instant::now();
        zero_range(&file, &path, covered)?;
        if fault == Some(FaultMode::LeaveNonzero) && covered >= 4 {
            file.write_all_at(&0xDEAD_BEEFu32.to_le_bytes(), 0).map_err(ScrubError::io(&path))?;
        }
        file.sync_all().map_err(ScrubError::io(&path))?;
        let zero_seconds = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let nonzero_words = count_nonzero_words(&file, &path, covered)?;
        let verify_seconds = t1.elapsed().as_secs_f64();

        let after = file.metadata().map_err(ScrubError::io(&path))?.len();
        if after != total {
            return Err(ScrubError::SizeChanged { path, before: total, after });
        }
        Ok(ScrubReport {
            device: device_uuid.to_string(),
            backend: BACKEND_SIM.to_string(),
            ok: false,
            error: None,
            bytes_covered: covered,
            bytes_total: total,
            nonzero_words,
            seconds: started.elapsed().as_secs_f64(),
            gbps: 0.0,
            zero_seconds,
            verify_seconds,
            zero_gbps: 0.0,
            verify_gbps: 0.0,
            chunks: 1,
            finished_unix_s: 0,
        }
        .finish())
    }
}

/// Open `path` read-write without following a symlink in its last component, and check
/// on the descriptor that it is a regular file.
pub(crate) fn open_memory_file(path: &Path) -> Result<File, ScrubError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        // O_NONBLOCK: opening a FIFO planted in place of the file must not block; it
        // is refused by the check below.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                ScrubError::NotRegularFile { path: path.to_path_buf(), kind: "symlink" }
            } else {
                ScrubError::io(path)(e)
            }
        })?;
    let ft = file.metadata().map_err(ScrubError::io(path))?.file_type();
    if !ft.is_file() {
        let kind = if ft.is_dir() {
            "directory"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_char_device() || ft.is_block_device() {
            "device"
        } else if ft.is_socket() {
            "socket"
        } else {
            "not a file"
        };
        return Err(ScrubError::NotRegularFile { path: path.to_path_buf(), kind });
    }
    Ok(file)
}

const BLOCK: usize = 1 << 20;

fn zero_range(file: &File, path: &Path, len: u64) -> Result<(), ScrubError> {
    let zeros = vec![0u8; BLOCK];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(BLOCK as u64) as usize;
        file.write_all_at(&zeros[..n], off).map_err(ScrubError::io(path))?;
        off += n as u64;
    }
    Ok(())
}

/// Count the non-zero 32-bit words in the first `len` bytes (a trailing partial word
/// counts as one if any of its bytes is non-zero).
pub(crate) fn count_nonzero_words(file: &File, path: &Path, len: u64) -> Result<u64, ScrubError> {
    count_words(file, path, len, |w| w != 0)
}

pub(crate) fn count_words(
    file: &File,
    path: &Path,
    len: u64,
    matches: impl Fn(u32) -> bool,
) -> Result<u64, ScrubError> {
    let mut buf = vec![0u8; BLOCK];
    let mut off = 0u64;
    let mut count = 0u64;
    while off < len {
        let n = (len - off).min(BLOCK as u64) as usize;
        file.read_exact_at(&mut buf[..n], off).map_err(ScrubError::io(path))?;
        let words = buf[..n].chunks_exact(4);
        let tail = words.remainder();
        count +=
            words.filter(|w| matches(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))).count() as u64;
        if !tail.is_empty() {
            let mut w = [0u8; 4];
            w[..tail.len()].copy_from_slice(tail);
            if matches(u32::from_le_bytes(w)) {
                count += 1;
            }
        }
        off += n as u64;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    const UUID: &str = "MIG-11111111-2222-3333-4444-555555555555";

    /// A sim dir with one memory file of `len` bytes holding a secret pattern.
    fn fixture(len: usize) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("mem")).unwrap();
        let file = sim_memory_file(&dir.path().join("mem"), UUID);
        let secret: Vec<u8> = b"TENANT-A-SECRET!".iter().copied().cycle().take(len).collect();
        std::fs::write(&file, secret).unwrap();
        (dir, file)
    }

    #[test]
    fn zeroes_a_secret_and_verifies() {
        let (dir, file) = fixture(3 * BLOCK + 6);
        let r = SimScrubber::in_sim_dir(dir.path()).scrub(UUID).unwrap();
        assert!(r.ok, "{r}");
        assert_eq!(r.backend, "sim");
        assert_eq!(r.device, UUID);
        assert_eq!(r.bytes_total, 3 * BLOCK as u64 + 6);
        assert_eq!(r.bytes_covered, r.bytes_total);
        assert_eq!(r.nonzero_words, 0);
        let bytes = std::fs::read(&file).unwrap();
        assert_eq!(bytes.len(), 3 * BLOCK + 6, "same size after");
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn memory_file_name_matches_the_backend() {
        let p = sim_memory_file(Path::new("/s/mem"), "MIG-GPU-ab/1/0");
        assert_eq!(p, Path::new("/s/mem/MIG-GPU-ab_1_0.bin"));
        let p = sim_memory_file(Path::new("/s/mem"), "../../etc/passwd");
        assert_eq!(p.parent(), Some(Path::new("/s/mem")));
    }

    #[test]
    fn refuses_a_symlinked_memory_file_and_leaves_its_target_alone() {
        let (dir, file) = fixture(4096);
        let target = dir.path().join("host-secret");
        std::fs::write(&target, b"do not touch").unwrap();
        std::fs::remove_file(&file).unwrap();
        symlink(&target, &file).unwrap();
        let e = SimScrubber::in_sim_dir(dir.path()).scrub(UUID).unwrap_err();
        assert!(matches!(e, ScrubError::NotRegularFile { kind: "symlink", .. }), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"do not touch");
    }

    #[test]
    fn refuses_a_fifo_or_directory() {
        let (dir, file) = fixture(16);
        std::fs::remove_file(&file).unwrap();
        let c = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = SimScrubber::in_sim_dir(dir.path()).scrub(UUID).unwrap_err();
        assert!(matches!(e, ScrubError::NotRegularFile { kind: "fifo", .. }), "{e}");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        let e = SimScrubber::in_sim_dir(dir.path()).scrub(UUID).unwrap_err();
        assert!(matches!(e, ScrubError::NotRegularFile { .. } | ScrubError::Io { .. }), "{e}");
    }

    #[test]
    fn missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = SimScrubber::in_sim_dir(dir.path()).scrub(UUID).unwrap_err();
        assert!(matches!(e, ScrubError::Io { .. }), "{e}");
    }

    #[test]
    fn fault_leave_nonzero_is_found_by_verify() {
        let (dir, _) = fixture(8192);
        let faults =
            FaultInjection { devices: BTreeMap::from([(UUID.into(), FaultMode::LeaveNonzero)]) };
        let r = SimScrubber::in_sim_dir(dir.path()).with_faults(faults).scrub(UUID).unwrap();
        assert!(!r.ok);
        assert_eq!(r.nonzero_words, 1);
        assert!(crate::ScrubPolicy::default().judge(&r).unwrap_err().contains("non-zero"));
    }

    #[test]
    fn fault_error_leaves_memory_untouched() {
        let (dir, file) = fixture(4096);
        let faults = FaultInjection { devices: BTreeMap::from([(UUID.into(), FaultMode::Error)]) };
        let e = SimScrubber::in_sim_dir(dir.path()).with_faults(faults).scrub(UUID).unwrap_err();
        assert!(matches!(e, ScrubError::Injected { .. }));
        assert!(std::fs::read(&file).unwrap().starts_with(b"TENANT-A-SECRET!"));
    }

    #[test]
    fn fault_partial_reports_low_coverage() {
        let (dir, file) = fixture(4096);
        let faults =
            FaultInjection { devices: BTreeMap::from([(UUID.into(), FaultMode::Partial)]) };
        let r = SimScrubber::in_sim_dir(dir.path()).with_faults(faults).scrub(UUID).unwrap();
        assert!(r.ok, "what it covered is clean");
        assert_eq!(r.bytes_covered, 2048);
        assert_eq!(r.bytes_total, 4096);
        assert!(crate::ScrubPolicy::default().judge(&r).unwrap_err().contains("below"));
        let bytes = std::fs::read(&file).unwrap();
        assert!(bytes[..2048].iter().all(|&b| b == 0));
        assert!(bytes[2048..].starts_with(b"TENANT-A-SECRET!"));
    }

    #[test]
    fn faults_file_is_reread_at_every_scrub() {
        let (dir, _) = fixture(4096);
        let scrubber = SimScrubber::in_sim_dir(dir.path());
        let faults_path = dir.path().join(SimScrubber::FAULTS_FILE);
        assert!(scrubber.scrub(UUID).unwrap().ok);
        FaultInjection { devices: BTreeMap::from([(UUID.into(), FaultMode::Error)]) }
            .save(&faults_path)
            .unwrap();
        assert!(matches!(scrubber.scrub(UUID), Err(ScrubError::Injected { .. })));
        std::fs::write(&faults_path, r#"{"devices":{"other":"partial"}}"#).unwrap();
        assert!(scrubber.scrub(UUID).unwrap().ok);
        std::fs::write(&faults_path, r#"{"devices":{"x":"explode"}}"#).unwrap();
        assert!(matches!(scrubber.scrub(UUID), Err(ScrubError::Faults { .. })), "fail closed");
        std::fs::remove_file(&faults_path).unwrap();
        assert!(scrubber.scrub(UUID).unwrap().ok);
    }

    #[test]
    fn counting_words_handles_tails() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 9]).unwrap();
        let f = File::open(&p).unwrap();
        assert_eq!(count_nonzero_words(&f, &p, 14).unwrap(), 2);
        assert_eq!(count_nonzero_words(&f, &p, 12).unwrap(), 1);
        assert_eq!(count_words(&f, &p, 14, |w| w == 1).unwrap(), 1);
    }
}
