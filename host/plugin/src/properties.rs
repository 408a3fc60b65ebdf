//! What NCCL learns about devices: `devices`, the fields every `getProperties` version shares
//! (each version's own struct is filled in its `vN` module), and `makeVDevice`'s body.

use std::ffi::{c_char, c_int};

use ncclwasm_abi::*;
use ncclwasm_transport::{DeviceProps, MAX_RECVS, NetError};

use crate::context::net;
use crate::edge::{c_string, guard, null_arg};

pub(crate) unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        // SAFETY: NCCL passes a valid out-pointer (or NULL, refused).
        let ndev = unsafe { ndev.as_mut() }.ok_or_else(|| null_arg("ndev"))?;
        *ndev = 0;
        *ndev = net()?.device_count() as c_int;
        Ok(())
    })
}

pub(crate) fn props(dev: c_int) -> Result<DeviceProps, NetError> {
    net()?.properties(i64::from(dev))
}

/// The fields every properties version shares.
pub(crate) struct Common {
    pub(crate) name: *const c_char,
    pub(crate) pci_path: *const c_char,
    pub(crate) guid: u64,
    pub(crate) speed: c_int,
    pub(crate) port: c_int,
    pub(crate) max_comms: c_int,
}

pub(crate) fn common(p: &DeviceProps) -> Common {
    Common {
        name: c_string(&p.name),
        pci_path: c_string(&p.pci_path),
        guid: p.guid,
        speed: p.speed_mbps.min(i32::MAX as u32) as c_int,
        port: c_int::from(p.port),
        max_comms: p.max_comms.min(i32::MAX as u32) as c_int,
    }
}

pub(crate) fn children<const N: usize>(p: &DeviceProps) -> (c_int, [c_int; N]) {
    let mut devs = [0; N];
    for (d, c) in devs.iter_mut().zip(&p.children) {
        *d = *c as c_int;
    }
    (p.children.len().min(N) as c_int, devs)
}

pub(crate) fn props_v9(p: &DeviceProps) -> PropsV9 {
    let c = common(p);
    let (ndevs, devs) = children::<4>(p);
    PropsV9 {
        name: c.name,
        pci_path: c.pci_path,
        guid: c.guid,
        ptr_support: p.ptr_support as c_int,
        reg_is_global: 1,
        force_flush: c_int::from(p.force_flush),
        speed: c.speed,
        port: c.port,
        latency: 0.0,
        max_comms: c.max_comms,
        max_recvs: MAX_RECVS as c_int,
        net_device_type: 0,
        net_device_version: 0,
        vprops: VDevPropsV9 { ndevs, devs },
        // net_ib's values. NCCL core (2.24–2.30) only checks maxP2pBytes and never hands a net
        // operation more than 1 GiB (`NCCL_MAX_NET_SIZE`), which `isend` takes.
        max_p2p_bytes: NCCL_MAX_NET_SIZE_BYTES,
        max_coll_bytes: MAX_COLLNET_SIZE,
    }
}

pub(crate) fn make_vdevice_impl(d: *mut c_int, devs: &[c_int]) -> NcclResult {
    guard("makeVDevice", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let d = unsafe { d.as_mut() }.ok_or_else(|| null_arg("d"))?;
        *d = -1;
        let request: Vec<u32> = devs.iter().map(|&x| x.max(0) as u32).collect();
        *d = net()?.make_vdevice(&request)? as c_int;
        Ok(())
    })
}
