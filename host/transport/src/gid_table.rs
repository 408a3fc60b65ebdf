//! A device's GID tables as its async-event thread last read them, and what an
//! `IBV_EVENT_GID_CHANGE` changed in one (nccl#1819): read again through verbs, logged slot by
//! slot, a vanished or changed entry WARNed about, and the new table handed to the decision
//! maker.

use std::collections::HashMap;
use std::net::Ipv6Addr;

use ncclwasm_model::{Gid, GidType};
use ncclwasm_verbs::{Context, VerbsError};

use crate::device::DevCtx;
use ncclwasm_model::decide::Decisions;

/// The GID table of each port of one device as the event thread last read it, so that an
/// `IBV_EVENT_GID_CHANGE` (an address of the port's interface added or removed) can say what
/// changed. NCCL's net_ib only logs the event (nccl#1819), and its connections keep the GID
/// index chosen at init; here the table is read again, the change logged, a vanished or changed
/// entry WARNed about, and the new table handed to the decision maker.
///
/// The transport reads the tables through verbs (`query_port`, `query_gid`), as discovery does;
/// what only sysfs says of an entry (its RoCE type, its subnet's prefix) it does not read, so
/// entries carry `GidType::Unknown` and prefix 0 and the decision maker keeps what it knew of an
/// entry whose bytes did not change.
#[derive(Debug)]
pub(crate) struct GidTables(HashMap<u8, Vec<Gid>>);

impl GidTables {
    /// Every port's table now; a port that cannot be read has none (its first change is then
    /// told as all additions).
    pub(crate) fn read(dev: &DevCtx) -> GidTables {
        let ports = 1..=dev.attr.phys_port_cnt;
        GidTables(
            ports
                .filter_map(|p| Some((p, read_gids(&dev.ctx, p).ok()?)))
                .collect(),
        )
    }

    /// Port `port` of `dev` says its table changed: read it again, log what changed (INFO) and
    /// WARN about configured entries that changed or vanished, and hand the table to
    /// `decisions`.
    pub(crate) fn changed(&mut self, dev: &DevCtx, port: u8, decisions: &dyn Decisions) {
        let now = match read_gids(&dev.ctx, port) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(
                    "NET/WASM: {} port {port}: its GID table changed but cannot be read: {e}",
                    dev.name()
                );
                return;
            }
        };
        let before = self.0.get(&port).map(Vec::as_slice).unwrap_or_default();
        let changes = gid_changes(before, &now);
        log_gid_changes(dev.name(), port, &changes, dev.gid_in_use(port));
        decisions.gids_changed(dev.name(), port, &now);
        self.0.insert(port, now);
    }
}

/// Port `port`'s GID table as verbs reports it: every slot up to `gid_tbl_len`, an empty or
/// unreadable one as an unconfigured entry (as discovery keeps them).
fn read_gids(ctx: &Context, port: u8) -> Result<Vec<Gid>, VerbsError> {
    let len = ctx.query_port(port)?.gid_tbl_len;
    Ok((0..len)
        .map(|index| Gid {
            index,
            raw: ctx.query_gid(port, index).unwrap_or([0; 16]),
            gid_type: GidType::Unknown,
            prefix_len: 0,
        })
        .collect())
}

/// A slot of a GID table whose configured entry changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GidSlotChange {
    Added {
        index: u32,
        addr: Ipv6Addr,
    },
    Removed {
        index: u32,
        addr: Ipv6Addr,
    },
    Replaced {
        index: u32,
        before: Ipv6Addr,
        after: Ipv6Addr,
    },
}

impl GidSlotChange {
    /// The address connections over this slot used, unless the slot had none.
    fn lost(&self) -> Option<(u32, Ipv6Addr)> {
        match *self {
            GidSlotChange::Added { .. } => None,
            GidSlotChange::Removed { index, addr } => Some((index, addr)),
            GidSlotChange::Replaced { index, before, .. } => Some((index, before)),
        }
    }
}

impl std::fmt::Display for GidSlotChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GidSlotChange::Added { index, addr } => write!(f, "index {index} added {addr}"),
            GidSlotChange::Removed { index, addr } => write!(f, "index {index} removed {addr}"),
            GidSlotChange::Replaced {
                index,
                before,
                after,
            } => write!(f, "index {index} {before} -> {after}"),
        }
    }
}

/// The slots whose configured entry differs between the two tables, by index.
fn gid_changes(before: &[Gid], after: &[Gid]) -> Vec<GidSlotChange> {
    let entry = |table: &[Gid], index: u32| {
        table
            .iter()
            .find(|g| g.index == index && !g.is_unconfigured())
            .map(Gid::addr)
    };
    let mut indices: Vec<u32> = before.iter().chain(after).map(|g| g.index).collect();
    indices.sort_unstable();
    indices.dedup();
    indices
        .into_iter()
        .filter_map(|index| match (entry(before, index), entry(after, index)) {
            (None, Some(addr)) => Some(GidSlotChange::Added { index, addr }),
            (Some(addr), None) => Some(GidSlotChange::Removed { index, addr }),
            (Some(b), Some(a)) if b != a => Some(GidSlotChange::Replaced {
                index,
                before: b,
                after: a,
            }),
            _ => None,
        })
        .collect()
}

/// One INFO line with what changed in `device` port `port`'s GID table, and one WARN line when
/// the entry the port's connections use (`in_use`, chosen at init and kept) changed or vanished:
/// a connection made over it from now on fails, or talks from the new address.
fn log_gid_changes(device: &str, port: u8, changes: &[GidSlotChange], in_use: Option<u32>) {
    if changes.is_empty() {
        tracing::info!("NET/WASM: {device} port {port}: GID table read again, no entry changed");
        return;
    }
    let all: Vec<String> = changes.iter().map(ToString::to_string).collect();
    tracing::info!(
        "NET/WASM: {device} port {port}: GID table changed: {}",
        all.join(", ")
    );
    let lost = changes
        .iter()
        .filter_map(GidSlotChange::lost)
        .find(|&(index, _)| Some(index) == in_use);
    if let Some((index, addr)) = lost {
        tracing::warn!(
            "NET/WASM: {device} port {port}: GID index {index} ({addr}), the one this port's \
             connections use (chosen at init and kept), changed or vanished: its new \
             connections will fail, or use the new address"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: &[(u32, &str)]) -> Vec<Gid> {
        entries
            .iter()
            .map(|&(i, a)| Gid::new(i, a.parse().unwrap(), GidType::Unknown, 0))
            .collect()
    }

    /// What a `GID_CHANGE` is told as: by slot, a configured entry added, removed or replaced;
    /// a slot that stays empty (`::`, `fe80::`) or keeps its address is no change.
    #[test]
    fn gid_changes_are_told_by_slot() {
        let before = table(&[
            (0, "fe80::1"),
            (1, "::ffff:10.0.0.1"),
            (2, "::ffff:10.0.0.2"),
            (3, "::"),
            (4, "fe80::"),
        ]);
        let after = table(&[
            (0, "fe80::1"),
            (1, "::"),
            (2, "::ffff:10.0.0.3"),
            (3, "::ffff:10.0.1.1"),
            (4, "::"),
            (5, "fe80::5"),
        ]);
        let addr = |a: &str| a.parse::<Ipv6Addr>().unwrap();
        let changes = gid_changes(&before, &after);
        assert_eq!(
            changes,
            [
                GidSlotChange::Removed {
                    index: 1,
                    addr: addr("::ffff:10.0.0.1")
                },
                GidSlotChange::Replaced {
                    index: 2,
                    before: addr("::ffff:10.0.0.2"),
                    after: addr("::ffff:10.0.0.3")
                },
                GidSlotChange::Added {
                    index: 3,
                    addr: addr("::ffff:10.0.1.1")
                },
                GidSlotChange::Added {
                    index: 5,
                    addr: addr("fe80::5")
                },
            ]
        );
        let lost: Vec<_> = changes.iter().filter_map(GidSlotChange::lost).collect();
        assert_eq!(
            lost,
            [(1, addr("::ffff:10.0.0.1")), (2, addr("::ffff:10.0.0.2"))]
        );
        assert_eq!(
            changes[1].to_string(),
            "index 2 ::ffff:10.0.0.2 -> ::ffff:10.0.0.3"
        );
        assert!(gid_changes(&after, &after).is_empty());
    }
}
