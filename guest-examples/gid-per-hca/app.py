"""gid-per-hca: a GID index per HCA, the per-device NCCL_IB_GID_INDEX that NCCL lacks.

NCCL reads one NCCL_IB_GID_INDEX for every port (NVIDIA/nccl#890). In a Kubernetes pod each
SR-IOV function gets its own GID table, and the pod's RoCEv2 address sits at a different index on
each; the operator who knows the indices writes them down here:

    NCCL_WASM_POLICY_CONFIG="mlx5_2=3, mlx5_5:1=5"

`device=index` applies to every port of the device, `device:port=index` to one port (and wins).
A port that is not listed, or whose table has no such entry, keeps the built-in choice (no
opinion), so the list only has to name the ports NCCL's scan gets wrong.
"""

from typing import List, Optional, Tuple

import wit_world
from componentize_py_types import Err
from wit_world.imports import types

CONFIG_KEY = "NCCL_WASM_POLICY_CONFIG"


def parse(text: str) -> dict:
    """`mlx5_2=3, mlx5_5:1=5` as {"mlx5_2": 3, "mlx5_5:1": 5}; a bad entry is an error naming it."""
    table = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, index = entry.partition("=")
        name, index = name.strip(), index.strip()
        if not sep or not name or not index.isdigit():
            raise ValueError(f"{entry!r} is not DEVICE=INDEX or DEVICE:PORT=INDEX")
        if name in table:
            raise ValueError(f"{name} is listed twice")
        table[name] = int(index)
    if not table:
        raise ValueError("no DEVICE=INDEX entries (e.g. mlx5_2=3, mlx5_5:1=5)")
    return table


def choose(table: dict, port: types.Port) -> Optional[Tuple[int, str]]:
    """The index listed for this port (its own entry first, then its device's), if its table has it."""
    for name in (f"{port.device}:{port.port}", port.device):
        if name not in table:
            continue
        index = table[name]
        if any(g.index == index and not g.unconfigured for g in port.gids):
            return index, f"{name}={index} in NCCL_WASM_POLICY_CONFIG"
        wit_world.log(
            types.LogLevel.WARN,
            f"{name}={index}: {port.device}:{port.port} has no configured GID {index}; built-in choice",
        )
        return None
    return None


class WitWorld(wit_world.WitWorld):
    table: dict = {}

    def init(self, config: List[Tuple[str, str]]) -> types.PolicyInfo:
        text = dict(config).get(CONFIG_KEY, "")
        try:
            WitWorld.table = parse(text)
        except ValueError as e:
            raise Err(f"gid-per-hca: {e}")
        return types.PolicyInfo("gid-per-hca", "0.1.0", types.Hooks.SELECT_GID)

    def select_gid(self, port: types.Port) -> Optional[types.GidChoice]:
        chosen = choose(WitWorld.table, port)
        return None if chosen is None else types.GidChoice(*chosen)

    # The hooks not declared in `init` are never called; they answer "no opinion".
    def select_devices(self, ports):
        return None

    def group_devices(self, ports, max_devices):
        return None

    def make_vnic(self, request, ports, max_devices):
        return None

    def plan_connection(self, conn):
        return None

    def on_port_event(self, event, conn, qps, states):
        return None
