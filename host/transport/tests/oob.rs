//! The handshake listener binds the out-of-band address NCCL would choose: `NCCL_SOCKET_IFNAME`
//! and `NCCL_SOCKET_FAMILY` handed to `Net::new` as values (the plugin reads them from the
//! environment), checked on the handle `listen` writes; IPv6 end to end (a global and a
//! link-local address) inside a network namespace this test makes; bad values fail `Net::new`.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::Arc;

use common::*;
use ncclwasm_policy::PolicyHost;
use ncclwasm_proto::handle::ListenHandle;
use ncclwasm_transport::oob::{OobEnv, choose_on_host};
use ncclwasm_transport::{ErrorClass, Net, NetError, RecvComm, SendComm};

fn oob(ifname: Option<&str>, family: Option<&str>) -> OobEnv {
    OobEnv {
        socket_ifname: ifname.map(Into::into),
        socket_family: family.map(Into::into),
        comm_id: None,
    }
}

fn policy() -> Arc<PolicyHost> {
    Arc::new(PolicyHost::from_env(4).expect("policy settings"))
}

/// The address in the handle `listen` on device 1 writes.
fn listen_addr(net: &Net) -> std::net::SocketAddr {
    let (_listener, handle) = net.listen(1).unwrap();
    ListenHandle::decode(&handle).unwrap().addr
}

/// Connects device 0 to device 1 through the listener and moves one 4 KiB message.
fn round_trip(net: &Net) {
    let (s, r): (SendComm, RecvComm) = connect(net, 0, 1);
    small_message(&s, &r);
}

#[test]
fn lo_by_prefix_and_exact_name_binds_loopback() {
    for ifname in ["lo", "=lo"] {
        let net = net_with(oob(Some(ifname), None), policy()).unwrap();
        assert_eq!(net.oob().ifname, "lo", "{ifname}");
        let addr = listen_addr(&net);
        assert_eq!(addr.ip(), IpAddr::V4(Ipv4Addr::LOCALHOST), "{ifname}");
        assert_ne!(addr.port(), 0);
        assert!(
            net.oob()
                .reason
                .starts_with(&format!("NCCL_SOCKET_IFNAME={ifname}:")),
            "{}",
            net.oob().reason
        );
    }
    round_trip(&net_with(oob(Some("lo"), None), policy()).unwrap());
}

/// `^lo` on this host: whatever else runs here, never loopback; a host with nothing else fails
/// `init` naming the variable.
#[test]
fn excluding_lo_binds_another_interface() {
    let env = oob(Some("^lo"), None);
    match choose_on_host(&env) {
        Ok(choice) => {
            let net = net_with(env, policy()).unwrap();
            assert_eq!(net.oob(), &choice);
            assert_ne!(choice.ifname, "lo");
            let addr = listen_addr(&net);
            assert_eq!(addr.ip(), choice.addr.ip());
            assert!(!addr.ip().is_loopback(), "{addr}");
        }
        Err(_) => {
            let e = net_with(env, policy()).unwrap_err();
            assert!(e.to_string().contains("NCCL_SOCKET_IFNAME"), "{e}");
        }
    }
}

#[test]
fn bad_values_fail_init_naming_the_variable() {
    let cases = [
        (
            oob(Some("nosuchif0"), None),
            "NCCL_SOCKET_IFNAME=\"nosuchif0\"",
        ),
        (oob(None, Some("AF_UNIX")), "NCCL_SOCKET_FAMILY=\"AF_UNIX\""),
        // NCCL never uses the IPv6 loopback ::1, so lo has no IPv6 address to offer.
        (
            oob(Some("lo"), Some("AF_INET6")),
            "NCCL_SOCKET_IFNAME=\"lo\"",
        ),
    ];
    for (env, named) in cases {
        let e: NetError = net_with(env.clone(), policy()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(named), "{env:?}: {msg}");
        assert_eq!(e.class(), ErrorClass::InvalidUsage, "{msg}");
        if env.socket_ifname.is_some() {
            assert!(
                msg.contains("interfaces here: ") && msg.contains("lo (127.0.0.1"),
                "{msg}"
            );
        }
    }
}

const NETNS_TEST: &str = "ipv6_global_and_link_local_in_a_network_namespace";
/// The addresses [`SETUP`] gives the namespace's veth pair.
const GLOBAL: &str = "fd00:6::1";
const LINK_LOCAL: &str = "fe80::6:2";

/// The namespace's interfaces (`ip -batch`): a veth pair `oob6` (fd00:6::1) ↔ `oob6p`
/// (fe80::6:2), no IPv4, no automatic link-local addresses (they would stay tentative for a
/// while), and loopback for the soft fabric's ports.
const SETUP: &str = "\
link add oob6 type veth peer name oob6p
link set oob6 addrgenmode none
link set oob6p addrgenmode none
addr add fd00:6::1/64 dev oob6 nodad
addr add fe80::6:2/64 dev oob6p nodad
link set oob6 up
link set oob6p up
link set lo up
";

/// The child's side, in the namespace.
fn in_namespace() {
    let global = net_with(oob(Some("=oob6"), Some("AF_INET6")), policy()).unwrap();
    let addr = listen_addr(&global);
    assert_eq!(addr.ip(), GLOBAL.parse::<IpAddr>().unwrap());
    round_trip(&global);

    let link = net_with(oob(Some("=oob6p"), Some("AF_INET6")), policy()).unwrap();
    let addr = listen_addr(&link);
    let std::net::SocketAddr::V6(v6) = addr else {
        panic!("{addr} is not IPv6");
    };
    assert_eq!(v6.ip().to_string(), LINK_LOCAL);
    assert_ne!(v6.scope_id(), 0, "a link-local address needs its scope");
    round_trip(&link);

    // `^lo`, and NCCL's automatic order: not lo while another interface runs.
    for env in [oob(Some("^lo"), None), OobEnv::default()] {
        let net = net_with(env, policy()).unwrap();
        assert!(net.oob().ifname.starts_with("oob6"), "{:?}", net.oob());
        assert_eq!(listen_addr(&net).ip(), net.oob().addr.ip());
    }
}

#[test]
fn ipv6_global_and_link_local_in_a_network_namespace() {
    if ncclwasm_testkit::child::enter(NETNS_TEST) {
        in_namespace();
        return;
    }
    if let Some(why) = ncclwasm_testkit::netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return;
    }
    let hosts = ncclwasm_testkit::netns::Hosts::new(1);
    let ns = hosts.name(0).to_owned();
    let setup = std::env::temp_dir().join(format!("{ns}.ip"));
    std::fs::write(&setup, SETUP).unwrap();
    let out = Command::new("ip")
        .args(["-n", &ns, "-batch"])
        .arg(&setup)
        .output()
        .unwrap();
    std::fs::remove_file(&setup).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for ifname in ["oob6", "oob6p"] {
        ncclwasm_testkit::netns::wait_for_carrier(&ns, ifname);
    }
    ncclwasm_testkit::child::run(
        ncclwasm_testkit::child::command_via(hosts.exec(0), NETNS_TEST),
        NETNS_TEST,
    );
}
