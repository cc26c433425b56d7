//! Kubelet's word only from kubelet: every assignment the device plugin's `Allocate` hands
//! to kubelet carries a token, 128 random bits, that tesserad recorded first (durably,
//! `device-plugin-tokens.json` beside the state database). A container's
//! `tessera.io/device-plugin` is honoured only with a token issued here for exactly its
//! resource and device ids; anyone can write the annotation into a config, only kubelet
//! is handed tokens (the plugin's sockets are root's, in kubelet's plugin directory).
//!
//! kubelet keeps the `Allocate` answer of a pod's container for the pod's life and hands
//! the same annotation to every restart of that container (it does not call `Allocate`
//! again), so a token is single-use per pod container rather than per create: its first
//! use binds it to that pod container (namespace, pod, pod uid where containerd says it,
//! container name); after that only the same pod container may use it, and only while no
//! other container holds a grant made with it. A token is honoured only for a pod's
//! container (containerd's CRI annotations), never for a sandbox or a container of no pod.
//!
//! Expiry: a token never used is forgotten [`UNUSED_TTL_MS`] after it was issued (an image
//! pull may take long; kubelet never asks again for a pod it has admitted); a used one
//! [`KEEP_AFTER_USE_MS`] after it was last seen held by a grant (the pod's container may
//! restart). At most [`MAX_TOKENS`] are kept (the oldest not held by a grant go first).
//!
//! The decisions are pure ([`TokenBook`]); [`Node`] reads and writes the file.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tessera_api::cri::{PodContainer, Role, Workload};
use tessera_api::deviceplugin::{
    AssignmentToken, IssuedAssignment, PluginAssignment, ASSIGNMENT_ANNOTATION,
};
use tessera_api::AllocateRequest;
use tracing::warn;

use super::Node;
use crate::error::{CoreError, Detail};

/// The file of issued tokens, beside `state.db`.
pub const TOKENS_FILE: &str = "device-plugin-tokens.json";
/// How long a token nobody used is honoured after its `Allocate`.
pub const UNUSED_TTL_MS: u64 = 24 * 3600 * 1000;
/// How long a used token is kept after a grant made with it was last seen.
pub const KEEP_AFTER_USE_MS: u64 = 24 * 3600 * 1000;
/// The most tokens kept.
pub const MAX_TOKENS: usize = 4096;
/// The version of the file's form.
const BOOK_VERSION: u32 = 1;

/// The pod container a token was first used by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    pub container: String,
}

impl Holder {
    /// The holder of a pod's application container (`None` for a sandbox).
    pub fn of(w: &Workload) -> Option<Holder> {
        Some(Holder {
            namespace: w.namespace.clone(),
            pod: w.pod.clone(),
            pod_uid: w.pod_uid.clone(),
            container: w.container.clone()?,
        })
    }

    /// The pod container a config's CRI annotations name (`None`: no pod's container).
    pub fn from_annotations(a: &BTreeMap<String, String>) -> Option<Holder> {
        match PodContainer::from_annotations(a) {
            Ok(Some(pc)) if matches!(pc.role, Role::Container(_)) => Holder::of(&pc.workload),
            _ => None,
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.pod, self.container)?;
        if let Some(uid) = &self.pod_uid {
            write!(f, " (pod uid {uid})")?;
        }
        Ok(())
    }
}

/// One issued token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// The assignment it was issued for (`v1;<resource>;<ids>`).
    pub assignment: String,
    pub issued_ms: u64,
    /// When it is forgotten unless a grant holds it (see the module documentation).
    pub expires_ms: u64,
    /// The pod container that used it first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
    /// The container whose grant was made with it last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
}

/// Every token issued and not forgotten: token → entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBook {
    pub version: u32,
    pub tokens: BTreeMap<String, TokenEntry>,
}

impl Default for TokenBook {
    fn default() -> Self {
        TokenBook { version: BOOK_VERSION, tokens: BTreeMap::new() }
    }
}

/// Why an assignment's token is not honoured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenRefusal {
    #[error("was not issued by this node's device plugin (or was forgotten after it expired)")]
    Unknown,
    #[error("was issued for {issued_for}, not for these devices")]
    OtherAssignment { issued_for: String },
    #[error("expired at {}", tessera_api::time::format_utc(*.at_ms))]
    Expired { at_ms: u64 },
    #[error(
        "is kubelet's for a pod's container, and this config carries no pod container's CRI annotations"
    )]
    NotAPod,
    #[error("was used by pod container {holder}: it is that container's alone")]
    OtherHolder { holder: String },
    #[error("is held by container {container_id}'s grant")]
    InUse { container_id: String },
}

impl TokenBook {
    /// Records `token` for `a`, issued at `now`.
    pub fn issue(&mut self, now: u64, token: &AssignmentToken, a: &PluginAssignment) {
        self.tokens.insert(
            token.as_str().to_string(),
            TokenEntry {
                assignment: a.to_string(),
                issued_ms: now,
                expires_ms: now.saturating_add(UNUSED_TTL_MS),
                holder: None,
                container_id: None,
            },
        );
    }

    /// Whether `issued` may make `container_id`'s grant for `holder` now; `live` says
    /// whether a container holds a grant.
    pub fn check(
        &self,
        now: u64,
        issued: &IssuedAssignment,
        holder: Option<&Holder>,
        container_id: &str,
        live: &dyn Fn(&str) -> bool,
    ) -> Result<(), TokenRefusal> {
        let e = self.tokens.get(issued.token().as_str()).ok_or(TokenRefusal::Unknown)?;
        if e.assignment != issued.assignment().to_string() {
            return Err(TokenRefusal::OtherAssignment { issued_for: e.assignment.clone() });
        }
        let held_by = e.container_id.as_deref().filter(|c| live(c));
        if e.expires_ms <= now && held_by.is_none() {
            return Err(TokenRefusal::Expired { at_ms: e.expires_ms });
        }
        let holder = holder.ok_or(TokenRefusal::NotAPod)?;
        if let Some(first) = e.holder.as_ref().filter(|h| *h != holder) {
            return Err(TokenRefusal::OtherHolder { holder: first.to_string() });
        }
        match held_by {
            Some(c) if c != container_id => {
                Err(TokenRefusal::InUse { container_id: c.to_string() })
            }
            _ => Ok(()),
        }
    }

    /// Records that `container_id` (of `holder`) makes its grant with `token` now.
    pub fn bind(&mut self, now: u64, token: &AssignmentToken, holder: &Holder, container_id: &str) {
        if let Some(e) = self.tokens.get_mut(token.as_str()) {
            e.holder.get_or_insert_with(|| holder.clone());
            e.container_id = Some(container_id.to_string());
            e.expires_ms = now.saturating_add(KEEP_AFTER_USE_MS);
        }
    }

    /// Keeps the tokens held by live grants (`live`) [`KEEP_AFTER_USE_MS`] ahead, forgets
    /// the expired ones, and the oldest beyond [`MAX_TOKENS`]. Whether anything changed.
    pub fn tidy(&mut self, now: u64, live: &dyn Fn(&str) -> bool) -> bool {
        let before = self.clone();
        let held = |e: &TokenEntry| e.container_id.as_deref().is_some_and(live);
        for e in self.tokens.values_mut().filter(|e| held(e)) {
            // Written again only when half the time is gone, not at every tidy.
            if e.expires_ms < now.saturating_add(KEEP_AFTER_USE_MS / 2) {
                e.expires_ms = now.saturating_add(KEEP_AFTER_USE_MS);
            }
        }
        self.tokens.retain(|_, e| held(e) || e.expires_ms > now);
        if self.tokens.len() > MAX_TOKENS {
            let mut old: Vec<(u64, String)> = self
                .tokens
                .iter()
                .filter(|(_, e)| !held(e))
                .map(|(t, e)| (e.issued_ms, t.clone()))
                .collect();
            old.sort();
            let excess = self.tokens.len() - MAX_TOKENS;
            for (_, t) in old.into_iter().take(excess) {
                self.tokens.remove(&t);
            }
        }
        *self != before
    }
}

/// 16 bytes from the kernel's random source.
fn random_token() -> Result<AssignmentToken, CoreError> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).map_err(
        |e| CoreError::internal(format!("tesserad: no token: reading /dev/urandom: {e}")),
    )?;
    Ok(AssignmentToken::from_bytes(bytes))
}

impl Node {
    fn tokens_path(&self) -> PathBuf {
        self.store.path().with_file_name(TOKENS_FILE)
    }

    /// The book as recorded (empty when there is no file; an unreadable file is an error:
    /// no kubelet assignment is issued or honoured until it is fixed).
    fn load_tokens(&self) -> Result<TokenBook, CoreError> {
        let book: Option<TokenBook> =
            crate::durable::load_json(&self.tokens_path(), "device-plugin tokens")
                .map_err(|e| CoreError::internal(format!("tesserad: {e}")))?;
        Ok(book.unwrap_or_default())
    }

    fn store_tokens(&self, book: &TokenBook) -> Result<(), CoreError> {
        crate::durable::store_private_json(&self.tokens_path(), "device-plugin tokens", book)
            .map_err(|e| CoreError::internal(format!("tesserad: {e}")))
    }

    /// The containers that hold a grant now.
    fn live_containers(&self) -> Result<BTreeSet<String>, CoreError> {
        Ok(self.allocations()?.into_iter().map(|a| a.container_id.into_string()).collect())
    }

    /// Issues and records a token for each of `made` (the device plugin's `Allocate`):
    /// written durably before the answer goes to kubelet. All or nothing.
    pub fn issue_assignments(
        &self,
        made: &[PluginAssignment],
    ) -> Result<Vec<IssuedAssignment>, CoreError> {
        let now = tessera_api::time::now_ms();
        let live = self.live_containers()?;
        let mut book = self.load_tokens()?;
        book.tidy(now, &|c| live.contains(c));
        let mut issued = Vec::with_capacity(made.len());
        for a in made {
            let token = random_token()?;
            book.issue(now, &token, a);
            issued.push(IssuedAssignment::new(a.clone(), token));
        }
        book.tidy(now, &|c| live.contains(c));
        self.store_tokens(&book)?;
        Ok(issued)
    }

    /// Refuses (400, recorded as a `refuse` event) an assignment whose token this node did
    /// not issue for it, or may not honour for this container now.
    pub(super) fn check_token(
        &mut self,
        req: &AllocateRequest,
        issued: &IssuedAssignment,
    ) -> Result<(), CoreError> {
        let now = tessera_api::time::now_ms();
        let live = self.live_containers()?;
        let holder = Holder::from_annotations(&req.annotations);
        let verdict =
            self.load_tokens()?
                .check(now, issued, holder.as_ref(), &req.container_id, &|c| live.contains(c));
        if verdict.is_ok() {
            // kubelet's Allocate is answered by this create, granted or refused after.
            self.note_presented(issued.assignment());
        }
        verdict.map_err(|why| {
            let err = CoreError::BadRequest(Detail {
                message: format!(
                    "container {}: annotation {ASSIGNMENT_ANNOTATION}: token {} {why}; refusing device-plugin assignment {}",
                    req.container_id,
                    issued.token().short(),
                    issued.assignment()
                ),
                tenant: None,
                request: Some(req.request.to_string()),
                rule: Some(ASSIGNMENT_ANNOTATION.to_string()),
            });
            self.record_refusal(&req.container_id, &err);
            err
        })
    }

    /// Remembers that a create presented `a`'s verified token ([`MAX_PRESENTED`] kept).
    fn note_presented(&mut self, a: &PluginAssignment) {
        if !self.presented.contains(a) {
            self.presented.push_back(a.clone());
        }
        while self.presented.len() > super::MAX_PRESENTED {
            self.presented.pop_front();
        }
    }

    /// Records that `req`'s grant is made with `issued`'s token (checked by
    /// [`Node::check_token`] under this same lock).
    pub(super) fn bind_token(
        &self,
        req: &AllocateRequest,
        issued: &IssuedAssignment,
    ) -> Result<(), CoreError> {
        let holder = Holder::from_annotations(&req.annotations)
            .ok_or_else(|| CoreError::internal("a checked token lost its pod container"))?;
        let mut book = self.load_tokens()?;
        book.bind(tessera_api::time::now_ms(), issued.token(), &holder, &req.container_id);
        self.store_tokens(&book)
    }

    /// Keeps the book tidy ([`TokenBook::tidy`]); written only when that changed it.
    pub(super) fn tidy_tokens(&self, allocations: &[tessera_api::Allocation]) {
        let path = self.tokens_path();
        if !path.exists() {
            return;
        }
        let live: BTreeSet<&str> = allocations.iter().map(|a| a.container_id.as_str()).collect();
        let tidied = self.load_tokens().and_then(|mut book| {
            match book.tidy(tessera_api::time::now_ms(), &|c| live.contains(c)) {
                true => self.store_tokens(&book),
                false => Ok(()),
            }
        });
        if let Err(e) = tidied {
            warn!("device-plugin tokens: {}", e.message());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_767_225_600_000;

    fn a(text: &str) -> PluginAssignment {
        text.parse().expect("assignment")
    }

    fn token(n: u8) -> AssignmentToken {
        AssignmentToken::from_bytes([n; 16])
    }

    fn holder(container: &str) -> Holder {
        Holder {
            namespace: "team-a".into(),
            pod: "trainer".into(),
            pod_uid: Some("uid-1".into()),
            container: container.into(),
        }
    }

    fn none(_: &str) -> bool {
        false
    }

    #[test]
    fn only_a_token_issued_for_exactly_these_ids_is_honoured() {
        let mut book = TokenBook::default();
        let gpu = a("v1;tessera.io/gpu;GPU-1");
        book.issue(T, &token(1), &gpu);
        let ok = IssuedAssignment::new(gpu.clone(), token(1));
        let main = holder("main");
        assert_eq!(book.check(T + 1, &ok, Some(&main), "c1", &none), Ok(()));
        // A token nobody issued (guessed, or from another node).
        let forged = IssuedAssignment::new(gpu.clone(), token(2));
        assert_eq!(book.check(T, &forged, Some(&main), "c1", &none), Err(TokenRefusal::Unknown));
        // The right token on other ids: another GPU, or one more.
        for other in ["v1;tessera.io/gpu;GPU-2", "v1;tessera.io/gpu;GPU-1,GPU-2"] {
            let moved = IssuedAssignment::new(a(other), token(1));
            assert!(
                matches!(
                    book.check(T, &moved, Some(&main), "c1", &none),
                    Err(TokenRefusal::OtherAssignment { .. })
                ),
                "{other}"
            );
        }
        // No pod container: refused whatever the token.
        assert_eq!(book.check(T, &ok, None, "c1", &none), Err(TokenRefusal::NotAPod));
        // Not used within its time: forgotten.
        assert!(matches!(
            book.check(T + UNUSED_TTL_MS, &ok, Some(&main), "c1", &none),
            Err(TokenRefusal::Expired { .. })
        ));
        assert!(book.tidy(T + UNUSED_TTL_MS, &none));
        assert_eq!(book.check(T, &ok, Some(&main), "c1", &none), Err(TokenRefusal::Unknown));
    }

    #[test]
    fn a_used_token_serves_its_pod_containers_restarts_and_nobody_else() {
        let mut book = TokenBook::default();
        let gpu = a("v1;tessera.io/gpu;GPU-1");
        book.issue(T, &token(1), &gpu);
        let issued = IssuedAssignment::new(gpu, token(1));
        let main = holder("main");
        book.bind(T + 5, &token(1), &main, "c1");
        let c1_live = |c: &str| c == "c1";
        // Replayed while c1 holds its grant: by another container of the pod, another
        // pod, or the same pod container again.
        let side = holder("side");
        assert!(matches!(
            book.check(T + 6, &issued, Some(&side), "c2", &c1_live),
            Err(TokenRefusal::OtherHolder { .. })
        ));
        let other_pod = Holder { pod: "other".into(), ..main.clone() };
        assert!(matches!(
            book.check(T + 6, &issued, Some(&other_pod), "c2", &none),
            Err(TokenRefusal::OtherHolder { .. })
        ));
        assert_eq!(
            book.check(T + 6, &issued, Some(&main), "c2", &c1_live),
            Err(TokenRefusal::InUse { container_id: "c1".into() })
        );
        // c1 itself again (a retried create): fine.
        assert_eq!(book.check(T + 6, &issued, Some(&main), "c1", &c1_live), Ok(()));
        // c1's grant is gone: its restart (a new container id, kubelet's same annotation).
        assert_eq!(book.check(T + 7, &issued, Some(&main), "c2", &none), Ok(()));
        // A used token stays while a grant holds it, and a day after.
        let long = T + 10 * KEEP_AFTER_USE_MS;
        book.bind(T + 8, &token(1), &main, "c2");
        let c2_live = |c: &str| c == "c2";
        assert!(book.tidy(long, &c2_live), "its time is moved on");
        assert_eq!(book.check(long, &issued, Some(&main), "c2", &c2_live), Ok(()));
        assert!(!book.tidy(long + 1, &c2_live), "not written at every tidy");
        assert_eq!(
            book.check(long + KEEP_AFTER_USE_MS - 1, &issued, Some(&main), "c3", &none),
            Ok(())
        );
        assert!(book.tidy(long + KEEP_AFTER_USE_MS, &none));
        assert!(book.tokens.is_empty());
    }

    #[test]
    fn the_book_is_bounded_and_keeps_what_grants_hold() {
        let mut book = TokenBook::default();
        let gpu = a("v1;tessera.io/gpu;GPU-1");
        for i in 0..=MAX_TOKENS + 10 {
            let t = AssignmentToken::from_bytes(u128::try_from(i).expect("i").to_be_bytes());
            book.issue(T + i as u64, &t, &gpu);
            if i == 0 {
                book.bind(T, &t, &holder("main"), "held");
            }
        }
        assert!(book.tidy(T + 100, &|c| c == "held"));
        assert_eq!(book.tokens.len(), MAX_TOKENS);
        let first = AssignmentToken::from_bytes(0u128.to_be_bytes());
        assert!(book.tokens.contains_key(first.as_str()), "held by a grant: kept");
        let second = AssignmentToken::from_bytes(1u128.to_be_bytes());
        assert!(!book.tokens.contains_key(second.as_str()), "the oldest unheld: forgotten");
        // The file's form reads back.
        let json = serde_json::to_string(&book).expect("json");
        assert_eq!(serde_json::from_str::<TokenBook>(&json).expect("back"), book);
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let e = TokenRefusal::OtherHolder { holder: holder("main").to_string() };
        assert_eq!(
            e.to_string(),
            "was used by pod container team-a/trainer/main (pod uid uid-1): it is that container's alone"
        );
        assert!(TokenRefusal::Unknown.to_string().contains("not issued by this node"));
    }
}
