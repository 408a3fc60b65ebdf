//! What [`crate::export_policy!`] expands to: the one instance of the policy and the WIT exports,
//! generated from `ncclwasm_model::for_each_hook!`. Not public API.

use std::marker::PhantomData;
use std::sync::{Mutex, PoisonError};

use crate::{Config, Policy, bindings as wit};

/// Holds the policy built by `init`. WIT exports are free functions, so the instance lives in a
/// static; a component instance is single-threaded, the mutex only makes the static `Sync`.
#[derive(Debug)]
pub struct Slot<P>(Mutex<Option<P>>);

impl<P: Policy> Default for Slot<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Policy> Slot<P> {
    pub const fn new() -> Self {
        Slot(Mutex::new(None))
    }

    /// Builds the policy; a repeated `init` replaces the previous instance.
    pub fn init(
        &self,
        name: &str,
        version: &str,
        config: Vec<(String, String)>,
    ) -> Result<wit::PolicyInfo, String> {
        let policy = P::init(&Config::new(config))?;
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(policy);
        Ok(wit::PolicyInfo {
            name: name.to_owned(),
            version: version.to_owned(),
            hooks: P::HOOKS,
        })
    }

    /// Runs a hook on the instance. A hook before `init` is a host bug; panicking turns it into a
    /// trap the host reports, rather than a silent "no opinion".
    fn with<R>(&self, hook: impl FnOnce(&mut P) -> Option<R>) -> Option<R> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        hook(slot.as_mut().expect("policy hook called before init"))
    }
}

/// A policy exported by [`crate::export_policy!`]: its instance and what `init` reports.
pub trait Exported: Policy {
    /// The static that holds the instance.
    fn slot() -> &'static Slot<Self>;

    /// The name and version `init` reports (`policy-info`).
    fn info() -> (String, String);
}

/// The type wit-bindgen's export glue calls: the [`wit::Guest`] of policy `P`.
#[derive(Debug)]
pub struct Export<P>(PhantomData<P>);

/// A hook input the SDK converts from its WIT form (`convert` implements it).
pub trait FromWit: Sized {
    type Wit;
    fn from_wit(wit: Self::Wit) -> Self;
}

/// A hook answer the SDK converts to its WIT form (`convert` implements it).
pub trait IntoWit {
    type Wit;
    fn into_wit(self) -> Self::Wit;
}

/// How a hook parameter crosses from the WIT export to the policy method: what the export
/// receives (`Wit`), what the SDK converts it to (`Owned`), and ([`Lend`]) how the method
/// borrows that.
pub trait Arg {
    type Wit;
    type Owned;
    fn own(wit: Self::Wit) -> Self::Owned;
}

/// The parameter a policy method takes, lent from the converted value.
pub trait Lend<'a>: Arg {
    fn lend(owned: &'a Self::Owned) -> Self;
}

impl<T: FromWit> Arg for &[T] {
    type Wit = Vec<T::Wit>;
    type Owned = Vec<T>;
    fn own(wit: Self::Wit) -> Vec<T> {
        wit.into_iter().map(T::from_wit).collect()
    }
}

impl<'a, T: FromWit> Lend<'a> for &'a [T] {
    fn lend(owned: &'a Vec<T>) -> Self {
        owned
    }
}

impl<T: FromWit> Arg for &T {
    type Wit = T::Wit;
    type Owned = T;
    fn own(wit: T::Wit) -> T {
        T::from_wit(wit)
    }
}

impl<'a, T: FromWit> Lend<'a> for &'a T {
    fn lend(owned: &'a T) -> Self {
        owned
    }
}

/// Sizes: the WIT carries them as `u32`.
impl Arg for usize {
    type Wit = u32;
    type Owned = usize;
    fn own(wit: u32) -> usize {
        wit as usize
    }
}

impl Lend<'_> for usize {
    fn lend(owned: &usize) -> usize {
        *owned
    }
}

/// Implements [`wit::Guest`] for [`Export`] from the list of hooks: each export converts its
/// arguments, asks the policy and converts the answer back.
macro_rules! guest_exports {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        impl<P: Exported> wit::Guest for Export<P> {
            fn init(config: Vec<(String, String)>) -> Result<wit::PolicyInfo, String> {
                let (name, version) = P::info();
                P::slot().init(&name, &version, config)
            }

            $(
                fn $method(
                    $($garg: <$gty as Arg>::Wit),*
                ) -> Option<<$ganswer as IntoWit>::Wit> {
                    $(let $garg = <$gty as Arg>::own($garg);)*
                    P::slot()
                        .with(|p| p.$method($(Lend::lend(&$garg)),*))
                        .map(IntoWit::into_wit)
                }
            )*
        }
    };
}

ncclwasm_model::for_each_hook!(guest_exports);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::Guest;
    use crate::{GidChoice, Hooks, Port};

    /// Answers with the GID index its config names; refuses an empty config.
    #[derive(Debug)]
    struct Fixed(u32);

    impl Policy for Fixed {
        const HOOKS: Hooks = Hooks::SELECT_GID;

        fn init(config: &Config) -> Result<Self, String> {
            let index = config.get("index").ok_or("no index")?;
            index.parse().map(Fixed).map_err(|e| format!("{e}"))
        }

        fn select_gid(&mut self, _port: &Port) -> Option<GidChoice> {
            Some(GidChoice {
                index: self.0,
                reason: "fixed".into(),
            })
        }
    }

    /// Never `init`-ed: its own slot, apart from `Fixed`'s.
    #[derive(Debug)]
    struct NeverInit;

    impl Policy for NeverInit {
        const HOOKS: Hooks = Hooks::SELECT_GID;

        fn init(_: &Config) -> Result<Self, String> {
            Ok(NeverInit)
        }
    }

    /// What `export_policy!` implements, without the wit-bindgen export symbols.
    macro_rules! exported {
        ($policy:ty) => {
            impl Exported for $policy {
                fn slot() -> &'static Slot<Self> {
                    static SLOT: Slot<$policy> = Slot::new();
                    &SLOT
                }

                fn info() -> (String, String) {
                    (stringify!($policy).into(), "1.2.3".into())
                }
            }
        };
    }

    exported!(Fixed);
    exported!(NeverInit);

    fn port() -> wit::Port {
        wit::Port {
            index: 0,
            device: "d".into(),
            port: 1,
            state: wit::ncclwasm::policy::types::PortState::Active,
            link_layer: wit::ncclwasm::policy::types::LinkLayer::Ethernet,
            speed_mbps: 1,
            width: 1,
            mtu: 1024,
            lid: 0,
            pci_path: String::new(),
            full_pci_path: String::new(),
            guid: 0,
            numa_node: -1,
            max_qps: 1,
            provider: "soft".into(),
            gids: Vec::new(),
        }
    }

    fn config(index: &str) -> Vec<(String, String)> {
        vec![("index".into(), index.into())]
    }

    type Fix = Export<Fixed>;

    #[test]
    fn init_reports_info_and_a_later_init_replaces_the_instance() {
        let info = Fix::init(config("3")).unwrap();
        assert_eq!(
            (info.name.as_str(), info.version.as_str()),
            ("Fixed", "1.2.3")
        );
        assert_eq!(info.hooks, Hooks::SELECT_GID);
        assert_eq!(Fix::select_gid(port()).unwrap().index, 3);
        Fix::init(config("5")).unwrap();
        assert_eq!(Fix::select_gid(port()).unwrap().index, 5);
        // Hooks the policy leaves alone answer "no opinion".
        assert!(Fix::select_devices(vec![port()]).is_none());
        assert!(Fix::group_devices(vec![port(), port()], 4).is_none());
    }

    #[test]
    fn init_errors_reach_the_host() {
        assert_eq!(Fix::init(Vec::new()).unwrap_err(), "no index");
    }

    #[test]
    #[should_panic(expected = "before init")]
    fn a_hook_before_init_traps() {
        Export::<NeverInit>::select_gid(port());
    }
}
