//! Test-only: a stand-in for tesserad's socket, answering canned HTTP.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// Read one HTTP request (headers and a Content-Length body) from `s`, write `answer`,
/// and return the request as text.
pub(crate) fn answer_one(s: &mut UnixStream, answer: &str) -> String {
    let mut req = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = s.read(&mut buf).expect("read");
        req.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&req);
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if req.len() >= end + 4 + len {
                break;
            }
        }
        if n == 0 {
            break;
        }
    }
    s.write_all(answer.as_bytes()).expect("write");
    String::from_utf8(req).expect("utf8")
}
