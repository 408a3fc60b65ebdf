// Builds policy.js into a WebAssembly component of the `policy` world with componentize-js.
//
//   npm run build                       -> ./tc-by-class.wasm, against ../../wit
//   NCCLWASM_GUEST_OUT=x.wasm NCCLWASM_WIT=dir npm run build   (what `cargo xtask guests` does)
import { componentize } from "@bytecodealliance/componentize-js";
import { writeFile } from "node:fs/promises";

const out = process.env.NCCLWASM_GUEST_OUT ?? "tc-by-class.wasm";
const { component } = await componentize({
  sourcePath: "policy.js",
  witPath: process.env.NCCLWASM_WIT ?? "../../wit",
  worldName: "policy",
  // The host gives a policy no clock, randomness, stdio or network: without these features the
  // component imports nothing from WASI, only the world's own `log`.
  disableFeatures: ["random", "stdio", "clocks", "http", "fetch-event"],
});
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes`);
