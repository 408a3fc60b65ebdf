//! Discovery: every port of every device as a [`ncclwasm_model::Port`], as `ncclIbInitDevices`
//! gathers it (verbs for what the device says, sysfs for the rest).

use std::cell::OnceCell;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use ncclwasm_model::topology::merged_pci_path;
use ncclwasm_model::{AddrFamily, Gid, GidType, LinkLayer, Port, PortState};

use crate::device::{Context, Fabric};
use crate::sysfs::Sysfs;

/// Prefix length of IB and link-local GIDs (the IB subnet prefix is 64 bits).
const IB_PREFIX: u8 = 64;

/// `NCCL_IB_MERGE_VFS` as NCCL reads it: anything but `0` (and unset) merges a virtual function's
/// PCI path into its physical function's, so NCCL's topology sees them as one NIC.
pub fn merge_vfs_from_env() -> bool {
    std::env::var("NCCL_IB_MERGE_VFS").map_or(true, |v| v.trim() != "0")
}

impl Fabric {
    /// All ports of all devices, numbered in discovery order. A device or port that cannot be
    /// queried is skipped with a WARN, as NCCL does; no library devices means an empty list.
    /// `merge_vfs` is `NCCL_IB_MERGE_VFS` (default 1) for the PCI path rule.
    pub fn discover(self: &Arc<Self>, merge_vfs: bool) -> Vec<Port> {
        let sysfs = Sysfs::open(&self.provider.sysfs);
        let addresses = OnceCell::new();
        let mut ports = Vec::new();
        // Held across the loop: every open below shares this one read of the list.
        let _held = self.device_list();
        for name in self.device_names() {
            let ctx = match self.open(&name) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("skipping device {name}: {e}");
                    continue;
                }
            };
            if let Err(e) = discover_device(&ctx, &sysfs, &addresses, merge_vfs, &mut ports) {
                tracing::warn!("skipping device {name}: {e}");
            }
        }
        ports
    }
}

/// The host's interface addresses, read once per discovery when a GID first needs its prefix.
type Addresses = OnceCell<Vec<Address>>;

fn discover_device(
    ctx: &Context,
    sysfs: &Sysfs,
    addresses: &Addresses,
    merge_vfs: bool,
    ports: &mut Vec<Port>,
) -> crate::error::Result<()> {
    let name = ctx.name();
    let dev = ctx.query_device()?;
    let full_pci_path = sysfs.pci_path(name).unwrap_or_default();
    let pci_path = if full_pci_path.is_empty() {
        String::new()
    } else {
        merged_pci_path(&full_pci_path, merge_vfs)
    };
    let numa_node = sysfs.numa_node(name);
    let provider = sysfs
        .driver(name)
        .unwrap_or_else(|| provider_from_name(name));
    for port in 1..=dev.phys_port_cnt {
        let attr = match ctx.query_port(port) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("skipping {name} port {port}: {e}");
                continue;
            }
        };
        // Every slot the kernel reports, as NCCL's scan walks them up to `gid_tbl_len`: an
        // unconfigured slot still counts (NCCL's family rule may pick one), so the live table is
        // the one a captured topology and `ncclwasm policy explain` show.
        // An Ethernet port's GID types are read for every slot, whatever its GID (IB GIDs are
        // all of type IB).
        let types = match attr.link_layer {
            LinkLayer::Ethernet => sysfs.roce_gid_types(name, port, attr.gid_tbl_len),
            LinkLayer::Infiniband => Vec::new(),
        };
        let gids: Vec<Gid> = (0..attr.gid_tbl_len)
            .map(|index| {
                let raw = ctx.query_gid(port, index).unwrap_or_else(|e| {
                    tracing::debug!("{name} port {port}: {e}");
                    [0; 16]
                });
                let roce = types.get(index as usize).copied();
                gid(sysfs, addresses, name, port, index, raw, roce)
            })
            .collect();
        ports.push(Port {
            index: ports.len() as u32,
            device: name.to_owned(),
            port,
            state: attr.state,
            link_layer: attr.link_layer,
            // A link that is not up has no speed (its active_speed bits are stale or zero,
            // which ncclIbSpeed would read as the fastest entry); NCCL never uses such a port.
            speed_mbps: if attr.state == PortState::Active {
                attr.speed_mbps
            } else {
                0
            },
            width: attr.width,
            mtu: attr.mtu,
            lid: attr.lid,
            pci_path: pci_path.clone(),
            full_pci_path: full_pci_path.clone(),
            guid: dev.sys_image_guid,
            numa_node,
            max_qps: dev.max_qp,
            provider: provider.clone(),
            gids,
        });
    }
    Ok(())
}

/// A GID entry with its type and the prefix length of the subnet it sits in. `roce` is the
/// slot's type as sysfs gives it on an Ethernet port, `None` on an IB port. An unconfigured slot
/// keeps the bytes the kernel gave (`::` or `fe80::`) and whatever type sysfs gives (on a kernel
/// the read fails: `unknown`), with no prefix.
fn gid(
    sysfs: &Sysfs,
    addresses: &Addresses,
    dev: &str,
    port: u8,
    index: u32,
    raw: [u8; 16],
    roce: Option<GidType>,
) -> Gid {
    let probe = Gid {
        index,
        raw,
        gid_type: GidType::Unknown,
        prefix_len: 0,
    };
    let Some(gid_type) = roce else {
        if probe.is_unconfigured() {
            return probe;
        }
        return Gid {
            gid_type: GidType::Ib,
            prefix_len: IB_PREFIX,
            ..probe
        };
    };
    if probe.is_unconfigured() {
        return Gid { gid_type, ..probe };
    }
    let prefix_len = if probe.is_link_local() {
        IB_PREFIX
    } else {
        sysfs
            .gid_netdev(dev, port, index)
            .and_then(|ndev| interface_prefix(addresses.get_or_init(addresses_now), &ndev, &probe))
            .unwrap_or(0)
    };
    Gid {
        gid_type,
        prefix_len,
        ..probe
    }
}

/// One address of an interface, with its prefix length.
struct Address {
    interface: String,
    addr: IpAddr,
    prefix_len: u8,
}

/// The prefix length of the address `gid` carries on interface `ndev`, among `addresses`.
fn interface_prefix(addresses: &[Address], ndev: &str, gid: &Gid) -> Option<u8> {
    let v6 = Ipv6Addr::from(gid.raw);
    let want: IpAddr = match gid.family() {
        AddrFamily::Ipv4 => IpAddr::V4(v6.to_ipv4_mapped()?),
        AddrFamily::Ipv6 => IpAddr::V6(v6),
    };
    addresses
        .iter()
        .find(|a| a.interface == ndev && a.addr == want)
        .map(|a| a.prefix_len)
}

/// Every interface address of this host (`getifaddrs`): one netlink dump per discovery, not one
/// per GID (a machine of thousands of RoCE ports asked the kernel thousands of times).
fn addresses_now() -> Vec<Address> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the list is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut found = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned, which stays valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: non-NULL sockaddrs of the live list, read per their family.
        let Some((addr, prefix_len)) =
            (unsafe { address_and_prefix(ifa.ifa_addr, ifa.ifa_netmask) })
        else {
            continue;
        };
        // SAFETY: ifa_name is a NUL-terminated string of the live list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        found.push(Address {
            interface: name.to_string_lossy().into_owned(),
            addr,
            prefix_len,
        });
    }
    // SAFETY: frees the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// An IPv4 or IPv6 address and its netmask's length.
///
/// # Safety
/// `addr` and `mask` must point at valid sockaddrs of the same family.
unsafe fn address_and_prefix(
    addr: *const libc::sockaddr,
    mask: *const libc::sockaddr,
) -> Option<(IpAddr, u8)> {
    // SAFETY: the caller guarantees valid sockaddrs; the family says which struct it is.
    unsafe {
        match i32::from((*addr).sa_family) {
            libc::AF_INET => {
                let a = &*addr.cast::<libc::sockaddr_in>();
                let m = &*mask.cast::<libc::sockaddr_in>();
                Some((
                    IpAddr::V4(u32::from_be(a.sin_addr.s_addr).into()),
                    m.sin_addr.s_addr.count_ones() as u8,
                ))
            }
            libc::AF_INET6 => {
                let a = &*addr.cast::<libc::sockaddr_in6>();
                let m = &*mask.cast::<libc::sockaddr_in6>();
                let bits: u32 = m.sin6_addr.s6_addr.iter().map(|b| b.count_ones()).sum();
                Some((IpAddr::V6(a.sin6_addr.s6_addr.into()), bits as u8))
            }
            _ => None,
        }
    }
}

/// When sysfs has no driver link: the device name without its index (`mlx5_0` → `mlx5`).
fn provider_from_name(name: &str) -> String {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    stem.strip_suffix('_').unwrap_or(stem).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names() {
        assert_eq!(provider_from_name("mlx5_0"), "mlx5");
        assert_eq!(provider_from_name("rxe0"), "rxe");
        assert_eq!(provider_from_name("soft"), "soft");
    }

    #[test]
    fn loopback_prefix() {
        let g = Gid::new(
            1,
            std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            GidType::RoceV2,
            0,
        );
        let now = addresses_now();
        assert_eq!(interface_prefix(&now, "lo", &g), Some(8));
        assert_eq!(interface_prefix(&now, "nonexistent0", &g), None);
    }
}
