//! Network namespaces as "hosts": tests that cross machines make their own namespaces, join
//! them with veth pairs carrying test-only addresses, run children inside, and remove it all
//! afterwards — also when the test panics, since [`Hosts`] removes its namespaces on drop.
//!
//! Each veth end is created directly inside its namespace (`ip link add … netns …`), so its
//! name only has to be unique within that namespace: tests can give them meaningful names
//! (`rail0`) and hand them to `NCCL_SOCKET_IFNAME`. Only the namespace names are global; they
//! carry the process id and a counter so parallel tests and test binaries never collide.
//! Loopback stays down unless a test asks for it ([`Hosts::loopback_up`]), so traffic that
//! works really crossed a veth.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Why namespaces cannot be made here (not root, or no working `ip netns`); `None` when they
/// can. A test passes the reason to [`skip`](crate::skip) and returns.
pub fn unavailable() -> Option<&'static str> {
    if !is_root() {
        return Some("needs root to create network namespaces");
    }
    let works = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .is_ok_and(|o| o.status.success());
    (!works).then_some("`ip netns` is unavailable")
}

/// Effective uid 0, from `/proc/self/status` (this crate has no FFI).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Runs `ip` with `args` in this process's network namespace; panics with its stderr when it
/// fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running `ip {}`: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Returns once interface `ifname` in namespace `ns` has carrier (`LOWER_UP`): a veth gets it a
/// moment after both its ends are up, and NCCL's interface choice skips an interface that is
/// not running yet.
pub fn wait_for_carrier(ns: &str, ifname: &str) {
    crate::wait_until(
        &format!("{ifname} in {ns} has carrier"),
        std::time::Duration::from_secs(10),
        || {
            Command::new("ip")
                .args(["-n", ns, "-o", "link", "show", "dev", ifname])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP"))
        },
    );
}

/// `n` network namespaces ("hosts") owned by the test; dropped, they are deleted with every
/// veth in them.
#[derive(Debug)]
pub struct Hosts {
    names: Vec<String>,
}

impl Hosts {
    /// Creates `n` empty namespaces. Call [`unavailable`] first: this panics where namespaces
    /// cannot be made.
    pub fn new(n: usize) -> Hosts {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let set = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut hosts = Hosts {
            names: Vec::with_capacity(n),
        };
        for i in 0..n {
            let name = format!("ncclwasm-{}-{set}-{i}", std::process::id());
            ip(&["netns", "add", &name]);
            // Owned from here on: a later failure still removes it.
            hosts.names.push(name);
        }
        hosts
    }

    /// The namespace name of host `i`.
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// Joins host `a` and host `b` with a veth pair: `a_end = (interface name, a.b.c.d/len)`
    /// in `a`, likewise in `b`; both ends are brought up, and this returns once both have
    /// carrier ([`wait_for_carrier`]).
    pub fn link(&self, a: usize, a_end: (&str, &str), b: usize, b_end: (&str, &str)) {
        let (na, nb) = (self.names[a].clone(), self.names[b].clone());
        ip(&[
            "link", "add", a_end.0, "netns", &na, "type", "veth", "peer", "name", b_end.0, "netns",
            &nb,
        ]);
        for (ns, (name, cidr)) in [(&na, a_end), (&nb, b_end)] {
            ip(&["-n", ns, "addr", "add", cidr, "dev", name]);
            ip(&["-n", ns, "link", "set", name, "up"]);
        }
        for (ns, name) in [(&na, a_end.0), (&nb, b_end.0)] {
            wait_for_carrier(ns, name);
        }
    }

    /// Brings `lo` up in host `i`, for tests that want loopback inside a namespace too.
    pub fn loopback_up(&self, i: usize) {
        ip(&["-n", &self.names[i], "link", "set", "lo", "up"]);
    }

    /// `ip netns exec <host i>`: a launcher for [`child::command_via`](crate::child::command_via),
    /// or give it a program and arguments of your own.
    pub fn exec(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i]]);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.names {
            // Best effort while unwinding; a leftover would show in `ip netns list`.
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(ns: &str) -> bool {
        let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.split_whitespace().next() == Some(ns))
    }

    /// Two hosts reach each other over their veth and only over it (loopback stays down), and
    /// the namespaces are gone once the value is dropped, even by a panic.
    #[test]
    fn hosts_talk_over_their_veth_and_are_removed() {
        if let Some(why) = unavailable() {
            crate::skip(why);
            return;
        }
        let names = std::panic::catch_unwind(|| {
            let h = Hosts::new(2);
            h.link(0, ("left", "192.0.2.1/24"), 1, ("right", "192.0.2.2/24"));
            // A TCP knock on a closed port: "refused" means the packet got there and back;
            // with no path the connect hangs until `timeout` ends it.
            let reaches = |i: usize, to: &str| {
                let out = h
                    .exec(i)
                    .args(["timeout", "2", "bash", "-c"])
                    .arg(format!("exec 3<>/dev/tcp/{to}/9"))
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stderr).contains("refused")
            };
            assert!(reaches(0, "192.0.2.2"), "no path over the veth");
            assert!(!reaches(0, "192.0.2.1"), "loopback should be down");
            let names = [h.name(0).to_owned(), h.name(1).to_owned()];
            assert!(names.iter().all(|n| exists(n)));
            std::panic::panic_any(names)
        })
        .expect_err("the closure panics on purpose")
        .downcast::<[String; 2]>()
        .expect("the names, unless an assertion failed");
        assert!(names.iter().all(|n| !exists(n)), "{names:?} left behind");
    }
}
