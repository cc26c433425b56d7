//! The version of the tesserad API a client speaks, sent as the `tessera-protocol` header
//! (`MAJOR.MINOR`) on every request, so the request bodies stay strict.
//!
//! The rule: tesserad serves a client of its own major version whose minor version is its
//! own or the one before (a wrapper or hook one minor version older than the daemon keeps
//! getting its grants during a rolling upgrade), and refuses every other version with a
//! 400 naming both. A request without the header speaks [`UNVERSIONED`]: the wrappers and
//! hooks released before the header existed sent none. A minor version may add optional
//! request fields and response fields (clients ignore unknown response fields); anything
//! else is a new major version.

use std::fmt;
use std::str::FromStr;

use crate::display::untrusted;

/// The HTTP header that carries the protocol version of a request (and of its answer).
pub const PROTOCOL_HEADER: &str = "tessera-protocol";

/// The protocol version this build speaks.
pub const PROTOCOL: ProtocolVersion = ProtocolVersion { major: 1, minor: 1 };

/// What a request without a [`PROTOCOL_HEADER`] speaks: the wire format of the clients
/// released before the header existed.
pub const UNVERSIONED: ProtocolVersion = ProtocolVersion { major: 1, minor: 0 };

/// A protocol version, `MAJOR.MINOR`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProtocolVersion {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why a request's protocol version is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error(
        "malformed {PROTOCOL_HEADER} header `{}`: expected MAJOR.MINOR, e.g. `{PROTOCOL}`",
        untrusted(.0).max_chars(64)
    )]
    Malformed(String),
    #[error("more than one {PROTOCOL_HEADER} header")]
    Repeated,
    #[error(
        "protocol version {client} is not supported: this tesserad speaks {server} and accepts \
         {server} and {major}.{previous} (the same major version, the same or the previous minor \
         version); upgrade {older} to match",
        major = server.major,
        previous = server.minor.saturating_sub(1),
        older = if client < server { "the client (tessera-runtime, tessera-hook, tessera)" } else { "tesserad" }
    )]
    Unsupported { client: ProtocolVersion, server: ProtocolVersion },
}

impl FromStr for ProtocolVersion {
    type Err = ProtocolError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let number = |p: &str| {
            (!p.is_empty() && p.len() <= 9 && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        };
        let (major, minor) = s.trim().split_once('.').unwrap_or((s, ""));
        match (number(major), number(minor)) {
            (Some(major), Some(minor)) => Ok(ProtocolVersion { major, minor }),
            _ => Err(ProtocolError::Malformed(s.to_string())),
        }
    }
}

impl ProtocolVersion {
    /// Whether a server speaking `self` serves a client speaking `client`: the same major
    /// version, and the server's minor version or the one before.
    pub fn accepts(self, client: ProtocolVersion) -> bool {
        client.major == self.major
            && (client.minor == self.minor || client.minor.checked_add(1) == Some(self.minor))
    }

    /// The version a request speaks, from its [`PROTOCOL_HEADER`] values (none:
    /// [`UNVERSIONED`]), if a server speaking `self` serves it.
    pub fn negotiate<'a>(
        self,
        mut headers: impl Iterator<Item = &'a [u8]>,
    ) -> Result<ProtocolVersion, ProtocolError> {
        let client = match (headers.next(), headers.next()) {
            (None, _) => UNVERSIONED,
            (Some(_), Some(_)) => return Err(ProtocolError::Repeated),
            (Some(v), None) => std::str::from_utf8(v)
                .map_err(|_| ProtocolError::Malformed(String::from_utf8_lossy(v).into_owned()))?
                .parse()?,
        };
        if self.accepts(client) {
            Ok(client)
        } else {
            Err(ProtocolError::Unsupported { client, server: self })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32) -> ProtocolVersion {
        ProtocolVersion { major, minor }
    }

    #[test]
    fn parses_and_prints_major_dot_minor() {
        assert_eq!("1.4".parse::<ProtocolVersion>(), Ok(v(1, 4)));
        assert_eq!(v(12, 0).to_string(), "12.0");
        for bad in ["", "1", "1.", ".1", "1.2.3", "+1.2", "1.-2", "a.b", "1 .2", "9999999999.0"] {
            assert!(bad.parse::<ProtocolVersion>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_server_accepts_its_own_and_the_previous_minor_of_its_major() {
        let server = v(1, 4);
        assert!(server.accepts(v(1, 4)) && server.accepts(v(1, 3)));
        for other in [v(1, 2), v(1, 5), v(0, 4), v(2, 4), v(2, 3), v(1, u32::MAX)] {
            assert!(!server.accepts(other), "{other}");
        }
        assert!(v(1, 0).accepts(v(1, 0)) && !v(1, 0).accepts(v(0, u32::MAX)));
    }

    #[test]
    fn no_header_is_the_unversioned_minor_and_refusals_name_both_versions() {
        let none = std::iter::empty();
        assert_eq!(v(1, 1).negotiate(none.clone()), Ok(UNVERSIONED));
        assert!(v(1, 2).negotiate(none).is_err(), "1.0 is two minors behind 1.2");
        assert_eq!(PROTOCOL.negotiate([PROTOCOL.to_string().as_bytes()].into_iter()), Ok(PROTOCOL));
        let e = v(1, 1).negotiate([&b"2.0"[..]].into_iter()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("2.0") && msg.contains("1.1") && msg.contains("upgrade tesserad"),
            "{msg}"
        );
        let e = v(1, 3).negotiate([&b"1.1"[..]].into_iter()).unwrap_err().to_string();
        assert!(e.contains("1.1") && e.contains("1.3") && e.contains("upgrade the client"), "{e}");
        let e = v(1, 1).negotiate([&b"1.1\n"[..], b"1.1"].into_iter()).unwrap_err();
        assert_eq!(e, ProtocolError::Repeated);
        let e = v(1, 1).negotiate([&b"one\x1b"[..]].into_iter()).unwrap_err().to_string();
        assert!(e.contains("malformed") && !e.contains('\x1b'), "{e}");
    }

    /// The 1.0 request bodies kept as fixtures are exactly what today's request types send
    /// and read: a change to the types that would refuse (or re-spell) them shows here.
    #[test]
    fn protocol_1_0_fixtures_are_what_the_request_types_send() {
        use crate::types::{AllocateRequest, ReleaseRequest, StartRequest};
        fn same<T: serde::Serialize + serde::de::DeserializeOwned>(name: &str) {
            let path = format!("{}/testdata/protocol-1.0/{name}", env!("CARGO_MANIFEST_DIR"));
            let bytes = std::fs::read(&path).expect("fixture");
            let parsed: T = serde_json::from_slice(&bytes).expect(name);
            assert_eq!(serde_json::to_vec(&parsed).expect("encode"), bytes, "{name}");
        }
        same::<AllocateRequest>("allocate.json");
        same::<StartRequest>("start.json");
        same::<ReleaseRequest>("release.json");
    }
}
