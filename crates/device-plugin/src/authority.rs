//! Kubelets before 1.26 dial a plugin's socket by its bare path, and their grpc-go then
//! sends that path as the HTTP/2 `:authority` (`/var/lib/kubelet/device-plugins/
//! tessera-gpu.sock`; kubernetes#112597 set `localhost` from 1.26 on). h2, under tonic,
//! refuses a request whose `:authority` is not a URI authority: it resets the stream
//! (`PROTOCOL_ERROR`), so every `ListAndWatch` of such a kubelet failed and every
//! `tessera.io/*` resource showed 0 (hyperium/h2#487 is still open).
//!
//! [`Rewriter`] reads the client's side of an HTTP/2 connection and writes it out again
//! with every header block decoded (HPACK, RFC 7541: its own copy of the client's dynamic
//! table) and re-encoded as literals without indexing, an `:authority` that is no URI
//! authority replaced by `localhost`; every other frame passes byte for byte. The server
//! then never sees the client's indexing, so re-encoding is exact. [`FixAuthority`] wraps
//! each accepted connection with it, on the reading side only. The same rewriter, given
//! another rule, makes the tests' kubelet stand-in send what a kubelet of 1.20 sends.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::hpack_table::{CODES, CODE_LENGTHS};

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest header block (all its frames) read before the connection is refused.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The largest frame payload passed on (the SETTINGS_MAX_FRAME_SIZE maximum).
const MAX_FRAME: usize = (1 << 24) - 1;
/// The frame size re-encoded header blocks are cut into (the initial
/// SETTINGS_MAX_FRAME_SIZE, which every server accepts).
const OUT_FRAME: usize = 16_384;
/// The largest dynamic table a client may ask for here (h2 advertises 4096).
const MAX_TABLE: usize = 65_536;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// What to do with a header: `Some(value)` replaces the value.
pub type Rule = fn(name: &[u8], value: &[u8]) -> Option<Vec<u8>>;

/// The server's rule: an `:authority` that is not a URI authority (a socket path) becomes
/// `localhost`.
pub fn fix_authority(name: &[u8], value: &[u8]) -> Option<Vec<u8>> {
    (name == b":authority" && !is_authority(value)).then(|| b"localhost".to_vec())
}

/// RFC 3986's authority characters (what `http::uri::Authority` accepts, near enough):
/// unreserved, sub-delims, `:`, `@`, `[`, `]`, `%`.
pub fn is_authority(v: &[u8]) -> bool {
    !v.is_empty()
        && v.iter().all(|c| c.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@[]%".contains(c))
}

/// Why a stream could not be rewritten (the connection is then closed).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RewriteError {
    #[error("malformed HTTP/2 frame: {0}")]
    Frame(&'static str),
    #[error("malformed HPACK header block: {0}")]
    Hpack(&'static str),
    #[error("a header block larger than {MAX_HEADER_BLOCK} bytes")]
    TooLarge,
}

impl From<RewriteError> for std::io::Error {
    fn from(e: RewriteError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// A header block waiting for its CONTINUATION frames.
#[derive(Debug)]
struct Pending {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// The client-to-server byte stream of one HTTP/2 connection, rewritten (see the module
/// documentation). Feed it what the client sent; take what the server should read.
#[derive(Debug)]
pub struct Rewriter {
    rule: Rule,
    input: Vec<u8>,
    output: Vec<u8>,
    preface_done: bool,
    /// Not HTTP/2 with a preface: everything passes untouched.
    passthrough: bool,
    pending: Option<Pending>,
    table: Table,
}

impl Rewriter {
    pub fn new(rule: Rule) -> Rewriter {
        Rewriter {
            rule,
            input: Vec::new(),
            output: Vec::new(),
            preface_done: false,
            passthrough: false,
            pending: None,
            table: Table::new(4096),
        }
    }

    /// Takes in bytes the client sent.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), RewriteError> {
        if self.passthrough {
            self.output.extend_from_slice(bytes);
            return Ok(());
        }
        self.input.extend_from_slice(bytes);
        self.process()
    }

    /// The client ended its side: whatever is left (a frame cut short) passes as it is.
    pub fn finish(&mut self) {
        self.output.append(&mut self.input);
    }

    /// The rewritten bytes ready for the server.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.output
    }

    fn process(&mut self) -> Result<(), RewriteError> {
        if !self.preface_done {
            let n = self.input.len().min(PREFACE.len());
            if self.input[..n] != PREFACE[..n] {
                self.passthrough = true;
                self.output.append(&mut self.input);
                return Ok(());
            }
            if n < PREFACE.len() {
                return Ok(());
            }
            self.output.extend(self.input.drain(..PREFACE.len()));
            self.preface_done = true;
        }
        let mut at = 0;
        while self.input.len() - at >= 9 {
            let h = &self.input[at..at + 9];
            let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
            if len > MAX_FRAME {
                return Err(RewriteError::Frame("a frame larger than the protocol allows"));
            }
            if self.input.len() - at < 9 + len {
                break;
            }
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let frame = at..at + 9 + len;
            at += 9 + len;
            match kind {
                HEADERS => {
                    let payload = self.input[frame.start + 9..frame.end].to_vec();
                    self.headers(stream, flags, &payload)?;
                }
                CONTINUATION if self.pending.is_some() => {
                    let payload = self.input[frame.start + 9..frame.end].to_vec();
                    self.continuation(stream, flags, &payload)?;
                }
                _ if self.pending.is_some() => {
                    return Err(RewriteError::Frame("a frame inside a header block"));
                }
                _ => {
                    let bytes = self.input[frame].to_vec();
                    self.output.extend_from_slice(&bytes);
                }
            }
        }
        self.input.drain(..at);
        Ok(())
    }

    fn headers(&mut self, stream: u32, flags: u8, payload: &[u8]) -> Result<(), RewriteError> {
        if self.pending.is_some() {
            return Err(RewriteError::Frame("HEADERS inside a header block"));
        }
        let mut p = payload;
        let pad = if flags & PADDED != 0 {
            let (&n, rest) = p.split_first().ok_or(RewriteError::Frame("no pad length"))?;
            p = rest;
            usize::from(n)
        } else {
            0
        };
        let priority = if flags & PRIORITY != 0 {
            let b: [u8; 5] = p
                .get(..5)
                .and_then(|b| b.try_into().ok())
                .ok_or(RewriteError::Frame("no priority"))?;
            p = &p[5..];
            Some(b)
        } else {
            None
        };
        let block = p.get(..p.len().checked_sub(pad).ok_or(RewriteError::Frame("padding"))?);
        let block = block.ok_or(RewriteError::Frame("padding"))?.to_vec();
        let pending = Pending { stream, flags, priority, block };
        if flags & END_HEADERS != 0 {
            self.emit(pending)
        } else {
            self.pending = Some(pending);
            Ok(())
        }
    }

    fn continuation(&mut self, stream: u32, flags: u8, payload: &[u8]) -> Result<(), RewriteError> {
        let mut pending = self.pending.take().ok_or(RewriteError::Frame("CONTINUATION"))?;
        if pending.stream != stream {
            return Err(RewriteError::Frame("CONTINUATION of another stream"));
        }
        if pending.block.len() + payload.len() > MAX_HEADER_BLOCK {
            return Err(RewriteError::TooLarge);
        }
        pending.block.extend_from_slice(payload);
        if flags & END_HEADERS != 0 {
            self.emit(pending)
        } else {
            self.pending = Some(pending);
            Ok(())
        }
    }

    /// Decodes a whole header block, applies the rule, writes it as HEADERS (and
    /// CONTINUATION) frames of literals without indexing.
    fn emit(&mut self, p: Pending) -> Result<(), RewriteError> {
        let headers = self.table.decode(&p.block)?;
        let mut block = Vec::new();
        for (name, value) in &headers {
            let value = (self.rule)(name, value).unwrap_or_else(|| value.clone());
            block.push(0x00); // literal without indexing, new name
            encode_string(&mut block, name);
            encode_string(&mut block, &value);
        }
        let mut first = true;
        let mut rest: &[u8] = &block;
        loop {
            let room = OUT_FRAME - if first && p.priority.is_some() { 5 } else { 0 };
            let (chunk, tail) = rest.split_at(rest.len().min(room));
            let last = tail.is_empty();
            let (kind, mut flags) = match first {
                true => (HEADERS, p.flags & (END_STREAM | PRIORITY)),
                false => (CONTINUATION, 0),
            };
            if last {
                flags |= END_HEADERS;
            }
            let prio = if first { p.priority } else { None };
            let len = chunk.len() + prio.map_or(0, |_| 5);
            self.output.extend_from_slice(&[
                (len >> 16) as u8,
                (len >> 8) as u8,
                len as u8,
                kind,
                flags,
            ]);
            self.output.extend_from_slice(&p.stream.to_be_bytes());
            if let Some(b) = prio {
                self.output.extend_from_slice(&b);
            }
            self.output.extend_from_slice(chunk);
            if last {
                return Ok(());
            }
            first = false;
            rest = tail;
        }
    }
}

/// A string literal, not Huffman-coded (7-bit prefix length).
fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_int(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix, `first` holding the bits above it.
pub fn encode_int(out: &mut Vec<u8>, mut v: usize, n: u8, first: u8) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

fn decode_int(b: &[u8], n: u8) -> Result<(usize, usize), RewriteError> {
    let max = (1usize << n) - 1;
    let first = *b.first().ok_or(RewriteError::Hpack("an integer cut short"))?;
    let mut v = usize::from(first) & max;
    if v < max {
        return Ok((v, 1));
    }
    let mut shift = 0;
    for (i, byte) in b.iter().enumerate().skip(1) {
        if shift > 28 {
            return Err(RewriteError::Hpack("an integer too large"));
        }
        v += (usize::from(*byte) & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            return Ok((v, i + 1));
        }
    }
    Err(RewriteError::Hpack("an integer cut short"))
}

fn decode_string(b: &[u8]) -> Result<(Vec<u8>, usize), RewriteError> {
    let huffman = b.first().is_some_and(|f| f & 0x80 != 0);
    let (len, used) = decode_int(b, 7)?;
    let raw = b.get(used..used + len).ok_or(RewriteError::Hpack("a string cut short"))?;
    let s = if huffman { huffman_decode(raw)? } else { raw.to_vec() };
    Ok((s, used + len))
}

/// (code length, code) -> byte.
fn huffman_codes() -> &'static HashMap<(u8, u32), u8> {
    static CODES_BY_LEN: OnceLock<HashMap<(u8, u32), u8>> = OnceLock::new();
    CODES_BY_LEN
        .get_or_init(|| (0..256usize).map(|i| ((CODE_LENGTHS[i], CODES[i]), i as u8)).collect())
}

/// RFC 7541 §5.2: the code bit by bit; at the end, at most 7 bits, all ones (the start of
/// the end-of-string code) may be left over.
pub fn huffman_decode(raw: &[u8]) -> Result<Vec<u8>, RewriteError> {
    let codes = huffman_codes();
    let mut out = Vec::with_capacity(raw.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0u8);
    for byte in raw {
        for bit in (0..8).rev() {
            code = code << 1 | u32::from(byte >> bit & 1);
            len += 1;
            if len >= 5 {
                if let Some(&sym) = codes.get(&(len, code)) {
                    out.push(sym);
                    (code, len) = (0, 0);
                    continue;
                }
            }
            if len >= 30 {
                return Err(RewriteError::Hpack("a Huffman code that is none (or end-of-string)"));
            }
        }
    }
    if len > 7 || code != (1u32 << len) - 1 {
        return Err(RewriteError::Hpack("Huffman padding that is not the end-of-string prefix"));
    }
    Ok(out)
}

/// One header field: name and value, as bytes.
type Header = (Vec<u8>, Vec<u8>);

/// The HPACK decoder's dynamic table (RFC 7541 §2.3.2, §4).
#[derive(Debug)]
struct Table {
    entries: VecDeque<Header>,
    size: usize,
    max: usize,
}

impl Table {
    fn new(max: usize) -> Table {
        Table { entries: VecDeque::new(), size: 0, max }
    }

    fn get(&self, index: usize) -> Result<Header, RewriteError> {
        match index {
            0 => Err(RewriteError::Hpack("index 0")),
            i if i <= STATIC.len() => {
                let (n, v) = STATIC[i - 1];
                Ok((n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            }
            i => self
                .entries
                .get(i - STATIC.len() - 1)
                .cloned()
                .ok_or(RewriteError::Hpack("an index past the tables")),
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + 32;
        self.entries.push_front((name, value));
        self.size += size;
        self.evict();
    }

    fn evict(&mut self) {
        while self.size > self.max {
            match self.entries.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + 32,
                None => break,
            }
        }
    }

    fn decode(&mut self, mut b: &[u8]) -> Result<Vec<Header>, RewriteError> {
        let mut out = Vec::new();
        while let Some(&first) = b.first() {
            if first & 0x80 != 0 {
                let (i, used) = decode_int(b, 7)?;
                out.push(self.get(i)?);
                b = &b[used..];
            } else if first & 0xe0 == 0x20 {
                let (size, used) = decode_int(b, 5)?;
                if size > MAX_TABLE {
                    return Err(RewriteError::Hpack("a dynamic table larger than allowed"));
                }
                self.max = size;
                self.evict();
                b = &b[used..];
            } else {
                // Literal: with incremental indexing (01), without (0000) or never (0001).
                let indexed = first & 0xc0 == 0x40;
                let (index, mut used) = decode_int(b, if indexed { 6 } else { 4 })?;
                let name = if index == 0 {
                    let (n, u) = decode_string(&b[used..])?;
                    used += u;
                    n
                } else {
                    self.get(index)?.0
                };
                let (value, u) = decode_string(&b[used..])?;
                used += u;
                if indexed {
                    self.insert(name.clone(), value.clone());
                }
                out.push((name, value));
                b = &b[used..];
            }
        }
        Ok(out)
    }
}

/// The static table (RFC 7541, Appendix A).
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// An accepted connection whose client side is read through a [`Rewriter`] (see the
/// module documentation); writes go straight to the client.
#[derive(Debug)]
pub struct FixAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    /// How much of the rewriter's output has been handed to the reader.
    sent: usize,
    eof: bool,
}

impl<S> FixAuthority<S> {
    pub fn new(inner: S) -> FixAuthority<S> {
        FixAuthority { inner, rewriter: Rewriter::new(fix_authority), sent: 0, eof: false }
    }
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FixAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            let out = this.rewriter.output();
            if this.sent < out.len() {
                let n = (out.len() - this.sent).min(buf.remaining());
                buf.put_slice(&out[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == out.len() {
                    out.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    this.eof = true;
                    this.rewriter.finish();
                }
                Poll::Ready(Ok(())) => this.rewriter.feed(rb.filled())?,
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FixAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for FixAuthority<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Huffman-codes `s` (the encoder's side, for the tests).
    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
        for &c in s {
            acc = acc << CODE_LENGTHS[usize::from(c)] | u64::from(CODES[usize::from(c)]);
            bits += u32::from(CODE_LENGTHS[usize::from(c)]);
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
        }
        out
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// What a server's decoder (a fresh table) reads from the rewritten stream.
    fn server_reads(bytes: &[u8]) -> Vec<(u32, Vec<(String, String)>)> {
        assert_eq!(&bytes[..24], PREFACE);
        let (mut at, mut table, mut out, mut block, mut stream) =
            (24, Table::new(4096), Vec::new(), Vec::new(), 0);
        while at < bytes.len() {
            let len = usize::from(bytes[at]) << 16
                | usize::from(bytes[at + 1]) << 8
                | usize::from(bytes[at + 2]);
            let (kind, flags) = (bytes[at + 3], bytes[at + 4]);
            let mut p = &bytes[at + 9..at + 9 + len];
            if kind == HEADERS || kind == CONTINUATION {
                if kind == HEADERS {
                    stream = u32::from_be_bytes(bytes[at + 5..at + 9].try_into().unwrap());
                    if flags & PRIORITY != 0 {
                        p = &p[5..];
                    }
                    assert_eq!(flags & PADDED, 0);
                }
                block.extend_from_slice(p);
                if flags & END_HEADERS != 0 {
                    let h = table.decode(&block).expect("the server decodes it");
                    assert!(table.entries.is_empty(), "nothing indexed");
                    let h = h
                        .into_iter()
                        .map(|(n, v)| {
                            (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect();
                    out.push((stream, h));
                    block.clear();
                }
            }
            at += 9 + len;
        }
        out
    }

    #[test]
    fn huffman_round_trips_and_rejects_bad_padding() {
        for s in [
            "",
            "localhost",
            "/var/lib/kubelet/device-plugins/tessera-gpu.sock",
            "grpc-go/1.27.1",
            "\u{0}\u{ff}x",
        ] {
            assert_eq!(huffman_decode(&huffman_encode(s.as_bytes())).expect(s), s.as_bytes());
        }
        // RFC 7541 C.4.1: "www.example.com".
        let c41 = [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        assert_eq!(huffman_decode(&c41).expect("rfc"), b"www.example.com");
        assert!(huffman_decode(&[0x00]).is_err(), "zero padding");
        assert!(huffman_decode(&[0xff, 0xff, 0xff, 0xff]).is_err(), "end-of-string");
    }

    /// A kubelet 1.20 request as grpc-go writes it: `:authority` the socket path
    /// (Huffman, indexed), a second request on the same connection indexing it; the
    /// server reads `localhost` both times and everything else as sent.
    #[test]
    fn a_socket_path_authority_reads_as_localhost_and_the_rest_unchanged() {
        let path = "/var/lib/kubelet/device-plugins/tessera-gpu.sock";
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static)
        block.push(0x41); // :authority, incremental indexing, name index 1
        let h = huffman_encode(path.as_bytes());
        encode_int(&mut block, h.len(), 7, 0x80);
        block.extend_from_slice(&h);
        block.push(0x44); // :path, incremental indexing
        let p = b"/v1beta1.DevicePlugin/ListAndWatch";
        encode_int(&mut block, p.len(), 7, 0);
        block.extend_from_slice(p);
        block.push(0x40); // new name, incremental indexing
        encode_int(&mut block, 2, 7, 0);
        block.extend_from_slice(b"te");
        encode_int(&mut block, 8, 7, 0);
        block.extend_from_slice(b"trailers");
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
                                             // Cut in two: HEADERS without END_HEADERS, then a CONTINUATION.
        let (a, b) = block.split_at(5);
        input.extend(frame(HEADERS, 0, 1, a));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0")); // DATA
                                                                // The second request: :method, :scheme, then the dynamic table's entries
                                                                // (62 = te, 63 = :path, 64 = :authority).
        input.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM | PADDED,
            3,
            &[2, 0x83, 0x86, 0xc0, 0xbf, 0xbe, 0, 0],
        ));
        let mut r = Rewriter::new(fix_authority);
        // Byte by byte: every frame boundary falls everywhere once.
        for byte in &input {
            r.feed(std::slice::from_ref(byte)).expect("rewrites");
        }
        let got = server_reads(r.output());
        let want = |s: u32| {
            (
                s,
                vec![
                    (":method".into(), "POST".into()),
                    (":scheme".into(), "http".into()),
                    (":authority".into(), "localhost".into()),
                    (":path".into(), "/v1beta1.DevicePlugin/ListAndWatch".into()),
                    ("te".into(), "trailers".into()),
                ],
            )
        };
        assert_eq!(got[0], want(1));
        assert_eq!(got[1], want(3));
        // Frames other than headers pass byte for byte.
        let out = r.output().clone();
        assert!(out.windows(14).any(|w| w == &frame(0x0, END_STREAM, 1, b"\0\0\0\0\0")[..]));
        // A valid authority is kept; a client that is not HTTP/2 passes untouched.
        assert_eq!(fix_authority(b":authority", b"localhost"), None);
        assert_eq!(fix_authority(b":authority", b"[::1]:50051"), None);
        let mut r = Rewriter::new(fix_authority);
        r.feed(b"GET / HTTP/1.1\r\n\r\n").expect("passes");
        assert_eq!(r.output().as_slice(), b"GET / HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn malformed_blocks_are_errors_not_guesses() {
        let mut r = Rewriter::new(fix_authority);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]));
        assert!(r.feed(&input).is_err(), "an index past the tables");
        let mut r = Rewriter::new(fix_authority);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &[0x82]));
        input.extend(frame(0x0, 0, 1, b"x"));
        assert!(r.feed(&input).is_err(), "DATA inside a header block");
    }
}
