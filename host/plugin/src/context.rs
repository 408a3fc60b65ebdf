//! The process-wide context and its lifetime: `init` makes it (v8–v10 once per load, v11+ once
//! per communicator, counted), the last `finalize` or the image's unload drops it, which stops
//! every thread of ours (crate docs, "Lifetime").

use std::ffi::c_void;
use std::panic::catch_unwind;
use std::sync::{Arc, Mutex};

use ncclwasm_abi::*;
use ncclwasm_model::NetAttr;
use ncclwasm_policy::{PolicyCache, PolicyHost};
use ncclwasm_transport::{CommConfig, Net, NetError, TelemetryFormat};

use crate::edge::{as_handle, guard, key, null_arg};
use crate::handles::Handles;
use crate::profiler::NcclProfiler;
use crate::{fabric, log, pin};

/// Where the plugin writes the policies' telemetry (the snapshot file format), when set.
const ENV_TELEMETRY_FILE: &str = "NCCL_WASM_TELEMETRY_FILE";
/// Where it writes the same counters in Prometheus' text format, when set.
const ENV_METRICS_FILE: &str = "NCCL_WASM_METRICS_FILE";
/// How often it rewrites it.
const TELEMETRY_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The process-wide context and how many v11+ contexts use it.
struct Global {
    net: Net,
    contexts: usize,
}

static STATE: Mutex<Option<Global>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<Global>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The live context, or an error if NCCL calls before `init`.
pub(crate) fn net() -> Result<Net, NetError> {
    state()
        .as_ref()
        .map(|g| g.net.clone())
        .ok_or_else(|| NetError::Usage("the plugin is not initialised (call init first)".into()))
}

/// Makes (or, for v11+, reuses) the context; `contexts` counts v11+ communicators.
///
/// v8–v10 call `init` once per load and have no `finalize`, and `dlclose` need not unload this
/// image (a Rust library with thread-local destructors stays mapped), so their `init` may find
/// the state of an earlier load: it is replaced, so each load starts from what the machine is
/// now, not with the earlier load's virtual NICs.
pub(crate) fn init_net(
    logger: Logger,
    profiler: Profiler,
    max_devs_per_nic: usize,
    context: bool,
) -> Result<(), NetError> {
    log::install(logger);
    let mut st = state();
    if !context {
        drop(st.take());
    }
    if st.is_none() {
        let choice = fabric::choice()?;
        let decisions = Arc::new(
            PolicyHost::from_env(max_devs_per_nic).map_err(|e| NetError::Decision(Box::new(e)))?,
        );
        if decisions.settings().cache != PolicyCache::Off
            && let Err(why) = pin::pin_image()
        {
            log::emit(
                LOG_WARN,
                &format!(
                    "NET/WASM: {why}; NCCL's dlclose may unmap this library under the policy cache's worker thread"
                ),
            );
        }
        let net = Net::new(fabric::config(choice, max_devs_per_nic, decisions)?)
            .map_err(|e| fabric::hint(choice, e))?;
        for (var, format, what) in [
            (
                ENV_TELEMETRY_FILE,
                TelemetryFormat::Snapshot,
                "the policies' telemetry",
            ),
            (
                ENV_METRICS_FILE,
                TelemetryFormat::Prometheus,
                "Prometheus metrics",
            ),
        ] {
            if let Some(path) = std::env::var_os(var).filter(|p| !p.is_empty()) {
                let path = expand_path(&path);
                log::emit(
                    LOG_INFO,
                    &format!(
                        "NET/WASM: {var}: writing {what} to {} every second",
                        path.display()
                    ),
                );
                net.write_telemetry(path, format, TELEMETRY_EVERY)?;
            }
        }
        *st = Some(Global { net, contexts: 0 });
    }
    if let Some(g) = st.as_mut() {
        if context {
            g.contexts += 1;
        }
        // NCCL passes the same callback to every init (NULL when nothing is profiled).
        if let Some(callback) = profiler {
            g.net.set_profiler(Arc::new(NcclProfiler::new(callback)));
        }
    }
    Ok(())
}

/// A file variable's path with `%h` (the host name up to its first dot) and `%p` (the process
/// id) filled in, as NCCL fills in `NCCL_DEBUG_FILE`: the ranks of a node can share one
/// setting and still write a file each.
fn expand_path(path: &std::ffi::OsStr) -> std::path::PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let host = log::short_host();
    let mut out = Vec::with_capacity(path.len());
    let mut bytes = path.as_bytes().iter();
    while let Some(&b) = bytes.next() {
        match (b, bytes.as_slice().first()) {
            (b'%', Some(b'h')) => out.extend_from_slice(host.as_bytes()),
            (b'%', Some(b'p')) => out.extend_from_slice(std::process::id().to_string().as_bytes()),
            _ => {
                out.push(b);
                continue;
            }
        }
        bytes.next();
    }
    std::ffi::OsString::from_vec(out).into()
}

/// A v11+ per-communicator context: its id, traffic class and NCCL's latest `setNetAttr` hint
/// (written by the proxy's progress thread, read by `connect` on its proxy thread).
struct Ctx {
    comm: Mutex<CommConfig>,
}

/// The v11+ contexts NCCL holds: like communicators, a context is a generation-checked key, not
/// an address, so a second `finalize` or a finalized (or made-up) context passed to `listen`,
/// `connect` or `setNetAttr` is refused as invalid usage instead of freeing or reading freed
/// memory.
static CTXS: Handles<Ctx> = Handles::new("context");

/// What a connection of the v11+ context `ctx` is planned with; a context that is not open is
/// refused.
pub(crate) fn config(ctx: *mut c_void) -> Result<CommConfig, NetError> {
    CTXS.with(key(ctx, "ctx")?, |c| {
        Ok(*c.comm.lock().unwrap_or_else(|p| p.into_inner()))
    })
}

/// `setNetAttr` (v11+): NCCL's hint about the communicator's coming transfers, kept for the
/// plans of its next connections (a connection already planned keeps its plan).
pub(crate) unsafe extern "C" fn set_net_attr(ctx: *mut c_void, attr: *mut NetAttrC) -> NcclResult {
    guard("setNetAttr", || {
        let k = key(ctx, "ctx")?;
        // SAFETY: NULL or NCCL's struct, valid for the call.
        let hint = unsafe { attr.as_ref() }
            .ok_or_else(|| null_arg("netAttr"))?
            .to_model();
        CTXS.with(k, |ctx| {
            remember(
                &mut ctx.comm.lock().unwrap_or_else(|p| p.into_inner()),
                hint,
            );
            Ok(())
        })
    })
}

/// Keeps NCCL's latest hint for the context's next connections.
fn remember(comm: &mut CommConfig, hint: NetAttr) {
    // NCCL sends one whenever the shape of its transfers changes: its own log has them at
    // TRACE, so does this one.
    if comm.net_attr != Some(hint) {
        tracing::debug!(
            "NET/WASM: comm {:#x} hint: send {:?}, recv {:?}, ops {:?}, algos {:?}, protos {:?}",
            comm.comm_id,
            hint.send,
            hint.recv,
            hint.ops,
            hint.algos,
            hint.protos
        );
    }
    comm.net_attr = Some(hint);
}

pub(crate) fn init_ctx(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    profiler: Profiler,
    max_devs: usize,
) -> NcclResult {
    guard("init", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { ctx.as_mut() }.ok_or_else(|| null_arg("ctx"))?;
        *out = std::ptr::null_mut();
        // SAFETY: NULL or NCCL's config.
        let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.traffic_class);
        let k = CTXS.insert(Ctx {
            comm: Mutex::new(CommConfig {
                comm_id,
                traffic_class: tc,
                net_attr: None,
                one_sided: None,
            }),
        })?;
        if let Err(e) = init_net(logger, profiler, max_devs, true) {
            // Not handed out, so not counted: the key goes stale at once.
            let _ = CTXS.remove(k, |_| true);
            return Err(e);
        }
        tracing::info!("NET/WASM: init comm {comm_id:#x} traffic class {tc}");
        *out = as_handle(k);
        Ok(())
    })
}

/// `finalize`: the last context drops the process-wide state, stopping every thread. NULL (no
/// context was made) is tolerated; a context finalized already, or never made, is refused and
/// counts for nothing.
pub(crate) unsafe extern "C" fn finalize(ctx: *mut c_void) -> NcclResult {
    guard("finalize", || {
        if ctx.is_null() {
            return Ok(());
        }
        CTXS.remove(key(ctx, "ctx")?, |_| true)?;
        let last = {
            let mut st = state();
            match st.as_mut() {
                Some(g) => {
                    g.contexts = g.contexts.saturating_sub(1);
                    if g.contexts == 0 { st.take() } else { None }
                }
                None => None,
            }
        };
        drop(last);
        Ok(())
    })
}

/// Drops the process-wide state when the image is unloaded without `finalize` (ABI v8–v10 have
/// none), so no thread of ours outlives the code it runs.
extern "C" fn unload() {
    let _ = catch_unwind(|| {
        // At process exit another thread may hold the lock mid-call: then leave it be.
        if let Ok(mut st) = STATE.try_lock() {
            drop(st.take());
        }
    });
}

#[used]
#[unsafe(link_section = ".fini_array")]
static UNLOAD: extern "C" fn() = unload;

#[cfg(test)]
mod tests {
    use super::expand_path;
    use std::ffi::OsStr;

    #[test]
    fn a_file_variable_names_the_host_and_the_process() {
        let short = crate::log::short_host();
        let pid = std::process::id();
        assert_eq!(
            expand_path(OsStr::new("/run/m/%h-%p.prom")),
            std::path::PathBuf::from(format!("/run/m/{short}-{pid}.prom"))
        );
        // Anything else stays as written, a lone % at the end too.
        assert_eq!(
            expand_path(OsStr::new("/a%%x/%q%")),
            std::path::PathBuf::from("/a%%x/%q%")
        );
    }
}
