//! The wasmtime side: one engine per [`crate::PolicyHost`], its epoch ticker, the linker with the
//! only imports a policy gets, compilation with a content-addressed cache, and per-version pools of
//! instances.
//!
//! Sandbox, in a few lines (see `wit/policy.wit`):
//! - time: epoch interruption; a ticker thread advances the epoch every `timeout / 10` and each
//!   call gets a deadline of ten ticks, so a runaway call is stopped at 0.9–1.0 × the timeout;
//! - memory: a [`ResourceLimiter`] caps each linear memory and traps on a refused growth, and
//!   remembers that it refused, so the fault is reported as out-of-memory rather than a trap;
//! - capabilities: the `log` import, plus what Rust's std on wasm32-wasip2 imports (`wasi:io`,
//!   `wasi:cli`, `wasi:random`) backed by an *empty* WASI context: no preopens, no environment, no
//!   arguments, null stdio. Clocks, filesystem and sockets are not linked at all — a component
//!   that imports them is refused at load time with the import's name, because a linked
//!   monotonic clock would also let a guest block the host in `poll` where no epoch can reach it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasData, HasSelf, Linker, ResourceTable};
use wasmtime::{ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, Trap};
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::random::WasiRandom;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use ncclwasm_model::telemetry::TelemetrySource;

// A wasmtime error as one line: policy errors end up in single WARN lines and CLI output.
use crate::backtrace::{self, one_line};
use crate::{ENV_CACHE_DIR, FailureCause, Hook, PolicyCache, PolicyError, Settings};

/// The generated bindings of world `ncclwasm:policy/policy`.
pub(crate) mod wit {
    wasmtime::component::bindgen!({ path: "../../wit", world: "policy" });
}

/// The target of every log line of this crate.
pub(crate) const LOG_TARGET: &str = "ncclwasm::policy";

/// Epoch ticks per timeout: the resolution of the time bound.
const TICKS_PER_TIMEOUT: u32 = 10;
/// Compiled components kept in memory; more than a watcher flipping between a few versions needs.
const COMPILED_CACHE_ENTRIES: usize = 8;
/// Idle instances kept per loaded version: about the number of NCCL threads that ask at once.
const POOL_SIZE: usize = 8;
/// `log` lines a guest may write per call; the rest are counted and reported in one line.
const LOG_LINES_PER_CALL: u32 = 16;
/// Longest `log` line kept, in bytes.
const LOG_LINE_MAX: usize = 512;

/// Import names (or name prefixes) a policy may have; see the module docs.
const ALLOWED_IMPORTS: [&str; 6] = [
    "log",
    "ncclwasm:policy/types",
    "ncclwasm:policy/telemetry",
    "wasi:io/",
    "wasi:cli/",
    "wasi:random/",
];

/// Core instances, linear memories and tables one policy's store may create. Generous: a
/// component is several core modules (a Rust std guest: its own and WASI's adapter; a
/// componentize-py guest: 38 instances), and what bounds a guest is its memory, counted over
/// all its memories together (`NCCL_WASM_POLICY_MEMORY_MB`), and its time per call. These only
/// stop a component from being built of thousands of pieces.
const MAX_INSTANCES: usize = 100;
const MAX_MEMORIES: usize = 16;
const MAX_TABLES: usize = 100;

/// Which of the structural limits above an instantiation error is about, if any (wasmtime's
/// "instance count too high at 101", and the same for memories and tables).
fn structural_limit(e: &wasmtime::Error) -> Option<&'static str> {
    let text = format!("{e:#}");
    [
        ("instance count too high", "core instances"),
        ("memory count too high", "memories"),
        ("table count too high", "tables"),
    ]
    .into_iter()
    .find(|(needle, _)| text.contains(needle))
    .map(|(_, what)| what)
}

/// What one store holds: the empty WASI context, the limits and the `log` budget.
pub(crate) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    /// Set when the limiter refused a growth, so the trap that follows is reported as OOM.
    memory_refused: bool,
    /// Bytes of all the store's linear memories together, and their bound.
    memory_total: usize,
    memory_cap: usize,
    /// `name@version` (or the file name before `init` said), for log lines.
    label: Arc<str>,
    log_left: u32,
    log_dropped: u32,
    /// Where `telemetry.read` reads, set for each call; and what it read in this call, so that
    /// every read of one call sees the same counters (and sums them once).
    telemetry: Option<Arc<dyn TelemetrySource>>,
    telemetry_read: Option<Arc<wit::ncclwasm::policy::telemetry::Snapshot>>,
}

impl HostState {
    fn new(memory_mb: u32, label: Arc<str>) -> Self {
        let memory_cap = usize::try_from(u64::from(memory_mb) << 20).unwrap_or(usize::MAX);
        HostState {
            // Empty on purpose: no preopens, env, args or sockets; stdio reads EOF and writes nowhere.
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
            limits: StoreLimitsBuilder::new()
                .memory_size(memory_cap)
                .instances(MAX_INSTANCES)
                .memories(MAX_MEMORIES)
                .tables(MAX_TABLES)
                .table_elements(1 << 20)
                .trap_on_grow_failure(true)
                .build(),
            memory_refused: false,
            memory_total: 0,
            memory_cap,
            label,
            log_left: LOG_LINES_PER_CALL,
            log_dropped: 0,
            telemetry: None,
            telemetry_read: None,
        }
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl ResourceLimiter for HostState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // Memories are created through here too (from 0), so the total counts every one.
        let total = self
            .memory_total
            .saturating_sub(current)
            .saturating_add(desired);
        let verdict = match self.limits.memory_growing(current, desired, maximum) {
            // The bound is for the guest, however many memories it spreads over.
            Ok(true) if total > self.memory_cap => Err(wasmtime::Error::msg(format!(
                "the guest's memories would hold {total} bytes together, over its {} bytes",
                self.memory_cap
            ))),
            other => other,
        };
        match verdict {
            // Past the memory's own maximum the growth fails after all: nothing to count.
            Ok(true) if maximum.is_some_and(|m| desired > m) => {}
            Ok(true) => self.memory_total = total,
            _ => self.memory_refused = true,
        }
        verdict
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

impl wit::ncclwasm::policy::types::Host for HostState {}

impl wit::ncclwasm::policy::telemetry::Host for HostState {
    /// The counters of the source the call was armed with (none: nothing ran, an empty
    /// snapshot), read once per call.
    fn read(&mut self) -> wit::ncclwasm::policy::telemetry::Snapshot {
        let source = &self.telemetry;
        let snapshot = self.telemetry_read.get_or_insert_with(|| {
            let model = source.as_ref().map(|s| s.snapshot()).unwrap_or_default();
            Arc::new(crate::convert::telemetry(&model))
        });
        (**snapshot).clone()
    }
}

impl wit::PolicyImports for HostState {
    /// Guest lines go to `tracing` under the policy's name, capped in length and in number per
    /// call so a guest cannot flood NCCL's log.
    fn log(&mut self, level: wit::LogLevel, mut message: String) {
        if self.log_left == 0 {
            self.log_dropped += 1;
            return;
        }
        self.log_left -= 1;
        ncclwasm_model::text::shorten(&mut message, LOG_LINE_MAX);
        let policy = &*self.label;
        match level {
            wit::LogLevel::Error => tracing::error!(target: LOG_TARGET, policy, "{message}"),
            wit::LogLevel::Warn => tracing::warn!(target: LOG_TARGET, policy, "{message}"),
            wit::LogLevel::Info => tracing::info!(target: LOG_TARGET, policy, "{message}"),
            wit::LogLevel::Debug => tracing::debug!(target: LOG_TARGET, policy, "{message}"),
        }
    }
}

/// `HasData` for the WASI I/O interfaces, which only need the resource table.
struct IoTable;

impl HasData for IoTable {
    type Data<'a> = &'a mut ResourceTable;
}

/// Link exactly the imports a policy may have (module docs).
fn link(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    use wasmtime_wasi::p2::bindings::sync::{cli, io, random};
    wit::Policy::add_to_linker::<_, HasSelf<_>>(linker, |h| h)?;
    let l = linker;
    io::error::add_to_linker::<_, IoTable>(l, |h| &mut h.table)?;
    io::poll::add_to_linker::<_, IoTable>(l, |h| &mut h.table)?;
    io::streams::add_to_linker::<_, IoTable>(l, |h| &mut h.table)?;
    cli::environment::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::exit::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::stdin::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::stdout::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::stderr::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::terminal_input::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::terminal_output::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::terminal_stdin::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::terminal_stdout::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    cli::terminal_stderr::add_to_linker::<_, WasiCli>(l, HostState::cli)?;
    random::random::add_to_linker::<_, WasiRandom>(l, |h| h.wasi.random())?;
    random::insecure::add_to_linker::<_, WasiRandom>(l, |h| h.wasi.random())?;
    random::insecure_seed::add_to_linker::<_, WasiRandom>(l, |h| h.wasi.random())?;
    Ok(())
}

/// Advances the engine's epoch every tick; stopped and joined when the engine is dropped.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: wasmtime::Engine, tick: Duration) -> Result<Ticker, PolicyError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("ncclwasm-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Acquire) {
                    std::thread::park_timeout(tick);
                    engine.increment_epoch();
                }
            })
            .map_err(|e| PolicyError::Engine(format!("cannot start the epoch thread: {e}")))?;
        Ok(Ticker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // The ticker only sleeps and increments; it cannot panic.
            let _ = t.join();
        }
    }
}

/// zstd's default level, wasmtime's baseline for its cache entries.
const CACHE_COMPRESSION_LEVEL: i32 = 3;

/// wasmtime's on-disk cache of compiled components, as [`PolicyCache`] says. It never fails:
/// a directory that cannot be used (the per-user default refused, or the operator's
/// `NCCL_WASM_POLICY_CACHE_DIR` not creatable or writable) is WARNed once per process and the
/// engine compiles in memory, so the cache costs compile time, never the job — with or without
/// a policy set.
fn disk_cache(choice: &PolicyCache) -> Option<wasmtime::Cache> {
    let open = |dir: &Path| {
        // wasmtime takes absolute paths only.
        let dir = std::path::absolute(dir).map_err(|e| e.to_string())?;
        let mut cache = wasmtime::CacheConfig::new();
        // wasmtime's worker recompresses an entry at zstd level 20 once it has been read 256
        // times: seconds of a core in a background thread of the rank that reads it then,
        // during the job (a third of the samples of a profile of the per-message bench, on 2
        // cores), and started again by the next process when one exits first. An optimised
        // level equal to the baseline's means never.
        cache
            .with_directory(dir)
            .with_baseline_compression_level(CACHE_COMPRESSION_LEVEL)
            .with_optimized_compression_level(CACHE_COMPRESSION_LEVEL);
        wasmtime::Cache::new(cache).map_err(|e| one_line(&e))
    };
    let (named, hint) = match choice {
        PolicyCache::Off => return None,
        PolicyCache::Dir(_) => (format!("{ENV_CACHE_DIR}="), "=off silences this"),
        PolicyCache::PerUser => (
            String::new(),
            "=DIR names another directory, =off silences this",
        ),
    };
    let cache = match choice.directory() {
        Ok(None) => return None,
        Ok(Some(dir)) => open(&dir).map_err(|e| format!("{named}{}: {e}", dir.display())),
        Err(refused) => Err(refused),
    };
    cache
        .inspect_err(|why| {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    target: LOG_TARGET,
                    "{why}; compiling policies in memory, without the disk cache \
                     ({ENV_CACHE_DIR}{hint})"
                )
            });
        })
        .ok()
}

/// The engine shared by every version a host loads. Dropped (and its ticker joined) when the
/// host and the last loaded version are gone.
pub(crate) struct PolicyEngine {
    engine: wasmtime::Engine,
    linker: Linker<HostState>,
    /// Compiled components by the sha256 of their bytes, newest last.
    compiled: Mutex<Vec<([u8; 32], Component)>>,
    /// The on-disk cache the engine compiles through (its hit count tells a load where the code
    /// came from); `None` when off.
    disk_cache: Option<wasmtime::Cache>,
    deadline_ticks: u64,
    timeout: Duration,
    memory_mb: u32,
    /// What a guest's `telemetry.read` reads ([`PolicyEngine::set_telemetry`]).
    telemetry: Mutex<Option<Arc<dyn TelemetrySource>>>,
    _ticker: Ticker,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("timeout", &self.timeout)
            .field("memory_mb", &self.memory_mb)
            .finish_non_exhaustive()
    }
}

impl PolicyEngine {
    pub(crate) fn new(settings: &Settings) -> Result<Arc<PolicyEngine>, PolicyError> {
        let engine_err = |e: wasmtime::Error| PolicyError::Engine(one_line(&e));
        let mut config = wasmtime::Config::new();
        config
            .strategy(wasmtime::Strategy::Cranelift)
            .epoch_interruption(true)
            // Not needed by policies, and async support makes every call several times dearer.
            .concurrency_support(false)
            // A fault's line says where in the policy it happened (`backtrace::one_line`); the
            // capture costs ~10 µs per trap, against the fresh instance every trap costs anyway.
            .wasm_backtrace_max_frames(Some(backtrace::CAPTURED_FRAMES))
            // Keep the component's DWARF, when it has any, for file:line in that line. It is
            // read only when a trap is reported; compiling merely copies its sections.
            .wasm_backtrace_details(wasmtime::WasmBacktraceDetails::Enable);
        let disk_cache = disk_cache(&settings.cache);
        config.cache(disk_cache.clone());
        let engine = wasmtime::Engine::new(&config).map_err(engine_err)?;
        let mut linker = Linker::new(&engine);
        link(&mut linker).map_err(engine_err)?;
        let tick = (settings.timeout / TICKS_PER_TIMEOUT).max(Duration::from_micros(100));
        Ok(Arc::new(PolicyEngine {
            _ticker: Ticker::start(engine.clone(), tick)?,
            engine,
            linker,
            compiled: Mutex::new(Vec::new()),
            disk_cache,
            deadline_ticks: u64::from(TICKS_PER_TIMEOUT),
            timeout: settings.timeout,
            memory_mb: settings.memory_mb,
            telemetry: Mutex::new(None),
        }))
    }

    /// Where every later call's `telemetry.read` reads: the data path's counters in a job, a
    /// snapshot file offline.
    pub(crate) fn set_telemetry(&self, source: Arc<dyn TelemetrySource>) {
        *self.telemetry.lock().unwrap_or_else(|p| p.into_inner()) = Some(source);
    }

    /// Whether a source was set.
    pub(crate) fn has_telemetry(&self) -> bool {
        self.telemetry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn telemetry(&self) -> Option<Arc<dyn TelemetrySource>> {
        self.telemetry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Compile `bytes` (or reuse the compilation of identical bytes) and check that the component
    /// is a policy. `what` names it in errors (a path, or a label given by the caller). Imports
    /// are checked first, from the bytes: a component that would be refused is not compiled.
    pub(crate) fn prepare(&self, bytes: &[u8], what: &str) -> Result<Prepared, PolicyError> {
        check_header(bytes, what)?;
        // Bytes the parser refuses would not compile either: the same error as compiling.
        let imports = imports(bytes).map_err(|e| PolicyError::Compile {
            what: what.to_owned(),
            detail: e.to_string(),
        })?;
        check_imports(&imports, what)?;
        let sha: [u8; 32] = Sha256::digest(bytes).into();
        let started = Instant::now();
        let (component, cache) = self.compile(bytes, sha, what)?;
        let compilation = Compilation {
            bytes: bytes.len(),
            imports,
            time: started.elapsed(),
            cache,
        };
        self.check_world(&component, what)?;
        let not_policy = |e: wasmtime::Error| PolicyError::NotAPolicy {
            what: what.to_owned(),
            why: one_line(&e),
        };
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(not_policy)?;
        let pre = wit::PolicyPre::new(pre).map_err(not_policy)?;
        Ok(Prepared {
            pre,
            sha,
            compilation,
        })
    }

    fn compile(
        &self,
        bytes: &[u8],
        sha: [u8; 32],
        what: &str,
    ) -> Result<(Component, CompileCache), PolicyError> {
        if let Some((_, c)) = self.compiled().iter().find(|(s, _)| *s == sha) {
            return Ok((c.clone(), CompileCache::Memory));
        }
        let hits = self.disk_cache.as_ref().map(wasmtime::Cache::cache_hits);
        // Compile outside the lock: it takes tens of ms and other versions may be looked up.
        let component = Component::new(&self.engine, bytes).map_err(|e| PolicyError::Compile {
            what: what.to_owned(),
            detail: one_line(&e),
        })?;
        // Another thread's compilation may count a hit in between; a load is rare enough that
        // this only ever mislabels a racing pair.
        let cache = match (
            hits,
            self.disk_cache.as_ref().map(wasmtime::Cache::cache_hits),
        ) {
            (Some(before), Some(after)) if after > before => CompileCache::Disk,
            (Some(_), _) => CompileCache::Compiled,
            (None, _) => CompileCache::Off,
        };
        let mut compiled = self.compiled();
        if compiled.len() >= COMPILED_CACHE_ENTRIES {
            compiled.remove(0);
        }
        compiled.push((sha, component.clone()));
        Ok((component, cache))
    }

    fn compiled(&self) -> std::sync::MutexGuard<'_, Vec<([u8; 32], Component)>> {
        // A panic while holding this lock cannot leave the Vec inconsistent.
        self.compiled.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Name the exports that are missing before wasmtime's type check, whose messages are about
    /// linker internals rather than about the policy world (forbidden imports were refused
    /// before compiling, by `check_imports`).
    fn check_world(&self, component: &Component, what: &str) -> Result<(), PolicyError> {
        let ty = component.component_type();
        let exports: Vec<&str> = ty.exports(&self.engine).map(|(n, _)| n).collect();
        // The exports that make a component a policy: `init` and every hook.
        let missing: Vec<&str> = Hook::EXPORTS
            .iter()
            .copied()
            .filter(|r| !exports.contains(r))
            .collect();
        if !missing.is_empty() {
            return Err(PolicyError::NotAPolicy {
                what: what.to_owned(),
                why: format!(
                    "it does not export {} (it exports [{}]); build it from wit/policy.wit, world `policy`",
                    missing.join(", "),
                    exports.join(", ")
                ),
            });
        }
        Ok(())
    }
}

/// The top-level imports of a component, read from its bytes (nested modules' and components'
/// own imports are satisfied inside it). Imported types (a world's records and enums) are names,
/// not capabilities, and are left out.
fn imports(bytes: &[u8]) -> Result<Vec<String>, wasmparser::BinaryReaderError> {
    use wasmparser::{ComponentTypeRef, Parser, Payload};
    let mut names = Vec::new();
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        match payload? {
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(section) if depth == 0 => {
                for import in section {
                    let import = import?;
                    if !matches!(import.ty, ComponentTypeRef::Type(_)) {
                        names.push(import.name.name.to_owned());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(names)
}

/// Refuse what policies are not given, naming it; for WASI's clocks, filesystem and sockets,
/// which a language runtime imports whether the policy uses them or not, say how such a
/// component is built without them.
fn check_imports(imports: &[String], what: &str) -> Result<(), PolicyError> {
    let forbidden: Vec<&str> = imports
        .iter()
        .map(String::as_str)
        .filter(|n| !ALLOWED_IMPORTS.iter().any(|a| n.starts_with(a)))
        .collect();
    if forbidden.is_empty() {
        return Ok(());
    }
    let runtime = forbidden.iter().all(|n| n.starts_with("wasi:"));
    let fix = if runtime {
        "policies are not given a filesystem, network or clock; when a language runtime imports \
         them (componentize-py, a C library built for WASI), build with them stubbed out \
         (componentize-py --stub-wasi; `wasi-virt` for others) or remove the code that needs them"
    } else {
        "policies are only given `log` and the interfaces of wit/policy.wit; build it from world `policy`"
    };
    Err(PolicyError::NotAPolicy {
        what: what.to_owned(),
        why: format!("it imports {}: {fix}", forbidden.join(", ")),
    })
}

/// The first bytes tell a component from a core module from anything else; say which, so the
/// author knows whether to run `wasm-tools component new` or to rebuild.
fn check_header(bytes: &[u8], what: &str) -> Result<(), PolicyError> {
    let why = match bytes {
        [0, b'a', b's', b'm', 0x0d, 0, 0x01, 0, ..] => return Ok(()),
        [0, b'a', b's', b'm', 0x01, 0, 0, 0, ..] => {
            "it is a core WebAssembly module, not a component; build for wasm32-wasip2 (or wrap it with `wasm-tools component new`)"
        }
        _ => "it is not a WebAssembly file",
    };
    Err(PolicyError::NotAPolicy {
        what: what.to_owned(),
        why: why.to_owned(),
    })
}

/// A compiled, type-checked policy, ready to instantiate.
pub(crate) struct Prepared {
    pre: wit::PolicyPre<HostState>,
    pub(crate) sha: [u8; 32],
    pub(crate) compilation: Compilation,
}

/// What loading a component cost, for `ncclwasm policy check` and the load's INFO line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compilation {
    /// The component's size in bytes.
    pub bytes: usize,
    /// Its top-level imports, as named in the component.
    pub imports: Vec<String>,
    /// Compiling it, or finding its compilation.
    pub time: Duration,
    pub cache: CompileCache,
}

/// Where a load found the component's machine code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompileCache {
    /// This process had compiled the same bytes (a hot swap back, another communicator).
    Memory,
    /// The on-disk cache had it: another rank, or an earlier run, compiled it.
    Disk,
    /// Compiled now, and stored in the on-disk cache for the next rank.
    Compiled,
    /// Compiled now, with no on-disk cache (`NCCL_WASM_POLICY_CACHE_DIR=off`, or its directory
    /// could not be made).
    Off,
}

impl CompileCache {
    /// One word for scripts (`ncclwasm policy check --json`): `memory`, `disk`, `compiled`, `off`.
    pub fn name(self) -> &'static str {
        match self {
            CompileCache::Memory => "memory",
            CompileCache::Disk => "disk",
            CompileCache::Compiled => "compiled",
            CompileCache::Off => "off",
        }
    }
}

impl std::fmt::Display for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CompileCache::Memory => "already compiled in this process",
            CompileCache::Disk => "found in the compiled-policy cache",
            CompileCache::Compiled => "compiled, now in the compiled-policy cache",
            CompileCache::Off => "compiled (no compiled-policy cache)",
        })
    }
}

/// A fault of one guest call, before the host decides between open and closed.
#[derive(Clone, Debug)]
pub(crate) struct Fault {
    pub(crate) cause: FailureCause,
    pub(crate) detail: String,
}

/// One live instance with its store. Dropped, never reused, after a fault: a trapped store
/// refuses every later entry (wasmtime's rule for a store that trapped).
pub(crate) struct Instance {
    pub(crate) store: Store<HostState>,
    pub(crate) bindings: wit::Policy,
}

/// Instances of one loaded version, checked out per call so threads never share a store, and so
/// an answer always comes whole from this version.
pub(crate) struct Pool {
    engine: Arc<PolicyEngine>,
    prepared: Prepared,
    init_pairs: Vec<(String, String)>,
    label: Mutex<Arc<str>>,
    idle: Mutex<Vec<Instance>>,
}

impl Pool {
    pub(crate) fn new(
        engine: Arc<PolicyEngine>,
        prepared: Prepared,
        init_pairs: Vec<(String, String)>,
        label: &str,
    ) -> Pool {
        Pool {
            engine,
            prepared,
            init_pairs,
            label: Mutex::new(label.into()),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Name log lines of later instances (`init` told us the policy's name and version).
    pub(crate) fn set_label(&self, label: &str) {
        *self.label.lock().unwrap_or_else(|p| p.into_inner()) = label.into();
    }

    /// A fresh store and instance, `init`-ed. The outer error is a fault, the inner one is
    /// `init` refusing.
    pub(crate) fn fresh(&self) -> Result<Result<(Instance, wit::PolicyInfo), String>, Fault> {
        let label = Arc::clone(&self.label.lock().unwrap_or_else(|p| p.into_inner()));
        let mut store = Store::new(
            &self.engine.engine,
            HostState::new(self.engine.memory_mb, label),
        );
        store.limiter(|h| h);
        self.arm(&mut store);
        let bindings = match self.prepared.pre.instantiate(&mut store) {
            Ok(b) => b,
            Err(e) => return Err(self.fault(&store, &e)),
        };
        let mut inst = Instance { store, bindings };
        match self.run(&mut inst, |i| {
            i.bindings.call_init(&mut i.store, &self.init_pairs)
        }) {
            Ok(Ok(info)) => Ok(Ok((inst, info))),
            Ok(Err(refusal)) => Ok(Err(refusal)),
            Err(fault) => Err(fault),
        }
    }

    /// Keep a healthy instance for a later call.
    pub(crate) fn give_back(&self, inst: Instance) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < POOL_SIZE {
            idle.push(inst);
        }
    }

    /// Run `call` on an idle instance (or a fresh one), bounded in time and memory. The instance
    /// goes back to the pool only if the call succeeded.
    pub(crate) fn call<R>(
        &self,
        call: impl FnOnce(&mut Instance) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut inst = match idle {
            Some(i) => i,
            None => match self.fresh()? {
                Ok((i, _)) => i,
                Err(refusal) => {
                    return Err(Fault {
                        cause: FailureCause::Init,
                        detail: format!("a fresh instance's init returned {refusal:?}"),
                    });
                }
            },
        };
        let out = self.run(&mut inst, call)?;
        self.give_back(inst);
        Ok(out)
    }

    /// Arm the bounds, make one guest call, and turn an error into a [`Fault`].
    fn run<R>(
        &self,
        inst: &mut Instance,
        call: impl FnOnce(&mut Instance) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        self.arm(&mut inst.store);
        let result = call(inst);
        let dropped = std::mem::take(&mut inst.store.data_mut().log_dropped);
        if dropped > 0 {
            let policy = &*inst.store.data().label;
            tracing::warn!(target: LOG_TARGET, policy, "dropped {dropped} log lines over the limit of {LOG_LINES_PER_CALL} per call");
        }
        result.map_err(|e| self.fault(&inst.store, &e))
    }

    fn arm(&self, store: &mut Store<HostState>) {
        store.set_epoch_deadline(self.engine.deadline_ticks);
        let telemetry = self.engine.telemetry();
        let state = store.data_mut();
        state.memory_refused = false;
        state.log_left = LOG_LINES_PER_CALL;
        state.telemetry = telemetry;
        state.telemetry_read = None;
    }

    fn fault(&self, store: &Store<HostState>, e: &wasmtime::Error) -> Fault {
        let (cause, detail) = if store.data().memory_refused {
            let mb = self.engine.memory_mb;
            (
                FailureCause::OutOfMemory,
                format!(
                    "the guest wanted more than NCCL_WASM_POLICY_MEMORY_MB={mb} MiB{}",
                    backtrace::at(e)
                ),
            )
        } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            let ms = self.engine.timeout.as_millis();
            (
                FailureCause::Timeout,
                format!(
                    "still running after NCCL_WASM_POLICY_TIMEOUT_MS={ms} ms; interrupted{}",
                    backtrace::at(e)
                ),
            )
        } else if let Some(what) = structural_limit(e) {
            (
                FailureCause::Trap,
                format!(
                    "the component needs more {what} than the engine allows one policy \
                     ({MAX_INSTANCES} core instances, {MAX_MEMORIES} memories, {MAX_TABLES} \
                     tables): {}",
                    one_line(e)
                ),
            )
        } else {
            (FailureCause::Trap, one_line(e))
        };
        Fault { cause, detail }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `NCCL_WASM_POLICY_MEMORY_MB` bounds the guest, not each of its memories: a second memory
    /// that would take the total past the bound is refused, and the refusal is reported as the
    /// guest running out of memory.
    #[test]
    fn the_memory_bound_counts_every_memory_together() {
        const PAGE: usize = 64 << 10;
        let mut h = HostState::new(1, "t".into());
        assert!(h.memory_growing(0, 10 * PAGE, None).unwrap());
        assert!(h.memory_growing(10 * PAGE, 12 * PAGE, None).unwrap());
        assert!(!h.memory_refused);
        // 12 pages in the first memory; 4 more fit in a second, 5 do not (16 pages = 1 MiB).
        assert!(h.memory_growing(0, 5 * PAGE, None).is_err());
        assert!(h.memory_refused);
        assert!(h.memory_growing(0, 4 * PAGE, None).unwrap());
        assert_eq!(h.memory_total, 16 * PAGE);
        // A growth past a memory's own maximum fails anyway and counts nothing.
        let _ = h.memory_growing(4 * PAGE, 4 * PAGE, Some(2 * PAGE));
        assert_eq!(h.memory_total, 16 * PAGE);
    }
}
