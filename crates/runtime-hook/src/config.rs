//! The runtime configuration file, `/etc/tessera/runtime.toml`: where tessera-runtime and
//! tessera-hook find tesserad, runc and the hook, where the wrapper logs its failures, and
//! which engine it runs for. No engine has to pass environment to its runtime (Docker's
//! daemon.json and podman's containers.conf cannot).
//!
//! ```toml
//! socket = "/run/tessera/tesserad.sock"   # tesserad's API socket
//! runc = "/usr/sbin/runc"                 # absolute, or a bare name looked up on PATH
//! hook = "/usr/local/bin/tessera-hook"    # default: tessera-hook beside tessera-runtime
//! log = "/var/log/tessera/runtime.log"    # failures appended here too (optional)
//! engine = "docker-alice"                 # identity: see docs/SECURITY.md (optional)
//! kubelet = true                          # containerd's CRI handler only (optional)
//! quota_wait_s = 90                       # hold a create while its reclaim runs (optional)
//! ```
//!
//! `quota_wait_s` (0 to [`MAX_QUOTA_WAIT_S`], default [`DEFAULT_QUOTA_WAIT_S`]): how long
//! `create` asks tesserad again (pauses of 0.5 s doubling to 2 s) while the quotas answer that a
//! reclaim is under way for this container (its victims stopping, or the leases that hold
//! its guarantee being recalled), before it fails with that answer. The engine then sees
//! the container start once the capacity is free, instead of a failure it retries on its
//! own schedule (kubelet's back-off). 0: fail at once, as before. Any other answer (a
//! refusal, a place in the fair queue) fails at once.
//!
//! `kubelet = true` says this is the configuration of the engine kubelet drives
//! (containerd's CRI plugin, through the handler `tessera setup containerd` writes, whose
//! `BinaryName` is a link with this file beside it): only there is the device plugin's
//! assignment annotation (`tessera.io/device-plugin`) honoured, and only for a pod's
//! container (see [`crate::request::check_assignment_source`]). It is never set in a
//! configuration other engines (Docker, podman, `ctr`) read.
//!
//! Precedence, highest first: `TESSERA_SOCKET` / `TESSERA_RUNC` / `TESSERA_HOOK` (set and
//! not empty), then the file, then the built-in defaults. `engine`, `log`, `kubelet` and
//! `quota_wait_s` come from the file only. Which file: `--tessera-config PATH` as tessera-runtime's first argument (what
//! `tessera setup docker --runtime-config` writes as daemon.json `runtimeArgs`), else
//! `TESSERA_RUNTIME_CONFIG`, else the file beside the path tessera-runtime was run as
//! (argv\[0\] + `.toml`, when argv\[0\] is absolute and that file exists: for engines that
//! pass their runtimes neither arguments nor environment, such as podman, a link
//! `/usr/local/lib/tessera/podman-alice -> tessera-runtime` reads
//! `/usr/local/lib/tessera/podman-alice.toml`; see [`ConfigSource::choose_beside`]), else
//! [`DEFAULT_CONFIG`]. A file named by the argument or the variable, or found beside
//! argv\[0\], must be read; the default one may be absent (all defaults). The file is parsed
//! strictly: an unknown key, a value of the wrong type or a relative path is an error
//! naming the file and the key, and the wrapper then refuses to run (fail closed).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use tessera_api::untrusted;
use toml_edit::{DocumentMut, Item, Value};

/// The configuration file read when nothing names another one.
pub const DEFAULT_CONFIG: &str = "/etc/tessera/runtime.toml";
/// The environment variable naming another file (tests, per-engine setups).
pub const CONFIG_ENV: &str = "TESSERA_RUNTIME_CONFIG";
/// tessera-runtime's own first argument naming the file (Docker's `runtimeArgs`).
pub const CONFIG_ARG: &str = "--tessera-config";
/// The annotation tessera-runtime sends tesserad with its configuration's `engine` (a
/// config.json that carries it is refused). A policy identity rule may map it to tenants,
/// and rules may be limited to engines (`identity[].engines`): see crates/policy.
pub const ENGINE_ANNOTATION: &str = "tessera.io/engine";
/// The largest configuration file read (it is a handful of lines).
pub const MAX_CONFIG_BYTES: u64 = 64 * 1024;
/// How long a create waits while its reclaim runs, by default: the default grace period
/// (30 s) with room for the scrub and a lease recall, well inside kubelet's 2-minute
/// runtime request timeout.
pub const DEFAULT_QUOTA_WAIT_S: u64 = 90;
/// The most `quota_wait_s` may say (kubelet's default runtime request timeout is 120 s).
pub const MAX_QUOTA_WAIT_S: u64 = 110;

/// Why the configuration file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("runtime config {path}: cannot read: {message}")]
    Read { path: String, message: String },
    #[error("runtime config {path}: larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: String },
    #[error("runtime config {path}: not valid TOML: {}", untrusted(.message))]
    Parse { path: String, message: String },
    #[error(
        "runtime config {path}: unknown key `{}`: expected socket, runc, hook, log, engine, kubelet or \
         quota_wait_s",
        untrusted(.key)
    )]
    UnknownKey { path: String, key: String },
    #[error("runtime config {path}: `{key}` must be a string")]
    NotAString { path: String, key: &'static str },
    #[error("runtime config {path}: `{key}` must be true or false")]
    NotABool { path: String, key: &'static str },
    #[error(
        "runtime config {path}: `quota_wait_s` must be a whole number of seconds from 0 to \
         {MAX_QUOTA_WAIT_S}"
    )]
    BadWait { path: String },
    #[error("runtime config {path}: `{key}` = {}: {why}", untrusted(.value))]
    Invalid { path: String, key: &'static str, value: String, why: &'static str },
    #[error("{CONFIG_ARG} needs a file: `{CONFIG_ARG} PATH` or `{CONFIG_ARG}=PATH`")]
    MissingArgValue,
    #[error(
        "runtime config {path}: `kubelet = true` in the default configuration, which every engine on the node \
         reads (Docker, podman, ctr): set it only in the CRI handler's own file (`tessera setup containerd` \
         writes one beside the handler's tessera-runtime link)"
    )]
    KubeletInDefault { path: String },
}

/// The file's settings; `None` where the file does not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// The file read (`None`: the default file was absent).
    pub source: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub runc: Option<OsString>,
    pub hook: Option<PathBuf>,
    pub log: Option<PathBuf>,
    pub engine: Option<String>,
    /// This is the configuration of the engine kubelet drives (see the module docs).
    pub kubelet: bool,
    /// How long a create waits while its reclaim runs (see the module docs); `None`:
    /// [`DEFAULT_QUOTA_WAIT_S`].
    pub quota_wait_s: Option<u64>,
}

/// Where the configuration comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    /// Named explicitly (argument or variable): it must exist.
    Named(PathBuf),
    /// [`DEFAULT_CONFIG`] (or a test's stand-in): absent means defaults.
    Default(PathBuf),
}

impl ConfigSource {
    /// Picks the file from the process environment; `arg` is a `--tessera-config` value.
    pub fn choose(arg: Option<PathBuf>) -> ConfigSource {
        match arg
            .or_else(|| std::env::var_os(CONFIG_ENV).filter(|v| !v.is_empty()).map(PathBuf::from))
        {
            Some(p) => ConfigSource::Named(p),
            None => ConfigSource::Default(PathBuf::from(DEFAULT_CONFIG)),
        }
    }

    /// [`ConfigSource::choose`], with one more place before the default: `ARGV0.toml`,
    /// where `argv0` is the absolute path tessera-runtime was run as (a link's own path,
    /// not its target) and that file exists. Whoever can run tessera-runtime with an argv\[0\]
    /// of their choosing can set `TESSERA_RUNTIME_CONFIG` as well: this gives nobody a file
    /// they could not name already. A relative argv\[0\] (a PATH lookup) is not used.
    pub fn choose_beside(arg: Option<PathBuf>, argv0: Option<&std::ffi::OsStr>) -> ConfigSource {
        match ConfigSource::choose(arg) {
            ConfigSource::Default(d) => match argv0.and_then(beside) {
                Some(f) => ConfigSource::Named(f),
                None => ConfigSource::Default(d),
            },
            named => named,
        }
    }

    /// Reads and parses the chosen file.
    pub fn load(&self) -> Result<RuntimeConfig, ConfigError> {
        let (path, must_exist) = match self {
            ConfigSource::Named(p) => (p, true),
            ConfigSource::Default(p) => (p, false),
        };
        let shown = path.display().to_string();
        let read_err =
            |e: std::io::Error| ConfigError::Read { path: shown.clone(), message: e.to_string() };
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !must_exist => {
                return Ok(RuntimeConfig::default())
            }
            Err(e) => return Err(read_err(e)),
        };
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge { path: shown });
        }
        let text = std::fs::read_to_string(path).map_err(read_err)?;
        let mut cfg = parse(&text, &shown)?;
        if cfg.kubelet && matches!(self, ConfigSource::Default(_)) {
            return Err(ConfigError::KubeletInDefault { path: shown });
        }
        cfg.source = Some(path.clone());
        Ok(cfg)
    }
}

/// What tessera-runtime still uses of a configuration it cannot read
/// ([`ConfigSource::load`] failed): the keys it would read that hold a valid value
/// (`socket`, `runc`, `hook`, `log`) — so containers without a GPU request still run with
/// the node's runc, and are still checked against the GPU grants listed beside the socket —
/// and nothing that decides a grant (`engine`, `kubelet`): GPU requests are refused with
/// the configuration's error.
pub fn salvage(source: &ConfigSource) -> RuntimeConfig {
    let path = match source {
        ConfigSource::Named(p) | ConfigSource::Default(p) => p,
    };
    let small = std::fs::metadata(path).is_ok_and(|m| m.len() <= MAX_CONFIG_BYTES);
    let Some(text) = small.then(|| std::fs::read_to_string(path).ok()).flatten() else {
        return RuntimeConfig::default();
    };
    let Ok(doc) = text.parse::<DocumentMut>() else { return RuntimeConfig::default() };
    let mut cfg = RuntimeConfig::default();
    for key in ["socket", "runc", "hook", "log"] {
        let Some(item) = doc.get(key) else { continue };
        // Each key alone, as `parse` reads it: a valid value is kept.
        let mut one = DocumentMut::new();
        one.insert(key, item.clone());
        if let Ok(c) = parse(&one.to_string(), "") {
            cfg.socket = cfg.socket.or(c.socket);
            cfg.runc = cfg.runc.or(c.runc);
            cfg.hook = cfg.hook.or(c.hook);
            cfg.log = cfg.log.or(c.log);
        }
    }
    cfg
}

/// `ARGV0.toml` when `argv0` is absolute and that file exists (any kind: a directory there
/// is an error when read, not a silent default).
fn beside(argv0: &std::ffi::OsStr) -> Option<PathBuf> {
    let p = Path::new(argv0);
    if !p.is_absolute() || p.file_name().is_none() {
        return None;
    }
    let mut f = argv0.to_owned();
    f.push(".toml");
    let f = PathBuf::from(f);
    f.symlink_metadata().is_ok().then_some(f)
}

/// Takes a leading `--tessera-config PATH` (or `=PATH`) off tessera-runtime's argv
/// (argv\[0\] kept). Only the first argument is looked at: runc's own flags come after.
pub fn take_config_arg(args: &mut Vec<OsString>) -> Result<Option<PathBuf>, ConfigError> {
    let Some(first) = args.get(1).and_then(|a| a.to_str()).map(str::to_owned) else {
        return Ok(None);
    };
    if first == CONFIG_ARG {
        if args.len() < 3 || args[2].is_empty() {
            return Err(ConfigError::MissingArgValue);
        }
        let path = PathBuf::from(args.remove(2));
        args.remove(1);
        return Ok(Some(path));
    }
    match first.strip_prefix(CONFIG_ARG).and_then(|r| r.strip_prefix('=')) {
        Some("") => Err(ConfigError::MissingArgValue),
        Some(p) => {
            let path = PathBuf::from(p);
            args.remove(1);
            Ok(Some(path))
        }
        None => Ok(None),
    }
}

/// Parses the file's text; `path` is only for messages.
pub fn parse(text: &str, path: &str) -> Result<RuntimeConfig, ConfigError> {
    let doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| ConfigError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    let mut cfg = RuntimeConfig::default();
    for (key, item) in doc.as_table().iter() {
        let key: &'static str = match key {
            "socket" => "socket",
            "runc" => "runc",
            "hook" => "hook",
            "log" => "log",
            "engine" => "engine",
            "kubelet" => "kubelet",
            "quota_wait_s" => "quota_wait_s",
            other => {
                return Err(ConfigError::UnknownKey {
                    path: path.to_owned(),
                    key: other.to_owned(),
                })
            }
        };
        if key == "quota_wait_s" {
            cfg.quota_wait_s = match item {
                Item::Value(Value::Integer(i)) => u64::try_from(*i.value())
                    .ok()
                    .filter(|&s| s <= MAX_QUOTA_WAIT_S)
                    .map(Some)
                    .ok_or_else(|| ConfigError::BadWait { path: path.to_owned() })?,
                _ => return Err(ConfigError::BadWait { path: path.to_owned() }),
            };
            continue;
        }
        if key == "kubelet" {
            cfg.kubelet = match item {
                Item::Value(Value::Boolean(b)) => *b.value(),
                _ => return Err(ConfigError::NotABool { path: path.to_owned(), key }),
            };
            continue;
        }
        let value = match item {
            Item::Value(Value::String(s)) => s.value().clone(),
            _ => return Err(ConfigError::NotAString { path: path.to_owned(), key }),
        };
        let invalid = |why: &'static str| ConfigError::Invalid {
            path: path.to_owned(),
            key,
            value: value.clone(),
            why,
        };
        if value.is_empty() {
            return Err(invalid("empty"));
        }
        if value.contains('\0') {
            return Err(invalid("contains a NUL byte"));
        }
        let absolute = |v: &str| {
            if Path::new(v).is_absolute() {
                Ok(PathBuf::from(v))
            } else {
                Err(invalid("not an absolute path"))
            }
        };
        match key {
            "socket" => cfg.socket = Some(absolute(&value)?),
            "hook" => cfg.hook = Some(absolute(&value)?),
            "log" => cfg.log = Some(absolute(&value)?),
            "runc" => {
                if value.contains('/') && !Path::new(&value).is_absolute() {
                    return Err(invalid(
                        "a path must be absolute (a bare name is looked up on PATH)",
                    ));
                }
                cfg.runc = Some(OsString::from(value.clone()));
            }
            _ => {
                if !valid_engine(&value) {
                    return Err(invalid(
                        "an engine name is 1 to 63 of a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit",
                    ));
                }
                cfg.engine = Some(value.clone());
            }
        }
    }
    Ok(cfg)
}

/// `[a-z0-9][a-z0-9._-]{0,62}`: a name that is also a valid annotation value and file name.
pub fn valid_engine(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=63).contains(&b.len())
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn quota_wait_s_is_a_bounded_whole_number_of_seconds() {
        let p = "/etc/tessera/runtime.toml";
        assert_eq!(parse("", p).expect("empty").quota_wait_s, None);
        assert_eq!(parse("quota_wait_s = 0\n", p).expect("0").quota_wait_s, Some(0));
        assert_eq!(parse("quota_wait_s = 110\n", p).expect("110").quota_wait_s, Some(110));
        for bad in ["111", "-1", "\"90\"", "1.5", "true"] {
            let e = parse(&format!("quota_wait_s = {bad}\n"), p).expect_err(bad);
            assert_eq!(
                e.to_string(),
                "runtime config /etc/tessera/runtime.toml: `quota_wait_s` must be a whole number \
                 of seconds from 0 to 110",
                "{bad}"
            );
        }
    }

    #[test]
    fn every_key_is_read() {
        let c = parse(
            "# node\nsocket = \"/run/t/d.sock\"\nrunc = \"/usr/sbin/runc\"\nhook = '/opt/t/tessera-hook'\n\
             log = \"/var/log/t.log\"\nengine = \"docker-alice\"\n",
            "/etc/tessera/runtime.toml",
        )
        .expect("parses");
        assert_eq!(c.socket.as_deref(), Some(Path::new("/run/t/d.sock")));
        assert_eq!(c.runc.as_deref(), Some(std::ffi::OsStr::new("/usr/sbin/runc")));
        assert_eq!(c.hook.as_deref(), Some(Path::new("/opt/t/tessera-hook")));
        assert_eq!(c.log.as_deref(), Some(Path::new("/var/log/t.log")));
        assert_eq!(c.engine.as_deref(), Some("docker-alice"));
        assert!(!c.kubelet, "only where the file says so");
        assert!(parse("kubelet = true", "f").expect("kubelet").kubelet);
        assert!(!parse("kubelet = false", "f").expect("kubelet").kubelet);
        assert_eq!(parse("", "f").expect("empty"), RuntimeConfig::default());
        assert_eq!(parse("runc = \"runc\"", "f").expect("bare").runc, Some("runc".into()));
    }

    #[test]
    fn strict_errors_name_the_file_and_the_key() {
        let cases = [
            ("sockt = \"/x\"", "runtime config /e/r.toml: unknown key `sockt`"),
            ("[socket]\npath = \"/x\"", "`socket` must be a string"),
            ("socket = 3", "`socket` must be a string"),
            ("socket = \"run/x\"", "`socket` = run/x: not an absolute path"),
            ("hook = \"\"", "`hook` = : empty"),
            ("runc = \"bin/runc\"", "`runc` = bin/runc: a path must be absolute"),
            ("engine = \"Alice\"", "`engine` = Alice: an engine name is"),
            ("engine = \"a/b\"", "`engine` = a/b: an engine name is"),
            ("kubelet = \"true\"", "`kubelet` must be true or false"),
            ("kubelet = 1", "`kubelet` must be true or false"),
            ("kubelet = true\nkubelet = false", "not valid TOML"),
            ("socket = \"/a\"\nsocket = \"/b\"", "runtime config /e/r.toml: not valid TOML"),
            ("socket = \"/a\u{1b}[2J\" = ", "not valid TOML"),
        ];
        for (text, want) in cases {
            let e = parse(text, "/e/r.toml").expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.contains("/e/r.toml") && !e.contains('\u{1b}'), "{text:?}: {e}");
        }
        let e = parse("x\u{1b}[2J = \"1\"", "f").expect_err("escaped");
        assert!(!e.to_string().contains('\u{1b}'), "{e}");
    }

    #[test]
    fn a_broken_file_keeps_its_valid_paths_and_nothing_that_decides_a_grant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("r.toml");
        std::fs::write(
            &f,
            "sockt = \"/typo\"\nsocket = \"/run/t.sock\"\nrunc = \"/usr/sbin/runc\"\nhook = \"rel\"\n\
             engine = \"docker-alice\"\nkubelet = true\n",
        )
        .expect("write");
        let src = ConfigSource::Named(f.clone());
        assert!(src.load().is_err());
        let c = salvage(&src);
        assert_eq!(c.socket.as_deref(), Some(Path::new("/run/t.sock")));
        assert_eq!(c.runc.as_deref(), Some(std::ffi::OsStr::new("/usr/sbin/runc")));
        assert_eq!((c.hook, c.engine, c.kubelet), (None, None, false));
        std::fs::write(&f, "socket = [").expect("write");
        assert_eq!(salvage(&src), RuntimeConfig::default());
        assert_eq!(
            salvage(&ConfigSource::Named(dir.path().join("none"))),
            RuntimeConfig::default()
        );
    }

    #[test]
    fn engine_names() {
        for ok in ["a", "docker-alice", "0", "podman.bob_2", &"a".repeat(63)] {
            assert!(valid_engine(ok), "{ok}");
        }
        for bad in ["", "-a", ".a", "A", "a b", "a/b", "a=b", &"a".repeat(64), "é"] {
            assert!(!valid_engine(bad), "{bad}");
        }
    }

    #[test]
    fn named_file_must_exist_default_may_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("none.toml");
        assert_eq!(
            ConfigSource::Default(missing.clone()).load().expect("absent default"),
            RuntimeConfig::default()
        );
        let e = ConfigSource::Named(missing.clone()).load().expect_err("named must exist");
        assert!(e.to_string().contains("none.toml: cannot read"), "{e}");
        let f = dir.path().join("r.toml");
        std::fs::write(&f, "engine = \"e1\"\n").expect("write");
        let c = ConfigSource::Named(f.clone()).load().expect("loads");
        assert_eq!((c.engine.as_deref(), c.source.as_deref()), (Some("e1"), Some(f.as_path())));
        std::fs::write(&f, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).expect("write");
        let e = ConfigSource::Default(f.clone()).load().expect_err("too large");
        assert!(matches!(e, ConfigError::TooLarge { .. }), "{e}");
        // `kubelet = true` only in a file named for the CRI handler, never in the default
        // every engine reads.
        std::fs::write(&f, "kubelet = true\n").expect("write");
        assert!(ConfigSource::Named(f.clone()).load().expect("named").kubelet);
        let e = ConfigSource::Default(f).load().expect_err("kubelet in the default");
        assert!(matches!(e, ConfigError::KubeletInDefault { .. }), "{e}");
        assert!(e.to_string().contains("tessera setup containerd"), "{e}");
    }

    #[test]
    fn a_file_beside_argv0_comes_after_the_argument_and_before_the_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exe = dir.path().join("podman-alice");
        let beside_file = dir.path().join("podman-alice.toml");
        let exe_os = exe.as_os_str();
        if std::env::var_os(CONFIG_ENV).is_some() {
            return; // the variable would win over the file beside argv[0]
        }
        // Absent: the default, as before.
        assert!(matches!(
            ConfigSource::choose_beside(None, Some(exe_os)),
            ConfigSource::Default(_)
        ));
        std::fs::write(&beside_file, "engine = \"podman-alice\"\n").expect("write");
        let chosen = ConfigSource::choose_beside(None, Some(exe_os));
        assert_eq!(chosen, ConfigSource::Named(beside_file.clone()));
        assert_eq!(chosen.load().expect("loads").engine.as_deref(), Some("podman-alice"));
        // The argument still wins; a relative argv[0] is never used.
        let other = dir.path().join("other.toml");
        assert_eq!(
            ConfigSource::choose_beside(Some(other.clone()), Some(exe_os)),
            ConfigSource::Named(other)
        );
        assert!(matches!(
            ConfigSource::choose_beside(None, Some(std::ffi::OsStr::new("podman-alice"))),
            ConfigSource::Default(_)
        ));
        // Something there that is not a readable file is an error, not the default.
        std::fs::remove_file(&beside_file).expect("rm");
        std::fs::create_dir(&beside_file).expect("mkdir");
        let e = ConfigSource::choose_beside(None, Some(exe_os)).load().expect_err("a dir");
        assert!(e.to_string().contains("podman-alice.toml: cannot read"), "{e}");
    }

    #[test]
    fn the_config_argument_is_taken_off_argv() {
        let mut a = args("rt --tessera-config /e/r.toml --root /r create x");
        assert_eq!(take_config_arg(&mut a), Ok(Some(PathBuf::from("/e/r.toml"))));
        assert_eq!(a, args("rt --root /r create x"));
        let mut a = args("rt --tessera-config=/e/r.toml state x");
        assert_eq!(take_config_arg(&mut a), Ok(Some(PathBuf::from("/e/r.toml"))));
        assert_eq!(a, args("rt state x"));
        // Only as the first argument: later it is runc's (and an error there).
        let mut a = args("rt --root /r --tessera-config /x state x");
        assert_eq!(take_config_arg(&mut a), Ok(None));
        assert_eq!(a.len(), 7);
        for bad in ["rt --tessera-config", "rt --tessera-config="] {
            assert_eq!(take_config_arg(&mut args(bad)), Err(ConfigError::MissingArgValue), "{bad}");
        }
        let mut a = args("rt");
        assert_eq!(take_config_arg(&mut a), Ok(None));
    }
}
