//! The HTTP plumbing every route module shares: the error answer ([`ApiErr`]), the peer
//! address extractor, and request bodies and queries parsed into typed values with a 400
//! naming what is wrong. Below the route modules (`server`, `quota`) and the state they are
//! handed (`app`): it depends on none of them.

use std::net::SocketAddr;

use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Query};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tracing::error;

use crate::store::StoreError;
use crate::wire::ErrorBody;

/// An error answer: an HTTP status and an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiErr {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiErr {
    pub fn status(&self) -> u16 {
        self.status.as_u16()
    }
    pub fn body(&self) -> &ErrorBody {
        &self.body
    }
    pub(crate) fn new(status: StatusCode, error: impl Into<String>) -> Self {
        ApiErr::with_body(status, ErrorBody { error: error.into(), path: None, who: None })
    }
    pub(crate) fn with_body(status: StatusCode, body: ErrorBody) -> Self {
        ApiErr { status, body }
    }
    pub(crate) fn bad_request(error: impl Into<String>) -> Self {
        ApiErr::new(StatusCode::BAD_REQUEST, error)
    }
    /// A store failure as the client should see it: its own mistakes as 4xx, a store
    /// that does not answer as 503, stored data that cannot be read as 500.
    pub(crate) fn store(e: StoreError) -> Self {
        match e {
            StoreError::Invalid(why) => ApiErr::bad_request(why),
            StoreError::Conflict { .. } | StoreError::Occupied { .. } => {
                ApiErr::new(StatusCode::CONFLICT, e.to_string())
            }
            StoreError::Deposed(_) => {
                ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, format!("{e}; ask again"))
            }
            StoreError::Etcd(_) | StoreError::Sqlite(_) => {
                error!("store: {e}");
                ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, format!("store unavailable: {e}"))
            }
            StoreError::Corrupt(_) | StoreError::ForeignKey { .. } | StoreError::Other(_) => {
                error!("store: {e}");
                ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, format!("store: {e}"))
            }
        }
    }
}

impl IntoResponse for ApiErr {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiErr>;

/// The peer's address (the server is made with `into_make_service_with_connect_info`).
pub(crate) type Peer = ConnectInfo<SocketAddr>;

/// A JSON request body as `T`, or a 400 naming `what` and the parse error.
pub(crate) fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> ApiResult<T> {
    serde_json::from_slice(body).map_err(|e| ApiErr::bad_request(format!("{what}: {e}")))
}

/// A query string as `T`, or a 400 with axum's reason.
pub(crate) fn query<T>(q: Result<Query<T>, QueryRejection>) -> ApiResult<T> {
    q.map(|Query(v)| v).map_err(|e| ApiErr::bad_request(e.body_text()))
}
