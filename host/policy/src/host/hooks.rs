//! Each decision hook as the host asks it, one block per hook of
//! `ncclwasm_model::for_each_hook!`: the built-in default's answer (`builtin`), the policy call
//! with its conversions and validation (`ask`), and the reason a decision shows (`reason`). The
//! hook methods of [`PolicyHost`](super::PolicyHost), the counters and the `policy-info.hooks`
//! flags are generated from the list; this is what the list cannot say. Also the trial run of
//! every hook that a new version passes before it is published.

use ncclwasm_model::validate;
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortAnswer, PortChange,
    PortEvent, PortEventCause, PortState, QpPlan, VnicAnswer,
};

use super::{Asked, Loaded, Shared, Source};
use crate::convert;
use crate::engine::Fault;
use crate::engine::wit::ncclwasm::policy::types::Hooks as HookFlags;
use crate::{Hook, PolicyError};

/// One type per hook, to hang its glue on, and the `policy-info.hooks` flag of each.
macro_rules! hook_types {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        $(
            $(#[$doc])*
            pub(super) enum $variant {}
        )*

        /// Whether `policy-info.hooks` names `hook` (`init` is always called).
        pub(super) fn declares(flags: HookFlags, hook: Hook) -> bool {
            match hook {
                Hook::Init => true,
                $(Hook::$variant => flags.contains(HookFlags::$flag),)*
            }
        }
    };
}

ncclwasm_model::for_each_hook!(hook_types);

impl SelectDevices {
    pub(super) fn builtin(s: &Shared, ports: &[Port]) -> DeviceSelection {
        ncclwasm_default::select_devices(&s.ib, ports)
    }

    pub(super) fn reason(d: &DeviceSelection, _: &Source) -> String {
        d.reason.clone()
    }

    pub(super) fn ask(
        _: &Shared,
        l: &Loaded,
        ports: &[Port],
    ) -> Result<Asked<DeviceSelection>, Fault> {
        let arg = convert::ports(ports);
        l.ask(
            Hook::SelectDevices,
            |i| i.bindings.call_select_devices(&mut i.store, &arg),
            |w| {
                let sel = convert::selection(w);
                validate::check_selection(&sel, ports).map(|()| sel)
            },
        )
    }
}

impl SelectGid {
    pub(super) fn builtin(s: &Shared, port: &Port) -> GidChoice {
        ncclwasm_default::select_gid(&s.ib, port)
    }

    pub(super) fn reason(d: &GidChoice, _: &Source) -> String {
        d.reason.clone()
    }

    pub(super) fn ask(_: &Shared, l: &Loaded, port: &Port) -> Result<Asked<GidChoice>, Fault> {
        let arg = convert::port(port);
        l.ask(
            Hook::SelectGid,
            |i| i.bindings.call_select_gid(&mut i.store, &arg),
            |w| {
                let choice = convert::gid_choice(w);
                validate::check_gid(&choice, port).map(|()| choice)
            },
        )
    }
}

impl GroupDevices {
    pub(super) fn builtin(s: &Shared, ports: &[Port]) -> Vec<DeviceGroup> {
        ncclwasm_default::group_devices(&s.ib, ports)
    }

    pub(super) fn reason(gs: &[DeviceGroup], source: &Source) -> String {
        if gs.is_empty() {
            return match source {
                Source::Policy(id) => format!("{id} made no groups"),
                _ => ncclwasm_default::NO_GROUPS_REASON.to_owned(),
            };
        }
        gs.iter()
            .map(|g| g.reason.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub(super) fn ask(
        s: &Shared,
        l: &Loaded,
        ports: &[Port],
    ) -> Result<Asked<Vec<DeviceGroup>>, Fault> {
        let arg = convert::ports(ports);
        let max = s.settings.max_devs_per_nic;
        l.ask(
            Hook::GroupDevices,
            |i| {
                i.bindings
                    .call_group_devices(&mut i.store, &arg, wire_max(max))
            },
            |w| {
                let groups = convert::groups(w);
                validate::check_groups(&groups, ports, max).map(|()| groups)
            },
        )
    }
}

impl MakeVnic {
    pub(super) fn builtin(s: &Shared, request: &[u32], ports: &[Port]) -> VnicAnswer {
        ncclwasm_default::make_vnic(&s.ib, request, ports, s.settings.max_devs_per_nic)
    }

    pub(super) fn reason(v: &VnicAnswer, _: &Source) -> String {
        match v {
            VnicAnswer::Accept { reason }
            | VnicAnswer::Reshape { reason, .. }
            | VnicAnswer::Refuse { reason } => reason.clone(),
        }
    }

    pub(super) fn ask(
        s: &Shared,
        l: &Loaded,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Asked<VnicAnswer>, Fault> {
        let arg = convert::ports(ports);
        let max = s.settings.max_devs_per_nic;
        l.ask(
            Hook::MakeVnic,
            |i| {
                i.bindings
                    .call_make_vnic(&mut i.store, request, &arg, wire_max(max))
            },
            |w| {
                let answer = convert::vnic(w);
                validate::check_vnic(&answer, request, ports, max).map(|()| answer)
            },
        )
    }
}

impl PlanConnection {
    pub(super) fn builtin(s: &Shared, conn: &Connection) -> ConnPlan {
        ncclwasm_default::plan_connection(&s.ib, conn)
    }

    pub(super) fn reason(p: &ConnPlan, _: &Source) -> String {
        p.reason.clone()
    }

    /// The policy's patch merged over the built-in plan, validated.
    pub(super) fn ask(s: &Shared, l: &Loaded, conn: &Connection) -> Result<Asked<ConnPlan>, Fault> {
        let arg = convert::connection(conn);
        let max_qps = s.max_qps(conn);
        l.ask(
            Hook::PlanConnection,
            |i| i.bindings.call_plan_connection(&mut i.store, &arg),
            |w| {
                let plan = convert::patch(w).apply(Self::builtin(s, conn));
                validate::check_plan(&plan, conn, max_qps).map(|()| plan)
            },
        )
    }
}

impl OnPortEvent {
    pub(super) fn builtin(
        s: &Shared,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> PortAnswer {
        ncclwasm_default::on_port_event(&s.ib, event, conn, qps, states)
    }

    pub(super) fn reason(a: &PortAnswer, _: &Source) -> String {
        format!("{}: {}", a.kind(), a.reason())
    }

    /// Checked by `validate::check_port_answer`, so the transport can carry it out as given.
    pub(super) fn ask(
        _: &Shared,
        l: &Loaded,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Asked<PortAnswer>, Fault> {
        let (e, c, q) = (
            convert::port_event(event),
            convert::connection(conn),
            convert::qp_plans(qps),
        );
        let st: Vec<_> = states.iter().map(|&s| convert::port_state(s)).collect();
        l.ask(
            Hook::OnPortEvent,
            |i| i.bindings.call_on_port_event(&mut i.store, e, &c, &q, &st),
            |w| {
                let answer = convert::port_answer(w);
                validate::check_port_answer(&answer, event, conn, qps, states).map(|()| answer)
            },
        )
    }
}

/// The vNIC size limit as the WIT carries it (NCCL's limits are 4 and 8).
fn wire_max(max_devs_per_nic: usize) -> u32 {
    u32::try_from(max_devs_per_nic).unwrap_or(u32::MAX)
}

/// Ask every hook once, as the plugin would at start-up and on the first connection, off the
/// hot path: a policy that faults or answers nonsense here is never published.
pub(super) fn trial(s: &Shared, l: &Loaded, ports: &[Port]) -> Result<(), PolicyError> {
    let failed = |hook: Hook| {
        move |Fault { cause, detail }| PolicyError::Trial {
            what: l.id.origin.clone(),
            hook,
            cause,
            detail,
        }
    };
    let selection = match SelectDevices::ask(s, l, ports).map_err(failed(Hook::SelectDevices))? {
        Asked::Answer(sel) => sel,
        Asked::NoOpinion | Asked::NotImplemented => SelectDevices::builtin(s, ports),
    };
    let selected: Vec<Port> = selection
        .ports
        .iter()
        .filter_map(|i| ports.iter().find(|p| p.index == *i).cloned())
        .collect();
    for port in &selected {
        SelectGid::ask(s, l, port).map_err(failed(Hook::SelectGid))?;
    }
    GroupDevices::ask(s, l, &selected).map_err(failed(Hook::GroupDevices))?;
    let pair = &selected[..selected.len().min(2)];
    let request: Vec<u32> = (0..pair.len() as u32).collect();
    MakeVnic::ask(s, l, &request, pair).map_err(failed(Hook::MakeVnic))?;
    if let Some(conn) = selected.first().map(|p| sample_connection(s, p)) {
        PlanConnection::ask(s, l, &conn).map_err(failed(Hook::PlanConnection))?;
        let base = PlanConnection::builtin(s, &conn);
        // Its one port goes down, then comes back.
        for (change, state) in [
            (PortChange::Down, PortState::Down),
            (PortChange::Up, PortState::Active),
        ] {
            let event = PortEvent {
                port: 0,
                change,
                cause: PortEventCause::AsyncEvent,
            };
            OnPortEvent::ask(s, l, &event, &conn, &base.qps, &[state])
                .map_err(failed(Hook::OnPortEvent))?;
        }
    }
    Ok(())
}

/// A connection from `port` to a peer that looks the same (as between two identical nodes),
/// with the GID the built-in default would pick.
fn sample_connection(s: &Shared, port: &Port) -> Connection {
    Connection::to_twin(port, SelectGid::builtin(s, port).index)
}
