//! The one error of tesserad's core ([`CoreError`]): what the [`crate::controller`] and
//! the [`crate::node`] return when an action fails (Firecracker's shape: a typed action
//! error inside, the wire's error only at the API). The HTTP layer turns it into the
//! wire's [`tessera_api::ApiError`] in one place, `server::wire_error`, with the status
//! [`CoreError::code`] names (`server::tests::core_errors_convert_once_with_their_status`).
//!
//! The variants are the kinds of failure a client acts on differently: a refusal of the
//! request (its [`Detail`] says why, for whom and by which rule) or a failure of the daemon
//! itself (the store, the ledger, the MPS supervisor, anything else), in which nothing was
//! granted.

use std::fmt;

use metering::LedgerError;
use tessera_api::ErrorCode;

use crate::store::StoreError;

/// Why a refused action was refused: a sentence a person can act on, and who asked, for
/// what and which policy rule decided (as the wire error carries them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Detail {
    pub message: String,
    pub tenant: Option<String>,
    pub request: Option<String>,
    /// The policy rule that decided, as a JSON path into the policy.
    pub rule: Option<String>,
}

impl Detail {
    /// A refusal with only its sentence.
    pub fn new(message: impl Into<String>) -> Detail {
        Detail { message: message.into(), ..Detail::default() }
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Why an action of tesserad's core failed.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The request itself is malformed (400).
    #[error("{0}")]
    BadRequest(Detail),
    /// The caller could not be identified as a tenant (403).
    #[error("{0}")]
    UnknownTenant(Detail),
    /// The policy refuses the request (403).
    #[error("{0}")]
    Refused(Detail),
    /// Allowed, but the node has nothing free that fits (503).
    #[error("{0}")]
    NoCapacity(Detail),
    /// This daemon does not implement that (501).
    #[error("{0}")]
    NotSupported(Detail),
    /// No such allocation or device (404).
    #[error("{0}")]
    NotFound(Detail),
    /// The request conflicts with what is recorded (409).
    #[error("{0}")]
    Conflict(Detail),
    /// Within the tenant's guarantees, but the capacity is lent out and being reclaimed:
    /// a retry after the time the message names is granted (503).
    #[error("{0}")]
    Reclaiming(Detail),
    /// The node's store failed; nothing was granted (500).
    #[error("tesserad: {0}")]
    Store(#[from] StoreError),
    /// The metering ledger failed (500).
    #[error("tesserad ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// The MPS supervisor failed (500).
    #[error("tesserad mps: {0}")]
    Mps(#[from] mpsd::MpsError),
    /// Anything else in the daemon failed; nothing was granted (500). The message is whole
    /// (it names the daemon and the step).
    #[error("{0}")]
    Internal(Detail),
}

impl CoreError {
    pub fn bad_request(message: impl Into<String>) -> CoreError {
        CoreError::BadRequest(Detail::new(message))
    }

    pub fn unknown_tenant(message: impl Into<String>) -> CoreError {
        CoreError::UnknownTenant(Detail::new(message))
    }

    pub fn refused(message: impl Into<String>) -> CoreError {
        CoreError::Refused(Detail::new(message))
    }

    pub fn no_capacity(message: impl Into<String>) -> CoreError {
        CoreError::NoCapacity(Detail::new(message))
    }

    pub fn not_supported(message: impl Into<String>) -> CoreError {
        CoreError::NotSupported(Detail::new(message))
    }

    pub fn not_found(message: impl Into<String>) -> CoreError {
        CoreError::NotFound(Detail::new(message))
    }

    pub fn conflict(message: impl Into<String>) -> CoreError {
        CoreError::Conflict(Detail::new(message))
    }

    pub fn reclaiming(message: impl Into<String>) -> CoreError {
        CoreError::Reclaiming(Detail::new(message))
    }

    pub fn internal(message: impl Into<String>) -> CoreError {
        CoreError::Internal(Detail::new(message))
    }

    /// The failure of kind `code` with `detail`.
    pub fn of(code: ErrorCode, detail: Detail) -> CoreError {
        match code {
            ErrorCode::BadRequest => CoreError::BadRequest(detail),
            ErrorCode::UnknownTenant => CoreError::UnknownTenant(detail),
            ErrorCode::Refused => CoreError::Refused(detail),
            ErrorCode::NoCapacity => CoreError::NoCapacity(detail),
            ErrorCode::NotSupported => CoreError::NotSupported(detail),
            ErrorCode::NotFound => CoreError::NotFound(detail),
            ErrorCode::Conflict => CoreError::Conflict(detail),
            ErrorCode::Reclaiming => CoreError::Reclaiming(detail),
            ErrorCode::Internal => CoreError::Internal(detail),
        }
    }

    /// The wire's code for it (and so its HTTP status).
    pub fn code(&self) -> ErrorCode {
        match self {
            CoreError::BadRequest(_) => ErrorCode::BadRequest,
            CoreError::UnknownTenant(_) => ErrorCode::UnknownTenant,
            CoreError::Refused(_) => ErrorCode::Refused,
            CoreError::NoCapacity(_) => ErrorCode::NoCapacity,
            CoreError::NotSupported(_) => ErrorCode::NotSupported,
            CoreError::NotFound(_) => ErrorCode::NotFound,
            CoreError::Conflict(_) => ErrorCode::Conflict,
            CoreError::Reclaiming(_) => ErrorCode::Reclaiming,
            CoreError::Store(_)
            | CoreError::Ledger(_)
            | CoreError::Mps(_)
            | CoreError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// Why it was refused or failed; `None` for a failure of the store, the ledger or the
    /// MPS supervisor (their own error says).
    pub fn detail(&self) -> Option<&Detail> {
        match self {
            CoreError::BadRequest(d)
            | CoreError::UnknownTenant(d)
            | CoreError::Refused(d)
            | CoreError::NoCapacity(d)
            | CoreError::NotSupported(d)
            | CoreError::NotFound(d)
            | CoreError::Conflict(d)
            | CoreError::Reclaiming(d)
            | CoreError::Internal(d) => Some(d),
            CoreError::Store(_) | CoreError::Ledger(_) | CoreError::Mps(_) => None,
        }
    }

    /// [`CoreError::detail`], to add who asked or the rule after the fact.
    pub fn detail_mut(&mut self) -> Option<&mut Detail> {
        match self {
            CoreError::BadRequest(d)
            | CoreError::UnknownTenant(d)
            | CoreError::Refused(d)
            | CoreError::NoCapacity(d)
            | CoreError::NotSupported(d)
            | CoreError::NotFound(d)
            | CoreError::Conflict(d)
            | CoreError::Reclaiming(d)
            | CoreError::Internal(d) => Some(d),
            CoreError::Store(_) | CoreError::Ledger(_) | CoreError::Mps(_) => None,
        }
    }

    /// The sentence the wire's error carries (the same as `Display`).
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// The policy rule that decided a refusal.
    pub fn rule(&self) -> Option<&str> {
        self.detail().and_then(|d| d.rule.as_deref())
    }

    /// The tenant a refusal names.
    pub fn tenant(&self) -> Option<&str> {
        self.detail().and_then(|d| d.tenant.as_deref())
    }

    /// The request a refusal names.
    pub fn request(&self) -> Option<&str> {
        self.detail().and_then(|d| d.request.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_code_and_keeps_its_detail() {
        let d = Detail {
            message: "no".into(),
            tenant: Some("acme".into()),
            request: Some("gpu=1".into()),
            rule: Some("tiers.untrusted".into()),
        };
        for code in [
            ErrorCode::BadRequest,
            ErrorCode::UnknownTenant,
            ErrorCode::Refused,
            ErrorCode::NoCapacity,
            ErrorCode::NotSupported,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
            ErrorCode::Reclaiming,
            ErrorCode::Internal,
        ] {
            let e = CoreError::of(code, d.clone());
            assert_eq!(e.code(), code);
            assert_eq!(e.detail(), Some(&d));
            assert_eq!(e.to_string(), "no");
            assert_eq!(
                (e.tenant(), e.request(), e.rule()),
                (Some("acme"), Some("gpu=1"), Some("tiers.untrusted"))
            );
        }
        let e = CoreError::of(ErrorCode::Internal, d.clone());
        assert_eq!((e.code(), e.detail()), (ErrorCode::Internal, Some(&d)));
    }
}
