//! XID events and device health through NVML.
//!
//! The event set is created on the first [`NvmlBackend::read_xids`] and registered for
//! `nvmlEventTypeXidCriticalError` on every GPU that supports it (one raw
//! `nvmlDeviceRegisterEvents` per GPU: the wrapper's `register_events` frees the whole set
//! when one GPU refuses). Each read drains it with `nvmlEventSetWait_v2` and a 0 ms
//! timeout, so it never blocks; the raw wait is used because the wrapper's `EventData`
//! drops the GPU and compute instance ids a MIG fault carries.
//!
//! Health: a GPU is unhealthy while NVML says pages are pending retirement or rows
//! pending remapping, or when its handle cannot be had (fallen off the bus); a MIG
//! instance is as healthy as its GPU.

use std::os::raw::c_uint;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::event::EventSet;
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::nvmlEventData_t;

use super::{nvml_err, sym, NvmlBackend};
use crate::backend::BackendError;
use crate::xid::XidEvent;

/// The most events one read drains.
const MAX_EVENTS_PER_READ: usize = 256;

impl NvmlBackend {
    /// Register every GPU that supports XID events on a new event set.
    fn xid_event_set(&self) -> Result<EventSet<'static>, BackendError> {
        let set = self.nvml.create_event_set().map_err(nvml_err("nvmlEventSetCreate"))?;
        let register = sym(&self.nvml.lib().nvmlDeviceRegisterEvents, "nvmlDeviceRegisterEvents")?;
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        for index in 0..count {
            let dev =
                self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
            // SAFETY: `dev` and `set` are live handles of this Nvml (which is never dropped:
            // it is leaked at open); the call only records the registration.
            let code = unsafe {
                register(dev.handle(), EventTypes::CRITICAL_XID_ERROR.bits(), set.handle())
            };
            match nvml_try(code) {
                Ok(()) => {}
                // A GPU without XID events (a vGPU) is not watched; its ECC count still is.
                Err(NvmlError::NotSupported) => {}
                Err(e) => return Err(nvml_err("nvmlDeviceRegisterEvents")(e)),
            }
        }
        Ok(set)
    }

    /// Drain the XID events pending on the event set (created on the first call).
    pub(super) fn read_xids(&self) -> Result<Vec<XidEvent>, BackendError> {
        let mut guard = self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.is_none() {
            *guard = Some(self.xid_event_set()?);
        }
        let Some(set) = guard.as_ref() else { return Ok(Vec::new()) };
        let wait = sym(&self.nvml.lib().nvmlEventSetWait_v2, "nvmlEventSetWait_v2")?;
        let mut out = Vec::new();
        while out.len() < MAX_EVENTS_PER_READ {
            // SAFETY: nvmlEventData_t is a plain C struct (a handle pointer and integers)
            // for which all-zero bytes are a valid value.
            let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is a live event set of this Nvml; `data` is a valid
            // out-pointer; a 0 ms timeout returns at once.
            let code = unsafe { wait(set.handle(), &mut data, 0) };
            match nvml_try(code) {
                Ok(()) => {}
                Err(NvmlError::Timeout) => break,
                Err(e) => return Err(nvml_err("nvmlEventSetWait_v2")(e)),
            }
            if data.eventType & u64::from(nvml_wrapper_sys::bindings::nvmlEventTypeXidCriticalError)
                == 0
            {
                continue;
            }
            // SAFETY: the driver filled `data.device` with a handle of this Nvml.
            let dev = unsafe { Device::new(data.device, self.nvml) };
            let uuid = dev.uuid().map_err(nvml_err("nvmlDeviceGetUUID (XID event)"))?;
            out.push(XidEvent::from_nvml(
                uuid,
                data.eventData,
                data.gpuInstanceId as c_uint,
                data.computeInstanceId as c_uint,
            ));
        }
        Ok(out)
    }

    /// The health check of a GPU or MIG instance (see the module docs).
    pub(super) fn health_of(&self, uuid: &str) -> Result<Option<String>, BackendError> {
        let dev = match self.nvml.device_by_uuid(uuid) {
            Ok(d) => d,
            Err(NvmlError::GpuLost) => return Ok(Some("the GPU has fallen off the bus".into())),
            Err(e) => return Err(nvml_err("nvmlDeviceGetHandleByUUID")(e)),
        };
        let gpu = if uuid.starts_with("MIG-") {
            dev.mig_parent_device()
                .map_err(nvml_err("nvmlDeviceGetDeviceHandleFromMigDeviceHandle"))?
        } else {
            dev
        };
        match gpu.are_pages_pending_retired() {
            Ok(true) => return Ok(Some("ECC pages are pending retirement (reset the GPU)".into())),
            Ok(false) | Err(NvmlError::NotSupported) => {}
            Err(NvmlError::GpuLost) => return Ok(Some("the GPU has fallen off the bus".into())),
            Err(e) => return Err(nvml_err("nvmlDeviceGetRetiredPagesPendingStatus")(e)),
        }
        let get = sym(&self.nvml.lib().nvmlDeviceGetRemappedRows, "nvmlDeviceGetRemappedRows")?;
        let (mut corr, mut unc, mut pending, mut failed): (c_uint, c_uint, c_uint, c_uint) =
            (0, 0, 0, 0);
        // SAFETY: `gpu` is a live handle of this Nvml; the four out-pointers are valid.
        let code = unsafe { get(gpu.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
        match nvml_try(code) {
            Ok(()) if failed != 0 => {
                Ok(Some("row remapping failed (the GPU needs service)".into()))
            }
            Ok(()) if pending != 0 => Ok(Some("rows are pending remapping (reset the GPU)".into())),
            Ok(()) | Err(NvmlError::NotSupported) => Ok(None),
            Err(e) => Err(nvml_err("nvmlDeviceGetRemappedRows")(e)),
        }
    }
}
