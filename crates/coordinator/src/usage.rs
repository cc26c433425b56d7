//! Usage that proves itself, at the coordinator ([`fleet::proof`]): node keys pinned by
//! the operator, uploads stored only when they verify, each node's chain heads and signed
//! segments kept beside the intervals, and fleet bills exported with everything needed to
//! check them offline.
//!
//! | route | who | what |
//! |---|---|---|
//! | `PUT /v1/nodes/{node}/key` | admin | pin the node's public key ([`RegisterNodeKey`]; `replace` to change one) |
//! | `GET /v1/nodes/{node}/key` | admin, that node | the pinned key |
//! | `POST /v1/nodes/{node}/usage` | that node | a signed segment ([`UsageUpload`]) → [`UploadOutcome`] |
//! | `GET /v1/nodes/{node}/usage/head?ledger_id=` | admin, that node | the newest link held for that ledger |
//! | `GET /v1/usage/export?from_ms=&to_ms=&by=&node=` | admin | a [`BillExport`] |
//!
//! Records (the store's proof records, the same on SQLite and etcd):
//!
//! | key | value |
//! |---|---|
//! | `nodekey/{node}` | [`NodeKeyRecord`] |
//! | `head/{node}/{ledger}` | [`ChainHead`]: the newest link stored |
//! | `seg/{node}/{ledger}/{head seq:020}` | [`StoredSegment`]: the signature and the interval ids, in chain order |
//!
//! An upload is stored in three steps, each safe to repeat: its intervals (insert-or-ignore
//! by id), its segment record (created once; the same segment again is fine, another one
//! at the same place is a fork, refused), then the head moves from the one the checks were
//! made against to the segment's last link (compare-and-set: two coordinators storing the
//! same upload move it once, the other answers 409 and the node counts it as stored). A
//! crash between steps leaves the head where it was: the node sends the segment again.

use std::collections::{BTreeMap, BTreeSet};

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use fleet::proof::{
    self, BillExport, NodeKeyRecord, NodeProof, ProofError, SegmentProof, SignedSegment,
};
use metering::chain::ChainHead;
use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};

use crate::app::{App, Coordinator};
use crate::http::{json_body, query, ApiErr, ApiResult, Peer};
use crate::now_ms;
use crate::signing;
use crate::store::{self, PolicyStore, StoreError};
use crate::wire::{RegisterNodeKey, UploadOutcome, UsageUpload, MAX_UPLOAD_BATCH};

fn node_key_record(node: &str) -> String {
    format!("nodekey/{node}")
}

fn head_record(node: &str, ledger: &str) -> String {
    format!("head/{node}/{ledger}")
}

fn segments_of(node: &str, ledger: &str) -> String {
    format!("seg/{node}/{ledger}/")
}

fn segment_record(node: &str, ledger: &str, head_seq: u64) -> String {
    format!("seg/{node}/{ledger}/{head_seq:020}")
}

/// A stored upload: the node's signature and which intervals it covers, in chain order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredSegment {
    pub signed: SignedSegment,
    pub ids: Vec<String>,
    pub received_ms: u64,
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(format!("encode: {e}")))
}

/// The key pinned for `node`, if any.
pub async fn node_key(
    store: &dyn PolicyStore,
    node: &str,
) -> Result<Option<NodeKeyRecord>, StoreError> {
    store.proof_get(node_key_record(node)).await?.map(|t| decode("node key", &t)).transpose()
}

/// The newest link stored for `node`'s ledger `ledger` (empty: none), and the record's
/// exact text (what a compare-and-set must find).
async fn head(
    store: &dyn PolicyStore,
    node: &str,
    ledger: &str,
) -> Result<(ChainHead, Option<String>), StoreError> {
    match store.proof_get(head_record(node, ledger)).await? {
        Some(t) => Ok((decode("chain head", &t)?, Some(t))),
        None => Ok((ChainHead::empty(ledger), None)),
    }
}

/// The HTTP status of a refused upload: not allowed (403), not next (409), not intact (422).
fn status_of(e: &ProofError) -> StatusCode {
    match e {
        ProofError::Unsigned { .. }
        | ProofError::NoKey { .. }
        | ProofError::WrongKey { .. }
        | ProofError::BadSignature { .. } => StatusCode::FORBIDDEN,
        ProofError::NotNext { .. } => StatusCode::CONFLICT,
        ProofError::Malformed(_) | ProofError::Chain { .. } => StatusCode::UNPROCESSABLE_ENTITY,
    }
}

/// `POST /v1/nodes/{node}/usage`: checked by [`proof::check_upload`] against the key
/// pinned for the node and the head held for the ledger, then stored (see the module docs).
/// Every refusal is in the audit log.
pub(crate) async fn upload(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<UploadOutcome>> {
    let who = app.require_node(&headers, peer, "upload usage", &node, false)?;
    let up: UsageUpload = json_body(&body, "usage upload")?;
    if up.intervals.len() > MAX_UPLOAD_BATCH {
        return Err(ApiErr::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{} intervals in one upload; at most {MAX_UPLOAD_BATCH}", up.intervals.len()),
        ));
    }
    for i in &up.intervals {
        store::check_interval(&node, i).map_err(ApiErr::bad_request)?;
    }
    let refuse = |e: ProofError| {
        app.refuse(who.to_string(), "upload usage", format!("{}: {e}", e.kind()), status_of(&e))
    };
    let Some(seg) = &up.segment else {
        return Err(refuse(ProofError::Unsigned { node: node.clone() }));
    };
    crate::validate_name("ledger id", &seg.ledger_id).map_err(ApiErr::bad_request)?;
    let store = app.store.as_ref();
    let key = match node_key(store, &node).await.map_err(ApiErr::store)? {
        Some(rec) => {
            Some(rec.key().map_err(|e| ApiErr::store(StoreError::Corrupt(e.to_string())))?)
        }
        None => None,
    };
    let (held, held_text) = head(store, &node, &seg.ledger_id).await.map_err(ApiErr::store)?;
    proof::check_upload(&node, key.as_ref(), &held, Some(seg), &up.intervals).map_err(refuse)?;
    app.touch(&node);

    // 1. The intervals.
    let n = up.intervals.len();
    let ids: Vec<String> = up.intervals.iter().map(|i| i.id.to_string()).collect();
    let out = store.insert_usage(node.clone(), up.intervals).await.map_err(ApiErr::store)?;
    if !out.conflicts.is_empty() {
        error!(node = %node, conflicts = ?out.conflicts, "usage upload: interval ids already stored with other content; the chain is not moved");
        return Err(ApiErr::new(
            StatusCode::CONFLICT,
            format!(
                "intervals {:?} are stored with other content; the chain of ledger {} stays at seq {}",
                out.conflicts, seg.ledger_id, held.seq
            ),
        ));
    }
    // 2. The segment, once.
    let record = StoredSegment { signed: seg.clone(), ids, received_ms: now_ms() };
    let at = segment_record(&node, &seg.ledger_id, seg.head_seq);
    let text = encode(&record).map_err(ApiErr::store)?;
    if !store.proof_cas(at.clone(), None, text).await.map_err(ApiErr::store)? {
        let stored: Option<StoredSegment> = store
            .proof_get(at)
            .await
            .map_err(ApiErr::store)?
            .map(|t| decode("segment", &t))
            .transpose()
            .map_err(ApiErr::store)?;
        if stored.is_none_or(|s| s.signed != *seg) {
            return Err(app.refuse(
                who.to_string(),
                "upload usage",
                format!(
                    "another segment ending at chain seq {} of ledger {} is stored: node {node}'s ledger forked",
                    seg.head_seq, seg.ledger_id
                ),
                StatusCode::CONFLICT,
            ));
        }
    }
    // 3. The head, from what the checks saw to the segment's last link.
    let new_head = ChainHead {
        ledger_id: seg.ledger_id.clone(),
        seq: seg.head_seq,
        hash: seg.head_hash.clone(),
    };
    let moved = store
        .proof_cas(
            head_record(&node, &seg.ledger_id),
            held_text,
            encode(&new_head).map_err(ApiErr::store)?,
        )
        .await
        .map_err(ApiErr::store)?;
    if !moved {
        return Err(ApiErr::new(
            StatusCode::CONFLICT,
            format!(
                "replayed: ledger {} of node {node} moved past chain seq {} meanwhile (the same upload through another coordinator?)",
                seg.ledger_id, held.seq
            ),
        ));
    }
    info!(node = %node, ledger = %seg.ledger_id, intervals = n, from = seg.after_seq + 1, to = seg.head_seq, accepted = out.accepted, "signed usage stored");
    Ok(Json(out))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeadQuery {
    ledger_id: String,
}

/// `GET /v1/nodes/{node}/usage/head?ledger_id=`.
pub(crate) async fn usage_head(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    q: Result<Query<HeadQuery>, QueryRejection>,
) -> ApiResult<Json<ChainHead>> {
    app.require_node(&headers, peer, "read a usage chain head", &node, true)?;
    let q = query(q)?;
    crate::validate_name("ledger id", &q.ledger_id).map_err(ApiErr::bad_request)?;
    let (h, _) = head(app.store.as_ref(), &node, &q.ledger_id).await.map_err(ApiErr::store)?;
    Ok(Json(h))
}

/// `PUT /v1/nodes/{node}/key`: pin a node's key (admin). The same key again is a no-op;
/// another key needs `replace`.
pub(crate) async fn register_key(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<NodeKeyRecord>)> {
    let admin = app.require_admin(&headers, peer, "register a node key")?;
    crate::validate_node_id(&node).map_err(ApiErr::bad_request)?;
    let r: RegisterNodeKey = json_body(&body, "node key")?;
    let key = signing::parse_verifying_key(&r.public_key, &format!("node {node}'s key"))
        .map_err(|e| ApiErr::bad_request(e.to_string()))?;
    let public_key = signing::encode_verifying_key(&key);
    let store = app.store.as_ref();
    let at = node_key_record(&node);
    let current = store.proof_get(at.clone()).await.map_err(ApiErr::store)?;
    if let Some(text) = &current {
        let rec: NodeKeyRecord = decode("node key", text).map_err(ApiErr::store)?;
        if rec.public_key == public_key {
            return Ok((StatusCode::OK, Json(rec)));
        }
        if !r.replace {
            return Err(ApiErr::new(
                StatusCode::CONFLICT,
                format!(
                    "node {node} already has key {} (registered by {} at {}); pass replace to pin {} instead",
                    rec.key_id,
                    rec.registered_by,
                    tessera_api::time::format_utc(rec.registered_ms),
                    signing::key_id(&key)
                ),
            ));
        }
    }
    let rec = NodeKeyRecord {
        node: node.clone(),
        public_key,
        key_id: signing::key_id(&key),
        registered_ms: now_ms(),
        registered_by: admin.clone(),
    };
    let text = encode(&rec).map_err(ApiErr::store)?;
    if !store.proof_cas(at, current, text).await.map_err(ApiErr::store)? {
        return Err(ApiErr::new(StatusCode::CONFLICT, "the node's key changed meanwhile; retry"));
    }
    info!(node = %node, key_id = %rec.key_id, admin = %admin, "node key registered");
    Ok((StatusCode::CREATED, Json(rec)))
}

/// `GET /v1/nodes/{node}/key`.
pub(crate) async fn get_key(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
) -> ApiResult<Json<NodeKeyRecord>> {
    app.require_node(&headers, peer, "read a node key", &node, true)?;
    match node_key(app.store.as_ref(), &node).await.map_err(ApiErr::store)? {
        Some(rec) => Ok(Json(rec)),
        None => {
            Err(ApiErr::new(StatusCode::NOT_FOUND, format!("no key is registered for node {node}")))
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExportParams {
    from_ms: u64,
    to_ms: u64,
    #[serde(default)]
    by: Option<String>,
    /// Comma-separated node ids.
    #[serde(default)]
    node: Option<String>,
}

/// `GET /v1/usage/export`: the fleet's bill for a window, priced with the newest revision
/// that verifies, with the signed segments of every interval in it.
pub(crate) async fn export(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    q: Result<Query<ExportParams>, QueryRejection>,
) -> ApiResult<Json<BillExport>> {
    app.require_admin(&headers, peer, "export a bill")?;
    let p = query(q)?;
    let by = match p.by.as_deref() {
        None => metering::GroupBy::Org,
        Some(s) => {
            s.parse().map_err(|e: metering::LedgerError| ApiErr::bad_request(e.to_string()))?
        }
    };
    let only: Option<Vec<String>> = p
        .node
        .map(|s| s.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect());
    let q = metering::UsageQuery::new(p.from_ms, p.to_ms, by, metering::Prices::default());
    Ok(Json(bill_export(&app, q, only).await?))
}

/// The bill of `q` (priced with the newest verified revision) with its proofs.
pub(crate) async fn bill_export(
    app: &Coordinator,
    q: metering::UsageQuery,
    only: Option<Vec<String>>,
) -> ApiResult<BillExport> {
    let made_ms = now_ms();
    let (q, envelope, _, skipped) = app.priced_query(q, made_ms).await?;
    for s in &skipped {
        warn!("bill export: not pricing with {s}");
    }
    let store = app.store.as_ref();
    let rows = store.usage_intervals(q.from_ms, q.to_ms).await.map_err(ApiErr::store)?;
    let rows: Vec<(String, metering::ClosedInterval)> =
        rows.into_iter().filter(|(n, _)| only.as_ref().is_none_or(|o| o.contains(n))).collect();
    let spans: Vec<metering::Span> = rows.iter().map(|(_, i)| store::span_of(i)).collect();
    let report = metering::aggregate(&spans, &q)
        .map_err(|e| ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;

    // Per node and ledger, the chain seqs the window needs.
    let mut needed: BTreeMap<(String, String), BTreeSet<u64>> = BTreeMap::new();
    for (node, i) in &rows {
        let (Some(link), Some(ledger)) = (&i.chain, ledger_of(node, i.id.as_str())) else {
            continue;
        };
        needed.entry((node.clone(), ledger.to_string())).or_default().insert(link.seq);
    }
    let mut nodes: BTreeMap<String, NodeProof> = BTreeMap::new();
    for ((node, ledger), seqs) in needed {
        let entry = match nodes.entry(node.clone()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let key = node_key(store, &node).await.map_err(ApiErr::store)?;
                v.insert(NodeProof {
                    node: node.clone(),
                    public_key: key.map(|k| k.public_key),
                    segments: Vec::new(),
                    heads: Vec::new(),
                })
            }
        };
        let mut covered_to = 0u64;
        for seq in seqs {
            if seq <= covered_to {
                continue;
            }
            let found = store
                .proof_range(segments_of(&node, &ledger), segment_record(&node, &ledger, seq), 1)
                .await
                .map_err(ApiErr::store)?;
            let Some((_, text)) = found.into_iter().next() else { break };
            let seg: StoredSegment = decode("segment", &text).map_err(ApiErr::store)?;
            covered_to = seg.signed.head_seq;
            let intervals =
                store.usage_by_ids(node.clone(), seg.ids.clone()).await.map_err(ApiErr::store)?;
            entry.segments.push(SegmentProof { signed: seg.signed, intervals });
        }
        let (h, _) = head(store, &node, &ledger).await.map_err(ApiErr::store)?;
        entry.heads.push(h);
    }
    Ok(BillExport {
        format: proof::EXPORT_FORMAT.to_string(),
        made_ms,
        query: q,
        policy: envelope,
        coordinator_key: signing::encode_verifying_key(&app.signer.verifying_key()),
        nodes: nodes.into_values().collect(),
        report,
    })
}

/// The ledger id in an interval id `{node}-{ledger}-{seq}`.
fn ledger_of<'a>(node: &str, id: &'a str) -> Option<&'a str> {
    id.strip_prefix(node)?.strip_prefix('-')?.rsplit_once('-').map(|(ledger, _)| ledger)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ledger_ids_come_out_of_interval_ids() {
        assert_eq!(ledger_of("node-a", "node-a-0123456789ab-17"), Some("0123456789ab"));
        assert_eq!(ledger_of("node-a", "node-b-0123456789ab-17"), None);
        assert_eq!(ledger_of("n", "n-x"), None);
        assert!(segment_record("n", "l", 7) > segment_record("n", "l", 6));
        assert!(segment_record("n", "l", 10) > segment_record("n", "l", 9), "zero-padded");
    }
}
