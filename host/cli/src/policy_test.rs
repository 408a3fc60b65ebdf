//! `ncclwasm policy test POLICY [CASES…]`: the decisions a policy must make, pinned in case files
//! an author keeps beside the policy and runs in their own CI, whatever language it is written in.
//!
//! A case names a machine (and a peer), the `NCCL_IB_*` variables and the policy's config, and
//! the decisions expected on it; only what a case names is compared. Each case is evaluated as
//! `explain` evaluates it (a fresh host with the case's settings, so cases cannot leak into each
//! other), and the differences are worded as `explain` words the values. A hook that faulted
//! fails its case whatever was expected: the decision was then the built-in default's. The file
//! format is in host/cli/README.md.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args as ClapArgs;
use ncclwasm_inspect::render::json;
use ncclwasm_inspect::report::{self, Connections, PortGid, Report};
use ncclwasm_inspect::setup::{self, PolicyArg};
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::spelling;
use ncclwasm_model::telemetry::Telemetry;
use ncclwasm_model::{NetAttr, OneSided, PortChange, Topology};
use serde::{Deserialize, Serialize};
use serde_path_to_error::Segment;

use crate::explain::{self, port_answer, qp_pairs};
use crate::fail::{Exit, Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The policy: a component (.wasm) or `builtin`
    #[arg(value_name = "FILE|builtin")]
    pub policy: PolicyArg,

    /// Case files (TOML; format in host/cli/README.md) [default: cases.toml]
    #[arg(value_name = "CASES")]
    pub cases: Vec<PathBuf>,

    /// Print the results as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

/// A case file: `[[case]]` tables.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseFile {
    case: Vec<Case>,
}

/// One machine, its settings, and what the policy must decide on it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// Topology files, relative to the case file.
    topology: PathBuf,
    peer: Option<PathBuf>,
    /// `NCCL_IB_*` variables (the process environment's are not read: a case says all), read
    /// strictly: a name NCCL does not read, or a value it reads otherwise, is an error.
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// `NCCL_WASM_POLICY_CONFIG` handed to `init`.
    config: Option<String>,
    /// The connection whose plan and port events are checked: NCCL device `device` (default:
    /// the sample connection `explain` shows).
    device: Option<u32>,
    /// NCCL's `setNetAttr` hint the connection is planned with (default: none given), by the
    /// WIT's names: `net-attr = { send = { max-concurrent-peers = 2 } }`.
    #[serde(rename = "net-attr")]
    net_attr: Option<NetAttr>,
    /// Plan the connection as one-sided traffic, where it sits in its RMA communicator, by the
    /// WIT's names: `one-sided = { context = 1, contexts = 4, rank = 0, peer = 1, nranks = 2 }`.
    #[serde(rename = "one-sided")]
    one_sided: Option<OneSided>,
    /// What the policy's `telemetry.read` returns (default: every port idle): a snapshot file,
    /// relative to the case file, or the snapshot itself as a table.
    telemetry: Option<TelemetryGiven>,
    expect: Expect,
}

/// A case's telemetry: a file name, or the snapshot file's content inline.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TelemetryGiven {
    File(PathBuf),
    Inline(toml::Table),
}

/// Expected decisions; every one optional.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Expect {
    /// Selected ports in NCCL device order (`mlx5_0:1`).
    devices: Option<Vec<String>>,
    /// GID index per named port.
    gids: Option<BTreeMap<String, u32>>,
    peer_devices: Option<Vec<String>>,
    peer_gids: Option<BTreeMap<String, u32>>,
    /// Fused groups, each its members' port names; `[]` for none.
    fused: Option<Vec<Vec<String>>>,
    /// The device names NCCL sees, in order.
    nccl_devices: Option<Vec<String>>,
    /// v12 `railId` per NCCL device name (-1: undefined), only those named.
    rails: Option<BTreeMap<String, i16>>,
    /// The sample fusion request's answer: `accept`, `refuse` or `reshape to devices 0,1`.
    vnic: Option<String>,
    /// Plan fields by WIT name; `qps` is a count or the QPs as `local>remote` port names.
    plan: Option<BTreeMap<String, toml::Value>>,
    /// `on-port-event` answers when the connection's first port goes down and comes back:
    /// `move-to mlx5_1:1`, `wait 5000`, `fail`, `fail-back`, `stay` (the kind alone matches
    /// any ports or time).
    port_down: Option<String>,
    port_up: Option<String>,
    /// Any decision by the name `policy diff` gives it, its value worded as there: every hook's
    /// decision can be pinned this way, a new hook's included.
    items: Option<BTreeMap<String, String>>,
}

/// One case's result, as printed with `--json`.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub file: String,
    pub name: String,
    pub pass: bool,
    pub differences: Vec<Difference>,
}

/// A decision that is not what the case expects.
#[derive(Debug, Serialize)]
pub struct Difference {
    /// Named as `explain` and `diff` name decisions (`gid mlx5_0:1`, `plan tc`, …).
    pub decision: String,
    pub expected: String,
    pub got: String,
}

#[derive(Debug, Serialize)]
struct Results {
    policy: report::PolicyView,
    passed: usize,
    failed: usize,
    cases: Vec<CaseResult>,
}

/// Case files are small; anything larger is a mistake.
const CASE_FILE: Limit = Limit {
    what: "policy test case file",
    cap: 1 << 20,
};

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let files = if args.cases.is_empty() {
        vec![PathBuf::from("cases.toml")]
    } else {
        args.cases.clone()
    };
    let mut results = Vec::new();
    let mut policy = None;
    for path in &files {
        for case in read(path)? {
            let (view, result) = run_case(&args.policy, path, case)?;
            policy.get_or_insert(view);
            results.push(result);
        }
    }
    let failed = results.iter().filter(|r| !r.pass).count();
    let results = Results {
        policy: policy.unwrap_or_else(report::PolicyView::builtin),
        passed: results.len() - failed,
        failed,
        cases: results,
    };
    let text = if args.json {
        json(&results)?
    } else {
        render(&results)
    };
    let exit = if failed == 0 { Exit::Success } else { Exit::No };
    Ok(Outcome { text, exit })
}

fn read(path: &Path) -> Result<Vec<Case>, Fail> {
    let text = file::read_to_string(path, CASE_FILE).map_err(Fail::trouble)?;
    parse(&text, &path.display().to_string()).map_err(Fail::trouble)
}

/// A case file's cases, or its first mistake as one line: `FILE: case "NAME": …` for one inside
/// a case, `FILE:LINE:COLUMN: …` for one outside any (a syntax error, a key beside `[[case]]`).
/// An unknown key, at any depth and in `expect.plan` too, is named by its dotted path with the
/// closest known key when one is close (`unknown key `peers` (did you mean `peer`?)`).
fn parse(text: &str, origin: &str) -> Result<Vec<Case>, String> {
    let at = |span: Option<Range<usize>>| match span {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("{origin}:{line}:{column}")
        }
        None => origin.to_owned(),
    };
    // toml's `Display` is a multi-line snippet of the file; its message and span make one line.
    let message = |e: &toml::de::Error| {
        let lines: Vec<&str> = e.message().lines().map(str::trim).collect();
        lines.join("; ").trim_matches([' ', ';']).to_owned()
    };
    let table: toml::Table =
        toml::from_str(text).map_err(|e| format!("{}: {}", at(e.span()), message(&e)))?;
    let cases: CaseFile =
        serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
            let path: Vec<Segment> = e.path().iter().cloned().collect();
            let e = e.into_inner();
            let (place, path) = match path.as_slice() {
                [Segment::Map { key }, Segment::Seq { index }, inside @ ..] if key == "case" => {
                    let name = table
                        .get("case")
                        .and_then(|c| c.get(*index))
                        .and_then(|c| c.get("name"))
                        .and_then(toml::Value::as_str);
                    (case_place(origin, *index, name), inside)
                }
                whole => (at(e.span()), whole),
            };
            format!("{place}: {}", mistake(path, &message(&e)))
        })?;
    if cases.case.is_empty() {
        return Err(format!("{origin}: no [[case]]"));
    }
    for (index, case) in cases.case.iter().enumerate() {
        let known = ncclwasm_model::ConnPlan::FIELDS;
        let mut plan = case.expect.plan.iter().flat_map(|p| p.keys());
        if let Some(field) = plan.find(|f| !known.contains(&f.as_str())) {
            return Err(format!(
                "{}: {}",
                case_place(origin, index, Some(&case.name)),
                unknown("expect.plan.", field, known)
            ));
        }
    }
    Ok(cases.case)
}

/// `FILE: case "NAME"`, or `FILE: case #N` (from 1) when the case has no name.
fn case_place(origin: &str, index: usize, name: Option<&str>) -> String {
    match name {
        Some(name) => format!("{origin}: case {name:?}"),
        None => format!("{origin}: case #{}", index + 1),
    }
}

/// serde's message for the value at `path`, an unknown key (the path's last key, which serde
/// names with the keys it knows) worded as [`unknown`].
fn mistake(path: &[Segment], message: &str) -> String {
    if let Some((Segment::Map { key }, table)) = path.split_last()
        && let Some(known) = message.strip_prefix(&format!("unknown field `{key}`, "))
    {
        // `expected one of `a`, `b``, `expected `a` or `b``, `there are no fields`.
        let known: Vec<&str> = known.split('`').skip(1).step_by(2).collect();
        let prefix = match dotted(table) {
            p if p.is_empty() => p,
            p => p + ".",
        };
        return unknown(&prefix, key, &known);
    }
    match dotted(path) {
        p if p.is_empty() => message.to_owned(),
        p => format!("{p}: {message}"),
    }
}

/// `unknown key `expect.gid` (did you mean `expect.gids`?)`: `key` in the table at `prefix`
/// (`expect.`; empty at the top of a case or the file), whose keys are `known`.
fn unknown(prefix: &str, key: &str, known: &[&str]) -> String {
    let mut line = format!("unknown key `{prefix}{}`", bare(key));
    if let Some(meant) = spelling::closest(key, known) {
        line += &format!(" (did you mean `{prefix}{meant}`?)");
    }
    line
}

/// A path as TOML writes it: `expect.plan.tc`, `net-attr.send`, `devices[1]`.
fn dotted(path: &[Segment]) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out += &format!("[{index}]"),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out += &bare(key);
            }
            Segment::Unknown => out += ".?",
        }
    }
    out
}

/// A key as TOML writes it: bare when it can be, quoted otherwise.
fn bare(key: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    if !key.is_empty() && key.chars().all(plain) {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

fn run_case(
    policy: &PolicyArg,
    path: &Path,
    case: Case,
) -> Result<(report::PolicyView, CaseResult), Fail> {
    let at = |what: &str| format!("{} case {:?}: {what}", path.display(), case.name);
    let dir = path.parent().unwrap_or(Path::new("."));
    let load =
        |t: &Path| Topology::load(dir.join(t)).map_err(|e| Fail::trouble(at(&e.to_string())));
    let local = load(&case.topology)?;
    let peer = case.peer.as_deref().map(load).transpose()?;
    let env = case
        .env
        .iter()
        .map(|(k, v)| setup::parse_env_pair(&format!("{k}={v}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Fail::trouble(at(&e)))?;
    let settings = setup::isolated_settings(env, case.config.clone())?;
    let (host, view) =
        setup::host(settings, policy).map_err(|e| Fail::trouble(at(&e.to_string())))?;
    let ports = local.ports();
    let telemetry = match &case.telemetry {
        None => None,
        Some(TelemetryGiven::File(f)) => Some(Telemetry::load(&dir.join(f), &ports)),
        Some(TelemetryGiven::Inline(t)) => {
            Some(Telemetry::parse(&t.to_string(), "telemetry", &ports))
        }
    };
    if let Some(t) = telemetry {
        host.set_telemetry(Arc::new(t.map_err(|e| Fail::trouble(at(&e)))?));
    }
    let which = case.device.map_or(Connections::Sample, Connections::Device);
    let report = report::evaluate(
        &host,
        view.clone(),
        &local,
        peer.as_ref(),
        &[],
        which,
        report::ConnShape {
            net_attr: case.net_attr,
            one_sided: case.one_sided,
        },
    )?;
    if let Some(n) = case.device
        && report.connection.is_none()
    {
        return Err(Fail::trouble(at(&format!(
            "device {n}: the policy gives NCCL {} device(s)",
            report.nccl_devices.len()
        ))));
    }
    let differences = compare(&case.expect, &report).map_err(|e| Fail::trouble(at(&e)))?;
    Ok((
        view,
        CaseResult {
            file: path.display().to_string(),
            name: case.name,
            pass: differences.is_empty(),
            differences,
        },
    ))
}

/// Everything the case expects that the report does not show, and every fault. An expectation
/// that cannot be compared (a `qps` that is neither a count nor pairs, an `items` decision the
/// report lacks) is an error in the case file.
fn compare(expect: &Expect, r: &Report) -> Result<Vec<Difference>, String> {
    let mut out: Vec<Difference> = report::fallbacks(r)
        .into_iter()
        .map(|(decision, source)| Difference {
            decision,
            expected: "an answer".into(),
            got: explain::fault(source).unwrap_or_default(),
        })
        .collect();
    let mut check = |decision: &str, expected: String, got: String| {
        if expected != got {
            out.push(Difference {
                decision: decision.to_owned(),
                expected,
                got,
            });
        }
    };
    let names = |d: &report::Decided<Vec<report::DeviceView>>| {
        d.value.iter().map(|v| v.name.clone()).collect::<Vec<_>>()
    };
    if let Some(want) = &expect.devices {
        check("devices", want.join(" "), names(&r.devices).join(" "));
    }
    if let Some(want) = &expect.gids {
        gids(&mut check, "gid", want, &r.gids);
    }
    if let Some(want) = &expect.peer_devices {
        let got = r.peer.as_ref().map_or_else(Vec::new, |p| names(&p.devices));
        check("peer devices", want.join(" "), got.join(" "));
    }
    if let Some(want) = &expect.peer_gids {
        let got = r.peer.as_ref().map_or(&[][..], |p| &p.gids);
        gids(&mut check, "peer gid", want, got);
    }
    if let Some(want) = &expect.fused {
        let words = |groups: Vec<String>| {
            if groups.is_empty() {
                "none".to_owned()
            } else {
                groups.join(" ")
            }
        };
        let want = want.iter().map(|g| format!("[{}]", g.join(" "))).collect();
        let got = r
            .groups
            .value
            .iter()
            .map(|g| format!("[{}]", g.members.join(" ")))
            .collect();
        check("fused", words(want), words(got));
    }
    if let Some(want) = &expect.nccl_devices {
        let got: Vec<&str> = r.nccl_devices.iter().map(|d| d.name.as_str()).collect();
        check("nccl devices", want.join(" "), got.join(" "));
    }
    if let Some(want) = &expect.rails {
        for (name, rail) in want {
            let got = r
                .nccl_devices
                .iter()
                .find(|d| d.name == *name)
                .map_or_else(|| "no such device".to_owned(), |d| d.rail.to_string());
            check(&format!("rail {name}"), rail.to_string(), got);
        }
    }
    if let Some(want) = &expect.vnic {
        let got = r.vnic.as_ref().map_or(
            "no request (fewer than two devices)".to_owned(),
            explain::vnic_answer,
        );
        check("vnic", want.clone(), matched(want, got));
    }
    let connection = r.connection.as_ref();
    let none = || "no connection (no device selected)".to_owned();
    if let Some(want) = &expect.plan {
        for (field, value) in want {
            let (expected, got) = match connection {
                Some(c) => plan_field(field, value, c)?,
                None => (value.to_string(), none()),
            };
            check(&format!("plan {field}"), expected, got);
        }
    }
    for (want, change, label) in [
        (&expect.port_down, PortChange::Down, "port-down"),
        (&expect.port_up, PortChange::Up, "port-up"),
    ] {
        let Some(want) = want else { continue };
        let got = connection
            .and_then(|c| {
                let e = c.port_events.iter().find(|e| e.change == change)?;
                Some(port_answer(&e.answer.value, c))
            })
            .unwrap_or_else(none);
        check(label, want.clone(), matched(want, got));
    }
    if let Some(want) = &expect.items {
        let items = explain::items(r);
        for (decision, value) in want {
            let Some(item) = items.iter().find(|i| &i.decision == decision) else {
                let names: Vec<&str> = items.iter().map(|i| i.decision.as_str()).collect();
                return Err(format!(
                    "items: no decision {decision:?} here; there are {}",
                    names.join(", ")
                ));
            };
            check(decision, value.clone(), item.value.clone());
        }
    }
    Ok(out)
}

/// `got`, or its first word when that is all the expectation says (`move-to` for any ports).
fn matched(want: &str, got: String) -> String {
    match got.split_once(' ') {
        Some((kind, _)) if kind == want => kind.to_owned(),
        _ => got,
    }
}

fn gids(
    check: &mut impl FnMut(&str, String, String),
    prefix: &str,
    want: &BTreeMap<String, u32>,
    got: &[PortGid],
) {
    for (port, index) in want {
        let found = got
            .iter()
            .find(|g| &g.name == port)
            .map_or("not a selected port".to_owned(), |g| g.index.to_string());
        check(&format!("{prefix} {port}"), index.to_string(), found);
    }
}

/// One plan field (a known one: [`parse`] refuses others): expected and actual, as text. `qps`
/// compares the count or the pairs; the others compare the value as the plan's JSON has it.
fn plan_field(
    field: &str,
    value: &toml::Value,
    c: &report::ConnectionView,
) -> Result<(String, String), String> {
    let plan = &c.plan.decided.value;
    let qps = &plan.qps;
    if field == "qps" {
        return match value {
            toml::Value::Integer(n) => Ok((n.to_string(), qps.len().to_string())),
            toml::Value::Array(pairs) => {
                let want: Vec<String> = pairs
                    .iter()
                    .map(|p| {
                        p.as_str()
                            .map(str::to_owned)
                            .unwrap_or_else(|| p.to_string())
                    })
                    .collect();
                Ok((want.join(" "), qp_pairs(c)))
            }
            other => Err(format!(
                "plan qps = {other}: give a count or a list of \"local>remote\" port names"
            )),
        };
    }
    let json = serde_json::to_value(plan).map_err(|e| e.to_string())?;
    let got = &json[field.replace('-', "_")];
    let expected = serde_json::to_value(value).map_err(|e| e.to_string())?;
    Ok((expected.to_string(), got.to_string()))
}

fn render(r: &Results) -> String {
    let mut out = String::new();
    for c in &r.cases {
        let verdict = if c.pass { "PASS" } else { "FAIL" };
        out += &format!("{verdict}  {}  ({})\n", c.name, c.file);
        for d in &c.differences {
            out += &format!(
                "      {}: expected {}, got {}\n",
                d.decision, d.expected, d.got
            );
        }
    }
    out + &format!(
        "{} {}: {} passed, {} failed\n",
        r.policy.name, r.policy.version, r.passed, r.failed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const CASE: &str = "[[case]]\nname = \"one\"\ntopology = \"t.toml\"\n[case.expect]\n\n[[case]]\nname = \"two-rails\"\ntopology = \"t.toml\"\n";

    fn error(text: &str) -> String {
        let e = parse(text, "cases.toml").expect_err("a mistake");
        assert_eq!(e.lines().count(), 1, "one line: {e}");
        e
    }

    #[test]
    fn unknown_keys_name_the_case_and_the_closest_key() {
        for (extra, want) in [
            (
                "peers = \"t.toml\"\n[case.expect]",
                "cases.toml: case \"two-rails\": unknown key `peers` (did you mean `peer`?)",
            ),
            (
                "[case.expect]\ngid = { \"mlx5_0:1\" = 3 }",
                "cases.toml: case \"two-rails\": unknown key `expect.gid` (did you mean `expect.gids`?)",
            ),
            (
                "[case.expect]\nplan = { tcc = 1 }",
                "cases.toml: case \"two-rails\": unknown key `expect.plan.tcc` (did you mean `expect.plan.tc`?)",
            ),
            (
                "net-attr = { send = { max-peers = 2 } }\n[case.expect]",
                "cases.toml: case \"two-rails\": unknown key `net-attr.send.max-peers`",
            ),
            (
                "[case.expect]\nwhatever = 1",
                "cases.toml: case \"two-rails\": unknown key `expect.whatever`",
            ),
            (
                "[case.expect]\n\"port down\" = \"fail\"",
                "cases.toml: case \"two-rails\": unknown key `expect.\"port down\"` (did you mean `expect.port-down`?)",
            ),
        ] {
            let text = format!("{CASE}{extra}\n");
            assert_eq!(error(&text), want, "{text}");
        }
    }

    #[test]
    fn other_mistakes_are_one_line_placed() {
        assert_eq!(
            error(CASE),
            "cases.toml: case \"two-rails\": missing field `expect`"
        );
        assert_eq!(
            error(&format!("{CASE}device = \"1\"\n[case.expect]\n")),
            "cases.toml: case \"two-rails\": device: invalid type: string \"1\", expected u32"
        );
        assert_eq!(
            error("[[case]]\ntopology = \"t.toml\"\n[case.expect]\n"),
            "cases.toml: case #1: missing field `name`"
        );
        assert_eq!(
            error("cases = []\n"),
            "cases.toml:1:1: unknown key `cases` (did you mean `case`?)"
        );
        let syntax = error("[[case]]\nname = \"x\"\ntopology = t.toml\n");
        assert!(syntax.starts_with("cases.toml:3:12: "), "{syntax}");
        assert_eq!(
            error("[[case]\n"),
            "cases.toml:1:7: invalid table header; expected `.`, `]]`"
        );
        assert_eq!(error("case = []\n"), "cases.toml: no [[case]]");
    }
}
