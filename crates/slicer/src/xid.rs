//! XID errors: what the driver reports when a GPU (or a MIG instance of it) faults, and
//! which devices a fault takes out of service (pure).
//!
//! The driver reports XIDs through NVML's event API (`nvmlEventSetWait_v2` on a set
//! registered for `nvmlEventTypeXidCriticalError`); the event names the GPU and, on a GPU
//! in MIG mode, the GPU and compute instance the error was contained to (both
//! `0xFFFFFFFF` when it was not). [`scope`] decides what a fault quarantines:
//!
//! * an XID caused by the application (13 graphics engine exception, 31 MMU fault, 43
//!   stopped channel, 45 preemptive cleanup, 68 video processor exception: NVIDIA's XID
//!   catalogue) quarantines nothing; its holders are told;
//! * XID 94 (contained ECC error) with a GPU instance: exactly that MIG instance;
//! * every other XID (95 uncontained ECC, 48 double-bit ECC, 63/64 row remapping, 79
//!   fallen off the bus, 92 high single-bit ECC rate, 119/120 GSP, an XID this table does
//!   not know, and 94 without an instance): the GPU and everything on it. Unknown means
//!   whole GPU: a fault nobody classified fails closed.
//!
//! The policy may list more XIDs to treat as the application's (`faults.ignore_xids`).

use serde::{Deserialize, Serialize};

/// XIDs NVIDIA's catalogue attributes to the application, not the hardware.
pub const APPLICATION_XIDS: [u64; 5] = [13, 31, 43, 45, 68];
/// Contained ECC error: confined to the MIG instance that saw it.
pub const CONTAINED_ECC: u64 = 94;
/// Uncontained ECC error: every process on the GPU is affected.
pub const UNCONTAINED_ECC: u64 = 95;
/// What NVML puts in an event's GPU/compute instance id when there is none.
pub const NO_INSTANCE: u32 = u32::MAX;

/// One XID error event, as the backend read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XidEvent {
    /// The physical GPU the driver reported it on.
    pub gpu_uuid: String,
    pub xid: u64,
    /// The GPU instance the error was contained to (MIG), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gi_id: Option<u32>,
    /// The compute instance, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci_id: Option<u32>,
}

impl XidEvent {
    /// An event from NVML's raw fields (`0xFFFFFFFF` instance ids mean none).
    pub fn from_nvml(gpu_uuid: String, xid: u64, gi: u32, ci: u32) -> XidEvent {
        let id = |v: u32| (v != NO_INSTANCE).then_some(v);
        XidEvent { gpu_uuid, xid, gi_id: id(gi), ci_id: id(ci) }
    }
}

/// What one fault takes out of service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidScope {
    /// Caused by the application: nothing is quarantined; the holders are told.
    Application,
    /// Contained to one MIG instance (its GPU instance, and compute instance when given).
    Instance { gi_id: u32, ci_id: Option<u32> },
    /// The whole GPU and all its instances and shares.
    Gpu,
}

impl XidScope {
    /// A short word for events: `application`, `instance`, `gpu`.
    pub fn name(self) -> &'static str {
        match self {
            XidScope::Application => "application",
            XidScope::Instance { .. } => "instance",
            XidScope::Gpu => "gpu",
        }
    }
}

/// What `event` quarantines, given the XIDs the policy treats as the application's
/// (`extra_application`, on top of [`APPLICATION_XIDS`]).
pub fn scope(event: &XidEvent, extra_application: &[u64]) -> XidScope {
    if APPLICATION_XIDS.contains(&event.xid) || extra_application.contains(&event.xid) {
        return XidScope::Application;
    }
    match (event.xid, event.gi_id) {
        (CONTAINED_ECC, Some(gi_id)) => XidScope::Instance { gi_id, ci_id: event.ci_id },
        _ => XidScope::Gpu,
    }
}

/// A short description of an XID for events and logs.
pub fn describe(xid: u64) -> &'static str {
    match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup",
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapper failure",
        68 => "video processor exception",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP error",
        _ => "unclassified XID",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(xid: u64, gi: Option<u32>) -> XidEvent {
        XidEvent { gpu_uuid: "GPU-x".into(), xid, gi_id: gi, ci_id: gi.map(|_| 0) }
    }

    #[test]
    fn contained_errors_take_their_instance_and_the_rest_the_whole_gpu() {
        assert_eq!(scope(&ev(94, Some(3)), &[]), XidScope::Instance { gi_id: 3, ci_id: Some(0) });
        assert_eq!(scope(&ev(94, None), &[]), XidScope::Gpu, "94 without an instance");
        for xid in [95, 48, 63, 64, 79, 92, 119, 120, 9999] {
            assert_eq!(scope(&ev(xid, Some(3)), &[]), XidScope::Gpu, "xid {xid}");
        }
        for xid in APPLICATION_XIDS {
            assert_eq!(scope(&ev(xid, Some(3)), &[]), XidScope::Application, "xid {xid}");
        }
        assert_eq!(scope(&ev(92, None), &[92]), XidScope::Application, "the policy's list");
    }

    #[test]
    fn nvml_marks_no_instance_with_all_ones() {
        let e = XidEvent::from_nvml("GPU-x".into(), 95, NO_INSTANCE, NO_INSTANCE);
        assert_eq!((e.gi_id, e.ci_id), (None, None));
        let e = XidEvent::from_nvml("GPU-x".into(), 94, 2, 0);
        assert_eq!((e.gi_id, e.ci_id), (Some(2), Some(0)));
    }
}
