// tc-by-class: an nccl-net-wasm policy in JavaScript (see README.md).
//
// NCCL gives each communicator a traffic class (ncclConfig_t.trafficClass, -1 when unset). This
// policy maps those classes to the InfiniBand/RoCE traffic class its QPs carry, so a cluster's
// QoS (DSCP on RoCE, the TC byte on IB) can tell a latency-critical job's traffic from a bulk
// one's without every job setting NCCL_IB_TC. It implements one hook, plan-connection, and only
// sets the `tc` field: the built-in default decides everything else.
//
// Configuration, NCCL_WASM_POLICY_CONFIG: comma-separated `class=tc` entries, plus an optional
// `default=tc` for communicators whose class is unset or unlisted, e.g. "1=106, 2=34, default=0".

import log from "log";

/** class (number, or "default") -> traffic class byte, filled by init. */
let classes = new Map();

/** Parse NCCL_WASM_POLICY_CONFIG; a mistake throws, which makes init return `err`. */
function parse(text) {
  const map = new Map();
  for (const entry of text.split(",").map((e) => e.trim()).filter((e) => e !== "")) {
    const [key, value, extra] = entry.split("=").map((s) => s.trim());
    if (value === undefined || extra !== undefined) {
      throw `NCCL_WASM_POLICY_CONFIG: \`${entry}\` is not of the form class=tc`;
    }
    const cls = key === "default" ? key : Number(key);
    if (cls !== "default" && (key === "" || !(Number.isInteger(cls) && cls >= 0))) {
      throw `NCCL_WASM_POLICY_CONFIG: \`${key}\` is neither a traffic class (0, 1, …) nor "default"`;
    }
    const tc = Number(value);
    if (!(Number.isInteger(tc) && tc >= 0 && tc <= 255) || value === "") {
      throw `NCCL_WASM_POLICY_CONFIG: \`${entry}\`: the TC is a byte, 0..255`;
    }
    if (map.has(cls)) {
      throw `NCCL_WASM_POLICY_CONFIG: class \`${key}\` is set twice`;
    }
    map.set(cls, tc);
  }
  if (map.size === 0) {
    throw "NCCL_WASM_POLICY_CONFIG: map at least one traffic class, e.g. 1=106,default=0";
  }
  return map;
}

// init(config: list<tuple<string, string>>) -> result<policy-info, string>
// Returning a value is `ok`; throwing is `err` with the thrown string.
export function init(config) {
  const entry = config.find(([name]) => name === "NCCL_WASM_POLICY_CONFIG");
  classes = parse(entry ? entry[1] : "");
  log("info", `tc-by-class: ${[...classes].map(([c, tc]) => `${c}→${tc}`).join(", ")}`);
  return {
    name: "tc-by-class",
    version: "0.1.0",
    hooks: { planConnection: true },
  };
}

// plan-connection(conn: connection) -> option<conn-plan>
// `undefined` is `none`: no opinion, the built-in plan stands. Unset record fields are `none` too.
export function planConnection(conn) {
  const cls = conn.trafficClass;
  const key = classes.has(cls) ? cls : "default";
  if (!classes.has(key)) {
    return undefined;
  }
  const what = cls === -1 ? "unset" : `${cls}`;
  const via = key === "default" ? " (default entry)" : "";
  return {
    tc: classes.get(key),
    reason: `communicator traffic class ${what} → TC ${classes.get(key)}${via}`,
  };
}

// The hooks this policy does not implement are never called (init does not declare them), but
// the world exports them, so they must exist.
export function selectDevices(_ports) {
  return undefined;
}
export function selectGid(_port) {
  return undefined;
}
export function groupDevices(_ports, _maxDevices) {
  return undefined;
}
export function makeVnic(_request, _ports, _maxDevices) {
  return undefined;
}
export function onPortEvent(_event, _conn, _qps, _states) {
  return undefined;
}
