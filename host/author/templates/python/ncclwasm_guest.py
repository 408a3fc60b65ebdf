"""ncclwasm_guest: helpers for the answers of an nccl-net-wasm policy in Python.

Written by `ncclwasm policy new` beside app.py; `wit_world` is generated from wit/policy.wit by
componentize-py when the policy is built.
"""

from typing import List, Optional

from wit_world.imports import types


def conn_plan(
    reason: str,
    *,
    qps: Optional[List[types.QpPlan]] = None,
    stripe_width: Optional[int] = None,
    align: Optional[int] = None,
    adaptive_routing: Optional[bool] = None,
    ar_threshold: Optional[int] = None,
    tc: Optional[int] = None,
    sl: Optional[int] = None,
    fifo_tc: Optional[int] = None,
    ece: Optional[bool] = None,
    timeout: Optional[int] = None,
    retry_cnt: Optional[int] = None,
) -> types.ConnPlan:
    """A plan-connection answer that sets the fields named and keeps the built-in's for the rest.

    `types.ConnPlan` takes all 12 fields; here every field left out is None, which the host reads
    as "the built-in default's value for this connection" — NCCL's own, with the job's NCCL_IB_*
    variables applied:

    - qps: NCCL_IB_QPS_PER_CONNECTION (1) × the larger port count of the two sides, QP i on
      local port i % nlocal and peer port i % npeer, equal weights
    - stripe_width: every QP with NCCL_IB_SPLIT_DATA_ON_QPS=1, else one per device
    - align: 128 bytes
    - adaptive_routing: on for InfiniBand, off for RoCE (NCCL_IB_ADAPTIVE_ROUTING)
    - ar_threshold: NCCL_IB_AR_THRESHOLD (8192 bytes)
    - tc, sl: NCCL_IB_TC / NCCL_IB_SL, else the communicator's traffic class, else 0
    - fifo_tc: NCCL_IB_FIFO_TC, else the data TC
    - ece: NCCL_IB_ECE_ENABLE (1)
    - timeout: NCCL_IB_TIMEOUT (20); retry_cnt: NCCL_IB_RETRY_CNT (7)

    A misspelt field is a TypeError (a trap: the built-in default then decides, and the rank
    WARNs naming the hook).
    """
    return types.ConnPlan(
        qps=qps,
        stripe_width=stripe_width,
        align=align,
        adaptive_routing=adaptive_routing,
        ar_threshold=ar_threshold,
        tc=tc,
        sl=sl,
        fifo_tc=fifo_tc,
        ece=ece,
        timeout=timeout,
        retry_cnt=retry_cnt,
        reason=reason,
    )
