// The policy's logic, run natively: `npm test` (node's test runner; no wasm involved).
import { test } from "node:test";
import assert from "node:assert/strict";

import { init, onPortEvent, planConnection } from "../policy.js";
import { lines } from "./log-stub.mjs";

const config = (text) => [
  ["NCCL_IB_TC", "1"],
  ["NCCL_WASM_POLICY_CONFIG", text],
];

test("maps listed classes and has no opinion on the others", () => {
  const info = init(config("1=106, 2=34"));
  assert.deepEqual(info.hooks, { planConnection: true });
  assert.deepEqual(planConnection({ trafficClass: 1 }), {
    tc: 106,
    reason: "communicator traffic class 1 → TC 106",
  });
  assert.equal(planConnection({ trafficClass: 2 }).tc, 34);
  assert.equal(planConnection({ trafficClass: 3 }), undefined);
  assert.equal(planConnection({ trafficClass: -1 }), undefined);
  assert.deepEqual(lines.at(-1), ["info", "tc-by-class: 1→106, 2→34"]);
});

test("the default entry covers unset and unlisted classes", () => {
  init(config("1=106, default=0"));
  assert.deepEqual(planConnection({ trafficClass: -1 }), {
    tc: 0,
    reason: "communicator traffic class unset → TC 0 (default entry)",
  });
  assert.equal(planConnection({ trafficClass: 7 }).tc, 0);
});

test("refuses malformed settings, naming the entry", () => {
  const refused = {
    "": "map at least one traffic class",
    "=106": "`` is neither a traffic class",
    "gold=106": "`gold` is neither a traffic class",
    "1=256": "`1=256`: the TC is a byte",
    "1=": "`1=`: the TC is a byte",
    "1=2=3": "`1=2=3` is not of the form class=tc",
    "1=5, 1=6": "class `1` is set twice",
  };
  for (const [text, why] of Object.entries(refused)) {
    assert.throws(() => init(config(text)), (e) => e.includes(why), text);
  }
  assert.throws(() => init([]), /map at least one/);
});

test("has no opinion on port events (the hook is exported but not declared)", () => {
  const info = init(config("1=106"));
  assert.equal(info.hooks.onPortEvent, undefined);
  assert.equal(onPortEvent({ port: 0, change: "down", cause: "async-event" }, {}, [], []), undefined);
});
