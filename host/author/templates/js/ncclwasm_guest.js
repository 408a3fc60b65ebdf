// ncclwasm_guest: helpers for the answers of an nccl-net-wasm policy in JavaScript. Written by
// `ncclwasm policy new` beside policy.js.

/**
 * The fields of a plan-connection answer (WIT `conn-plan`), each `undefined` unless set. An
 * `undefined` field is `none`, which the host reads as "the built-in default's value for this
 * connection" — NCCL's own, with the job's NCCL_IB_* variables applied:
 *
 * - qps: NCCL_IB_QPS_PER_CONNECTION (1) × the larger port count of the two sides, QP i on local
 *   port i % nlocal and peer port i % npeer, equal weights
 * - stripeWidth: every QP with NCCL_IB_SPLIT_DATA_ON_QPS=1, else one per device
 * - align: 128 bytes
 * - adaptiveRouting: on for InfiniBand, off for RoCE (NCCL_IB_ADAPTIVE_ROUTING)
 * - arThreshold: NCCL_IB_AR_THRESHOLD (8192 bytes), a BigInt
 * - tc, sl: NCCL_IB_TC / NCCL_IB_SL, else the communicator's traffic class, else 0
 * - fifoTc: NCCL_IB_FIFO_TC, else the data TC
 * - ece: NCCL_IB_ECE_ENABLE (1)
 * - timeout: NCCL_IB_TIMEOUT (20); retryCnt: NCCL_IB_RETRY_CNT (7)
 */
export const PLAN_FIELDS = [
  "qps",
  "stripeWidth",
  "align",
  "adaptiveRouting",
  "arThreshold",
  "tc",
  "sl",
  "fifoTc",
  "ece",
  "timeout",
  "retryCnt",
];

/**
 * A plan-connection answer that sets the fields named in `fields` and keeps the built-in's for
 * the rest, e.g. `connPlan("bulk traffic on TC 106", { tc: 106 })`. A name that is not a plan
 * field (`trafficClass`, `stripe_width`) throws: left in a plain object it would be dropped
 * without a word. A throw is a trap: the built-in default decides, and the rank WARNs naming the
 * hook.
 */
export function connPlan(reason, fields = {}) {
  const unknown = Object.keys(fields).filter((name) => !PLAN_FIELDS.includes(name));
  if (unknown.length > 0) {
    throw new Error(`connPlan: ${unknown.join(", ")} not a plan field (${PLAN_FIELDS.join(", ")})`);
  }
  const plan = { reason };
  for (const name of PLAN_FIELDS) {
    plan[name] = fields[name];
  }
  return plan;
}
