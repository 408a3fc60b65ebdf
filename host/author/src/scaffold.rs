//! `ncclwasm policy new`: a standalone project in one language, its chosen hooks stubbed as "no
//! opinion" (so it builds, loads and changes nothing until the author fills one in), with a
//! README, a `policy test` case file and the topology that case runs on.
//!
//! The language's files are templates under `templates/<lang>/` with `{{name}}`, `{{hooks}}`
//! (the hooks declared in `init`), `{{stubs}}` (one function per hook) and, for Rust, `{{sdk}}`
//! filled in; the per-hook stubs are below, one table per language.

use std::path::{Path, PathBuf};

use ncclwasm_model::Hook;

use crate::{Error, Lang, WIT};

/// Where the Rust SDK is: `guest` is the `ncclwasm-guest` crate's directory; `vendor`, when set,
/// holds its crates.io dependencies (the release tarball's `sdk/vendor`), which the project's
/// `.cargo/config.toml` then uses instead of the network.
#[derive(Clone, Debug)]
pub struct Sdk {
    pub guest: PathBuf,
    pub vendor: Option<PathBuf>,
}

/// What `policy new` is asked to make.
#[derive(Clone, Debug)]
pub struct NewProject {
    /// The policy's name: the directory, the package and `policy-info.name`.
    pub name: String,
    pub lang: Lang,
    /// The hooks stubbed and declared, in [`Hook::DECISIONS`] order.
    pub hooks: Vec<Hook>,
    /// The directory to create (it must not exist).
    pub dir: PathBuf,
    /// Needed for Rust.
    pub sdk: Option<Sdk>,
}

/// Writes the project and returns the files written, relative to its directory.
pub fn scaffold(project: &NewProject) -> Result<Vec<PathBuf>, Error> {
    check_name(&project.name)?;
    if project.dir.exists() {
        return Err(Error::Usage(format!(
            "{} already exists; `policy new` makes a new directory",
            project.dir.display()
        )));
    }
    let files = files(project)?;
    for (path, text) in &files {
        let full = project.dir.join(path);
        if let Some(parent) = full.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        std::fs::write(&full, text).map_err(|e| Error::io(&full, e))?;
    }
    Ok(files.into_iter().map(|(path, _)| path).collect())
}

/// A name every toolchain takes as is: a Cargo package, an npm package, a directory.
fn check_name(name: &str) -> Result<(), Error> {
    let ok = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "policy name {name:?}: lowercase letters, digits and '-', starting with a letter (e.g. gid-by-rack)"
        )))
    }
}

/// The files of `project`, relative path and text.
fn files(project: &NewProject) -> Result<Vec<(PathBuf, String)>, Error> {
    let fill = |template: &str| {
        template
            .replace("{{name}}", &project.name)
            .replace("{{hooks}}", &declared(project.lang, &project.hooks))
            .replace("{{stubs}}", &stubs(project.lang, &project.hooks))
            .replace("{{type}}", &type_name(&project.name))
            .replace("{{imports}}", &rust_imports(&project.hooks))
    };
    let mut files: Vec<(PathBuf, String)> = templates(project.lang)
        .iter()
        .map(|(path, text)| (PathBuf::from(path), fill(text)))
        .collect();
    files.push(("cases.toml".into(), fill(CASES)));
    files.push((
        "topology.toml".into(),
        ncclwasm_model::topology::LOOPBACK_TOML.to_owned(),
    ));
    match project.lang {
        Lang::Rust => {
            let sdk = project.sdk.as_ref().ok_or_else(|| {
                Error::Usage(
                    "a Rust policy needs the SDK (the tarball's sdk/); none was found".into(),
                )
            })?;
            for (_, text) in &mut files {
                *text = text.replace("{{sdk}}", &toml_path(&sdk.guest));
            }
            if let Some(vendor) = &sdk.vendor {
                files.push((
                    ".cargo/config.toml".into(),
                    RUST_OFFLINE.replace("{{vendor}}", &toml_path(vendor)),
                ));
            }
        }
        Lang::Python | Lang::Js | Lang::C => files.push(("wit/policy.wit".into(), WIT.to_owned())),
    }
    Ok(files)
}

/// A path inside a TOML basic string.
fn toml_path(path: &Path) -> String {
    path.display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
}

const CASES: &str = include_str!("../templates/cases.toml");

const RUST_OFFLINE: &str = "\
# Written by `ncclwasm policy new`: crates.io is replaced by the SDK's vendored sources, so the
# policy builds with no network (delete this file to build against crates.io instead).
[source.crates-io]
replace-with = \"ncclwasm-sdk\"

[source.ncclwasm-sdk]
directory = \"{{vendor}}\"

[net]
offline = true
";

/// The language's template files, relative path and text.
fn templates(lang: Lang) -> &'static [(&'static str, &'static str)] {
    match lang {
        Lang::Rust => &[
            ("Cargo.toml", include_str!("../templates/rust/Cargo.toml")),
            ("src/lib.rs", include_str!("../templates/rust/lib.rs")),
            ("README.md", include_str!("../templates/rust/README.md")),
            (".gitignore", "/target\n/*.wasm\n"),
        ],
        Lang::Python => &[
            ("app.py", include_str!("../templates/python/app.py")),
            (
                "ncclwasm_guest.py",
                include_str!("../templates/python/ncclwasm_guest.py"),
            ),
            ("requirements.txt", "componentize-py==0.25.1\n"),
            ("README.md", include_str!("../templates/python/README.md")),
            (".gitignore", "/.venv\n__pycache__/\n/*.wasm\n"),
        ],
        Lang::Js => &[
            ("package.json", include_str!("../templates/js/package.json")),
            ("build.mjs", include_str!("../templates/js/build.mjs")),
            ("policy.js", include_str!("../templates/js/policy.js")),
            (
                "ncclwasm_guest.js",
                include_str!("../templates/js/ncclwasm_guest.js"),
            ),
            ("README.md", include_str!("../templates/js/README.md")),
            (".gitignore", "/node_modules\n/*.wasm\n"),
        ],
        Lang::C => &[
            ("policy.c", include_str!("../templates/c/policy.c")),
            ("README.md", include_str!("../templates/c/README.md")),
            (".gitignore", "/build\n/*.wasm\n"),
        ],
    }
}

/// The `hooks` flags `init` declares, in the language's syntax.
fn declared(lang: Lang, hooks: &[Hook]) -> String {
    let flag = |h: &Hook| h.name().to_uppercase().replace('-', "_");
    match lang {
        // A const item: bitflags' `|` is not const, `union` is.
        Lang::Rust if hooks.is_empty() => "Hooks::empty()".into(),
        Lang::Rust if hooks.len() == Hook::COUNT => "Hooks::all()".into(),
        Lang::Rust => {
            let mut flags = hooks.iter().map(|h| format!("Hooks::{}", flag(h)));
            let first = flags.next().unwrap_or_default();
            flags.fold(first, |all, f| format!("{all}.union({f})"))
        }
        Lang::Python if hooks.is_empty() => "types.Hooks(0)".into(),
        Lang::Python => join(hooks, " | ", |h| format!("types.Hooks.{}", flag(h))),
        Lang::Js => format!(
            "{{ {} }}",
            join(hooks, ", ", |h| format!("{}: true", camel(h.name())))
        ),
        Lang::C if hooks.is_empty() => "0".into(),
        Lang::C => join(hooks, " | ", |h| {
            format!("NCCLWASM_POLICY_TYPES_HOOKS_{}", flag(h))
        }),
    }
}

fn join(hooks: &[Hook], sep: &str, f: impl Fn(&Hook) -> String) -> String {
    hooks.iter().map(f).collect::<Vec<_>>().join(sep)
}

/// `gid-by-rack` → `GidByRack`: the Rust policy's type.
fn type_name(name: &str) -> String {
    let mut camel = camel(name);
    if let Some(first) = camel.get(..1) {
        camel.replace_range(..1, &first.to_uppercase());
    }
    camel
}

/// The SDK items the Rust stubs name, as one `use` formatted as rustfmt would.
fn rust_imports(hooks: &[Hook]) -> String {
    let mut items = vec!["Config", "Hooks", "Policy"];
    for hook in hooks {
        items.extend_from_slice(match hook {
            Hook::SelectDevices => &["DeviceSelection", "Port"][..],
            Hook::SelectGid => &["GidChoice", "Port"],
            Hook::GroupDevices => &["DeviceGroup", "Port"],
            Hook::MakeVnic => &["Port", "VnicAnswer"],
            Hook::PlanConnection => &["Connection", "PlanPatch"],
            Hook::OnPortEvent => &[
                "Connection",
                "PortAnswer",
                "PortEvent",
                "PortState",
                "QpPlan",
            ],
            Hook::Init => &[],
        });
    }
    items.sort_unstable();
    items.dedup();
    let line = format!("use ncclwasm_guest::{{{}}};", items.join(", "));
    if line.len() <= 100 {
        return line;
    }
    let mut lines = vec![String::from("   ")];
    for item in items {
        let last = lines.last_mut().expect("one line at least");
        if last.len() + item.len() + 2 > 100 {
            lines.push(format!("    {item},"));
        } else {
            last.push_str(&format!(" {item},"));
        }
    }
    format!("use ncclwasm_guest::{{\n{}\n}};", lines.join("\n"))
}

/// `plan-connection` → `planConnection`.
fn camel(wit: &str) -> String {
    let mut parts = wit.split('-');
    let first = parts.next().unwrap_or_default().to_owned();
    parts.fold(first, |mut s, p| {
        let mut c = p.chars();
        if let Some(head) = c.next() {
            s.extend(head.to_uppercase());
            s.push_str(c.as_str());
        }
        s
    })
}

/// The stub functions: the chosen hooks with a note on what to decide; in Python, JavaScript and
/// C also the others, which the world exports whether or not `init` declares them.
fn stubs(lang: Lang, chosen: &[Hook]) -> String {
    let mut out = Vec::new();
    for hook in Hook::DECISIONS {
        let declared = chosen.contains(&hook);
        if lang == Lang::Rust && !declared {
            continue;
        }
        let note = if declared {
            format!(
                "{}: return an answer to decide; no answer keeps the built-in default's.",
                hook.name()
            )
        } else {
            format!(
                "{}: not declared in init, so never called; the world exports it.",
                hook.name()
            )
        };
        out.push(stub(lang, hook, &note, declared));
    }
    let sep = if lang == Lang::Rust { "\n" } else { "\n\n" };
    out.join(sep).trim_end().to_owned()
}

/// One hook's stub, answering "no opinion", with `note` as its comment and, for a hook the
/// policy declares, what its first answer looks like ([`example`]).
fn stub(lang: Lang, hook: Hook, note: &str, declared: bool) -> String {
    let example = if declared { example(lang, hook) } else { "" };
    let (signature, body) = match lang {
        Lang::Rust => (rust_signature(hook), "        None\n    }\n"),
        Lang::Python => (python_signature(hook), "        return None\n"),
        Lang::Js => (js_signature(hook), "  return undefined;\n}\n"),
        Lang::C => (c_signature(hook), ""),
    };
    match lang {
        Lang::Rust => format!("    /// {note}\n{signature}{example}{body}"),
        Lang::Python => format!("    # {note}\n{signature}{example}{body}"),
        Lang::Js => format!("// {note}\n{signature}{example}{body}"),
        Lang::C => format!("// {note}\n{signature}"),
    }
}

/// Comment lines inside a stub where the answer's shape is not obvious from the signature: a
/// plan answer names only the fields it sets (the SDKs' plan builders; the WIT record has 12),
/// and the Rust SDK's GID gives the WIT's derived fields as methods.
fn example(lang: Lang, hook: Hook) -> &'static str {
    match (lang, hook) {
        (Lang::Rust, Hook::SelectGid) => {
            "        // In `port.gids` the WIT's `family`, `link-local`, `unconfigured` and `hi`/`lo`\n        \
             // are methods, read from the GID's bytes: `g.family()`, `g.is_link_local()`,\n        \
             // `g.is_unconfigured()`, `g.hi()`/`g.lo()`, and `g.addr()` (see README.md).\n"
        }
        (Lang::Rust, Hook::PlanConnection) => {
            "        // e.g. Some(PlanPatch { tc: Some(106), reason: \"bulk on TC 106\".into(),\n        \
             //     ..PlanPatch::default() }): the fields left `None` keep the built-in's values.\n"
        }
        (Lang::Python, Hook::PlanConnection) => {
            "        # e.g. return conn_plan(\"bulk traffic on TC 106\", tc=106): the fields not\n        \
             # named keep the built-in default's values (ncclwasm_guest.py lists them).\n"
        }
        (Lang::Js, Hook::PlanConnection) => {
            "  // e.g. return connPlan(\"bulk traffic on TC 106\", { tc: 106 }): the fields not named\n  \
             // keep the built-in default's values (ncclwasm_guest.js lists them).\n"
        }
        _ => "",
    }
}

/// Parameters start with `_` until used: the stub builds without warnings.
fn rust_signature(hook: Hook) -> String {
    let sig = match hook {
        Hook::SelectDevices => {
            "fn select_devices(&mut self, _ports: &[Port]) -> Option<DeviceSelection>"
        }
        Hook::SelectGid => "fn select_gid(&mut self, _port: &Port) -> Option<GidChoice>",
        Hook::GroupDevices => {
            "fn group_devices(\n        &mut self,\n        _ports: &[Port],\n        _max_devices: usize,\n    ) -> Option<Vec<DeviceGroup>>"
        }
        Hook::MakeVnic => {
            "fn make_vnic(\n        &mut self,\n        _request: &[u32],\n        _ports: &[Port],\n        _max_devices: usize,\n    ) -> Option<VnicAnswer>"
        }
        Hook::PlanConnection => {
            "fn plan_connection(&mut self, _conn: &Connection) -> Option<PlanPatch>"
        }
        Hook::OnPortEvent => {
            "fn on_port_event(\n        &mut self,\n        _event: &PortEvent,\n        _conn: &Connection,\n        _qps: &[QpPlan],\n        _states: &[PortState],\n    ) -> Option<PortAnswer>"
        }
        Hook::Init => unreachable!("init is not a decision hook"),
    };
    format!("    {sig} {{\n")
}

fn python_signature(hook: Hook) -> String {
    let params = match hook {
        Hook::SelectDevices => "ports: List[types.Port]) -> Optional[types.DeviceSelection]",
        Hook::SelectGid => "port: types.Port) -> Optional[types.GidChoice]",
        Hook::GroupDevices => {
            "ports: List[types.Port], max_devices: int\n    ) -> Optional[List[types.DeviceGroup]]"
        }
        Hook::MakeVnic => {
            "request: List[int], ports: List[types.Port], max_devices: int\n    ) -> Optional[types.VnicAnswer]"
        }
        Hook::PlanConnection => "conn: types.Connection) -> Optional[types.ConnPlan]",
        Hook::OnPortEvent => {
            "event: types.PortEvent, conn: types.Connection,\n        qps: List[types.QpPlan], states: List[types.PortState]\n    ) -> Optional[types.PortAnswer]"
        }
        Hook::Init => unreachable!("init is not a decision hook"),
    };
    format!(
        "    def {}(self, {params}:\n",
        hook.name().replace('-', "_")
    )
}

fn js_signature(hook: Hook) -> String {
    let params = match hook {
        Hook::SelectDevices => "_ports",
        Hook::SelectGid => "_port",
        Hook::GroupDevices => "_ports, _maxDevices",
        Hook::MakeVnic => "_request, _ports, _maxDevices",
        Hook::PlanConnection => "_conn",
        Hook::OnPortEvent => "_event, _conn, _qps, _states",
        Hook::Init => unreachable!("init is not a decision hook"),
    };
    format!("export function {}({params}) {{\n", camel(hook.name()))
}

/// C stubs own their arguments (wit-bindgen's C convention): each frees them before returning.
fn c_signature(hook: Hook) -> String {
    let (params, frees) = match hook {
        Hook::SelectDevices => (
            "policy_list_port_t *ports, policy_device_selection_t *ret",
            "  policy_list_port_free(ports);\n",
        ),
        Hook::SelectGid => (
            "policy_port_t *port, policy_gid_choice_t *ret",
            "  policy_port_free(port);\n",
        ),
        Hook::GroupDevices => (
            "policy_list_port_t *ports, uint32_t max_devices, policy_list_device_group_t *ret",
            "  policy_list_port_free(ports);\n",
        ),
        Hook::MakeVnic => (
            "policy_list_u32_t *request, policy_list_port_t *ports, uint32_t max_devices,\n                              policy_vnic_answer_t *ret",
            "  policy_list_u32_free(request);\n  policy_list_port_free(ports);\n",
        ),
        Hook::PlanConnection => (
            "policy_connection_t *conn, policy_conn_plan_t *ret",
            "  policy_connection_free(conn);\n",
        ),
        Hook::OnPortEvent => (
            "policy_port_event_t *event, policy_connection_t *conn,\n                                   policy_list_qp_plan_t *qps, policy_list_port_state_t *states,\n                                   policy_port_answer_t *ret",
            "  policy_connection_free(conn);\n  policy_list_qp_plan_free(qps);\n  policy_list_port_state_free(states);\n",
        ),
        Hook::Init => unreachable!("init is not a decision hook"),
    };
    format!(
        "bool exports_policy_{}({params}) {{\n{frees}  return false;\n}}\n",
        hook.name().replace('-', "_")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_every_toolchain_takes() {
        assert!(check_name("gid-by-rack").is_ok());
        for bad in ["", "Gid", "1gid", "gid_rack", "gid-", "gid rack", "../x"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hooks_are_declared_in_each_language() {
        let hooks = [Hook::SelectGid, Hook::PlanConnection];
        assert_eq!(
            declared(Lang::Rust, &hooks),
            "Hooks::SELECT_GID.union(Hooks::PLAN_CONNECTION)"
        );
        assert_eq!(declared(Lang::Rust, &Hook::DECISIONS), "Hooks::all()");
        assert_eq!(
            declared(Lang::Python, &hooks),
            "types.Hooks.SELECT_GID | types.Hooks.PLAN_CONNECTION"
        );
        assert_eq!(
            declared(Lang::Js, &hooks),
            "{ selectGid: true, planConnection: true }"
        );
        assert_eq!(
            declared(Lang::C, &hooks),
            "NCCLWASM_POLICY_TYPES_HOOKS_SELECT_GID | NCCLWASM_POLICY_TYPES_HOOKS_PLAN_CONNECTION"
        );
        assert_eq!(declared(Lang::C, &[]), "0");
    }

    /// The Python and JavaScript plan builders take every field of the WIT's `conn-plan`, so
    /// a field added to the contract cannot be missing from them.
    #[test]
    fn plan_builders_name_every_plan_field() {
        let mut resolve = wit_parser::Resolve::default();
        resolve.push_str("policy.wit", WIT).unwrap();
        let plan = resolve
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some("conn-plan"))
            .expect("a conn-plan record")
            .1;
        let wit_parser::TypeDefKind::Record(record) = &plan.kind else {
            panic!("conn-plan is a record");
        };
        let python = include_str!("../templates/python/ncclwasm_guest.py");
        let js = include_str!("../templates/js/ncclwasm_guest.js");
        let fields: Vec<&str> = record.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(fields.len(), 12, "{fields:?}");
        for field in fields.into_iter().filter(|f| *f != "reason") {
            let snake = field.replace('-', "_");
            assert!(
                python.contains(&format!("    {snake}: Optional["))
                    && python.contains(&format!("{snake}={snake},")),
                "{snake} in ncclwasm_guest.py"
            );
            assert!(
                js.contains(&format!("  \"{}\",\n", camel(field))),
                "{field} in ncclwasm_guest.js"
            );
        }
    }

    /// Rust stubs only the chosen hooks (the trait has defaults); the other languages stub all,
    /// since the world exports them whether or not `init` declares them.
    #[test]
    fn stubs_cover_what_each_language_must_export() {
        let chosen = [Hook::OnPortEvent];
        let rust = stubs(Lang::Rust, &chosen);
        assert_eq!(rust.matches("fn ").count(), 1, "{rust}");
        let c = stubs(Lang::C, &chosen);
        assert_eq!(
            c.matches("bool exports_policy_").count(),
            Hook::COUNT,
            "{c}"
        );
        assert!(c.contains("policy_list_port_state_free(states);"), "{c}");
        let js = stubs(Lang::Js, &chosen);
        assert!(
            js.contains("export function onPortEvent(_event, _conn, _qps, _states)"),
            "{js}"
        );
        assert_eq!(
            stubs(Lang::Python, &chosen).matches("def ").count(),
            Hook::COUNT
        );
    }
}
