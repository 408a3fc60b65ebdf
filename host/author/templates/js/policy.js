// {{name}}: an nccl-net-wasm policy in JavaScript (see README.md). `ncclwasm policy build` makes
// {{name}}.wasm; `ncclwasm policy test {{name}}.wasm` checks it against cases.toml.
//
// A hook returns an answer to decide, `undefined` for "no opinion" (the built-in default
// decides). WIT names are camelCase here (`traffic-class` is `trafficClass`).

import log from "log";
import { connPlan } from "./ncclwasm_guest.js"; // plan-connection's answers

// init(config: list<tuple<string, string>>) -> result<policy-info, string>: `config` holds the
// job's NCCL_IB_* variables and NCCL_WASM_POLICY_CONFIG; throwing a string refuses the policy.
export function init(config) {
  log("debug", `{{name}}: ${config.length} configuration pair(s)`);
  return {
    name: "{{name}}",
    version: "0.1.0",
    // The hooks the host calls; every other decision stays the built-in default's.
    hooks: {{hooks}},
  };
}

{{stubs}}
