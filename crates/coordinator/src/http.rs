//! A small HTTP/1.1 client over TCP: hyper's connection-level client, one connection per
//! request. Enough for long polls (a connection a poll costs nothing next to the poll)
//! and for the CLI; plain `http://` only.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Largest response body accepted.
const MAX_BODY: usize = 64 << 20;

/// How long a TCP connect may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a request got no HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("bad coordinator url {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("cannot connect to {addr}: {why}")]
    Connect { addr: String, why: String },
    #[error("{addr}: {why}")]
    Transport { addr: String, why: String },
    #[error("{addr}: no answer within {after:?}")]
    Timeout { addr: String, after: Duration },
}

/// Where a coordinator listens, from `http://host:port[/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub url: String,
    pub authority: String,
    pub base: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, HttpError> {
        let bad = |why: &str| HttpError::BadUrl { url: url.to_string(), why: why.to_string() };
        let rest = url.trim().strip_prefix("http://").ok_or_else(|| {
            if url.starts_with("https://") {
                bad("https is not supported by this client; terminate TLS in front of the coordinator")
            } else {
                bad("expected http://HOST:PORT")
            }
        })?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("expected http://HOST:PORT"));
        }
        let authority = if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(Endpoint { url: url.trim().trim_end_matches('/').to_string(), authority, base: base.to_string() })
    }
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub(crate) struct Response {
    pub status: u16,
    pub body: Bytes,
}

/// Send one request. `timeout` bounds connect, send and the whole body.
pub(crate) async fn request(
    ep: &Endpoint,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
    extra: &[(&'static str, String)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let addr = ep.authority.clone();
    match tokio::time::timeout(timeout, request_inner(ep, method, path_and_query, token, extra, body)).await {
        Ok(r) => r,
        Err(_) => Err(HttpError::Timeout { addr, after: timeout }),
    }
}

async fn request_inner(
    ep: &Endpoint,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
    extra: &[(&'static str, String)],
    body: Option<Vec<u8>>,
) -> Result<Response, HttpError> {
    let addr = ep.authority.clone();
    let transport = |e: &dyn std::fmt::Display| HttpError::Transport { addr: addr.clone(), why: e.to_string() };
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&ep.authority)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(HttpError::Connect { addr, why: e.to_string() }),
        Err(_) => return Err(HttpError::Connect { addr, why: format!("no connection within {CONNECT_TIMEOUT:?}") }),
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| transport(&e))?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let uri = format!("{}{}", ep.base, path_and_query);
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(h) = req.headers_mut() {
        if let Ok(v) = HeaderValue::from_str(&ep.authority) {
            h.insert(HOST, v);
        }
        if let Some(t) = token {
            let v = HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| HttpError::BadUrl {
                url: ep.url.clone(),
                why: "the token is not a valid header value".into(),
            })?;
            h.insert(AUTHORIZATION, v);
        }
        for (k, v) in extra {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(*k, v);
            }
        }
        if body.is_some() {
            h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
    }
    let req = req.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|e| transport(&e))?;
    let result = async {
        let resp = sender.send_request(req).await.map_err(|e| transport(&e))?;
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| transport(&format!("reading the answer: {e}")))?
            .to_bytes();
        Ok(Response { status, body })
    }
    .await;
    driver.abort();
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        let e = Endpoint::parse("http://127.0.0.1:7000").unwrap();
        assert_eq!((e.authority.as_str(), e.base.as_str()), ("127.0.0.1:7000", ""));
        let e = Endpoint::parse("http://coord.example/api/").unwrap();
        assert_eq!((e.authority.as_str(), e.base.as_str()), ("coord.example:80", "/api"));
        assert!(Endpoint::parse("https://x:1").unwrap_err().to_string().contains("https"));
        assert!(Endpoint::parse("x:1").is_err());
        assert!(Endpoint::parse("http://u@x:1").is_err());
    }
}
