//! The control protocol of `nvidia-cuda-mps-control`: typed commands rendered exactly as
//! the binary reads them on stdin, and strict parsers of its answers.
//!
//! Syntax (NVIDIA, "Multi-Process Service", nvidia-cuda-mps-control commands):
//!
//! ```text
//! get_server_list                                   -> one server PID a line
//! start_server -uid <uid>
//! shutdown_server <pid> [-f]
//! get_client_list <server pid>                      -> one client PID a line
//! set_default_active_thread_percentage <pct>
//! get_default_active_thread_percentage              -> a float, e.g. `50.0`
//! set_active_thread_percentage <server pid> <pct>
//! get_active_thread_percentage <server pid>         -> a float
//! set_default_device_pinned_mem_limit <dev> <value> (value: integer + `M` or `G`)
//! get_default_device_pinned_mem_limit <dev>         -> e.g. `4G`, `512M`
//! set_device_pinned_mem_limit <server pid> <dev> <value>
//! get_device_pinned_mem_limit <server pid> <dev>
//! terminate_client <server pid> <client pid>
//! quit
//! ```
//!
//! `<dev>` is a device ordinal (as seen through the daemon's `CUDA_VISIBLE_DEVICES`) or a
//! device UUID; NVIDIA's own DRA driver always passes UUIDs, and so does the supervisor.
//!
//! The driver shows a pinned-memory limit of at least 1 GiB in whole GiB, rounded down
//! (a limit set as `1044M` reads back as `1G`, observed on driver 595.91.07), so a
//! read-back is compared with [`MemLimit::readback_matches`], never with `==`.
//!
//! Parsers are strict: an answer that is not exactly the documented shape is an error that
//! quotes the (sanitized, bounded) answer, never a guessed value.

use std::fmt;

/// A device as named in a control command.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceRef {
    /// A CUDA ordinal, relative to the daemon's `CUDA_VISIBLE_DEVICES`.
    Ordinal(u32),
    /// A device UUID, `GPU-...` or `MIG-...`.
    Uuid(String),
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRef::Ordinal(n) => write!(f, "{n}"),
            DeviceRef::Uuid(u) => f.write_str(u),
        }
    }
}

impl DeviceRef {
    fn parse(token: &str) -> Result<DeviceRef, ParseError> {
        if let Ok(n) = token.parse::<u32>() {
            return Ok(DeviceRef::Ordinal(n));
        }
        if is_uuid_token(token) {
            return Ok(DeviceRef::Uuid(token.to_string()));
        }
        Err(ParseError::new("a device ordinal or UUID", token))
    }
}

/// Whether `s` can be a device UUID token: `GPU-`/`MIG-` and then `[0-9A-Za-z-/]`.
fn is_uuid_token(s: &str) -> bool {
    (s.starts_with("GPU-") || s.starts_with("MIG-"))
        && s.len() <= 96
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
}

/// A device pinned-memory limit, in whole MiB (the protocol has no finer unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemLimit {
    mib: u64,
}

const MIB: u64 = 1024 * 1024;
/// Larger limits than this (1 EiB) are not memory sizes; refusing them keeps byte
/// arithmetic free of overflow.
const MAX_MIB: u64 = 1 << 40;

impl MemLimit {
    /// A limit of `mib` MiB. None for 0 or absurd sizes.
    pub fn from_mib(mib: u64) -> Option<MemLimit> {
        (1..=MAX_MIB).contains(&mib).then_some(MemLimit { mib })
    }

    /// The largest whole-MiB limit not above `bytes` (a cap must never grant more than
    /// asked). None below 1 MiB.
    pub fn from_bytes_floor(bytes: u64) -> Option<MemLimit> {
        MemLimit::from_mib(bytes / MIB)
    }

    pub fn mib(self) -> u64 {
        self.mib
    }

    pub fn bytes(self) -> u64 {
        self.mib * MIB
    }

    /// The protocol form: `NG` when a whole number of GiB, else `NM`.
    pub fn render(self) -> String {
        let (gib, rest) = (self.mib / 1024, self.mib % 1024);
        if rest == 0 {
            format!("{gib}G")
        } else {
            format!("{}M", self.mib)
        }
    }

    /// Parse the protocol form: digits then `M` or `G`, nothing else (no spaces, no
    /// `MiB`, no lowercase, no fractions). `0M`/`0G` parse as [`MemLimit::ZERO_READBACK`]
    /// so that a daemon reporting "no limit" never matches a real cap.
    pub fn parse(text: &str) -> Result<MemLimit, ParseError> {
        let bad = || ParseError::new("a memory limit such as 4G or 4096M", text);
        let (digits, unit) = text.split_at(text.len().saturating_sub(1));
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 13 {
            return Err(bad());
        }
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let mib = match unit {
            "M" => n,
            "G" => n.checked_mul(1024).ok_or_else(bad)?,
            _ => return Err(bad()),
        };
        if mib == 0 {
            return Ok(MemLimit::ZERO_READBACK);
        }
        MemLimit::from_mib(mib).ok_or_else(bad)
    }

    /// What a `0M` answer parses to: no cap. Never equal to a limit made by the
    /// constructors, which refuse 0.
    pub const ZERO_READBACK: MemLimit = MemLimit { mib: 0 };

    /// Whether `read` (parsed from a `get_*_device_pinned_mem_limit` answer) shows this
    /// limit: exactly, or as the driver displays limits of 1 GiB and more: in whole GiB,
    /// rounded down.
    pub fn readback_matches(self, read: MemLimit) -> bool {
        // The whole-GiB display: `read` is `self` rounded down to a GiB, and not below 1 GiB.
        let floor_gib = self.mib / 1024 * 1024;
        read == self || (floor_gib >= 1024 && read.mib == floor_gib)
    }
}

impl fmt::Display for MemLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render())
    }
}

/// One control command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    GetServerList,
    StartServer {
        uid: u32,
    },
    ShutdownServer {
        pid: u32,
        force: bool,
    },
    GetClientList {
        server_pid: u32,
    },
    /// 1..=100.
    SetDefaultActiveThreadPercentage(u8),
    GetDefaultActiveThreadPercentage,
    SetActiveThreadPercentage {
        server_pid: u32,
        percent: u8,
    },
    GetActiveThreadPercentage {
        server_pid: u32,
    },
    SetDefaultDevicePinnedMemLimit {
        device: DeviceRef,
        limit: MemLimit,
    },
    GetDefaultDevicePinnedMemLimit {
        device: DeviceRef,
    },
    SetDevicePinnedMemLimit {
        server_pid: u32,
        device: DeviceRef,
        limit: MemLimit,
    },
    GetDevicePinnedMemLimit {
        server_pid: u32,
        device: DeviceRef,
    },
    TerminateClient {
        server_pid: u32,
        client_pid: u32,
    },
    Quit,
}

impl Command {
    /// The line the control binary reads on stdin (without the newline).
    pub fn render(&self) -> String {
        match self {
            Command::GetServerList => "get_server_list".into(),
            Command::StartServer { uid } => format!("start_server -uid {uid}"),
            Command::ShutdownServer { pid, force: false } => format!("shutdown_server {pid}"),
            Command::ShutdownServer { pid, force: true } => format!("shutdown_server {pid} -f"),
            Command::GetClientList { server_pid } => format!("get_client_list {server_pid}"),
            Command::SetDefaultActiveThreadPercentage(p) => {
                format!("set_default_active_thread_percentage {p}")
            }
            Command::GetDefaultActiveThreadPercentage => {
                "get_default_active_thread_percentage".into()
            }
            Command::SetActiveThreadPercentage { server_pid, percent } => {
                format!("set_active_thread_percentage {server_pid} {percent}")
            }
            Command::GetActiveThreadPercentage { server_pid } => {
                format!("get_active_thread_percentage {server_pid}")
            }
            Command::SetDefaultDevicePinnedMemLimit { device, limit } => {
                format!("set_default_device_pinned_mem_limit {device} {limit}")
            }
            Command::GetDefaultDevicePinnedMemLimit { device } => {
                format!("get_default_device_pinned_mem_limit {device}")
            }
            Command::SetDevicePinnedMemLimit { server_pid, device, limit } => {
                format!("set_device_pinned_mem_limit {server_pid} {device} {limit}")
            }
            Command::GetDevicePinnedMemLimit { server_pid, device } => {
                format!("get_device_pinned_mem_limit {server_pid} {device}")
            }
            Command::TerminateClient { server_pid, client_pid } => {
                format!("terminate_client {server_pid} {client_pid}")
            }
            Command::Quit => "quit".into(),
        }
    }

    /// Whether the command changes the daemon's state (the test double persists after these).
    pub fn is_mutating(&self) -> bool {
        !matches!(
            self,
            Command::GetServerList
                | Command::GetClientList { .. }
                | Command::GetDefaultActiveThreadPercentage
                | Command::GetActiveThreadPercentage { .. }
                | Command::GetDefaultDevicePinnedMemLimit { .. }
                | Command::GetDevicePinnedMemLimit { .. }
        )
    }

    /// Parse one command line (the inverse of [`Command::render`]; used by the test double).
    pub fn parse(line: &str) -> Result<Command, ParseError> {
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        let bad = || ParseError::new("a control command", line);
        let pid = |w: &str| w.parse::<u32>().map_err(|_| ParseError::new("a PID", w));
        let pct = |w: &str| parse_percent_arg(w);
        let cmd = match words.as_slice() {
            ["get_server_list"] => Command::GetServerList,
            ["start_server", "-uid", uid] => Command::StartServer {
                uid: uid.parse().map_err(|_| ParseError::new("a user id", uid))?,
            },
            ["shutdown_server", p] => Command::ShutdownServer { pid: pid(p)?, force: false },
            ["shutdown_server", p, "-f"] => Command::ShutdownServer { pid: pid(p)?, force: true },
            ["get_client_list", p] => Command::GetClientList { server_pid: pid(p)? },
            ["set_default_active_thread_percentage", p] => {
                Command::SetDefaultActiveThreadPercentage(pct(p)?)
            }
            ["get_default_active_thread_percentage"] => Command::GetDefaultActiveThreadPercentage,
            ["set_active_thread_percentage", s, p] => {
                Command::SetActiveThreadPercentage { server_pid: pid(s)?, percent: pct(p)? }
            }
            ["get_active_thread_percentage", s] => {
                Command::GetActiveThreadPercentage { server_pid: pid(s)? }
            }
            ["set_default_device_pinned_mem_limit", d, v] => {
                Command::SetDefaultDevicePinnedMemLimit {
                    device: DeviceRef::parse(d)?,
                    limit: parse_limit_arg(v)?,
                }
            }
            ["get_default_device_pinned_mem_limit", d] => {
                Command::GetDefaultDevicePinnedMemLimit { device: DeviceRef::parse(d)? }
            }
            ["set_device_pinned_mem_limit", s, d, v] => Command::SetDevicePinnedMemLimit {
                server_pid: pid(s)?,
                device: DeviceRef::parse(d)?,
                limit: parse_limit_arg(v)?,
            },
            ["get_device_pinned_mem_limit", s, d] => Command::GetDevicePinnedMemLimit {
                server_pid: pid(s)?,
                device: DeviceRef::parse(d)?,
            },
            ["terminate_client", s, c] => {
                Command::TerminateClient { server_pid: pid(s)?, client_pid: pid(c)? }
            }
            ["quit"] | ["quit", "-t", _] => Command::Quit,
            _ => return Err(bad()),
        };
        Ok(cmd)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render())
    }
}

fn parse_percent_arg(w: &str) -> Result<u8, ParseError> {
    match w.parse::<u8>() {
        Ok(p) if (1..=100).contains(&p) => Ok(p),
        _ => Err(ParseError::new("a percentage from 1 to 100", w)),
    }
}

fn parse_limit_arg(w: &str) -> Result<MemLimit, ParseError> {
    match MemLimit::parse(w)? {
        MemLimit::ZERO_READBACK => Err(ParseError::new("a memory limit of at least 1M", w)),
        l => Ok(l),
    }
}

/// An answer (or command) that is not of the documented shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected {expected}, got \"{got}\"")]
pub struct ParseError {
    pub expected: &'static str,
    /// The offending text, sanitized: printable ASCII, at most 120 characters.
    pub got: String,
}

impl ParseError {
    pub fn new(expected: &'static str, got: &str) -> ParseError {
        ParseError { expected, got: sanitize(got, 120) }
    }
}

/// `text` as printable ASCII (newlines shown as `\n`, other bytes as `?`), at most `max`
/// characters, for error messages and logs.
pub fn sanitize(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        let piece = match c {
            '\n' => "\\n".to_string(),
            ' '..='~' => c.to_string(),
            _ => "?".to_string(),
        };
        if out.len() + piece.len() > max {
            out.push_str("...");
            break;
        }
        out.push_str(&piece);
    }
    out
}

/// The one meaningful line of an answer: trailing whitespace and blank lines removed; more
/// than one non-blank line is an error.
fn single_line<'a>(answer: &'a str, expected: &'static str) -> Result<&'a str, ParseError> {
    let mut lines = answer.lines().map(str::trim).filter(|l| !l.is_empty());
    match (lines.next(), lines.next()) {
        (Some(l), None) => Ok(l),
        _ => Err(ParseError::new(expected, answer)),
    }
}

/// Parse a list of PIDs, one a line (`get_server_list`, `get_client_list`). An empty answer
/// is an empty list.
pub fn parse_pid_list(answer: &str) -> Result<Vec<u32>, ParseError> {
    answer
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| match l.parse::<u32>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(ParseError::new("one PID a line", answer)),
        })
        .collect()
}

/// Parse a thread percentage answer, a float such as `50.0` (an integer is accepted too),
/// in 0..=100.
pub fn parse_thread_percentage(answer: &str) -> Result<f64, ParseError> {
    const EXPECTED: &str = "a thread percentage such as 50.0";
    let line = single_line(answer, EXPECTED)?;
    let well_formed = {
        let (int, frac) = line.split_once('.').unwrap_or((line, "0"));
        !int.is_empty()
            && int.len() <= 3
            && int.bytes().all(|b| b.is_ascii_digit())
            && !frac.is_empty()
            && frac.len() <= 6
            && frac.bytes().all(|b| b.is_ascii_digit())
    };
    let value: f64 = if well_formed {
        line.parse().map_err(|_| ParseError::new(EXPECTED, answer))?
    } else {
        -1.0
    };
    if !(0.0..=100.0).contains(&value) {
        return Err(ParseError::new(EXPECTED, answer));
    }
    Ok(value)
}

/// Whether a thread-percentage read-back shows `percent`.
pub fn thread_percentage_matches(percent: u8, read: f64) -> bool {
    (read - f64::from(percent)).abs() < 0.05
}

/// Parse a pinned-memory limit answer (`get_*_device_pinned_mem_limit`).
pub fn parse_mem_limit(answer: &str) -> Result<MemLimit, ParseError> {
    MemLimit::parse(single_line(answer, "a memory limit such as 4G or 4096M")?)
}

/// What the control client prints when no control daemon serves its pipe directory.
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid() -> DeviceRef {
        DeviceRef::Uuid("GPU-f22fb098-d1b3-3806-2655-ba25f02229c1".into())
    }

    fn limit(mib: u64) -> MemLimit {
        MemLimit::from_mib(mib).expect("valid limit")
    }

    /// The real `nvidia-cuda-mps-control` (driver 580.159.04, H100 80GB HBM3, 2026-11-28,
    /// `scripts/gpu-checks.sh` step 06, docs/GPU.md) was sent these lines as rendered here and
    /// answered as below (its stdout, verbatim); the parsers read each answer, and the
    /// server's caps read back as the defaults set.
    #[test]
    fn the_real_control_daemons_answers_parse() {
        let gpu = DeviceRef::Uuid("GPU-b3948cc5-3767-1ce3-8dfc-2f3d1702c019".into());
        let sent = [
            (Command::GetServerList, "get_server_list", ""),
            (
                Command::SetDefaultActiveThreadPercentage(50),
                "set_default_active_thread_percentage 50",
                "50.0\n",
            ),
            (
                Command::GetDefaultActiveThreadPercentage,
                "get_default_active_thread_percentage",
                "50.0\n",
            ),
            (
                Command::SetDefaultDevicePinnedMemLimit { device: gpu.clone(), limit: limit(4096) },
                "set_default_device_pinned_mem_limit GPU-b3948cc5-3767-1ce3-8dfc-2f3d1702c019 4G",
                "",
            ),
            (
                Command::GetDefaultDevicePinnedMemLimit { device: gpu.clone() },
                "get_default_device_pinned_mem_limit GPU-b3948cc5-3767-1ce3-8dfc-2f3d1702c019",
                "4G\n",
            ),
        ];
        for (cmd, line, _) in &sent {
            assert_eq!(&cmd.render(), line);
            assert_eq!(&Command::parse(line).expect("parses"), cmd);
        }
        assert_eq!(parse_pid_list(sent[0].2).expect("empty list"), Vec::<u32>::new());
        assert!(thread_percentage_matches(50, parse_thread_percentage(sent[1].2).expect("50.0")));
        assert!(thread_percentage_matches(50, parse_thread_percentage(sent[2].2).expect("50.0")));
        assert!(limit(4096).readback_matches(parse_mem_limit(sent[4].2).expect("4G")));
        // After a CUDA client ran (through the pipe directory mounted read-only): one server,
        // its caps those defaults.
        assert_eq!(parse_pid_list("673\n").expect("one server"), [673]);
        let server = Command::GetActiveThreadPercentage { server_pid: 673 };
        assert_eq!(server.render(), "get_active_thread_percentage 673");
        assert!(thread_percentage_matches(50, parse_thread_percentage("50.0\n").expect("50.0")));
        let server = Command::GetDevicePinnedMemLimit { server_pid: 673, device: gpu };
        assert_eq!(
            server.render(),
            "get_device_pinned_mem_limit 673 GPU-b3948cc5-3767-1ce3-8dfc-2f3d1702c019"
        );
        assert!(limit(4096).readback_matches(parse_mem_limit("4G\n").expect("4G")));
    }

    #[test]
    fn every_command_renders_in_the_binarys_syntax() {
        let cases = [
            (Command::GetServerList, "get_server_list"),
            (Command::StartServer { uid: 1000 }, "start_server -uid 1000"),
            (Command::ShutdownServer { pid: 42, force: false }, "shutdown_server 42"),
            (Command::ShutdownServer { pid: 42, force: true }, "shutdown_server 42 -f"),
            (Command::GetClientList { server_pid: 42 }, "get_client_list 42"),
            (Command::SetDefaultActiveThreadPercentage(50), "set_default_active_thread_percentage 50"),
            (Command::GetDefaultActiveThreadPercentage, "get_default_active_thread_percentage"),
            (Command::SetActiveThreadPercentage { server_pid: 7, percent: 25 }, "set_active_thread_percentage 7 25"),
            (Command::GetActiveThreadPercentage { server_pid: 7 }, "get_active_thread_percentage 7"),
            (
                Command::SetDefaultDevicePinnedMemLimit { device: DeviceRef::Ordinal(0), limit: limit(4096) },
                "set_default_device_pinned_mem_limit 0 4G",
            ),
            (
                Command::SetDefaultDevicePinnedMemLimit { device: uuid(), limit: limit(10_240 + 1) },
                "set_default_device_pinned_mem_limit GPU-f22fb098-d1b3-3806-2655-ba25f02229c1 10241M",
            ),
            (
                Command::GetDefaultDevicePinnedMemLimit { device: uuid() },
                "get_default_device_pinned_mem_limit GPU-f22fb098-d1b3-3806-2655-ba25f02229c1",
            ),
            (
                Command::SetDevicePinnedMemLimit { server_pid: 9, device: DeviceRef::Ordinal(1), limit: limit(512) },
                "set_device_pinned_mem_limit 9 1 512M",
            ),
            (
                Command::GetDevicePinnedMemLimit { server_pid: 9, device: DeviceRef::Ordinal(1) },
                "get_device_pinned_mem_limit 9 1",
            ),
            (Command::TerminateClient { server_pid: 9, client_pid: 10 }, "terminate_client 9 10"),
            (Command::Quit, "quit"),
        ];
        for (cmd, text) in cases {
            assert_eq!(cmd.render(), text);
            assert_eq!(Command::parse(text).as_ref(), Ok(&cmd), "{text}");
        }
    }

    #[test]
    fn command_parsing_refuses_garbage() {
        for line in [
            "",
            "get_server_list extra",
            "start_server 1000",
            "start_server -uid -1",
            "set_default_active_thread_percentage 0",
            "set_default_active_thread_percentage 101",
            "set_default_active_thread_percentage 50.5",
            "set_default_device_pinned_mem_limit 0 4",
            "set_default_device_pinned_mem_limit 0 0M",
            "set_default_device_pinned_mem_limit ../etc 4G",
            "get_client_list abc",
            "shutdown_server 4 -x",
            "rm -rf /",
        ] {
            assert!(Command::parse(line).is_err(), "{line}");
        }
        assert_eq!(Command::parse("  quit  "), Ok(Command::Quit));
        assert_eq!(Command::parse("quit -t 5"), Ok(Command::Quit));
    }

    #[test]
    fn memory_limits_render_and_parse_strictly() {
        assert_eq!(limit(4096).render(), "4G");
        assert_eq!(limit(4095).render(), "4095M");
        assert_eq!(MemLimit::parse("4G"), Ok(limit(4096)));
        assert_eq!(MemLimit::parse("4096M"), Ok(limit(4096)));
        assert_eq!(MemLimit::parse("0M"), Ok(MemLimit::ZERO_READBACK));
        for bad in [
            "",
            "G",
            "4",
            "4 G",
            "4g",
            "4GB",
            "4MiB",
            "1.5G",
            "-1G",
            "unlimited",
            "99999999999999G",
            "+4G",
        ] {
            assert!(MemLimit::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(MemLimit::from_bytes_floor(20 * 1024 * MIB + 5), Some(limit(20 * 1024)));
        assert_eq!(MemLimit::from_bytes_floor(MIB - 1), None);
        assert_eq!(MemLimit::from_mib(0), None);
        assert_eq!(limit(3).bytes(), 3 * MIB);
    }

    #[test]
    fn memory_readback_allows_the_drivers_whole_gib_display_only() {
        // Set 1044M, the driver shows 1G.
        assert!(limit(1044).readback_matches(limit(1024)));
        assert!(limit(20_389).readback_matches(limit(19 * 1024)));
        assert!(limit(20_389).readback_matches(limit(20_389)));
        assert!(!limit(20_389).readback_matches(limit(20 * 1024)));
        assert!(!limit(20_389).readback_matches(limit(18 * 1024)));
        assert!(!limit(512).readback_matches(MemLimit::ZERO_READBACK));
        assert!(!limit(1024).readback_matches(MemLimit::ZERO_READBACK));
        assert!(!limit(512).readback_matches(limit(511)));
    }

    #[test]
    fn pid_lists_parse_or_fail_whole() {
        assert_eq!(parse_pid_list(""), Ok(vec![]));
        assert_eq!(parse_pid_list("\n"), Ok(vec![]));
        assert_eq!(parse_pid_list("12\n345\n"), Ok(vec![12, 345]));
        assert!(parse_pid_list("12\nabc").is_err());
        assert!(parse_pid_list("0").is_err());
        assert!(parse_pid_list(NO_DAEMON).is_err());
    }

    #[test]
    fn thread_percentages_parse_as_the_driver_prints_them() {
        assert_eq!(parse_thread_percentage("50.0\n"), Ok(50.0));
        assert_eq!(parse_thread_percentage("25"), Ok(25.0));
        assert_eq!(parse_thread_percentage("100.0"), Ok(100.0));
        for bad in [
            "",
            "25 %",
            "abc",
            "-1.0",
            "100.5",
            "NaN",
            "inf",
            "1e2",
            "50.0\n50.0",
            ".5",
            "5.",
            "50,0",
        ] {
            assert!(parse_thread_percentage(bad).is_err(), "{bad:?}");
        }
        assert!(thread_percentage_matches(50, 50.0));
        assert!(!thread_percentage_matches(50, 25.0));
    }

    #[test]
    fn memory_answers_parse_one_line() {
        assert_eq!(parse_mem_limit("4G\n"), Ok(limit(4096)));
        assert!(parse_mem_limit("4G\n4G").is_err());
        assert!(parse_mem_limit("1024 MB").is_err());
    }

    #[test]
    fn errors_quote_a_sanitized_bounded_answer() {
        let hostile = format!("\u{7}\u{0}é line\n{}", "x".repeat(500));
        let e = parse_thread_percentage(&hostile).expect_err("garbage");
        assert!(e.got.len() <= 123, "{}", e.got);
        assert!(e.got.bytes().all(|b| (b' '..=b'~').contains(&b)), "{}", e.got);
        assert!(
            e.to_string()
                .starts_with("expected a thread percentage such as 50.0, got \"??? line\\n"),
            "{e}"
        );
    }
}
