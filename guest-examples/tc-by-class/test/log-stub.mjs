// Stands in for the host's `log`: keeps the lines so tests can look at them.
export const lines = [];

export default function log(level, message) {
  lines.push([level, message]);
}
