//! Policy answers through validation. A policy is untrusted wasm: whatever it answers, the
//! `check_*` functions must not panic, and an answer they accept must be one the host can carry
//! out. Answers are built from the input (small numbers are likely, so both valid and invalid
//! answers are common) against the ports of `topologies/mixed-ib-roce.toml`; each accepted one is
//! re-checked here independently, and an accepted plan is run through the striping arithmetic
//! the data path executes for every message.
#![no_main]

use std::collections::HashSet;
use std::sync::OnceLock;

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use ncclwasm_fuzz::{VALIDATE_TOPOLOGY, ports};
use ncclwasm_model::validate::{
    MAX_NAME_LEN, MAX_QPS_PER_CONNECTION, MAX_RETRY_CNT, MAX_SL, check_gid, check_groups,
    check_plan, check_selection, check_vnic,
};
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortState, QpPlan,
    VnicAnswer,
};

fn table() -> &'static [Port] {
    static PORTS: OnceLock<Vec<Port>> = OnceLock::new();
    PORTS.get_or_init(|| ports(VALIDATE_TOPOLOGY))
}

/// A number that is usually small (an index near the table), sometimes anything.
fn small(u: &mut Unstructured<'_>) -> Result<u32> {
    Ok(if u.ratio(7, 8)? {
        u.int_in_range(0..=12)?
    } else {
        u.arbitrary()?
    })
}

fn list(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<u32>> {
    let n = u.int_in_range(0..=max)?;
    (0..n).map(|_| small(u)).collect()
}

fn port_by_index(index: u32) -> &'static Port {
    table()
        .iter()
        .find(|p| p.index == index)
        .expect("accepted index is a port")
}

fn one_link_layer(indices: impl IntoIterator<Item = u32>) {
    let layers: HashSet<_> = indices
        .into_iter()
        .map(|i| port_by_index(i).link_layer)
        .collect();
    assert!(layers.len() <= 1, "accepted members mix link layers");
}

fn selection(u: &mut Unstructured<'_>) -> Result<()> {
    let sel = DeviceSelection {
        ports: list(u, 12)?,
        rails: None,
        reason: String::new(),
    };
    if check_selection(&sel, table()).is_ok() {
        let distinct: HashSet<_> = sel.ports.iter().collect();
        assert_eq!(distinct.len(), sel.ports.len(), "accepted duplicates");
        for &i in &sel.ports {
            assert_eq!(port_by_index(i).state, PortState::Active);
        }
    }
    Ok(())
}

fn gid(u: &mut Unstructured<'_>) -> Result<()> {
    let port = u.choose(table())?;
    let choice = GidChoice {
        index: small(u)?,
        reason: String::new(),
    };
    if check_gid(&choice, port).is_ok() {
        let g = port.gids.iter().find(|g| g.index == choice.index);
        assert!(
            g.is_some_and(|g| !g.is_unconfigured()),
            "accepted GID {}",
            choice.index
        );
    }
    Ok(())
}

fn groups(u: &mut Unstructured<'_>) -> Result<()> {
    let n = u.int_in_range(0..=4)?;
    let groups = (0..n)
        .map(|_| {
            Ok(DeviceGroup {
                ports: list(u, 9)?,
                name: if u.arbitrary()? {
                    Some("x".repeat(u.int_in_range(0..=MAX_NAME_LEN + 1)?))
                } else {
                    None
                },
                reason: String::new(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let max = u.int_in_range(0..=8)?;
    if check_groups(&groups, table(), max).is_ok() {
        let mut taken = HashSet::new();
        for g in &groups {
            assert!((2..=max).contains(&g.ports.len()), "accepted group size");
            for &i in &g.ports {
                assert!(taken.insert(i), "accepted port {i} twice");
            }
            one_link_layer(g.ports.iter().copied());
            assert!(
                g.name
                    .as_ref()
                    .is_none_or(|n| (1..=MAX_NAME_LEN).contains(&n.len()))
            );
        }
    }
    Ok(())
}

fn vnic(u: &mut Unstructured<'_>) -> Result<()> {
    let picks = list(u, 9)?;
    let request: Vec<u32> = picks.iter().map(|&i| i % table().len() as u32).collect();
    let mut ports: Vec<Port> = request.iter().map(|&i| port_by_index(i).clone()).collect();
    if u.ratio(1, 16)? {
        ports.pop();
    }
    let answer = match u.int_in_range(0..=2)? {
        0 => VnicAnswer::Accept {
            reason: String::new(),
        },
        1 => VnicAnswer::Reshape {
            devices: list(u, 9)?,
            reason: String::new(),
        },
        _ => VnicAnswer::Refuse {
            reason: String::new(),
        },
    };
    let max = u.int_in_range(0..=8)?;
    if check_vnic(&answer, &request, &ports, max).is_ok() {
        assert_eq!(request.len(), ports.len());
        let chosen: Vec<u32> = match &answer {
            VnicAnswer::Refuse { .. } => return Ok(()),
            VnicAnswer::Accept { .. } => request.clone(),
            VnicAnswer::Reshape { devices, .. } => {
                assert!(!devices.is_empty());
                for d in devices {
                    assert!(request.contains(d), "reshape names {d}, not requested");
                }
                devices.clone()
            }
        };
        assert!(chosen.len() <= max, "vNIC of {} > {max}", chosen.len());
        one_link_layer(chosen);
    }
    Ok(())
}

fn plan(u: &mut Unstructured<'_>) -> Result<()> {
    let pick = |u: &mut Unstructured<'_>| -> Result<Vec<_>> {
        let n = u.int_in_range(1..=8)?;
        (0..n).map(|_| Ok(u.choose(table())?.endpoint(1))).collect()
    };
    let conn = Connection {
        net_attr: None,
        one_sided: None,
        comm_id: 1,
        traffic_class: -1,
        device: 0,
        device_name: "fuzz".to_owned(),
        local: pick(u)?,
        peer: pick(u)?,
    };
    let n_qps = if u.ratio(15, 16)? {
        u.int_in_range(0..=9)?
    } else {
        u.int_in_range(0..=200)?
    };
    let qps = (0..n_qps)
        .map(|_| {
            Ok(QpPlan {
                local: small(u)?,
                remote: small(u)?,
                weight: if u.arbitrary()? {
                    small(u)?
                } else {
                    u.arbitrary()?
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let plan = ConnPlan {
        qps,
        stripe_width: small(u)?,
        align: if u.arbitrary()? {
            1 << u.int_in_range(0..=31)?
        } else {
            u.arbitrary()?
        },
        adaptive_routing: u.arbitrary()?,
        ar_threshold: u.arbitrary()?,
        tc: u.arbitrary()?,
        sl: u.int_in_range(0..=20)?,
        fifo_tc: u.arbitrary()?,
        ece: u.arbitrary()?,
        timeout: u.int_in_range(0..=40)?,
        retry_cnt: u.int_in_range(0..=10)?,
        reason: String::new(),
    };
    let max_qps = small(u)?;
    if check_plan(&plan, &conn, max_qps).is_err() {
        return Ok(());
    }
    let n = plan.qps.len();
    assert!(n >= 1 && n as u32 <= max_qps.min(MAX_QPS_PER_CONNECTION));
    for q in &plan.qps {
        assert!((q.local as usize) < conn.local.len() && (q.remote as usize) < conn.peer.len());
        assert!(q.weight > 0);
    }
    assert!(plan.sl <= MAX_SL && plan.retry_cnt <= MAX_RETRY_CNT && plan.timeout >= 1);
    // The striping the data path does for every message of this connection.
    let mut start = u.arbitrary::<u32>()?;
    for _ in 0..u.int_in_range(1..=4)? {
        let size = if u.arbitrary()? {
            u.int_in_range(0..=1 << 20)?
        } else {
            u.arbitrary()?
        };
        let stripes: Vec<_> = plan.stripes(size, start).collect();
        assert_eq!(stripes.len(), plan.stripe_count());
        assert!((1..=n).contains(&stripes.len()));
        let used: HashSet<_> = stripes.iter().map(|s| s.qp).collect();
        assert_eq!(used.len(), stripes.len(), "a QP used twice for one message");
        let mut end = 0u64;
        for s in &stripes {
            assert!((s.qp as usize) < n);
            assert_eq!(s.offset, end.min(size), "stripe not contiguous");
            end = s.offset + s.len;
            assert!(end <= size);
        }
        assert_eq!(end, size, "stripes do not cover the message");
        start = plan.next_start(start);
        assert!((start as usize) < n);
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = match u.int_in_range(0..=4u8) {
        Ok(0) => selection(&mut u),
        Ok(1) => gid(&mut u),
        Ok(2) => groups(&mut u),
        Ok(3) => vnic(&mut u),
        Ok(_) => plan(&mut u),
        Err(_) => Ok(()),
    };
});
