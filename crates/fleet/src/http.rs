//! A small HTTP/1.1 client over TCP, or TLS for `https://` (see [`crate::tls`]): hyper's
//! connection-level client with a tiny keep-alive pool. Enough for long polls, the agent
//! and the CLI.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::client::conn::http1::SendRequest;
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
    /// A request that would send the bearer token in clear text to a peer that is, or
    /// is configured as, a TLS server; nothing was sent.
    #[error("{url}: {why}; nothing was sent")]
    PlainText { url: String, why: String },
}

/// Where a coordinator listens, from `http[s]://host:port[/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub url: String,
    pub authority: String,
    pub base: String,
    /// `https://`: the connection is TLS, verified against the client's CA.
    pub tls: bool,
    /// The host part, the name the server's certificate must carry.
    pub host: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, HttpError> {
        let bad = |why: &str| HttpError::BadUrl { url: url.to_string(), why: why.to_string() };
        let trimmed = url.trim();
        let (tls, rest) = match (trimmed.strip_prefix("https://"), trimmed.strip_prefix("http://"))
        {
            (Some(rest), _) => (true, rest),
            (None, Some(rest)) => (false, rest),
            (None, None) => return Err(bad("expected http://HOST:PORT or https://HOST:PORT")),
        };
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("expected http://HOST:PORT or https://HOST:PORT"));
        }
        let (host, authority) = match authority.rsplit_once(':') {
            Some((h, p)) if p.parse::<u16>().is_ok() => (h, authority.to_string()),
            _ => (authority, format!("{authority}:{}", if tls { 443 } else { 80 })),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        Ok(Endpoint {
            url: trimmed.trim_end_matches('/').to_string(),
            authority,
            base: base.to_string(),
            tls,
            host,
        })
    }
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub(crate) struct Response {
    pub status: u16,
    pub body: Bytes,
}

/// One open HTTP/1.1 connection: the request handle and the task driving it.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Idle keep-alive connections per `host:port`, so that a watcher's next long poll (and
/// an agent's report) reuses its connection instead of opening a new one: at 10,000
/// watchers, reconnecting after every push costs the coordinator more than the push.
#[derive(Clone, Default)]
pub(crate) struct Pool {
    idle: Arc<Mutex<HashMap<String, Vec<Conn>>>>,
    /// How `https://` endpoints are verified; `None`: they are refused.
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").finish_non_exhaustive()
    }
}

/// Idle connections kept per coordinator.
const MAX_IDLE: usize = 4;

impl Pool {
    /// A pool whose `https://` connections trust `tls`.
    pub fn new(tls: Option<Arc<rustls::ClientConfig>>) -> Pool {
        Pool { idle: Arc::default(), tls }
    }

    fn take(&self, authority: &str) -> Option<Conn> {
        let mut idle = self.idle.lock().ok()?;
        let conns = idle.get_mut(authority)?;
        while let Some(c) = conns.pop() {
            if !c.sender.is_closed() {
                return Some(c);
            }
        }
        None
    }

    fn give_back(&self, authority: &str, conn: Conn) {
        if conn.sender.is_closed() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            let conns = idle.entry(authority.to_string()).or_default();
            if conns.len() < MAX_IDLE {
                conns.push(conn);
            }
        }
    }
}

/// Send one request (on an idle pooled connection when there is one). `timeout` bounds
/// connect, send and the whole body. A request that fails on a reused connection before
/// any answer (the server had closed it) is sent once more on a fresh one: every route
/// the clients use is safe to repeat.
#[allow(clippy::too_many_arguments)] // one call site per client; a struct would only rename them
pub(crate) async fn request(
    pool: &Pool,
    ep: &Endpoint,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
    extra: &[(&'static str, String)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let addr = ep.authority.clone();
    let attempt = async {
        let req = build(ep, method.clone(), path_and_query, token, extra, body.clone())?;
        if let Some(conn) = pool.take(&ep.authority) {
            match send(conn, req, &addr).await {
                Ok((resp, conn)) => {
                    pool.give_back(&ep.authority, conn);
                    return Ok(resp);
                }
                Err(Failure::Unsent(_)) => {}
                Err(Failure::Failed(e)) => return Err(e),
            }
        }
        let mut conn = connect(ep, pool.tls.as_ref()).await?;
        if !ep.tls {
            conn = probe_plain(conn, ep).await?;
        }
        let req = build(ep, method.clone(), path_and_query, token, extra, body.clone())?;
        match send(conn, req, &addr).await {
            Ok((resp, conn)) => {
                pool.give_back(&ep.authority, conn);
                Ok(resp)
            }
            // The peer answered the probe in plain HTTP and closed (`connection: close`):
            // it speaks plain HTTP, so a new connection carries the request.
            Err(Failure::Unsent(_)) if !ep.tls => {
                let conn = connect(ep, pool.tls.as_ref()).await?;
                let req = build(ep, method, path_and_query, token, extra, body)?;
                match send(conn, req, &addr).await {
                    Ok((resp, conn)) => {
                        pool.give_back(&ep.authority, conn);
                        Ok(resp)
                    }
                    Err(Failure::Unsent(e) | Failure::Failed(e)) => Err(e),
                }
            }
            Err(Failure::Unsent(e) | Failure::Failed(e)) => Err(e),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(HttpError::Timeout { addr, after: timeout }),
    }
}

enum Failure {
    /// The connection was gone before the request went out: safe to send again.
    Unsent(HttpError),
    Failed(HttpError),
}

async fn connect(
    ep: &Endpoint,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Conn, HttpError> {
    let addr = ep.authority.clone();
    let tls = match (ep.tls, tls) {
        (false, Some(_)) => return Err(plain_with_ca(&ep.url)),
        (false, None) => None,
        (true, Some(cfg)) => {
            let name = rustls_pki_types::ServerName::try_from(ep.host.clone()).map_err(|e| HttpError::BadUrl {
                url: ep.url.clone(),
                why: format!("`{}` is not a name a certificate can carry: {e}", ep.host),
            })?;
            Some((tokio_rustls::TlsConnector::from(cfg.clone()), name))
        }
        (true, None) => {
            return Err(HttpError::Connect {
                addr,
                why: "https:// needs the CA that signed the coordinator's certificate (--coordinator-ca FILE)".into(),
            })
        }
    };
    let stream =
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&ep.authority)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(HttpError::Connect { addr, why: e.to_string() }),
            Err(_) => {
                return Err(HttpError::Connect {
                    addr,
                    why: format!("no connection within {CONNECT_TIMEOUT:?}"),
                })
            }
        };
    let _ = stream.set_nodelay(true);
    let Some((connector, name)) = tls else { return handshake(TokioIo::new(stream), addr).await };
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, stream)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(HttpError::Connect { addr, why: format!("TLS: {e}") }),
        Err(_) => {
            return Err(HttpError::Connect {
                addr,
                why: format!("no TLS handshake within {CONNECT_TIMEOUT:?}"),
            })
        }
    };
    handshake(TokioIo::new(stream), addr).await
}

/// The refusal of an `http://` URL where a CA is configured.
pub(crate) fn plain_with_ca(url: &str) -> HttpError {
    HttpError::PlainText {
        url: url.to_string(),
        why:
            "an http:// URL with a coordinator CA configured would send the bearer token in clear \
              text; use https://"
                .into(),
    }
}

/// On a new plain-HTTP connection, before any credential: `GET /v1/ping` without one. A
/// peer that does not answer it with HTTP (a TLS server behind an `http://` URL answers
/// with a TLS alert or closes) fails here, so the token is never written to it.
async fn probe_plain(conn: Conn, ep: &Endpoint) -> Result<Conn, HttpError> {
    let req = build(ep, Method::GET, "/v1/ping", None, &[], None)?;
    match send(conn, req, &ep.authority).await {
        Ok((_, conn)) => Ok(conn),
        Err(Failure::Unsent(e) | Failure::Failed(e)) => Err(HttpError::PlainText {
            url: ep.url.clone(),
            why: format!(
                "the peer does not answer plain HTTP ({e}); if it serves TLS, use https:// with the \
                 CA that signed its certificate"
            ),
        }),
    }
}

/// HTTP/1.1 over an open stream (TCP or TLS); a task drives the connection.
async fn handshake<I>(io: I, addr: String) -> Result<Conn, HttpError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(io)
        .await
        .map_err(|e| HttpError::Transport { addr, why: e.to_string() })?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { sender, driver })
}

fn build(
    ep: &Endpoint,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
    extra: &[(&'static str, String)],
    body: Option<Vec<u8>>,
) -> Result<Request<Full<Bytes>>, HttpError> {
    let mut req = Request::builder().method(method).uri(format!("{}{}", ep.base, path_and_query));
    if let Some(h) = req.headers_mut() {
        if let Ok(v) = HeaderValue::from_str(&ep.authority) {
            h.insert(HOST, v);
        }
        if let Some(t) = token {
            let v =
                HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| HttpError::BadUrl {
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
    req.body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| HttpError::Transport { addr: ep.authority.clone(), why: e.to_string() })
}

async fn send(
    mut conn: Conn,
    req: Request<Full<Bytes>>,
    addr: &str,
) -> Result<(Response, Conn), Failure> {
    let err = |e: &dyn std::fmt::Display| HttpError::Transport {
        addr: addr.to_string(),
        why: e.to_string(),
    };
    if conn.sender.ready().await.is_err() {
        return Err(Failure::Unsent(err(&"connection closed")));
    }
    let resp = match conn.sender.send_request(req).await {
        Ok(r) => r,
        Err(e) if e.is_canceled() || e.is_closed() || e.is_incomplete_message() => {
            return Err(Failure::Unsent(err(&e)))
        }
        Err(e) => return Err(Failure::Failed(err(&e))),
    };
    let status = resp.status().as_u16();
    let body = Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| Failure::Failed(err(&format!("reading the answer: {e}"))))?
        .to_bytes();
    Ok((Response { status, body }, conn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        let e = Endpoint::parse("http://127.0.0.1:7000").unwrap();
        assert_eq!((e.authority.as_str(), e.base.as_str()), ("127.0.0.1:7000", ""));
        let e = Endpoint::parse("http://coord.example/api/").unwrap();
        assert_eq!((e.authority.as_str(), e.base.as_str()), ("coord.example:80", "/api"));
        let e = Endpoint::parse("https://coord.example:7443/").unwrap();
        assert_eq!(
            (e.authority.as_str(), e.host.as_str(), e.tls),
            ("coord.example:7443", "coord.example", true)
        );
        let e = Endpoint::parse("https://[::1]").unwrap();
        assert_eq!((e.authority.as_str(), e.host.as_str(), e.tls), ("[::1]:443", "::1", true));
        assert!(!Endpoint::parse("http://x:1").unwrap().tls);
        assert!(Endpoint::parse("ftp://x:1").unwrap_err().to_string().contains("https://"));
        assert!(Endpoint::parse("x:1").is_err());
        assert!(Endpoint::parse("http://u@x:1").is_err());
    }
}
