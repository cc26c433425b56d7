//! runc's command line, parsed the way runc (urfave/cli v1 over Go's `flag`) parses it.
//!
//! Only what the wrapper needs is understood: the global flags, the verb, for `create`
//! and `run` the verb's flags and the container id, and for `delete` its container id. Everything is kept so runc can be
//! exec'd with the exact original argv. Go flag rules that matter here:
//! - a flag is `-name` or `--name`, with its value either `=`-joined or the next argument;
//! - boolean flags only take a value `=`-joined (`--detach=false`);
//! - `--` ends the flags; a lone `-` is a positional argument;
//! - global flags stop at the first positional argument (the verb);
//! - urfave/cli v1 reorders a verb's arguments so that its flags may come after the
//!   container id (`create abc --bundle /x` works), except after `--`.
//!
//! Unknown flags are not guessed at: they are kept and treated as boolean. Where that
//! could make a `create`/`run` invisible (an unknown global flag whose value would be
//! taken for the verb), parsing fails instead of letting a GPU container slip past.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

/// runc's state root when `--root` is not given (as root).
pub const DEFAULT_RUNC_ROOT: &str = "/run/runc";

/// Why runc's argv could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgsError {
    #[error("flag `{0}` needs a value")]
    MissingValue(String),
    #[error("invalid boolean value `{value}` for flag `{flag}`")]
    BadBool { flag: String, value: String },
    #[error("argument {0:?} is not valid UTF-8")]
    NotUtf8(OsString),
    #[error("`{verb}` needs a container id")]
    MissingContainerId { verb: String },
    #[error("`{verb}` takes exactly one container id, got {args:?}")]
    ExtraArguments { verb: String, args: Vec<String> },
    #[error(
        "cannot tell runc's verb: unknown global flag `{flag}` may take `{value}` as its value; \
         refusing to guess (put the value after `=`)"
    )]
    Ambiguous { flag: String, value: String },
}

/// runc's global flags (those before the verb).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalOptions {
    pub debug: bool,
    pub systemd_cgroup: bool,
    /// `--log`: where runc writes its log; containerd reads errors back from it.
    pub log: Option<PathBuf>,
    /// `--log-format`: `text` (runc's default) or `json`.
    pub log_format: Option<String>,
    /// `--root`, or [`DEFAULT_RUNC_ROOT`].
    pub root: PathBuf,
    pub criu: Option<OsString>,
    pub rootless: Option<String>,
    /// Flags this parser does not know (kept as given; treated as boolean).
    pub unknown: Vec<OsString>,
}

impl Default for GlobalOptions {
    fn default() -> Self {
        GlobalOptions {
            debug: false,
            systemd_cgroup: false,
            log: None,
            log_format: None,
            root: PathBuf::from(DEFAULT_RUNC_ROOT),
            criu: None,
            rootless: None,
            unknown: Vec::new(),
        }
    }
}

/// The flags of `create` and `run`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// `--bundle`/`-b`; runc uses its working directory when absent.
    pub bundle: Option<PathBuf>,
    pub console_socket: Option<PathBuf>,
    pub pid_file: Option<PathBuf>,
    pub preserve_fds: Option<String>,
    pub detach: bool,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
    pub keep: bool,
    pub no_subreaper: bool,
    /// Flags this parser does not know (kept as given; treated as boolean).
    pub unknown: Vec<OsString>,
}

/// A `create` or `run`: the verbs that make a container from a bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateArgs {
    pub options: CreateOptions,
    pub container_id: String,
}

/// A `delete`: the verb after which a container's devices are free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteArgs {
    pub force: bool,
    pub container_id: String,
}

/// What runc is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// No verb at all (`runc`, `runc --version`).
    None,
    Create(CreateArgs),
    Run(CreateArgs),
    /// `delete [--force] ID`.
    Delete(DeleteArgs),
    /// Any other verb, or `create`/`run` asking for help; passed through untouched.
    Other {
        verb: OsString,
        args: Vec<OsString>,
    },
}

/// A parsed runc command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncInvocation {
    pub global: GlobalOptions,
    pub command: Command,
}

impl RuncInvocation {
    /// The `create`/`run` arguments, if this invocation makes a container.
    pub fn create_args(&self) -> Option<&CreateArgs> {
        match &self.command {
            Command::Create(c) | Command::Run(c) => Some(c),
            _ => None,
        }
    }

    /// The verb, as text (lossy), for messages.
    pub fn verb(&self) -> Option<String> {
        match &self.command {
            Command::None => None,
            Command::Create(_) => Some("create".into()),
            Command::Run(_) => Some("run".into()),
            Command::Delete(_) => Some("delete".into()),
            Command::Other { verb, .. } => Some(verb.to_string_lossy().into_owned()),
        }
    }
}

/// One argument, classified the way Go's `flag` package does.
pub(crate) enum Token<'a> {
    /// `--`: the end of flags.
    EndOfFlags,
    /// Not a flag.
    Positional,
    /// A flag: its name (dashes stripped) and `=`-joined value, if any.
    Flag { name: &'a str, value: Option<&'a OsStr> },
    /// Starts with `-` but is not valid flag syntax (`---x`, `-=x`) or not UTF-8: kept,
    /// treated as an unknown boolean flag.
    Odd,
}

/// Go's `flag` reading of one argument: `-name` and `--name` are the same flag.
pub(crate) fn classify(arg: &OsStr) -> Token<'_> {
    let bytes = arg.as_encoded_bytes();
    if bytes.len() < 2 || bytes[0] != b'-' {
        return Token::Positional;
    }
    if bytes == b"--" {
        return Token::EndOfFlags;
    }
    let dashes = if bytes[1] == b'-' { 2 } else { 1 };
    let rest = &bytes[dashes..];
    if rest.is_empty() || rest[0] == b'-' || rest[0] == b'=' {
        return Token::Odd;
    }
    let (name, value) = match rest.iter().position(|&b| b == b'=') {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let Ok(name) = std::str::from_utf8(name) else { return Token::Odd };
    let value = value.map(os_from_bytes);
    Token::Flag { name, value }
}

/// An `OsStr` from raw bytes (Unix: any bytes are a valid `OsStr`).
fn os_from_bytes(b: &[u8]) -> &OsStr {
    use std::os::unix::ffi::OsStrExt;
    OsStr::from_bytes(b)
}

fn to_utf8(v: &OsStr) -> Result<String, ArgsError> {
    v.to_str().map(str::to_string).ok_or_else(|| ArgsError::NotUtf8(v.to_os_string()))
}

/// Go's `strconv.ParseBool`.
fn parse_bool(flag: &str, v: &OsStr) -> Result<bool, ArgsError> {
    match v.to_str() {
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(false),
        _ => Err(ArgsError::BadBool { flag: flag.to_string(), value: v.to_string_lossy().into() }),
    }
}

/// Takes a flag's value: the `=`-joined one, else the next argument.
fn take_value<'a>(
    name: &str,
    inline: Option<&'a OsStr>,
    args: &'a [OsString],
    i: &mut usize,
) -> Result<&'a OsStr, ArgsError> {
    if let Some(v) = inline {
        return Ok(v);
    }
    let next = args.get(*i + 1).ok_or_else(|| ArgsError::MissingValue(name.to_string()))?;
    *i += 1;
    Ok(next)
}

const KNOWN_VERBS: &[&str] = &[
    "checkpoint",
    "create",
    "delete",
    "events",
    "exec",
    "features",
    "init",
    "kill",
    "list",
    "pause",
    "ps",
    "restore",
    "resume",
    "run",
    "spec",
    "start",
    "state",
    "update",
    "help",
    "h",
];

/// A question `tessera-runtime` answers itself before runc's own answer follows (see
/// [`crate::about`]): its help and its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrapperQuery {
    /// `--help`, `-h`, `help`, `h`, or no arguments at all (runc prints its help then too).
    Help,
    /// `--version`, `-v`.
    Version,
}

impl RuncInvocation {
    /// Whether this asks for the wrapper's help or version: only with no verb (or the
    /// `help` verb alone). `runc help create`, `create --help` and the like go to runc
    /// untouched.
    pub fn wrapper_query(&self) -> Option<WrapperQuery> {
        match &self.command {
            Command::None => {
                // Go's flag package: one or two dashes; urfave/cli v1's aliases.
                let names: Vec<&str> = self
                    .global
                    .unknown
                    .iter()
                    .filter_map(|a| a.to_str())
                    .map(|a| a.trim_start_matches('-'))
                    .collect();
                if names.iter().any(|n| matches!(*n, "help" | "h")) {
                    Some(WrapperQuery::Help)
                } else if names.iter().any(|n| matches!(*n, "version" | "v")) {
                    Some(WrapperQuery::Version)
                } else if self.global == GlobalOptions::default() {
                    Some(WrapperQuery::Help)
                } else {
                    None
                }
            }
            Command::Other { verb, args } if args.is_empty() && (verb == "help" || verb == "h") => {
                Some(WrapperQuery::Help)
            }
            _ => None,
        }
    }
}

impl GlobalOptions {
    /// These options as runc's arguments, each value as `--name=value`: for a command the
    /// wrapper runs itself with the caller's root, cgroup manager and log (the `delete`
    /// that undoes a create tesserad refused to confirm).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut out: Vec<OsString> = Vec::new();
        let valued = |name: &str, v: &OsStr| {
            let mut a = OsString::from(format!("--{name}="));
            a.push(v);
            a
        };
        if self.debug {
            out.push("--debug".into());
        }
        if let Some(log) = &self.log {
            out.push(valued("log", log.as_os_str()));
        }
        if let Some(f) = &self.log_format {
            out.push(valued("log-format", OsStr::new(f)));
        }
        out.push(valued("root", self.root.as_os_str()));
        if let Some(c) = &self.criu {
            out.push(valued("criu", c));
        }
        if self.systemd_cgroup {
            out.push("--systemd-cgroup".into());
        }
        if let Some(r) = &self.rootless {
            out.push(valued("rootless", OsStr::new(r)));
        }
        out.extend(self.unknown.iter().cloned());
        out
    }
}

/// Parses runc's arguments (everything after argv\[0\]).
pub fn parse_runc_args(args: &[OsString]) -> Result<RuncInvocation, ArgsError> {
    let mut global = GlobalOptions::default();
    let mut i = 0;
    // The last unknown global flag given without `=`, and the index it was at.
    let mut last_unknown_bare: Option<usize> = None;
    while i < args.len() {
        let arg = &args[i];
        match classify(arg) {
            Token::Positional => break,
            Token::EndOfFlags => {
                i += 1;
                break;
            }
            Token::Odd => {
                global.unknown.push(arg.clone());
                last_unknown_bare = Some(i);
            }
            Token::Flag { name, value } => match name {
                "debug" => global.debug = value.map_or(Ok(true), |v| parse_bool(name, v))?,
                "systemd-cgroup" => {
                    global.systemd_cgroup = value.map_or(Ok(true), |v| parse_bool(name, v))?
                }
                "log" => global.log = Some(take_value(name, value, args, &mut i)?.into()),
                "log-format" => {
                    global.log_format = Some(to_utf8(take_value(name, value, args, &mut i)?)?)
                }
                "root" => global.root = take_value(name, value, args, &mut i)?.into(),
                "criu" => global.criu = Some(take_value(name, value, args, &mut i)?.into()),
                "rootless" => {
                    global.rootless = Some(to_utf8(take_value(name, value, args, &mut i)?)?)
                }
                _ => {
                    global.unknown.push(arg.clone());
                    last_unknown_bare = if value.is_none() { Some(i) } else { None };
                }
            },
        }
        i += 1;
    }
    let Some(verb) = args.get(i) else {
        return Ok(RuncInvocation { global, command: Command::None });
    };
    let rest = &args[i + 1..];
    // An unknown bare global flag right before the "verb" may really be a value flag; if
    // the word after it is a container-making verb, we cannot tell which one runc sees.
    if i > 0 && last_unknown_bare == Some(i - 1) {
        let verb_known = verb.to_str().is_some_and(|v| KNOWN_VERBS.contains(&v));
        let next_makes =
            rest.first().and_then(|a| a.to_str()).is_some_and(|a| a == "create" || a == "run");
        if !verb_known && next_makes {
            return Err(ArgsError::Ambiguous {
                flag: args[i - 1].to_string_lossy().into(),
                value: verb.to_string_lossy().into(),
            });
        }
    }
    let command = match verb.to_str() {
        Some(v @ ("create" | "run")) => match parse_create(v, rest)? {
            Some(c) if v == "create" => Command::Create(c),
            Some(c) => Command::Run(c),
            None => Command::Other { verb: verb.clone(), args: rest.to_vec() },
        },
        // A delete must never be blocked by this parser: anything it cannot read exactly
        // (help, extra arguments, a bad flag value) goes to runc untouched.
        Some("delete") => match parse_delete(rest) {
            Some(d) => Command::Delete(d),
            None => Command::Other { verb: verb.clone(), args: rest.to_vec() },
        },
        _ => Command::Other { verb: verb.clone(), args: rest.to_vec() },
    };
    Ok(RuncInvocation { global, command })
}

/// Parses the arguments of `create`/`run`. `None` means "asks for help": pass through.
fn parse_create(verb: &str, args: &[OsString]) -> Result<Option<CreateArgs>, ArgsError> {
    let mut o = CreateOptions::default();
    let mut positional: Vec<&OsString> = Vec::new();
    let mut help = false;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        match classify(arg) {
            Token::Positional => positional.push(arg),
            Token::EndOfFlags => {
                positional.extend(&args[i + 1..]);
                break;
            }
            Token::Odd => o.unknown.push(arg.clone()),
            Token::Flag { name, value } => {
                let flag = |v: Option<&OsStr>| v.map_or(Ok(true), |v| parse_bool(name, v));
                match name {
                    "bundle" | "b" => {
                        o.bundle = Some(take_value(name, value, args, &mut i)?.into())
                    }
                    "console-socket" => {
                        o.console_socket = Some(take_value(name, value, args, &mut i)?.into())
                    }
                    "pid-file" => o.pid_file = Some(take_value(name, value, args, &mut i)?.into()),
                    "preserve-fds" => {
                        o.preserve_fds = Some(to_utf8(take_value(name, value, args, &mut i)?)?)
                    }
                    "detach" | "d" => o.detach = flag(value)?,
                    "no-pivot" => o.no_pivot = flag(value)?,
                    "no-new-keyring" => o.no_new_keyring = flag(value)?,
                    "keep" => o.keep = flag(value)?,
                    "no-subreaper" => o.no_subreaper = flag(value)?,
                    "help" | "h" => help = flag(value)?,
                    _ => o.unknown.push(arg.clone()),
                }
            }
        }
        i += 1;
    }
    if help {
        return Ok(None);
    }
    match positional.as_slice() {
        [] => Err(ArgsError::MissingContainerId { verb: verb.to_string() }),
        [id] => {
            let container_id = to_utf8(id)?;
            if container_id.is_empty() {
                return Err(ArgsError::MissingContainerId { verb: verb.to_string() });
            }
            Ok(Some(CreateArgs { options: o, container_id }))
        }
        more => Err(ArgsError::ExtraArguments {
            verb: verb.to_string(),
            args: more.iter().map(|a| a.to_string_lossy().into_owned()).collect(),
        }),
    }
}

/// Parses the arguments of `delete`; `None` when they are not exactly `[--force] ID`
/// (runc then reports whatever is wrong).
fn parse_delete(args: &[OsString]) -> Option<DeleteArgs> {
    let mut force = false;
    let mut positional: Vec<&OsString> = Vec::new();
    for (i, arg) in args.iter().enumerate() {
        match classify(arg) {
            Token::Positional => positional.push(arg),
            Token::EndOfFlags => {
                positional.extend(&args[i + 1..]);
                break;
            }
            Token::Flag { name: "force" | "f", value } => {
                force = value.map_or(Ok(true), |v| parse_bool("force", v)).ok()?;
            }
            Token::Flag { .. } | Token::Odd => return None,
        }
    }
    match positional.as_slice() {
        [id] => {
            let container_id = id.to_str()?.to_string();
            (!container_id.is_empty()).then_some(DeleteArgs { force, container_id })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn argv(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    fn parse(s: &str) -> Result<RuncInvocation, ArgsError> {
        parse_runc_args(&argv(s))
    }

    #[test]
    fn the_global_options_read_back_as_runc_reads_them() {
        for line in [
            "create --bundle /b c",
            "--root /run/containerd/runc/k8s.io --log /x/log.json --log-format json \
             --systemd-cgroup create --bundle /b c",
            "--debug --criu /usr/sbin/criu --rootless false --weird create --bundle /b c",
        ] {
            let (global, _) = create(line);
            let mut again = global.to_args();
            again.extend(argv("delete --force c"));
            let inv = parse_runc_args(&again).expect("parses");
            assert_eq!(inv.global, global, "{line}");
            assert!(
                matches!(inv.command, Command::Delete(ref d) if d.force && d.container_id == "c")
            );
        }
    }

    fn create(s: &str) -> (GlobalOptions, CreateArgs) {
        let inv = parse(s).expect("parses");
        match inv.command {
            Command::Create(c) | Command::Run(c) => (inv.global, c),
            other => panic!("not create/run: {other:?}"),
        }
    }

    #[test]
    fn containerd_create_shape() {
        let inv = parse(
            "--root /run/containerd/runc/default --log /x/log.json --log-format json \
             create --bundle /x --pid-file /x/init.pid abc",
        )
        .expect("parses");
        assert_eq!(inv.global.root, PathBuf::from("/run/containerd/runc/default"));
        assert_eq!(inv.global.log, Some(PathBuf::from("/x/log.json")));
        assert_eq!(inv.global.log_format.as_deref(), Some("json"));
        let Command::Create(c) = inv.command else { panic!("not create") };
        assert_eq!(c.container_id, "abc");
        assert_eq!(c.options.bundle, Some(PathBuf::from("/x")));
        assert_eq!(c.options.pid_file, Some(PathBuf::from("/x/init.pid")));
        assert!(!c.options.detach);
    }

    #[test]
    fn containerd_shim_v2_shape_with_systemd_and_console() {
        let (g, c) = create(
            "--root /run/containerd/runc/k8s.io --log /run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/log.json \
             --log-format json --systemd-cgroup create --bundle /run/b --pid-file /run/b/init.pid \
             --console-socket /tmp/pty.sock --no-pivot --preserve-fds 2 abc",
        );
        assert!(g.systemd_cgroup);
        assert_eq!(c.options.console_socket, Some(PathBuf::from("/tmp/pty.sock")));
        assert!(c.options.no_pivot);
        assert_eq!(c.options.preserve_fds.as_deref(), Some("2"));
        assert_eq!(c.container_id, "abc");
    }

    #[test]
    fn run_detached_with_relative_bundle() {
        let inv = parse("run -d --bundle . id").expect("parses");
        let Command::Run(c) = inv.command else { panic!("not run") };
        assert!(c.options.detach);
        assert_eq!(c.options.bundle, Some(PathBuf::from(".")));
        assert_eq!(c.container_id, "id");
        assert_eq!(inv.global.root, PathBuf::from(DEFAULT_RUNC_ROOT));
    }

    #[test]
    fn equals_forms_and_single_dash_forms() {
        let inv = parse("--root=/r state id").expect("parses");
        assert_eq!(inv.global.root, PathBuf::from("/r"));
        assert_eq!(inv.command, Command::Other { verb: "state".into(), args: argv("id") });
        let (g, c) = create("-root /r2 -log=/l -debug create -b=/bb -pid-file=/p x");
        assert_eq!(g.root, PathBuf::from("/r2"));
        assert_eq!(g.log, Some(PathBuf::from("/l")));
        assert!(g.debug);
        assert_eq!(c.options.bundle, Some(PathBuf::from("/bb")));
        assert_eq!(c.options.pid_file, Some(PathBuf::from("/p")));
        let (_, c) = create("create --bundle= x");
        assert_eq!(c.options.bundle, Some(PathBuf::from("")));
    }

    #[test]
    fn boolean_values_follow_go_parse_bool() {
        let (g, c) = create("--debug=false --systemd-cgroup=1 run --detach=true --keep=F x");
        assert!(!g.debug);
        assert!(g.systemd_cgroup);
        assert!(c.options.detach);
        assert!(!c.options.keep);
        assert_eq!(
            parse("run --detach=maybe x"),
            Err(ArgsError::BadBool { flag: "detach".into(), value: "maybe".into() })
        );
        // A boolean flag never takes the next argument as its value.
        let (g, _) = create("--debug create x");
        assert!(g.debug);
    }

    #[test]
    fn flags_after_the_container_id_are_reordered_like_urfave_cli() {
        let (_, c) = create("create abc --bundle /b --no-new-keyring");
        assert_eq!(c.container_id, "abc");
        assert_eq!(c.options.bundle, Some(PathBuf::from("/b")));
        assert!(c.options.no_new_keyring);
        // After `--`, everything is positional.
        let (_, c) = create("create --bundle /b -- -weird-id");
        assert_eq!(c.container_id, "-weird-id");
    }

    #[test]
    fn all_run_flags() {
        let (_, c) = create(
            "run --bundle /b --console-socket /c --pid-file /p --preserve-fds=3 -d --no-pivot \
             --no-new-keyring --keep --no-subreaper x",
        );
        let o = c.options;
        assert_eq!(o.bundle, Some("/b".into()));
        assert_eq!(o.console_socket, Some("/c".into()));
        assert_eq!(o.pid_file, Some("/p".into()));
        assert_eq!(o.preserve_fds.as_deref(), Some("3"));
        assert!(o.detach && o.no_pivot && o.no_new_keyring && o.keep && o.no_subreaper);
        assert!(o.unknown.is_empty());
    }

    #[test]
    fn other_verbs_pass_through_raw() {
        let inv = parse("--root /r exec -u 1000 --tty id sh -c true").expect("parses");
        assert_eq!(
            inv.command,
            Command::Other { verb: "exec".into(), args: argv("-u 1000 --tty id sh -c true") }
        );
        for s in ["delete --force id", "kill id 9", "start id", "features", "spec --rootless"] {
            let inv = parse(s).expect("parses");
            assert!(inv.create_args().is_none(), "{s}");
        }
    }

    #[test]
    fn no_verb() {
        assert_eq!(parse("").expect("parses").command, Command::None);
        let inv = parse("--version").expect("parses");
        assert_eq!(inv.command, Command::None);
        assert_eq!(inv.global.unknown, argv("--version"));
        assert_eq!(parse("--root /r --").expect("parses").command, Command::None);
    }

    #[test]
    fn the_wrapper_answers_help_and_version_itself_and_nothing_else() {
        use WrapperQuery::{Help, Version};
        for (line, want) in [
            ("--help", Some(Help)),
            ("-h", Some(Help)),
            ("--root /r --help", Some(Help)),
            ("help", Some(Help)),
            ("h", Some(Help)),
            ("", Some(Help)),
            ("--version", Some(Version)),
            ("-v", Some(Version)),
            ("--debug -version", Some(Version)),
            // Verbs and their help are runc's.
            ("help create", None),
            ("create --help", None),
            ("create --bundle /b x", None),
            ("state x", None),
            ("--root /r", None),
            ("--root /r --", None),
        ] {
            let inv = parse(line).expect("parses");
            assert_eq!(inv.wrapper_query(), want, "{line:?}");
        }
    }

    #[test]
    fn create_help_passes_through() {
        let inv = parse("create --help").expect("parses");
        assert!(matches!(inv.command, Command::Other { .. }));
        assert_eq!(inv.verb().as_deref(), Some("create"));
    }

    #[test]
    fn unknown_flags_are_kept_as_booleans() {
        let (g, c) = create("--future-bool create --newflag --bundle /b x");
        assert_eq!(g.unknown, argv("--future-bool"));
        assert_eq!(c.options.unknown, argv("--newflag"));
        assert_eq!(c.container_id, "x");
        // An unknown verb flag that really takes a value leaves an extra positional: an
        // error, never a guess about which one is the container id.
        assert_eq!(
            parse("create --newvalue v x"),
            Err(ArgsError::ExtraArguments {
                verb: "create".into(),
                args: vec!["v".into(), "x".into()]
            })
        );
    }

    #[test]
    fn unknown_global_value_flag_before_create_is_ambiguous() {
        assert!(matches!(parse("--future-opt val create x"), Err(ArgsError::Ambiguous { .. })));
        // A known verb after the unknown flag is fine.
        let inv = parse("--future-bool create x").expect("parses");
        assert!(inv.create_args().is_some());
        // `=`-joined values are unambiguous.
        let inv = parse("--future-opt=val create x").expect("parses");
        assert!(inv.create_args().is_some());
    }

    #[test]
    fn errors() {
        assert_eq!(parse("--root"), Err(ArgsError::MissingValue("root".into())));
        assert_eq!(parse("create --bundle"), Err(ArgsError::MissingValue("bundle".into())));
        assert_eq!(
            parse("create --bundle /b"),
            Err(ArgsError::MissingContainerId { verb: "create".into() })
        );
        assert!(matches!(parse("run a b"), Err(ArgsError::ExtraArguments { .. })));
        let bad = vec![OsString::from("create"), OsString::from_vec(vec![b'a', 0xff])];
        assert!(matches!(parse_runc_args(&bad), Err(ArgsError::NotUtf8(_))));
    }

    #[test]
    fn non_utf8_paths_are_fine() {
        let args = vec![
            OsString::from("--root"),
            OsString::from_vec(vec![b'/', 0xfe]),
            OsString::from("create"),
            OsString::from_vec(b"--bundle=/b\xff".to_vec()),
            OsString::from("x"),
        ];
        let inv = parse_runc_args(&args).expect("parses");
        assert_eq!(inv.global.root.as_os_str().as_encoded_bytes(), b"/\xfe");
        let c = inv.create_args().expect("create");
        assert_eq!(
            c.options.bundle.as_ref().map(|b| b.as_os_str().as_encoded_bytes()),
            Some(&b"/b\xff"[..])
        );
    }

    #[test]
    fn value_flags_take_the_next_argument_even_if_it_looks_like_a_flag() {
        let (g, _) = create("--log -weird create x");
        assert_eq!(g.log, Some(PathBuf::from("-weird")));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(words in proptest::collection::vec("(-{0,3})[a-z=/.]{0,6}", 0..8)) {
            let args: Vec<OsString> = words.into_iter().map(OsString::from).collect();
            let _ = parse_runc_args(&args);
        }
    }

    #[test]
    fn delete_is_parsed_with_its_force_flag_and_anything_else_passes_through() {
        let d = |s: &str| match parse(s).expect("parses").command {
            Command::Delete(d) => Some(d),
            _ => None,
        };
        let want = |force: bool| Some(DeleteArgs { force, container_id: "x".into() });
        assert_eq!(d("--root /r delete x"), want(false));
        assert_eq!(d("delete -f x"), want(true));
        assert_eq!(d("delete x --force"), want(true));
        assert_eq!(d("delete --force=false -- x"), want(false));
        // Help, unknown flags, bad values, no id or two ids: runc's business, untouched.
        for other in
            ["delete", "delete a b", "delete --help x", "delete --force=maybe x", "delete --what x"]
        {
            let inv = parse(other).expect("parses");
            assert!(matches!(inv.command, Command::Other { .. }), "{other}: {:?}", inv.command);
            assert_eq!(inv.verb().as_deref(), Some("delete"));
        }
    }
}
