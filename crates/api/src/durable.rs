//! Replacing a file whole, the one way Tessera writes state: a temporary file created
//! anew beside it (never through a link left there: `O_EXCL | O_NOFOLLOW`), with exactly
//! its mode from the start, written, fsynced, renamed over the file, and the directory fsynced. A
//! reader sees the old file or the new one, never a torn one; after a crash, the new one
//! if [`replace`] returned. [`Sync::Rename`] skips the two fsyncs for derived files that
//! their writer writes again at start (the wrapper's lists beside tesserad's socket).

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// How far a write is carried to the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// The data and the rename survive a crash (fsync the file and its directory).
    Durable,
    /// Atomic for readers only: for derived files written again at start.
    Rename,
}

/// The temporary file [`replace`] uses for `path`: hidden, beside it, named by this
/// process so two writers never share one.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Replace `path` with `bytes`, file mode `mode` (see the module documentation). The
/// directory is created if missing. On error the temporary file is removed and `path` is
/// untouched.
pub fn replace(path: &Path, bytes: &[u8], mode: u32, sync: Sync) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let tmp = temp_path(path);
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // Exactly `mode`, whatever the umask made of the creation mode.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        f.write_all(bytes)?;
        if sync == Sync::Durable {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if sync == Sync::Durable {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn a_file_is_replaced_whole_with_its_mode_and_nothing_left_beside_it() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("sub/state.json");
        replace(&path, b"one", 0o600, Sync::Durable).expect("first");
        replace(&path, b"two", 0o600, Sync::Rename).expect("second");
        assert_eq!(std::fs::read(&path).expect("read"), b"two");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")], "no temporary left");
    }

    #[test]
    fn a_link_planted_where_the_temporary_file_goes_is_never_written_through() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("state.json");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").expect("victim");
        // Planted and re-planted: `replace` removes it and creates its file with O_EXCL.
        std::os::unix::fs::symlink(&victim, temp_path(&path)).expect("link");
        replace(&path, b"new", 0o644, Sync::Durable).expect("written");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"keep");
        assert_eq!(std::fs::read(&path).expect("file"), b"new");
    }
}
