//! Devices and ports of the soft fabric, built from a topology file, and the address
//! resolution that turns a QP's `ah_attr` (GID or LID) into the IP address of the peer's port.

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, Weak};

use ibverbs_sys::{ibv_device, ibv_node_type, ibv_port_state, ibv_transport_type};
use ncclwasm_model::topology::{Device, DevicePort};
use ncclwasm_model::{AddrFamily, PortState, Topology};

use super::ctx::Ctx;
use super::link_watch::PortLink;
use crate::abi::plain;

/// An `ibv_device` with the soft device behind it. `ibv` comes first so the pointer handed to
/// the caller is also a pointer to this struct.
#[repr(C)]
pub(crate) struct SoftDevice {
    pub ibv: ibv_device,
    pub desc: Device,
    /// Live port states (their interface's link and fault injection flip them), indexed like
    /// `desc.ports`.
    port_states: Mutex<Vec<PortState>>,
    /// What the `link_watch` module last saw of each port's interface, indexed like `desc.ports`.
    pub links: Mutex<Vec<PortLink>>,
    /// Set by [`super::fault::kill_device`]: every verb on it fails from then on.
    pub dead: AtomicBool,
    /// Open contexts, for events that concern every user of the device.
    pub contexts: Mutex<Vec<Weak<Ctx>>>,
    pub name_c: CString,
}

impl std::fmt::Debug for SoftDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftDevice")
            .field("name", &self.desc.name)
            .finish_non_exhaustive()
    }
}

impl SoftDevice {
    fn new(desc: Device, index: usize) -> SoftDevice {
        let mut ibv: ibv_device = plain::zeroed();
        ibv.node_type = ibv_node_type::IBV_NODE_CA;
        ibv.transport_type = ibv_transport_type::IBV_TRANSPORT_IB;
        copy_c(&mut ibv.name, &desc.name);
        copy_c(&mut ibv.dev_name, &format!("uverbs{index}"));
        copy_c(
            &mut ibv.dev_path,
            &format!("/sys/class/infiniband_verbs/uverbs{index}"),
        );
        copy_c(
            &mut ibv.ibdev_path,
            &format!("/sys/class/infiniband/{}", desc.name),
        );
        SoftDevice {
            ibv,
            port_states: Mutex::new(desc.ports.iter().map(|p| p.state).collect()),
            links: Mutex::new(desc.ports.iter().map(|_| PortLink::default()).collect()),
            dead: AtomicBool::new(false),
            contexts: Mutex::new(Vec::new()),
            name_c: CString::new(desc.name.clone()).unwrap_or_default(),
            desc,
        }
    }

    /// The port with verbs number `num` (1-based, as in the file).
    pub(crate) fn port(&self, num: u8) -> Option<&DevicePort> {
        self.desc.ports.iter().find(|p| p.port == num)
    }

    /// The live state of port `num`, as `ibv_port_state`.
    pub(crate) fn port_state(&self, num: u8) -> Option<ibv_port_state::Type> {
        let i = self.desc.ports.iter().position(|p| p.port == num)?;
        let states = self.port_states.lock().unwrap_or_else(|e| e.into_inner());
        Some(match states[i] {
            PortState::Down => ibv_port_state::IBV_PORT_DOWN,
            PortState::Initializing => ibv_port_state::IBV_PORT_INIT,
            PortState::Armed => ibv_port_state::IBV_PORT_ARMED,
            PortState::Active => ibv_port_state::IBV_PORT_ACTIVE,
        })
    }

    pub(crate) fn port_active(&self, num: u8) -> bool {
        self.port_state(num) == Some(ibv_port_state::IBV_PORT_ACTIVE)
    }

    /// Changes a port's state; `false` if there is no such port or nothing changed.
    pub(crate) fn set_port_state(&self, num: u8, state: PortState) -> bool {
        let Some(i) = self.desc.ports.iter().position(|p| p.port == num) else {
            return false;
        };
        let mut states = self.port_states.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut states[i], state) != state
    }

    /// Calls `f` on every open context of the device: how events that concern every user of
    /// the device (a port's, the device's) reach them.
    pub(crate) fn each_context(&self, f: impl Fn(&Ctx)) {
        let ctxs: Vec<_> = self
            .contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for c in ctxs {
            f(&c);
        }
    }

    /// Highest port number (`phys_port_cnt`).
    pub(crate) fn port_count(&self) -> u8 {
        self.desc.ports.iter().map(|p| p.port).max().unwrap_or(0)
    }

    /// Distinct bind addresses of the ports, in port order: where this device listens.
    pub(crate) fn addresses(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::new();
        for p in &self.desc.ports {
            if !out.contains(&p.address) {
                out.push(p.address);
            }
        }
        out
    }
}

fn copy_c(dst: &mut [std::os::raw::c_char], src: &str) {
    let room = dst.len() - 1;
    for (d, s) in dst.iter_mut().zip(src.bytes().take(room)) {
        *d = s as std::os::raw::c_char;
    }
}

/// The process's soft devices (per loaded copy of this code): built once from
/// `NCCL_WASM_TOPOLOGY` (or the embedded loopback topology), never freed, so device pointers
/// stay valid for the life of the process as the libibverbs contract asks.
#[derive(Debug)]
pub(crate) struct Fabric {
    pub topology: Topology,
    pub devices: Vec<SoftDevice>,
}

static FABRIC: OnceLock<Result<Fabric, String>> = OnceLock::new();

/// The fabric, loading the topology on first use; `Err` carries a message naming the file.
pub(crate) fn fabric() -> Result<&'static Fabric, &'static str> {
    FABRIC
        .get_or_init(|| {
            let topology = match std::env::var_os("NCCL_WASM_TOPOLOGY") {
                Some(path) if !path.is_empty() => Topology::load(&path),
                _ => Ok(Topology::loopback()),
            }
            .map_err(|e| e.to_string())?;
            Ok(Fabric::new(topology))
        })
        .as_ref()
        .map_err(String::as_str)
}

impl Fabric {
    pub(crate) fn new(topology: Topology) -> Fabric {
        let devices = topology
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| SoftDevice::new(d.clone(), i))
            .collect();
        Fabric { topology, devices }
    }

    /// Every port of the fabric, for resolving GIDs and LIDs of local peers.
    fn ports(&self) -> impl Iterator<Item = &DevicePort> {
        self.topology.devices.iter().flat_map(|d| d.ports.iter())
    }

    /// Where a QP whose `ah_attr` names `dgid` (when `is_global`) or `dlid` sends its traffic,
    /// seen from a QP bound to `local`.
    ///
    /// - A GID of a port in the topology resolves to that port's address (covers IB GIDs, which
    ///   carry no IP).
    /// - An IPv4-mapped GID (`::ffff:a.b.c.d`, the RoCEv2 IPv4 form) is that IPv4 address; any
    ///   other routable GID is taken as an IPv6 address.
    /// - A LID of a port in the topology resolves to its address; any other LID is the host part
    ///   of an address in the local port's IPv4 /16 (the soft "subnet manager" rule: LIDs are
    ///   unique per subnet, and a soft IB subnet is an IPv4 /16).
    pub(crate) fn resolve(
        &self,
        local: &DevicePort,
        dgid: Option<[u8; 16]>,
        dlid: u16,
    ) -> Option<IpAddr> {
        if let Some(raw) = dgid {
            if let Some(p) = self
                .ports()
                .find(|p| p.gids.iter().any(|g| g.raw == raw && !g.is_unconfigured()))
            {
                return Some(p.address);
            }
            let gid = ncclwasm_model::Gid::new(
                0,
                Ipv6Addr::from(raw),
                ncclwasm_model::GidType::Unknown,
                0,
            );
            if raw == [0; 16] || gid.is_link_local() {
                return None;
            }
            return Some(match gid.family() {
                AddrFamily::Ipv4 => IpAddr::V4(Ipv4Addr::new(raw[12], raw[13], raw[14], raw[15])),
                AddrFamily::Ipv6 => IpAddr::V6(Ipv6Addr::from(raw)),
            });
        }
        if dlid == 0 {
            return None;
        }
        if let Some(p) = self.ports().find(|p| p.lid == dlid) {
            return Some(p.address);
        }
        match local.address {
            IpAddr::V4(v4) => {
                let net = u32::from(v4) & 0xffff_0000;
                Some(IpAddr::V4(Ipv4Addr::from(net | u32::from(dlid))))
            }
            IpAddr::V6(_) => None,
        }
    }
}

/// Whether the device behind `ibv` is still usable (not killed by fault injection).
pub(crate) fn alive(dev: &SoftDevice) -> bool {
    !dev.dead.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOPO: &str = r#"
name = "t"
[[devices]]
name = "ib_0"
guid = "0x0002c90300000010"
[[devices.ports]]
port = 1
link-layer = "infiniband"
speed-mbps = 200000
lid = 7
address = "127.0.0.3"
[[devices]]
name = "roce_0"
guid = "0x0002c90300000020"
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
address = "127.0.0.1"
"#;

    #[test]
    fn resolves_gids_and_lids_to_addresses() {
        let f = Fabric::new(Topology::parse(TOPO, "t").expect("valid"));
        let roce = f.devices[1].port(1).expect("port 1").clone();
        let ib = f.devices[0].port(1).expect("port 1").clone();
        // An IB GID (no IP inside) resolves through the topology.
        let ib_gid = ib.gids[0].raw;
        assert_eq!(
            f.resolve(&roce, Some(ib_gid), 0),
            Some("127.0.0.3".parse().expect("ip"))
        );
        // IPv4-mapped RoCEv2 GIDs carry the address.
        let mapped: Ipv6Addr = "::ffff:10.1.2.3".parse().expect("gid");
        assert_eq!(
            f.resolve(&roce, Some(mapped.octets()), 0),
            Some("10.1.2.3".parse().expect("ip"))
        );
        let v6: Ipv6Addr = "fd00::5".parse().expect("gid");
        assert_eq!(f.resolve(&roce, Some(v6.octets()), 0), Some(IpAddr::V6(v6)));
        assert_eq!(f.resolve(&roce, Some([0; 16]), 0), None);
        // LIDs: the topology's first, then the /16 rule.
        assert_eq!(
            f.resolve(&roce, None, 7),
            Some("127.0.0.3".parse().expect("ip"))
        );
        assert_eq!(
            f.resolve(&ib, None, 0x0102),
            Some("127.0.1.2".parse().expect("ip"))
        );
        assert_eq!(f.resolve(&ib, None, 0), None);
        assert_eq!(f.devices[0].port_count(), 1);
        assert!(f.devices[0].set_port_state(1, PortState::Down));
        assert!(!f.devices[0].port_active(1));
        assert!(!f.devices[0].set_port_state(1, PortState::Down));
    }

    #[test]
    fn embedded_default_is_the_loopback_topology() {
        let t = Topology::loopback();
        assert!(t.devices.iter().all(|d| {
            d.ports
                .iter()
                .all(|p| p.address == IpAddr::V4(Ipv4Addr::LOCALHOST))
        }));
    }
}
