//! [`Net`]: the process-wide network context — the fabric, the decision maker, the device table
//! NCCL sees (physical devices, then vNICs), and `listen`/`connect`.
//!
//! Devices are decided once, when the context is made (NCCL caches them): discovery gives the
//! ports, the policy selects and orders them (`select-devices`), picks each one's GID
//! (`select-gid`) and may fuse some into one device (`group-devices`); NCCL core's own fusion
//! requests go through `make-vnic`. Every decision is logged at INFO with its reason and source.
//! What NCCL's device numbers, names and members are is not decided here: the
//! [`DeviceTable`] makes them of those decisions (and of which NICs have a Data Direct
//! function), as it does for `ncclwasm policy explain`.

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};

use ncclwasm_model::device_table::{
    DeviceTable, RailPlane, TableDevice, TableEnv, data_direct_name,
};
use ncclwasm_model::telemetry::{Telemetry, TelemetrySource};
use ncclwasm_model::{LinkLayer, NetAttr, OneSided, Port, PortState, VnicAnswer};
use ncclwasm_verbs::Fabric;

use crate::device::{DevCtx, EventThread, PortCtx};
use crate::gpu::{GpuEnv, GpuSupport};
use crate::listener::Listener;
use crate::net_error::NetError;
use crate::oob::{OobChoice, OobEnv};
use crate::oob_host::{announce, choose_on_host};
use crate::profile::Profiler;
use crate::qp::random_u64;
use crate::send::{Connecting, SendComm};
use crate::socket::Stream;
use crate::telemetry::{FileWriter, MeterSpec, Registry, TelemetryFormat};
use ncclwasm_model::decide::Decisions;
use ncclwasm_proto::MAX_QPS;
use ncclwasm_proto::handle::ListenHandle;
use ncclwasm_proto::handle::{HANDLE_SCRATCH, HANDLE_SIZE};
use ncclwasm_proto::handshake::Connector;
use ncclwasm_proto::handshake::{AcceptorConfig, ConnectorConfig};

/// How to make a [`Net`]: the fabric is chosen and opened by the caller (the plugin picks it from
/// its environment), so the transport runs on whatever provider it is handed.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// The verbs fabric that carries the data.
    pub fabric: Arc<Fabric>,
    /// Refuse to start unless a selected port is active (NCCL then falls back to its own
    /// transports); off when the caller asked for this fabric explicitly.
    pub require_active_port: bool,
    /// How many devices a vNIC may fuse (4 for NCCL's v9–v11 ABI, 8 for v12).
    pub max_devs_per_nic: usize,
    /// Who decides (the policy engine, in the plugin).
    pub decisions: Arc<dyn Decisions>,
    /// NCCL's out-of-band settings (`NCCL_SOCKET_IFNAME`, …), read by the caller: they pick
    /// the address every handshake listener binds, as they pick NCCL's own.
    pub oob: OobEnv,
}

/// Per-communicator values NCCL hands the plugin (v10 `connect` config, v11+ `init`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommConfig {
    pub comm_id: u64,
    /// -1 when undefined.
    pub traffic_class: i32,
    /// NCCL's latest `setNetAttr` hint for the communicator, handed to the plan.
    pub net_attr: Option<NetAttr>,
    /// For a connection of one-sided traffic, where it sits in its RMA communicator.
    pub one_sided: Option<OneSided>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            comm_id: 0,
            traffic_class: -1,
            net_attr: None,
            one_sided: None,
        }
    }
}

/// One device as NCCL sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProps {
    /// As net_ib names it, not necessarily unique (vNICs: children joined by `+`); see
    /// [`ncclwasm_model::device_table`].
    pub name: String,
    /// Empty when unknown (virtual devices).
    pub pci_path: String,
    /// The first port's `sys_image_guid` as verbs returns it (network byte order), which is
    /// what net_ib reports; [`ncclwasm_model::Port::guid`] holds it in host order.
    pub guid: u64,
    pub speed_mbps: u32,
    /// The device table's port number: the first port's verbs port plus its earlier devices
    /// on the same card.
    pub port: u8,
    /// Connections the device can carry: its first port's device QP limit (`max_qp`), for a
    /// vNIC too, as net_ib reports it.
    pub max_comms: u32,
    pub link_layer: LinkLayer,
    /// The physical NCCL devices it is made of (`vProps`): itself for a physical device.
    pub children: Vec<u32>,
    /// v12's `railId` and `planeId` (see [`ncclwasm_model::device_table`]).
    pub ids: RailPlane,
    /// `ptrSupport`: `NCCL_PTR_*` bits ([`crate::PTR_HOST`] …), from [`Net::gpu_support`].
    pub ptr_support: u32,
    /// `forceFlush`: NCCL must flush receives on this device (mlx5 Data Direct).
    pub force_flush: bool,
}

#[derive(Debug)]
struct NetDevice {
    props: DeviceProps,
    /// Indices into `NetInner::ports`.
    ports: Vec<usize>,
}

/// The device table and, for each of its devices, what the data path needs of it.
#[derive(Debug)]
struct Devices {
    /// Numbers, names and members, as [`DeviceTable`] decides them.
    table: DeviceTable,
    net: Vec<NetDevice>,
}

#[derive(Debug)]
struct NetInner {
    /// First, so the event threads stop before anything else goes.
    _events: Vec<EventThread>,
    decisions: Arc<dyn Decisions>,
    fabric: Arc<Fabric>,
    /// Where handshake listeners bind, decided once like NCCL's `ncclIbIfAddr`.
    oob: OobChoice,
    /// The selected ports in NCCL order, then the Data Direct twins' ports in table order.
    ports: Vec<PortCtx>,
    devices: RwLock<Devices>,
    max_devs_per_nic: usize,
    /// Connections in progress, by the id written into the handle's scratch bytes.
    connecting: Mutex<HashMap<u64, Connecting>>,
    next_connect: AtomicU64,
    /// Every side's counters, for the policies' `telemetry` import.
    telemetry: Arc<Registry>,
    /// Their files, one per format at most, when asked for ([`Net::write_telemetry`]).
    telemetry_files: Mutex<Vec<FileWriter>>,
    /// NCCL's profiler ([`Net::set_profiler`]), for the communicators made from then on.
    profiler: RwLock<Option<Arc<dyn Profiler>>>,
}

/// The network context. Cheap to clone; the last clone (and every communicator) gone stops the
/// threads and closes the devices.
#[derive(Clone, Debug)]
pub struct Net {
    inner: Arc<NetInner>,
}

/// Marks a handle's scratch bytes as holding a connection in progress.
const SCRATCH_MAGIC: [u8; 8] = *b"NWCONN01";

impl Net {
    /// Chooses the out-of-band address, discovers the fabric's ports and asks the policy which
    /// NCCL sees. A bad out-of-band setting fails here, so NCCL's `init` reports it.
    pub fn new(config: NetConfig) -> Result<Net, NetError> {
        let oob = choose_on_host(&config.oob)?;
        announce(&oob);
        let fabric = config.fabric;
        let merge_vfs = ncclwasm_verbs::merge_vfs_from_env();
        let ports = fabric.discover(merge_vfs);
        tracing::info!(
            "NET/WASM: fabric {} has {} port(s)",
            fabric.name(),
            ports.len()
        );
        let decisions = config.decisions;
        decisions.live_ports(&ports);
        let telemetry = Registry::new(&ports);
        decisions.telemetry(Arc::clone(&telemetry) as Arc<dyn TelemetrySource>);
        let gpu_env = GpuEnv::from_env()?;
        let peer_memory = fabric.peer_memory_module();

        // The decision maker logs each decision with its reason and source; the lines here add
        // what the plugin made of it.
        let sel = decisions.select_devices(&ports)?;
        let selected: Vec<Port> = sel
            .value
            .ports
            .iter()
            .filter_map(|&i| ports.iter().find(|p| p.index == i).cloned())
            .collect();
        if ports.is_empty() {
            // No RDMA port at all (`auto` on a host without NICs): nothing to select from, and
            // NCCL falls back to another transport when `init` says so.
            return Err(NetError::NoDevice(format!(
                "fabric {} has no port",
                fabric.name()
            )));
        } else if selected.is_empty() {
            // Ports exist but the selection (NCCL_IB_HCA, or a policy) took none of them: as
            // NCCL's IB transport, init succeeds with no device, and NCCL falls back.
            tracing::warn!(
                "NET/WASM: no device: 0 of {} port(s) selected ({})",
                ports.len(),
                sel.reason
            );
        } else if config.require_active_port
            && !selected.iter().any(|p| p.state == PortState::Active)
        {
            return Err(NetError::NoDevice(format!(
                "none of the {} selected port(s) is active",
                selected.len()
            )));
        }

        let mut devs: HashMap<String, Arc<DevCtx>> = HashMap::new();
        let mut events = Vec::new();
        let mut port_ctxs = Vec::with_capacity(selected.len());
        for port in selected {
            let dev = match devs.get(&port.device) {
                Some(d) => Arc::clone(d),
                None => {
                    let mlx5 = port.provider == "mlx5";
                    let d =
                        DevCtx::open(&fabric, &port.device, &gpu_env, peer_memory.clone(), mlx5)?;
                    events.push(EventThread::start(
                        Arc::clone(&d),
                        Arc::clone(&decisions),
                        Arc::clone(&telemetry),
                    )?);
                    devs.insert(port.device.clone(), Arc::clone(&d));
                    d
                }
            };
            let choice = decisions.select_gid(&port)?;
            if port.endpoint(choice.value.index).gid.is_unconfigured() {
                // As NCCL: the port stays, and its connections fail (`unusable`).
                tracing::warn!(
                    "NET/WASM: {}:{}: GID index {} is not a configured entry of its table; connections on this port will fail",
                    port.device,
                    port.port,
                    choice.value.index
                );
            }
            tracing::info!(
                "NET/WASM: {}:{} uses GID index {} ({})",
                port.device,
                port.port,
                choice.value.index,
                choice.source
            );
            dev.use_gid(port.port, choice.value.index);
            let endpoint = port.endpoint(choice.value.index);
            port_ctxs.push(PortCtx {
                port: Arc::new(port),
                endpoint,
                dev,
            });
        }

        let selected: Vec<Port> = port_ctxs.iter().map(|p| (*p.port).clone()).collect();
        let groups = decisions.group_devices(&selected)?;
        // Each NIC once, in NCCL order (a refusal is logged).
        let mut data_direct = BTreeMap::new();
        for p in &port_ctxs {
            if let Some(path) = devs.remove(&p.port.device).and_then(|d| d.data_direct()) {
                data_direct.insert(p.port.device.clone(), path);
            }
        }
        let env = TableEnv {
            merge_vfs,
            data_direct_both: gpu_env.data_direct_both,
        };
        let ids: Vec<RailPlane> = decisions.rails(&sel.value, &selected);
        telemetry.set_rails(&selected, &ids);
        let table = DeviceTable::new(&selected, &groups.value, &data_direct, &ids, env);
        let net = physical_devices(&table, &mut port_ctxs)?;
        for (i, d) in net.iter().enumerate() {
            tracing::info!(
                "NET/WASM: device {i}: {} port {} ({} Mb/s, {} port(s), guid {:#018x})",
                d.props.name,
                d.props.port,
                d.props.speed_mbps,
                d.ports.len(),
                port_ctxs[d.ports[0]].port.guid
            );
        }
        Ok(Net {
            inner: Arc::new(NetInner {
                _events: events,
                decisions,
                fabric,
                oob,
                ports: port_ctxs,
                devices: RwLock::new(Devices { table, net }),
                max_devs_per_nic: config.max_devs_per_nic,
                connecting: Mutex::new(HashMap::new()),
                next_connect: AtomicU64::new(1),
                telemetry,
                telemetry_files: Mutex::new(Vec::new()),
                profiler: RwLock::new(None),
            }),
        })
    }

    /// The out-of-band address handshake listeners bind, and why it was chosen.
    pub fn oob(&self) -> &OobChoice {
        &self.inner.oob
    }

    /// The fabric's provider name (`"ib"` for a loaded libibverbs), for messages.
    pub fn fabric_name(&self) -> &'static str {
        self.inner.fabric.name()
    }

    /// Devices NCCL sees: physical ones first, then vNICs.
    pub fn device_count(&self) -> usize {
        self.devices().net.len()
    }

    /// How many of them are physical (not made by `make_vdevice`).
    pub fn physical_count(&self) -> usize {
        self.devices().table.physical_count()
    }

    fn devices(&self) -> std::sync::RwLockReadGuard<'_, Devices> {
        self.inner.devices.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn device(&self, dev: i64) -> Result<(DeviceProps, Vec<PortCtx>), NetError> {
        let devices = self.devices();
        let d = usize::try_from(dev)
            .ok()
            .and_then(|i| devices.net.get(i))
            .ok_or(NetError::BadDevice {
                dev,
                count: devices.net.len(),
            })?;
        let ports = d
            .ports
            .iter()
            .map(|&p| self.inner.ports[p].clone())
            .collect();
        Ok((d.props.clone(), ports))
    }

    /// `getProperties`.
    pub fn properties(&self, dev: i64) -> Result<DeviceProps, NetError> {
        self.device(dev).map(|(p, _)| p)
    }

    /// The ports device `dev` is made of (their `index` in discovery's table; a Data Direct
    /// twin's is its NIC port's), first one first: for tests and operator tools.
    pub fn device_ports(&self, dev: i64) -> Result<Vec<u32>, NetError> {
        self.device(dev)
            .map(|(_, ports)| ports.iter().map(|p| p.port.index).collect())
    }

    /// What was decided about GPU memory on device `dev` (a vNIC: its first device's, as
    /// net_ib's `ncclIbDmaBufSupport` looks at the first physical device), each with its reason.
    pub fn gpu_support(&self, dev: i64) -> Result<GpuSupport, NetError> {
        let (_, ports) = self.device(dev)?;
        Ok(ports[0].dev.gpu.clone())
    }

    /// `makeVDevice`: NCCL core asks to fuse physical devices; the policy's `make-vnic` accepts,
    /// reshapes or refuses. The new device is appended, named by [`DeviceTable::fuse`].
    pub fn make_vdevice(&self, request: &[u32]) -> Result<u32, NetError> {
        let inner = &*self.inner;
        let mut devices = inner.devices.write().unwrap_or_else(|p| p.into_inner());
        let refuse = |reason: String| NetError::Vnic {
            devices: request.to_vec(),
            reason,
        };
        // The policy sees one port per requested device (its first).
        let firsts = request
            .iter()
            .map(|&d| {
                devices
                    .table
                    .physical(d)
                    .map_err(|e| refuse(e.to_string()))?;
                Ok((*inner.ports[devices.net[d as usize].ports[0]].port).clone())
            })
            .collect::<Result<Vec<Port>, NetError>>()?;
        let answer = inner.decisions.make_vnic(request, &firsts)?;
        tracing::info!(
            "NET/WASM: make-vnic {request:?}: {:?} [{}]",
            answer.value,
            answer.source
        );
        let children = match &answer.value {
            VnicAnswer::Accept { .. } => request.to_vec(),
            VnicAnswer::Reshape { devices, .. } => devices.clone(),
            VnicAnswer::Refuse { reason } => return Err(refuse(reason.clone())),
        };
        if children.is_empty() || children.len() > inner.max_devs_per_nic {
            return Err(refuse(format!(
                "{} devices; a virtual NIC holds 1..={}",
                children.len(),
                inner.max_devs_per_nic
            )));
        }
        let index = devices
            .table
            .fuse(&children)
            .map_err(|e| refuse(e.to_string()))?;
        let members: Vec<usize> = children
            .iter()
            .flat_map(|&c| devices.net[c as usize].ports.iter().copied())
            .collect();
        let props = props_of(
            &inner.ports,
            &members,
            &devices.table.devices()[index as usize],
        );
        tracing::info!("NET/WASM: device {index}: virtual NIC {}", props.name);
        devices.net.push(NetDevice {
            props,
            ports: members,
        });
        Ok(index)
    }

    /// `listen` on device `dev`: a TCP listener on the out-of-band address (whatever the
    /// device, as `ncclIbListen`), and the 128-byte handle to give the peer.
    pub fn listen(&self, dev: i64) -> Result<(Listener, [u8; HANDLE_SIZE]), NetError> {
        let (_, ports) = self.device(dev)?;
        unusable(&ports)?;
        let listener = bind_listener(&self.inner.oob)?;
        listener
            .set_nonblocking(true)
            .map_err(NetError::io("making the listener non-blocking"))?;
        let addr = listener
            .local_addr()
            .map_err(NetError::io("reading the listener's address"))?;
        let nonce = random_u64();
        let handle = ListenHandle { addr, nonce }
            .encode()
            .map_err(NetError::protocol("listen"))?;
        let config = AcceptorConfig {
            endpoints: ports.iter().map(|p| p.endpoint.clone()).collect(),
            nonce,
            max_qps: max_qps(&ports),
        };
        // NCCL's `listen` names no communicator: the receiving side's id is unknown (0).
        let meter = self.meter(0, dev, false);
        let listener = Listener::new(listener, addr, config, ports, meter, self.profiler());
        Ok((listener, handle))
    }

    /// `connect` to the listener behind `handle`: `Ok(None)` means "call again with the same
    /// handle" (the connection in progress is kept, keyed by the handle's scratch bytes).
    pub fn connect(
        &self,
        dev: i64,
        handle: &mut [u8; HANDLE_SIZE],
        comm: CommConfig,
    ) -> Result<Option<SendComm>, NetError> {
        let inner = &*self.inner;
        let scratch = HANDLE_SCRATCH.start;
        let resumed = (handle[scratch..scratch + 8] == SCRATCH_MAGIC)
            .then(|| {
                let id = u64::from_le_bytes(handle[scratch + 8..scratch + 16].try_into().ok()?);
                let c = inner.connecting.lock().unwrap_or_else(|p| p.into_inner());
                let mut c = c;
                c.remove(&id)
            })
            .flatten();
        let mut connecting = match resumed {
            Some(c) => c,
            None => {
                let target = ListenHandle::decode(handle).map_err(NetError::protocol("connect"))?;
                let (props, ports) = self.device(dev)?;
                unusable(&ports)?;
                let machine = Connector::new(ConnectorConfig {
                    comm_id: comm.comm_id,
                    traffic_class: comm.traffic_class,
                    net_attr: comm.net_attr,
                    one_sided: comm.one_sided,
                    device: dev as u32,
                    device_name: props.name.clone(),
                    endpoints: ports.iter().map(|p| p.endpoint.clone()).collect(),
                    nonce: target.nonce,
                    max_qps: max_qps(&ports),
                })
                .map_err(NetError::protocol("connect"))?;
                let stream = Stream::connect(target.addr)?;
                Connecting::new(
                    machine,
                    stream,
                    ports,
                    Arc::clone(&inner.decisions),
                    self.meter(comm.comm_id, dev, true),
                    self.profiler(),
                )
            }
        };
        handle[HANDLE_SCRATCH].fill(0);
        match connecting.progress()? {
            Some(comm) => Ok(Some(comm)),
            None => {
                let id = inner.next_connect.fetch_add(1, Ordering::Relaxed);
                handle[scratch..scratch + 8].copy_from_slice(&SCRATCH_MAGIC);
                handle[scratch + 8..scratch + 16].copy_from_slice(&id.to_le_bytes());
                inner
                    .connecting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, connecting);
                Ok(None)
            }
        }
    }

    /// The counters of every port and open connection now: what a policy's `telemetry.read`
    /// returns (and the plugin's `NCCL_WASM_TELEMETRY_FILE`).
    pub fn telemetry(&self) -> Telemetry {
        self.inner.telemetry.snapshot()
    }

    /// Writes [`telemetry`](Self::telemetry) to `path` in `format` now and every `every`, from
    /// a thread of its own, until the context goes (or another path is given for that format).
    pub fn write_telemetry(
        &self,
        path: PathBuf,
        format: TelemetryFormat,
        every: Duration,
    ) -> Result<(), NetError> {
        let mut files = self
            .inner
            .telemetry_files
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // The old writer stops (and a metrics file goes) before the new one starts.
        files.retain(|w| w.format() != format);
        files.push(FileWriter::start(
            Arc::clone(&self.inner.telemetry),
            path,
            format,
            every,
        )?);
        Ok(())
    }

    /// NCCL's profiler (v10+ `init`): the communicators made from now on record their QP
    /// events and decisions with it.
    pub fn set_profiler(&self, profiler: Arc<dyn Profiler>) {
        *self
            .inner
            .profiler
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(profiler);
    }

    fn profiler(&self) -> Option<Arc<dyn Profiler>> {
        self.inner
            .profiler
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn meter(&self, comm_id: u64, dev: i64, sending: bool) -> MeterSpec {
        MeterSpec {
            registry: Arc::clone(&self.inner.telemetry),
            comm_id,
            device: dev as u32,
            sending,
        }
    }

    /// Registrations alive on the device of port `port` (tests and diagnostics).
    pub fn registrations(&self, port: usize) -> usize {
        self.inner.ports.get(port).map_or(0, |p| p.dev.mrs.len())
    }
}

/// How many QPs one connection may use on these ports: the smallest port limit, capped by
/// NCCL's 128.
/// A port whose GID is no configured entry (a forced `NCCL_IB_GID_INDEX` this port lacks) fails
/// its connections, as NCCL's fail when the NIC refuses that GID.
fn unusable(ports: &[PortCtx]) -> Result<(), NetError> {
    match ports.iter().find(|p| p.endpoint.gid.is_unconfigured()) {
        Some(p) => Err(NetError::NoDevice(format!(
            "{}:{}: GID index {} is not a configured entry of its table",
            p.port.device, p.port.port, p.endpoint.gid.index
        ))),
        None => Ok(()),
    }
}

fn max_qps(ports: &[PortCtx]) -> u32 {
    ports
        .iter()
        .map(|p| p.port.max_qps)
        .min()
        .unwrap_or(0)
        .min(MAX_QPS as u32)
}

/// The properties of device `device` of the table, made of the ports `members` (indices into
/// `ports`): its name, port, PCI path, children, rail and plane are the table's; for fused
/// devices the speeds add up and the rest is the first port's, its QP limit (`maxComms`)
/// included, as `ncclIbGetProperties` reads a vNIC's properties from its first child
/// (`ncclIbMakeVDeviceInternal` sums only the speed).
fn props_of(ports: &[PortCtx], members: &[usize], device: &TableDevice) -> DeviceProps {
    let first = &ports[members[0]].port;
    let gpu = &ports[members[0]].dev.gpu;
    DeviceProps {
        name: device.name.clone(),
        pci_path: device.pci_path.clone(),
        // As verbs reads it, in network byte order: net_ib hands NCCL `sys_image_guid` as is.
        guid: first.guid.to_be(),
        speed_mbps: members.iter().map(|&m| ports[m].port.speed_mbps).sum(),
        port: device.port,
        max_comms: ports[members[0]].dev.attr.max_qp,
        link_layer: first.link_layer,
        children: device.children.clone(),
        ids: device.ids,
        ptr_support: gpu.ptr_support(),
        force_flush: gpu.force_flush(),
    }
}

/// The data path's side of the table's physical devices. `ports` holds the selected ports in
/// NCCL order; the port of each Data Direct twin is appended to it (the NIC port's, on the
/// device of the NIC's Data Direct function, see [`DevCtx::data_direct_twin`], one per NIC).
fn physical_devices(
    table: &DeviceTable,
    ports: &mut Vec<PortCtx>,
) -> Result<Vec<NetDevice>, NetError> {
    let mut twins: HashMap<String, Arc<DevCtx>> = HashMap::new();
    let mut out = Vec::with_capacity(table.devices().len());
    for device in table.devices() {
        let mut members = Vec::with_capacity(device.members.len());
        for m in &device.members {
            if !m.data_direct {
                members.push(m.selected);
                continue;
            }
            let base = ports[m.selected].clone();
            let dev = match twins.get(base.dev.name()) {
                Some(t) => Arc::clone(t),
                None => {
                    let t = base.dev.data_direct_twin()?;
                    twins.insert(base.dev.name().to_owned(), Arc::clone(&t));
                    t
                }
            };
            let mut port = (*base.port).clone();
            port.device = data_direct_name(&base.port.device);
            port.pci_path = device.pci_path.clone();
            ports.push(PortCtx {
                port: Arc::new(port),
                endpoint: base.endpoint.clone(),
                dev,
            });
            members.push(ports.len() - 1);
        }
        out.push(NetDevice {
            props: props_of(ports, &members, device),
            ports: members,
        });
    }
    Ok(out)
}

/// Connections the kernel queues for a handshake listener before it refuses more: NCCL's own
/// listening sockets ask for 16384 (the kernel caps it at `net.core.somaxconn`), so a burst of
/// strangers does not push a real peer's SYN into retransmission while `accept` drains them.
const LISTEN_BACKLOG: i32 = 16384;

/// The handshake listener, on the out-of-band address with a port the kernel picks.
fn bind_listener(oob: &OobChoice) -> Result<TcpListener, NetError> {
    let bind = || -> std::io::Result<TcpListener> {
        let sock = Socket::new(
            Domain::for_address(oob.addr),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        sock.set_reuse_address(true)?;
        sock.bind(&oob.addr.into())?;
        sock.listen(LISTEN_BACKLOG)?;
        Ok(sock.into())
    };
    bind().map_err(NetError::io(format!(
        "binding a handshake listener on {} of {} ({})",
        oob.addr.ip(),
        oob.ifname,
        oob.reason
    )))
}
