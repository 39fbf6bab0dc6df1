/* Shared helpers of the verbs conformance probes (tests/c_programs.rs runs them):
 * only <infiniband/verbs.h>, as a user's program. Every check exits non-zero
 * with a message on a mismatch. */
#ifndef PROBE_COMMON_H
#define PROBE_COMMON_H
#include <infiniband/verbs.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(c)                                                                   \
	do {                                                                       \
		if (!(c)) {                                                        \
			fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__,     \
				__LINE__, #c);                                     \
			exit(1);                                                   \
		}                                                                  \
	} while (0)
#define CHECK_EQ(a, b)                                                             \
	do {                                                                       \
		long long _a = (long long)(a), _b = (long long)(b);                \
		if (_a != _b) {                                                    \
			fprintf(stderr, "%s:%d: %s == %lld, expected %s == %lld\n", \
				__FILE__, __LINE__, #a, _a, #b, _b);               \
			exit(1);                                                   \
		}                                                                  \
	} while (0)

static inline double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* NP-RDMA mode: only for its documented limitations (README). */
static inline int np_mode(void)
{
	const char *m = getenv("NPRDMA_MODE");
	return m && (!strcmp(m, "nprdma") || !strcmp(m, "np") || !strcmp(m, "np-rdma"));
}

struct env {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	union ibv_gid gid;
};

static inline void env_open(struct env *e)
{
	int n = 0;
	struct ibv_device **l = ibv_get_device_list(&n);
	CHECK(l && n >= 1);
	e->ctx = ibv_open_device(l[0]);
	CHECK(e->ctx);
	ibv_free_device_list(l);
	e->pd = ibv_alloc_pd(e->ctx);
	CHECK(e->pd);
	CHECK_EQ(ibv_query_gid(e->ctx, 1, 0, &e->gid), 0);
}

/* An RC QP with these caps, or NULL (errno set) if the library refuses it. */
static inline struct ibv_qp *try_qp_caps(struct env *e, struct ibv_cq *scq,
					 struct ibv_cq *rcq, uint32_t wr,
					 uint32_t sge, uint32_t inl, int sig_all)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = scq;
	a.recv_cq = rcq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = sig_all;
	a.cap.max_send_wr = wr;
	a.cap.max_recv_wr = wr;
	a.cap.max_send_sge = sge;
	a.cap.max_recv_sge = sge;
	a.cap.max_inline_data = inl;
	return ibv_create_qp(e->pd, &a);
}

static inline struct ibv_qp *make_qp_caps(struct env *e, struct ibv_cq *scq,
					  struct ibv_cq *rcq, uint32_t wr,
					  uint32_t sge, uint32_t inl, int sig_all)
{
	struct ibv_qp *qp = try_qp_caps(e, scq, rcq, wr, sge, inl, sig_all);
	CHECK(qp);
	return qp;
}

/* The end of a program with one QP pair, one MR and one CQ: destroy them,
 * then the PD and the device, each checked. */
static inline void close_pair(struct env *e, struct ibv_qp *a, struct ibv_qp *b,
			      struct ibv_mr *mr, struct ibv_cq *cq)
{
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);
	CHECK_EQ(ibv_dealloc_pd(e->pd), 0);
	CHECK_EQ(ibv_close_device(e->ctx), 0);
}

static inline struct ibv_qp *make_qp(struct env *e, struct ibv_cq *cq)
{
	return make_qp_caps(e, cq, cq, 16, 1, 0, 1);
}

static inline int to_init(struct ibv_qp *qp, int access)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = access;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				     IBV_QP_ACCESS_FLAGS);
}

/* RTR with `rd` incoming RDMA READs / atomics in flight. */
static inline int to_rtr_rd(struct ibv_qp *qp, union ibv_gid gid, uint32_t dqpn, int rd)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dqpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = rd;
	a.min_rnr_timer = 1;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
				     IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				     IBV_QP_MAX_DEST_RD_ATOMIC |
				     IBV_QP_MIN_RNR_TIMER);
}

static inline int to_rtr(struct ibv_qp *qp, union ibv_gid gid, uint32_t dqpn)
{
	return to_rtr_rd(qp, gid, dqpn, 1);
}

/* RTS with `rd` outgoing RDMA READs / atomics in flight. */
static inline int to_rts_rd(struct ibv_qp *qp, int timeout, int retry, int rnr, int rd)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = timeout;
	a.retry_cnt = retry;
	a.rnr_retry = rnr;
	a.sq_psn = 0;
	a.max_rd_atomic = rd;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				     IBV_QP_MAX_QP_RD_ATOMIC);
}

static inline int to_rts(struct ibv_qp *qp, int timeout, int retry, int rnr)
{
	return to_rts_rd(qp, timeout, retry, rnr, 1);
}

#define ALL_ACCESS                                                                 \
	(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |                        \
	 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)

static inline void connect_qp(struct ibv_qp *qp, union ibv_gid gid, uint32_t dqpn,
			      int access, int rnr_retry)
{
	CHECK_EQ(to_init(qp, access), 0);
	CHECK_EQ(to_rtr(qp, gid, dqpn), 0);
	CHECK_EQ(to_rts(qp, 14, 7, rnr_retry), 0);
}

/* Two QPs of one process connected to each other. */
static inline void connect_pair(struct env *e, struct ibv_qp *a, struct ibv_qp *b,
				int rnr_retry)
{
	connect_qp(a, e->gid, b->qp_num, ALL_ACCESS, rnr_retry);
	connect_qp(b, e->gid, a->qp_num, ALL_ACCESS, rnr_retry);
}

/* Poll exactly n completions within secs seconds (exits on timeout). */
static inline void poll_n_at(int line, struct ibv_cq *cq, struct ibv_wc *wc, int n, double secs)
{
	int got = 0;
	double end = now_s() + secs;
	while (got < n) {
		int r = ibv_poll_cq(cq, n - got, wc + got);
		CHECK(r >= 0);
		got += r;
		if (got < n && now_s() > end) {
			fprintf(stderr, "line %d: timeout: %d of %d completions\n", line, got, n);
			exit(1);
		}
	}
}

#define poll_n(cq, wc, n, secs) poll_n_at(__LINE__, cq, wc, n, secs)

/* No further completion arrives within secs seconds. */
static inline void expect_empty(struct ibv_cq *cq, double secs)
{
	struct ibv_wc wc;
	double end = now_s() + secs;
	do {
		int r = ibv_poll_cq(cq, 1, &wc);
		if (r != 0) {
			fprintf(stderr,
				"unexpected completion: wr_id %llu status %s opcode %d\n",
				(unsigned long long)wc.wr_id,
				ibv_wc_status_str(wc.status), wc.opcode);
			exit(1);
		}
	} while (now_s() < end);
}

static inline int post_send1(struct ibv_qp *qp, uint64_t id, enum ibv_wr_opcode op,
			     void *addr, uint32_t len, uint32_t lkey, uint64_t raddr,
			     uint32_t rkey, int flags)
{
	struct ibv_sge s = { .addr = (uintptr_t)addr, .length = len, .lkey = lkey };
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = id;
	wr.opcode = op;
	wr.sg_list = &s;
	wr.num_sge = 1;
	wr.send_flags = flags;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

static inline int post_recv1(struct ibv_qp *qp, uint64_t id, void *addr, uint32_t len,
			     uint32_t lkey)
{
	struct ibv_sge s = { .addr = (uintptr_t)addr, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = id;
	wr.sg_list = &s;
	wr.num_sge = 1;
	return ibv_post_recv(qp, &wr, &bad);
}

static inline int qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	CHECK_EQ(ibv_query_qp(qp, &a, IBV_QP_STATE, &i), 0);
	return a.qp_state;
}

/* All of `n` bytes to / from a pipe or socket (exits if the peer is gone). */
static inline void xwrite(int fd, const void *p, size_t n)
{
	CHECK_EQ(write(fd, p, n), (long long)n);
}

static inline void xread(int fd, void *p, size_t n)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = read(fd, (char *)p + got, n - got);
		if (r <= 0) {
			fprintf(stderr, "peer closed the connection (%zd)\n", r);
			exit(1);
		}
		got += r;
	}
}

static inline void *xalloc(size_t n)
{
	void *p = NULL;
	CHECK_EQ(posix_memalign(&p, 4096, n), 0);
	memset(p, 0, n);
	return p;
}
#endif
