// Under componentize-js, `import log from "log"` is the world's `log` import. Under node's test
// runner there is no host, so the specifier resolves to a stub that records the lines instead.
import { register } from "node:module";

register("./resolve-log.mjs", import.meta.url);
