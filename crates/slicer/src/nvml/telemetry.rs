//! Device and process telemetry through NVML (read-only; see `crate::telemetry`).
//!
//! GPM needs two samples: each read takes a new one per device (GPU, and each MIG
//! instance through `nvmlGpmMigSampleGet`) and computes the metrics against the previous
//! read's, which it keeps; the first read of a device has no GPM figures yet and falls
//! back to the utilisation rates.

use std::collections::HashMap;

use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, PcieUtilCounter};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, GpmSample};

use super::{nvml_err, NvmlBackend};
use crate::backend::{BackendError, GpuBackend};
use crate::telemetry::{throttle_names, DeviceTelemetry, ProcessTelemetry, Source};

/// The GPM metrics read, in this order.
const METRICS: [GpmMetricId; 6] = [
    GpmMetricId::SmUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::PcieTxPerSec,
    GpmMetricId::PcieRxPerSec,
    GpmMetricId::NvlinkTotalTxPerSec,
    GpmMetricId::NvlinkTotalRxPerSec,
];

const MIB: f64 = 1024.0 * 1024.0;

/// The previous GPM sample of each device (`GPU-…` or `GPU-…/gi<N>`).
pub(super) type GpmSamples = std::sync::Mutex<HashMap<String, GpmSample<'static>>>;

fn ok_or_none<T>(r: Result<T, NvmlError>) -> Result<Option<T>, BackendError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::NotSupported | NvmlError::NoPermission | NvmlError::InvalidArg) => Ok(None),
        Err(e) => Err(BackendError::Nvml { call: "telemetry".into(), message: e.to_string() }),
    }
}

impl NvmlBackend {
    /// GPM figures for `key` from a fresh sample against the kept one (`None` the first time,
    /// or without GPM).
    fn gpm(
        &self,
        key: &str,
        fresh: Result<GpmSample<'static>, NvmlError>,
    ) -> Option<[Option<f64>; 6]> {
        let fresh = fresh.ok()?;
        let mut kept = self.gpm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let previous = kept.insert(key.to_string(), fresh)?;
        let current = kept.get(key)?;
        let results =
            nvml_wrapper::gpm::gpm_metrics_get(self.nvml, &previous, current, &METRICS).ok()?;
        let mut out = [None; 6];
        for (slot, r) in out.iter_mut().zip(results) {
            *slot = r.ok().map(|m| m.value).filter(|v| v.is_finite());
        }
        Some(out)
    }

    fn apply_gpm(t: &mut DeviceTelemetry, m: [Option<f64>; 6]) {
        let pct = |v: Option<f64>| v.map(|p| (p / 100.0).clamp(0.0, 1.0));
        let bytes = |v: Option<f64>| v.map(|mib| (mib * MIB).max(0.0) as u64);
        t.source = Source::Gpm;
        t.sm_active = pct(m[0]);
        t.dram_active = pct(m[1]);
        t.pcie_tx_bytes_per_s = bytes(m[2]);
        t.pcie_rx_bytes_per_s = bytes(m[3]);
        t.nvlink_tx_bytes_per_s = bytes(m[4]);
        t.nvlink_rx_bytes_per_s = bytes(m[5]);
    }

    fn gpu_telemetry(
        &self,
        dev: &Device<'static>,
        uuid: &str,
    ) -> Result<DeviceTelemetry, BackendError> {
        let mut t = DeviceTelemetry::empty(uuid, uuid, Source::Utilization);
        match self.gpm(uuid, dev.gpm_sample()) {
            Some(m) => Self::apply_gpm(&mut t, m),
            None => {
                if let Some(u) = ok_or_none(dev.utilization_rates())? {
                    t.sm_active = Some(f64::from(u.gpu.min(100)) / 100.0);
                    t.dram_active = Some(f64::from(u.memory.min(100)) / 100.0);
                }
                // KB/s.
                t.pcie_tx_bytes_per_s = ok_or_none(dev.pcie_throughput(PcieUtilCounter::Send))?
                    .map(|kb| u64::from(kb) * 1024);
                t.pcie_rx_bytes_per_s = ok_or_none(dev.pcie_throughput(PcieUtilCounter::Receive))?
                    .map(|kb| u64::from(kb) * 1024);
            }
        }
        t.power_watts = ok_or_none(dev.power_usage())?.map(|mw| f64::from(mw) / 1000.0);
        t.sm_clock_mhz = ok_or_none(dev.clock_info(Clock::SM))?;
        t.mem_clock_mhz = ok_or_none(dev.clock_info(Clock::Memory))?;
        if let Some(r) = ok_or_none(dev.current_throttle_reasons())? {
            t.throttle_mask = r.bits();
            t.throttle_reasons = throttle_names(r.bits());
        }
        t.ecc_corrected =
            ok_or_none(dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile))?;
        t.ecc_uncorrected =
            ok_or_none(dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile))?;
        Ok(t)
    }

    pub(super) fn read_device_telemetry(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<DeviceTelemetry>, BackendError> {
        let dev =
            self.nvml.device_by_uuid(gpu_uuid).map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
        let mut out = vec![self.gpu_telemetry(&dev, gpu_uuid)?];
        let inv = self.inventory()?;
        let Some(gpu) = inv.gpus.iter().find(|g| g.uuid == gpu_uuid) else { return Ok(out) };
        for i in &gpu.instances {
            let mut t = DeviceTelemetry::empty(&i.uuid, gpu_uuid, Source::Gpm);
            if let Some(m) =
                self.gpm(&format!("{gpu_uuid}/gi{}", i.gi_id), dev.gpm_mig_sample(i.gi_id))
            {
                Self::apply_gpm(&mut t, m);
            }
            out.push(t);
        }
        Ok(out)
    }

    pub(super) fn read_process_telemetry(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessTelemetry>>, BackendError> {
        let dev =
            self.nvml.device_by_uuid(gpu_uuid).map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
        if let Ok(mode) = dev.mig_mode() {
            if mode.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE {
                return Ok(None);
            }
        }
        match dev.process_utilization_stats(since_us) {
            Ok(samples) => {
                // NVML returns one sample per process per period: keep each pid's newest.
                let mut newest: HashMap<u32, (u64, ProcessTelemetry)> = HashMap::new();
                for s in samples {
                    let t = ProcessTelemetry {
                        pid: s.pid,
                        sm: f64::from(s.sm_util.min(100)) / 100.0,
                        mem: f64::from(s.mem_util.min(100)) / 100.0,
                    };
                    let e = newest.entry(s.pid).or_insert((s.timestamp, t));
                    if s.timestamp >= e.0 {
                        *e = (s.timestamp, t);
                    }
                }
                let mut v: Vec<ProcessTelemetry> = newest.into_values().map(|(_, t)| t).collect();
                v.sort_by_key(|t| t.pid);
                Ok(Some(v))
            }
            Err(NvmlError::NotSupported) => Ok(None),
            // No process ran since `since_us`.
            Err(NvmlError::NotFound) => Ok(Some(Vec::new())),
            Err(e) => Err(nvml_err("nvmlDeviceGetProcessUtilization")(e)),
        }
    }
}
