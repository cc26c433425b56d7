//! The ledger's hash chain against a real SQLite file: every closed interval is linked in
//! the transaction that closes it (also by crash recovery), a schema-1 ledger is chained on
//! open, and `verify_chain` names the first row that does not verify after the file is
//! edited behind the ledger's back (the triggers dropped first, as anyone with the file
//! and the sqlite3 shell can).

mod common;

use std::path::Path;

use common::{clock, open, start, T0};
use metering::chain::{genesis, verify_segment};
use metering::{Class, GroupBy, Prices, UsageQuery, POSTSTOP_REASON, RECOVERED_REASON};

/// A ledger at `path` with `n` closed intervals (containers c1..cn, 10 s each) and one
/// still open (c-open).
fn ledger_with(path: &Path, n: usize) {
    let c = clock();
    let mut l = open(path, &c);
    for i in 1..=n {
        l.open_interval(&start(&format!("c{i}"), "acme/ml/cv/alice", &i.to_string()))
            .expect("open");
        c.advance(10_000);
        l.close_container(&format!("c{i}"), POSTSTOP_REASON).expect("close");
    }
    l.open_interval(&start("c-open", "acme/ml", "99")).expect("open");
}

/// Runs SQL on the file with the ledger closed (the ledger holds it exclusively).
fn sql(path: &Path, batch: &str) {
    let conn = rusqlite::Connection::open(path).expect("sqlite");
    conn.execute_batch(batch).expect("sql");
}

#[test]
fn every_close_is_linked_and_the_chain_survives_reopen_and_recovery() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("l.db");
    let c = clock();
    {
        let mut l = open(&path, &c);
        assert_eq!(l.chain_head().expect("head").seq, 0);
        assert_eq!(l.chain_head().expect("head").hash, genesis(l.ledger_id()));
        l.open_interval(&start("a", "acme/ml", "0")).expect("open");
        l.open_interval(&start("b", "acme/ml", "1")).expect("open");
        c.advance(5_000);
        let closed = l.close_container("a", POSTSTOP_REASON).expect("close");
        let link = closed[0].chain.clone().expect("closing links it");
        assert_eq!((link.seq, link.prev.as_str()), (1, genesis(l.ledger_id()).as_str()));
        assert_eq!(l.chain_head().expect("head").hash, link.hash);
        c.advance(2_000);
        l.checkpoint().expect("checkpoint");
        c.advance(3_000);
        // Dropped without closing `b`: a crash.
    }
    let l = open(&path, &c);
    assert_eq!(l.recovered(), 1);
    let report = l.verify_chain().expect("verify");
    assert!(report.ok(), "{report:#?}");
    assert_eq!((report.links, report.closed_rows, report.head.seq), (2, 2, 2));
    let rows = l.chained_after(0, 100).expect("chain");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].reason, RECOVERED_REASON);
    assert_eq!(rows[1].duration_ms, 7_000, "recovered at its checkpoint");
    // What a node uploads verifies on its own, from the genesis of its ledger.
    let (seq, head) = verify_segment((0, &genesis(l.ledger_id())), &rows).expect("segment");
    assert_eq!((seq, head), (2, report.head.hash.clone()));
    assert_eq!(l.chained_after(1, 100).expect("after 1").len(), 1);
}

#[test]
fn a_schema_one_ledger_is_chained_in_seq_order_when_opened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("l.db");
    ledger_with(&path, 3);
    // Back to schema 1: no chain table, no new columns' meaning.
    sql(&path, "DROP TABLE chain; PRAGMA user_version = 1;");
    let l = open(&path, &clock());
    let report = l.verify_chain().expect("verify");
    // The interval left open was recovered (and chained) after the migration.
    assert!(report.ok(), "{report:#?}");
    assert_eq!((report.links, report.closed_rows), (4, 4));
    let ids: Vec<String> =
        l.chained_after(0, 10).expect("chain").into_iter().map(|c| c.start.container_id).collect();
    assert_eq!(ids, ["c1", "c2", "c3", "c-open"]);
}

#[test]
fn an_edited_row_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("l.db");
    ledger_with(&path, 4);
    // Someone halves the GPU-seconds of the second interval.
    sql(
        &path,
        "DROP TRIGGER intervals_closed_rows_are_final;
         UPDATE intervals SET gpu_seconds = gpu_seconds / 2, duration_ms = duration_ms / 2
             WHERE container_id = 'c2';",
    );
    let l = open(&path, &clock());
    let report = l.verify_chain().expect("verify");
    let first = report.problems.first().expect("named");
    assert_eq!(first.chain_seq, 2, "{report:#?}");
    assert!(first.interval.ends_with("-2"), "{first}");
    assert!(first.why.contains("changed after it closed"), "{first}");
    assert_eq!(report.problems.len(), 1, "the rest of the chain still verifies: {report:#?}");
}

#[test]
fn a_deleted_row_or_link_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("l.db");
    ledger_with(&path, 4);
    sql(
        &path,
        "DROP TRIGGER intervals_append_only;
         DELETE FROM intervals WHERE container_id = 'c3';",
    );
    let l = open(&path, &clock());
    let report = l.verify_chain().expect("verify");
    let first = report.problems.first().expect("named");
    assert_eq!(first.chain_seq, 3, "{report:#?}");
    assert!(first.why.contains("no longer holds"), "{first}");
    drop(l);

    // Deleting the row and its link: the chain has a hole where it was.
    let path = dir.path().join("l2.db");
    ledger_with(&path, 4);
    sql(
        &path,
        "DROP TRIGGER intervals_append_only; DROP TRIGGER chain_append_only;
         DELETE FROM chain WHERE interval_seq = (SELECT seq FROM intervals WHERE container_id = 'c2');
         DELETE FROM intervals WHERE container_id = 'c2';",
    );
    let l = open(&path, &clock());
    let report = l.verify_chain().expect("verify");
    let first = report.problems.first().expect("named");
    assert_eq!(first.chain_seq, 2, "{report:#?}");
    assert!(first.why.contains("missing"), "{first}");
}

#[test]
fn preemption_marks_and_peaks_are_chained_and_billed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = clock();
    let mut l = open(&dir.path().join("l.db"), &c);
    let mut s = start("victim", "acme/dev", "0");
    s.class = Class::Burst;
    s.nvlink_domain = Some(1);
    l.open_interval(&s).expect("open");
    for sm in [10.0, 40.0, 25.0] {
        l.record_utilization(&[("victim".into(), "GPU-0".into(), sm)]).expect("sample");
    }
    assert_eq!(l.mark_preempted("victim").expect("mark"), 1);
    assert_eq!(l.mark_preempted("nobody").expect("mark"), 0);
    c.advance(3_600_000);
    let closed = l.close_container("victim", "exited").expect("close").remove(0);
    assert!(closed.preempted);
    let u = closed.utilization.clone().expect("sampled");
    assert_eq!((u.samples, u.sm_percent_avg, u.sm_percent_max), (3, 25.0, Some(40.0)));
    assert!(closed.canonical(1).contains(r#""nvlink_domain":1"#));
    assert!(closed
        .canonical(1)
        .contains(r#""preempted":true,"util_samples":3,"util_sm_avg":25.0,"util_sm_max":40.0"#));
    assert!(l.verify_chain().expect("verify").ok());
    let mut q = UsageQuery::new(T0, T0 + 3_600_000, GroupBy::Team, Prices::default());
    q.prices.per_model.insert(
        "H100-80GB".into(),
        metering::Rate {
            reserved_per_gpu_hour: 2.0,
            burst_per_gpu_hour: 1.0,
            nvlink_premium_per_gpu_hour: 0.25,
        },
    );
    let r = l.usage(&q).expect("usage");
    assert_eq!(
        (r.total.preempted_gpu_seconds, r.total.burst_cost, r.total.premium_cost),
        (3600.0, 1.0, 0.25)
    );
    assert_eq!(r.total.cost, 1.25);
}
