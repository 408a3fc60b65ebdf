//! The out-of-band interface: which local address the handshake listener binds, chosen as
//! NCCL's IB transport chooses `ncclIbIfAddr` (`ncclFindInterfaces` in its socket layer), so a
//! job's `NCCL_SOCKET_IFNAME`/`NCCL_SOCKET_FAMILY` steer this plugin as they steer NCCL.
//!
//! [`choose`] is the whole decision, pure: it takes the interface addresses in the order
//! `getifaddrs` lists them and the variables as the caller read them ([`OobEnv`]), and returns
//! the first address that qualifies with the reason, or an error naming the variable and
//! listing the interfaces there are. [`interfaces`] and [`choose_from_env`] do the I/O.
//!
//! The rules, NCCL's:
//! * An address qualifies when its interface is running (`IFF_RUNNING`: up and attached), it is
//!   IPv4 or IPv6, of the family `NCCL_SOCKET_FAMILY` forces (`AF_INET`, `AF_INET6`), and not
//!   the IPv6 loopback `::1` (NCCL skips it; `127.0.0.1` is kept). Link-local IPv6 addresses
//!   qualify, with their scope (the interface index), which the listen handle carries.
//! * `NCCL_SOCKET_IFNAME` set: the first qualifying address of an interface the list selects
//!   (see `oob_pattern`), or an error.
//! * Unset: the first qualifying address of an `ib*` interface (IPoIB); else, with
//!   `NCCL_COMM_ID` set, the first address in the same subnet as the bootstrap root's (any
//!   interface, any state, as NCCL's `ncclFindInterfaceMatchSubnet`); else any interface not
//!   named `docker*`, `lo*` or `virbr*`; else `docker*`; else `lo*`; else `virbr*`.
//!
//! Where NCCL quietly falls back (an unknown family, a one-character interface list), we refuse
//! the value: the setting was meant to steer the choice, and ignoring it hides the mistake.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::net_error::NetError;
use crate::oob_pattern::IfPattern;

pub use crate::oob_host::{choose_from_env, choose_on_host, interfaces};

/// Which interfaces may carry the handshake (NCCL's variable).
pub const ENV_IFNAME: &str = "NCCL_SOCKET_IFNAME";
/// `AF_INET` or `AF_INET6`: the address family the handshake must use (NCCL's variable).
pub const ENV_FAMILY: &str = "NCCL_SOCKET_FAMILY";
/// The bootstrap root's `<host>:<port>` or `[<ipv6>%<ifname>]:<port>`; without
/// `NCCL_SOCKET_IFNAME`, an interface in its subnet is preferred (NCCL's variable).
pub const ENV_COMM_ID: &str = "NCCL_COMM_ID";

/// The variables that steer the choice, as read from NCCL's environment by the caller (the
/// plugin reads them; tests hand them over). `None` and an empty value mean unset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OobEnv {
    /// `NCCL_SOCKET_IFNAME`.
    pub socket_ifname: Option<String>,
    /// `NCCL_SOCKET_FAMILY`.
    pub socket_family: Option<String>,
    /// `NCCL_COMM_ID`.
    pub comm_id: Option<String>,
}

/// One address of one interface, as `getifaddrs` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    /// The interface index (`if_nametoindex`).
    pub index: u32,
    pub addr: IpAddr,
    /// The IPv6 scope (the interface index for a link-local address), 0 otherwise.
    pub scope_id: u32,
    pub netmask: Option<IpAddr>,
    /// `IFF_RUNNING`: up and physically attached.
    pub running: bool,
}

/// The chosen address and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OobChoice {
    pub ifname: String,
    /// The address to bind, port 0 (an IPv6 link-local one with its scope).
    pub addr: SocketAddr,
    /// Which rule chose it, for the log and `ncclwasm doctor`.
    pub reason: String,
}

/// `NCCL_SOCKET_FAMILY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn parse(raw: Option<&str>) -> Result<Option<Family>, NetError> {
        match raw.filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some("AF_INET") => Ok(Some(Family::V4)),
            Some("AF_INET6") => Ok(Some(Family::V6)),
            Some(v) => Err(config(
                ENV_FAMILY,
                v,
                "must be AF_INET or AF_INET6 (NCCL would ignore it and take either family)"
                    .to_owned(),
            )),
        }
    }

    fn admits(family: Option<Family>, ip: &IpAddr) -> bool {
        match family {
            None => true,
            Some(Family::V4) => ip.is_ipv4(),
            Some(Family::V6) => ip.is_ipv6(),
        }
    }

    /// The suffix the reason and errors carry when the family is forced.
    fn note(family: Option<Family>) -> &'static str {
        match family {
            None => "",
            Some(Family::V4) => ", IPv4 only (NCCL_SOCKET_FAMILY=AF_INET)",
            Some(Family::V6) => {
                ", IPv6 only (NCCL_SOCKET_FAMILY=AF_INET6; NCCL never uses the IPv6 loopback ::1)"
            }
        }
    }
}

fn config(variable: &'static str, value: &str, problem: String) -> NetError {
    NetError::Config {
        variable,
        value: value.to_owned(),
        problem,
    }
}

/// Chooses the handshake address among `interfaces` (in `getifaddrs` order) as NCCL would.
/// `resolve` turns a host name of `NCCL_COMM_ID` into an address (the caller's DNS).
pub fn choose(
    env: &OobEnv,
    interfaces: &[Interface],
    resolve: &dyn Fn(&str) -> Option<IpAddr>,
) -> Result<OobChoice, NetError> {
    let family = Family::parse(env.socket_family.as_deref())?;
    let note = Family::note(family);
    let first = |pattern: &IfPattern| {
        interfaces.iter().find(|i| {
            i.running
                && Family::admits(family, &i.addr)
                && !(i.addr.is_ipv6() && i.addr.is_loopback())
                && pattern.admits(&i.name)
        })
    };

    if let Some(raw) = env.socket_ifname.as_deref().filter(|v| !v.is_empty()) {
        if raw.len() < 2 {
            return Err(config(
                ENV_IFNAME,
                raw,
                "NCCL ignores values shorter than two characters; name the interfaces, or unset \
                 it for NCCL's automatic choice"
                    .to_owned(),
            ));
        }
        let pattern = IfPattern::parse(raw).map_err(|p| config(ENV_IFNAME, raw, p))?;
        return match first(&pattern) {
            Some(i) => Ok(chosen(
                i,
                format!(
                    "{ENV_IFNAME}={raw}: the first running interface {}{note}",
                    pattern.describe()
                ),
            )),
            None => Err(config(
                ENV_IFNAME,
                raw,
                format!(
                    "no running interface {}{note}; interfaces here: {}",
                    pattern.describe(),
                    list(interfaces)
                ),
            )),
        };
    }

    let unset = format!("{ENV_IFNAME} unset");
    let ib = IfPattern::prefixes(false, &["ib"]);
    if let Some(i) = first(&ib) {
        return Ok(chosen(
            i,
            format!(
                "{unset}: the first running interface {} (IPoIB){note}",
                ib.describe()
            ),
        ));
    }
    if let Some(raw) = env.comm_id.as_deref().filter(|v| v.len() > 1) {
        let (root, scope) = comm_id_addr(raw, interfaces, resolve)?;
        if let Some(i) = interfaces.iter().find(|i| same_subnet(i, root, scope)) {
            return Ok(chosen(
                i,
                format!("{unset}, no ib* interface: in the subnet of {ENV_COMM_ID}={raw}"),
            ));
        }
    }
    let steps = [
        IfPattern::prefixes(true, &["docker", "lo", "virbr"]),
        IfPattern::prefixes(false, &["docker"]),
        IfPattern::prefixes(false, &["lo"]),
        IfPattern::prefixes(false, &["virbr"]),
    ];
    for (k, pattern) in steps.iter().enumerate() {
        if let Some(i) = first(pattern) {
            let passed: Vec<String> = [&ib]
                .into_iter()
                .chain(&steps[..k])
                .map(IfPattern::describe)
                .collect();
            return Ok(chosen(
                i,
                format!(
                    "{unset}: the first running interface {}{note} (NCCL's automatic order; \
                     none {})",
                    pattern.describe(),
                    passed.join(", none ")
                ),
            ));
        }
    }
    let problem = format!(
        "no running interface has a usable address{note}; interfaces here: {}",
        list(interfaces)
    );
    match (family, env.socket_family.as_deref()) {
        (Some(_), Some(raw)) => Err(config(ENV_FAMILY, raw, problem)),
        _ => Err(NetError::NoDevice(format!(
            "no IP interface for the handshake socket: {problem}"
        ))),
    }
}

fn chosen(i: &Interface, reason: String) -> OobChoice {
    let addr = match i.addr {
        IpAddr::V4(v4) => SocketAddr::V4(SocketAddrV4::new(v4, 0)),
        IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, 0, 0, i.scope_id)),
    };
    OobChoice {
        ifname: i.name.clone(),
        addr,
        reason,
    }
}

/// The interfaces for an error message: each name once, with its addresses, in `getifaddrs`
/// order; `(not running)` when it is down or unplugged.
fn list(interfaces: &[Interface]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for i in interfaces {
        if !names.contains(&i.name.as_str()) {
            names.push(&i.name);
        }
    }
    if names.is_empty() {
        return "none with an IPv4 or IPv6 address".to_owned();
    }
    let mut out = String::new();
    for (k, name) in names.iter().enumerate() {
        let addrs: Vec<&Interface> = interfaces.iter().filter(|i| i.name == *name).collect();
        let shown: Vec<String> = addrs.iter().map(|i| i.addr.to_string()).collect();
        let _ = write!(
            out,
            "{}{name} ({}){}",
            if k == 0 { "" } else { ", " },
            shown.join(", "),
            if addrs.iter().any(|i| i.running) {
                ""
            } else {
                " not running"
            }
        );
    }
    out
}

/// The bootstrap root's address in `NCCL_COMM_ID` and its IPv6 scope (as
/// `ncclSocketGetAddrFromString`): `[<ipv6>]:<port>` or `[<ipv6>%<ifname>]:<port>`, else
/// `<ipv4 or host>:<port>` (the first comma-separated entry; a host name is resolved).
fn comm_id_addr(
    raw: &str,
    interfaces: &[Interface],
    resolve: &dyn Fn(&str) -> Option<IpAddr>,
) -> Result<(IpAddr, u32), NetError> {
    let bad = |problem: String| config(ENV_COMM_ID, raw, problem);
    if let Some(rest) = raw.strip_prefix('[') {
        let inner = rest
            .split_once(']')
            .map(|(inner, _)| inner)
            .ok_or_else(|| bad("no ']' closes the IPv6 address ([<ipv6>]:<port>)".into()))?;
        let (ip, ifname) = match inner.split_once('%') {
            Some((ip, ifname)) => (ip, Some(ifname)),
            None => (inner, None),
        };
        let ip: std::net::Ipv6Addr = ip
            .parse()
            .map_err(|_| bad(format!("{ip:?} is not an IPv6 address")))?;
        let scope = match ifname {
            None => 0,
            Some(name) => interfaces
                .iter()
                .find(|i| i.name == name)
                .map(|i| i.index)
                .ok_or_else(|| {
                    bad(format!(
                        "scope {name:?} is no interface here; interfaces here: {}",
                        list(interfaces)
                    ))
                })?,
        };
        return Ok((IpAddr::V6(ip), scope));
    }
    let entry = raw.split(',').find(|e| !e.is_empty()).unwrap_or_default();
    let host = entry.split(':').next().unwrap_or_default();
    if host.is_empty() {
        return Err(bad("no host before the port (<host>:<port>)".into()));
    }
    let ip = host
        .parse::<IpAddr>()
        .ok()
        .or_else(|| resolve(host))
        .ok_or_else(|| bad(format!("cannot resolve host {host:?}")))?;
    Ok((ip, 0))
}

/// Whether `i` is in the subnet of `root` (same family, same bits under `i`'s netmask, and for
/// IPv6 the same scope), as NCCL's `matchSubnet`.
fn same_subnet(i: &Interface, root: IpAddr, scope: u32) -> bool {
    let masked = |a: &[u8], m: &[u8]| a.iter().zip(m).map(|(a, m)| a & m).collect::<Vec<u8>>();
    match (i.addr, i.netmask, root) {
        (IpAddr::V4(a), Some(IpAddr::V4(m)), IpAddr::V4(r)) => {
            masked(&a.octets(), &m.octets()) == masked(&r.octets(), &m.octets())
        }
        (IpAddr::V6(a), Some(IpAddr::V6(m)), IpAddr::V6(r)) => {
            masked(&a.octets(), &m.octets()) == masked(&r.octets(), &m.octets())
                && i.scope_id == scope
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ErrorClass;

    fn iface(name: &str, index: u32, addr: &str, prefix: u8, running: bool) -> Interface {
        let addr: IpAddr = addr.parse().unwrap();
        let netmask = match addr {
            IpAddr::V4(_) => {
                IpAddr::V4((u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)).into())
            }
            IpAddr::V6(_) => {
                IpAddr::V6((u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)).into())
            }
        };
        let scope_id = match addr {
            IpAddr::V6(v6) if v6.is_unicast_link_local() => index,
            _ => 0,
        };
        Interface {
            name: name.into(),
            index,
            addr,
            scope_id,
            netmask: Some(netmask),
            running,
        }
    }

    /// A host as `getifaddrs` lists it: IPv4 addresses first, then IPv6.
    fn host() -> Vec<Interface> {
        vec![
            iface("lo", 1, "127.0.0.1", 8, true),
            iface("docker0", 2, "172.17.0.1", 16, true),
            iface("eth0", 3, "10.0.0.5", 24, true),
            iface("eth1", 4, "10.1.0.5", 24, false),
            iface("enp1s0", 5, "10.2.0.5", 24, true),
            iface("lo", 1, "::1", 128, true),
            iface("eth0", 3, "fd00::5", 64, true),
            iface("eth0", 3, "fe80::5", 64, true),
        ]
    }

    fn env(ifname: Option<&str>, family: Option<&str>) -> OobEnv {
        OobEnv {
            socket_ifname: ifname.map(Into::into),
            socket_family: family.map(Into::into),
            comm_id: None,
        }
    }

    fn no_dns(_: &str) -> Option<IpAddr> {
        None
    }

    fn pick(e: &OobEnv, ifs: &[Interface]) -> Result<OobChoice, NetError> {
        choose(e, ifs, &no_dns)
    }

    fn addr_of(e: &OobEnv, ifs: &[Interface]) -> String {
        let c = pick(e, ifs).unwrap();
        format!("{} {}", c.ifname, c.addr)
    }

    #[test]
    fn automatic_order_prefers_ipoib_then_anything_but_docker_lo_virbr() {
        let mut ifs = host();
        assert_eq!(addr_of(&OobEnv::default(), &ifs), "eth0 10.0.0.5:0");
        ifs.push(iface("ib0", 9, "192.168.0.5", 24, true));
        let c = pick(&OobEnv::default(), &ifs).unwrap();
        assert_eq!(
            (c.ifname.as_str(), c.addr.to_string()),
            ("ib0", "192.168.0.5:0".into())
        );
        assert!(c.reason.contains("ib* (IPoIB)"), "{}", c.reason);
    }

    #[test]
    fn automatic_order_falls_back_to_docker_then_lo_then_virbr() {
        let only = |names: &[&str]| -> Vec<Interface> {
            host()
                .into_iter()
                .filter(|i| names.contains(&i.name.as_str()))
                .collect()
        };
        let c = pick(&OobEnv::default(), &only(&["lo", "docker0"])).unwrap();
        assert_eq!(c.ifname, "docker0");
        assert!(
            c.reason.contains("named docker*")
                && c.reason.contains("none not named docker*, lo* or virbr*"),
            "{}",
            c.reason
        );
        assert_eq!(
            addr_of(&OobEnv::default(), &only(&["lo"])),
            "lo 127.0.0.1:0"
        );
        let mut ifs = only(&["lo"]);
        ifs.insert(0, iface("virbr0", 7, "192.168.122.1", 24, true));
        assert_eq!(addr_of(&OobEnv::default(), &ifs), "lo 127.0.0.1:0");
        ifs.retain(|i| i.name != "lo");
        assert_eq!(addr_of(&OobEnv::default(), &ifs), "virbr0 192.168.122.1:0");
    }

    #[test]
    fn interfaces_not_running_are_skipped() {
        let e = env(Some("eth1"), None);
        let err = pick(&e, &host()).unwrap_err();
        assert!(
            err.to_string().contains("eth1 (10.1.0.5) not running"),
            "{err}"
        );
        let mut ifs = host();
        ifs.iter_mut()
            .filter(|i| i.name == "eth0")
            .for_each(|i| i.running = false);
        assert_eq!(addr_of(&OobEnv::default(), &ifs), "enp1s0 10.2.0.5:0");
    }

    #[test]
    fn ifname_prefix_exact_exclude_and_port_suffix() {
        let ifs = host();
        assert_eq!(addr_of(&env(Some("en"), None), &ifs), "enp1s0 10.2.0.5:0");
        assert_eq!(addr_of(&env(Some("lo"), None), &ifs), "lo 127.0.0.1:0");
        assert_eq!(addr_of(&env(Some("=lo"), None), &ifs), "lo 127.0.0.1:0");
        assert_eq!(
            addr_of(&env(Some("^lo,docker"), None), &ifs),
            "eth0 10.0.0.5:0"
        );
        assert_eq!(
            addr_of(&env(Some("^=lo,docker"), None), &ifs),
            "docker0 172.17.0.1:0"
        );
        assert_eq!(
            addr_of(&env(Some("enp1s0:7"), None), &ifs),
            "enp1s0 10.2.0.5:0"
        );
        // The list's order does not matter: the first address in getifaddrs order wins.
        assert_eq!(
            addr_of(&env(Some("enp,eth"), None), &ifs),
            "eth0 10.0.0.5:0"
        );
        assert!(pick(&env(Some("=eth"), None), &ifs).is_err());
        let c = pick(&env(Some("^lo"), None), &ifs).unwrap();
        assert_eq!(
            c.reason,
            "NCCL_SOCKET_IFNAME=^lo: the first running interface not named lo*"
        );
    }

    #[test]
    fn family_filters_and_ipv6_loopback_is_never_used() {
        let ifs = host();
        assert_eq!(
            addr_of(&env(None, Some("AF_INET6")), &ifs),
            "eth0 [fd00::5]:0"
        );
        assert_eq!(
            addr_of(&env(Some("eth"), Some("AF_INET")), &ifs),
            "eth0 10.0.0.5:0"
        );
        assert_eq!(addr_of(&env(None, Some("")), &ifs), "eth0 10.0.0.5:0");
        // lo has ::1 only, which NCCL skips: no IPv6 address on lo.
        let e = pick(&env(Some("lo"), Some("AF_INET6")), &ifs).unwrap_err();
        assert!(
            matches!(
                e,
                NetError::Config {
                    variable: ENV_IFNAME,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("::1"), "{e}");
        // Family forced and nothing left: the error names the family.
        let v4_only: Vec<Interface> = ifs.iter().filter(|i| i.addr.is_ipv4()).cloned().collect();
        let e = pick(&env(None, Some("AF_INET6")), &v4_only).unwrap_err();
        assert!(
            matches!(
                e,
                NetError::Config {
                    variable: ENV_FAMILY,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.class(), ErrorClass::InvalidUsage);
    }

    #[test]
    fn link_local_ipv6_keeps_its_scope() {
        let ifs: Vec<Interface> = host()
            .into_iter()
            .filter(|i| i.addr.to_string() != "fd00::5")
            .collect();
        let c = pick(&env(Some("eth0"), Some("AF_INET6")), &ifs).unwrap();
        assert_eq!(c.addr, "[fe80::5%3]:0".parse().unwrap());
    }

    #[test]
    fn bad_values_are_config_errors_naming_the_variable_and_the_interfaces() {
        let ifs = host();
        let e = pick(&env(Some("nosuch0"), None), &ifs).unwrap_err();
        assert_eq!(e.class(), ErrorClass::InvalidUsage);
        let msg = e.to_string();
        assert!(
            msg.starts_with("NCCL_SOCKET_IFNAME=\"nosuch0\": no running interface named nosuch0*"),
            "{msg}"
        );
        assert!(
            msg.contains(
                "lo (127.0.0.1, ::1), docker0 (172.17.0.1), eth0 (10.0.0.5, fd00::5, fe80::5)"
            ),
            "{msg}"
        );
        let e = pick(&env(None, Some("AF_UNIX")), &ifs).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("NCCL_SOCKET_FAMILY=\"AF_UNIX\": must be AF_INET or AF_INET6"),
            "{e}"
        );
        for short in ["e", "^", "="] {
            let e = pick(&env(Some(short), None), &ifs).unwrap_err();
            assert!(e.to_string().contains("shorter than two characters"), "{e}");
        }
        let e = pick(&env(Some("eth0, eth1"), None), &ifs).unwrap_err();
        assert!(e.to_string().contains("whitespace"), "{e}");
        // An empty value is unset.
        assert_eq!(addr_of(&env(Some(""), None), &ifs), "eth0 10.0.0.5:0");
    }

    #[test]
    fn nothing_usable_without_settings_is_no_device() {
        let e = pick(&OobEnv::default(), &[]).unwrap_err();
        assert!(matches!(e, NetError::NoDevice(_)), "{e}");
        assert!(
            e.to_string().contains("none with an IPv4 or IPv6 address"),
            "{e}"
        );
    }

    #[test]
    fn comm_id_prefers_the_interface_in_the_roots_subnet() {
        let ifs = host();
        let with = |id: &str| OobEnv {
            comm_id: Some(id.into()),
            ..OobEnv::default()
        };
        let c = pick(&with("10.2.0.77:5000"), &ifs).unwrap();
        assert_eq!(c.ifname, "enp1s0");
        assert!(
            c.reason.contains("NCCL_COMM_ID=10.2.0.77:5000"),
            "{}",
            c.reason
        );
        // No interface in that subnet: the usual order.
        assert_eq!(addr_of(&with("10.9.0.1:5000"), &ifs), "eth0 10.0.0.5:0");
        // IPv6, with and without a scope.
        assert_eq!(addr_of(&with("[fd00::99]:5000"), &ifs), "eth0 [fd00::5]:0");
        assert_eq!(
            addr_of(&with("[fe80::99%eth0]:5000"), &ifs),
            "eth0 [fe80::5%3]:0"
        );
        // Host names go through the resolver.
        let dns = |h: &str| (h == "root.example").then(|| "172.17.9.9".parse().unwrap());
        let c = choose(&with("root.example:5000"), &ifs, &dns).unwrap();
        assert_eq!(c.ifname, "docker0");
        // IPoIB still comes first, and NCCL_SOCKET_IFNAME overrides it all.
        let mut ib = ifs.clone();
        ib.push(iface("ib0", 9, "192.168.0.5", 24, true));
        assert_eq!(pick(&with("10.2.0.77:5000"), &ib).unwrap().ifname, "ib0");
        let both = OobEnv {
            socket_ifname: Some("lo".into()),
            ..with("10.2.0.77:5000")
        };
        assert_eq!(pick(&both, &ifs).unwrap().ifname, "lo");
        for (bad, why) in [
            ("nohost.example:1", "cannot resolve"),
            ("[fd00::1:5000", "no ']'"),
            ("[zz::1]:5000", "not an IPv6 address"),
            ("[fe80::1%nosuch]:5000", "no interface here"),
            (":5000", "no host"),
        ] {
            let e = pick(&with(bad), &ifs).unwrap_err();
            assert!(
                matches!(
                    e,
                    NetError::Config {
                        variable: ENV_COMM_ID,
                        ..
                    }
                ),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }
}
