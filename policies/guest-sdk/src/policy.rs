//! The trait a policy implements, generated from `ncclwasm_model::for_each_hook!`: one method
//! per hook, each with its "no opinion" default.

use crate::{Config, Hooks};

/// Makes [`Policy`] from the list of hooks, with the parameters the list gives the guest side.
macro_rules! policy_trait {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        /// A placement policy, in model types.
        ///
        /// Every hook defaults to `None` ("no opinion": the host uses its built-in default, i.e.
        /// what NCCL's own IB transport would decide), so a policy overrides only what it cares
        /// about and lists exactly those hooks in [`Policy::HOOKS`]. The host never calls a hook
        /// missing from `HOOKS`, so overriding a method without listing it has no effect.
        ///
        /// The host may discard the instance after a trap and make a fresh one (calling
        /// [`Policy::init`] again), so state kept in `self` between calls is a cache, never the
        /// only copy of something needed for a correct answer.
        pub trait Policy: Sized + Send + 'static {
            /// The hooks this policy implements, reported to the host by `init`.
            const HOOKS: Hooks;

            /// Builds the policy from its configuration. An `Err` refuses the policy: say which
            /// setting is wrong and what would be accepted, because the host logs the message as
            /// the reason.
            fn init(config: &Config) -> Result<Self, String>;

            $(
                $(#[$doc])*
                fn $method(&mut self, $($garg: $gty),*) -> Option<$ganswer> {
                    let _ = ($($garg,)*);
                    None
                }
            )*
        }
    };
}

ncclwasm_model::for_each_hook!(policy_trait);
