/* Several threads post on one QP at once (libibverbs providers lock their
 * queues; applications share QPs across threads): every WR completes exactly
 * once, successfully, and every byte lands; a thread polling the CQ meanwhile
 * sees each completion once. SENDs with RECVs, inline WRITEs, READs and atomics
 * on the same QP, from 4 threads. */
#include "common.h"
#include <pthread.h>
#include <stdatomic.h>

enum { T = 4, PER = 1500, WIN = 4 };

static struct ibv_qp *a, *b;
static struct ibv_mr *mr;
static char *buf;
static struct ibv_cq *cqa, *cqb;
static atomic_int outstanding[T];
static atomic_int done_count;
static atomic_uint_fast64_t seen[T];

static void *poster(void *arg)
{
	int t = (int)(intptr_t)arg;
	for (int i = 0; i < PER; i++) {
		while (atomic_load(&outstanding[t]) >= WIN)
			sched_yield();
		atomic_fetch_add(&outstanding[t], 1);
		uint64_t id = ((uint64_t)t << 32) | (uint64_t)i;
		char *src = buf + t * 8192 + (i % 16) * 64;
		uint64_t dst = (uintptr_t)buf + 65536 + t * 8192 + (i % 16) * 64;
		int r;
		switch (i % 4) {
		case 0: /* inline WRITE of the pattern */
			memset(src, (char)(t * 31 + i), 64);
			r = post_send1(a, id, IBV_WR_RDMA_WRITE, src, 64, mr->lkey, dst, mr->rkey,
				       IBV_SEND_SIGNALED | IBV_SEND_INLINE);
			break;
		case 1: /* WRITE */
			r = post_send1(a, id, IBV_WR_RDMA_WRITE, src, 64, mr->lkey, dst, mr->rkey,
				       IBV_SEND_SIGNALED);
			break;
		case 2: /* READ back */
			r = post_send1(a, id, IBV_WR_RDMA_READ, buf + 131072 + t * 8192 + (i % 16) * 64, 64,
				       mr->lkey, dst, mr->rkey, IBV_SEND_SIGNALED);
			break;
		default: { /* FETCH_ADD on this thread's counter */
			struct ibv_sge s = { (uintptr_t)(buf + 200000 + t * 64), 8, mr->lkey };
			struct ibv_send_wr w, *bad;
			memset(&w, 0, sizeof(w));
			w.wr_id = id;
			w.sg_list = &s;
			w.num_sge = 1;
			w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
			w.send_flags = IBV_SEND_SIGNALED;
			w.wr.atomic.remote_addr = (uintptr_t)buf + 220000 + t * 64;
			w.wr.atomic.rkey = mr->rkey;
			w.wr.atomic.compare_add = 1;
			r = ibv_post_send(a, &w, &bad);
			break;
		}
		}
		CHECK_EQ(r, 0);
	}
	return NULL;
}

static void *poller(void *arg)
{
	(void)arg;
	struct ibv_wc wc[16];
	double end = now_s() + 60;
	while (atomic_load(&done_count) < T * PER) {
		int n = ibv_poll_cq(cqa, 16, wc);
		CHECK(n >= 0);
		for (int k = 0; k < n; k++) {
			if (wc[k].status != IBV_WC_SUCCESS) {
				fprintf(stderr, "wr %llx status %s\n", (unsigned long long)wc[k].wr_id,
					ibv_wc_status_str(wc[k].status));
				exit(1);
			}
			int t = (int)(wc[k].wr_id >> 32);
			CHECK(t >= 0 && t < T);
			atomic_fetch_add(&seen[t], 1);
			atomic_fetch_sub(&outstanding[t], 1);
			atomic_fetch_add(&done_count, 1);
		}
		CHECK(now_s() < end);
	}
	return NULL;
}

int main(void)
{
	struct env e;
	env_open(&e);
	cqa = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	cqb = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	CHECK(cqa && cqb);
	a = make_qp_caps(&e, cqa, cqa, 64, 1, 64, 1);
	b = make_qp(&e, cqb);
	CHECK(a && b);
	connect_pair(&e, a, b, 7);
	buf = xalloc(1 << 18);
	memset(buf, 0, 1 << 18);
	mr = ibv_reg_mr(e.pd, buf, 1 << 18, ALL_ACCESS);
	CHECK(mr);
	pthread_t th[T], pl;
	CHECK_EQ(pthread_create(&pl, NULL, poller, NULL), 0);
	for (int t = 0; t < T; t++)
		CHECK_EQ(pthread_create(&th[t], NULL, poster, (void *)(intptr_t)t), 0);
	for (int t = 0; t < T; t++)
		pthread_join(th[t], NULL);
	pthread_join(pl, NULL);
	for (int t = 0; t < T; t++) {
		CHECK_EQ(atomic_load(&seen[t]), PER);
		CHECK_EQ(*(uint64_t *)(buf + 220000 + t * 64), PER / 4);
	}
	struct ibv_wc wc;
	CHECK_EQ(ibv_poll_cq(cqa, 1, &wc), 0);
	printf("threads ok\n");
	return 0;
}
