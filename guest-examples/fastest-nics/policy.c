// fastest-nics: an nccl-net-wasm policy in C (see README.md). It answers `select-devices` only:
// NCCL sees the active ports of the link layer with the most total bandwidth, and of those only
// the ports at least `min-percent` percent as fast as the fastest one. A rule instead of a
// per-node-type NCCL_IB_HCA list.
//
// Types and functions come from build/policy.h, which `ncclwasm policy build` generates from the
// WIT. Hooks own their arguments and free them; the bindings free every answer after the host
// has read it, so each string and list in an answer is allocated.

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

#define CONFIG_KEY "NCCL_WASM_POLICY_CONFIG"
#define DEFAULT_MIN_PERCENT 50u
// A reason is one log line and one `explain` entry: about 200 characters stay readable there, and
// a list that does not fit ends in "+N more" rather than a name cut in half.
#define REASON_MAX 200

static const char *const POLICY_NAME = "fastest-nics";

// Set by init, read by select-devices. An instance is init-ed before any hook, and a fresh one
// after a fault, so this is always the value of the configuration in effect.
static unsigned min_percent = DEFAULT_MIN_PERCENT;

// ---- small helpers ------------------------------------------------------------------------------

// WIT strings carry a length and no NUL terminator: compare them with that length.
static bool string_equals(const policy_string_t *s, const char *literal) {
  size_t n = strlen(literal);
  return s->len == n && memcmp(s->ptr, literal, n) == 0;
}

static bool is_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Trims ASCII white space off both ends of [*begin, *end).
static void trim(const uint8_t **begin, const uint8_t **end) {
  while (*begin < *end && is_space(**begin)) ++*begin;
  while (*end > *begin && is_space((*end)[-1])) --*end;
}

static const char *layer_name(ncclwasm_policy_types_link_layer_t layer) {
  return layer == NCCLWASM_POLICY_TYPES_LINK_LAYER_INFINIBAND ? "InfiniBand" : "Ethernet";
}

// Mb/s as Gb/s without floating point: "200", "56", "2.5" (SDR x1), "0.1".
static void format_gbps(char *out, size_t size, uint64_t mbps) {
  unsigned long long whole = mbps / 1000, frac = mbps % 1000;
  if (frac == 0) {
    snprintf(out, size, "%llu", whole);
    return;
  }
  while (frac % 10 == 0) frac /= 10;  // 500 -> 5: "2.5", not "2.500"
  // Zero-pad to the digits left after dropping trailing zeros: 50 Mb/s -> "0.05".
  int digits = mbps % 100 == 0 ? 1 : mbps % 10 == 0 ? 2 : 3;
  snprintf(out, size, "%llu.%0*llu", whole, digits, frac);
}

// Appends printf-style text to a fixed buffer; returns false (leaving the buffer unchanged)
// when it would not fit, so the caller can say "+N more" instead of cutting a name in half.
static bool append(char *buf, size_t size, size_t *used, const char *fmt, ...) {
  if (*used + 1 >= size) return false;
  va_list args;
  va_start(args, fmt);
  int n = vsnprintf(buf + *used, size - *used, fmt, args);
  va_end(args);
  if (n < 0 || (size_t)n >= size - *used) {
    buf[*used] = '\0';
    return false;
  }
  *used += (size_t)n;
  return true;
}

static void log_line(policy_log_level_t level, const char *text) {
  policy_string_t message;
  // policy_log borrows the message: a pointer into our buffer is enough here (unlike answers).
  policy_string_set(&message, text);
  policy_log(level, &message);
}

// Parses NCCL_WASM_POLICY_CONFIG: empty, or `min-percent=N` with N in 1..100. On failure writes a
// message for the operator into msg and returns false.
static bool parse_config(const policy_string_t *value, unsigned *percent, char *msg,
                         size_t msg_size) {
  const uint8_t *begin = value->ptr, *end = value->ptr + value->len;
  trim(&begin, &end);
  if (begin == end) {
    *percent = DEFAULT_MIN_PERCENT;
    return true;
  }
  const uint8_t *eq = memchr(begin, '=', (size_t)(end - begin));
  const uint8_t *key_end = eq ? eq : end, *val = eq ? eq + 1 : end;
  const uint8_t *key_begin = begin;
  trim(&key_begin, &key_end);
  trim(&val, &end);
  static const char key[] = "min-percent";
  bool key_ok = eq && (size_t)(key_end - key_begin) == sizeof key - 1 &&
                memcmp(key_begin, key, sizeof key - 1) == 0;
  // Digits only, and at most three of them, so "1e2", "+50", "50%" and overflows are refused.
  unsigned n = 0;
  bool number_ok = key_ok && val < end && end - val <= 3;
  for (const uint8_t *c = val; number_ok && c < end; ++c) {
    if (*c < '0' || *c > '9') number_ok = false;
    else n = n * 10 + (unsigned)(*c - '0');
  }
  if (number_ok && n >= 1 && n <= 100) {
    *percent = n;
    return true;
  }
  // %.*s: the value is not NUL-terminated; cap it so the message stays one readable line.
  int shown = value->len > 60 ? 60 : (int)value->len;
  snprintf(msg, msg_size,
           "'%.*s%s' is not min-percent=N with N from 1 to 100 (the share of the fastest port's "
           "speed a port needs to be kept; default %u)",
           shown, (const char *)value->ptr, value->len > 60 ? "..." : "", DEFAULT_MIN_PERCENT);
  return false;
}

// ---- exports ------------------------------------------------------------------------------------

// `init` gets NCCL_WASM_POLICY_CONFIG (under that key, when set) and the NCCL_IB_* variables.
// NCCL_IB_HCA is deliberately not read: this rule replaces it.
bool exports_policy_init(policy_list_tuple2_string_string_t *config, policy_policy_info_t *ret,
                         policy_string_t *err) {
  unsigned percent = DEFAULT_MIN_PERCENT;
  bool ok = true;
  char msg[256];
  for (size_t i = 0; i < config->len && ok; i++) {
    if (string_equals(&config->ptr[i].f0, CONFIG_KEY)) {
      ok = parse_config(&config->ptr[i].f1, &percent, msg, sizeof msg);
    }
  }
  policy_list_tuple2_string_string_free(config);
  if (!ok) {
    // An err refuses the policy; the plugin keeps its previous one and logs this text.
    policy_string_dup(err, msg);
    return false;
  }
  min_percent = percent;
  policy_string_dup(&ret->name, POLICY_NAME);
  policy_string_dup(&ret->version, "0.1.0");
  ret->hooks = NCCLWASM_POLICY_TYPES_HOOKS_SELECT_DEVICES;
  return true;
}

static bool is_active(const ncclwasm_policy_types_port_t *p) {
  return p->state == NCCLWASM_POLICY_TYPES_PORT_STATE_ACTIVE;
}

bool exports_policy_select_devices(policy_list_port_t *ports, policy_device_selection_t *ret) {
  const ncclwasm_policy_types_link_layer_t IB = NCCLWASM_POLICY_TYPES_LINK_LAYER_INFINIBAND;
  const ncclwasm_policy_types_link_layer_t ETH = NCCLWASM_POLICY_TYPES_LINK_LAYER_ETHERNET;

  // Total active bandwidth and port count per link layer. 64 bits: a sum of u32 speeds.
  uint64_t total[2] = {0, 0};
  size_t active[2] = {0, 0};
  for (size_t i = 0; i < ports->len; i++) {
    const ncclwasm_policy_types_port_t *p = &ports->ptr[i];
    if (!is_active(p) || p->link_layer > ETH) continue;
    total[p->link_layer] += p->speed_mbps;
    active[p->link_layer]++;
  }
  if (active[IB] == 0 && active[ETH] == 0) {
    // Nothing to choose from: let the built-in default decide (and say there are no devices).
    policy_list_port_free(ports);
    return false;
  }
  // The layer with more bandwidth; a tie goes to InfiniBand (native IB needs no GID or
  // lossless-Ethernet set-up to be right). A layer without active ports never wins a 0-0 tie.
  ncclwasm_policy_types_link_layer_t layer =
      active[ETH] == 0 ? IB : active[IB] == 0 ? ETH : total[ETH] > total[IB] ? ETH : IB;
  ncclwasm_policy_types_link_layer_t other = layer == IB ? ETH : IB;

  uint64_t fastest = 0;
  for (size_t i = 0; i < ports->len; i++) {
    const ncclwasm_policy_types_port_t *p = &ports->ptr[i];
    if (is_active(p) && p->link_layer == layer && p->speed_mbps > fastest) fastest = p->speed_mbps;
  }
  // Kept when speed * 100 >= fastest * min_percent: exact, no rounding of the threshold.
  uint64_t threshold_x100 = fastest * min_percent;

  uint32_t *kept = malloc(active[layer] * sizeof *kept);
  if (kept == NULL) {  // only under the host's memory limit after a leak; decide nothing then
    policy_list_port_free(ports);
    return false;
  }
  size_t n_kept = 0, n_hidden = 0;
  char g_port[24], g_threshold[24], g_fastest[24], line[200];
  format_gbps(g_threshold, sizeof g_threshold, threshold_x100 / 100);
  format_gbps(g_fastest, sizeof g_fastest, fastest);

  // Input order is kept: the host hands the ports in its own order, and NCCL device i is
  // ports[i] of the answer. Each hidden port gets one INFO line, since the reason may not list
  // them all.
  for (size_t i = 0; i < ports->len; i++) {
    const ncclwasm_policy_types_port_t *p = &ports->ptr[i];
    if (!is_active(p)) continue;
    bool same_layer = p->link_layer == layer;
    if (same_layer && (uint64_t)p->speed_mbps * 100 >= threshold_x100) {
      kept[n_kept++] = p->index;
      continue;
    }
    format_gbps(g_port, sizeof g_port, p->speed_mbps);
    int name_len = p->device.len > 64 ? 64 : (int)p->device.len;  // not NUL-terminated
    if (same_layer) {
      n_hidden++;
      snprintf(line, sizeof line, "%s: hid %.*s:%u (%s Gb/s): below %s Gb/s (%u%% of %s Gb/s)",
               POLICY_NAME, name_len, (const char *)p->device.ptr, p->port, g_port, g_threshold,
               min_percent, g_fastest);
    } else {
      snprintf(line, sizeof line, "%s: hid %.*s:%u (%s, %s Gb/s): %s has less bandwidth",
               POLICY_NAME, name_len, (const char *)p->device.ptr, p->port,
               layer_name(p->link_layer), g_port, layer_name(p->link_layer));
    }
    log_line(NCCLWASM_POLICY_TYPES_LOG_LEVEL_INFO, line);
  }

  // The reason: why this layer, the threshold, and the ports of this layer it hid (the other
  // layer's are implied by the first clause).
  char reason[REASON_MAX + 1], g_total[24], g_other[24];
  size_t used = 0;
  format_gbps(g_total, sizeof g_total, total[layer]);
  format_gbps(g_other, sizeof g_other, total[other]);
  if (active[other] > 0) {
    append(reason, sizeof reason, &used, "%s %s Gb/s in total vs %s %s Gb/s", layer_name(layer),
           g_total, layer_name(other), g_other);
  } else {
    append(reason, sizeof reason, &used, "%s %s Gb/s in total, no %s port active",
           layer_name(layer), g_total, layer_name(other));
  }
  append(reason, sizeof reason, &used, "; kept %zu port(s) at >= %s Gb/s (%u%% of %s Gb/s)",
         n_kept, g_threshold, min_percent, g_fastest);
  // Name hidden ports while they fit, keeping room for ", +N more" rather than cutting a name.
  const size_t room_for_more = 16;
  size_t listed = 0;
  for (size_t i = 0; i < ports->len && listed < n_hidden; i++) {
    const ncclwasm_policy_types_port_t *p = &ports->ptr[i];
    if (!is_active(p) || p->link_layer != layer ||
        (uint64_t)p->speed_mbps * 100 >= threshold_x100) {
      continue;
    }
    format_gbps(g_port, sizeof g_port, p->speed_mbps);
    int name_len = p->device.len > 64 ? 64 : (int)p->device.len;
    if (!append(reason, sizeof reason - room_for_more, &used, "%s%.*s:%u (%s Gb/s)",
                listed == 0 ? "; hid " : ", ", name_len, (const char *)p->device.ptr, p->port,
                g_port)) {
      break;
    }
    listed++;
  }
  if (listed < n_hidden) {
    append(reason, sizeof reason, &used, "%s+%zu more", listed == 0 ? "; hid " : ", ",
           n_hidden - listed);
  }
  policy_list_port_free(ports);

  ret->ports.ptr = kept;
  ret->ports.len = n_kept;
  ret->rails.is_some = false;  // every field of an answer is set: the rails stay the host's
  policy_string_dup(&ret->reason, reason);
  return true;
}

// The hooks below are not declared in init, so the host never calls them; the world exports
// them all, so they exist, free what they own and have no opinion.

bool exports_policy_select_gid(policy_port_t *port, policy_gid_choice_t *ret) {
  (void)ret;
  policy_port_free(port);
  return false;
}

bool exports_policy_group_devices(policy_list_port_t *ports, uint32_t max_devices,
                                  policy_list_device_group_t *ret) {
  (void)max_devices;
  (void)ret;
  policy_list_port_free(ports);
  return false;
}

bool exports_policy_make_vnic(policy_list_u32_t *request, policy_list_port_t *ports,
                              uint32_t max_devices, policy_vnic_answer_t *ret) {
  (void)max_devices;
  (void)ret;
  policy_list_u32_free(request);
  policy_list_port_free(ports);
  return false;
}

bool exports_policy_plan_connection(policy_connection_t *conn, policy_conn_plan_t *ret) {
  (void)ret;
  policy_connection_free(conn);
  return false;
}

bool exports_policy_on_port_event(policy_port_event_t *event, policy_connection_t *conn,
                                  policy_list_qp_plan_t *qps, policy_list_port_state_t *states,
                                  policy_port_answer_t *ret) {
  (void)event;
  (void)ret;
  policy_connection_free(conn);
  policy_list_qp_plan_free(qps);
  policy_list_port_state_free(states);
  return false;
}
