//! Small JSON state files that must survive a crash: read (absent is not an error) and
//! written whole (temporary file, fsync, rename, fsync the directory), so a reader sees
//! the old file or the new one, never a torn one. Errors name the file and what it holds.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The value in `path`, or None where there is no such file. `what` names it in errors
/// (`quota leases`, `usage upload mark`).
pub(crate) fn load_json<T: DeserializeOwned>(path: &Path, what: &str) -> Result<Option<T>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{what} {}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{what} {}: {e}", path.display())),
    }
}

/// Write `value` to `path` durably (see the module documentation).
pub(crate) fn store_json<T: Serialize>(path: &Path, what: &str, value: &T) -> Result<(), String> {
    store(path, what, value, false)
}

/// [`store_json`] for a file of secrets: created anew with mode 0600 (never through a link
/// left where the temporary file goes), so only root reads it whatever the umask.
pub(crate) fn store_private_json<T: Serialize>(
    path: &Path,
    what: &str,
    value: &T,
) -> Result<(), String> {
    store(path, what, value, true)
}

fn store<T: Serialize>(path: &Path, what: &str, value: &T, private: bool) -> Result<(), String> {
    let json = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    let mode = if private { 0o600 } else { 0o644 };
    tessera_api::durable::replace(path, &json, mode, tessera_api::durable::Sync::Durable)
        .map_err(|e| format!("{what} {}: {e}", path.display()))
}
