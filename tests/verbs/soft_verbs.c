/* A plain verbs program on the soft fabric: only libibverbs' public API, no ECE, no knowledge
 * of the plugin. Built against the system's <infiniband/verbs.h> and linked with -libverbs;
 * run with the soft provider standing in for libibverbs.so.1 (tests/verbs/driver.rs), so any
 * verbs program can use the soft fabric in its CI the way it would use a NIC.
 *
 *   1. a QP connected to itself (as NCCL connects its GPU-flush QP) reads its own memory with
 *      RDMA READ;
 *   2. the same QP does atomics on its own memory: FETCH_AND_ADD, then CMP_AND_SWP whose
 *      compare fails and one whose compare holds, each bringing back the original value, on a
 *      device that reports IBV_ATOMIC_HCA;
 *   3. two QPs on two devices, brought up with random PSNs exchanged "out of band" (here: in
 *      variables) and no ECE, do RDMA WRITE_WITH_IMM one way and SEND/RECV the other.
 * Every byte is checked. Exit status 0 and one OK line per part, else FAIL and status 1. The
 * sockets the process holds after the transfers are printed: over TCP each QP direction that
 * carried work has a connection, with NCCL_WASM_SOFT_DELIVERY=in-process none does. */
#include <arpa/inet.h>
#include <dirent.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAIL(...)                                                    \
  do {                                                               \
    fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);             \
    fprintf(stderr, __VA_ARGS__);                                    \
    fprintf(stderr, "\n");                                           \
    exit(1);                                                         \
  } while (0)

#define CHECK(cond, ...) \
  do {                   \
    if (!(cond)) FAIL(__VA_ARGS__); \
  } while (0)

enum { PORT = 1, GID_INDEX = 1, LEN = 65536 };

struct end {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  struct ibv_qp *qp;
  union ibv_gid gid;
};

static void open_end(struct ibv_device *dev, struct end *e) {
  e->ctx = ibv_open_device(dev);
  CHECK(e->ctx, "ibv_open_device(%s)", ibv_get_device_name(dev));
  e->pd = ibv_alloc_pd(e->ctx);
  e->cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0);
  CHECK(e->pd && e->cq, "pd/cq");
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof ia);
  ia.send_cq = e->cq;
  ia.recv_cq = e->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 16;
  ia.cap.max_recv_wr = 16;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  e->qp = ibv_create_qp(e->pd, &ia);
  CHECK(e->qp, "ibv_create_qp");
  CHECK(ibv_query_gid(e->ctx, PORT, GID_INDEX, &e->gid) == 0, "ibv_query_gid");
}

static void close_end(struct end *e) {
  CHECK(ibv_destroy_qp(e->qp) == 0, "ibv_destroy_qp");
  CHECK(ibv_destroy_cq(e->cq) == 0, "ibv_destroy_cq");
  CHECK(ibv_dealloc_pd(e->pd) == 0, "ibv_dealloc_pd");
  CHECK(ibv_close_device(e->ctx) == 0, "ibv_close_device");
}

/* RESET -> INIT -> RTR (towards `peer`, expecting its packets from `rq_psn`) -> RTS (sending
 * from `sq_psn`): what every RC program does after its out-of-band exchange. */
static void connect_qp(struct end *e, const struct end *peer, uint32_t rq_psn, uint32_t sq_psn) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_INIT;
  a.port_num = PORT;
  a.qp_access_flags =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  CHECK(ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0,
        "INIT");
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer->qp->qp_num;
  a.rq_psn = rq_psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = peer->gid;
  a.ah_attr.grh.sgid_index = GID_INDEX;
  a.ah_attr.grh.hop_limit = 255;
  a.ah_attr.port_num = PORT;
  CHECK(ibv_modify_qp(e->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
        "RTR");
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = sq_psn;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  CHECK(ibv_modify_qp(e->qp, &a,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                          IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
        "RTS");
}

/* Polls one completion (10 s at most) and checks its id and status. */
static struct ibv_wc poll_one(struct end *e, uint64_t wr_id) {
  struct ibv_wc wc;
  time_t deadline = time(NULL) + 10;
  int n;
  while ((n = ibv_poll_cq(e->cq, 1, &wc)) == 0) CHECK(time(NULL) < deadline, "no completion for wr %llu", (unsigned long long)wr_id);
  CHECK(n == 1, "ibv_poll_cq: %d", n);
  CHECK(wc.status == IBV_WC_SUCCESS, "wr %llu: status %d", (unsigned long long)wc.wr_id, (int)wc.status);
  CHECK(wc.wr_id == wr_id, "completion of wr %llu, expected %llu", (unsigned long long)wc.wr_id,
        (unsigned long long)wr_id);
  return wc;
}

static void post_send(struct end *e, uint64_t id, enum ibv_wr_opcode op, struct ibv_mr *mr, void *buf,
                      uint32_t len, uint64_t raddr, uint32_t rkey, uint32_t imm) {
  struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = imm;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  CHECK(ibv_post_send(e->qp, &wr, &bad) == 0, "ibv_post_send(wr %llu)", (unsigned long long)id);
}

static void post_recv(struct end *e, uint64_t id, struct ibv_mr *mr, void *buf, uint32_t len) {
  struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = mr ? mr->lkey : 0};
  struct ibv_recv_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = id;
  wr.sg_list = mr ? &sge : NULL;
  wr.num_sge = mr ? 1 : 0;
  CHECK(ibv_post_recv(e->qp, &wr, &bad) == 0, "ibv_post_recv(wr %llu)", (unsigned long long)id);
}

/* How many of this process's file descriptors are sockets. */
static int sockets(void) {
  DIR *d = opendir("/proc/self/fd");
  CHECK(d, "opendir /proc/self/fd");
  int n = 0;
  struct dirent *e;
  char path[300], target[64];
  while ((e = readdir(d)) != NULL) {
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t len = readlink(path, target, sizeof target - 1);
    if (len > 0 && strncmp(target, "socket:", 7) == 0) n++;
  }
  closedir(d);
  return n;
}

static void fill(unsigned char *b, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 131 + seed);
}

/* 1. A QP connected to itself reads its own memory. */
static void self_read(struct ibv_device *dev) {
  struct end e;
  open_end(dev, &e);
  uint32_t qpn = e.qp->qp_num;
  uint32_t psn = (uint32_t)rand() & 0xffffff;
  connect_qp(&e, &e, psn, psn);
  unsigned char *src = malloc(LEN), *dst = calloc(1, LEN);
  fill(src, LEN, 7);
  struct ibv_mr *smr = ibv_reg_mr(e.pd, src, LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  struct ibv_mr *dmr = ibv_reg_mr(e.pd, dst, LEN, IBV_ACCESS_LOCAL_WRITE);
  CHECK(smr && dmr, "ibv_reg_mr");
  post_send(&e, 1, IBV_WR_RDMA_READ, dmr, dst, LEN, (uintptr_t)src, smr->rkey, 0);
  poll_one(&e, 1);
  CHECK(memcmp(src, dst, LEN) == 0, "the READ brought other bytes");
  CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0, "ibv_dereg_mr");
  free(src);
  free(dst);
  close_end(&e);
  printf("OK self-connected QP %u: RDMA READ of %d bytes, every byte checked\n", qpn, LEN);
}

/* One signaled atomic on the word at `raddr`, its original value landing in `*result`; checks the
 * completion's opcode and length and returns that value. */
static uint64_t atomic(struct end *e, uint64_t id, enum ibv_wr_opcode op, struct ibv_mr *mr, uint64_t *result,
                       uint64_t raddr, uint32_t rkey, uint64_t compare_add, uint64_t swap) {
  struct ibv_sge sge = {.addr = (uintptr_t)result, .length = 8, .lkey = mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.atomic.remote_addr = raddr;
  wr.wr.atomic.compare_add = compare_add;
  wr.wr.atomic.swap = swap;
  wr.wr.atomic.rkey = rkey;
  CHECK(ibv_post_send(e->qp, &wr, &bad) == 0, "ibv_post_send(atomic %llu)", (unsigned long long)id);
  struct ibv_wc wc = poll_one(e, id);
  enum ibv_wc_opcode want = op == IBV_WR_ATOMIC_FETCH_AND_ADD ? IBV_WC_FETCH_ADD : IBV_WC_COMP_SWAP;
  CHECK(wc.opcode == want && wc.byte_len == 8, "atomic %llu: opcode %d, %u bytes", (unsigned long long)id,
        (int)wc.opcode, wc.byte_len);
  return *(volatile uint64_t *)result;
}

/* 2. A QP connected to itself does atomics on its own memory. */
static void self_atomics(struct ibv_device *dev) {
  struct end e;
  open_end(dev, &e);
  struct ibv_device_attr da;
  CHECK(ibv_query_device(e.ctx, &da) == 0, "ibv_query_device");
  CHECK(da.atomic_cap == IBV_ATOMIC_HCA, "atomic_cap %d, want IBV_ATOMIC_HCA", (int)da.atomic_cap);
  uint32_t psn = (uint32_t)rand() & 0xffffff;
  connect_qp(&e, &e, psn, psn);
  uint64_t *word = calloc(1, 8), *result = calloc(1, 8);
  *word = 37;
  struct ibv_mr *wmr = ibv_reg_mr(e.pd, word, 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
  struct ibv_mr *rmr = ibv_reg_mr(e.pd, result, 8, IBV_ACCESS_LOCAL_WRITE);
  CHECK(wmr && rmr, "ibv_reg_mr");
  uint64_t got = atomic(&e, 1, IBV_WR_ATOMIC_FETCH_AND_ADD, rmr, result, (uintptr_t)word, wmr->rkey, 5, 0);
  CHECK(got == 37 && *word == 42, "FETCH_AND_ADD 5 on 37: returned %llu, word %llu", (unsigned long long)got,
        (unsigned long long)*word);
  got = atomic(&e, 2, IBV_WR_ATOMIC_CMP_AND_SWP, rmr, result, (uintptr_t)word, wmr->rkey, 41, 7);
  CHECK(got == 42 && *word == 42, "CMP_AND_SWP 41->7 on 42: returned %llu, word %llu", (unsigned long long)got,
        (unsigned long long)*word);
  got = atomic(&e, 3, IBV_WR_ATOMIC_CMP_AND_SWP, rmr, result, (uintptr_t)word, wmr->rkey, 42, 7);
  CHECK(got == 42 && *word == 7, "CMP_AND_SWP 42->7 on 42: returned %llu, word %llu", (unsigned long long)got,
        (unsigned long long)*word);
  CHECK(ibv_dereg_mr(wmr) == 0 && ibv_dereg_mr(rmr) == 0, "ibv_dereg_mr");
  free(word);
  free(result);
  printf("OK self-connected QP %u: FETCH_AND_ADD and CMP_AND_SWP (failed and held compare), atomic_cap HCA\n",
         e.qp->qp_num);
  close_end(&e);
}

/* 3. Two QPs, no ECE: WRITE_WITH_IMM a -> b, SEND b -> a. */
static void two_qps(struct ibv_device *da, struct ibv_device *db) {
  struct end a, b;
  open_end(da, &a);
  open_end(db, &b);
  /* The out-of-band exchange: each side's QPN, GID and starting PSN. */
  uint32_t a_psn = (uint32_t)rand() & 0xffffff, b_psn = (uint32_t)rand() & 0xffffff;
  connect_qp(&a, &b, b_psn, a_psn);
  connect_qp(&b, &a, a_psn, b_psn);

  unsigned char *src = malloc(LEN), *dst = calloc(1, LEN);
  fill(src, LEN, 3);
  struct ibv_mr *smr = ibv_reg_mr(a.pd, src, LEN, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = ibv_reg_mr(b.pd, dst, LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(smr && dmr, "ibv_reg_mr");
  post_recv(&b, 10, NULL, NULL, 0);
  post_send(&a, 11, IBV_WR_RDMA_WRITE_WITH_IMM, smr, src, LEN, (uintptr_t)dst, dmr->rkey, htonl(0xfeed));
  poll_one(&a, 11);
  struct ibv_wc wc = poll_one(&b, 10);
  CHECK(wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == 0xfeed,
        "the WRITE_WITH_IMM's completion: opcode %d, imm %x", wc.opcode, ntohl(wc.imm_data));
  CHECK(wc.byte_len == LEN, "byte_len %u", wc.byte_len);
  CHECK(memcmp(src, dst, LEN) == 0, "the WRITE placed other bytes");

  unsigned char *msg = malloc(4000), *got = calloc(1, 4000);
  fill(msg, 4000, 9);
  struct ibv_mr *mmr = ibv_reg_mr(b.pd, msg, 4000, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *gmr = ibv_reg_mr(a.pd, got, 4000, IBV_ACCESS_LOCAL_WRITE);
  CHECK(mmr && gmr, "ibv_reg_mr");
  post_recv(&a, 20, gmr, got, 4000);
  post_send(&b, 21, IBV_WR_SEND, mmr, msg, 4000, 0, 0, 0);
  poll_one(&b, 21);
  wc = poll_one(&a, 20);
  CHECK(wc.opcode == IBV_WC_RECV && wc.byte_len == 4000, "the SEND's completion: opcode %d, %u bytes", wc.opcode,
        wc.byte_len);
  CHECK(memcmp(msg, got, 4000) == 0, "the SEND delivered other bytes");
  printf("sockets: %d\n", sockets());

  CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0 && ibv_dereg_mr(mmr) == 0 && ibv_dereg_mr(gmr) == 0,
        "ibv_dereg_mr");
  free(src);
  free(dst);
  free(msg);
  free(got);
  printf("OK QPs %u and %u, no ECE, PSNs %06x/%06x: WRITE_WITH_IMM of %d bytes and SEND of 4000, every byte checked\n",
         a.qp->qp_num, b.qp->qp_num, a_psn, b_psn, LEN);
  close_end(&a);
  close_end(&b);
}

int main(void) {
  srand((unsigned)time(NULL));
  int n = 0;
  struct ibv_device **devs = ibv_get_device_list(&n);
  CHECK(devs && n >= 2, "ibv_get_device_list: %d device(s), want 2", n);
  printf("devices: %s, %s\n", ibv_get_device_name(devs[0]), ibv_get_device_name(devs[1]));
  self_read(devs[0]);
  self_atomics(devs[0]);
  two_qps(devs[0], devs[1]);
  ibv_free_device_list(devs);
  return 0;
}
