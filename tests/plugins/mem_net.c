/* A minimal NCCL net plugin exporting only ncclNetPlugin_v12, with no network at all: a send
 * comm and the recv comm accepted for it live in one process and share a channel, and isend
 * copies the message into the oldest posted receive with memcpy. It exists so
 * `ncclwasm bench --single-process` has a second plugin to drive (built from source by
 * host/cli/tests/bench.rs), and its figures are the floor of that bench: what the loader, the
 * loop and a plugin that does nothing but copy cost per matched pair.
 *
 * The layouts are the ones host/abi/src/layout.rs mirrors (sizes asserted below). What it
 * implements of NCCL's contract: one device, host memory only, one buffer per irecv
 * (maxRecvs 1), tags matched in order (a send whose tag differs from the oldest receive's is
 * ncclInvalidUsage, as net_ib fails it), isend answers "not yet" (a NULL request) while no
 * receive is posted, and no allocation per message (fixed request pools). A handle from another
 * process cannot be connected to (ncclSystemError). Calls come from one thread at a time, as
 * from NCCL's proxy; the listener table is locked because NCCL may connect from another. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { SUCCESS = 0, SYSTEM_ERROR = 2, INTERNAL_ERROR = 3, INVALID_ARGUMENT = 4,
       INVALID_USAGE = 5 };
enum { PTR_HOST = 1, REQS = 32, LISTENERS = 64, BACKLOG = 16, UNDEF = -1 };

typedef struct {
  int ndevs;
  int devs[8];
} vprops_t;

typedef struct {
  const char *name, *pciPath;
  uint64_t guid;
  int ptrSupport, regIsGlobal, forceFlush, speed, port;
  float latency;
  int maxComms, maxRecvs, netDeviceType, netDeviceVersion;
  vprops_t vProps;
  size_t maxP2pBytes, maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId, planeId;
} props_t;

_Static_assert(sizeof(props_t) == 128, "ncclNetProperties_v12_t is 128 bytes");
_Static_assert(offsetof(props_t, vProps) == 64, "vProps at 64");
_Static_assert(offsetof(props_t, maxP2pBytes) == 104, "maxP2pBytes at 104");
_Static_assert(offsetof(props_t, railId) == 124, "railId at 124");

/* One request: a posted receive or a send, done once copied. */
typedef struct {
  int used, done, size;
  int is_recv, tag;
  void *data;
  size_t capacity;
} req_t;

/* What a send comm and its recv comm share: the request pool and the receives in post order. */
typedef struct {
  req_t reqs[REQS];
  int order[REQS]; /* receives waiting for a send, oldest at head */
  int head, count;
  int closed; /* ends closed so far; the second frees the channel */
} channel_t;

/* The listen handle: whose process, which listener. */
typedef struct {
  uint64_t magic;
  int32_t pid, listener;
} handle_t;

#define MAGIC 0x6d656d6e65743132ull /* "memnet12" */

typedef struct {
  int used;
  channel_t *pending[BACKLOG]; /* connected, not yet accepted */
  int npending;
} listener_t;

static listener_t listeners[LISTENERS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static req_t *new_req(channel_t *c) {
  for (int i = 0; i < REQS; i++)
    if (!c->reqs[i].used) {
      memset(&c->reqs[i], 0, sizeof c->reqs[i]);
      c->reqs[i].used = 1;
      return &c->reqs[i];
    }
  return NULL;
}

static int init(void **ctx, uint64_t commId, void *config, void *logger, void *profiler) {
  (void)commId, (void)config, (void)logger, (void)profiler;
  *ctx = (void *)&listeners; /* any non-NULL context: this plugin keeps no per-communicator state */
  return SUCCESS;
}

static int devices(int *n) {
  *n = 1;
  return SUCCESS;
}

static int get_properties(int dev, props_t *p) {
  if (dev != 0) return INVALID_ARGUMENT;
  memset(p, 0, sizeof *p);
  p->name = "mem_0";
  p->pciPath = NULL;
  p->guid = 0x6d656d;
  p->ptrSupport = PTR_HOST;
  p->speed = 100000;
  p->port = 1;
  p->maxComms = LISTENERS;
  p->maxRecvs = 1;
  p->vProps.ndevs = 1;
  p->vProps.devs[0] = 0;
  p->maxP2pBytes = p->maxCollBytes = (size_t)1 << 31;
  p->maxMultiRequestSize = 1;
  p->railId = p->planeId = UNDEF;
  return SUCCESS;
}

static int listen_(void *ctx, int dev, void *handle, void **listenComm) {
  (void)ctx;
  *listenComm = NULL;
  if (dev != 0) return INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  int i = 0;
  while (i < LISTENERS && listeners[i].used) i++;
  if (i < LISTENERS) memset(&listeners[i], 0, sizeof listeners[i]), listeners[i].used = 1;
  pthread_mutex_unlock(&lock);
  if (i == LISTENERS) return SYSTEM_ERROR;
  handle_t h = {MAGIC, getpid(), i};
  memset(handle, 0, 128);
  memcpy(handle, &h, sizeof h);
  *listenComm = &listeners[i];
  return SUCCESS;
}

static int connect_(void *ctx, int dev, void *handle, void **sendComm, void **sendDevComm) {
  (void)ctx;
  *sendComm = NULL;
  if (sendDevComm) *sendDevComm = NULL;
  handle_t h;
  memcpy(&h, handle, sizeof h);
  if (dev != 0 || h.magic != MAGIC || h.listener < 0 || h.listener >= LISTENERS)
    return INVALID_ARGUMENT;
  if (h.pid != getpid()) return SYSTEM_ERROR; /* no network: one process only */
  channel_t *c = calloc(1, sizeof *c);
  if (!c) return SYSTEM_ERROR;
  pthread_mutex_lock(&lock);
  listener_t *l = &listeners[h.listener];
  int ok = l->used && l->npending < BACKLOG;
  if (ok) l->pending[l->npending++] = c;
  pthread_mutex_unlock(&lock);
  if (!ok) {
    free(c);
    return INVALID_USAGE;
  }
  *sendComm = c;
  return SUCCESS;
}

static int accept_(void *listenComm, void **recvComm, void **recvDevComm) {
  listener_t *l = listenComm;
  *recvComm = NULL;
  if (recvDevComm) *recvDevComm = NULL;
  pthread_mutex_lock(&lock);
  if (l->npending > 0) {
    channel_t *c = l->pending[0];
    memmove(l->pending, l->pending + 1, --l->npending * sizeof l->pending[0]);
    /* The channel plus one byte: the two ends' comms differ, as NCCL expects. */
    *recvComm = (char *)c + 1;
  }
  pthread_mutex_unlock(&lock);
  return SUCCESS;
}

static channel_t *recv_channel(void *recvComm) { return (channel_t *)((char *)recvComm - 1); }

static int reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  (void)data, (void)size;
  *mhandle = NULL;
  if (type != PTR_HOST) return INTERNAL_ERROR;
  *mhandle = comm; /* nothing to register: any non-NULL handle */
  return SUCCESS;
}

static int reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                         void **mhandle) {
  (void)comm, (void)data, (void)size, (void)type, (void)offset, (void)fd;
  *mhandle = NULL;
  return INTERNAL_ERROR; /* ptrSupport is host memory only */
}

static int dereg_mr(void *comm, void *mhandle) {
  (void)comm, (void)mhandle;
  return SUCCESS;
}

static int isend(void *sendComm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                 void **request) {
  (void)mhandle, (void)phandle;
  channel_t *c = sendComm;
  *request = NULL;
  if (c->count == 0) return SUCCESS; /* no receive posted yet: call again */
  req_t *r = &c->reqs[c->order[c->head]];
  if (r->tag != tag) return INVALID_USAGE;
  if (size > r->capacity) return INVALID_USAGE; /* NCCL never sends more than was posted */
  req_t *s = new_req(c);
  if (!s) return SUCCESS; /* every request in use: call again once some are tested */
  memcpy(r->data, data, size);
  r->size = s->size = (int)size;
  r->done = s->done = 1;
  c->head = (c->head + 1) % REQS;
  c->count--;
  *request = s;
  return SUCCESS;
}

static int irecv(void *recvComm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                 void **phandles, void **request) {
  (void)mhandles, (void)phandles;
  channel_t *c = recv_channel(recvComm);
  *request = NULL;
  if (n != 1) return INVALID_ARGUMENT; /* maxRecvs is 1 */
  if (c->count == REQS) return SUCCESS;
  req_t *r = new_req(c);
  if (!r) return SUCCESS;
  r->is_recv = 1;
  r->tag = tags[0];
  r->data = data[0];
  r->capacity = sizes[0];
  c->order[(c->head + c->count) % REQS] = (int)(r - c->reqs);
  c->count++;
  *request = r;
  return SUCCESS;
}

static int iflush(void *recvComm, int n, void **data, int *sizes, void **mhandles,
                  void **request) {
  (void)recvComm, (void)n, (void)data, (void)sizes, (void)mhandles;
  *request = NULL; /* host memory: nothing to flush */
  return SUCCESS;
}

static int test(void *request, int *done, int *sizes) {
  req_t *r = request;
  *done = r->done;
  if (r->done) {
    if (sizes) *sizes = r->size;
    r->used = 0;
  }
  return SUCCESS;
}

/* Either end: the channel is freed by whichever closes last. */
static int close_end(channel_t *c) {
  pthread_mutex_lock(&lock);
  int last = ++c->closed == 2;
  pthread_mutex_unlock(&lock);
  if (last) free(c);
  return SUCCESS;
}

static int close_send(void *sendComm) { return close_end(sendComm); }

static int close_recv(void *recvComm) { return close_end(recv_channel(recvComm)); }

static int close_listen(void *listenComm) {
  listener_t *l = listenComm;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < l->npending; i++) free(l->pending[i]);
  memset(l, 0, sizeof *l);
  pthread_mutex_unlock(&lock);
  return SUCCESS;
}

static int make_vdevice(int *d, vprops_t *props) {
  (void)props;
  *d = -1;
  return INVALID_USAGE; /* one device, nothing to fuse */
}

static int finalize(void *ctx) {
  (void)ctx;
  return SUCCESS;
}

static int set_net_attr(void *ctx, void *attr) {
  (void)ctx, (void)attr;
  return SUCCESS;
}

typedef struct {
  const char *name;
  void *init, *devices, *getProperties, *listen, *connect, *accept, *regMr, *regMrDmaBuf,
      *deregMr, *isend, *irecv, *iflush, *test, *closeSend, *closeRecv, *closeListen,
      *getDeviceMr, *irecvConsumed, *makeVDevice, *finalize, *setNetAttr;
} net_v12_t;

_Static_assert(sizeof(net_v12_t) == 176, "ncclNet_v12_t is 176 bytes");

__attribute__((visibility("default"))) const net_v12_t ncclNetPlugin_v12 = {
    "MEM",        init,        devices,    get_properties, listen_, connect_, accept_, reg_mr,
    reg_mr_dmabuf, dereg_mr,   isend,      irecv,          iflush,  test,     close_send,
    close_recv,   close_listen, NULL,      NULL,           make_vdevice, finalize, set_net_attr,
};
