//! The result of one scrub, as the scrubber reports it and the daemon records it.
//!
//! The JSON form is the contract between the scrub child (`tessera scrub --json`) and the
//! daemon: one object on one line, every field always present, in the order below, and
//! unknown fields refused so a mismatch between the two binaries is an error, not a
//! silent default.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Which scrubber produced a report.
pub const BACKEND_CUDA: &str = "cuda";
/// Which scrubber produced a report.
pub const BACKEND_SIM: &str = "sim";

/// One scrub of one device (a GPU or a MIG instance).
///
/// Bandwidths are in GB/s (10^9 bytes per second). `gbps` is the bandwidth of the scrub's
/// memory traffic: bytes written by the zero pass plus bytes read back by the verify pass,
/// over the time of the two passes (GPU time measured with events on the CUDA backend).
/// It is the figure to hold against the peak of a plain `cuMemsetD32`. `seconds` is the
/// wall time of the whole scrub, allocation and release included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubReport {
    /// The device uuid as the daemon knows it (`GPU-…` or `MIG-…`).
    pub device: String,
    /// [`BACKEND_CUDA`] or [`BACKEND_SIM`].
    pub backend: String,
    /// The scrubber's own verdict: no error, something was covered, and the verify pass
    /// found no non-zero word. Coverage and time limits are the policy's to judge.
    pub ok: bool,
    /// Why the scrub failed, when it did.
    pub error: Option<String>,
    /// Bytes zeroed and verified.
    pub bytes_covered: u64,
    /// Bytes of memory the device has (`cuMemGetInfo` total; the file size in sim).
    pub bytes_total: u64,
    /// Non-zero 32-bit words the verify pass found in the covered bytes.
    pub nonzero_words: u64,
    /// Wall time of the whole scrub.
    pub seconds: f64,
    /// (zeroed + verified bytes) / (zero_seconds + verify_seconds).
    pub gbps: f64,
    /// Time of the zero pass.
    pub zero_seconds: f64,
    /// Time of the verify pass.
    pub verify_seconds: f64,
    /// Bandwidth of the zero pass alone.
    pub zero_gbps: f64,
    /// Bandwidth of the verify pass alone.
    pub verify_gbps: f64,
    /// How many allocations the covered bytes were split into.
    pub chunks: u32,
    /// When the scrub finished, in seconds since the Unix epoch.
    pub finished_unix_s: u64,
}

impl ScrubReport {
    /// A report for a scrub that could not run or did not finish.
    pub fn failed(device: &str, backend: &str, error: impl fmt::Display) -> ScrubReport {
        ScrubReport {
            device: device.to_string(),
            backend: backend.to_string(),
            ok: false,
            error: Some(error.to_string()),
            bytes_covered: 0,
            bytes_total: 0,
            nonzero_words: 0,
            seconds: 0.0,
            gbps: 0.0,
            zero_seconds: 0.0,
            verify_seconds: 0.0,
            zero_gbps: 0.0,
            verify_gbps: 0.0,
            chunks: 0,
            finished_unix_s: now_unix_s(),
        }
    }

    /// Fraction of the device memory covered, 0 when the total is unknown.
    pub fn coverage(&self) -> f64 {
        if self.bytes_total == 0 {
            0.0
        } else {
            self.bytes_covered as f64 / self.bytes_total as f64
        }
    }

    /// Fill in the derived fields (`ok`, bandwidths) from the measured ones and replace
    /// any non-finite number by 0, so the JSON form always parses back.
    pub(crate) fn finish(mut self) -> ScrubReport {
        for v in [&mut self.seconds, &mut self.zero_seconds, &mut self.verify_seconds] {
            *v = finite(*v);
        }
        self.zero_gbps = gbps(self.bytes_covered, self.zero_seconds);
        self.verify_gbps = gbps(self.bytes_covered, self.verify_seconds);
        self.gbps =
            gbps(self.bytes_covered.saturating_mul(2), self.zero_seconds + self.verify_seconds);
        self.ok = self.error.is_none() && self.bytes_covered > 0 && self.nonzero_words == 0;
        self.finished_unix_s = now_unix_s();
        self
    }

    /// The one-line JSON form printed by `tessera scrub --json`.
    pub fn to_json_line(&self) -> String {
        // Serialising a struct of strings, integers and finite floats cannot fail; fall
        // back to a hand-written failure object rather than panicking if it ever did.
        serde_json::to_string(self).unwrap_or_else(|e| {
            format!(
                "{{\"device\":{:?},\"backend\":{:?},\"ok\":false,\"error\":\"encode report: {e}\"}}",
                self.device, self.backend
            )
        })
    }

    /// Parse the JSON form.
    pub fn from_json(text: &str) -> Result<ScrubReport, serde_json::Error> {
        serde_json::from_str(text)
    }
}

impl fmt::Display for ScrubReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} scrub of {}: {} of {} covered ({:.1}%) in {} chunks, {} non-zero words, \
             {:.3} s; zero {:.1} GB/s, verify {:.1} GB/s, scrub {:.1} GB/s: {}",
            self.backend,
            self.device,
            human_bytes(self.bytes_covered),
            human_bytes(self.bytes_total),
            self.coverage() * 100.0,
            self.chunks,
            self.nonzero_words,
            self.seconds,
            self.zero_gbps,
            self.verify_gbps,
            self.gbps,
            if self.ok { "ok" } else { "FAILED" },
        )?;
        if let Some(e) = &self.error {
            write!(f, " ({e})")?;
        }
        Ok(())
    }
}

/// Bytes per second in GB/s, 0 for an empty or unmeasurable interval.
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 && seconds.is_finite() {
        finite(bytes as f64 / seconds / 1e9)
    } else {
        0.0
    }
}

fn finite(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

pub(crate) fn now_unix_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `1.50 GiB`, `64.00 MiB`, `512 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ScrubReport {
        ScrubReport {
            device: "MIG-5b1e3c1a-7d2f-5e8b-9a4c-0d1e2f3a4b5c".into(),
            backend: BACKEND_CUDA.into(),
            ok: true,
            error: None,
            bytes_covered: 1 << 30,
            bytes_total: 2 << 30,
            nonzero_words: 0,
            seconds: 0.5,
            gbps: 1000.0,
            zero_seconds: 0.001,
            verify_seconds: 0.002,
            zero_gbps: 1073.741824,
            verify_gbps: 536.870912,
            chunks: 1,
            finished_unix_s: 1_800_000_000,
        }
    }

    #[test]
    fn json_form_is_stable() {
        let json = sample().to_json_line();
        assert_eq!(
            json,
            "{\"device\":\"MIG-5b1e3c1a-7d2f-5e8b-9a4c-0d1e2f3a4b5c\",\"backend\":\"cuda\",\
             \"ok\":true,\"error\":null,\"bytes_covered\":1073741824,\"bytes_total\":2147483648,\
             \"nonzero_words\":0,\"seconds\":0.5,\"gbps\":1000.0,\"zero_seconds\":0.001,\
             \"verify_seconds\":0.002,\"zero_gbps\":1073.741824,\"verify_gbps\":536.870912,\
             \"chunks\":1,\"finished_unix_s\":1800000000}"
        );
        assert!(!json.contains('\n'));
        assert_eq!(ScrubReport::from_json(&json).unwrap(), sample());
    }

    #[test]
    fn unknown_and_missing_fields_are_refused() {
        let mut v: serde_json::Value = serde_json::from_str(&sample().to_json_line()).unwrap();
        v["extra"] = serde_json::json!(1);
        assert!(ScrubReport::from_json(&v.to_string()).is_err());
        let mut v: serde_json::Value = serde_json::from_str(&sample().to_json_line()).unwrap();
        v.as_object_mut().unwrap().remove("nonzero_words");
        assert!(ScrubReport::from_json(&v.to_string()).is_err());
    }

    #[test]
    fn finish_derives_ok_and_bandwidth_and_drops_non_finite_numbers() {
        let mut r = sample();
        r.zero_seconds = 0.5;
        r.verify_seconds = 0.5;
        r.seconds = f64::NAN;
        let r = r.finish();
        assert!(r.ok);
        assert_eq!(r.seconds, 0.0);
        assert!((r.gbps - 2.0 * (1u64 << 30) as f64 / 1e9).abs() < 1e-9);
        assert!((r.zero_gbps - (1u64 << 30) as f64 / 0.5 / 1e9).abs() < 1e-9);
        assert!(ScrubReport::from_json(&r.to_json_line()).is_ok());

        let mut r = sample();
        r.nonzero_words = 3;
        assert!(!r.finish().ok);
        let mut r = sample();
        r.bytes_covered = 0;
        assert!(!r.finish().ok);
        let mut r = sample();
        r.error = Some("boom".into());
        assert!(!r.finish().ok);
    }

    #[test]
    fn failed_report_parses_back_and_displays_the_error() {
        let r = ScrubReport::failed("GPU-x", BACKEND_SIM, "no CUDA driver");
        assert!(!r.ok);
        assert_eq!(r.coverage(), 0.0);
        assert_eq!(ScrubReport::from_json(&r.to_json_line()).unwrap(), r);
        assert!(r.to_string().contains("FAILED (no CUDA driver)"));
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 << 20), "64.00 MiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }
}
