"""{{name}}: an nccl-net-wasm policy in Python (see README.md).

`ncclwasm policy build` makes {{name}}.wasm; `ncclwasm policy test {{name}}.wasm` checks it
against cases.toml. A hook returns an answer to decide, None for "no opinion" (the built-in
default decides).
"""

from typing import List, Optional, Tuple

import wit_world
from componentize_py_types import Err
from ncclwasm_guest import conn_plan  # noqa: F401 (plan-connection's answers)
from wit_world.imports import types


class WitWorld(wit_world.WitWorld):
    def init(self, config: List[Tuple[str, str]]) -> types.PolicyInfo:
        """`config`: the job's NCCL_IB_* variables and NCCL_WASM_POLICY_CONFIG as pairs.

        `raise Err("why")` refuses the policy with that text.
        """
        # The hooks the host calls; every other decision stays the built-in default's.
        return types.PolicyInfo("{{name}}", "0.1.0", {{hooks}})

{{stubs}}
