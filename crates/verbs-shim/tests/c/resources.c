/* Resource rules: dealloc_pd with an MR / QP alive (EBUSY), destroy_cq with a QP
 * attached (EBUSY), destroy_cq waits for its events to be acked, destroy_qp with
 * events unacked, reg_mr of length 0 / NULL address, a deregistered MR's lkey,
 * CQ sizes (cqe >= asked, as many completions as asked fit). */
#include "common.h"
#include <pthread.h>

static struct ibv_cq *dcq;
static volatile int destroyed;

static void *destroyer(void *arg)
{
	(void)arg;
	CHECK_EQ(ibv_destroy_cq(dcq), 0);
	destroyed = 1;
	return NULL;
}

int main(void)
{
	struct env e;
	env_open(&e);
	char *buf = xalloc(1 << 16);
	struct ibv_wc wc[64];

	/* MR keeps its PD busy. */
	struct ibv_pd *pd2 = ibv_alloc_pd(e.ctx);
	CHECK(pd2);
	struct ibv_mr *mr2 = ibv_reg_mr(pd2, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr2);
	CHECK_EQ(ibv_dealloc_pd(pd2), EBUSY);
	CHECK_EQ(ibv_dereg_mr(mr2), 0);
	/* So does a QP. */
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 16, NULL, NULL, 0);
	CHECK(cq);
	CHECK(cq->cqe >= 16);
	struct env e2 = e;
	e2.pd = pd2;
	struct ibv_qp *q2 = make_qp(&e2, cq);
	CHECK_EQ(ibv_dealloc_pd(pd2), EBUSY);
	/* A CQ with a QP on it is busy. */
	CHECK_EQ(ibv_destroy_cq(cq), EBUSY);
	CHECK_EQ(ibv_destroy_qp(q2), 0);
	CHECK_EQ(ibv_dealloc_pd(pd2), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);

	/* reg_mr: length 0 and NULL address fail (ib_umem_get). */
	errno = 0;
	CHECK(ibv_reg_mr(e.pd, buf, 0, IBV_ACCESS_LOCAL_WRITE) == NULL);
	CHECK(errno != 0);
	errno = 0;
	CHECK(ibv_reg_mr(e.pd, NULL, 4096, IBV_ACCESS_LOCAL_WRITE) == NULL);
	CHECK(errno != 0);

	/* A deregistered MR's lkey: LOC_PROT_ERR. */
	cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	struct ibv_qp *a = make_qp(&e, cq), *b = make_qp(&e, cq);
	connect_pair(&e, a, b, 7);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, ALL_ACCESS);
	struct ibv_mr *gone = ibv_reg_mr(e.pd, buf + 8192, 4096, ALL_ACCESS);
	CHECK(mr && gone);
	uint32_t glkey = gone->lkey;
	CHECK_EQ(ibv_dereg_mr(gone), 0);
	CHECK_EQ(post_send1(a, 1, IBV_WR_RDMA_WRITE, buf + 8192, 8, glkey, (uintptr_t)buf, mr->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_LOC_PROT_ERR);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);

	/* A CQ of 8 holds 8 completions. */
	cq = ibv_create_cq(e.ctx, 8, NULL, NULL, 0);
	CHECK(cq && cq->cqe >= 8);
	a = make_qp(&e, cq);
	b = make_qp(&e, cq);
	connect_pair(&e, a, b, 7);
	for (int i = 0; i < 8; i++)
		CHECK_EQ(post_send1(a, 100 + i, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED), 0);
	usleep(100000);
	poll_n(cq, wc, 8, 5);
	for (int i = 0; i < 8; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[i].wr_id, 100 + i);
	}
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);

	/* Events unacked: destroy_qp succeeds; destroy_cq waits for the ack. */
	struct ibv_comp_channel *ch = ibv_create_comp_channel(e.ctx);
	CHECK(ch);
	dcq = ibv_create_cq(e.ctx, 16, NULL, ch, 0);
	CHECK(dcq);
	a = make_qp(&e, dcq);
	b = make_qp(&e, dcq);
	connect_pair(&e, a, b, 7);
	CHECK_EQ(ibv_req_notify_cq(dcq, 0), 0);
	CHECK_EQ(post_send1(a, 5, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED), 0);
	struct ibv_cq *ecq;
	void *ectx;
	CHECK_EQ(ibv_get_cq_event(ch, &ecq, &ectx), 0);
	CHECK(ecq == dcq);
	poll_n(dcq, wc, 1, 5);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	/* The channel is in use by the CQ. */
	CHECK_EQ(ibv_destroy_comp_channel(ch), EBUSY);
	pthread_t t;
	CHECK_EQ(pthread_create(&t, NULL, destroyer, NULL), 0);
	usleep(200000);
	CHECK_EQ(destroyed, 0);
	ibv_ack_cq_events(dcq, 1);
	CHECK_EQ(pthread_join(t, NULL), 0);
	CHECK_EQ(destroyed, 1);
	CHECK_EQ(ibv_destroy_comp_channel(ch), 0);

	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("resources ok\n");
	return 0;
}
