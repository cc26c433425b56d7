//! etcd history compaction.
//!
//! etcd keeps every old value of every key (its MVCC history) until the cluster is
//! compacted: usage retention's deletes, and node records rewritten every report interval,
//! free nothing until then, and the database grows towards its quota (2 GiB by default),
//! where etcd stops taking writes. So each coordinator on etcd compacts, the way etcd's
//! own `--auto-compaction-mode=periodic` does: it samples the cluster's revision every
//! [`sample_every`] and compacts to the newest revision that was current at least `keep`
//! ago ([`Schedule`]), so every revision of the last `keep` stays readable (a paged read
//! pinned to one revision lasts seconds; `keep` is an hour by default).
//!
//! Compaction is cluster-wide: it drops the old history of every key, not only this
//! fleet's prefix. Several coordinators on one etcd all run it (compacting to a revision
//! another already compacted past is a no-op). Defragmentation, which gives the freed
//! pages back to the file system and blocks the member while it runs, stays an operator's
//! job (`etcdctl defrag`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::PolicyStore;

/// How much etcd history a coordinator keeps by default (`--etcd-compaction-retention-s`).
pub const DEFAULT_HISTORY_RETENTION: Duration = Duration::from_secs(3600);

/// How often the revision is sampled for a retention of `keep`: a tenth of it, between
/// 50 ms and 5 minutes (so compaction lags `keep` by at most a tenth, or 5 minutes).
pub fn sample_every(keep: Duration) -> Duration {
    (keep / 10).clamp(Duration::from_millis(50), Duration::from_secs(300))
}

/// Which revision may be compacted, from samples of the store's revision over time. Pure:
/// times are milliseconds on any monotonic clock.
#[derive(Debug, Clone)]
pub struct Schedule {
    keep_ms: u64,
    /// (first seen at, revision), oldest first, revisions strictly increasing.
    samples: VecDeque<(u64, i64)>,
    /// The revision compacted to last (0: none).
    compacted: i64,
}

impl Schedule {
    pub fn new(keep: Duration) -> Schedule {
        Schedule {
            keep_ms: u64::try_from(keep.as_millis()).unwrap_or(u64::MAX),
            samples: VecDeque::new(),
            compacted: 0,
        }
    }

    /// The store was at `revision` at `now_ms`. Returns the revision to compact to now, if
    /// any: the newest one seen at least `keep` ago (it was current then, so every
    /// revision of the last `keep` is at or above it), if above the last compaction.
    pub fn observe(&mut self, now_ms: u64, revision: i64) -> Option<i64> {
        match self.samples.back() {
            // A revision that went back is another cluster (restored, replaced): start over.
            Some(&(_, last)) if revision < last => {
                self.samples.clear();
                self.compacted = 0;
                self.samples.push_back((now_ms, revision));
            }
            // The same revision keeps the time it was first seen: it has been current since.
            Some(&(_, last)) if revision == last => {}
            _ => self.samples.push_back((now_ms, revision)),
        }
        let cutoff = now_ms.checked_sub(self.keep_ms)?;
        // Samples older than the newest one at or before the cutoff are never needed again.
        while self.samples.get(1).is_some_and(|&(t, _)| t <= cutoff) {
            self.samples.pop_front();
        }
        let &(t, rev) = self.samples.front()?;
        (t <= cutoff && rev > self.compacted).then_some(rev)
    }

    /// The store was compacted to `revision` (by this coordinator or another).
    pub fn compacted(&mut self, revision: i64) {
        self.compacted = self.compacted.max(revision);
    }
}

/// Compact the store's history, keeping `keep` of it, until the task is dropped. Returns at
/// once for a store without history (SQLite).
pub async fn compaction_loop(store: Arc<dyn PolicyStore>, keep: Duration) {
    let origin = tokio::time::Instant::now();
    let mut schedule = Schedule::new(keep);
    let mut tick = tokio::time::interval(sample_every(keep));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let revision = match store.revision().await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                if !failing {
                    warn!("etcd compaction: cannot read the revision: {e}");
                }
                failing = true;
                continue;
            }
        };
        let now = u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let Some(target) = schedule.observe(now, revision) else { continue };
        match store.compact(target).await {
            Ok(done) => {
                failing = false;
                schedule.compacted(target);
                if done {
                    info!(revision = target, keep_s = keep.as_secs(), "etcd history compacted");
                }
            }
            Err(e) => {
                if !failing {
                    warn!(revision = target, "etcd compaction failed: {e}");
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEEP: Duration = Duration::from_secs(10);

    #[test]
    fn nothing_is_compacted_before_the_history_is_old_enough() {
        let mut s = Schedule::new(KEEP);
        assert_eq!(s.observe(0, 5), None);
        assert_eq!(s.observe(9_999, 50), None, "revision 5 was current only 9.999 s ago");
        assert_eq!(s.observe(10_000, 60), Some(5), "revision 5 was current 10 s ago");
        s.compacted(5);
        assert_eq!(s.observe(10_500, 61), None, "nothing newer is 10 s old yet");
        assert_eq!(s.observe(20_000, 70), Some(60), "revision 60 was current at the cutoff");
    }

    #[test]
    fn the_target_is_the_revision_current_at_the_cutoff_never_a_later_one() {
        let mut s = Schedule::new(KEEP);
        for (t, rev) in [(0, 10), (1_000, 20), (2_000, 30), (3_000, 40)] {
            assert_eq!(s.observe(t, rev), None);
        }
        // At 12.5 s the cutoff is 2.5 s: revision 30 was current then, 40 came after.
        assert_eq!(s.observe(12_500, 99), Some(30));
        // Property over a generated run: the target was always seen at or before the cutoff,
        // and every later sample is at or above it.
        let mut s = Schedule::new(KEEP);
        let mut seen: Vec<(u64, i64)> = Vec::new();
        let (mut t, mut rev) = (0u64, 1i64);
        for i in 0..2_000u64 {
            t += 1 + (i * 7919) % 900;
            rev += ((i * 104_729) % 5) as i64;
            if seen.last().is_none_or(|&(_, r)| r != rev) {
                seen.push((t, rev));
            }
            if let Some(target) = s.observe(t, rev) {
                let at_cutoff = seen
                    .iter()
                    .filter(|&&(st, _)| st + 10_000 <= t)
                    .map(|&(_, r)| r)
                    .max()
                    .expect("a sample at or before the cutoff");
                assert_eq!(target, at_cutoff, "at t={t}");
                s.compacted(target);
            }
        }
        let in_window = seen.iter().filter(|&&(st, _)| st + 10_000 > t).count();
        assert!(s.samples.len() <= in_window + 1, "samples are dropped once past the cutoff");
    }

    #[test]
    fn an_idle_cluster_is_compacted_once_and_samples_stay_bounded() {
        let mut s = Schedule::new(KEEP);
        assert_eq!(s.observe(0, 7), None);
        assert_eq!(s.observe(10_000, 7), Some(7));
        s.compacted(7);
        for t in (11_000..100_000).step_by(1_000) {
            assert_eq!(s.observe(t, 7), None, "revision 7 is compacted already");
        }
        assert_eq!(s.samples.len(), 1);
    }

    #[test]
    fn a_revision_that_goes_back_starts_over() {
        let mut s = Schedule::new(KEEP);
        s.observe(0, 500);
        assert_eq!(s.observe(10_000, 600), Some(500));
        s.compacted(500);
        // A restored or new cluster: its revisions are below what was compacted.
        assert_eq!(s.observe(11_000, 3), None);
        assert_eq!(s.observe(21_000, 9), Some(3), "compacts the new cluster's history too");
    }

    #[test]
    fn sampling_is_a_tenth_of_the_retention_within_bounds() {
        assert_eq!(sample_every(Duration::from_secs(3600)), Duration::from_secs(300));
        assert_eq!(sample_every(Duration::from_secs(60)), Duration::from_secs(6));
        assert_eq!(sample_every(Duration::from_millis(100)), Duration::from_millis(50));
    }
}
