//! One ledger interval as reports see it: where it lies in wall time and what it is
//! worth (`crate::report` sums them, `crate::idle` judges them).

use tessera_api::cri::Workload;
use tessera_api::Isolation;

use crate::interval::{Class, ClosedInterval, IntervalStart, Utilization};

/// One interval as the report sees it: where it lies in wall time and what it is worth.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub container_id: String,
    pub tenant: String,
    pub gpu_model: String,
    pub class: Class,
    pub fraction: f64,
    /// `[start_ms, end_ms)` in wall milliseconds; `end_ms = start_ms + duration`, the
    /// duration being monotonic where possible (so a wall-clock step moves no usage).
    pub start_ms: u64,
    pub end_ms: u64,
    pub open: bool,
    /// Used / reserved: mean SM fraction of the GPU used over the fraction reserved, where
    /// utilisation was sampled.
    pub used_ratio: Option<f64>,
    /// The pod container, where the interval is one's.
    pub workload: Option<Workload>,
    /// The device held (right-sizing is per device).
    pub device_uuid: String,
    pub isolation: Isolation,
    /// Part of a multi-GPU grant inside one NVLink domain: the topology premium applies.
    pub nvlink: bool,
    /// Stopped by a quota reclaim.
    pub preempted: bool,
    /// Utilisation samples taken, and the highest (SM percent of the whole GPU).
    pub samples: u64,
    pub sm_peak: Option<f64>,
}

impl Span {
    /// The span of an interval that started at `start_ms` and lasted `duration_ms`.
    pub fn new(
        start: IntervalStart,
        start_ms: u64,
        duration_ms: u64,
        open: bool,
        util: Option<&Utilization>,
        preempted: bool,
    ) -> Span {
        Span {
            used_ratio: util.map(|u| u.sm_percent_avg / 100.0 / start.fraction),
            samples: util.map_or(0, |u| u.samples),
            sm_peak: util.and_then(|u| u.sm_percent_max),
            start_ms,
            end_ms: start_ms.saturating_add(duration_ms),
            nvlink: start.nvlink_domain.is_some(),
            container_id: start.container_id,
            tenant: start.tenant,
            gpu_model: start.gpu_model,
            class: start.class,
            fraction: start.fraction,
            workload: start.workload,
            device_uuid: start.device_uuid,
            isolation: start.isolation,
            open,
            preempted,
        }
    }

    /// The span of a closed interval (start wall time plus the measured duration).
    pub fn of_closed(i: &ClosedInterval) -> Span {
        Span::new(
            i.start.clone(),
            i.start_wall_ms,
            i.duration_ms,
            false,
            i.utilization.as_ref(),
            i.preempted,
        )
    }

    /// Milliseconds of this span inside `[from, to)`.
    pub fn overlap_ms(&self, from: u64, to: u64) -> u64 {
        self.end_ms.min(to).saturating_sub(self.start_ms.max(from))
    }

    /// Whether the span counts as an interval of the window: it overlaps it, or it is
    /// empty and starts inside it.
    pub fn touches(&self, from: u64, to: u64) -> bool {
        self.overlap_ms(from, to) > 0 || (self.start_ms >= from && self.start_ms < to)
    }
}
