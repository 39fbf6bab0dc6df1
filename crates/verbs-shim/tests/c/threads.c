/* Several threads post on one QP at once (libibverbs providers lock their
 * queues; applications share QPs across threads): every WR completes exactly
 * once, successfully, in post order, and every byte lands; a thread polling
 * the CQ meanwhile sees each completion once. SENDs with RECVs, WRITEs
 * (inline and not), READs and atomics on the same QP, from 4 threads:
 * - a WRITE's 64 target bytes are its source pattern when it completes;
 * - a READ (of the bytes the WRITE just before it on the QP wrote) returns
 *   them, over a buffer filled with other bytes first;
 * - a FETCH_ADD on the thread's counter returns its previous value (the
 *   thread's earlier adds), and the counter ends at the number of adds;
 * - each SEND lands in one of the RECVs a receiving thread keeps posted: 64
 *   bytes, its (thread, index) header and pattern intact, once, in the
 *   sending thread's order.
 * A thread has at most WIN WRs outstanding and they complete in post order,
 * so a slot (one of 16 per thread) is not reused before the WR that used it
 * has completed and was checked. */
#include "common.h"
#include <pthread.h>
#include <stdatomic.h>

enum { T = 4, PER = 1500, WIN = 4, KINDS = 5, SLOTS = 16, LEN = 64, RQ = 64 };
enum { SENDS = T * PER / KINDS };

/* Areas of the one MR, per thread t and slot s: sources, WRITE targets,
 * READ results, FETCH_ADD results, the counters, then the RECV buffers. */
#define SRC(t, s) (buf + (t) * 8192 + (s) * LEN)
#define DST(t, s) (buf + 65536 + (t) * 8192 + (s) * LEN)
#define RES(t, s) (buf + 131072 + (t) * 8192 + (s) * LEN)
#define FAR(t) (buf + 200000 + (t) * 64)
#define CTR(t) (buf + 220000 + (t) * 64)
#define RCV(k) (buf + 229376 + (k) * LEN)

static struct ibv_qp *a, *b;
static struct ibv_mr *mr;
static char *buf;
static struct ibv_cq *cqa, *cqb;
static atomic_int outstanding[T];
static atomic_int done_count;
static atomic_uint_fast64_t seen[T];
static int next_i[T]; /* the poller's: the index of thread t's next completion */

/* Byte k of the payload of thread t's WR i. */
static unsigned char pat(int t, int i, int k)
{
	return (unsigned char)(t * 131 + i * 7 + k * 13 + 1);
}

static void fill_pat(char *p, int t, int i)
{
	for (int k = 0; k < LEN; k++)
		p[k] = (char)pat(t, i, k);
}

/* The 64 bytes at p are thread t's WR i's pattern (from byte `from` on). */
static void check_pat(const char *what, const char *p, int t, int i, int from)
{
	for (int k = from; k < LEN; k++)
		if ((unsigned char)p[k] != pat(t, i, k)) {
			fprintf(stderr,
				"%s of thread %d: byte %d is 0x%02x, expected 0x%02x (wr %d's pattern)\n",
				what, t, k, (unsigned char)p[k], pat(t, i, k), i);
			exit(1);
		}
}

static void *poster(void *arg)
{
	int t = (int)(intptr_t)arg;
	for (int i = 0; i < PER; i++) {
		while (atomic_load(&outstanding[t]) >= WIN)
			sched_yield();
		atomic_fetch_add(&outstanding[t], 1);
		uint64_t id = ((uint64_t)t << 32) | (uint64_t)i;
		int s = i % SLOTS;
		char *src = SRC(t, s);
		uint64_t dst = (uintptr_t)DST(t, s);
		int r;
		switch (i % KINDS) {
		case 0: /* inline WRITE of the pattern */
			fill_pat(src, t, i);
			r = post_send1(a, id, IBV_WR_RDMA_WRITE, src, LEN, mr->lkey, dst, mr->rkey,
				       IBV_SEND_SIGNALED | IBV_SEND_INLINE);
			break;
		case 1: /* WRITE */
			fill_pat(src, t, i);
			r = post_send1(a, id, IBV_WR_RDMA_WRITE, src, LEN, mr->lkey, dst, mr->rkey,
				       IBV_SEND_SIGNALED);
			break;
		case 2: /* READ back what WR i - 1 (the WRITE before it) wrote */
			memset(RES(t, s), 0xee, LEN);
			r = post_send1(a, id, IBV_WR_RDMA_READ, RES(t, s), LEN, mr->lkey,
				       (uintptr_t)DST(t, (i - 1) % SLOTS), mr->rkey, IBV_SEND_SIGNALED);
			break;
		case 3: { /* FETCH_ADD on this thread's counter */
			struct ibv_sge sg = { (uintptr_t)FAR(t), 8, mr->lkey };
			struct ibv_send_wr w, *bad;
			memset(&w, 0, sizeof(w));
			memset(FAR(t), 0xee, 8);
			w.wr_id = id;
			w.sg_list = &sg;
			w.num_sge = 1;
			w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
			w.send_flags = IBV_SEND_SIGNALED;
			w.wr.atomic.remote_addr = (uintptr_t)CTR(t);
			w.wr.atomic.rkey = mr->rkey;
			w.wr.atomic.compare_add = 1;
			r = ibv_post_send(a, &w, &bad);
			break;
		}
		default: /* SEND: (thread, index) header, then the pattern */
			fill_pat(src, t, i);
			src[0] = (char)t;
			memcpy(src + 1, &i, 4);
			r = post_send1(a, id, IBV_WR_SEND, src, LEN, mr->lkey, 0, 0, IBV_SEND_SIGNALED);
			break;
		}
		CHECK_EQ(r, 0);
	}
	return NULL;
}

/* Thread t's WR i completed: what it did is there. */
static void check_done(const struct ibv_wc *wc, int t, int i)
{
	int s = i % SLOTS;
	switch (i % KINDS) {
	case 0:
	case 1:
		CHECK_EQ(wc->opcode, IBV_WC_RDMA_WRITE);
		check_pat("WRITE target", DST(t, s), t, i, 0);
		break;
	case 2:
		CHECK_EQ(wc->opcode, IBV_WC_RDMA_READ);
		check_pat("READ result", RES(t, s), t, i - 1, 0);
		break;
	case 3:
		CHECK_EQ(wc->opcode, IBV_WC_FETCH_ADD);
		CHECK_EQ(*(uint64_t *)FAR(t), i / KINDS);
		break;
	default:
		CHECK_EQ(wc->opcode, IBV_WC_SEND);
		break;
	}
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
			int i = (int)(uint32_t)wc[k].wr_id;
			CHECK(t >= 0 && t < T);
			/* One QP: a thread's WRs complete in the order it posted them. */
			CHECK_EQ(i, next_i[t]);
			next_i[t]++;
			check_done(&wc[k], t, i);
			atomic_fetch_add(&seen[t], 1);
			atomic_fetch_sub(&outstanding[t], 1);
			atomic_fetch_add(&done_count, 1);
		}
		CHECK(now_s() < end);
	}
	return NULL;
}

/* Keeps RQ RECVs posted on b; checks every SEND that lands. */
static void *receiver(void *arg)
{
	(void)arg;
	static unsigned char got[T][PER];
	int last[T];
	for (int t = 0; t < T; t++)
		last[t] = -1;
	struct ibv_wc wc[16];
	double end = now_s() + 60;
	int n_recv = 0;
	while (n_recv < SENDS) {
		int n = ibv_poll_cq(cqb, 16, wc);
		CHECK(n >= 0);
		for (int k = 0; k < n; k++) {
			if (wc[k].status != IBV_WC_SUCCESS) {
				fprintf(stderr, "recv %llu status %s\n",
					(unsigned long long)wc[k].wr_id,
					ibv_wc_status_str(wc[k].status));
				exit(1);
			}
			CHECK_EQ(wc[k].opcode, IBV_WC_RECV);
			CHECK_EQ(wc[k].byte_len, LEN);
			CHECK(wc[k].wr_id < RQ);
			char *p = RCV(wc[k].wr_id);
			int t = (unsigned char)p[0], i;
			memcpy(&i, p + 1, 4);
			CHECK(t < T && i >= 0 && i < PER && i % KINDS == KINDS - 1);
			CHECK(!got[t][i]);
			got[t][i] = 1;
			CHECK(i > last[t]);
			last[t] = i;
			check_pat("received SEND", p, t, i, 5);
			memset(p, 0, LEN);
			CHECK_EQ(post_recv1(b, wc[k].wr_id, p, LEN, mr->lkey), 0);
			n_recv++;
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
	b = make_qp_caps(&e, cqb, cqb, RQ, 1, 0, 1);
	CHECK(a && b);
	connect_pair(&e, a, b, 7);
	buf = xalloc(1 << 18);
	memset(buf, 0, 1 << 18);
	mr = ibv_reg_mr(e.pd, buf, 1 << 18, ALL_ACCESS);
	CHECK(mr);
	for (int k = 0; k < RQ; k++)
		CHECK_EQ(post_recv1(b, k, RCV(k), LEN, mr->lkey), 0);
	pthread_t th[T], pl, rv;
	CHECK_EQ(pthread_create(&rv, NULL, receiver, NULL), 0);
	CHECK_EQ(pthread_create(&pl, NULL, poller, NULL), 0);
	for (int t = 0; t < T; t++)
		CHECK_EQ(pthread_create(&th[t], NULL, poster, (void *)(intptr_t)t), 0);
	for (int t = 0; t < T; t++)
		pthread_join(th[t], NULL);
	pthread_join(pl, NULL);
	pthread_join(rv, NULL);
	for (int t = 0; t < T; t++) {
		CHECK_EQ(atomic_load(&seen[t]), PER);
		CHECK_EQ(*(uint64_t *)CTR(t), PER / KINDS);
	}
	struct ibv_wc wc;
	CHECK_EQ(ibv_poll_cq(cqa, 1, &wc), 0);
	CHECK_EQ(ibv_poll_cq(cqb, 1, &wc), 0);
	printf("threads ok: %d WRs, %d SENDs received\n", T * PER, SENDS);
	return 0;
}
