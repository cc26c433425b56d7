//! `tessera doctor`: what the node's engines, tessera-runtime's configurations and the
//! policy make of a container together, decided here without running one.
//!
//! For every Tessera runtime an engine is configured with (Docker's daemon.json
//! `runtimes`, podman's `[engine.runtimes]`, containerd's CRI handlers), the runtime
//! configuration it reads ([`runtime_hook::config`]) says which engine it reports
//! (`tessera.io/engine`); with the annotations that engine itself sets (containerd's CRI:
//! `io.kubernetes.cri.sandbox-namespace`), the policy's identity rules are walked as
//! [`policy::Policy::resolve_identity`] walks them, and the report says which rule a
//! container meets and which tenant it lands on. The traps (each a [`Kind::Identity`] or
//! [`Kind::Config`] finding of [`Severity::Trap`]):
//!
//! - a rule reading `tessera.io/engine` placed before the CRI rule, without `engines`, and
//!   the CRI handler's configuration naming an engine that rule does not map: every pod is
//!   refused;
//! - the CRI rule limited to `engines` that the handler's configuration does not name:
//!   every pod is billed to `default_tenant` (or refused without one);
//! - a runtime no rule identifies and no `default_tenant`: every GPU request through it is
//!   refused (Docker and podman set no identity of their own);
//! - a runtime configuration that does not parse: every GPU request through it fails.
//!
//! NVIDIA container toolkit remnants (its runtimes, default runtime, hooks, CDI specs:
//! [`Kind::Nvidia`]) are traps too — GPUs stay reachable outside the policy — which
//! `tessera setup --replace-nvidia` removes. Pure: the command line reads the files.

use std::fmt::Write as _;

use policy::Policy;
use runtime_hook::config::{RuntimeConfig, ENGINE_ANNOTATION};
use tessera_api::cri::SANDBOX_NAMESPACE;
use tessera_api::untrusted;

/// A container engine that runs tessera-runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Engine {
    Docker,
    Podman,
    /// containerd's CRI plugin (kubelet's engine).
    Containerd,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Docker => "docker",
            Engine::Podman => "podman",
            Engine::Containerd => "containerd",
        }
    }

    /// Whether whoever starts a container may write any annotation into its config:
    /// podman's `--annotation` (Docker 20.10 has none; containerd's CRI handler passes only
    /// `tessera.io/gpu*` from pods).
    fn users_set_annotations(self) -> bool {
        matches!(self, Engine::Podman)
    }
}

/// One Tessera runtime of an engine, with the runtime configuration it reads.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub engine: Engine,
    /// The runtime's name (`--runtime NAME`, the CRI handler).
    pub name: String,
    /// The file the configuration came from (for messages).
    pub config_file: String,
    /// The configuration, or why it cannot be read (tessera-runtime refuses GPU requests then).
    pub config: Result<RuntimeConfig, String>,
    /// The engine's default runtime.
    pub is_default: bool,
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Ok,
    Warning,
    Trap,
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Who a container is.
    Identity,
    /// A runtime configuration.
    Config,
    /// NVIDIA's container toolkit, still configured.
    Nvidia,
    /// The kernel's settings the runtime's checks depend on.
    Kernel,
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    pub kind: Kind,
    /// What it is about (`docker runtime tessera`, a file).
    pub subject: String,
    pub text: String,
}

/// Every finding, in the order found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub findings: Vec<Finding>,
}

impl Report {
    /// The traps.
    pub fn traps(&self) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(|f| f.severity == Severity::Trap)
    }

    /// The traps `tessera setup` refuses to write: identity and configuration (NVIDIA's
    /// remnants are `--replace-nvidia`'s, and only warned of without it).
    pub fn setup_traps(&self) -> impl Iterator<Item = &Finding> {
        self.traps().filter(|f| f.kind != Kind::Nvidia)
    }

    /// One line per finding: `ok`, `warning` or `TRAP`, the subject, what it means.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for f in &self.findings {
            let mark = match f.severity {
                Severity::Ok => "ok     ",
                Severity::Warning => "warning",
                Severity::Trap => "TRAP   ",
            };
            let _ = writeln!(out, "{mark} {}: {}", f.subject, f.text);
        }
        let traps = self.traps().count();
        let _ = match traps {
            0 => writeln!(out, "no traps"),
            n => writeln!(out, "{n} trap{}", if n == 1 { "" } else { "s" }),
        };
        out
    }
}

fn finding(severity: Severity, kind: Kind, subject: &str, text: String) -> Finding {
    Finding { severity, kind, subject: subject.to_owned(), text }
}

/// How the identity walk ends for a runtime's containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Rule `index` reads an annotation the engine always sets (the CRI namespace):
    /// its map decides, an unmapped value is refused.
    ByValue { index: usize, annotation: String },
    /// Rule `index` maps this runtime's engine to `tenant`.
    Engine { index: usize, tenant: String },
    /// Rule `index` reads this runtime's engine and does not map it: refused.
    EngineUnmapped { index: usize, engine: String },
    /// No rule applies: the default tenant.
    Default { tenant: String },
    /// No rule applies and there is no default tenant: refused.
    Refused,
}

/// What the rules decide for containers of `engine` whose runtime reports `engine_name`
/// (and, for containerd's CRI, carry a pod namespace), as
/// [`Policy::resolve_identity`] decides; also the rules skipped because of their
/// `engines` that read an annotation the engine sets, and the rules that read an
/// annotation users of the engine may set themselves.
pub fn decide(
    policy: &Policy,
    engine: Engine,
    engine_name: Option<&str>,
) -> (Decision, Vec<usize>, Vec<usize>) {
    let mut skipped = Vec::new();
    let mut user_set = Vec::new();
    for (i, (annotation, map, engines)) in policy.identity_rules().enumerate() {
        let sets_it = annotation == SANDBOX_NAMESPACE && engine == Engine::Containerd;
        if let Some(engines) = engines {
            if !engine_name.is_some_and(|e| engines.iter().any(|x| x == e)) {
                if sets_it {
                    skipped.push(i);
                }
                continue;
            }
        }
        if annotation == ENGINE_ANNOTATION {
            let Some(e) = engine_name else { continue };
            let decision = match map.get(e) {
                Some(t) => Decision::Engine { index: i, tenant: t.clone() },
                None => Decision::EngineUnmapped { index: i, engine: e.to_owned() },
            };
            return (decision, skipped, user_set);
        }
        if sets_it {
            return (
                Decision::ByValue { index: i, annotation: annotation.to_owned() },
                skipped,
                user_set,
            );
        }
        if engine.users_set_annotations() {
            user_set.push(i);
        }
    }
    let decision = match policy.default_tenant() {
        Some(t) => Decision::Default { tenant: t.to_owned() },
        None => Decision::Refused,
    };
    (decision, skipped, user_set)
}

fn engines_list(engines: Option<&[String]>) -> String {
    engines.map(|e| format!("[{}]", e.join(", "))).unwrap_or_default()
}

fn tenant_with_trust(policy: &Policy, path: &str) -> String {
    match policy.tenant(path) {
        Some(t) => format!("{path} (trust {})", t.trust),
        None => path.to_owned(),
    }
}

/// What Yama's `ptrace_scope` (as [`runtime_hook::spec::read_ptrace_scope`] read it;
/// `None`: no Yama) means for containers without a GPU that see the host's processes
/// ([`runtime_hook::spec::check_process_view`]): a warning where tessera-runtime refuses
/// them (node monitoring pods: `hostPID`, a `/proc` bind), nothing where it runs them.
pub fn kernel_findings(ptrace_scope: Option<u32>) -> Vec<Finding> {
    if ptrace_scope.is_some_and(|s| s >= 1) {
        return Vec::new();
    }
    let now = match ptrace_scope {
        Some(s) => format!("kernel.yama.ptrace_scope is {s}"),
        None => "this kernel has no Yama ptrace_scope".into(),
    };
    vec![finding(
        Severity::Warning,
        Kind::Kernel,
        "kernel",
        format!(
            "{now}: containers without a GPU that see the host's processes (hostPID, --pid=host, \
             a bind of /proc: node-exporter and other monitoring pods) are refused, since they \
             could attach to a GPU container's process; set kernel.yama.ptrace_scope=1 to run \
             them (docs/INSTALL.md)"
        ),
    )]
}

/// The report for `runtimes` under `policy` (`None`: no policy found, identity not
/// checked), with the NVIDIA toolkit findings `nvidia` appended.
pub fn diagnose(policy: Option<&Policy>, runtimes: &[Runtime], nvidia: Vec<Finding>) -> Report {
    let mut findings = Vec::new();
    if runtimes.is_empty() {
        findings.push(finding(
            Severity::Warning,
            Kind::Config,
            "engines",
            "no engine is configured to run tessera-runtime (`tessera setup docker|podman|containerd`)"
                .into(),
        ));
    }
    for rt in runtimes {
        let subject = format!(
            "{} runtime `{}`{}",
            rt.engine.name(),
            untrusted(&rt.name),
            if rt.is_default { " (the default)" } else { "" }
        );
        let cfg = match &rt.config {
            Ok(c) => c,
            Err(e) => {
                findings.push(finding(
                    Severity::Trap,
                    Kind::Config,
                    &subject,
                    format!(
                        "its runtime configuration cannot be used, so every GPU request through it \
                         fails (containers without one still run): {}",
                        untrusted(e).max_chars(1024)
                    ),
                ));
                continue;
            }
        };
        let engine_name = cfg.engine.as_deref();
        let about = format!(
            "reads {} ({})",
            untrusted(&rt.config_file),
            match engine_name {
                Some(e) => format!("engine `{e}`"),
                None => "no engine".into(),
            }
        );
        match (rt.engine, cfg.kubelet) {
            (Engine::Containerd, false) => findings.push(finding(
                Severity::Warning,
                Kind::Config,
                &subject,
                format!(
                    "{about} without `kubelet = true`: the device plugin's assignments are refused \
                     through this handler (`tessera setup containerd` writes the handler's own file)"
                ),
            )),
            (Engine::Docker | Engine::Podman, true) => findings.push(finding(
                Severity::Trap,
                Kind::Config,
                &subject,
                format!(
                    "{about} with `kubelet = true`, which only containerd's CRI handler may have: a \
                     {} user's container would be read as kubelet's",
                    rt.engine.name()
                ),
            )),
            _ => {}
        }
        let Some(policy) = policy else {
            findings.push(finding(Severity::Ok, Kind::Config, &subject, about));
            continue;
        };
        let (decision, skipped, user_set) = decide(policy, rt.engine, engine_name);
        let rules: Vec<_> = policy.identity_rules().collect();
        for i in &user_set {
            let (annotation, _, engines) = rules[*i];
            findings.push(finding(
                Severity::Warning,
                Kind::Identity,
                &subject,
                format!(
                    "identity[{i}] reads {annotation}{}, which a {} user sets with --annotation: \
                     whoever runs {} here picks among its tenants (fine where only root does; \
                     else give identity[{i}] `engines` without `{}`)",
                    match engines {
                        Some(e) => format!(" for engines {}", engines_list(Some(e))),
                        None => String::new(),
                    },
                    rt.engine.name(),
                    rt.engine.name(),
                    engine_name.unwrap_or("this engine")
                ),
            ));
        }
        let f = match decision {
            Decision::ByValue { index, annotation } => {
                let map = rules[index].1;
                let shown: Vec<String> = map
                    .iter()
                    .take(8)
                    .map(|(v, t)| format!("{v} -> {}", tenant_with_trust(policy, t)))
                    .collect();
                finding(
                    Severity::Ok,
                    Kind::Identity,
                    &subject,
                    format!(
                        "{about}; a pod meets identity[{index}] ({annotation}): {}{}; other namespaces are refused",
                        shown.join(", "),
                        if map.len() > 8 { format!(" and {} more", map.len() - 8) } else { String::new() }
                    ),
                )
            }
            Decision::Engine { index, tenant } => finding(
                Severity::Ok,
                Kind::Identity,
                &subject,
                format!(
                    "{about}; a container meets identity[{index}] ({ENGINE_ANNOTATION}) and lands on {}",
                    tenant_with_trust(policy, &tenant)
                ),
            ),
            Decision::EngineUnmapped { index, engine } => {
                let mapped: Vec<&str> = rules[index].1.keys().map(String::as_str).collect();
                finding(
                    Severity::Trap,
                    Kind::Identity,
                    &subject,
                    format!(
                        "{about}; identity[{index}] reads {ENGINE_ANNOTATION} for every engine and \
                         does not map `{engine}`: every GPU container through this runtime is refused \
                         (\"trusted annotation {ENGINE_ANNOTATION} has value \"{engine}\", which \
                         identity[{index}].map does not map to any tenant\"); give identity[{index}] \
                         `\"engines\": [{}]` (the engines it maps), or map `{engine}`",
                        mapped.iter().map(|m| format!("\"{m}\"")).collect::<Vec<_>>().join(", ")
                    ),
                )
            }
            Decision::Default { tenant } if rt.engine == Engine::Containerd => {
                let why = match skipped.first() {
                    Some(i) => format!(
                        "identity[{i}] ({SANDBOX_NAMESPACE}) is limited to engines {}, which this \
                         handler's configuration does not name, so pods skip it",
                        engines_list(rules[*i].2)
                    ),
                    None => format!("no identity rule reads {SANDBOX_NAMESPACE}"),
                };
                let fix = match skipped.first().and_then(|i| rules[*i].2).and_then(|e| e.first()) {
                    Some(e) => format!("add `engine = \"{e}\"` to {}", untrusted(&rt.config_file)),
                    None => format!("add a rule reading {SANDBOX_NAMESPACE}"),
                };
                finding(
                    Severity::Trap,
                    Kind::Identity,
                    &subject,
                    format!(
                        "{about}; {why}: every pod, whatever its namespace, is billed to the \
                         default tenant {}; {fix}",
                        tenant_with_trust(policy, &tenant)
                    ),
                )
            }
            Decision::Default { tenant } => finding(
                Severity::Ok,
                Kind::Identity,
                &subject,
                format!(
                    "{about}; no identity rule applies, so a container lands on default_tenant {}",
                    tenant_with_trust(policy, &tenant)
                ),
            ),
            Decision::Refused => {
                let fix = match rt.engine {
                    Engine::Containerd => match skipped.first().and_then(|i| rules[*i].2) {
                        Some(e) => format!(
                            "identity[{}] is limited to engines {}: add `engine = \"{}\"` to {}",
                            skipped[0],
                            engines_list(Some(e)),
                            e.first().map(String::as_str).unwrap_or(""),
                            untrusted(&rt.config_file)
                        ),
                        None => format!("add a rule reading {SANDBOX_NAMESPACE}"),
                    },
                    Engine::Docker | Engine::Podman => format!(
                        "{} sets no identity of its own: give the policy a `default_tenant`, or this \
                         runtime an `engine` in its configuration and a {ENGINE_ANNOTATION} rule mapping it",
                        rt.engine.name()
                    ),
                };
                finding(
                    Severity::Trap,
                    Kind::Identity,
                    &subject,
                    format!(
                        "{about}; no identity rule applies and the policy has no default_tenant: every \
                         GPU request through this runtime is refused; {fix}"
                    ),
                )
            }
        };
        findings.push(f);
    }
    if policy.is_none() && !runtimes.is_empty() {
        findings.push(finding(
            Severity::Warning,
            Kind::Identity,
            "policy",
            "no policy found (--policy, /etc/tessera/policy.json, or the file tesserad enforces): \
             identity not checked"
                .into(),
        ));
    }
    findings.extend(nvidia);
    Report { findings }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use std::collections::BTreeMap;

    fn example() -> Value {
        serde_json::from_str(include_str!("../examples/policy.json")).expect("example policy")
    }

    fn parse(v: &Value) -> Policy {
        Policy::parse(v.to_string().as_bytes(), "policy.json").expect("valid")
    }

    fn rt(engine: Engine, name: &str, cfg: &str) -> Runtime {
        Runtime {
            engine,
            name: name.into(),
            config_file: format!("/cfg/{name}.toml"),
            config: runtime_hook::config::parse(cfg, "f").map_err(|e| e.to_string()),
            is_default: false,
        }
    }

    fn traps(r: &Report) -> Vec<String> {
        r.traps().map(|f| format!("{}: {}", f.subject, f.text)).collect()
    }

    /// The walk agrees with what tesserad decides, for every engine and engine name here.
    fn agrees(policy: &Policy, engine: Engine, engine_name: Option<&str>) {
        let mut a = BTreeMap::new();
        if let Some(e) = engine_name {
            a.insert(ENGINE_ANNOTATION.to_string(), e.to_string());
        }
        if engine == Engine::Containerd {
            a.insert(SANDBOX_NAMESPACE.to_string(), "doctor-probe".to_string());
        }
        let real = policy.resolve_identity(&a);
        let (d, _, _) = decide(policy, engine, engine_name);
        match (&d, &real) {
            (
                Decision::ByValue { annotation, .. },
                Err(policy::IdentityError::Unmapped { annotation: a, .. }),
            ) => {
                assert_eq!(annotation, a)
            }
            (
                Decision::EngineUnmapped { .. },
                Err(policy::IdentityError::Unmapped { annotation, .. }),
            ) => {
                assert_eq!(annotation, ENGINE_ANNOTATION)
            }
            (Decision::Engine { tenant, .. } | Decision::Default { tenant }, Ok(t)) => {
                assert_eq!(tenant, &t.path)
            }
            (Decision::Refused, Err(policy::IdentityError::NoIdentity { .. })) => {}
            _ => panic!("doctor says {d:?}, tesserad {real:?}"),
        }
    }

    #[test]
    fn a_kernel_without_yama_is_a_warning_naming_the_sysctl() {
        for scope in [None, Some(0)] {
            let f = kernel_findings(scope);
            assert_eq!(f.len(), 1, "{scope:?}");
            assert_eq!((f[0].severity, f[0].kind), (Severity::Warning, Kind::Kernel));
            assert!(f[0].text.contains("kernel.yama.ptrace_scope=1"), "{}", f[0].text);
            assert!(f[0].text.contains("hostPID"), "{}", f[0].text);
        }
        assert!(kernel_findings(Some(1)).is_empty());
        assert!(kernel_findings(Some(3)).is_empty());
        let r = Report { findings: kernel_findings(None) };
        assert!(r.render().ends_with("no traps\n"), "a warning is no trap: {}", r.render());
    }

    #[test]
    fn the_example_policy_traps_no_engine() {
        let p = parse(&example());
        let runtimes = [
            rt(Engine::Docker, "tessera", ""),
            rt(Engine::Podman, "tessera", ""),
            rt(Engine::Containerd, "tessera", "kubelet = true"),
        ];
        let r = diagnose(Some(&p), &runtimes, Vec::new());
        assert!(traps(&r).is_empty(), "{}", r.render());
        let text = r.render();
        assert!(
            text.contains("default_tenant acme/untrusted/sandbox/guest (trust untrusted)"),
            "{text}"
        );
        assert!(
            text.contains("team-trusted -> acme/trusted/training/alice (trust trusted)"),
            "{text}"
        );
        // podman users can write the CRI annotation: said, not a trap.
        assert!(text.contains("warning podman runtime `tessera`: identity[0] reads"), "{text}");
        for (e, n) in
            [(Engine::Docker, None), (Engine::Podman, Some("x")), (Engine::Containerd, None)]
        {
            agrees(&p, e, n);
        }
    }

    /// INSTALL's hardening followed halfway: the handler names its engine, an engine rule
    /// for Docker comes first without `engines`: every pod refused.
    #[test]
    fn an_engine_rule_before_the_cri_rule_that_does_not_map_the_handlers_engine_is_a_trap() {
        let mut v = example();
        v["identity"].as_array_mut().unwrap().insert(
            0,
            json!({"annotation": ENGINE_ANNOTATION, "map": {"docker-alice": "acme/trusted/training/alice"}}),
        );
        let p = parse(&v);
        let cri = rt(Engine::Containerd, "tessera", "kubelet = true\nengine = \"containerd-k8s\"");
        let r = diagnose(Some(&p), std::slice::from_ref(&cri), Vec::new());
        let t = traps(&r);
        assert_eq!(t.len(), 1, "{}", r.render());
        assert!(
            t[0].contains("does not map `containerd-k8s`")
                && t[0].contains("\"engines\": [\"docker-alice\"]"),
            "{}",
            t[0]
        );
        agrees(&p, Engine::Containerd, Some("containerd-k8s"));
        // The cure the message names: the engine rule limited to the engines it maps.
        v["identity"][0]["engines"] = json!(["docker-alice"]);
        let p = parse(&v);
        let r = diagnose(Some(&p), &[cri], Vec::new());
        assert!(traps(&r).is_empty(), "{}", r.render());
        agrees(&p, Engine::Containerd, Some("containerd-k8s"));
    }

    /// The reverse: `engines` on the CRI rule, no `engine` in the handler's file: pods
    /// silently billed to the default tenant (or refused without one).
    #[test]
    fn a_cri_rule_limited_to_an_engine_the_handler_does_not_name_is_a_trap() {
        let mut v = example();
        v["identity"][0]["engines"] = json!(["containerd-k8s"]);
        v["default_tenant"] = json!("acme/untrusted/sandbox/guest");
        let p = parse(&v);
        let cri = rt(Engine::Containerd, "tessera", "kubelet = true");
        let r = diagnose(Some(&p), std::slice::from_ref(&cri), Vec::new());
        let t = traps(&r);
        assert_eq!(t.len(), 1, "{}", r.render());
        assert!(
            t[0].contains("billed to the default tenant acme/untrusted/sandbox/guest")
                && t[0].contains("add `engine = \"containerd-k8s\"` to /cfg/tessera.toml"),
            "{}",
            t[0]
        );
        agrees(&p, Engine::Containerd, None);
        v.as_object_mut().unwrap().remove("default_tenant");
        let p = parse(&v);
        let t = traps(&diagnose(Some(&p), std::slice::from_ref(&cri), Vec::new()));
        assert!(t[0].contains("every GPU request through this runtime is refused"), "{}", t[0]);
        agrees(&p, Engine::Containerd, None);
        // Named: no trap.
        let named =
            rt(Engine::Containerd, "tessera", "kubelet = true\nengine = \"containerd-k8s\"");
        let r = diagnose(Some(&p), &[named], Vec::new());
        assert!(traps(&r).is_empty(), "{}", r.render());
    }

    #[test]
    fn docker_and_podman_without_a_default_tenant_are_refused_and_said_so() {
        let mut v = example();
        v.as_object_mut().unwrap().remove("default_tenant");
        let p = parse(&v);
        for e in [Engine::Docker, Engine::Podman] {
            let r = diagnose(Some(&p), &[rt(e, "tessera", "")], Vec::new());
            let t = traps(&r);
            assert_eq!(t.len(), 1, "{}", r.render());
            assert!(t[0].contains("give the policy a `default_tenant`"), "{}", t[0]);
            agrees(&p, e, None);
        }
    }

    #[test]
    fn a_broken_runtime_configuration_and_kubelet_outside_the_cri_handler_are_traps() {
        let p = parse(&example());
        let r = diagnose(
            Some(&p),
            &[
                rt(Engine::Docker, "tessera", "sockt = \"/x\""),
                rt(Engine::Podman, "p", "kubelet = true"),
            ],
            Vec::new(),
        );
        let t = traps(&r);
        assert_eq!(t.len(), 2, "{}", r.render());
        assert!(
            t[0].contains("unknown key `sockt`") && t[0].contains("every GPU request"),
            "{}",
            t[0]
        );
        assert!(t[1].contains("only containerd's CRI handler"), "{}", t[1]);
        assert_eq!(r.setup_traps().count(), 2);
        // NVIDIA findings count as traps for doctor, not for setup's refusal.
        let nv = finding(Severity::Trap, Kind::Nvidia, "f", "x".into());
        let r = diagnose(Some(&p), &[rt(Engine::Docker, "tessera", "")], vec![nv]);
        assert_eq!((r.traps().count(), r.setup_traps().count()), (1, 0));
    }
}
