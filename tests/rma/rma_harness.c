/* Drives the one-sided RMA tables of libnccl-net-wasm.so (ncclRmaPlugin_v14 … v16) as NCCL's GIN
 * proxy does, for one table version, with three ranks in three forked processes: each listens,
 * all connect as one group, build a context of two streams, register symmetric buffers, and put
 * to every rank — themselves included, as NCCL does — with signals, plain puts, gets and flushes.
 * Every byte is checked: each put's bytes must be visible once its signal is, calls with bad
 * arguments must be refused and write nothing, and the context must close with puts in flight.
 * Written against the layouts the plugin exports (host/abi/src/rma.rs, with their sizes checked
 * there and below), not against NCCL's headers.
 *
 * The parent opens the library and finds the table before forking, so a missing export is one
 * line; the ranks share one MAP_SHARED page holding the three listen handles and a
 * process-shared barrier, which stands in for NCCL's bootstrap allgather and barriers.
 *
 * usage: rma_harness <plugin.so> <version 14..16>
 * exit 0 and "rma harness vN: OK" on success; any failure prints one line saying who failed, in
 * which call, with what result, and exits 1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NRANKS 3
#define HANDLE 128 /* NCCL_NET_HANDLE_MAXSIZE */
#define PTR_HOST 1
#define DEVICE_GIN_PROXY 2
#define SIGNAL_OP_INC 1
#define SIGNAL_OP_ADD 2
#define OPT_AGGREGATE 1 /* ncclRmaOptFlagsAggregateRequests */
#define CHUNK (4096 + 13) /* no size or offset is round */
#define ITERS 50          /* signalled puts from each rank to each rank */
#define PLAIN 4           /* plain puts from each rank to each rank */
#define SIGNAL_ONLY 1000  /* the value of the signal-only put (size 0) */
#define GUARD 4096        /* bytes past the destination's registration, never to be written */
#define IN_FLIGHT 20      /* puts left untested when the context is destroyed */
#define TIMEOUT_S 60

/* Destination layout, the same at every rank: the slices of the signalled puts by sender and
 * iteration, then the plain puts' by sender. The source and the get buffer use the same layout,
 * by target instead of by sender. */
#define SLOT(who, it) ((uint64_t)((who) * ITERS + (it)) * CHUNK)
#define PLAIN_SLOT(who, k) ((uint64_t)(NRANKS * ITERS + (who) * PLAIN + (k)) * CHUNK)
#define REGION ((size_t)NRANKS * (ITERS + PLAIN) * CHUNK)

typedef int ncclResult_t;
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char *file, int line,
                                  const char *fmt, ...);

/* net_v12.h */
typedef struct {
  int ndevs;
  int devs[8];
} ncclNetVDeviceProps_v12_t;

typedef struct {
  char *name;
  char *pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  int netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v12_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
} ncclNetProperties_v12_t;

/* rma_v14.h (= v15, v16) */
typedef struct {
  int nContexts;
  int trafficClass;
  int rankStride;
} ncclRmaConfig_v14_t;

/* rma_v16.h */
typedef struct {
  bool flushesAllPutsOnAnySignal;
} ncclRmaProperties_v16_t;

typedef ncclResult_t (*init_fn)(void **ctx, uint64_t commId, ncclDebugLogger_t logger);
typedef ncclResult_t (*devices_fn)(int *ndev);
typedef ncclResult_t (*get_rma_properties_fn)(void *collComm, ncclRmaProperties_v16_t *props);
typedef ncclResult_t (*get_properties_fn)(int dev, ncclNetProperties_v12_t *props);
typedef ncclResult_t (*listen_fn)(void *ctx, int dev, void *handle, void **listenComm);
typedef ncclResult_t (*connect_fn)(void *ctx, void *handles[], int nranks, int rank,
                                   void *listenComm, void **collComm);
typedef ncclResult_t (*create_context_fn)(void *collComm, ncclRmaConfig_v14_t *config,
                                          void **rmaCtx);
typedef ncclResult_t (*reg_mr_sym_fn)(void *collComm, void *data, size_t size, int type,
                                      uint64_t mrFlags, void **mhandle);
typedef ncclResult_t (*reg_mr_sym_dma_buf_fn)(void *collComm, void *data, size_t size, int type,
                                              uint64_t offset, int fd, uint64_t mrFlags,
                                              void **mhandle);
typedef ncclResult_t (*dereg_mr_sym_fn)(void *collComm, void *mhandle);
typedef ncclResult_t (*close_fn)(void *comm);
typedef ncclResult_t (*iput_v14_fn)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle,
                                    size_t size, uint64_t dstOff, void *dstMhandle, uint32_t rank,
                                    void **request);
typedef ncclResult_t (*iput_v15_fn)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle,
                                    size_t size, uint64_t dstOff, void *dstMhandle, uint32_t rank,
                                    uint32_t optFlags, void **request);
typedef ncclResult_t (*iput_signal_v14_fn)(void *rmaCtx, int context, uint64_t srcOff,
                                           void *srcMhandle, size_t size, uint64_t dstOff,
                                           void *dstMhandle, uint32_t rank, uint64_t signalOff,
                                           void *signalMhandle, uint64_t signalValue,
                                           uint32_t signalOp, bool isStrongSignal,
                                           void **request);
typedef ncclResult_t (*iput_signal_v15_fn)(void *rmaCtx, int context, uint64_t srcOff,
                                           void *srcMhandle, size_t size, uint64_t dstOff,
                                           void *dstMhandle, uint32_t rank, uint64_t signalOff,
                                           void *signalMhandle, uint64_t signalValue,
                                           uint32_t signalOp, bool isStrongSignal,
                                           uint32_t optFlags, void **request);
typedef ncclResult_t (*iget_v14_fn)(void *rmaCtx, int context, uint64_t remoteOff,
                                    void *remoteMhandle, size_t size, uint64_t localOff,
                                    void *localMhandle, uint32_t rank, void **request);
typedef ncclResult_t (*iget_v15_fn)(void *rmaCtx, int context, uint64_t remoteOff,
                                    void *remoteMhandle, size_t size, uint64_t localOff,
                                    void *localMhandle, uint32_t rank, uint32_t optFlags,
                                    void **request);
typedef ncclResult_t (*iflush_fn)(void *rmaCtx, int context, void *mhandle, uint32_t rank,
                                  void **request);
typedef ncclResult_t (*test_fn)(void *collComm, void *request, int *done);
typedef ncclResult_t (*progress_fn)(void *rmaCtx);
typedef ncclResult_t (*query_last_error_fn)(void *rmaCtx, bool *hasError);
typedef ncclResult_t (*finalize_fn)(void *ctx);

typedef struct {
  const char *name;
  init_fn init;
  devices_fn devices;
  get_properties_fn getProperties;
  listen_fn listen;
  connect_fn connect;
  create_context_fn createContext;
  reg_mr_sym_fn regMrSym;
  reg_mr_sym_dma_buf_fn regMrSymDmaBuf;
  dereg_mr_sym_fn deregMrSym;
  close_fn destroyContext;
  close_fn closeColl;
  close_fn closeListen;
  iput_v14_fn iput;
  iput_signal_v14_fn iputSignal;
  iget_v14_fn iget;
  iflush_fn iflush;
  test_fn test;
  progress_fn rmaProgress;         /* may be NULL */
  query_last_error_fn queryLastError; /* may be NULL */
  finalize_fn finalize;
} ncclRma_v14_t;

/* v14 with optFlags on the three data calls. */
typedef struct {
  const char *name;
  init_fn init;
  devices_fn devices;
  get_properties_fn getProperties;
  listen_fn listen;
  connect_fn connect;
  create_context_fn createContext;
  reg_mr_sym_fn regMrSym;
  reg_mr_sym_dma_buf_fn regMrSymDmaBuf;
  dereg_mr_sym_fn deregMrSym;
  close_fn destroyContext;
  close_fn closeColl;
  close_fn closeListen;
  iput_v15_fn iput;
  iput_signal_v15_fn iputSignal;
  iget_v15_fn iget;
  iflush_fn iflush;
  test_fn test;
  progress_fn rmaProgress;
  query_last_error_fn queryLastError;
  finalize_fn finalize;
} ncclRma_v15_t;

/* v15 with getRmaProperties right after devices. */
typedef struct {
  const char *name;
  init_fn init;
  devices_fn devices;
  get_rma_properties_fn getRmaProperties;
  get_properties_fn getProperties;
  listen_fn listen;
  connect_fn connect;
  create_context_fn createContext;
  reg_mr_sym_fn regMrSym;
  reg_mr_sym_dma_buf_fn regMrSymDmaBuf;
  dereg_mr_sym_fn deregMrSym;
  close_fn destroyContext;
  close_fn closeColl;
  close_fn closeListen;
  iput_v15_fn iput;
  iput_signal_v15_fn iputSignal;
  iget_v15_fn iget;
  iflush_fn iflush;
  test_fn test;
  progress_fn rmaProgress;
  query_last_error_fn queryLastError;
  finalize_fn finalize;
} ncclRma_v16_t;

_Static_assert(sizeof(ncclNetProperties_v12_t) == 128, "ncclNetProperties_v12_t");
_Static_assert(sizeof(ncclRmaConfig_v14_t) == 12, "ncclRmaConfig_v14_t");
_Static_assert(sizeof(ncclRmaProperties_v16_t) == 1, "ncclRmaProperties_v16_t");
_Static_assert(sizeof(ncclRma_v14_t) == 168, "ncclRma_v14_t");
_Static_assert(sizeof(ncclRma_v15_t) == 168, "ncclRma_v15_t");
_Static_assert(sizeof(ncclRma_v16_t) == 176, "ncclRma_v16_t");

static int V;
static char who[16] = "parent";
static ncclRma_v14_t *T14;
static ncclRma_v15_t *T15;
static ncclRma_v16_t *T16;

/* A slot every version has, whatever its offset. */
#define F(slot) (V == 14 ? T14->slot : V == 15 ? T15->slot : T16->slot)

/* One write per line, so the lines of three ranks failing at once do not interleave. */
__attribute__((format(printf, 2, 3), noreturn)) static void die(int line, const char *fmt, ...) {
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "rma harness v%d %s: ", V, who);
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(msg + n, sizeof msg - n, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof msg - 24) n = (int)sizeof msg - 24;
  n += snprintf(msg + n, sizeof msg - n, " (line %d)\n", line);
  ssize_t written = write(2, msg, n); /* if stderr is gone, the exit status still tells */
  (void)written;
  _exit(1);
}

#define FAIL(...) die(__LINE__, __VA_ARGS__)
#define CHECK(call)                                                                         \
  do {                                                                                      \
    int rc_ = (call);                                                                       \
    if (rc_ != 0) FAIL("%s returned %d", #call, rc_);                                       \
  } while (0)
/* `call` must fail; it names `&req_` as its request. */
#define REFUSED(what, call)                                                                 \
  do {                                                                                      \
    void *req_ = (void *)0xdead;                                                            \
    int rc_ = (call);                                                                       \
    if (rc_ == 0) FAIL("%s: %s succeeded", what, #call);                                    \
  } while (0)

static void logger(int level, unsigned long flags, const char *file, int line, const char *fmt,
                   ...) {
  (void)flags;
  if (level > 3) return;
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "[rma v%d %s %s %s:%d] ", V, who,
                   level == 2 ? "WARN" : "INFO", file, line);
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(msg + n, sizeof msg - n, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof msg - 2) n = (int)sizeof msg - 2;
  msg[n++] = '\n';
  ssize_t written = write(2, msg, n);
  (void)written;
}

static void spin(void) {
  struct timespec ts = {0, 20000};
  nanosleep(&ts, NULL);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- what the ranks share ---- */

typedef struct {
  pthread_barrier_t barrier;
  char handles[NRANKS][HANDLE];
} shared_t;

static shared_t *sh;
static int rank;

static void barrier(void) {
  int rc = pthread_barrier_wait(&sh->barrier);
  if (rc != 0 && rc != PTHREAD_BARRIER_SERIAL_THREAD) FAIL("pthread_barrier_wait returned %d", rc);
}

/* ---- the version-dependent calls ---- */

static void *ctx, *coll, *rctx;

static int iput(int context, uint64_t srcOff, void *srcMh, size_t size, uint64_t dstOff,
                void *dstMh, uint32_t peer, uint32_t opt, void **req) {
  if (V == 14) return T14->iput(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, req);
  if (V == 15) return T15->iput(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, opt, req);
  return T16->iput(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, opt, req);
}

static int iput_signal(int context, uint64_t srcOff, void *srcMh, size_t size, uint64_t dstOff,
                       void *dstMh, uint32_t peer, uint64_t sigOff, void *sigMh, uint64_t value,
                       uint32_t op, bool strong, uint32_t opt, void **req) {
  if (V == 14)
    return T14->iputSignal(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, sigOff, sigMh,
                           value, op, strong, req);
  if (V == 15)
    return T15->iputSignal(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, sigOff, sigMh,
                           value, op, strong, opt, req);
  return T16->iputSignal(rctx, context, srcOff, srcMh, size, dstOff, dstMh, peer, sigOff, sigMh,
                         value, op, strong, opt, req);
}

static int iget(int context, uint64_t remoteOff, void *remoteMh, size_t size, uint64_t localOff,
                void *localMh, uint32_t peer, uint32_t opt, void **req) {
  if (V == 14)
    return T14->iget(rctx, context, remoteOff, remoteMh, size, localOff, localMh, peer, req);
  if (V == 15)
    return T15->iget(rctx, context, remoteOff, remoteMh, size, localOff, localMh, peer, opt, req);
  return T16->iget(rctx, context, remoteOff, remoteMh, size, localOff, localMh, peer, opt, req);
}

/* ---- requests ---- */

#define MAX_PENDING (NRANKS * (ITERS + PLAIN + 2) + 16)
static void *pending[MAX_PENDING];
static int npending;

/* A request the plugin just returned; NCCL's proxy tests every one, so none may be NULL. */
static void keep(void *req, const char *what) {
  if (req == (void *)0xdead) FAIL("%s left *request unwritten", what);
  if (!req) FAIL("%s returned a NULL request", what);
  if (npending == MAX_PENDING) FAIL("more than %d requests pending", MAX_PENDING);
  pending[npending++] = req;
}

/* Tests every pending request once (and runs rmaProgress, as NCCL's proxy does when the plugin
 * has one); returns how many are still pending. */
static int poll_pending(void) {
  if (F(rmaProgress)) CHECK(F(rmaProgress)(rctx));
  int left = 0;
  for (int i = 0; i < npending; i++) {
    int done = -1;
    CHECK(F(test)(coll, pending[i], &done));
    if (done != 0 && done != 1) FAIL("test left done unwritten (%d)", done);
    if (!done) pending[left++] = pending[i];
  }
  npending = left;
  return left;
}

static void wait_pending(const char *what) {
  double start = now();
  while (poll_pending())
    if (now() - start > TIMEOUT_S) FAIL("%s: %d requests not done after %d s", what, npending,
                                        TIMEOUT_S);
    else spin();
}

/* ---- patterns ---- */

/* The byte `i` of the slice `sender` puts to `target` in iteration `it` (plain puts: ITERS + k). */
static unsigned char pat(int sender, int target, int it, size_t i) {
  return (unsigned char)(i * 131 + sender * 7 + target * 31 + it * 57 + (i >> 9));
}
static void fill(unsigned char *b, int sender, int target, int it) {
  for (size_t i = 0; i < CHUNK; i++) b[i] = pat(sender, target, it, i);
}
static void verify(const unsigned char *b, int sender, int target, int it, const char *what) {
  for (size_t i = 0; i < CHUNK; i++)
    if (b[i] != pat(sender, target, it, i))
      FAIL("%s from rank %d to rank %d, iteration %d: byte %zu is %u, expected %u", what, sender,
           target, it, i, b[i], pat(sender, target, it, i));
}

/* What each sender's signal word adds up to: INC adds 1 whatever the value passed, ADD the value
 * (it + 1 on odd iterations), and the signal-only put adds SIGNAL_ONLY. */
static uint64_t signal_total(void) {
  uint64_t sum = SIGNAL_ONLY;
  for (int it = 0; it < ITERS; it++) sum += it % 2 == 0 ? 1 : (uint64_t)it + 1;
  return sum;
}

/* The get buffer: what this rank put at every rank, read back. */
static void verify_gets(const unsigned char *got, const char *what) {
  for (int p = 0; p < NRANKS; p++) {
    for (int it = 0; it < ITERS; it++) verify(got + SLOT(p, it), rank, p, it, what);
    for (int k = 0; k < PLAIN; k++) verify(got + PLAIN_SLOT(p, k), rank, p, ITERS + k, what);
  }
}

static void *alloc(size_t size) {
  void *p;
  if (posix_memalign(&p, 4096, size)) FAIL("posix_memalign of %zu bytes", size);
  return p;
}

static void *reg(void *data, size_t size) {
  void *mh = (void *)0xdead;
  CHECK(F(regMrSym)(coll, data, size, PTR_HOST, 0, &mh));
  if (!mh || mh == (void *)0xdead) FAIL("regMrSym returned no handle");
  return mh;
}

/* ---- one rank ---- */

static void run_rank(void) {
  snprintf(who, sizeof who, "rank %d", rank);

  /* 1. init, devices, properties: an RMA proxy device that takes host memory. */
  ctx = (void *)0xdead;
  CHECK(F(init)(&ctx, 0x1234abcdULL, logger));
  if (!ctx || ctx == (void *)0xdead) FAIL("init did not set ctx");
  int n = -1;
  CHECK(F(devices)(&n));
  if (n < 1) FAIL("%d devices", n);
  for (int d = 0; d < n; d++) {
    ncclNetProperties_v12_t props;
    memset(&props, 0xa5, sizeof props);
    CHECK(F(getProperties)(d, &props));
    if (props.netDeviceType != DEVICE_GIN_PROXY)
      FAIL("device %d: netDeviceType %d, expected %d (GIN proxy)", d, props.netDeviceType,
           DEVICE_GIN_PROXY);
    if (!(props.ptrSupport & PTR_HOST)) FAIL("device %d: ptrSupport %#x", d, props.ptrSupport);
    if (!props.name || !props.name[0]) FAIL("device %d has no name", d);
  }

  /* 2. listen, then connect as one group (collective and blocking: all ranks at once). */
  void *lcomm = (void *)0xdead;
  CHECK(F(listen)(ctx, 0, sh->handles[rank], &lcomm));
  if (!lcomm || lcomm == (void *)0xdead) FAIL("listen returned no listenComm");
  barrier();
  void *handles[NRANKS];
  for (int p = 0; p < NRANKS; p++) handles[p] = sh->handles[p];
  coll = (void *)0xdead;
  CHECK(F(connect)(ctx, handles, NRANKS, rank, lcomm, &coll));
  if (!coll || coll == (void *)0xdead) FAIL("connect returned no collComm");
  CHECK(F(closeListen)(lcomm));
  if (V >= 16) {
    ncclRmaProperties_v16_t rp;
    memset(&rp, 0xa5, sizeof rp);
    CHECK(T16->getRmaProperties(coll, &rp));
    unsigned char b;
    memcpy(&b, &rp, 1);
    if (b > 1) FAIL("getRmaProperties left flushesAllPutsOnAnySignal unwritten (%#x)", b);
  }

  /* 3. a context of two streams (collective). */
  ncclRmaConfig_v14_t config = {.nContexts = 2, .trafficClass = -1, .rankStride = 1};
  rctx = (void *)0xdead;
  CHECK(F(createContext)(coll, &config, &rctx));
  if (!rctx || rctx == (void *)0xdead) FAIL("createContext returned no context");

  /* 4. symmetric registrations, every rank in the same order; the destination twice, with
   * guard bytes past its registration that no put may reach. */
  unsigned char *src = alloc(REGION), *dst = alloc(REGION + GUARD), *got = alloc(REGION);
  uint64_t *sig = alloc(NRANKS * sizeof(uint64_t));
  for (int p = 0; p < NRANKS; p++) {
    for (int it = 0; it < ITERS; it++) fill(src + SLOT(p, it), rank, p, it);
    for (int k = 0; k < PLAIN; k++) fill(src + PLAIN_SLOT(p, k), rank, p, ITERS + k);
  }
  memset(dst, 0, REGION);
  memset(dst + REGION, 0xee, GUARD);
  memset(got, 0xcc, REGION);
  memset(sig, 0, NRANKS * sizeof(uint64_t));
  void *srcMh = reg(src, REGION);
  void *dstMh = reg(dst, REGION);
  void *sigMh = reg(sig, NRANKS * sizeof(uint64_t));
  void *getMh = reg(got, REGION);
  void *dstMh2 = reg(dst, REGION);
  barrier(); /* every rank's buffers are ready before anyone puts */

  /* 5. puts with signals to every rank, itself included; plain puts; one signal-only put. */
  for (int p = 0; p < NRANKS; p++) {
    for (int it = 0; it < ITERS; it++) {
      void *req = (void *)0xdead;
      uint32_t op = it % 2 == 0 ? SIGNAL_OP_INC : SIGNAL_OP_ADD;
      uint32_t opt = (it / 2) % 2 ? OPT_AGGREGATE : 0;
      CHECK(iput_signal(it % 2, SLOT(p, it), srcMh, CHUNK, SLOT(rank, it),
                        it % 4 == 3 ? dstMh2 : dstMh, p, rank * sizeof(uint64_t), sigMh,
                        (uint64_t)it + 1, op, it % 3 == 0, opt, &req));
      keep(req, "iputSignal");
    }
    for (int k = 0; k < PLAIN; k++) {
      void *req = (void *)0xdead;
      CHECK(iput(k % 2, PLAIN_SLOT(p, k), srcMh, CHUNK, PLAIN_SLOT(rank, k),
                 k % 2 ? dstMh2 : dstMh, p, 0, &req));
      keep(req, "iput");
    }
    /* As NCCL's proxy posts a signal without data: size 0, no data handles. */
    void *req = (void *)0xdead;
    CHECK(iput_signal(1, 0, NULL, 0, 0, NULL, p, rank * sizeof(uint64_t), sigMh, SIGNAL_ONLY,
                      SIGNAL_OP_ADD, true, 0, &req));
    keep(req, "iputSignal of size 0");
  }

  /* 6. each sender's slices must be in place the moment its signal word is complete: checked
   * while this rank's own puts are still being tested, with no barrier in between. */
  {
    const uint64_t total = signal_total();
    int complete[NRANKS] = {0}, ncomplete = 0;
    double start = now();
    while (poll_pending() || ncomplete < NRANKS) {
      for (int s = 0; s < NRANKS; s++) {
        if (complete[s]) continue;
        uint64_t v = __atomic_load_n(&sig[s], __ATOMIC_ACQUIRE);
        if (v > total) FAIL("signal word of rank %d is %lu, past %lu", s, (unsigned long)v,
                            (unsigned long)total);
        if (v != total) continue;
        for (int it = 0; it < ITERS; it++)
          verify(dst + SLOT(s, it), s, rank, it, "put visible before its signal");
        complete[s] = 1, ncomplete++;
      }
      if (now() - start > TIMEOUT_S) {
        char words[96];
        snprintf(words, sizeof words, "%lu %lu %lu", (unsigned long)sig[0], (unsigned long)sig[1],
                 (unsigned long)sig[2]);
        FAIL("after %d s: signal words %s (each must reach %lu), %d requests pending", TIMEOUT_S,
             words, (unsigned long)total, npending);
      }
      spin();
    }
  }
  barrier(); /* every rank's puts are done: the plain puts have landed */
  for (int s = 0; s < NRANKS; s++)
    for (int k = 0; k < PLAIN; k++) verify(dst + PLAIN_SLOT(s, k), s, rank, ITERS + k, "plain put");
  for (size_t i = 0; i < GUARD; i++)
    if (dst[REGION + i] != 0xee) FAIL("guard byte %zu past the destination was written", i);
  barrier(); /* every rank has checked its destination */

  /* 7. gets: what this rank put at every rank, read back; then flushes. */
  for (int p = 0; p < NRANKS; p++) {
    void *req = (void *)0xdead;
    CHECK(iget(0, SLOT(rank, 0), dstMh, (size_t)ITERS * CHUNK, SLOT(p, 0), getMh, p, 0, &req));
    keep(req, "iget");
    req = (void *)0xdead;
    CHECK(iget(1, PLAIN_SLOT(rank, 0), dstMh2, (size_t)PLAIN * CHUNK, PLAIN_SLOT(p, 0), getMh, p,
               OPT_AGGREGATE, &req));
    keep(req, "iget");
  }
  wait_pending("iget");
  verify_gets(got, "get");
  for (int p = 0; p < NRANKS; p++) {
    /* A flush with nothing to do may return no request (NCCL's proxy takes that as done). */
    void *req = (void *)0xdead;
    CHECK(F(iflush)(rctx, 1, dstMh, p, &req));
    if (req == (void *)0xdead) FAIL("iflush left *request unwritten");
    if (req) keep(req, "iflush");
    req = (void *)0xdead;
    CHECK(F(iflush)(rctx, 0, sigMh, p, &req));
    if (req == (void *)0xdead) FAIL("iflush left *request unwritten");
    if (req) keep(req, "iflush");
  }
  wait_pending("iflush");
  if (F(queryLastError)) {
    bool has;
    memset(&has, 0xa5, sizeof has);
    CHECK(F(queryLastError)(rctx, &has));
    unsigned char b;
    memcpy(&b, &has, 1);
    if (b != 0) FAIL("queryLastError reports an error (%#x) after a clean run", b);
  }
  barrier(); /* every rank is done with the data */

  /* 8. bad input is refused and writes nothing: out of range rank, context, bounds, signal op,
   * NULL handles. The source holds bytes no slot has, so a stray write shows. */
  unsigned char *before = malloc(REGION + GUARD);
  if (!before) FAIL("malloc");
  memcpy(before, dst, REGION + GUARD);
  memset(src, 0x5a, REGION);
  const int next = (rank + 1) % NRANKS;
  REFUSED("rank out of range", iput(0, 0, srcMh, CHUNK, SLOT(rank, 0), dstMh, NRANKS, 0, &req_));
  REFUSED("context out of range", iput(2, 0, srcMh, CHUNK, SLOT(rank, 0), dstMh, next, 0, &req_));
  REFUSED("past the destination's registration",
          iput(0, 0, srcMh, CHUNK, REGION - CHUNK / 2, dstMh, next, 0, &req_));
  REFUSED("past the source's registration",
          iput(0, REGION - CHUNK / 2, srcMh, CHUNK, SLOT(rank, 0), dstMh, next, 0, &req_));
  REFUSED("NULL source handle", iput(0, 0, NULL, CHUNK, SLOT(rank, 0), dstMh, next, 0, &req_));
  REFUSED("NULL destination handle",
          iput(0, 0, srcMh, CHUNK, SLOT(rank, 0), NULL, next, 0, &req_));
  REFUSED("unknown signal op", iput_signal(0, 0, srcMh, CHUNK, SLOT(rank, 0), dstMh, next,
                                           rank * sizeof(uint64_t), sigMh, 1, 3, false, 0, &req_));
  REFUSED("get past the remote registration",
          iget(0, REGION - CHUNK / 2, dstMh, CHUNK, 0, getMh, next, 0, &req_));
  /* One registration of a buffer registered twice goes; the other still works. A put with a
   * signal on stream 0 to every rank then lands after anything the refused calls might have
   * queued there, and rewrites one known slice. */
  CHECK(F(deregMrSym)(coll, dstMh2));
  barrier();
  for (int p = 0; p < NRANKS; p++) {
    void *req = (void *)0xdead;
    fill(src + SLOT(p, 0), rank, p, 999);
    CHECK(iput_signal(0, SLOT(p, 0), srcMh, CHUNK, SLOT(rank, 0), dstMh, p,
                      rank * sizeof(uint64_t), sigMh, 1, SIGNAL_OP_INC, true, 0, &req));
    keep(req, "iputSignal after the refused calls");
  }
  {
    const uint64_t total = signal_total() + 1;
    double start = now();
    for (int s = 0; s < NRANKS; s++)
      while (__atomic_load_n(&sig[s], __ATOMIC_ACQUIRE) != total) {
        poll_pending();
        if (now() - start > TIMEOUT_S) FAIL("signal word of rank %d is %lu, expected %lu", s,
                                            (unsigned long)sig[s], (unsigned long)total);
        spin();
      }
  }
  wait_pending("iputSignal after the refused calls");
  barrier();
  for (int s = 0; s < NRANKS; s++) {
    verify(dst + SLOT(s, 0), s, rank, 999, "put after the refused calls");
    memcpy(before + SLOT(s, 0), dst + SLOT(s, 0), CHUNK);
  }
  for (size_t i = 0; i < REGION + GUARD; i++)
    if (dst[i] != before[i])
      FAIL("a refused call wrote byte %zu of the destination%s (%u, was %u)", i,
           i >= REGION ? ", past its registration" : "", dst[i], before[i]);
  free(before);
  verify_gets(got, "get buffer after a refused get");
  barrier(); /* every rank has checked its destination for the last time */

  /* 9. close with puts in flight, never tested: destroyContext must still succeed. They are
   * posted while every rank is still up, and no rank tears down before all have posted. */
  for (int i = 0; i < IN_FLIGHT; i++) {
    void *req = (void *)0xdead;
    CHECK(iput(i % 2, 0, srcMh, CHUNK, PLAIN_SLOT(rank, 0), dstMh, next, 0, &req));
    if (!req || req == (void *)0xdead) FAIL("iput in flight returned no request");
  }
  barrier();
  CHECK(F(destroyContext)(rctx));
  CHECK(F(deregMrSym)(coll, srcMh));
  CHECK(F(deregMrSym)(coll, dstMh));
  CHECK(F(deregMrSym)(coll, sigMh));
  CHECK(F(deregMrSym)(coll, getMh));
  CHECK(F(closeColl)(coll));
  CHECK(F(finalize)(ctx));
  free(src), free(dst), free(got), free(sig);
}

/* The three slots whose types change with the version. */
static int has_data_calls(void) {
  if (V == 14) return T14->iput && T14->iputSignal && T14->iget;
  if (V == 15) return T15->iput && T15->iputSignal && T15->iget;
  return T16->iput && T16->iputSignal && T16->iget;
}

/* As NCCL: the table of the version under test, found by name in the plugin library. */
static void open_plugin(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) FAIL("dlopen %s: %s", path, dlerror());
  char sym[32];
  snprintf(sym, sizeof sym, "ncclRmaPlugin_v%d", V);
  void *t = dlsym(lib, sym);
  if (!t) FAIL("dlsym %s: %s", sym, dlerror());
  if (V == 14) T14 = t;
  else if (V == 15) T15 = t;
  else T16 = t;
  if (!F(name) || strcmp(F(name), "WASM") != 0) FAIL("%s is named %s", sym, F(name));
  if (!F(init) || !F(devices) || !F(getProperties) || !F(listen) || !F(connect) ||
      !F(createContext) || !F(regMrSym) || !F(deregMrSym) || !F(destroyContext) ||
      !F(closeColl) || !F(closeListen) || !has_data_calls() || !F(iflush) || !F(test) ||
      !F(finalize))
    FAIL("%s leaves a slot NCCL calls NULL", sym);
  if (V == 16 && !T16->getRmaProperties) FAIL("%s has no getRmaProperties", sym);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s <plugin.so> <version 14..16>\n", argv[0]);
    return 2;
  }
  V = atoi(argv[2]);
  if (V < 14 || V > 16) return 2;
  open_plugin(argv[1]);

  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) FAIL("mmap of the shared page");
  memset(sh->handles, 0, sizeof sh->handles);
  pthread_barrierattr_t attr;
  if (pthread_barrierattr_init(&attr) ||
      pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED) ||
      pthread_barrier_init(&sh->barrier, &attr, NRANKS))
    FAIL("process-shared barrier");
  pthread_barrierattr_destroy(&attr);

  pid_t pids[NRANKS];
  fflush(NULL);
  for (int r = 0; r < NRANKS; r++) {
    pids[r] = fork();
    if (pids[r] < 0) FAIL("fork");
    if (pids[r] == 0) {
      alarm(300); /* alarms are not inherited */
      rank = r;
      run_rank();
      _exit(0);
    }
  }
  alarm(320);
  /* A rank that fails leaves the others at a barrier: they are stopped, and its line stands. */
  int failed = 0;
  for (int reaped = 0; reaped < NRANKS; reaped++) {
    int status;
    pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) FAIL("waitpid");
    int r = 0;
    while (r < NRANKS && pids[r] != pid) r++;
    if (r == NRANKS) FAIL("waitpid returned an unknown child %d", (int)pid);
    pids[r] = 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    if (!failed) {
      if (WIFSIGNALED(status))
        fprintf(stderr, "rma harness v%d: rank %d died of signal %d\n", V, r, WTERMSIG(status));
      else fprintf(stderr, "rma harness v%d: rank %d exited %d\n", V, r, WEXITSTATUS(status));
      for (int o = 0; o < NRANKS; o++)
        if (pids[o]) kill(pids[o], SIGKILL);
    }
    failed = 1;
  }
  if (failed) return 1;
  printf("rma harness v%d: OK\n", V);
  return 0;
}
