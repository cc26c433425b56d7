//! Issue 12, "one typed contract": a wrapper and hook of the previous minor protocol
//! version (1.0: no `tessera-protocol` header) still get their grant, start and release
//! from tesserad, with the exact bodies they send (`crates/api/testdata/protocol-1.0/`);
//! other versions are refused, naming both; requests refuse unknown fields by name.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use tessera_api::{Allocation, AllocationState, ApiError, ErrorCode, PROTOCOL};
use tessera_harness::node::*;

const ID: &str = "compat-1-0";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(repo("crates/api/testdata/protocol-1.0").join(name)).expect("fixture")
}

/// One raw HTTP/1.1 exchange, as a client of protocol 1.0 (no version header) or with
/// `version` as its `tessera-protocol` header: (status, headers, body).
fn send(
    socket: &Path,
    method: &str,
    path: &str,
    version: Option<&str>,
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    let mut s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: tesserad\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("content-type: application/json\r\n");
    }
    if let Some(v) = version {
        head.push_str(&format!("tessera-protocol: {v}\r\n"));
    }
    head.push_str("\r\n");
    // Head and body in one write; and a server that answers from the head alone (a
    // version it refuses) may close before reading the body: its answer is still there to
    // read, so a broken pipe on the write is not a failure.
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    match s.write_all(&request) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.expect("write request"),
    }
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    let end = out.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
    let head = String::from_utf8(out[..end].to_vec()).expect("utf8 head");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    (status, head.to_ascii_lowercase(), out[end + 4..].to_vec())
}

fn node() -> Node {
    Node::start_with(NodeOptions { pending_grace_ms: 600_000, ..Default::default() })
}

#[test]
fn a_previous_minor_wrapper_and_hook_get_their_grant_start_and_release() {
    let node = node();
    let answered = format!("tessera-protocol: {PROTOCOL}");

    // The fixtures' bundle, replaced by a stand-in container's (its init, in namespaces and
    // a cgroup of its own, is what the prestart confirmation checks).
    let init = node.fx.fake_container(ID);
    let bundle = "/run/containerd/io.containerd.runtime.v2.task/k8s.io/compat-1-0";
    let fake_bundle = init.bundle_str();
    let ours = |name: &str| {
        let text = String::from_utf8(fixture(name)).expect("utf8");
        assert!(text.contains(bundle), "{text}");
        text.replace(bundle, &fake_bundle)
    };
    let (status, head, body) =
        send(&node.socket, "POST", "/v1/allocations", None, ours("allocate.json").as_bytes());
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "1.0 allocate: {text}");
    assert!(head.contains(&answered), "{head}");
    let grant: Allocation = serde_json::from_slice(&body).expect("allocation");
    assert_eq!((grant.container_id.as_str(), grant.request.to_string().as_str()), (ID, "gpu=1"));
    assert_eq!(grant.tenant, "acme/trusted/training/alice");
    assert_eq!(grant.devices.len(), 1);
    assert!(grant.injection.env.iter().any(|e| e.starts_with("CUDA_VISIBLE_DEVICES=")));

    // The hook's prestart body, its pid placeholder replaced by the stand-in's.
    let start = ours("start.json");
    assert!(start.contains("\"pid\":1,"), "{start}");
    let start = start.replace("\"pid\":1,", &format!("\"pid\":{},", init.pid));
    let (status, _, body) =
        send(&node.socket, "POST", &format!("/v1/allocations/{ID}/start"), None, start.as_bytes());
    assert_eq!(status, 200, "1.0 start: {}", String::from_utf8_lossy(&body));
    let started: Allocation = serde_json::from_slice(&body).expect("allocation");
    assert_eq!(started.state, AllocationState::Running);

    drop(init); // the container is gone
    let (status, _, body) = send(
        &node.socket,
        "DELETE",
        &format!("/v1/allocations/{ID}"),
        None,
        ours("release.json").as_bytes(),
    );
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "1.0 release: {text}");
    assert!(text.contains("\"released\":true"), "{text}");
    assert!(node.client().status().expect("status").allocations.is_empty());
}

#[test]
fn other_versions_are_refused_naming_both_and_unknown_request_fields_by_name() {
    let node = node();
    let refused = |version: &str| {
        let (status, head, body) =
            send(&node.socket, "POST", "/v1/allocations", Some(version), &fixture("allocate.json"));
        let e: ApiError = serde_json::from_slice(&body).expect("error object");
        assert_eq!((status, e.code), (400, ErrorCode::BadRequest), "{version}: {}", e.message);
        assert!(head.contains(&format!("tessera-protocol: {PROTOCOL}")), "{head}");
        e.message
    };
    let future_major = format!("{}.0", PROTOCOL.major + 1);
    let newer_minor = format!("{}.{}", PROTOCOL.major, PROTOCOL.minor + 1);
    for v in [future_major.as_str(), newer_minor.as_str(), "0.9"] {
        let msg = refused(v);
        assert!(msg.contains(v) && msg.contains(&PROTOCOL.to_string()), "{v}: {msg}");
    }
    assert!(refused("one.two").contains("malformed tessera-protocol header"));
    assert!(node.client().status().expect("status").allocations.is_empty(), "nothing granted");

    // The current version, sent explicitly, is served (the client sends it on every call).
    let (status, _, body) = send(
        &node.socket,
        "POST",
        "/v1/allocations",
        Some(&PROTOCOL.to_string()),
        &fixture("allocate.json"),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    // Requests stay strict whatever the version: an unknown field is a 400 naming it.
    let v = PROTOCOL.to_string();
    for (method, path, body, field) in [
        (
            "POST",
            format!("/v1/allocations/{ID}/start"),
            r#"{"pid":1,"bundle":"/b","privileged":true}"#,
            "privileged",
        ),
        ("DELETE", format!("/v1/allocations/{ID}"), r#"{"bundle":"/b","force":true}"#, "force"),
    ] {
        for version in [None, Some(v.as_str())] {
            let (status, _, answer) = send(&node.socket, method, &path, version, body.as_bytes());
            let e: ApiError = serde_json::from_slice(&answer).expect("error object");
            assert_eq!(status, 400, "{method} {path}: {}", e.message);
            assert!(e.message.contains(&format!("unknown field `{field}`")), "{}", e.message);
        }
    }
    assert_eq!(node.client().status().expect("status").allocations.len(), 1);
}

/// The request and the container id are typed when the body is read: a malformed one is a
/// 400 naming the field, with the value escaped, and nothing is granted.
#[test]
fn a_malformed_request_or_container_id_is_refused_naming_the_field() {
    let node = node();
    let good = String::from_utf8(fixture("allocate.json")).expect("utf8");
    let cases = [
        (good.replace(r#""request":"gpu=1""#, r#""request":"gpu=banana\u001b[2J""#), "request"),
        (good.replace(r#""request":"gpu=1""#, r#""request":"tpu=1""#), "request"),
        (
            good.replace(r#""container_id":"compat-1-0""#, r#""container_id":"../x""#),
            "container_id",
        ),
        (
            good.replace(r#""container_id":"compat-1-0""#, r#""container_id":"a\nb""#),
            "container_id",
        ),
    ];
    for (body, field) in cases {
        assert_ne!(body, good, "the fixture changed: {body}");
        let (status, _, answer) =
            send(&node.socket, "POST", "/v1/allocations", None, body.as_bytes());
        let e: ApiError = serde_json::from_slice(&answer).expect("error object");
        assert_eq!((status, e.code), (400, ErrorCode::BadRequest), "{body}: {}", e.message);
        assert!(e.message.contains(&format!("{field}: ")), "{field}: {}", e.message);
        assert!(!e.message.contains(['\n', '\u{1b}']), "{:?}", e.message);
    }
    assert!(node.client().status().expect("status").allocations.is_empty(), "nothing granted");
}

/// Issue 24: the ids of URL paths are parsed once, at the edge (`tesserad::server`), and
/// the node checks them no more. An id that breaks runc's rule is refused there with the
/// status the node's own check gave before: 400 for a start, an update and its end, and a
/// release; 404 for a read (no allocation has such an id) and for an unquarantine of a
/// device uuid that is no uuid (no device has it). The answer is the API's error object,
/// the id escaped; nothing is granted or changed.
#[test]
fn a_bad_id_in_a_url_path_is_refused_at_the_edge_with_the_status_of_before() {
    let node = node();
    let start = br#"{"pid":1,"bundle":"/bundles/x"}"#;
    let update = br#"{"runc_root":"/run/runc","cpu_quota":100000,"cpu_period":100000}"#;
    let done = br#"{"runc_root":"/run/runc","runc_succeeded":true}"#;
    // Percent-encoded, as a client's URL carries them: `../x`, `a\nb`, `a b`, `.`.
    for bad in ["..%2Fx", "a%0Ab", "a%20b", "."] {
        let cases: [(&str, String, &[u8], u16); 6] = [
            ("POST", format!("/v1/allocations/{bad}/start"), start, 400),
            ("POST", format!("/v1/allocations/{bad}/update"), update, 400),
            ("POST", format!("/v1/allocations/{bad}/update/done"), done, 400),
            ("DELETE", format!("/v1/allocations/{bad}"), b"", 400),
            ("GET", format!("/v1/allocations/{bad}"), b"", 404),
            ("POST", format!("/v1/devices/GPU-{bad}/unquarantine"), b"", 404),
        ];
        for (method, path, body, want) in cases {
            let (status, _, answer) = send(&node.socket, method, &path, None, body);
            let e: ApiError = serde_json::from_slice(&answer).unwrap_or_else(|_| {
                panic!("{method} {path}: {}", String::from_utf8_lossy(&answer))
            });
            assert_eq!(status, want, "{method} {path}: {}", e.message);
            assert_eq!(e.code.http_status(), want, "{method} {path}");
            assert!(!e.message.contains('\n'), "{method} {path}: escaped: {:?}", e.message);
        }
    }
    let status = node.client().status().expect("status");
    assert!(status.allocations.is_empty(), "nothing granted");
}
