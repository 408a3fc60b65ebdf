// Builds policy.js into a WebAssembly component of the `policy` world with componentize-js.
// `ncclwasm policy build` runs it (`npm run build`), naming the contract and the output in
// NCCLWASM_WIT and NCCLWASM_GUEST_OUT.
import { componentize } from "@bytecodealliance/componentize-js";
import { writeFile } from "node:fs/promises";

const out = process.env.NCCLWASM_GUEST_OUT ?? "{{name}}.wasm";
const { component } = await componentize({
  sourcePath: "policy.js",
  witPath: process.env.NCCLWASM_WIT ?? "wit",
  worldName: "policy",
  // The host gives a policy no clock, randomness, stdio or network: without these features the
  // component imports nothing from WASI, only the world's own `log`.
  disableFeatures: ["random", "stdio", "clocks", "http", "fetch-event"],
});
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes`);
