//! `tessera policy revoke-check`: the running grants the policy in force would refuse now,
//! and (`--stop`) stopping them. The work is tesserad's (`GET /v1/revoke-check`, `POST
//! /v1/revoke-check/stop`); this file parses and prints.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use clap::Args;
use tessera_api::untrusted;
use tesserad::node::revoke::{
    Refused, RevokeCheck, StopOutcome, StopReport, StopRequest, DEFAULT_GRACE_S, MAX_GRACE_S,
};

/// `tessera policy revoke-check` flags.
#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// Stop them: SIGTERM to each container's init, SIGKILL after the grace period. Their
    /// grants are released once the container is removed (as every grant).
    #[arg(long)]
    stop: bool,
    /// With --stop: seconds between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = DEFAULT_GRACE_S, value_parser = clap::value_parser!(u64).range(0..=MAX_GRACE_S), requires = "stop")]
    grace: u64,
    /// With --stop: only this container (repeatable); each must be refused by the policy.
    #[arg(long = "container", value_name = "ID", requires = "stop")]
    containers: Vec<String>,
    /// Print tesserad's JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(socket: &Path, args: RevokeArgs) -> Result<(), String> {
    let client = tessera_api::Client::new(socket)
        // A stop answers after the grace period and at most 5 s more.
        .with_timeout(Duration::from_secs(args.grace + 60));
    let explain = |e: tessera_api::ClientError| match e.api_error() {
        Some(a)
            if a.code == tessera_api::ErrorCode::NotFound && a.message == "no such endpoint" =>
        {
            "this tesserad has no revoke-check (it predates it)".to_string()
        }
        _ => e.to_string(),
    };
    if !args.stop {
        let check: RevokeCheck =
            client.call::<(), _>("GET", "/v1/revoke-check", None).map_err(explain)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&check).map_err(|e| e.to_string())?);
        } else {
            print!("{}", render_check(&check));
        }
        return Ok(());
    }
    let req = StopRequest { grace_s: Some(args.grace), containers: args.containers };
    let report: StopReport =
        client.call("POST", "/v1/revoke-check/stop", Some(&req)).map_err(explain)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render_stop(&report));
    }
    let failed = report.stopped.iter().filter(|s| s.outcome == StopOutcome::Failed).count();
    if failed > 0 {
        return Err(format!("{failed} container(s) could not be stopped (see above)"));
    }
    Ok(())
}

/// One refused grant: a line of facts, then the refusal.
fn refused_lines(out: &mut String, r: &Refused) {
    let state = match r.pid {
        Some(pid) => format!("{} pid {pid}", state_name(r)),
        None => state_name(r).to_string(),
    };
    let pod = r
        .workload
        .as_ref()
        .map(|w| format!(" pod {}/{}", untrusted(&w.namespace), untrusted(&w.pod)))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "{}  {}  tenant {} (trust {})  request {}{pod}\n  refused by {}: {}",
        untrusted(&r.container_id),
        state,
        untrusted(&r.tenant),
        untrusted(&r.trust),
        untrusted(&r.request),
        untrusted(&r.rule),
        untrusted(&r.message).max_chars(1024)
    );
}

fn state_name(r: &Refused) -> &'static str {
    match r.state {
        tessera_api::AllocationState::Running => "running",
        tessera_api::AllocationState::Pending => "pending",
    }
}

pub fn render_check(c: &RevokeCheck) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "policy v{} ({}, sha256 {}) refuses {} of {} grant{}",
        c.policy_version,
        untrusted(&c.policy_source),
        c.policy_digest.chars().take(12).collect::<String>(),
        c.refused.len(),
        c.checked,
        if c.checked == 1 { "" } else { "s" }
    );
    for r in &c.refused {
        refused_lines(&mut out, r);
    }
    if !c.refused.is_empty() {
        let _ =
            writeln!(out, "stop them with: tessera policy revoke-check --stop [--grace SECONDS]");
    }
    out
}

pub fn render_stop(r: &StopReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "policy v{}: stopping {} container{} (SIGTERM, SIGKILL after {} s)",
        r.policy_version,
        r.stopped.len(),
        if r.stopped.len() == 1 { "" } else { "s" },
        r.grace_s
    );
    for s in &r.stopped {
        refused_lines(&mut out, &s.refused);
        let outcome = match s.outcome {
            StopOutcome::Terminated => "terminated",
            StopOutcome::Killed => "killed",
            StopOutcome::AlreadyGone => "already gone",
            StopOutcome::Skipped => "skipped",
            StopOutcome::Failed => "FAILED",
        };
        let _ = writeln!(out, "  {outcome}: {}", untrusted(&s.detail).max_chars(1024));
    }
    if r.stopped.iter().any(|s| matches!(s.outcome, StopOutcome::Terminated | StopOutcome::Killed))
    {
        let _ = writeln!(
            out,
            "their grants are released once their containers are removed (the engine's delete, or the reconciler)"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(id: &str) -> Refused {
        Refused {
            container_id: id.into(),
            tenant: "acme/trusted/training/alice".into(),
            trust: "trusted".into(),
            request: "gpu=1".into(),
            state: tessera_api::AllocationState::Running,
            pid: Some(42),
            workload: None,
            rule: "tiers.trusted.allow".into(),
            message: "tenant acme/trusted/training/alice (trust trusted) may not use gpu isolation"
                .into(),
        }
    }

    #[test]
    fn a_check_names_container_tenant_request_rule_and_message_escaped() {
        let mut r = refused("c1");
        r.message.push_str("\x1b[2J\nforged line");
        let text = render_check(&RevokeCheck {
            policy_version: 2,
            policy_digest: "abcdef0123456789".into(),
            policy_source: "file:/etc/p.json".into(),
            checked: 3,
            refused: vec![r],
        });
        assert!(
            text.starts_with(
                "policy v2 (file:/etc/p.json, sha256 abcdef012345) refuses 1 of 3 grants\n"
            ),
            "{text}"
        );
        for needle in [
            "c1  running pid 42",
            "tenant acme/trusted/training/alice (trust trusted)",
            "request gpu=1",
            "refused by tiers.trusted.allow: tenant",
        ] {
            assert!(text.contains(needle), "{needle:?} in {text}");
        }
        assert!(!text.contains('\x1b') && !text.contains("\nforged line"), "{text:?}");
    }

    #[test]
    fn a_stop_says_what_happened_to_each() {
        let text = render_stop(&StopReport {
            policy_version: 2,
            grace_s: 30,
            stopped: vec![
                tesserad::node::revoke::Stopped {
                    refused: refused("a"),
                    outcome: StopOutcome::Terminated,
                    detail: "its init (pid 42) exited 0.2 s after SIGTERM".into(),
                },
                tesserad::node::revoke::Stopped {
                    refused: refused("b"),
                    outcome: StopOutcome::Killed,
                    detail: "its init (pid 43) still ran 30 s after SIGTERM: SIGKILL".into(),
                },
            ],
        });
        assert!(text.contains("stopping 2 containers (SIGTERM, SIGKILL after 30 s)"), "{text}");
        assert!(
            text.contains("  terminated: its init (pid 42) exited 0.2 s after SIGTERM"),
            "{text}"
        );
        assert!(text.contains("  killed: its init (pid 43)"), "{text}");
        assert!(text.contains("released once their containers are removed"), "{text}");
    }
}
