//! Fabrics, devices and contexts: the top of the object tree.

use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ibverbs_sys::{
    _compat_ibv_port_attr, ibv_async_event, ibv_context, ibv_device, ibv_device_attr, ibv_gid,
    ibv_port_attr,
};
use ncclwasm_model::{LinkLayer, PortState};

use crate::error::{Result, VerbsError, check, last_errno};
use crate::ib;
use crate::provider::{Capabilities, Provider, SysfsTree};
use crate::table::VerbsTable;

/// One verbs library: a provider's table plus where its discovery extras live.
///
/// Everything opened from a fabric holds it (through `Arc`s), so the library stays loaded until
/// the last object is gone.
#[derive(Debug)]
pub struct Fabric {
    pub(crate) provider: Provider,
    /// The `dlopen`ed library behind `provider`'s table, for the `ib` fabric.
    library: Option<ib::Library>,
    /// The device list while anything opened from it lives: opening N devices reads it once,
    /// not N times (each read walks every device, so that was O(N²) in the device count). A
    /// poisoned lock is recovered: the critical section only swaps a `Weak`, never half-done.
    list: Mutex<Weak<DeviceList>>,
    /// How many times the list was read from the provider, for tests of the above.
    lists_read: AtomicUsize,
}

/// Where the `ib` fabric finds its library and sysfs.
#[derive(Clone, Debug, Default)]
pub struct IbOptions {
    /// The library to `dlopen`; `None` = `$NCCL_WASM_IBVERBS_PATH`, else `libibverbs.so.1`.
    pub library: Option<String>,
    /// Root of the sysfs tree discovery reads. `None`: the library's own tree when it exports
    /// one (`ncclwasm_verbs_sysfs_read`, see [`crate::table`]), else `/sys`;
    /// [`crate::ENV_SYSFS_ROOT`] overrides either.
    pub sysfs_root: Option<PathBuf>,
}

impl Fabric {
    /// The `ib` fabric: libibverbs opened at run time, with whatever extension symbols the
    /// library exports. Fails (cleanly) when the library is absent; callers treat that as "no IB
    /// device".
    pub fn ib(options: IbOptions) -> Result<Arc<Fabric>> {
        let (library, table) = ib::load(options.library.as_deref())?;
        tracing::debug!("verbs library {} loaded", library.path());
        let sysfs = match (options.sysfs_root, library.sysfs_read()) {
            (Some(root), _) => SysfsTree::Dir(root),
            (None, Some(read)) => SysfsTree::Served(read),
            (None, None) => SysfsTree::Dir(PathBuf::from("/sys")),
        };
        let provider = Provider::new("ib", table, sysfs, library.capabilities());
        #[cfg(feature = "fault-injection")]
        let provider = match library.fault_table() {
            Some(faults) => provider.with_faults(faults),
            None => provider,
        };
        Ok(Arc::new(Fabric::new(provider, Some(library))))
    }

    /// A fabric over an in-process provider (a provider crate's own constructor calls this).
    pub fn from_provider(provider: Provider) -> Arc<Fabric> {
        Arc::new(Fabric::new(provider, None))
    }

    fn new(provider: Provider, library: Option<ib::Library>) -> Fabric {
        Fabric {
            provider,
            library,
            list: Mutex::new(Weak::new()),
            lists_read: AtomicUsize::new(0),
        }
    }

    /// How many times this fabric read the provider's device list (`ibv_get_device_list`).
    pub fn device_lists_read(&self) -> usize {
        self.lists_read.load(Ordering::Relaxed)
    }

    /// The provider's name (`"ib"` for a loaded library), for messages.
    pub fn name(&self) -> &'static str {
        self.provider.name
    }

    /// The path of the `dlopen`ed library (`None` for in-process providers).
    pub fn library_path(&self) -> Option<&str> {
        self.library.as_ref().map(ib::Library::path)
    }

    /// The optional entry points the table has and what the provider promises.
    pub fn capabilities(&self) -> Capabilities {
        self.provider.capabilities()
    }

    pub(crate) fn table(&self) -> &VerbsTable {
        &self.provider.table
    }

    /// The device list, shared while any of it is in use, else read afresh; NULL from
    /// `get_device_list` (no kernel support, no library devices) is an empty list, as NCCL's
    /// `wrap_ibv_get_device_list`.
    pub(crate) fn device_list(self: &Arc<Self>) -> Arc<DeviceList> {
        let mut cached = self.list.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = cached.upgrade() {
            return list;
        }
        let list = self.read_device_list();
        *cached = Arc::downgrade(&list);
        list
    }

    fn read_device_list(self: &Arc<Self>) -> Arc<DeviceList> {
        self.lists_read.fetch_add(1, Ordering::Relaxed);
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the table honours the contract.
        let list = unsafe { (self.table().get_device_list)(&mut n) };
        let mut devices = Vec::new();
        if list.is_null() {
            tracing::debug!("ibv_get_device_list: none (errno {})", last_errno());
        } else {
            for i in 0..usize::try_from(n).unwrap_or(0) {
                // SAFETY: the array has `n` entries (and a NULL terminator).
                let Some(dev) = NonNull::new(unsafe { *list.add(i) }) else {
                    break;
                };
                // SAFETY: `dev` is a live device of the list.
                let name = unsafe { (self.table().get_device_name)(dev.as_ptr()) };
                if name.is_null() {
                    continue;
                }
                // SAFETY: a NUL-terminated name valid as long as the device (contract).
                let name = unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned();
                devices.push((dev, name));
            }
        }
        let by_name = devices
            .iter()
            .enumerate()
            .rev()
            .map(|(i, (_, name))| (name.clone(), i))
            .collect();
        Arc::new(DeviceList {
            fabric: Arc::clone(self),
            list,
            devices,
            by_name,
        })
    }

    /// Names of the devices, in the library's order (an empty list when there are none).
    pub fn device_names(self: &Arc<Self>) -> Vec<String> {
        self.device_list()
            .devices
            .iter()
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Opens the device called `name`.
    pub fn open(self: &Arc<Self>, name: &str) -> Result<Arc<Context>> {
        let list = self.device_list();
        let dev = list
            .by_name
            .get(name)
            .map(|&i| list.devices[i].0)
            .ok_or_else(|| VerbsError::NoSuchDevice(name.to_owned()))?;
        // SAFETY: `dev` belongs to `list`, which the context keeps alive.
        let ctx = unsafe { (self.table().open_device)(dev.as_ptr()) };
        let ctx = NonNull::new(ctx).ok_or_else(|| VerbsError::Verb {
            verb: "open_device",
            object: name.to_owned(),
            errno: last_errno(),
        })?;
        // SAFETY: an open context; its async fd is made non-blocking so the event thread can
        // poll with a timeout (contract: get_async_event honours O_NONBLOCK).
        unsafe {
            let fd = (*ctx.as_ptr()).async_fd;
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Ok(Arc::new(Context {
            list,
            ctx,
            name: name.to_owned(),
        }))
    }
}

/// A device list, freed when the last context opened from it is closed.
#[derive(Debug)]
pub(crate) struct DeviceList {
    fabric: Arc<Fabric>,
    list: *mut *mut ibv_device,
    devices: Vec<(NonNull<ibv_device>, String)>,
    /// Index in `devices` by name (the first of equal names, as a linear search finds).
    by_name: HashMap<String, usize>,
}

// SAFETY: the list is immutable after creation and libibverbs devices may be used from any thread.
unsafe impl Send for DeviceList {}
// SAFETY: as above.
unsafe impl Sync for DeviceList {}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the list came from get_device_list and no context uses it any more.
            unsafe { (self.fabric.table().free_device_list)(self.list) };
        }
    }
}

/// An open device (`ibv_context`).
#[derive(Debug)]
pub struct Context {
    list: Arc<DeviceList>,
    pub(crate) ctx: NonNull<ibv_context>,
    name: String,
}

// SAFETY: verbs contexts are thread-safe (contract); the pointer is owned by this value.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc of this context, so none is left.
        let rc = unsafe { (self.table().close_device)(self.ctx.as_ptr()) };
        if let Err(e) = check(rc, "close_device", || self.name.clone()) {
            tracing::warn!("{e}");
        }
    }
}

/// The attributes of a device the data path and discovery use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_sge: u32,
    pub max_mr_size: u64,
    pub max_qp_rd_atom: u32,
    /// `ibv_atomic_cap`: 0 none, 1 atomic between the device's QPs (HCA), 2 also against the
    /// CPU (GLOB).
    pub atomic_cap: u32,
    pub phys_port_cnt: u8,
    /// `sys_image_guid` in host order (as `ibv_devinfo` prints it). NCCL's `props->guid` is the
    /// value verbs returns, in network byte order: the transport turns it back when it reports
    /// a device.
    pub sys_image_guid: u64,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub fw_ver: String,
}

/// The attributes of a port (`ibv_port_attr`), decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub max_mtu: u32,
    pub lid: u16,
    pub gid_tbl_len: u32,
    /// Raw `active_speed` / `active_width` bits.
    pub active_speed: u8,
    pub active_width: u8,
    /// Lanes, as `ncclIbWidth`.
    pub width: u8,
    /// Per-lane speed × lanes in Mb/s, as `ncclIbSpeed(active_speed) * ncclIbWidth(active_width)`.
    pub speed_mbps: u32,
    pub port_cap_flags: u32,
}

/// `ibvWidths` of net_ib.cc, indexed by the first set bit of `active_width`.
const IB_WIDTHS: [u32; 5] = [1, 4, 8, 12, 2];
/// `ibvSpeeds` of net_ib.cc (Mb/s per lane), indexed by the first set bit of `active_speed`.
const IB_SPEEDS: [u32; 8] = [2500, 5000, 10000, 10000, 14000, 25000, 50000, 100000];

/// `firstBitSet(val, max)` of net_ib.cc: the index of the lowest set bit, capped at `max`.
fn first_bit_set(val: u8, max: usize) -> usize {
    (0..max).find(|i| val & (1 << i) != 0).unwrap_or(max)
}

/// MTU enum (`IBV_MTU_256` = 1 …) to bytes.
pub(crate) fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) {
        128 << mtu
    } else {
        0
    }
}

impl PortAttr {
    fn decode(a: &ibv_port_attr) -> PortAttr {
        let width = IB_WIDTHS[first_bit_set(a.active_width, IB_WIDTHS.len() - 1)];
        let lane = IB_SPEEDS[first_bit_set(a.active_speed, IB_SPEEDS.len() - 1)];
        PortAttr {
            state: match a.state {
                2 => PortState::Initializing,
                3 => PortState::Armed,
                4 | 5 => PortState::Active,
                _ => PortState::Down,
            },
            // IBV_LINK_LAYER_UNSPECIFIED (0) means InfiniBand for old providers.
            link_layer: if a.link_layer == 2 {
                LinkLayer::Ethernet
            } else {
                LinkLayer::Infiniband
            },
            mtu: mtu_bytes(a.active_mtu),
            max_mtu: mtu_bytes(a.max_mtu),
            lid: a.lid,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            active_speed: a.active_speed,
            active_width: a.active_width,
            width: width as u8,
            speed_mbps: lane * width,
            port_cap_flags: a.port_cap_flags,
        }
    }
}

impl Context {
    pub(crate) fn table(&self) -> &VerbsTable {
        self.list.fabric.table()
    }

    /// The fabric this context was opened from (its capabilities, its name).
    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.list.fabric
    }

    /// The device name (`mlx5_0`, `soft0`, …).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: ibv_device_attr is plain data; all-zero is a valid value.
        let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { (self.table().query_device)(self.ctx.as_ptr(), &mut a) };
        check(rc, "query_device", || self.name.clone())?;
        let fw = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect::<Vec<_>>();
        Ok(DeviceAttr {
            max_qp: a.max_qp.max(0) as u32,
            max_qp_wr: a.max_qp_wr.max(0) as u32,
            max_cqe: a.max_cqe.max(0) as u32,
            max_sge: a.max_sge.max(0) as u32,
            max_mr_size: a.max_mr_size,
            max_qp_rd_atom: a.max_qp_rd_atom.max(0) as u32,
            atomic_cap: a.atomic_cap,
            phys_port_cnt: a.phys_port_cnt,
            sys_image_guid: u64::from_be(a.sys_image_guid),
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
        })
    }

    /// `ibv_query_port` through the exported compat symbol, as NCCL.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: ibv_port_attr is plain data; all-zero is a valid value.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context; the compat entry point fills a full ibv_port_attr (contract).
        let rc = unsafe {
            (self.table().query_port)(
                self.ctx.as_ptr(),
                port,
                (&raw mut a).cast::<_compat_ibv_port_attr>(),
            )
        };
        check(rc, "query_port", || format!("{} port {port}", self.name))?;
        Ok(PortAttr::decode(&a))
    }

    /// GID `index` of `port`, 16 bytes in network order (all zero for an empty slot).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        let mut gid = ibv_gid { raw: [0; 16] };
        let idx = c_int::try_from(index)
            .map_err(|_| VerbsError::Invalid(format!("GID index {index}")))?;
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { (self.table().query_gid)(self.ctx.as_ptr(), port, idx, &mut gid) };
        check(rc, "query_gid", || {
            format!("{} port {port} index {index}", self.name)
        })?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }

    /// Waits up to `timeout` for one async event, acknowledges it and returns it decoded;
    /// `None` on timeout. One thread per device calls this in a loop (NCCL's async thread).
    pub fn next_async_event(&self, timeout: Duration) -> Result<Option<AsyncEvent>> {
        // SAFETY: reading a plain field of the live context.
        let fd = unsafe { (*self.ctx.as_ptr()).async_fd };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let errno = last_errno();
            if errno == libc::EINTR {
                return Ok(None);
            }
            return Err(VerbsError::Verb {
                verb: "get_async_event",
                object: self.name.clone(),
                errno,
            });
        }
        if n == 0 {
            return Ok(None);
        }
        // SAFETY: ibv_async_event is plain data (pointers, ints); zeroed is a valid value.
        let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { (self.table().get_async_event)(self.ctx.as_ptr(), &mut ev) };
        if rc != 0 {
            let errno = if rc > 0 { rc } else { last_errno() };
            if errno == libc::EAGAIN {
                return Ok(None);
            }
            return Err(VerbsError::Verb {
                verb: "get_async_event",
                object: self.name.clone(),
                errno,
            });
        }
        let event = AsyncEvent::decode(self.table(), &ev);
        // SAFETY: the event came from get_async_event and is acknowledged once.
        unsafe { (self.table().ack_async_event)(&mut ev) };
        Ok(Some(event))
    }
}

/// What an async event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEventKind {
    CqErr,
    QpFatal,
    QpReqErr,
    QpAccessErr,
    CommEst,
    SqDrained,
    PathMig,
    PathMigErr,
    DeviceFatal,
    PortActive,
    PortErr,
    LidChange,
    PkeyChange,
    SmChange,
    SrqErr,
    SrqLimitReached,
    QpLastWqeReached,
    ClientReregister,
    GidChange,
    WqFatal,
    Other(u32),
}

const EVENT_KINDS: [AsyncEventKind; 20] = [
    AsyncEventKind::CqErr,
    AsyncEventKind::QpFatal,
    AsyncEventKind::QpReqErr,
    AsyncEventKind::QpAccessErr,
    AsyncEventKind::CommEst,
    AsyncEventKind::SqDrained,
    AsyncEventKind::PathMig,
    AsyncEventKind::PathMigErr,
    AsyncEventKind::DeviceFatal,
    AsyncEventKind::PortActive,
    AsyncEventKind::PortErr,
    AsyncEventKind::LidChange,
    AsyncEventKind::PkeyChange,
    AsyncEventKind::SmChange,
    AsyncEventKind::SrqErr,
    AsyncEventKind::SrqLimitReached,
    AsyncEventKind::QpLastWqeReached,
    AsyncEventKind::ClientReregister,
    AsyncEventKind::GidChange,
    AsyncEventKind::WqFatal,
];

/// An async event, decoded and already acknowledged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    pub kind: AsyncEventKind,
    /// The port, for port events.
    pub port: Option<u8>,
    /// The QP number, for QP events (for messages: numbers are reused).
    pub qp_num: Option<u32>,
    /// [`crate::Qp::id`] of the QP, for QP events about a QP this crate created: what to
    /// attribute the event by.
    pub qp_id: Option<u64>,
    /// `ibv_event_type_str`.
    pub description: String,
}

impl AsyncEvent {
    fn decode(table: &VerbsTable, ev: &ibv_async_event) -> AsyncEvent {
        // SAFETY: read as the C enum's u32 so an out-of-range value from a provider is not UB.
        let raw = unsafe { (&raw const ev.event_type).cast::<u32>().read() };
        let kind = EVENT_KINDS
            .get(raw as usize)
            .copied()
            .unwrap_or(AsyncEventKind::Other(raw));
        let description = if (raw as usize) < EVENT_KINDS.len() {
            // SAFETY: `raw` is one of the 20 declared discriminants; the string is static.
            let s = unsafe {
                (table.event_type_str)(std::mem::transmute::<u32, ibverbs_sys::ibv_event_type>(raw))
            };
            if s.is_null() {
                format!("event {raw}")
            } else {
                // SAFETY: a static NUL-terminated string (contract).
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            }
        } else {
            format!("unknown event {raw}")
        };
        use AsyncEventKind as K;
        let (mut port, mut qp_num, mut qp_id) = (None, None, None);
        match kind {
            K::PortActive
            | K::PortErr
            | K::LidChange
            | K::PkeyChange
            | K::SmChange
            | K::ClientReregister
            | K::GidChange => {
                // SAFETY: port events carry the port number in the union.
                port = u8::try_from(unsafe { ev.element.port_num }).ok();
            }
            K::QpFatal
            | K::QpReqErr
            | K::QpAccessErr
            | K::CommEst
            | K::SqDrained
            | K::PathMig
            | K::PathMigErr
            | K::QpLastWqeReached => {
                // SAFETY: QP events carry a live QP (the provider holds it until the ack).
                let qp = unsafe { ev.element.qp };
                if !qp.is_null() {
                    // SAFETY: non-NULL live QP.
                    qp_num = Some(unsafe { (*qp).qp_num });
                    // SAFETY: as above; `create_qp` stored the id as the context pointer.
                    let ctx = unsafe { (*qp).qp_context }.addr() as u64;
                    qp_id = (ctx != 0).then_some(ctx);
                }
            }
            _ => {}
        }
        AsyncEvent {
            kind,
            port,
            qp_num,
            qp_id,
            description,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(speed: u8, width: u8, state: u32, link: u8, mtu: u32) -> PortAttr {
        // SAFETY: plain data; all-zero is a valid value.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        (
            a.active_speed,
            a.active_width,
            a.state,
            a.link_layer,
            a.active_mtu,
        ) = (speed, width, state, link, mtu);
        PortAttr::decode(&a)
    }

    /// Speeds as `ncclIbSpeed(active_speed) * ncclIbWidth(active_width)`, including NCCL's
    /// quirks: no bit set maps to the last table entry.
    #[test]
    fn speed_and_width_follow_net_ib_tables() {
        let cases = [
            (1, 1, 2500, 1),      // SDR 1x
            (32, 2, 100000, 4),   // EDR 4x
            (64, 2, 200000, 4),   // HDR 4x
            (128, 2, 400000, 4),  // NDR 4x
            (128, 16, 200000, 2), // NDR 2x
            (16, 8, 168000, 12),  // FDR 12x
            (0, 0, 200000, 2),    // nothing set: last entries (NDR, 2x), as firstBitSet does
        ];
        for (speed, width, mbps, lanes) in cases {
            let p = port(speed, width, 4, 1, 5);
            assert_eq!(
                (p.speed_mbps, p.width),
                (mbps, lanes),
                "speed {speed} width {width}"
            );
        }
    }

    #[test]
    fn state_link_layer_and_mtu() {
        let p = port(32, 2, 4, 2, 5);
        assert_eq!(
            (p.state, p.link_layer, p.mtu),
            (PortState::Active, LinkLayer::Ethernet, 4096)
        );
        let p = port(32, 2, 1, 0, 3);
        assert_eq!(
            (p.state, p.link_layer, p.mtu),
            (PortState::Down, LinkLayer::Infiniband, 1024)
        );
        assert_eq!(port(32, 2, 2, 1, 1).state, PortState::Initializing);
        assert_eq!(port(32, 2, 3, 1, 9).mtu, 0);
    }
}
