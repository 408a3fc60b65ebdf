#!/usr/bin/env python3
"""The GPU kit: real NCCL collectives through the nccl-net-wasm plugin on one GPU.

Two ranks share one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) and may not use P2P or shared memory, so
every byte between them goes through a network plugin, exactly as between two nodes: ours over
the soft fabric on loopback, then NCCL's built-in socket transport for comparison. Each
configuration is one launch of two worker processes (this script with --worker) running
torch.distributed on the nccl backend; NCCL's own log (NCCL_DEBUG=INFO, one file per rank)
proves which plugin and which table version NCCL took, that GPU Direct RDMA is off for the
plugin's devices (NCCL stages GPU buffers through host memory: the soft fabric cannot map a
GPU's dma-buf), and, for the hot swap, that the plugin published the new policy.

Every result is checked against values computed independently on the GPU; a wrong byte fails
the run. Tables are nccl-tests' (size, time, algbw, busbw with nccl-tests' bus factors).

    python3 run.py --dry-run   # check the environment and the kit, print what would run
    python3 run.py --quick     # a few sizes (a short device run)
    python3 run.py             # 8 B .. 256 MiB

Needs Python 3.8+, PyTorch with CUDA and NCCL >= 2.28, one GPU. Nothing else: no Rust, no
libibverbs, no network beyond 127.0.0.1. Exit status 0 only when every check passed.

Everything that needs neither torch nor a GPU (sizes, bus factors, table formatting, the
expected values, NCCL log parsing, the checks on it, the ELF symbol check) is a plain function
tested by test_run.py with plain python3 in CI.
"""

import argparse
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent
PLUGIN = KIT / "lib" / "libnccl-net-wasm.so"
POLICIES = KIT / "policies"
NRANKS = 2

# NCCL's plugin tables the library must export (NCCL >= 2.30 takes v12, 2.28/2.29 take v11).
PLUGIN_SYMBOLS = ["ncclNetPlugin_v%d" % v for v in range(8, 13)]
MIN_NCCL = (2, 28, 0)
# NCCL_MULTI_RANK_GPU_ENABLE (two ranks on one GPU) is NCCL 2.30's; before, one GPU per rank.
SHARED_GPU_NCCL = (2, 30, 0)

FULL_SIZES = [8 << i for i in range(26)]  # 8 B .. 256 MiB
QUICK_SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "sendrecv"]
# Bytes a size's timed iterations move at most (a few seconds on loopback), and their bounds.
ITER_BYTES = 1 << 30
ITERS = (2, 20)
QUICK_ITERS = (2, 5)


# ---------------------------------------------------------------------------------------------
# Pure parts (tested without torch).


def busbw_factor(op, nranks):
    """nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md there)."""
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "sendrecv":
        return 1.0
    raise ValueError("unknown operation %r" % op)


def iterations(size, quick=False):
    """Timed iterations of one size: as many as fit ITER_BYTES, within bounds."""
    lo, hi = QUICK_ITERS if quick else ITERS
    return max(lo, min(hi, ITER_BYTES // size))


def parse_size(text):
    """'8', '64K', '4M', '1G' -> bytes."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    value = int(number) * mult
    if value <= 0 or value % (4 * NRANKS):
        raise ValueError("%r: sizes must be positive multiples of %d bytes" % (text, 4 * NRANKS))
    return value


def human(size):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return "%d%s" % (size >> shift, unit)
    return str(size)


def elements(op, size, nranks=NRANKS):
    """(input elements, output elements) of float32 tensors for a size as nccl-tests counts it:
    the whole buffer for all-reduce and send/recv, the gathered (all-gather) or reduced
    (reduce-scatter) whole for the other two."""
    n = size // 4
    if op in ("all_reduce", "sendrecv"):
        return n, n
    if op == "all_gather":
        return n // nranks, n
    if op == "reduce_scatter":
        return n, n // nranks
    raise ValueError("unknown operation %r" % op)


def row(op, size, seconds, nranks=NRANKS):
    """One table row: size, time (us), algbw and busbw (GB/s, 1e9 as nccl-tests)."""
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "op": op,
        "size": size,
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * busbw_factor(op, nranks),
    }


def format_table(title, rows, baseline=None):
    """nccl-tests' columns; with `baseline` (rows of another run, same ops and sizes) a last
    column of busbw / baseline busbw."""
    head = "%12s %10s %9s %9s  %s" % ("size(B)", "time(us)", "algbw", "busbw", "check")
    if baseline is not None:
        head += "  %8s" % "ratio"
    base = {(r["op"], r["size"]): r for r in baseline or []}
    out = ["# " + title, "#" + head[1:]]
    op = None
    for r in rows:
        if r["op"] != op:
            op = r["op"]
            out.append("# " + op)
        line = "%12d %10.1f %9.2f %9.2f  %s" % (
            r["size"],
            r["time_us"],
            r["algbw"],
            r["busbw"],
            "OK" if r.get("ok") else "WRONG",
        )
        if baseline is not None:
            b = base.get((r["op"], r["size"]))
            if b and b["busbw"] > 0:
                line += "  %8.2f" % (r["busbw"] / b["busbw"])
            else:
                line += "  %8s" % "-"
        out.append(line)
    return "\n".join(out)


# NCCL's own lines (src/plugin/net/net_v*.cc, src/plugin/net.cc, src/init.cc,
# src/graph/topo.cc, src/transport/net.cc in NCCL 2.28 .. 2.30) and the plugin's.
RE_LOADED = re.compile(r"NET/Plugin: Loaded net plugin (\S+) \(v(\d+)\)")
RE_EXTERNAL = re.compile(r"Successfully loaded external network plugin (\S+)")
RE_USING = re.compile(r"Using network (\S+)")
RE_GDR = re.compile(r"NET/(\S+) : GPU Direct RDMA (Enabled|Disabled) for HCA (\d+) '([^']*)'")
RE_CHANNEL = re.compile(
    r"Channel (\d+)/(\d+) : (\d+)\[\d+\] -> (\d+)\[\d+\] \[(send|receive)\] "
    r"via NET/([^/\s]+)/(\d+)(?:\(\d+\))?(/GDRDMA)?"
)
RE_PUBLISHED = re.compile(r"policy (\S+) published \(was ([^)]*)\)")
RE_WARN = re.compile(r"NCCL WARN (.*)")


def parse_log(text):
    """What one rank's NCCL log says about the network it used."""
    info = {
        "loaded": [],  # (name, table version)
        "external": [],
        "using": [],
        "gdr": [],  # (net, Enabled|Disabled, hca, device)
        "channels": [],  # (net, gdrdma?)
        "published": [],  # (policy, was)
        "plugin_lines": 0,
        "warns": [],
    }
    for line in text.splitlines():
        m = RE_LOADED.search(line)
        if m:
            info["loaded"].append((m.group(1), int(m.group(2))))
        m = RE_EXTERNAL.search(line)
        if m:
            info["external"].append(m.group(1))
        m = RE_USING.search(line)
        if m:
            info["using"].append(m.group(1))
        m = RE_GDR.search(line)
        if m:
            info["gdr"].append((m.group(1), m.group(2), int(m.group(3)), m.group(4)))
        m = RE_CHANNEL.search(line)
        if m:
            info["channels"].append((m.group(6), m.group(8) is not None))
        m = RE_PUBLISHED.search(line)
        if m:
            info["published"].append((m.group(1), m.group(2)))
        if "NET/WASM" in line:
            info["plugin_lines"] += 1
        m = RE_WARN.search(line)
        if m:
            info["warns"].append(m.group(1))
    return info


def check_log(config, info, nccl_version=None):
    """Problems with one rank's log for `config` (a dict from configs()); empty: all proven."""
    problems = []
    if config["net"] == "Socket":
        if info["loaded"] or info["plugin_lines"]:
            problems.append("the socket run loaded a net plugin: %s" % info["loaded"])
        if "Socket" not in info["using"]:
            problems.append("NCCL did not say 'Using network Socket' (it said %s)" % info["using"])
        return problems
    wasm = [v for (name, v) in info["loaded"] if name == "WASM"]
    if not wasm:
        problems.append("NCCL never logged 'NET/Plugin: Loaded net plugin WASM (vN)'")
    else:
        want = expected_table(nccl_version)
        if want is not None and wasm[0] != want:
            problems.append("NCCL took table v%d, expected v%d for NCCL %s" % (wasm[0], want, nccl_version))
    if "WASM" not in info["using"]:
        problems.append("NCCL did not say 'Using network WASM' (it said %s)" % info["using"])
    if info["plugin_lines"] == 0:
        problems.append("no NET/WASM line: the plugin's log did not reach NCCL's")
    ours = [g for g in info["gdr"] if g[0] == "WASM"]
    if not ours:
        problems.append("NCCL logged no 'GPU Direct RDMA ... for HCA' line for the plugin's devices")
    for net, state, hca, dev in ours:
        if state != "Disabled":
            problems.append("GPU Direct RDMA %s for HCA %d '%s': soft cannot map GPU memory" % (state, hca, dev))
    chans = [c for c in info["channels"] if c[0] == "WASM"]
    if not chans:
        problems.append("no channel went 'via NET/WASM'")
    if any(gdr for _, gdr in chans):
        problems.append("a channel went via NET/WASM/.../GDRDMA")
    policy = config.get("policy")
    if policy:
        names = [p for p, _ in info["published"]]
        if not any(n.startswith(policy + "@") for n in names):
            problems.append("the plugin never published policy %s (published: %s)" % (policy, names))
    swap_to = config.get("swap_to")
    if swap_to:
        if not any(p.startswith(swap_to + "@") and w.startswith(policy + "@") for p, w in info["published"]):
            problems.append("no hot swap %s -> %s was published (published: %s)" % (policy, swap_to, info["published"]))
    return problems


def expected_table(nccl_version):
    """The plugin table NCCL takes: the newest it knows (v12 from 2.30, v11 in 2.28/2.29)."""
    if nccl_version is None:
        return None
    return 12 if tuple(nccl_version[:2]) >= (2, 30) else 11


def elf_dynamic_symbols(path):
    """Names in an ELF64 little-endian file's .dynsym (the symbols dlsym can find)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError("%s is not an ELF file" % path)
    if data[4] != 2 or data[5] != 1:
        raise ValueError("%s is not a 64-bit little-endian ELF file" % path)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        _, stype, _, _, offset, size, link, _, _, entsize = struct.unpack_from("<IIQQQQIIQQ", data, base)
        sections.append((stype, offset, size, link, entsize))
    names = set()
    for stype, offset, size, link, entsize in sections:
        if stype != 11 or not entsize:  # SHT_DYNSYM
            continue
        _, str_off, str_size, _, _ = sections[link]
        strtab = data[str_off:str_off + str_size]
        for k in range(size // entsize):
            name_off, = struct.unpack_from("<I", data, offset + k * entsize)
            end = strtab.find(b"\0", name_off)
            if end > name_off:
                names.add(strtab[name_off:end].decode("ascii", "replace"))
    return names


def configs():
    """The runs, in order: NCCL's socket transport first (the baseline every later table is
    compared with), the plugin with its built-in default, the two shipped policies, and a hot
    swap between them while collectives run."""
    plugin = {"net": "WASM"}
    return [
        {"name": "socket", "net": "Socket", "title": "NCCL's built-in socket transport"},
        dict(plugin, name="wasm", title="nccl-net-wasm, built-in default (soft fabric)"),
        dict(plugin, name="nccl-default", policy="nccl-default", title="nccl-net-wasm, nccl-default.wasm"),
        dict(plugin, name="rail-aligned", policy="rail-aligned", title="nccl-net-wasm, rail-aligned.wasm"),
        dict(
            plugin,
            name="hot-swap",
            policy="nccl-default",
            swap_to="rail-aligned",
            title="nccl-net-wasm, nccl-default.wasm swapped for rail-aligned.wasm while running",
        ),
    ]


def gpu_plan(nccl_version, gpus):
    """(the GPU of each rank, why), or (None, why not): both ranks on GPU 0 where NCCL lets
    them share it (2.30+), else one GPU each."""
    if gpus < 1:
        return None, "no GPU"
    if nccl_version is None or tuple(nccl_version) >= SHARED_GPU_NCCL:
        return [0] * NRANKS, "both ranks on GPU 0 (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    if gpus >= NRANKS:
        return list(range(NRANKS)), "one GPU per rank (NCCL %s cannot share one)" % ".".join(map(str, nccl_version))
    return None, "NCCL %s cannot put two ranks on one GPU (2.30 can) and only %d GPU is visible" % (
        ".".join(map(str, nccl_version)),
        gpus,
    )


def environment(config, rank, port, log_file, policy_file=None, base=None, gpu=0):
    """The environment of one worker: NCCL's variables for the run, torch.distributed's
    rendezvous on 127.0.0.1."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith("NCCL_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(gpu),  # the GPU it uses (gpu_plan)
            "WORLD_SIZE": str(NRANKS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NCCL_MULTI_RANK_GPU_ENABLE": "1",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": str(log_file),
            "NCCL_SOCKET_IFNAME": "lo",
            # GPU memory never goes to the plugin: NCCL would register a GPU buffer by dma-buf
            # (the soft fabric reports NCCL_PTR_DMABUF for memfds), and soft cannot mmap a
            # GPU's dma-buf. With these NCCL stages through pinned host memory instead.
            "NCCL_DMABUF_ENABLE": "0",
            "NCCL_NET_GDR_LEVEL": "LOC",
        }
    )
    if config["net"] == "Socket":
        env["NCCL_NET_PLUGIN"] = "none"
        env["NCCL_NET"] = "Socket"
    else:
        env["NCCL_NET_PLUGIN"] = "wasm"
        env["NCCL_NET"] = "WASM"  # fail instead of falling back to NCCL's own transports
        env["NCCL_WASM_FABRIC"] = "soft"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(KIT / "lib")] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        )
        if policy_file is not None:
            env["NCCL_WASM_POLICY"] = str(policy_file)
        if config.get("swap_to"):
            env["NCCL_WASM_POLICY_RELOAD_MS"] = "100"
    return env


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="NCCL collectives through the nccl-net-wasm plugin on one GPU (two ranks).",
    )
    p.add_argument("--dry-run", action="store_true", help="check the environment and the kit, print what would run")
    p.add_argument("--quick", action="store_true", help="a few sizes and iterations")
    p.add_argument("--sizes", help="comma list of sizes (8,64K,4M); default 8 B .. 256 MiB, doubling")
    p.add_argument("--configs", help="comma list of runs (default: all): " + ",".join(c["name"] for c in configs()))
    p.add_argument("--out", help="directory for logs and results (default: out/<UTC time> in the kit)")
    p.add_argument("--timeout", type=int, default=240, help="seconds one run (two ranks) may take (default 240)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    try:
        args.size_list = (
            [parse_size(s) for s in args.sizes.split(",") if s.strip()]
            if args.sizes
            else (QUICK_SIZES if args.quick else FULL_SIZES)
        )
    except ValueError as e:
        p.error("--sizes: %s" % e)
    if not args.size_list:
        p.error("--sizes: no size given")
    known = {c["name"]: c for c in configs()}
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error("unknown run(s) %s; known: %s" % (", ".join(unknown), ", ".join(known)))
        args.config_list = [known[n] for n in names]
    else:
        args.config_list = configs()
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


# ---------------------------------------------------------------------------------------------
# The environment check (no GPU needed).


def check_kit():
    """(problems, notes) about the kit's own files; problems make it unusable."""
    problems, notes = [], []
    if not PLUGIN.is_file():
        problems.append("missing %s" % PLUGIN)
    else:
        try:
            symbols = elf_dynamic_symbols(PLUGIN)
            missing = [s for s in PLUGIN_SYMBOLS if s not in symbols]
            if missing:
                problems.append("%s does not export %s" % (PLUGIN.name, ", ".join(missing)))
            else:
                notes.append(
                    "%s: ELF, %.1f MiB, exports %s"
                    % (PLUGIN.relative_to(KIT), PLUGIN.stat().st_size / 1048576, " ".join(PLUGIN_SYMBOLS))
                )
        except (ValueError, struct.error) as e:
            problems.append(str(e))
    for c in configs():
        for name in filter(None, (c.get("policy"), c.get("swap_to"))):
            f = POLICIES / (name + ".wasm")
            if not f.is_file():
                problems.append("missing %s" % f)
            elif f.read_bytes()[:4] != b"\0asm":
                problems.append("%s is not a WebAssembly file" % f)
    for f in ("run.sh", "expected-output.txt"):
        if not (KIT / f).is_file():
            problems.append("missing %s" % (KIT / f))
    return problems, sorted(set(notes))


def probe_torch():
    """(nccl version or None, GPU count, warnings, notes) from torch, without touching a GPU
    beyond asking how many there are and their names."""
    warns, notes = [], []
    gpus = 0
    try:
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        warns.append("torch does not import (%s): nothing can run here" % e)
        return None, gpus, warns, notes
    notes.append("torch %s" % getattr(torch, "__version__", "?"))
    version = None
    try:
        v = torch.cuda.nccl.version()
        version = tuple(v) if isinstance(v, (tuple, list)) else (v // 10000, v // 100 % 100, v % 100)
        notes.append("NCCL %s (torch's; expect plugin table v%d)" % (".".join(map(str, version)), expected_table(version)))
        if version < MIN_NCCL:
            warns.append("NCCL %s is older than 2.28, the oldest this kit runs" % ".".join(map(str, version)))
    except Exception as e:
        warns.append("torch has no NCCL (%s)" % e)
    try:
        if not torch.cuda.is_available():
            warns.append("torch sees no GPU")
        else:
            gpus = torch.cuda.device_count()
            notes.append("GPU 0: %s (%d visible)" % (torch.cuda.get_device_name(0), gpus))
    except Exception as e:
        warns.append("torch.cuda fails (%s)" % e)
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            warns.append("torch.distributed has no nccl backend")
    except Exception as e:
        warns.append("torch.distributed does not import (%s)" % e)
    if gpus:
        plan, why = gpu_plan(version, gpus)
        (notes if plan else warns).append(why)
    return version, gpus, warns, notes


def shell_line(env, argv):
    """The command as one could paste it: the variables this kit sets, then the command."""
    keys = sorted(k for k in env if k.startswith("NCCL_") or k in ("LD_LIBRARY_PATH", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"))
    return " ".join("%s=%s" % (k, env[k]) for k in keys) + " " + " ".join(argv)


def dry_run(args):
    problems, notes = check_kit()
    print("gpu-kit: dry run in %s" % KIT)
    py = sys.version_info
    print("OK   python %d.%d.%d" % (py[0], py[1], py[2]))
    if py < (3, 8):
        problems.append("python %d.%d is older than 3.8" % (py[0], py[1]))
    for n in notes:
        print("OK   " + n)
    version, gpus, warns, tnotes = probe_torch()
    plan = gpu_plan(version, gpus)[0] or [0] * NRANKS
    for n in tnotes:
        print("OK   " + n)
    for w in warns:
        print("WARN " + w)
    for p in problems:
        print("FAIL " + p)
    out = Path(args.out) if args.out else KIT / "out" / "<UTC time>"
    print("GPU memory: NCCL_DMABUF_ENABLE=0 NCCL_NET_GDR_LEVEL=LOC, so NCCL stages GPU buffers through")
    print("  pinned host memory (the soft fabric cannot map a GPU's dma-buf); each plugin run checks")
    print("  NCCL's 'GPU Direct RDMA Disabled for HCA' lines and that no channel says /GDRDMA")
    print("would run, for each of %d sizes (%s .. %s) of %s:" % (len(args.size_list), human(args.size_list[0]), human(args.size_list[-1]), ", ".join(OPS)))
    for c in args.config_list:
        policy = POLICIES / (c["policy"] + ".wasm") if c.get("policy") else None
        if c.get("swap_to"):
            policy = out / "hot-swap-policy.wasm"
        print("  %s: %s" % (c["name"], c["title"]))
        for rank in range(NRANKS):
            env = environment(c, rank, "<port>", out / ("%s.rank%d.nccl.log" % (c["name"], rank)), policy, gpu=plan[rank])
            spec = out / ("%s.rank%d.spec.json" % (c["name"], rank))
            print("    " + shell_line(env, [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)]))
        if c.get("swap_to"):
            print("    then rank 0 replaces %s with %s.wasm (os.replace) while all-reduces run" % (policy, c["swap_to"]))
    if problems:
        print("gpu-kit: the kit is broken (%d problem(s))" % len(problems))
        return 1
    print("gpu-kit: the kit is intact%s" % (" (%d warning(s): see WARN)" % len(warns) if warns else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# The run (needs torch and a GPU).


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, args, out, nccl_version, plan):
    """Runs one configuration's two workers; returns (rows, problems)."""
    policy_file = None
    if config.get("policy"):
        policy_file = POLICIES / (config["policy"] + ".wasm")
    if config.get("swap_to"):
        policy_file = out / "hot-swap-policy.wasm"
        shutil.copyfile(POLICIES / (config["policy"] + ".wasm"), policy_file)
    port = free_port()
    procs = []
    for rank in range(NRANKS):
        spec = {
            "config": config,
            "rank": rank,
            "gpu": plan[rank],
            "sizes": args.size_list,
            "quick": args.quick,
            "log": str(out / ("%s.rank%d.nccl.log" % (config["name"], rank))),
            "result": str(out / ("%s.rank%d.json" % (config["name"], rank))),
            "policy_file": str(policy_file) if policy_file else None,
            "swap_from": str(POLICIES / (config["swap_to"] + ".wasm")) if config.get("swap_to") else None,
        }
        spec_file = out / ("%s.rank%d.spec.json" % (config["name"], rank))
        spec_file.write_text(json.dumps(spec))
        env = environment(config, rank, port, spec["log"], policy_file, gpu=plan[rank])
        console = open(out / ("%s.rank%d.out" % (config["name"], rank)), "w")
        procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_file)], env=env, stdout=console, stderr=subprocess.STDOUT, cwd=str(out)), console))
    problems = []
    killed = wait_all([p for p, _ in procs], args.timeout)
    if killed:
        problems.append(killed)
    for rank, (proc, console) in enumerate(procs):
        console.close()
        if proc.returncode != 0:
            problems.append("rank %d exited with %s (see %s.rank%d.out)" % (rank, proc.returncode, config["name"], rank))
    results = []
    for rank in range(NRANKS):
        f = out / ("%s.rank%d.json" % (config["name"], rank))
        results.append(json.loads(f.read_text()) if f.is_file() else {"rows": [], "errors": ["no result file"]})
        for e in results[-1]["errors"]:
            problems.append("rank %d: %s" % (rank, e))
        log = out / ("%s.rank%d.nccl.log" % (config["name"], rank))
        text = log.read_text(errors="replace") if log.is_file() else ""
        info = parse_log(text)
        for p in check_log(config, info, nccl_version):
            problems.append("rank %d log: %s" % (rank, p))
        results[-1]["log"] = info
    rows = merge_rows(results[0]["rows"], results[1]["rows"])
    return rows, problems, results


def wait_all(procs, timeout, grace=20):
    """Waits for every process; kills the rest when `timeout` seconds passed, or `grace` seconds
    after one failed (its peer would wait in NCCL for it until then). Returns why it killed, or
    None."""
    deadline = time.time() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        why = None
        if now > deadline:
            why = "killed after %d s (--timeout)" % timeout
        elif failed_at is not None and now - failed_at > grace:
            why = "a rank failed; its peer was killed %d s later" % grace
        if why:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return why
        time.sleep(0.2)
    return None


def merge_rows(a, b):
    """Both ranks' rows: the slower rank's time, checked only if both ranks' results were."""
    theirs = {(r["op"], r["size"]): r for r in b}
    merged = []
    for r in a:
        o = theirs.get((r["op"], r["size"]))
        seconds = max(r["seconds"], o["seconds"]) if o else r["seconds"]
        m = row(r["op"], r["size"], seconds)
        m["ok"] = bool(r["ok"] and o and o["ok"])
        merged.append(m)
    return merged


def proof_lines(info):
    """The log lines that prove what NCCL loaded, for the report."""
    out = []
    for name, v in info["loaded"]:
        out.append("NET/Plugin: Loaded net plugin %s (v%d)" % (name, v))
    for u in sorted(set(info["using"])):
        out.append("Using network %s" % u)
    for net, state, hca, dev in info["gdr"]:
        out.append("NET/%s : GPU Direct RDMA %s for HCA %d '%s'" % (net, state, hca, dev))
    chans = info["channels"]
    if chans:
        out.append("%d channel(s) via NET/%s, %d with GDRDMA" % (len(chans), "/".join(sorted(set(c[0] for c in chans))), sum(1 for c in chans if c[1])))
    for p, w in info["published"]:
        out.append("policy %s published (was %s)" % (p, w))
    return out


def run(args):
    version, gpus, warns, notes = probe_torch()
    for w in warns:
        print("WARN " + w)
    if warns:
        print("gpu-kit: cannot run here (python3 run.py --dry-run says more)")
        return 2
    problems, _ = check_kit()
    if problems:
        print("\n".join("FAIL " + p for p in problems))
        return 1
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out).resolve() if args.out else KIT / "out" / stamp
    out.mkdir(parents=True, exist_ok=True)
    report = []

    def say(text=""):
        print(text, flush=True)
        report.append(text)

    say("gpu-kit: %s; results in %s" % (", ".join(notes), out))
    tables = {}
    failures = []
    summary = {}
    for c in args.config_list:
        started = time.time()
        rows, problems, results = launch(c, args, out, version, gpu_plan(version, gpus)[0])
        tables[c["name"]] = rows
        say()
        say("== %s (%.0f s)" % (c["title"], time.time() - started))
        for line in proof_lines(results[0]["log"]):
            say("   rank 0: " + line)
        extra = results[0].get("notes", [])
        for n in extra:
            say("   " + n)
        baseline = tables.get("socket") if c["name"] != "socket" else None
        say(format_table(c["title"] + (": busbw ratio against the socket run" if baseline else ""), rows, baseline))
        wrong = [r for r in rows if not r["ok"]]
        if wrong:
            problems.append("%d result(s) wrong: %s" % (len(wrong), ", ".join("%s %d" % (r["op"], r["size"]) for r in wrong[:8])))
        for p in problems:
            say("FAIL %s: %s" % (c["name"], p))
        failures += ["%s: %s" % (c["name"], p) for p in problems]
        summary[c["name"]] = {"rows": rows, "problems": problems, "log": [r["log"] for r in results]}
        # After every run, so a run cut short still leaves what it had.
        (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
        (out / "report.txt").write_text("\n".join(report) + "\n")
    say()
    if failures:
        say("gpu-kit: FAILED (%d problem(s)); logs in %s" % (len(failures), out))
    else:
        say("gpu-kit: PASSED: every result checked, NCCL's log proves the plugin (see above); logs in %s" % out)
    (out / "report.txt").write_text("\n".join(report) + "\n")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# One rank (a worker process; torch and a GPU).


def worker(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    errors, notes, rows = [], [], []
    try:
        work(spec, rows, errors, notes)
    except Exception as e:  # reported, never swallowed: the run fails
        import traceback

        traceback.print_exc()
        errors.append("%s: %s" % (type(e).__name__, e))
    Path(spec["result"]).write_text(json.dumps({"rows": rows, "errors": errors, "notes": notes}))
    return 1 if errors else 0


def work(spec, rows, errors, notes):
    import torch
    import torch.distributed as dist

    rank = spec["rank"]
    torch.cuda.set_device(spec["gpu"])
    dev = torch.device("cuda", spec["gpu"])
    try:  # device_id (torch >= 2.3) makes the communicator now, not at the first collective
        dist.init_process_group("nccl", rank=rank, world_size=NRANKS, device_id=dev)
    except TypeError:
        dist.init_process_group("nccl", rank=rank, world_size=NRANKS)
    peer = 1 - rank

    def fill(n, r, offset=0):
        i = torch.arange(offset, offset + n, device=dev, dtype=torch.int64)
        return ((i % 251) + 1000 * (r + 1)).to(torch.float32)

    def one(op, size, quick, timed=True):
        """Checked first call, then the timed iterations, the last of them checked too."""
        nin, nout = elements(op, size)
        if op == "all_reduce":
            buf = fill(nin, rank)
            want = sum(fill(nin, r) for r in range(NRANKS))

            def call():
                dist.all_reduce(buf)

            out = buf
        elif op == "all_gather":
            inp = fill(nin, rank)
            out = torch.full((nout,), -1.0, device=dev)
            want = torch.cat([fill(nin, r) for r in range(NRANKS)])

            def call():
                dist.all_gather_into_tensor(out, inp)

        elif op == "reduce_scatter":
            inp = fill(nin, rank)
            out = torch.full((nout,), -1.0, device=dev)
            want = sum(fill(nout, r, rank * nout) for r in range(NRANKS))

            def call():
                dist.reduce_scatter_tensor(out, inp)

        else:
            inp = fill(nin, rank)
            out = torch.full((nout,), -1.0, device=dev)
            want = fill(nin, peer)

            def call():
                ops = [dist.P2POp(dist.isend, inp, peer), dist.P2POp(dist.irecv, out, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

        call()
        torch.cuda.synchronize()
        ok = bool(torch.equal(out, want))
        if not ok:
            bad = int((out != want).sum())
            errors.append("%s %d B: %d of %d elements wrong after the first call" % (op, size, bad, out.numel()))
        seconds = 0.0
        if timed:
            iters = iterations(size, quick)
            if op != "all_reduce":
                out.fill_(-1.0)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / iters
            final = want * float(NRANKS ** iters) if op == "all_reduce" else want
            if not torch.equal(out, final):
                ok = False
                errors.append("%s %d B: wrong after %d timed calls" % (op, size, iters))
        return {"op": op, "size": size, "seconds": seconds, "ok": ok}

    quick = spec["quick"]
    config = spec["config"]
    for op in OPS:
        for size in spec["sizes"]:
            rows.append(one(op, size, quick))

    if config.get("swap_to"):
        hot_swap(spec, dist, torch, dev, one, errors, notes)
    dist.destroy_process_group()


def hot_swap(spec, dist, torch, dev, one, errors, notes):
    """Replaces the policy file (atomically, as an operator's `mv` would) while all-reduces run,
    until this rank's plugin logged the new policy as published; then a new communicator (new
    connections, planned by the new policy) carries an all-reduce too. Every result checked."""
    rank = spec["rank"]
    target = Path(spec["policy_file"])
    if rank == 0:
        staged = target.with_name(target.name + ".new")
        shutil.copyfile(spec["swap_from"], staged)
        os.replace(staged, target)
    log = Path(spec["log"])
    want = spec["config"]["swap_to"] + "@"
    calls, started = 0, time.time()
    flag = torch.zeros(1, device=dev)
    while True:
        for size in (8, 64 << 10, 1 << 20):
            one("all_reduce", size, True, timed=False)
            calls += 1
        text = log.read_text(errors="replace") if log.is_file() else ""
        seen = any(p.startswith(want) for p, _ in parse_log(text)["published"])
        flag.fill_(1.0 if seen or time.time() - started > 60 else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() >= 1.0:
            break
    if not seen:
        errors.append("the plugin did not publish %s within 60 s of the swap" % spec["config"]["swap_to"])
    notes.append("hot swap: %d checked all-reduces ran while the file was replaced; published after %.1f s" % (calls, time.time() - started))
    group = dist.new_group([0, 1])
    buf = torch.full((1 << 18,), float(rank + 1), device=dev)
    dist.all_reduce(buf, group=group)
    torch.cuda.synchronize()
    if not torch.equal(buf, torch.full_like(buf, float(sum(range(1, NRANKS + 1))))):
        errors.append("an all-reduce on a communicator made after the swap was wrong")
    else:
        notes.append("hot swap: a communicator made after the swap ran a checked all-reduce")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args.worker)
    if args.dry_run:
        return dry_run(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
