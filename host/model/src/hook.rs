//! The one list of policy hooks, and the [`Hook`] vocabulary made from it.
//!
//! Every layer that has one item per hook — the policy host's dispatch, counters and
//! `policy-info.hooks` flags, the transport's `Decisions` trait and its implementation by the
//! policy host, the guest SDK's `Policy` trait and its export glue — is generated from
//! [`for_each_hook!`], so a hook is declared once here (and in `wit/policy.wit`, which a test
//! holds equal to this list). `docs/architecture.md`, "How to add a hook", lists what else a new
//! hook needs: its answer type, its validation, the built-in default's answer, its host glue and
//! its rendering.

use std::fmt;

/// Calls `$callback! { … }` with the list of decision hooks, in the order the plugin asks them.
///
/// One entry per hook, its doc comment first:
///
/// ```text
/// Variant method "wit-name" WIT_FLAG
///     host (host parameters) -> Answer [, fitting method_fitting];
///     guest (policy parameters) -> PolicyAnswer;
/// ```
///
/// - `Variant` names the [`Hook`] variant (and the policy host's per-hook glue);
/// - `method` is the Rust name of the hook everywhere (`PolicyHost::method`,
///   `Decisions::method`, `Policy::method`);
/// - `"wit-name"` is the export of world `policy`; `WIT_FLAG` its flag in `policy-info.hooks`;
/// - the host parameters and `Answer` are what the host's callers pass and get (wrapped in the
///   layer's decision type);
/// - `fitting method_fitting`, when present, adds a host method that also takes the caller's own
///   check of a policy's answer (`fits`), which the transport's `Decisions::method` then takes;
/// - the guest parameters and answer are the SDK's `Policy::method` (which returns
///   `Option<PolicyAnswer>`, `None` being "no opinion"). A slice parameter arrives from the WIT
///   as a list, a `usize` as a `u32`.
///
/// Paths are `$crate::…`, so the callback may expand anywhere.
#[macro_export]
macro_rules! for_each_hook {
    ($callback:ident) => {
        $callback! {
            /// Which ports NCCL sees, in which order. `ports` is every port discovery found,
            /// active or not.
            SelectDevices select_devices "select-devices" SELECT_DEVICES
                host (ports: &[$crate::Port]) -> $crate::DeviceSelection;
                guest (ports: &[$crate::Port]) -> $crate::DeviceSelection;

            /// The GID index one selected port uses.
            SelectGid select_gid "select-gid" SELECT_GID
                host (port: &$crate::Port) -> $crate::GidChoice;
                guest (port: &$crate::Port) -> $crate::GidChoice;

            /// Selected ports fused into one NCCL device; `ports` are the selected ports in NCCL
            /// order, a group holds at most `max_devices` of them. An empty list means "no groups".
            GroupDevices group_devices "group-devices" GROUP_DEVICES
                host (ports: &[$crate::Port]) -> ::std::vec::Vec<$crate::DeviceGroup>;
                guest (ports: &[$crate::Port], max_devices: usize)
                    -> ::std::vec::Vec<$crate::DeviceGroup>;

            /// NCCL core asks to fuse the devices `request`; `ports[k]` is the (first) port of
            /// `request[k]`, and a vNIC holds at most `max_devices` devices.
            MakeVnic make_vnic "make-vnic" MAKE_VNIC
                host (request: &[u32], ports: &[$crate::Port]) -> $crate::VnicAnswer;
                guest (request: &[u32], ports: &[$crate::Port], max_devices: usize)
                    -> $crate::VnicAnswer;

            /// The plan of one connection, decided by the connecting side. A policy answers a
            /// patch: its `None` fields keep the built-in default's value.
            PlanConnection plan_connection "plan-connection" PLAN_CONNECTION
                host (conn: &$crate::Connection) -> $crate::ConnPlan,
                    fitting plan_connection_fitting;
                guest (conn: &$crate::Connection) -> $crate::PlanPatch;

            /// A port of connection `conn`, running QPs `qps`, went down or came back;
            /// `states[i]` is the current state of `conn.local[i]`. A port-down is answered with
            /// `MoveTo`, `Wait` or `Fail`, a port-up with `FailBack` or `Stay`.
            OnPortEvent on_port_event "on-port-event" ON_PORT_EVENT
                host (event: &$crate::PortEvent, conn: &$crate::Connection,
                    qps: &[$crate::QpPlan], states: &[$crate::PortState]) -> $crate::PortAnswer;
                guest (event: &$crate::PortEvent, conn: &$crate::Connection,
                    qps: &[$crate::QpPlan], states: &[$crate::PortState]) -> $crate::PortAnswer;
        }
    };
}

/// Makes [`Hook`] from the list.
macro_rules! hook_enum {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        /// A hook of the policy world (and `init`), for counters, logs and errors.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Hook {
            /// `init`: called once per instance, before any decision hook.
            Init,
            $($(#[$doc])* $variant,)*
        }

        impl Hook {
            /// The decision hooks, in the order the plugin calls them.
            pub const DECISIONS: [Hook; Hook::COUNT] = [$(Hook::$variant),*];

            /// How many decision hooks there are (`init` is not one).
            pub const COUNT: usize = [$($wit),*].len();

            /// The functions a policy component exports (world `policy`): `init`, then the
            /// decision hooks.
            pub const EXPORTS: [&'static str; Hook::COUNT + 1] = ["init", $($wit),*];

            /// The WIT name.
            pub fn name(self) -> &'static str {
                match self {
                    Hook::Init => "init",
                    $(Hook::$variant => $wit,)*
                }
            }
        }
    };
}

for_each_hook!(hook_enum);

impl Hook {
    /// The position of a decision hook in [`Hook::DECISIONS`]; `None` for `init`.
    pub fn decision_index(self) -> Option<usize> {
        Hook::DECISIONS.iter().position(|h| *h == self)
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Hook;

    /// `wit/policy.wit`, the contract the list must match, without its `//` comments (whose
    /// prose may hold braces and colons).
    fn wit() -> String {
        include_str!("../../../wit/policy.wit")
            .lines()
            .map(|l| l.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The body of the block that opens with `head` (which ends in `{`), up to its matching
    /// brace: `world policy` holds a `use types.{…}`.
    fn block<'a>(text: &'a str, head: &str) -> &'a str {
        let start = text
            .find(head)
            .unwrap_or_else(|| panic!("wit/policy.wit has no `{head}`"))
            + head.len();
        let mut depth = 1;
        for (i, c) in text[start..].char_indices() {
            depth += match c {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            if depth == 0 {
                return &text[start..start + i];
            }
        }
        panic!("`{head}` is not closed");
    }

    /// The block's lines, trimmed, empty ones dropped.
    fn code_lines(block: &str) -> impl Iterator<Item = &str> {
        block.lines().map(str::trim).filter(|l| !l.is_empty())
    }

    fn decision_names() -> Vec<&'static str> {
        Hook::DECISIONS.iter().map(|h| h.name()).collect()
    }

    /// A hook in the WIT but not in `for_each_hook!` (or the other way round) would be a hook
    /// no layer dispatches, or one no policy can export.
    #[test]
    fn the_worlds_exports_are_the_hook_list() {
        let wit = wit();
        let exports: Vec<&str> = code_lines(block(&wit, "world policy {"))
            .filter_map(|l| l.strip_prefix("export "))
            .map(|l| l.split(':').next().unwrap_or_default().trim())
            .collect();
        assert_eq!(
            exports,
            Hook::EXPORTS,
            "wit/policy.wit's world vs for_each_hook!"
        );
    }

    #[test]
    fn the_hooks_flags_are_the_hook_list() {
        let wit = wit();
        let flags: Vec<&str> = code_lines(block(&wit, "flags hooks {"))
            .map(|l| l.trim_end_matches(','))
            .collect();
        assert_eq!(
            flags,
            decision_names(),
            "policy-info.hooks vs for_each_hook!"
        );
    }

    #[test]
    fn names_are_distinct_and_init_is_no_decision() {
        let mut names = decision_names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Hook::COUNT);
        assert_eq!(Hook::Init.decision_index(), None);
        for (i, h) in Hook::DECISIONS.iter().enumerate() {
            assert_eq!(h.decision_index(), Some(i));
        }
    }
}
