//! The I/O around the pure choice of `oob`: this host's interface addresses (`getifaddrs`),
//! NCCL's environment, host-name resolution for `NCCL_COMM_ID`, and the one INFO line per
//! process that says which address the handshake uses and why.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Mutex;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::{InterfaceFlags, if_nametoindex};
use nix::sys::socket::SockaddrStorage;

use crate::net_error::NetError;
use crate::oob::{ENV_COMM_ID, ENV_FAMILY, ENV_IFNAME, Interface, OobChoice, OobEnv, choose};

impl OobEnv {
    /// Reads `NCCL_SOCKET_IFNAME`, `NCCL_SOCKET_FAMILY` and `NCCL_COMM_ID` from the environment.
    pub fn from_env() -> OobEnv {
        let var = |name| std::env::var(name).ok();
        OobEnv {
            socket_ifname: var(ENV_IFNAME),
            socket_family: var(ENV_FAMILY),
            comm_id: var(ENV_COMM_ID),
        }
    }
}

/// This host's IPv4 and IPv6 interface addresses, in `getifaddrs` order.
pub fn interfaces() -> Result<Vec<Interface>, NetError> {
    let all = getifaddrs()
        .map_err(|e| NetError::io("listing network interfaces (getifaddrs)")(e.into()))?;
    Ok(all
        .filter_map(|a| {
            let (addr, scope_id) = ip_of(a.address.as_ref()?)?;
            Some(Interface {
                // Interfaces listed a moment ago have an index; 0 if one went away since.
                index: if_nametoindex(a.interface_name.as_str()).unwrap_or(0),
                addr,
                scope_id,
                netmask: a.netmask.as_ref().and_then(ip_of).map(|(m, _)| m),
                running: a.flags.contains(InterfaceFlags::IFF_RUNNING),
                name: a.interface_name,
            })
        })
        .collect())
}

/// The IP address (and IPv6 scope) of a socket address, if it is IPv4 or IPv6.
fn ip_of(s: &SockaddrStorage) -> Option<(IpAddr, u32)> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some((IpAddr::V4(v4.ip()), 0));
    }
    s.as_sockaddr_in6()
        .map(|v6| (IpAddr::V6(v6.ip()), v6.scope_id()))
}

/// The first address a host name resolves to (`getaddrinfo`, as NCCL).
fn resolve(host: &str) -> Option<IpAddr> {
    (host, 0)
        .to_socket_addrs()
        .ok()?
        .next()
        .map(|a: SocketAddr| a.ip())
}

/// The handshake address on this host for these settings.
pub fn choose_on_host(env: &OobEnv) -> Result<OobChoice, NetError> {
    choose(env, &interfaces()?, &resolve)
}

/// The handshake address on this host for NCCL's environment: what `init` would choose (for
/// diagnostics such as `ncclwasm doctor`).
pub fn choose_from_env() -> Result<OobChoice, NetError> {
    choose_on_host(&OobEnv::from_env())
}

/// Logs the choice at INFO, once per process (again only if a later context chooses
/// differently, say after the environment changed).
pub(crate) fn announce(choice: &OobChoice) {
    static LOGGED: Mutex<Option<(String, SocketAddr)>> = Mutex::new(None);
    let mut last = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
    let key = (choice.ifname.clone(), choice.addr);
    if last.as_ref() != Some(&key) {
        tracing::info!(
            "NET/WASM: OOB {} {} ({})",
            choice.ifname,
            choice.addr.ip(),
            choice.reason
        );
        *last = Some(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed_running_with_its_index() {
        let ifs = interfaces().unwrap();
        let lo = ifs
            .iter()
            .find(|i| i.addr == IpAddr::from([127, 0, 0, 1]))
            .expect("127.0.0.1 on some interface");
        assert!(lo.running && lo.index > 0, "{lo:?}");
        assert_eq!(lo.netmask, Some(IpAddr::from([255, 0, 0, 0])), "{lo:?}");
    }
}
