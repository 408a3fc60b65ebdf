"""run.py's parts that need neither torch nor a GPU: `python3 -m unittest -v test_run` in the
packed kit (`cargo xtask test` does; the ELF test reads the kit's lib/libnccl-net-wasm.so)."""

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

import run

# NCCL 2.30's own lines, as a rank's NCCL_DEBUG_FILE holds them (format of src/debug.cc).
WASM_LOG = """\
h:1:1 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to wasm
h:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin WASM (v12)
h:1:1 [0] NCCL INFO Successfully loaded external network plugin libnccl-net-wasm.so
h:1:1 [0] NCCL INFO NET/WASM: device 0: soft_0 (100000 Mb/s, 1 port(s), guid 0x2005e0000000001)
h:1:1 [0] NCCL INFO NET/WASM (ncclwasm_policy::host): policy nccl-default@0.1.0 published (was the built-in default) policy=nccl-default@0.1.0
h:1:1 [0] NCCL INFO Using network WASM
h:1:1 [0] NCCL INFO NET/WASM : GPU Direct RDMA Disabled for HCA 0 'soft_0'
h:1:1 [0] NCCL INFO NET/WASM : GPU Direct RDMA Disabled for HCA 1 'soft_1'
h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/WASM/0
h:1:1 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/WASM/0
h:1:1 [0] NCCL INFO NET/WASM (ncclwasm_policy::host): policy rail-aligned@0.1.0 published (was nccl-default@0.1.0)
"""

SOCKET_LOG = """\
h:1:1 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to none
h:1:1 [0] NCCL INFO Using network Socket
h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

CONFIGS = {c["name"]: c for c in run.configs()}


class Pure(unittest.TestCase):
    def test_sizes_span_8_bytes_to_256_mib(self):
        self.assertEqual(run.FULL_SIZES[0], 8)
        self.assertEqual(run.FULL_SIZES[-1], 256 << 20)
        self.assertTrue(all(b == 2 * a for a, b in zip(run.FULL_SIZES, run.FULL_SIZES[1:])))
        self.assertLess(len(run.QUICK_SIZES), 6)

    def test_busbw_factors_are_nccl_tests(self):
        self.assertEqual(run.busbw_factor("all_reduce", 2), 1.0)
        self.assertEqual(run.busbw_factor("all_reduce", 8), 1.75)
        self.assertEqual(run.busbw_factor("all_gather", 2), 0.5)
        self.assertEqual(run.busbw_factor("reduce_scatter", 4), 0.75)
        self.assertEqual(run.busbw_factor("sendrecv", 2), 1.0)
        with self.assertRaises(ValueError):
            run.busbw_factor("broadcast", 2)

    def test_rows_and_table(self):
        r = run.row("all_gather", 1 << 20, 1e-3)
        self.assertAlmostEqual(r["algbw"], 1.048576)
        self.assertAlmostEqual(r["busbw"], 0.524288)
        self.assertAlmostEqual(r["time_us"], 1000.0)
        mine = [dict(r, ok=True), dict(run.row("all_gather", 8, 1e-5), ok=False)]
        base = [dict(run.row("all_gather", 1 << 20, 2e-3), ok=True)]
        table = run.format_table("t", mine, base).splitlines()
        self.assertEqual(table[0], "# t")
        self.assertIn("ratio", table[1])
        self.assertEqual(table[2], "# all_gather")
        self.assertTrue(table[3].split()[:1] == ["1048576"] and table[3].split()[-2:] == ["OK", "2.00"])
        self.assertEqual(table[4].split()[-2:], ["WRONG", "-"])

    def test_elements_per_operation(self):
        self.assertEqual(run.elements("all_reduce", 64), (16, 16))
        self.assertEqual(run.elements("all_gather", 64), (8, 16))
        self.assertEqual(run.elements("reduce_scatter", 64), (16, 8))
        self.assertEqual(run.elements("sendrecv", 8), (2, 2))

    def test_iterations_bounded(self):
        self.assertEqual(run.iterations(8), 20)
        self.assertEqual(run.iterations(256 << 20), 4)
        self.assertEqual(run.iterations(1 << 30), 2)
        self.assertEqual(run.iterations(8, quick=True), 5)

    def test_parse_size(self):
        self.assertEqual(run.parse_size("64K"), 65536)
        self.assertEqual(run.parse_size("4m"), 4 << 20)
        self.assertEqual(run.parse_size("8B"), 8)
        for bad in ("0", "4", "12", "x"):
            with self.assertRaises(ValueError):
                run.parse_size(bad)


class Logs(unittest.TestCase):
    def test_the_plugin_run_is_proven(self):
        info = run.parse_log(WASM_LOG)
        self.assertEqual(info["loaded"], [("WASM", 12)])
        self.assertEqual(info["using"], ["WASM"])
        self.assertEqual(len(info["gdr"]), 2)
        self.assertEqual(info["channels"], [("WASM", False), ("WASM", False)])
        self.assertEqual(info["published"][1], ("rail-aligned@0.1.0", "nccl-default@0.1.0"))
        self.assertEqual(run.check_log(CONFIGS["hot-swap"], info, (2, 30, 3)), [])
        self.assertEqual(run.check_log(CONFIGS["wasm"], info, None), [])

    def test_a_wrong_table_version_is_named(self):
        info = run.parse_log(WASM_LOG)
        (p,) = run.check_log(CONFIGS["wasm"], info, (2, 29, 7))
        self.assertIn("v12, expected v11", p)

    def test_gpu_direct_rdma_fails_the_run(self):
        text = WASM_LOG.replace("RDMA Disabled for HCA 1", "RDMA Enabled for HCA 1").replace(
            "[send] via NET/WASM/0", "[send] via NET/WASM/0/GDRDMA"
        )
        problems = run.check_log(CONFIGS["wasm"], run.parse_log(text), (2, 30, 3))
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("Enabled for HCA 1 'soft_1'", problems[0])
        self.assertIn("GDRDMA", problems[1])

    def test_no_plugin_no_proof(self):
        problems = run.check_log(CONFIGS["rail-aligned"], run.parse_log(SOCKET_LOG), (2, 30, 3))
        joined = "\n".join(problems)
        for what in ("Loaded net plugin WASM", "Using network WASM", "no NET/WASM line", "GPU Direct RDMA", "via NET/WASM", "rail-aligned"):
            self.assertIn(what, joined)

    def test_a_missing_swap_is_named(self):
        text = "\n".join(l for l in WASM_LOG.splitlines() if "rail-aligned" not in l)
        (p,) = run.check_log(CONFIGS["hot-swap"], run.parse_log(text), (2, 30, 3))
        self.assertIn("no hot swap nccl-default -> rail-aligned", p)

    def test_the_socket_baseline(self):
        self.assertEqual(run.check_log(CONFIGS["socket"], run.parse_log(SOCKET_LOG)), [])
        self.assertEqual(len(run.check_log(CONFIGS["socket"], run.parse_log(WASM_LOG))), 2)


class Environment(unittest.TestCase):
    def test_plugin_runs(self):
        env = run.environment(CONFIGS["hot-swap"], 1, 1234, "/l", "/p.wasm", base={"NCCL_IB_HCA": "x", "LD_LIBRARY_PATH": "/a"})
        self.assertNotIn("NCCL_IB_HCA", env)
        for k, v in {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1234",
            "NCCL_MULTI_RANK_GPU_ENABLE": "1",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_NET_PLUGIN": "wasm",
            "NCCL_NET": "WASM",
            "NCCL_WASM_FABRIC": "soft",
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": "/l",
            "NCCL_DMABUF_ENABLE": "0",
            "NCCL_NET_GDR_LEVEL": "LOC",
            "NCCL_WASM_POLICY": "/p.wasm",
            "NCCL_WASM_POLICY_RELOAD_MS": "100",
        }.items():
            self.assertEqual(env.get(k), v, k)
        self.assertEqual(env["LD_LIBRARY_PATH"], os.pathsep.join([str(run.KIT / "lib"), "/a"]))

    def test_socket_run_loads_no_plugin(self):
        env = run.environment(CONFIGS["socket"], 0, 1, "/l", base={})
        self.assertEqual((env["NCCL_NET_PLUGIN"], env["NCCL_NET"]), ("none", "Socket"))
        self.assertNotIn("NCCL_WASM_FABRIC", env)
        self.assertNotIn("NCCL_WASM_POLICY", env)

    def test_every_policy_run_names_a_shipped_policy(self):
        self.assertEqual([c["name"] for c in run.configs()], ["socket", "wasm", "nccl-default", "rail-aligned", "hot-swap"])
        for c in run.configs():
            for p in filter(None, (c.get("policy"), c.get("swap_to"))):
                self.assertIn(p, ("nccl-default", "rail-aligned"))


class Gpus(unittest.TestCase):
    def test_shared_from_2_30_else_one_each(self):
        self.assertEqual(run.gpu_plan((2, 30, 3), 1)[0], [0, 0])
        self.assertEqual(run.gpu_plan((2, 31, 0), 8)[0], [0, 0])
        self.assertEqual(run.gpu_plan((2, 29, 7), 2)[0], [0, 1])
        plan, why = run.gpu_plan((2, 28, 9), 1)
        self.assertIsNone(plan)
        self.assertIn("only 1 GPU", why)
        self.assertEqual(run.gpu_plan((2, 30, 3), 0), (None, "no GPU"))

    def test_the_gpu_is_the_local_rank(self):
        env = run.environment(CONFIGS["wasm"], 1, 1, "/l", base={}, gpu=1)
        self.assertEqual(env["LOCAL_RANK"], "1")


class Arguments(unittest.TestCase):
    def test_defaults_and_quick(self):
        a = run.parse_args([])
        self.assertEqual((a.dry_run, a.size_list, len(a.config_list)), (False, run.FULL_SIZES, 5))
        a = run.parse_args(["--quick", "--configs", "wasm,socket"])
        self.assertEqual(a.size_list, run.QUICK_SIZES)
        self.assertEqual([c["name"] for c in a.config_list], ["wasm", "socket"])
        self.assertEqual(run.parse_args(["--sizes", "8,1M"]).size_list, [8, 1 << 20])

    def test_bad_arguments_exit_2(self):
        for argv in (["--configs", "ib"], ["--sizes", "3"], ["--timeout", "0"], ["--bogus"]):
            with self.assertRaises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()):
                run.parse_args(argv)
            self.assertEqual(e.exception.code, 2, argv)


class Launch(unittest.TestCase):
    def spawn(self, code):
        return subprocess.Popen([sys.executable, "-c", code])

    def test_a_failed_rank_takes_its_peer_down(self):
        procs = [self.spawn("import sys; sys.exit(3)"), self.spawn("import time; time.sleep(600)")]
        why = run.wait_all(procs, timeout=600, grace=0.2)
        self.assertIn("a rank failed", why)
        self.assertEqual(procs[0].returncode, 3)
        self.assertNotEqual(procs[1].returncode, 0)

    def test_the_timeout_kills_both(self):
        procs = [self.spawn("import time; time.sleep(600)") for _ in range(2)]
        self.assertIn("--timeout", run.wait_all(procs, timeout=0, grace=600))
        self.assertTrue(all(p.returncode not in (None, 0) for p in procs))

    def test_clean_exits(self):
        procs = [self.spawn("pass") for _ in range(2)]
        self.assertIsNone(run.wait_all(procs, timeout=600))
        self.assertEqual([p.returncode for p in procs], [0, 0])


class Kit(unittest.TestCase):
    def test_the_plugin_exports_every_table(self):
        symbols = run.elf_dynamic_symbols(run.PLUGIN)
        for s in run.PLUGIN_SYMBOLS:
            self.assertIn(s, symbols)
        self.assertNotIn("ncclNetPlugin_v13", symbols)
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"not an ELF")
            f.flush()
            with self.assertRaises(ValueError):
                run.elf_dynamic_symbols(f.name)

    def test_dry_run_with_a_fake_torch(self):
        """The dry run reads torch's NCCL version and GPU count (a stand-in torch here: no GPU,
        NCCL 2.30.3) and still exits 0 for an intact kit, warning that no GPU is seen."""
        with tempfile.TemporaryDirectory() as d:
            pkg = Path(d) / "torch"
            (pkg / "cuda").mkdir(parents=True)
            (pkg / "__init__.py").write_text("__version__ = '9.9.9-fake'\nfrom . import cuda, distributed\n")
            (pkg / "cuda" / "__init__.py").write_text(
                textwrap.dedent(
                    """\
                    from . import nccl
                    def is_available(): return False
                    def device_count(): return 0
                    """
                )
            )
            (pkg / "cuda" / "nccl.py").write_text("def version(): return (2, 30, 3)\n")
            (pkg / "distributed.py").write_text("def is_available(): return True\ndef is_nccl_available(): return True\n")
            out = subprocess.run(
                [sys.executable, str(run.KIT / "run.py"), "--dry-run", "--quick"],
                env=dict(os.environ, PYTHONPATH=d),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                universal_newlines=True,
            )
        self.assertEqual(out.returncode, 0, out.stdout)
        self.assertIn("OK   torch 9.9.9-fake", out.stdout)
        self.assertIn("OK   NCCL 2.30.3 (torch's; expect plugin table v12)", out.stdout)
        self.assertIn("WARN torch sees no GPU", out.stdout)
        self.assertIn("NCCL_NET_PLUGIN=wasm", out.stdout)
        self.assertIn("gpu-kit: the kit is intact (1 warning(s): see WARN)", out.stdout)


if __name__ == "__main__":
    unittest.main()
