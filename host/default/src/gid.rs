//! Which GID a port talks with.

use ncclwasm_model::{AddrFamily, Gid, GidChoice, GidType, LinkLayer, Port};

use crate::IbConfig;

/// The GID index of `port`; as `ncclIbGetGidIndex`. IB ports use index 0 unless the
/// `NCCL_IB_ROUTABLE_FLID_GID_INDEX` entry carries a routable FLID (`NCCL_IB_GID_INDEX` does not
/// apply to IB). RoCE ports use `NCCL_IB_GID_INDEX` when set, otherwise NCCL's table scan
/// (`ncclUpdateGidIndex` over every entry, reproduced edge cases included). On tables as NICs lay
/// them out it picks the first routable entry of the wanted family (`NCCL_IB_ADDR_FAMILY`), range
/// (`NCCL_IB_ADDR_RANGE`) and RoCE version (`NCCL_IB_ROCE_VERSION_NUM`); failing that, the first
/// entry of that family and range; failing that, index 0. Entries of unreadable type never win
/// on version grounds.
pub fn select_gid(cfg: &IbConfig, port: &Port) -> GidChoice {
    match port.link_layer {
        LinkLayer::Infiniband => ib_gid(cfg, port),
        LinkLayer::Ethernet => match cfg.gid_index {
            Some(index) => forced_gid(index, port),
            None => roce_scan(cfg, port),
        },
    }
}

/// The IB half of `ncclIbGetGidIndex`: a router-assigned FLID makes the GID routable across
/// subnets, so the configured index wins when its entry has one.
fn ib_gid(cfg: &IbConfig, port: &Port) -> GidChoice {
    let flid_index = cfg.routable_flid_gid_index;
    let var = format!("NCCL_IB_ROUTABLE_FLID_GID_INDEX={flid_index}");
    let note = if cfg.gid_index.is_some() {
        " (NCCL_IB_GID_INDEX applies to RoCE only)"
    } else {
        ""
    };
    match port.gids.get(flid_index as usize) {
        Some(g) if g.flid() != 0 => GidChoice {
            index: g.index,
            reason: format!(
                "IB: index {} carries routable FLID {:#x} ({var}){note}",
                g.index,
                g.flid()
            ),
        },
        Some(_) => GidChoice {
            index: 0,
            reason: format!("IB: index 0; the entry at {var} has no routable FLID{note}"),
        },
        None => GidChoice {
            index: 0,
            reason: format!(
                "IB: index 0; the GID table has no entry {flid_index} ({var}) to carry a routable FLID{note}"
            ),
        },
    }
}

/// `NCCL_IB_GID_INDEX` on RoCE: used as given, as NCCL does. An index outside the table or on an
/// unconfigured slot is still returned (NCCL would fail the connection), with a reason saying so
/// for the validation WARN to show.
fn forced_gid(index: u32, port: &Port) -> GidChoice {
    let problem = match port.gids.iter().find(|g| g.index == index) {
        None => format!(
            "; this port's GID table has {} entries, so connections will fail: pick an index that exists",
            port.gids.len()
        ),
        Some(g) if g.is_unconfigured() => {
            "; that slot is unconfigured on this port, so connections will fail".to_owned()
        }
        Some(g) => format!(" ({})", describe(g)),
    };
    GidChoice {
        index,
        reason: format!("RoCE: NCCL_IB_GID_INDEX={index} forces index {index}{problem}"),
    }
}

/// Why the scan last moved its choice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Moved {
    /// Never moved: index 0 kept.
    No,
    /// To an entry of the wanted family when the current one was of the other family.
    Family,
    /// To an entry of the wanted RoCE version, replacing one of another version or an unusable one.
    Version,
}

/// The RoCE scan of `ncclIbGetGidIndex`: start at index 0 and walk the table once, applying
/// `ncclUpdateGidIndex` to each later entry. A candidate is taken when it is of the wanted family
/// (`NCCL_IB_ADDR_FAMILY`), inside `NCCL_IB_ADDR_RANGE`, and either the current choice is of the
/// other family, or the candidate is configured, not link-local, of the wanted RoCE version
/// (`NCCL_IB_ROCE_VERSION_NUM`) and the current choice is not (or is unusable). An entry whose
/// type is `unknown` (unreadable in sysfs) has no version, as the reference treats a failed read:
/// it can win only on family grounds.
fn roce_scan(cfg: &IbConfig, port: &Port) -> GidChoice {
    let family = cfg.addr_family;
    let version = cfg.roce_version;
    let in_range = |g: &Gid| cfg.addr_range.is_none_or(|r| r.contains(g));
    let table = &port.gids;
    let Some(first) = table.first() else {
        return GidChoice {
            index: 0,
            reason: "RoCE: NCCL_IB_GID_INDEX unset; the port reports no GID table, index 0 assumed"
                .into(),
        };
    };
    let mut current = first;
    let mut moved = Moved::No;
    for candidate in &table[1..] {
        let fam = candidate.family();
        let fits = fam == family && in_range(candidate);
        if fits && fam != current.family() {
            current = candidate;
            moved = Moved::Family;
        } else if fits
            && candidate.is_routable()
            && candidate.roce_version() == Some(version)
            && (current.roce_version() != candidate.roce_version() || !current.is_routable())
        {
            current = candidate;
            moved = Moved::Version;
        }
    }

    let fam = family_name(family);
    let range = cfg
        .addr_range
        .map_or(String::new(), |r| format!(", NCCL_IB_ADDR_RANGE={r}"));
    let wanted = format!("{fam}{range}, NCCL_IB_ROCE_VERSION_NUM={version}");
    let entry = describe(current);
    let reason = match moved {
        Moved::Version => format!(
            "RoCE: NCCL_IB_GID_INDEX unset; index {} is the {entry} ({wanted})",
            current.index
        ),
        Moved::Family => format!(
            "RoCE: NCCL_IB_GID_INDEX unset; index {} is the {entry}, the first {fam}{range} entry, \
             and no later entry is a better RoCE v{version} match ({wanted})",
            current.index
        ),
        Moved::No => {
            let risk = if current.is_routable() {
                String::new()
            } else {
                "; it is not routable, so cross-node traffic may fail: set NCCL_IB_ADDR_FAMILY, \
                 NCCL_IB_ADDR_RANGE or NCCL_IB_GID_INDEX to match this port's addresses"
                    .to_owned()
            };
            format!(
                "RoCE: NCCL_IB_GID_INDEX unset; no later entry displaces index 0 under NCCL's \
                 rules ({wanted}), so index {} ({entry}) is kept, as NCCL does{risk}",
                current.index
            )
        }
    };
    GidChoice {
        index: current.index,
        reason,
    }
}

fn family_name(family: AddrFamily) -> &'static str {
    match family {
        AddrFamily::Ipv4 => "AF_INET",
        AddrFamily::Ipv6 => "AF_INET6",
    }
}

/// How reasons name an entry: "RoCEv2 IPv4 entry ::ffff:10.0.0.1", "RoCEv1 link-local entry
/// fe80::1", …
fn describe(g: &Gid) -> String {
    let kind = match g.gid_type {
        GidType::Ib => "IB",
        GidType::RoceV1 => "RoCEv1",
        GidType::RoceV2 => "RoCEv2",
        GidType::Unknown => "unreadable-type",
    };
    let what = if g.is_unconfigured() {
        "unconfigured"
    } else if g.is_link_local() {
        "link-local"
    } else if g.family() == AddrFamily::Ipv4 {
        "IPv4"
    } else {
        "IPv6"
    };
    format!("{kind} {what} entry {}", g.addr())
}

#[cfg(test)]
mod tests {
    use ncclwasm_model::GidType::{Ib, RoceV1, RoceV2, Unknown};

    use super::*;
    use crate::testutil::{cfg, corpus, named, port, whole_corpus};

    fn pick(pairs: &[(&str, &str)], p: &Port) -> u32 {
        select_gid(&cfg(pairs), p).index
    }

    fn eth(gids: &[(&str, GidType)]) -> Port {
        port(0, "mlx5_0", 1, LinkLayer::Ethernet, gids)
    }

    #[test]
    fn roce_8nic_default_picks_follow_each_table() {
        let ports = corpus("roce-8nic.toml");
        let got: Vec<u32> = ports.iter().map(|p| pick(&[], p)).collect();
        assert_eq!(got, [3, 5, 2, 0, 3, 2, 4, 2]);
        let c = select_gid(&cfg(&[]), &ports[0]);
        assert_eq!(
            c.reason,
            "RoCE: NCCL_IB_GID_INDEX unset; index 3 is the RoCEv2 IPv4 entry ::ffff:10.0.0.21 (AF_INET, NCCL_IB_ROCE_VERSION_NUM=2)"
        );
    }

    #[test]
    fn address_family_filter() {
        let ports = corpus("roce-8nic.toml");
        let v6 = [("NCCL_IB_ADDR_FAMILY", "AF_INET6")];
        let got: Vec<u32> = ports.iter().map(|p| pick(&v6, p)).collect();
        // mlx5_0/2/4 have no global IPv6 entry: link-local entries never win, index 0 stays.
        assert_eq!(got, [0, 3, 0, 2, 0, 4, 2, 3]);
        // IPv6-only table with the default AF_INET: nothing matches, index 0 stays, and the
        // reason says it is link-local (the Broadcom case of NVIDIA/nccl#769).
        let c = select_gid(&cfg(&[]), &ports[3]);
        assert_eq!(c.index, 0);
        assert!(c.reason.contains("index 0 (RoCEv1 link-local entry fe80::a288:c2ff:fe1d:30) is kept, as NCCL does; it is not routable"), "{}", c.reason);
    }

    #[test]
    fn address_range_filter() {
        let ports = corpus("roce-8nic.toml");
        let nic4 = named(&ports, "mlx5_4");
        assert_eq!(pick(&[], nic4), 3);
        let c = select_gid(&cfg(&[("NCCL_IB_ADDR_RANGE", "192.168.0.0/16")]), nic4);
        assert_eq!(c.index, 5);
        assert!(
            c.reason.contains(
                "(AF_INET, NCCL_IB_ADDR_RANGE=192.168.0.0/16, NCCL_IB_ROCE_VERSION_NUM=2)"
            ),
            "{}",
            c.reason
        );
        // A range no entry is in keeps index 0.
        assert_eq!(pick(&[("NCCL_IB_ADDR_RANGE", "172.16.0.0/12")], nic4), 0);
        let nic1 = named(&ports, "mlx5_1");
        let v6_range = [
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
            ("NCCL_IB_ADDR_RANGE", "fd00:0:0:1::/64"),
        ];
        assert_eq!(pick(&v6_range, nic1), 3);
        let v6_elsewhere = [
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
            ("NCCL_IB_ADDR_RANGE", "fd00:0:0:2::/64"),
        ];
        assert_eq!(pick(&v6_elsewhere, nic1), 0);
    }

    #[test]
    fn roce_version_filter() {
        let ports = corpus("roce-8nic.toml");
        let v1 = [("NCCL_IB_ROCE_VERSION_NUM", "1")];
        assert_eq!(pick(&v1, &ports[0]), 2, "the IPv4 RoCEv1 entry");
        assert_eq!(pick(&v1, &ports[2]), 3, "v2 at 2 is replaced by v1 at 3");
        // mlx5_7 has IPv4 only as RoCEv1: the family switch takes it even when v2 is wanted.
        let c = select_gid(&cfg(&[]), &ports[7]);
        assert_eq!(c.index, 2);
        assert!(
            c.reason
                .contains("the first AF_INET entry, and no later entry is a better RoCE v2 match"),
            "{}",
            c.reason
        );
    }

    #[test]
    fn link_local_and_unconfigured_entries_never_win_on_version() {
        let p = eth(&[
            ("fe80::1", RoceV1),
            ("fe80::1", RoceV2),
            ("fd00::1", RoceV2),
        ]);
        assert_eq!(pick(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6")], &p), 2);
        let p = eth(&[("::", Unknown), ("fe80::", RoceV2), ("fd00::1", RoceV1)]);
        let v6 = ("NCCL_IB_ADDR_FAMILY", "AF_INET6");
        assert_eq!(pick(&[v6], &p), 0, "no routable RoCEv2 entry");
        assert_eq!(pick(&[v6, ("NCCL_IB_ROCE_VERSION_NUM", "1")], &p), 2);
        // An unusable current entry gives way to a routable one of the same version.
        let p = eth(&[("fe80::1", RoceV2), ("fd00::1", RoceV2)]);
        assert_eq!(pick(&[v6], &p), 1);
    }

    #[test]
    fn unknown_types_are_not_version_candidates() {
        // The unreadable entry can win only on family grounds, then yields to a real RoCEv2 one.
        let p = eth(&[
            ("fe80::1", RoceV1),
            ("::ffff:10.0.0.1", Unknown),
            ("::ffff:10.0.0.1", RoceV2),
        ]);
        assert_eq!(pick(&[], &p), 2);
        let p = eth(&[
            ("fe80::1", RoceV1),
            ("::ffff:10.0.0.1", RoceV2),
            ("::ffff:10.0.0.1", Unknown),
        ]);
        assert_eq!(pick(&[], &p), 1);
        let p = eth(&[("fe80::1", RoceV1), ("::ffff:10.0.0.1", Unknown)]);
        assert_eq!(pick(&[], &p), 1);
    }

    #[test]
    fn a_usable_entry_at_index_0_is_kept_even_outside_the_range() {
        // ncclUpdateGidIndex only replaces a routable current entry of the wanted version on
        // family grounds, and index 0 is never checked against the range: NCCL keeps it.
        let p = eth(&[("::ffff:10.0.0.1", RoceV2), ("::ffff:192.168.0.1", RoceV2)]);
        assert_eq!(pick(&[("NCCL_IB_ADDR_RANGE", "192.168.0.0/16")], &p), 0);
        let p = eth(&[("::ffff:10.0.0.1", RoceV1), ("::ffff:192.168.0.1", RoceV2)]);
        assert_eq!(pick(&[("NCCL_IB_ADDR_RANGE", "192.168.0.0/16")], &p), 1);
    }

    /// Issue 21, point 6: on the table the kernel reports — IPv4 at index 0, then `fe80::`
    /// slots of zero interface id, then the rest of mlx5's 256 slots — NCCL's family rule moves
    /// to index 1 under AF_INET6 without checking the slot is configured. The table must keep
    /// every slot for the plugin to agree (live discovery used to drop the trailing ones).
    #[test]
    fn af_inet6_takes_the_first_ipv6_family_slot_after_an_ipv4_index_0() {
        let ports = corpus("pod-ipv4-first.toml");
        let p = &ports[0];
        assert_eq!(p.gids.len(), 256);
        assert_eq!(pick(&[], p), 0);
        let v6 = select_gid(&cfg(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6")]), p);
        assert_eq!(v6.index, 1, "{}", v6.reason);
        assert!(
            v6.reason.contains("unconfigured entry fe80::"),
            "{}",
            v6.reason
        );
        // Without the trailing slots (what live discovery used to keep) NCCL's pick is lost.
        let mut cut = p.clone();
        cut.gids.truncate(1);
        assert_eq!(pick(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6")], &cut), 0);
    }

    #[test]
    fn k8s_sparse_tables() {
        let ports = corpus("k8s-pod.toml");
        assert_eq!(pick(&[], named(&ports, "mlx5_2")), 3);
        assert_eq!(pick(&[], named(&ports, "mlx5_5")), 5);
        let c = select_gid(&cfg(&[]), named(&ports, "mlx5_5"));
        assert!(
            c.reason.starts_with(
                "RoCE: NCCL_IB_GID_INDEX unset; index 5 is the RoCEv2 IPv4 entry ::ffff:10.244.2.17"
            ),
            "{}",
            c.reason
        );
        // One global index cannot serve both ports (NVIDIA/nccl#718).
        let forced = [("NCCL_IB_GID_INDEX", "3")];
        let c = select_gid(&cfg(&forced), named(&ports, "mlx5_5"));
        assert_eq!(c.index, 3);
        assert!(
            c.reason
                .contains("that slot is unconfigured on this port, so connections will fail"),
            "{}",
            c.reason
        );
    }

    #[test]
    fn forced_index_is_used_as_given() {
        let ports = corpus("roce-8nic.toml");
        let c = select_gid(&cfg(&[("NCCL_IB_GID_INDEX", "1")]), &ports[0]);
        assert_eq!(c.index, 1);
        assert_eq!(
            c.reason,
            "RoCE: NCCL_IB_GID_INDEX=1 forces index 1 (RoCEv2 link-local entry fe80::a288:c2ff:fe1d:0)"
        );
        let loopback = corpus("loopback.toml");
        let c = select_gid(&cfg(&[("NCCL_IB_GID_INDEX", "300")]), &loopback[0]);
        assert_eq!(c.index, 300);
        assert!(
            c.reason
                .contains("GID table has 256 entries, so connections will fail"),
            "{}",
            c.reason
        );
    }

    #[test]
    fn ib_uses_index_0_unless_the_flid_entry_is_routable() {
        let dgx = corpus("dgx-h100.toml");
        let c = select_gid(&cfg(&[("NCCL_IB_GID_INDEX", "3")]), &dgx[0]);
        assert_eq!(c.index, 0);
        assert_eq!(
            c.reason,
            "IB: index 0; the entry at NCCL_IB_ROUTABLE_FLID_GID_INDEX=1 has no routable FLID (NCCL_IB_GID_INDEX applies to RoCE only)"
        );
        let ib = |gids: &[(&str, GidType)]| port(0, "mlx5_0", 1, LinkLayer::Infiniband, gids);
        let routed = ib(&[("fe80::1", Ib), ("fec0:0:12:5::1", Ib)]);
        let c = select_gid(&cfg(&[]), &routed);
        assert_eq!(c.index, 1);
        assert_eq!(
            c.reason,
            "IB: index 1 carries routable FLID 0x12 (NCCL_IB_ROUTABLE_FLID_GID_INDEX=1)"
        );
        assert_eq!(
            pick(&[("NCCL_IB_ROUTABLE_FLID_GID_INDEX", "0")], &routed),
            0
        );
        let local = ib(&[("fe80::1", Ib), ("fe80::2", Ib)]);
        assert_eq!(pick(&[], &local), 0);
        assert!(
            select_gid(&cfg(&[]), &local)
                .reason
                .contains("has no routable FLID")
        );
    }

    #[test]
    fn empty_tables_fall_back_to_index_0() {
        assert_eq!(pick(&[], &eth(&[])), 0);
    }

    #[test]
    fn choices_pass_validation_on_the_whole_corpus() {
        for (file, ports) in whole_corpus() {
            for p in ports {
                let c = select_gid(&cfg(&[]), &p);
                ncclwasm_model::validate::check_gid(&c, &p)
                    .unwrap_or_else(|e| panic!("{file} {}: {e}", p.device));
            }
        }
        // The derived Ethernet table's RoCEv2 entry is what the default picks on the soft fabric.
        assert_eq!(pick(&[], &corpus("loopback.toml")[1]), 1);
        assert_eq!(pick(&[], named(&corpus("mixed-ib-roce.toml"), "mlx5_2")), 1);
    }
}
