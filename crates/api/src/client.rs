//! A minimal, blocking HTTP/1.1 client over a unix socket. One request per connection
//! (`Connection: close`), bodies framed by Content-Length or chunked encoding.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::display::untrusted;
use crate::protocol::{PROTOCOL, PROTOCOL_HEADER};
use crate::types::{
    AllocateRequest, Allocation, ApiError, NodeStatus, ReleaseRequest, StartRequest, UpdateAnswer,
    UpdateDone, UpdateRequest,
};
use crate::MAX_REQUEST_BYTES;

/// Largest response body the client accepts.
const MAX_RESPONSE: usize = 16 << 20;

/// Why a call to tesserad failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach tesserad at {path}: {source}{}", connect_hint(.source))]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("i/o with tesserad at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("malformed answer from tesserad: {0}")]
    Protocol(String),
    #[error("tesserad answered {status}: {error}")]
    Api { status: u16, error: ApiError },
    /// Not sent: tesserad refuses bodies over [`MAX_REQUEST_BYTES`].
    #[error("{what} is too large: {size} bytes, and tesserad accepts at most {limit} bytes")]
    TooLarge { what: String, size: usize, limit: usize },
}

/// What a person can do about a connection that failed this way.
fn connect_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::NotFound => {
            " (is tesserad running? `systemctl status tesserad`; another socket: --socket or \
             TESSERA_SOCKET)"
        }
        std::io::ErrorKind::ConnectionRefused => {
            " (the socket is there but nothing listens: tesserad stopped; `systemctl status \
             tesserad`)"
        }
        std::io::ErrorKind::PermissionDenied => {
            " (the socket is root's alone: run this as root, e.g. with sudo)"
        }
        _ => "",
    }
}

impl ClientError {
    /// The daemon's structured error, if the daemon answered one.
    pub fn api_error(&self) -> Option<&ApiError> {
        match self {
            ClientError::Api { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// A client of one tesserad socket.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    timeout: Duration,
}

/// A raw HTTP answer.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client { socket: socket.into(), timeout: Duration::from_secs(60) }
    }

    /// Bound every read and write on the socket.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn allocate(&self, req: &AllocateRequest) -> Result<Allocation, ClientError> {
        self.call("POST", "/v1/allocations", Some(req))
    }

    pub fn start(&self, container_id: &str, req: &StartRequest) -> Result<Allocation, ClientError> {
        self.call(
            "POST",
            &format!("/v1/allocations/{}/start", encode_segment(container_id)),
            Some(req),
        )
    }

    /// Release a container's allocation, saying nothing about which container asks: the
    /// daemon releases only once runc no longer has the container in the root it recorded.
    /// Releasing an unknown id is not an error.
    pub fn release(&self, container_id: &str) -> Result<(), ClientError> {
        let path = format!("/v1/allocations/{}", encode_segment(container_id));
        let _: serde_json::Value = self.call::<(), _>("DELETE", &path, None)?;
        Ok(())
    }

    /// Release the allocation of the container `container_id` in `req`'s runc root and
    /// bundle, once runc has removed it. The daemon refuses (409) when the grant belongs
    /// to a container elsewhere, or runc still has it.
    pub fn release_container(
        &self,
        container_id: &str,
        req: &ReleaseRequest,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/allocations/{}", encode_segment(container_id));
        let _: serde_json::Value = self.call("DELETE", &path, Some(req))?;
        Ok(())
    }

    /// Ask before `runc update` of a container: tesserad admits what the update will make
    /// its CPU and memory limits (a container without a grant here: `grant: false`).
    pub fn update(
        &self,
        container_id: &str,
        req: &UpdateRequest,
    ) -> Result<UpdateAnswer, ClientError> {
        let path = format!("/v1/allocations/{}/update", encode_segment(container_id));
        self.call("POST", &path, Some(req))
    }

    /// `runc update` of a container ended: tesserad records what the kernel enforces (or
    /// asks for the limits of before to be set back).
    pub fn update_done(
        &self,
        container_id: &str,
        req: &UpdateDone,
    ) -> Result<UpdateAnswer, ClientError> {
        let path = format!("/v1/allocations/{}/update/done", encode_segment(container_id));
        self.call("POST", &path, Some(req))
    }

    pub fn allocation(&self, container_id: &str) -> Result<Allocation, ClientError> {
        self.call::<(), _>(
            "GET",
            &format!("/v1/allocations/{}", encode_segment(container_id)),
            None,
        )
    }

    pub fn status(&self) -> Result<NodeStatus, ClientError> {
        self.call::<(), _>("GET", "/v1/status", None)
    }

    /// `GET /v1/telemetry`: the node's devices and who uses what on each now.
    pub fn telemetry(&self) -> Result<crate::telemetry::NodeTelemetry, ClientError> {
        self.call::<(), _>("GET", "/v1/telemetry", None)
    }

    /// Send one request and decode a JSON answer; non-2xx answers become `ClientError::Api`.
    pub fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let body = match body {
            Some(b) => Some(
                serde_json::to_vec(b).map_err(|e| ClientError::Protocol(format!("encode: {e}")))?,
            ),
            None => None,
        };
        let resp = self.raw(method, path, body.as_deref())?;
        if !(200..300).contains(&resp.status) {
            let error = serde_json::from_slice::<ApiError>(&resp.body).map_err(|_| {
                ClientError::Protocol(format!(
                    "status {} with a body that is not an error object: {}",
                    resp.status,
                    untrusted(&String::from_utf8_lossy(&resp.body))
                ))
            })?;
            return Err(ClientError::Api { status: resp.status, error });
        }
        serde_json::from_slice(&resp.body)
            .map_err(|e| ClientError::Protocol(format!("decode {method} {path}: {e}")))
    }

    /// Send one request with an optional JSON body and return the raw answer.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<RawResponse, ClientError> {
        let body = body.unwrap_or(&[]);
        if body.len() > MAX_REQUEST_BYTES {
            // tesserad would stop reading and close: the write would fail with "broken
            // pipe", which names nothing. Say what is too large instead, and send nothing.
            return Err(ClientError::TooLarge {
                what: format!("the request body of {method} {}", untrusted(path)),
                size: body.len(),
                limit: MAX_REQUEST_BYTES,
            });
        }
        let mut stream = UnixStream::connect(&self.socket)
            .map_err(|source| ClientError::Connect { path: self.socket.clone(), source })?;
        let io = |source| ClientError::Io { path: self.socket.clone(), source };
        stream.set_read_timeout(Some(self.timeout)).map_err(io)?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut msg = format!(
            "{method} {path} HTTP/1.1\r\nhost: tesserad\r\nconnection: close\r\n{PROTOCOL_HEADER}: {PROTOCOL}\r\ncontent-length: {}\r\n",
            body.len()
        );
        if !body.is_empty() {
            msg.push_str("content-type: application/json\r\n");
        }
        msg.push_str("\r\n");
        let mut out = msg.into_bytes();
        out.extend_from_slice(body);
        if let Err(e) = stream.write_all(&out) {
            // The daemon may have answered (and closed) before reading everything, e.g. a
            // refusal: its answer says more than the broken pipe does.
            let mut buf = Vec::new();
            let _ = Read::by_ref(&mut stream).take(MAX_RESPONSE as u64).read_to_end(&mut buf);
            return parse_response(&buf).map_err(|_| io(e));
        }
        let mut buf = Vec::with_capacity(4096);
        Read::by_ref(&mut stream)
            .take(MAX_RESPONSE as u64 + 1)
            .read_to_end(&mut buf)
            .map_err(io)?;
        if buf.len() > MAX_RESPONSE {
            return Err(ClientError::Protocol("answer larger than 16 MiB".into()));
        }
        parse_response(&buf)
    }
}

/// Percent-encode a path segment (container ids are `[A-Za-z0-9_.-]` in practice, but the
/// client never trusts that).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn parse_response(buf: &[u8]) -> Result<RawResponse, ClientError> {
    let proto = |m: &str| ClientError::Protocol(m.to_string());
    let head_end =
        buf.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| proto("no end of headers"))?;
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| proto("headers are not utf-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| proto("no status line"))?;
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(proto(&format!("not an HTTP/1 status line: {}", untrusted(status_line))));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| proto(&format!("bad status line: {}", untrusted(status_line))))?;
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((k, v)) = line.split_once(':') else { continue };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-length" {
            content_length = Some(v.parse::<usize>().map_err(|_| proto("bad content-length"))?);
        } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let rest = &buf[head_end + 4..];
    let body = if chunked {
        decode_chunked(rest)?
    } else if let Some(n) = content_length {
        if rest.len() < n {
            return Err(proto(&format!("body cut short: {} of {n} bytes", rest.len())));
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(RawResponse { status, body })
}

fn decode_chunked(mut rest: &[u8]) -> Result<Vec<u8>, ClientError> {
    let proto = |m: &str| ClientError::Protocol(m.to_string());
    let mut out = Vec::new();
    loop {
        let eol =
            rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| proto("bad chunk header"))?;
        let size_str = std::str::from_utf8(&rest[..eol]).map_err(|_| proto("bad chunk size"))?;
        let size_str = size_str.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_str, 16).map_err(|_| proto("bad chunk size"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size + 2 {
            return Err(proto("chunk cut short"));
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ErrorCode;
    use std::os::unix::net::UnixListener;

    fn serve_once(
        answer: &'static [u8],
    ) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<Vec<u8>>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let h = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut req = vec![0u8; 65536];
            let n = s.read(&mut req).expect("read");
            req.truncate(n);
            s.write_all(answer).expect("write");
            req
        });
        (dir, path, h)
    }

    #[test]
    fn a_connection_that_fails_says_what_to_check() {
        let dir = tempfile::tempdir().expect("tempdir");
        let absent = dir.path().join("none.sock");
        let e = Client::new(&absent).status().expect_err("no socket").to_string();
        assert!(e.contains("cannot reach tesserad") && e.contains("is tesserad running?"), "{e}");
        // A socket file nobody listens on: refused.
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).expect("bind"));
        let e = Client::new(&stale).status().expect_err("refused").to_string();
        assert!(e.contains("nothing listens"), "{e}");
    }

    #[test]
    fn decodes_content_length_and_sends_request() {
        let (_d, path, h) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
        let v: serde_json::Value = Client::new(&path)
            .call("POST", "/x", Some(&serde_json::json!({"a": 1})))
            .expect("call");
        assert_eq!(v, serde_json::json!({}));
        let req = String::from_utf8(h.join().expect("join")).expect("utf8");
        assert!(req.starts_with("POST /x HTTP/1.1\r\n"), "{req}");
        assert!(req.contains(&format!("\r\ntessera-protocol: {PROTOCOL}\r\n")), "{req}");
        assert!(req.ends_with("{\"a\":1}"), "{req}");
    }

    #[test]
    fn decodes_chunked_bodies() {
        let (_d, path, _h) = serve_once(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n",
        );
        let v: serde_json::Value =
            Client::new(&path).call::<(), _>("GET", "/", None).expect("call");
        assert_eq!(v, serde_json::json!({"a": 1}));
    }

    #[test]
    fn surfaces_structured_api_errors() {
        let (_d, path, _h) = serve_once(
            b"HTTP/1.1 403 Forbidden\r\ncontent-length: 58\r\n\r\n{\"code\":\"refused\",\"message\":\"no\",\"rule\":\"tiers.untrusted\"}",
        );
        let err = Client::new(&path).call::<(), serde_json::Value>("GET", "/", None).unwrap_err();
        let api = err.api_error().expect("api error");
        assert_eq!(api.code, ErrorCode::Refused);
        assert_eq!(api.rule.as_deref(), Some("tiers.untrusted"));
    }

    #[test]
    fn reports_garbage_and_missing_daemon_clearly() {
        let (_d, path, _h) = serve_once(b"SSH-2.0-OpenSSH\r\n\r\n");
        let err = Client::new(&path).status().unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err}");
        let err = Client::new("/nonexistent/tessera.sock").status().unwrap_err();
        assert!(
            err.to_string().contains("cannot reach tesserad at /nonexistent/tessera.sock"),
            "{err}"
        );
    }

    #[test]
    fn an_oversized_body_is_refused_before_sending_and_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let big = vec![b'x'; MAX_REQUEST_BYTES + 1];
        let err = Client::new(&path).raw("POST", "/v1/allocations", Some(&big)).unwrap_err();
        assert!(
            matches!(err, ClientError::TooLarge { size, limit, .. } if size == big.len() && limit == MAX_REQUEST_BYTES),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("POST /v1/allocations")
                && msg.contains("too large")
                && msg.contains("1048576"),
            "{msg}"
        );
        assert!(listener.accept().is_err(), "nothing may be sent");
    }

    #[test]
    fn release_says_which_container_gives_its_grant_back() {
        let (_d, path, h) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
        let req = ReleaseRequest { runc_root: Some("/run/runc".into()), bundle: Some("/b".into()) };
        Client::new(&path).release_container("abc", &req).expect("release");
        let sent = String::from_utf8(h.join().expect("join")).expect("utf8");
        assert!(sent.starts_with("DELETE /v1/allocations/abc HTTP/1.1\r\n"), "{sent}");
        assert!(sent.ends_with(r#"{"runc_root":"/run/runc","bundle":"/b"}"#), "{sent}");
    }

    #[test]
    fn encodes_path_segments() {
        assert_eq!(encode_segment("abc-1_2.3"), "abc-1_2.3");
        assert_eq!(encode_segment("../x y"), "..%2Fx%20y");
    }
}
