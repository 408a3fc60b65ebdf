/* Drives libnccl-net-wasm.so exactly as NCCL's proxy does, for one ABI version, across two
 * processes: the parent receives (listen/accept/irecv/iflush), the forked child sends
 * (connect/isend); the listen handle and a few sync bytes travel over pipes. Every byte received
 * is checked. Written against the layouts the plugin exports (host/abi/src/layout.rs, with their
 * sizes checked there), not against NCCL's headers.
 *
 * Both sides also move data between "GPU" buffers registered with regMrDmaBuf: a memfd mapped
 * twice stands in for a dma-buf and its CPU mapping; the sender fills one mapping and sends from
 * the other, the receiver receives into one and checks every byte through the other.
 *
 * usage: harness <plugin.so> <version 8..12> [expect-init-failure | inflight-close]
 * Environment: HARNESS_PTR = the ptrSupport every device must report (default 1, host only);
 * HARNESS_FLUSH = 1 when iflush must issue a flush, 0 when it must not (default 0).
 * exit 0 and "harness vN: OK" on success; any failure prints why and exits 1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024UL * 1024UL)
#define BUF (64 * MIB + 8192)
#define HANDLE 128
#define MAX_N 8
#define PTR_HOST 1
#define PTR_CUDA 2
#define PTR_DMABUF 4
#define DMABUF_BYTES (4 * MIB + 8192)

typedef struct {
  const char *name;
  void *init, *devices, *getProperties, *listen, *connect, *accept, *regMr, *regMrDmaBuf,
      *deregMr, *isend, *irecv, *iflush, *test, *closeSend, *closeRecv, *closeListen,
      *getDeviceMr, *irecvConsumed;
  void *makeVDevice; /* v9+ */
  void *finalize, *setNetAttr; /* v11+ */
} table_t;

typedef void (*logger_t)(int, unsigned long, const char *, int, const char *, ...);
typedef struct { int trafficClass; } cfg_t;

static int V;
static int expect_ptr = PTR_HOST, expect_flush;
static table_t *T;
static void *ctx; /* v11+ */
static const char *role = "recv";

#define FAIL(...)                                                                          \
  do {                                                                                      \
    fprintf(stderr, "harness v%d %s: ", V, role);                                           \
    fprintf(stderr, __VA_ARGS__);                                                           \
    fprintf(stderr, " (line %d)\n", __LINE__);                                              \
    exit(1);                                                                                \
  } while (0)
#define CHECK(call)                                                                         \
  do {                                                                                      \
    int rc_ = (call);                                                                       \
    if (rc_ != 0) FAIL("%s returned %d", #call, rc_);                                       \
  } while (0)

static void logger(int level, unsigned long flags, const char *file, int line, const char *fmt,
                   ...) {
  (void)flags;
  if (level > 3 || getenv("HARNESS_QUIET")) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[v%d %s %s %s:%d] ", V, role, level == 2 ? "WARN" : "INFO", file, line);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static void spin(void) {
  struct timespec ts = {0, 20000};
  nanosleep(&ts, NULL);
}

/* ---- version-dependent calls ---- */

static void do_init(void) {
  logger_t lg = V == 9 ? NULL : logger; /* one version gets a NULL logger, as RCCL tests do */
  if (V <= 9) CHECK(((int (*)(logger_t))T->init)(lg));
  else if (V == 10) CHECK(((int (*)(logger_t, void *))T->init)(lg, NULL));
  else {
    cfg_t cfg = {5};
    ctx = (void *)0xdead;
    CHECK(((int (*)(void **, uint64_t, cfg_t *, logger_t, void *))T->init)(&ctx, 0x1234abcdULL,
                                                                           &cfg, lg, NULL));
    if (!ctx || ctx == (void *)0xdead) FAIL("init did not set ctx");
  }
}

static int ndevices(void) {
  int n = -1;
  CHECK(((int (*)(int *))T->devices)(&n));
  return n;
}

typedef struct {
  const char *name, *pci;
  int ptr, speed, maxRecvs, ndevs, devs[8];
  size_t maxP2p;
  int16_t rail, plane; /* v12; -1 before */
} props_t;

static props_t props(int dev) {
  unsigned char b[128];
  memset(b, 0xa5, sizeof b);
  CHECK(((int (*)(int, void *))T->getProperties)(dev, b));
  props_t p;
  memset(&p, 0, sizeof p);
  memcpy(&p.name, b + 0, 8);
  memcpy(&p.pci, b + 8, 8);
  memcpy(&p.ptr, b + 24, 4);
  if (V == 8) {
    memcpy(&p.speed, b + 32, 4);
    memcpy(&p.maxRecvs, b + 48, 4);
    p.ndevs = 1, p.devs[0] = dev, p.maxP2p = 1UL << 30;
  } else {
    memcpy(&p.speed, b + 36, 4);
    memcpy(&p.maxRecvs, b + 52, 4);
    memcpy(&p.ndevs, b + 64, 4);
    memcpy(p.devs, b + 68, 4 * (V == 12 ? 8 : 4));
    memcpy(&p.maxP2p, b + (V == 12 ? 104 : 88), 8);
  }
  p.rail = p.plane = -1;
  if (V == 12) {
    memcpy(&p.rail, b + 124, 2);
    memcpy(&p.plane, b + 126, 2);
    if (p.rail != -1 && p.rail < 0) FAIL("railId %d", p.rail);
  }
  if (!p.name || !p.name[0]) FAIL("device %d has no name", dev);
  if (p.ptr != expect_ptr) FAIL("ptrSupport %#x, expected %#x", p.ptr, expect_ptr);
  if (p.maxRecvs != 8) FAIL("maxRecvs %d", p.maxRecvs);
  if (p.maxP2p == 0 || p.maxP2p > (1UL << 40)) FAIL("maxP2pBytes %zu", p.maxP2p);
  return p;
}

static void *do_listen(int dev, char *handle) {
  void *lc = (void *)0xdead;
  if (V <= 10) CHECK(((int (*)(int, void *, void **))T->listen)(dev, handle, &lc));
  else CHECK(((int (*)(void *, int, void *, void **))T->listen)(ctx, dev, handle, &lc));
  if (!lc || lc == (void *)0xdead) FAIL("listen returned no listenComm");
  return lc;
}

static void *do_connect(int dev, char *handle) {
  void *sc = NULL, *dc = NULL;
  for (;;) {
    sc = (void *)0xdead;
    if (V <= 9) CHECK(((int (*)(int, void *, void **, void **))T->connect)(dev, handle, &sc, &dc));
    else if (V == 10) {
      cfg_t cfg = {-1};
      CHECK(((int (*)(int, cfg_t *, void *, void **, void **))T->connect)(dev, &cfg, handle, &sc,
                                                                          NULL));
    } else
      CHECK(((int (*)(void *, int, void *, void **, void **))T->connect)(ctx, dev, handle, &sc,
                                                                         &dc));
    if (sc == (void *)0xdead) FAIL("connect left sendComm unwritten");
    if (sc) return sc;
    spin();
  }
}

static void *do_accept(void *lc) {
  void *rc = NULL, *dc = NULL;
  for (;;) {
    rc = (void *)0xdead;
    CHECK(((int (*)(void *, void **, void **))T->accept)(lc, &rc, &dc));
    if (rc == (void *)0xdead) FAIL("accept left recvComm unwritten");
    if (rc) return rc;
    spin();
  }
}

static int try_reg(void *comm, void *data, size_t size, int type, void **mh) {
  *mh = (void *)0xdead;
  int rc = ((int (*)(void *, void *, size_t, int, void **))T->regMr)(comm, data, size, type, mh);
  if (*mh == (void *)0xdead) FAIL("regMr left mhandle unwritten");
  if (rc == 0 && !*mh) FAIL("regMr returned no handle");
  return rc;
}

static void *reg(void *comm, void *data, size_t size) {
  void *mh;
  CHECK(try_reg(comm, data, size, PTR_HOST, &mh));
  return mh;
}

/* A "GPU buffer": a memfd (the dma-buf) mapped twice, as the device's and the CPU's view. */
typedef struct {
  int fd;
  unsigned char *dev, *cpu;
} gpubuf_t;

static gpubuf_t gpu_alloc(void) {
  gpubuf_t g;
  g.fd = memfd_create("harness-dmabuf", 0);
  if (g.fd < 0) FAIL("memfd_create");
  if (ftruncate(g.fd, DMABUF_BYTES)) FAIL("ftruncate");
  g.dev = mmap(NULL, DMABUF_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g.fd, 0);
  g.cpu = mmap(NULL, DMABUF_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g.fd, 0);
  if (g.dev == MAP_FAILED || g.cpu == MAP_FAILED) FAIL("mmap of the memfd");
  return g;
}

static void gpu_free(gpubuf_t *g) {
  munmap(g->dev, DMABUF_BYTES);
  munmap(g->cpu, DMABUF_BYTES);
  close(g->fd);
}

static void *reg_dmabuf(void *comm, gpubuf_t *g, int type) {
  if (!T->regMrDmaBuf) FAIL("regMrDmaBuf is NULL");
  void *mh = (void *)0xdead;
  CHECK(((int (*)(void *, void *, size_t, int, uint64_t, int, void **))T->regMrDmaBuf)(
      comm, g->dev, DMABUF_BYTES, type, 0, g->fd, &mh));
  if (!mh || mh == (void *)0xdead) FAIL("regMrDmaBuf returned no handle");
  return mh;
}

static void *try_isend(void *sc, void *data, size_t size, int tag, void *mh) {
  void *req = (void *)0xdead;
  if (V == 8)
    CHECK(((int (*)(void *, void *, int, int, void *, void **))T->isend)(sc, data, (int)size, tag,
                                                                         mh, &req));
  else if (V == 9)
    CHECK(((int (*)(void *, void *, size_t, int, void *, void **))T->isend)(sc, data, size, tag,
                                                                            mh, &req));
  else
    CHECK(((int (*)(void *, void *, size_t, int, void *, void *, void **))T->isend)(
        sc, data, size, tag, mh, NULL, &req));
  if (req == (void *)0xdead) FAIL("isend left request unwritten");
  return req;
}

static void *isend(void *sc, void *data, size_t size, int tag, void *mh) {
  void *req;
  while (!(req = try_isend(sc, data, size, tag, mh))) spin();
  return req;
}

static void *irecv(void *rc, int n, void **data, size_t *sizes, int *tags, void **mhs,
                   int sentinel) {
  void *req = sentinel ? (void *)0x1 : (void *)0xdead;
  if (V == 8) {
    int isz[MAX_N];
    for (int i = 0; i < n; i++) isz[i] = (int)sizes[i];
    CHECK(((int (*)(void *, int, void **, int *, int *, void **, void **))T->irecv)(
        rc, n, data, isz, tags, mhs, &req));
  } else if (V == 9)
    CHECK(((int (*)(void *, int, void **, size_t *, int *, void **, void **))T->irecv)(
        rc, n, data, sizes, tags, mhs, &req));
  else
    CHECK(((int (*)(void *, int, void **, size_t *, int *, void **, void **, void **))T->irecv)(
        rc, n, data, sizes, tags, mhs, NULL, &req));
  if (req == (void *)0xdead || req == (void *)0x1) FAIL("irecv did not overwrite *request");
  if (!req) FAIL("irecv returned no request");
  return req;
}

static void wait_req(void *req, int *sizes) {
  int done = 0;
  time_t start = time(NULL);
  while (!done) {
    done = -1;
    CHECK(((int (*)(void *, int *, int *))T->test)(req, &done, sizes));
    if (done != 0 && done != 1) FAIL("test left done unwritten");
    if (time(NULL) - start > 60) FAIL("request never completed");
  }
}

/* ---- the scenario ---- */

static unsigned char pat(size_t i, int seed) {
  return (unsigned char)(i * 131 + seed * 7 + (i >> 13));
}
static void fill(unsigned char *b, size_t n, int seed) {
  for (size_t i = 0; i < n; i++) b[i] = pat(i, seed);
}
static void verify(const unsigned char *b, size_t n, int seed, const char *what) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != pat(i, seed)) FAIL("%s: byte %zu of %zu is %u, expected %u", what, i, n, b[i],
                                   pat(i, seed));
}

static const size_t SIZES[] = {0, 1, 2, 7, 128, 4095, 4096, 8193, 65536, 1 * MIB + 3, 4 * MIB,
                               16 * MIB, 64 * MIB};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static int to_child[2], to_parent[2];

static void put(int fd, const void *p, size_t n) {
  if (write(fd, p, n) != (ssize_t)n) FAIL("pipe write");
}
static void get(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r <= 0) FAIL("pipe read");
    got += r;
  }
}

static void open_plugin(const char *path, void **lib) {
  *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!*lib) FAIL("dlopen %s: %s", path, dlerror());
  /* As NCCL: newest first, take the first hit — capped at the version under test. */
  char sym[32];
  T = NULL;
  for (int v = 12; v >= 8 && !T; v--) {
    snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
    table_t *t = dlsym(*lib, sym);
    if (!t) FAIL("%s is not exported", sym);
    if (v == V) T = t;
  }
  if (strcmp(T->name, "WASM") != 0) FAIL("plugin name %s", T->name);
  if (!T->regMrDmaBuf) FAIL("v%d has a regMrDmaBuf slot, left NULL", V);
}

static int threads(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  int n = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  if (f) fclose(f);
  return n;
}

static int threads_before; /* set before the first dlopen */

static void finish(void *lib) {
  if (V >= 11) {
    CHECK(((int (*)(void *))T->finalize)(ctx));
    /* The last finalize stops every thread of ours (event, policy, fabric threads). */
    int n = threads();
    for (int i = 0; i < 500 && n != threads_before; i++) spin(), n = threads();
    if (n != threads_before) FAIL("%d threads after finalize, %d before init", n, threads_before);
  }
  if (dlclose(lib) != 0) FAIL("dlclose: %s", dlerror());
}

static int pick_device(int *n) {
  *n = ndevices();
  if (*n < 2) FAIL("%d devices; the harness needs 2 ports", *n);
  for (int i = 0; i < *n; i++) {
    props_t p = props(i);
    if (V >= 9 && (p.ndevs != 1 || p.devs[0] != i)) FAIL("physical device %d vProps", i);
  }
  if (V == 8) return -1;
  /* Fuse devices 0 and 1, as NCCL core's makeVDevice does. */
  int d = -7;
  int vp[9] = {2, 0, 1};
  CHECK(((int (*)(int *, void *))T->makeVDevice)(&d, vp));
  int m = ndevices();
  if (m != *n + 1 || d != *n) FAIL("vNIC %d, devices %d -> %d", d, *n, m);
  props_t p = props(d);
  if (p.ndevs != 2 || p.devs[0] != 0 || p.devs[1] != 1 || !strchr(p.name, '+'))
    FAIL("vNIC props %s ndevs %d", p.name, p.ndevs);
  for (int i = 0; i < m; i++) props(i);
  /* HARNESS_RAILS="r0,p0,r1,p1,rv,pv": railId/planeId of devices 0, 1 and their vNIC. */
  const char *rails = getenv("HARNESS_RAILS");
  if (rails) {
    int want[6], got[6];
    if (sscanf(rails, "%d,%d,%d,%d,%d,%d", &want[0], &want[1], &want[2], &want[3], &want[4],
               &want[5]) != 6)
      FAIL("HARNESS_RAILS=%s", rails);
    int devs[3] = {0, 1, d};
    for (int k = 0; k < 3; k++) {
      props_t q = props(devs[k]);
      got[2 * k] = q.rail, got[2 * k + 1] = q.plane;
    }
    for (int k = 0; k < 6; k++)
      if (got[k] != want[k])
        FAIL("railId/planeId %d,%d %d,%d %d,%d; expected %s", got[0], got[1], got[2], got[3],
             got[4], got[5], rails);
  }
  return d;
}

static void receiver(const char *path) {
  void *lib;
  open_plugin(path, &lib);
  do_init();
  int n;
  int vdev = pick_device(&n);
  int dev = vdev >= 0 ? vdev : 0;
  char handle[HANDLE];
  memset(handle, 0, sizeof handle);
  void *lc = do_listen(dev, handle);
  put(to_child[1], handle, HANDLE);
  void *rc = do_accept(lc);
  CHECK(((int (*)(void *))T->closeListen)(lc)); /* right after accept, as NCCL */

  unsigned char *buf;
  if (posix_memalign((void **)&buf, 4096, BUF)) FAIL("alloc");
  void *mh = reg(rc, buf, BUF);
  CHECK(((int (*)(void *, void *))T->deregMr)(rc, NULL));

  /* Every size, one receive each, *request preset to the 0x1 hint on every other one. */
  for (size_t k = 0; k < NSIZES; k++) {
    size_t want = SIZES[k];
    if (V == 8 && want > (1UL << 30)) continue;
    memset(buf, 0xee, want + 64);
    void *data[1] = {buf};
    size_t sz[1] = {want + 64};
    int tags[1] = {42};
    void *mhs[1] = {mh};
    void *req = irecv(rc, 1, data, sz, tags, mhs, k % 2);
    int got = -1;
    wait_req(req, &got);
    if ((size_t)got != want) FAIL("size %zu arrived as %d", want, got);
    verify(buf, want, (int)k, "single receive");
    for (int i = 0; i < 64; i++)
      if (buf[want + i] != 0xee) FAIL("byte past the message was written (%zu)", want);
    /* iflush after the receive, polled with NULL sizes. */
    void *freq = (void *)0xdead;
    int fsz[1] = {(int)want};
    CHECK(((int (*)(void *, int, void **, int *, void **, void **))T->iflush)(rc, 1, data, fsz,
                                                                              mhs, &freq));
    if (freq == (void *)0xdead) FAIL("iflush left request unwritten");
    if (expect_flush != (freq != NULL) && want > 0)
      FAIL("iflush of %zu bytes: %s", want, freq ? "flushed, flush disabled" : "no flush issued");
    if (freq) wait_req(freq, NULL);
  }

  /* GPU memory by type: regMr of NCCL_PTR_CUDA works exactly when ptrSupport has CUDA. */
  {
    void *cmh;
    int rc_ = try_reg(rc, buf, 4096, PTR_CUDA, &cmh);
    if ((rc_ == 0) != ((expect_ptr & PTR_CUDA) != 0))
      FAIL("regMr of NCCL_PTR_CUDA returned %d with ptrSupport %#x", rc_, expect_ptr);
    if (rc_ == 0) CHECK(((int (*)(void *, void *))T->deregMr)(rc, cmh));
  }

  /* DMA-BUF receives: into the device mapping, every byte checked through the CPU mapping. */
  if (expect_ptr & PTR_DMABUF) {
    gpubuf_t g = gpu_alloc();
    void *gmh = reg_dmabuf(rc, &g, PTR_DMABUF);
    static const size_t GSIZES[] = {1, 4097, 1 * MIB + 3, 4 * MIB};
    for (size_t k = 0; k < sizeof GSIZES / sizeof GSIZES[0]; k++) {
      size_t want = GSIZES[k], at = k * 8; /* unaligned starts too */
      memset(g.cpu, 0xee, DMABUF_BYTES);
      void *data[1] = {g.dev + at};
      size_t sz[1] = {want + 64};
      int tags[1] = {50};
      void *mhs[1] = {gmh};
      void *req = irecv(rc, 1, data, sz, tags, mhs, 0);
      int got = -1;
      wait_req(req, &got);
      if ((size_t)got != want) FAIL("dma-buf receive of %zu arrived as %d", want, got);
      void *freq = (void *)0xdead;
      int fsz[1] = {(int)want};
      CHECK(((int (*)(void *, int, void **, int *, void **, void **))T->iflush)(rc, 1, data, fsz,
                                                                                mhs, &freq));
      if (expect_flush != (freq != NULL)) FAIL("dma-buf iflush: flush %p", freq);
      if (freq) wait_req(freq, NULL);
      verify(g.cpu + at, want, 500 + (int)k, "dma-buf receive (CPU mapping)");
      for (int i = 0; i < 64; i++)
        if (g.cpu[at + want + i] != 0xee) FAIL("dma-buf byte past the message was written");
      if (at && g.cpu[at - 1] != 0xee) FAIL("dma-buf byte before the message was written");
    }
    CHECK(((int (*)(void *, void *))T->deregMr)(rc, gmh));
    gpu_free(&g);
  }

  /* Truncation: the sender sends 10000 bytes into a 5000-byte receive. */
  {
    void *data[1] = {buf};
    size_t sz[1] = {5000};
    int tags[1] = {43};
    void *mhs[1] = {mh};
    memset(buf, 0xee, 6000);
    void *req = irecv(rc, 1, data, sz, tags, mhs, 0);
    int got = -1;
    wait_req(req, &got);
    if (got != 5000) FAIL("truncated receive size %d", got);
    verify(buf, 5000, 99, "truncated receive");
    if (buf[5000] != 0xee) FAIL("truncation wrote past the receive");
  }

  /* Multi-receive n=8 with tags; the sender sends in another order. */
  {
    void *data[MAX_N], *mhs[MAX_N];
    size_t sz[MAX_N];
    int tags[MAX_N], got[MAX_N];
    for (int i = 0; i < MAX_N; i++)
      data[i] = buf + i * MIB, sz[i] = MIB, tags[i] = 200 + i, mhs[i] = mh;
    void *req = irecv(rc, MAX_N, data, sz, tags, mhs, 0);
    wait_req(req, got);
    for (int i = 0; i < MAX_N; i++) {
      size_t want = (size_t)i * 1000 + (i == 3 ? 0 : 17);
      if ((size_t)got[i] != want) FAIL("multi-receive %d size %d != %zu", i, got[i], want);
      verify(buf + i * MIB, want, 300 + i, "multi-receive");
    }
  }

  /* 32 receives posted at once; the sender spins 32 isends without testing. */
  {
    void *reqs[32];
    for (int i = 0; i < 32; i++) {
      void *data[1] = {buf + i * 65536};
      size_t sz[1] = {65536};
      int tags[1] = {7};
      void *mhs[1] = {mh};
      reqs[i] = irecv(rc, 1, data, sz, tags, mhs, 0);
    }
    for (int i = 0; i < 32; i++) {
      int got = -1;
      wait_req(reqs[i], &got);
      if (got != 60000 + i) FAIL("in-flight receive %d size %d", i, got);
      verify(buf + i * 65536, got, 400 + i, "in-flight receive");
    }
  }

  /* Close with requests in flight: one receive the sender matches but nobody tests. */
  {
    void *data[1] = {buf};
    size_t sz[1] = {100};
    int tags[1] = {77};
    void *mhs[1] = {mh};
    irecv(rc, 1, data, sz, tags, mhs, 0);
    char c;
    get(to_parent[0], &c, 1); /* the sender's isend matched */
  }
  CHECK(((int (*)(void *, void *))T->deregMr)(rc, mh));
  CHECK(((int (*)(void *))T->closeRecv)(rc));
  finish(lib);
  free(buf);

  /* A second load from scratch, as NCCL after the last communicator went away. */
  open_plugin(path, &lib);
  do_init();
  if (ndevices() < 2) FAIL("devices after re-dlopen");
  props(0);
  finish(lib);
}

static void sender(const char *path) {
  role = "send";
  void *lib;
  open_plugin(path, &lib);
  do_init();
  int n;
  int vdev = pick_device(&n);
  int dev = vdev >= 0 ? vdev : 1;
  char handle[HANDLE];
  get(to_child[0], handle, HANDLE);
  void *sc = do_connect(dev, handle);

  unsigned char *buf;
  if (posix_memalign((void **)&buf, 4096, BUF)) FAIL("alloc");
  void *mh = reg(sc, buf, BUF);

  for (size_t k = 0; k < NSIZES; k++) {
    size_t size = SIZES[k];
    if (V == 8 && size > (1UL << 30)) continue;
    fill(buf, size, (int)k);
    void *req = isend(sc, buf, size, 42, mh);
    int got = -1;
    wait_req(req, k % 3 == 0 ? NULL : &got);
    if (k % 3 != 0 && (size_t)got != size) FAIL("send size %d != %zu", got, size);
  }

  if (expect_ptr & PTR_DMABUF) {
    /* Sent from a dma-buf: filled through the CPU mapping, sent from the device mapping. */
    gpubuf_t g = gpu_alloc();
    void *gmh = reg_dmabuf(sc, &g, PTR_CUDA);
    static const size_t GSIZES[] = {1, 4097, 1 * MIB + 3, 4 * MIB};
    for (size_t k = 0; k < sizeof GSIZES / sizeof GSIZES[0]; k++) {
      size_t off = 4096 + k * 3;
      fill(g.cpu + off, GSIZES[k], 500 + (int)k);
      int got = -1;
      wait_req(isend(sc, g.dev + off, GSIZES[k], 50, gmh), &got);
      if ((size_t)got != GSIZES[k]) FAIL("dma-buf send size %d", got);
    }
    CHECK(((int (*)(void *, void *))T->deregMr)(sc, gmh));
    gpu_free(&g);
  }

  fill(buf, 10000, 99);
  {
    void *req = isend(sc, buf, 10000, 43, mh);
    int got = -1;
    wait_req(req, &got);
    if (got != 5000) FAIL("truncated send reported %d", got);
  }

  {
    static const int order[MAX_N] = {5, 0, 7, 3, 1, 6, 2, 4};
    void *reqs[MAX_N];
    for (int j = 0; j < MAX_N; j++) {
      int i = order[j];
      size_t size = (size_t)i * 1000 + (i == 3 ? 0 : 17);
      fill(buf + 2 * MIB * (size_t)(j + 1), size, 300 + i);
      reqs[j] = isend(sc, buf + 2 * MIB * (size_t)(j + 1), size, 200 + i, mh);
    }
    for (int j = 0; j < MAX_N; j++) wait_req(reqs[j], NULL);
  }

  {
    void *reqs[32];
    for (int i = 0; i < 32; i++) {
      fill(buf + (size_t)i * 70000, 60000 + i, 400 + i);
      reqs[i] = isend(sc, buf + (size_t)i * 70000, 60000 + i, 7, mh);
    }
    for (int i = 0; i < 32; i++) {
      int got = -1;
      wait_req(reqs[i], &got);
      if (got != 60000 + i) FAIL("in-flight send %d size %d", i, got);
    }
  }

  isend(sc, buf, 100, 77, mh); /* left in flight */
  put(to_parent[1], "x", 1);
  CHECK(((int (*)(void *, void *))T->deregMr)(sc, mh));
  CHECK(((int (*)(void *))T->closeSend)(sc));
  finish(lib);
  free(buf);

  open_plugin(path, &lib);
  do_init();
  if (ndevices() < 2) FAIL("devices after re-dlopen");
  finish(lib);
}

/* ---- inflight-close: aws-ofi-nccl's inflight_close, unsynchronised ----
 * CLOSE_ROUNDS times over a fresh connection: the receiver posts MAX_N receives of CLOSE_BYTES,
 * deregisters their memory and closes at once, without a word to the sender (what NCCL core
 * does when one side of a communicator is aborted or destroyed first). The sender then sends
 * MAX_N messages: every isend must succeed and return a request — the clear-to-send entries
 * of receives posted before the close were written then, as a NIC writes them — and the sender
 * deregisters and closes with those requests in flight. Whether the writes into a closed peer
 * fail or not is never asked, as NCCL never asks after a close. */
#define CLOSE_ROUNDS 10
#define CLOSE_BYTES MIB

static void close_receiver(const char *path) {
  void *lib;
  open_plugin(path, &lib);
  do_init();
  int n;
  int vdev = pick_device(&n);
  int dev = vdev >= 0 ? vdev : 0;
  unsigned char *bufs[MAX_N];
  for (int i = 0; i < MAX_N; i++)
    if (posix_memalign((void **)&bufs[i], 4096, CLOSE_BYTES)) FAIL("alloc");
  for (int round = 0; round < CLOSE_ROUNDS; round++) {
    char handle[HANDLE];
    memset(handle, 0, sizeof handle);
    void *lc = do_listen(dev, handle);
    put(to_child[1], handle, HANDLE);
    void *rc = do_accept(lc);
    void *mhs[MAX_N];
    for (int i = 0; i < MAX_N; i++) {
      mhs[i] = reg(rc, bufs[i], CLOSE_BYTES);
      void *data[1] = {bufs[i]};
      size_t sz[1] = {CLOSE_BYTES};
      int tags[1] = {1};
      irecv(rc, 1, data, sz, tags, &mhs[i], 0);
    }
    for (int i = 0; i < MAX_N; i++) CHECK(((int (*)(void *, void *))T->deregMr)(rc, mhs[i]));
    CHECK(((int (*)(void *))T->closeRecv)(rc));
    CHECK(((int (*)(void *))T->closeListen)(lc));
  }
  finish(lib);
  for (int i = 0; i < MAX_N; i++) free(bufs[i]);
}

static void close_sender(const char *path) {
  role = "send";
  void *lib;
  open_plugin(path, &lib);
  do_init();
  int n;
  int vdev = pick_device(&n);
  int dev = vdev >= 0 ? vdev : 1;
  unsigned char *bufs[MAX_N];
  for (int i = 0; i < MAX_N; i++) {
    if (posix_memalign((void **)&bufs[i], 4096, CLOSE_BYTES)) FAIL("alloc");
    fill(bufs[i], CLOSE_BYTES, i);
  }
  for (int round = 0; round < CLOSE_ROUNDS; round++) {
    char handle[HANDLE];
    get(to_child[0], handle, HANDLE);
    void *sc = do_connect(dev, handle);
    void *mhs[MAX_N];
    for (int i = 0; i < MAX_N; i++) {
      mhs[i] = reg(sc, bufs[i], CLOSE_BYTES);
      time_t start = time(NULL);
      while (!try_isend(sc, bufs[i], CLOSE_BYTES, 1, mhs[i])) {
        if (time(NULL) - start > 30)
          FAIL("round %d: isend %d never got a request (the receive was posted before the "
               "close: its clear-to-send was lost or withheld)",
               round, i);
        spin();
      }
    }
    for (int i = 0; i < MAX_N; i++) CHECK(((int (*)(void *, void *))T->deregMr)(sc, mhs[i]));
    CHECK(((int (*)(void *))T->closeSend)(sc));
  }
  finish(lib);
  for (int i = 0; i < MAX_N; i++) free(bufs[i]);
}

/* With no usable fabric (NCCL_WASM_FABRIC=auto on a host without an active RDMA port), init
 * must fail cleanly so NCCL falls back to its own transports, and the library must unload. */
static void expect_init_failure(const char *path) {
  void *lib;
  open_plugin(path, &lib);
  int rc;
  if (V <= 9) rc = ((int (*)(logger_t))T->init)(logger);
  else if (V == 10) rc = ((int (*)(logger_t, void *))T->init)(logger, NULL);
  else {
    cfg_t cfg = {-1};
    ctx = (void *)0xdead;
    rc = ((int (*)(void **, uint64_t, cfg_t *, logger_t, void *))T->init)(&ctx, 1, &cfg, logger,
                                                                          NULL);
    if (ctx == (void *)0xdead) FAIL("init left ctx unwritten");
  }
  if (rc == 0) FAIL("init succeeded without a usable fabric");
  if (dlclose(lib) != 0) FAIL("dlclose: %s", dlerror());
}

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr,
            "usage: %s <plugin.so> <version 8..12> [expect-init-failure | inflight-close]\n",
            argv[0]);
    return 2;
  }
  int closing = argc == 4 && strcmp(argv[3], "inflight-close") == 0;
  V = atoi(argv[2]);
  if (V < 8 || V > 12) return 2;
  if (getenv("HARNESS_PTR")) expect_ptr = atoi(getenv("HARNESS_PTR"));
  if (getenv("HARNESS_FLUSH")) expect_flush = atoi(getenv("HARNESS_FLUSH"));
  if (argc == 4 && !closing) {
    expect_init_failure(argv[1]);
    printf("harness v%d: OK (init refused)\n", V);
    return 0;
  }
  if (pipe(to_child) || pipe(to_parent)) FAIL("pipe");
  pid_t pid = fork();
  if (pid < 0) FAIL("fork");
  alarm(300); /* in both processes: alarms are not inherited */
  if (pid == 0) {
    /* Only the other side holds the write ends, so a peer's death is EOF, not a hang. */
    close(to_child[1]);
    close(to_parent[0]);
    threads_before = threads();
    if (closing)
      close_sender(argv[1]);
    else
      sender(argv[1]);
    _exit(0);
  }
  close(to_child[0]);
  close(to_parent[1]);
  threads_before = threads();
  if (closing)
    close_receiver(argv[1]);
  else
    receiver(argv[1]);
  int status;
  if (waitpid(pid, &status, 0) != pid) FAIL("waitpid");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) FAIL("the sender failed (%d)", status);
  printf("harness v%d: OK%s\n", V, closing ? " (inflight-close)" : "");
  return 0;
}
