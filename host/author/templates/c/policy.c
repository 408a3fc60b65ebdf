// {{name}}: an nccl-net-wasm policy in C (see README.md). `ncclwasm policy build` makes
// {{name}}.wasm; `ncclwasm policy test {{name}}.wasm` checks it against cases.toml.
//
// The types and functions come from build/policy.h, generated from wit/policy.wit by
// `ncclwasm policy build`. A hook returns true with *ret filled to decide, false for "no opinion"
// (the built-in default decides). Hooks own their arguments and free them; answers are freed
// by the bindings after the host has read them, so every string in one is allocated.

#include <stdlib.h>
#include <string.h>

#include "policy.h"

// `init` gets the job's NCCL_IB_* variables and NCCL_WASM_POLICY_CONFIG as name/value pairs;
// returning false with *err set refuses the policy with that text.
bool exports_policy_init(policy_list_tuple2_string_string_t *config, policy_policy_info_t *ret,
                         policy_string_t *err) {
  policy_list_tuple2_string_string_free(config);
  policy_string_dup(&ret->name, "{{name}}");
  policy_string_dup(&ret->version, "0.1.0");
  // The hooks the host calls; every other decision stays the built-in default's.
  ret->hooks = {{hooks}};
  return true;
}

{{stubs}}
