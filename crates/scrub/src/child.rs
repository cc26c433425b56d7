//! The scrub child process and the command-line entries the `tessera` binary wires up.
//!
//! The daemon never touches CUDA: it runs `<exe> scrub --device UUID --json` with
//! `CUDA_VISIBLE_DEVICES=UUID` and an otherwise cleared environment (PATH kept), in its
//! own process group, reads the one-line JSON report from stdout, and kills the whole
//! group when the timeout passes.
//!
//! - [`run_scrub_child`] / [`ScrubChild`]: the daemon side.
//! - [`scrub_cli_main`]: `tessera scrub --device UUID [--json] [--sim-mem FILE]
//!   [--sim-faults FILE] [--reserve-mib N]`.
//! - [`gpu_bench_main`]: `tessera gpu-bench peak|fill|count …`, for the lent-GPU checks.
//!
//! Both entries take the arguments after the subcommand word (a leading `scrub` or
//! `gpu-bench` is skipped if present), print their result on stdout (logs belong on
//! stderr), and return the process exit code: 0 success, 1 failure, 2 usage.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cuda::{CudaOptions, CudaScrubber};
use crate::error::ScrubError;
use crate::report::{human_bytes, ScrubReport, BACKEND_CUDA, BACKEND_SIM};
use crate::sim::SimScrubber;
use crate::Scrubber;

/// Most bytes of the child's stdout and stderr kept.
const OUTPUT_LIMIT: u64 = 1 << 20;
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How to run one scrub child.
#[derive(Debug, Clone)]
pub struct ScrubChild {
    /// The binary with the `scrub` subcommand (`tessera`).
    pub exe: PathBuf,
    /// The device uuid, passed as `--device` and as `CUDA_VISIBLE_DEVICES`.
    pub device: String,
    /// Killed (with its process group) after this.
    pub timeout: Duration,
    /// Scrub this simulated memory file instead of CUDA memory (`--sim-mem`).
    pub sim_mem: Option<PathBuf>,
    /// Faults file for the simulated scrub (`--sim-faults`).
    pub sim_faults: Option<PathBuf>,
    /// Variables added to the cleared environment (PATH and CUDA_VISIBLE_DEVICES are
    /// always set), e.g. `LD_LIBRARY_PATH` where libcuda lives off the loader's path.
    pub env: Vec<(String, String)>,
}

impl ScrubChild {
    pub fn new(exe: &Path, device: &str, timeout: Duration) -> ScrubChild {
        ScrubChild {
            exe: exe.to_path_buf(),
            device: device.to_string(),
            timeout,
            sim_mem: None,
            sim_faults: None,
            env: Vec::new(),
        }
    }

    /// Scrub the simulated memory file `mem`, with faults from `faults`.
    pub fn sim(mut self, mem: &Path, faults: Option<&Path>) -> ScrubChild {
        self.sim_mem = Some(mem.to_path_buf());
        self.sim_faults = faults.map(Path::to_path_buf);
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> ScrubChild {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// The command line, environment included, as it will run.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("scrub").arg("--device").arg(&self.device).arg("--json");
        if let Some(mem) = &self.sim_mem {
            cmd.arg("--sim-mem").arg(mem);
        }
        if let Some(faults) = &self.sim_faults {
            cmd.arg("--sim-faults").arg(faults);
        }
        cmd.env_clear();
        cmd.env("PATH", std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()));
        cmd.env("CUDA_VISIBLE_DEVICES", &self.device);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // Its own process group, so a timeout kills anything it started too.
        cmd.process_group(0);
        cmd
    }

    /// Run the child to its report. A report that says the scrub failed is `Ok`: the
    /// policy judges it. No report, a report for another device, or the timeout is `Err`.
    pub fn run(&self) -> Result<ScrubReport, ScrubError> {
        let child_err =
            |message: String| ScrubError::Child { device: self.device.clone(), message };
        let mut child = self
            .command()
            .spawn()
            .map_err(|e| child_err(format!("spawn {}: {e}", self.exe.display())))?;
        let stdout = child.stdout.take().map(read_limited);
        let stderr = child.stderr.take().map(read_limited);
        let outcome = wait_with_timeout(&mut child, self.timeout);
        let stdout = stdout.map(join_output).unwrap_or_default();
        let stderr = stderr.map(join_output).unwrap_or_default();
        let status = match outcome {
            Ok(Some(status)) => status,
            Ok(None) => {
                tracing::warn!(device = %self.device, stderr = %tail(&stderr), "scrub child timed out, killed");
                return Err(ScrubError::Timeout {
                    device: self.device.clone(),
                    timeout: self.timeout,
                });
            }
            Err(e) => return Err(child_err(format!("wait: {e}"))),
        };
        let report = stdout
            .lines()
            .rev()
            .map(str::trim)
            .filter(|l| l.starts_with('{'))
            .find_map(|l| ScrubReport::from_json(l).ok());
        match report {
            Some(r) if r.device == self.device => {
                if status.success() != r.ok {
                    tracing::warn!(device = %self.device, %status, ok = r.ok, "scrub exit status and report disagree");
                }
                Ok(r)
            }
            Some(r) => Err(child_err(format!("report is for device {}", r.device))),
            None => Err(child_err(format!("{status} without a report; stderr: {}", tail(&stderr)))),
        }
    }
}

/// Spawn `<exe> scrub --device UUID --json` with `CUDA_VISIBLE_DEVICES=UUID`, read its
/// report, kill it (and its process group) after `timeout`.
pub fn run_scrub_child(
    exe: &Path,
    device_uuid: &str,
    timeout: Duration,
) -> Result<ScrubReport, ScrubError> {
    ScrubChild::new(exe, device_uuid, timeout).run()
}

fn read_limited<R: Read + Send + 'static>(mut r: R) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = (&mut r).take(OUTPUT_LIMIT).read_to_end(&mut buf);
        // Keep draining so the child never blocks on a full pipe.
        let _ = std::io::copy(&mut r, &mut std::io::sink());
        String::from_utf8_lossy(&buf).into_owned()
    })
}

fn join_output(h: JoinHandle<String>) -> String {
    h.join().unwrap_or_default()
}

fn tail(s: &str) -> &str {
    let s = s.trim_end();
    let mut start = s.len().saturating_sub(2000);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Wait for `child` until `timeout`; `Ok(None)` when it ran over and was killed. Either
/// way its process group is killed before the child is reaped: the unreaped child pins
/// its pid, so the group id can't have been reused by then, and any process it left
/// behind holding the output pipes goes too.
fn wait_with_timeout(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let pid = libc::pid_t::try_from(child.id()).map_err(std::io::Error::other)?;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    let exited = loop {
        if exited_unreaped(pid)? {
            break true;
        }
        let now = Instant::now();
        if now >= deadline {
            break false;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    };
    // SAFETY: kill(2) with a negative pid signals the process group the child leads; it
    // was created for this child (process_group(0)) and the child is not reaped yet.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let status = child.wait()?;
    Ok(exited.then_some(status))
}

/// Whether the child has exited, without reaping it (`waitid` with `WNOWAIT`).
fn exited_unreaped(pid: libc::pid_t) -> std::io::Result<bool> {
    // SAFETY: siginfo_t is plain data for which all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `info` is a valid siginfo_t to write into; `pid` is our own child.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    // SAFETY: waitid filled `info` (or left it zeroed when nothing changed); si_pid is
    // the field it sets for a child state change.
    Ok(unsafe { info.si_pid() } != 0)
}

// ---------------------------------------------------------------- `tessera scrub`

const SCRUB_USAGE: &str = "usage: tessera scrub --device UUID [--json] [--sim-mem FILE] \
                           [--sim-faults FILE] [--reserve-mib N]";

#[derive(Debug, Default, PartialEq)]
struct ScrubArgs {
    device: String,
    json: bool,
    sim_mem: Option<PathBuf>,
    sim_faults: Option<PathBuf>,
    reserve_mib: Option<u64>,
}

fn parse_scrub_args(args: &[String]) -> Result<ScrubArgs, String> {
    let mut out = ScrubArgs::default();
    let mut device = None;
    let mut it = args.iter().map(String::as_str).peekable();
    if it.peek() == Some(&"scrub") {
        it.next();
    }
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg, None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| it.next().map(str::to_string))
                .ok_or(format!("{name} needs a value"))
        };
        match flag {
            "--device" => device = Some(value("--device")?),
            "--json" => out.json = true,
            "--sim-mem" => out.sim_mem = Some(PathBuf::from(value("--sim-mem")?)),
            "--sim-faults" => out.sim_faults = Some(PathBuf::from(value("--sim-faults")?)),
            "--reserve-mib" => {
                let v = value("--reserve-mib")?;
                out.reserve_mib = Some(v.parse().map_err(|_| format!("bad --reserve-mib {v}"))?);
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    out.device = device.filter(|d| !d.is_empty()).ok_or("--device UUID is required")?;
    if out.sim_faults.is_some() && out.sim_mem.is_none() {
        return Err("--sim-faults needs --sim-mem".into());
    }
    Ok(out)
}

/// `tessera scrub`: scrub one device in this process and print the report (one JSON line
/// with `--json`). Exit code 0 only if the report is ok.
///
/// In CUDA mode this sets `CUDA_VISIBLE_DEVICES` to the device when it is not already,
/// so it must run before anything else in the process touches the driver (and before
/// other threads start reading the environment).
pub fn scrub_cli_main<I, S>(args: I) -> i32
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let args: Vec<String> = args.into_iter().map(Into::into).collect();
    let a = match parse_scrub_args(&args) {
        Ok(a) => a,
        Err(msg) => return usage(&msg, SCRUB_USAGE),
    };
    let (backend, result) = if let Some(mem) = &a.sim_mem {
        let s = SimScrubber::single_file(mem).with_faults_file(a.sim_faults.clone());
        (BACKEND_SIM, s.scrub(&a.device))
    } else {
        select_device(&a.device);
        let result = cuda_options(a.reserve_mib)
            .and_then(CudaScrubber::with_options)
            .and_then(|s| s.scrub(&a.device));
        (BACKEND_CUDA, result)
    };
    let report = result.unwrap_or_else(|e| ScrubReport::failed(&a.device, backend, e));
    if a.json {
        println!("{}", report.to_json_line());
    } else {
        println!("{report}");
    }
    let _ = std::io::stdout().flush();
    if report.ok {
        0
    } else {
        1
    }
}

fn usage(msg: &str, text: &str) -> i32 {
    if msg.is_empty() {
        println!("{text}");
        return 0;
    }
    eprintln!("error: {msg}\n{text}");
    2
}

fn cuda_options(reserve_mib: Option<u64>) -> Result<CudaOptions, ScrubError> {
    let mut opts = CudaOptions::default();
    if let Some(mib) = reserve_mib {
        opts.reserve_bytes =
            mib.checked_mul(1 << 20).ok_or(ScrubError::Usage("reserve too large".into()))?;
    }
    Ok(opts)
}

/// Point CUDA at `device` before the first driver call of this process.
fn select_device(device: &str) {
    if std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref() != Some(device) {
        std::env::set_var("CUDA_VISIBLE_DEVICES", device);
    }
}

// ---------------------------------------------------------------- `tessera gpu-bench`

const BENCH_USAGE: &str = concat!(
    "usage: tessera gpu-bench peak [--bytes N] [--reps N] [--device UUID] [--json]\n",
    "       tessera gpu-bench fill PATTERN [--device UUID] [--json]\n",
    "       tessera gpu-bench count PATTERN [--expect-zero] [--device UUID] [--json]\n",
    "PATTERN is a 32-bit word, decimal or 0x-hex, not 0. All take --reserve-mib N."
);

#[derive(Debug, PartialEq)]
enum BenchCmd {
    Peak { bytes: Option<u64>, reps: u32 },
    Fill { pattern: u32 },
    Count { pattern: u32, expect_zero: bool },
}

#[derive(Debug, PartialEq)]
struct BenchArgs {
    cmd: BenchCmd,
    device: Option<String>,
    json: bool,
    reserve_mib: Option<u64>,
}

fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn parse_pattern(s: Option<&str>) -> Result<u32, String> {
    let s = s.ok_or("PATTERN is required")?;
    let v = parse_u64(s).and_then(|v| u32::try_from(v).ok()).ok_or(format!("bad PATTERN {s}"))?;
    if v == 0 {
        return Err("PATTERN must not be 0 (zeroed memory would match it)".into());
    }
    Ok(v)
}

fn parse_bench_args(args: &[String]) -> Result<BenchArgs, String> {
    let mut it = args.iter().map(String::as_str).peekable();
    if it.peek() == Some(&"gpu-bench") {
        it.next();
    }
    let sub = it.next().ok_or("a subcommand is required")?;
    if matches!(sub, "-h" | "--help") {
        return Err(String::new());
    }
    let mut positional = Vec::new();
    let (mut bytes, mut reps, mut expect_zero) = (None, 5u32, false);
    let (mut device, mut json, mut reserve_mib) = (None, false, None);
    while let Some(arg) = it.next() {
        let mut value =
            |name: &str| it.next().map(str::to_string).ok_or(format!("{name} needs a value"));
        match arg {
            "--bytes" => {
                let v = value("--bytes")?;
                bytes = Some(parse_u64(&v).ok_or(format!("bad --bytes {v}"))?);
            }
            "--reps" => {
                let v = value("--reps")?;
                reps = v.parse().map_err(|_| format!("bad --reps {v}"))?;
            }
            "--reserve-mib" => {
                let v = value("--reserve-mib")?;
                reserve_mib = Some(v.parse().map_err(|_| format!("bad --reserve-mib {v}"))?);
            }
            "--device" => device = Some(value("--device")?),
            "--json" => json = true,
            "--expect-zero" => expect_zero = true,
            "-h" | "--help" => return Err(String::new()),
            a if a.starts_with("--") => return Err(format!("unexpected argument `{a}`")),
            a => positional.push(a.to_string()),
        }
    }
    let cmd = match sub {
        "peak" if positional.is_empty() => BenchCmd::Peak { bytes, reps },
        "fill" if positional.len() == 1 => {
            BenchCmd::Fill { pattern: parse_pattern(positional.first().map(String::as_str))? }
        }
        "count" if positional.len() == 1 => BenchCmd::Count {
            pattern: parse_pattern(positional.first().map(String::as_str))?,
            expect_zero,
        },
        "peak" | "fill" | "count" => return Err(format!("wrong arguments for {sub}")),
        other => return Err(format!("unknown subcommand `{other}`")),
    };
    Ok(BenchArgs { cmd, device, json, reserve_mib })
}

fn print_json<T: Serialize>(v: &T) {
    match serde_json::to_string(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: encode result: {e}"),
    }
}

/// `tessera gpu-bench`: the measurements for the lent GPU.
///
/// - `peak`: plain `cuMemsetD32` peak against the scrub on the same buffer, same run;
///   prints both and the ratio (acceptance: >= 0.8).
/// - `fill PATTERN`: fill all free memory with PATTERN and exit (leak test, process A).
/// - `count PATTERN`: allocate all free memory and count PATTERN words (process B);
///   with `--expect-zero`, exit 1 if any are found.
pub fn gpu_bench_main<I, S>(args: I) -> i32
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let args: Vec<String> = args.into_iter().map(Into::into).collect();
    let a = match parse_bench_args(&args) {
        Ok(a) => a,
        Err(msg) => return usage(&msg, BENCH_USAGE),
    };
    if let Some(d) = &a.device {
        select_device(d);
    }
    let scrubber = match cuda_options(a.reserve_mib).and_then(CudaScrubber::with_options) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let outcome = match a.cmd {
        BenchCmd::Peak { bytes, reps } => scrubber.memset_peak(bytes, reps).map(|r| {
            if a.json {
                print_json(&r);
            } else {
                println!("device: {} ({})", r.device_name, r.device_uuid);
                println!("buffer: {} in {} chunks, best of {} reps", human_bytes(r.bytes), r.chunks, r.reps);
                println!(
                    "plain cuMemsetD32 peak: {:.1} GB/s (async+events {:.1}, sync+wall {:.1})",
                    r.memset_peak_gbps, r.memset_async_gbps, r.memset_sync_gbps
                );
                println!("scrub zero pass:   {:.1} GB/s ({:.1}% of peak)", r.scrub_zero_gbps, r.zero_ratio * 100.0);
                println!("scrub verify pass: {:.1} GB/s", r.scrub_verify_gbps);
                println!(
                    "scrub (zeroed+verified bytes / time): {:.1} GB/s = {:.1}% of peak: target >= 80% {}",
                    r.scrub_gbps,
                    r.ratio * 100.0,
                    if r.ratio >= 0.8 { "MET" } else { "NOT MET" }
                );
                println!(
                    "bytes made clean per second: {:.1} GB/s ({:.1}% of peak; two passes)",
                    r.scrub_clean_gbps,
                    r.clean_ratio * 100.0
                );
                println!("non-zero words after the scrubs: {}", r.nonzero_words);
            }
            i32::from(r.nonzero_words != 0)
        }),
        BenchCmd::Fill { pattern } => scrubber.fill_pattern(pattern).map(|r| {
            if a.json {
                print_json(&r);
            } else {
                println!(
                    "filled {} of {} with {:#010x} in {} chunks ({:.2} s) on {}",
                    human_bytes(r.bytes_filled),
                    human_bytes(r.bytes_total),
                    r.pattern,
                    r.chunks,
                    r.seconds,
                    r.device_uuid
                );
            }
            0
        }),
        BenchCmd::Count { pattern, expect_zero } => scrubber.count_pattern(pattern).map(|r| {
            if a.json {
                print_json(&r);
            } else {
                println!(
                    "{} words of {:#010x} found in {} scanned ({:.4}% of the words) of {}, {} chunks, on {}",
                    r.matching_words,
                    r.pattern,
                    human_bytes(r.bytes_scanned),
                    if r.bytes_scanned > 0 { r.matching_words as f64 * 400.0 / r.bytes_scanned as f64 } else { 0.0 },
                    human_bytes(r.bytes_total),
                    r.chunks,
                    r.device_uuid
                );
            }
            i32::from(expect_zero && r.matching_words > 0)
        }),
    };
    let _ = std::io::stdout().flush();
    outcome.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        1
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// A shell script as a fake `tessera` binary.
    fn fake_exe(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("fake-tessera");
        // Written by a separate `sh`, not by this process: another test thread forking
        // while this one held the file open for writing would make exec fail with ETXTBSY.
        let status = Command::new("sh")
            .arg("-c")
            .arg("cat > \"$1\" && chmod 755 \"$1\"")
            .arg("sh")
            .arg(&path)
            .stdin(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .expect("stdin")
                    .write_all(format!("#!/bin/sh\n{body}\n").as_bytes())?;
                c.wait()
            })
            .unwrap();
        assert!(status.success());
        path
    }

    fn report_json(device: &str) -> String {
        ScrubReport { ok: true, error: None, ..ScrubReport::failed(device, "sim", "x") }
            .to_json_line()
    }

    #[test]
    fn scrub_args() {
        let a = parse_scrub_args(&strings(&["scrub", "--device", "GPU-1", "--json"])).unwrap();
        assert_eq!(a, ScrubArgs { device: "GPU-1".into(), json: true, ..ScrubArgs::default() });
        let a =
            parse_scrub_args(&strings(&["--device=MIG-2", "--sim-mem", "/m", "--sim-faults=/f"]))
                .unwrap();
        assert_eq!(a.device, "MIG-2");
        assert_eq!(a.sim_mem.as_deref(), Some(Path::new("/m")));
        assert_eq!(a.sim_faults.as_deref(), Some(Path::new("/f")));
        assert!(parse_scrub_args(&strings(&["--json"])).is_err());
        assert!(parse_scrub_args(&strings(&["--device"])).is_err());
        assert!(parse_scrub_args(&strings(&["--device", "x", "--bogus"])).is_err());
        assert!(parse_scrub_args(&strings(&["--device", "x", "--sim-faults", "f"])).is_err());
        assert_eq!(parse_scrub_args(&strings(&["--help"])), Err(String::new()));
    }

    #[test]
    fn bench_args() {
        let a =
            parse_bench_args(&strings(&["peak", "--bytes", "0x40000000", "--reps", "3"])).unwrap();
        assert_eq!(a.cmd, BenchCmd::Peak { bytes: Some(1 << 30), reps: 3 });
        let a =
            parse_bench_args(&strings(&["gpu-bench", "fill", "0xDEADBEEF", "--device", "GPU-1"]))
                .unwrap();
        assert_eq!(a.cmd, BenchCmd::Fill { pattern: 0xDEAD_BEEF });
        assert_eq!(a.device.as_deref(), Some("GPU-1"));
        let a = parse_bench_args(&strings(&["count", "1234", "--expect-zero", "--json"])).unwrap();
        assert_eq!(a.cmd, BenchCmd::Count { pattern: 1234, expect_zero: true });
        assert!(a.json);
        assert!(parse_bench_args(&strings(&["fill", "0"])).is_err());
        assert!(parse_bench_args(&strings(&["fill", "0x100000000"])).is_err());
        assert!(parse_bench_args(&strings(&["fill"])).is_err());
        assert!(parse_bench_args(&strings(&["peak", "extra"])).is_err());
        assert!(parse_bench_args(&strings(&["nope"])).is_err());
    }

    #[test]
    fn scrub_cli_sim_mode_zeroes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mem = dir.path().join("mem.bin");
        std::fs::write(&mem, vec![0x41u8; 64 * 1024]).unwrap();
        let code =
            scrub_cli_main(["--device", "GPU-1", "--json", "--sim-mem", mem.to_str().unwrap()]);
        assert_eq!(code, 0);
        assert!(std::fs::read(&mem).unwrap().iter().all(|&b| b == 0));
        // Faults via --sim-faults.
        let faults = dir.path().join("faults.json");
        std::fs::write(&faults, r#"{"devices":{"GPU-1":"leave_nonzero"}}"#).unwrap();
        let code = scrub_cli_main([
            "--device",
            "GPU-1",
            "--sim-mem",
            mem.to_str().unwrap(),
            "--sim-faults",
            faults.to_str().unwrap(),
        ]);
        assert_eq!(code, 1);
        assert_eq!(scrub_cli_main(["--bogus"]), 2);
    }

    #[test]
    fn scrub_cli_without_a_driver_fails_cleanly() {
        if crate::cuda::driver_present() {
            return;
        }
        assert_eq!(
            scrub_cli_main(["--device", "GPU-00000000-0000-0000-0000-000000000000", "--json"]),
            1
        );
        assert_eq!(gpu_bench_main(["peak"]), 1);
    }

    #[test]
    fn child_command_has_a_cleared_environment() {
        let c = ScrubChild::new(Path::new("/bin/tessera"), "MIG-1", Duration::from_secs(1))
            .sim(Path::new("/s/mem/MIG-1.bin"), Some(Path::new("/s/f.json")))
            .env("LD_LIBRARY_PATH", "/opt/nvidia");
        let cmd = c.command();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(
            args,
            [
                "scrub",
                "--device",
                "MIG-1",
                "--json",
                "--sim-mem",
                "/s/mem/MIG-1.bin",
                "--sim-faults",
                "/s/f.json"
            ]
        );
        let mut envs: Vec<_> = cmd
            .get_envs()
            .map(|(k, v)| {
                (k.to_string_lossy().into_owned(), v.map(|v| v.to_string_lossy().into_owned()))
            })
            .collect();
        envs.sort();
        let keys: Vec<&str> = envs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "PATH"]);
        assert_eq!(envs[0].1.as_deref(), Some("MIG-1"));
    }

    #[test]
    fn child_report_is_read_from_the_last_json_line() {
        let dir = tempfile::tempdir().unwrap();
        // The script also checks the environment it was given.
        let exe = fake_exe(
            dir.path(),
            &format!(
                "[ \"$CUDA_VISIBLE_DEVICES\" = GPU-1 ] || exit 9\n[ -z \"$HOME\" ] || exit 8\n\
                 echo noise\necho '{{not json'\necho '{}'\nexit 1",
                report_json("GPU-1")
            ),
        );
        let r = run_scrub_child(&exe, "GPU-1", Duration::from_secs(20)).unwrap();
        assert_eq!(r.device, "GPU-1");
        assert!(r.ok);
    }

    #[test]
    fn child_without_report_or_for_another_device_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let exe = fake_exe(dir.path(), "echo oops >&2\nexit 3");
        let e = run_scrub_child(&exe, "GPU-1", Duration::from_secs(20)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("without a report") && msg.contains("oops"), "{msg}");
        let exe = fake_exe(dir.path(), &format!("echo '{}'", report_json("GPU-2")));
        let e = run_scrub_child(&exe, "GPU-1", Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("another") || e.to_string().contains("GPU-2"), "{e}");
        let e = run_scrub_child(&dir.path().join("missing"), "GPU-1", Duration::from_secs(1))
            .unwrap_err();
        assert!(e.to_string().contains("spawn"), "{e}");
    }

    #[test]
    fn child_timeout_kills_the_child_and_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pids");
        // The shell starts a background sleeper that holds stdout open, then sleeps.
        let exe = fake_exe(
            dir.path(),
            &format!("sleep 300 &\necho $$ $! > {}\nsleep 300", pidfile.display()),
        );
        let started = Instant::now();
        let e = run_scrub_child(&exe, "GPU-1", Duration::from_millis(500)).unwrap_err();
        assert!(matches!(e, ScrubError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(20), "returned promptly");
        let pids = std::fs::read_to_string(&pidfile).unwrap();
        for pid in pids.split_whitespace() {
            let pid: libc::pid_t = pid.parse().unwrap();
            // Give the kernel a moment to reap the orphaned sleeper via init.
            let gone = (0..100).any(|_| {
                // SAFETY: signal 0 only checks whether the process exists.
                let alive = unsafe { libc::kill(pid, 0) } == 0
                    && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .map(|s| s.contains(") Z "))
                        .unwrap_or(true);
                if alive {
                    std::thread::sleep(Duration::from_millis(20));
                }
                !alive
            });
            assert!(gone, "process {pid} survived the timeout");
        }
    }

    /// Not a test of its own: the body of a scrub child when a test below re-runs this
    /// test binary through a wrapper script, so the real `scrub_cli_main` runs in a real
    /// child process with the environment `ScrubChild` gives it.
    #[test]
    fn child_entry() {
        let Ok(args) = std::env::var("SCRUB_TEST_CHILD_ARGS") else { return };
        let code = scrub_cli_main(args.split(' ').filter(|a| !a.is_empty()));
        std::process::exit(code);
    }

    /// A fake `tessera` that runs [`child_entry`] in this test binary.
    fn self_exe(dir: &Path) -> PathBuf {
        let me = std::env::current_exe().unwrap();
        fake_exe(
            dir,
            &format!(
                "SCRUB_TEST_CHILD_ARGS=\"$*\" exec '{}' --exact child::tests::child_entry \
                 --nocapture --quiet --test-threads=1",
                me.display()
            ),
        )
    }

    #[test]
    fn real_child_scrubs_sim_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mem = dir.path().join("mem.bin");
        std::fs::write(&mem, b"TENANT-A-SECRET!".repeat(4096)).unwrap();
        let exe = self_exe(dir.path());
        let r =
            ScrubChild::new(&exe, "MIG-1", Duration::from_secs(60)).sim(&mem, None).run().unwrap();
        assert!(r.ok, "{r}");
        assert_eq!(r.bytes_covered, 16 * 4096);
        assert!(std::fs::read(&mem).unwrap().iter().all(|&b| b == 0));

        // A stuck word injected through the faults file: a report that says so.
        let faults = dir.path().join("faults.json");
        std::fs::write(&faults, r#"{"devices":{"MIG-1":"leave_nonzero"}}"#).unwrap();
        let r = ScrubChild::new(&exe, "MIG-1", Duration::from_secs(60))
            .sim(&mem, Some(&faults))
            .run()
            .unwrap();
        assert!(!r.ok);
        assert_eq!(r.nonzero_words, 1);

        // An injected error: still a report (ok false, the error in it).
        std::fs::write(&faults, r#"{"devices":{"MIG-1":"error"}}"#).unwrap();
        let r = ScrubChild::new(&exe, "MIG-1", Duration::from_secs(60))
            .sim(&mem, Some(&faults))
            .run()
            .unwrap();
        assert!(!r.ok);
        assert!(r.error.unwrap().contains("injected"));
    }

    #[test]
    fn real_child_hang_is_killed_on_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let mem = dir.path().join("mem.bin");
        std::fs::write(&mem, [1u8; 64]).unwrap();
        let faults = dir.path().join("faults.json");
        std::fs::write(&faults, r#"{"devices":{"MIG-1":"hang"}}"#).unwrap();
        let started = Instant::now();
        let e = ScrubChild::new(&self_exe(dir.path()), "MIG-1", Duration::from_secs(2))
            .sim(&mem, Some(&faults))
            .run()
            .unwrap_err();
        assert!(matches!(e, ScrubError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30));
        assert_eq!(std::fs::read(&mem).unwrap(), [1u8; 64], "the hung scrub never ran");
    }

    #[test]
    fn child_gets_the_sim_arguments_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let exe = fake_exe(
            dir.path(),
            &format!(
                "[ \"$5\" = --sim-mem ] && [ \"$6\" = /m ] || exit 7\necho '{}'",
                report_json("GPU-1")
            ),
        );
        let r = ScrubChild::new(&exe, "GPU-1", Duration::from_secs(20))
            .sim(Path::new("/m"), None)
            .run()
            .unwrap();
        assert!(r.ok);
    }
}
