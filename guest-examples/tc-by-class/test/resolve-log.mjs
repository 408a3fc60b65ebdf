// Module resolution hook (see register.mjs): "log" -> ./log-stub.mjs.
export async function resolve(specifier, context, next) {
  if (specifier === "log") {
    return { url: new URL("./log-stub.mjs", import.meta.url).href, shortCircuit: true };
  }
  return next(specifier, context);
}
