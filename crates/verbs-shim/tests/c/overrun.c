/* Two verbs errors as rxe and mlx5 give them: a WRITE whose remote range wraps
 * around the end of the address space completes with REM_ACCESS_ERR (it lies in no
 * MR); more signaled completions than a CQ holds (the cqe ibv_create_cq returned)
 * overrun it: polling it returns what it held, then fails, and the QP that
 * completed into it is in ERR. */
#include "common.h"

#define SZ 8192

int main(void)
{
	struct env e;
	env_open(&e);
	char *buf = xalloc(SZ);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, SZ, ALL_ACCESS);
	CHECK(mr);
	struct ibv_wc wc[8];

	/* 1. A remote range that wraps. */
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 16, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp *a = make_qp(&e, cq), *b = make_qp(&e, cq);
	connect_pair(&e, a, b, 7);
	uint64_t wrap = UINT64_MAX - 2047;
	CHECK_EQ(post_send1(a, 1, IBV_WR_RDMA_WRITE, buf, 4096, mr->lkey, wrap, mr->rkey,
			    IBV_SEND_SIGNALED),
		 0);
	poll_n(cq, wc, 1, 10);
	CHECK_EQ(wc[0].wr_id, 1);
	CHECK_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR);
	CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);

	/* 2. CQ overrun: a CQ asked for 4 entries holds what its cqe says. */
	struct ibv_cq *small = ibv_create_cq(e.ctx, 4, NULL, NULL, 0);
	CHECK(small);
	CHECK(small->cqe >= 4);
	int n = small->cqe + 97;
	struct ibv_qp *c = make_qp_caps(&e, small, cq, n + 1, 1, 0, 1);
	struct ibv_qp *d = make_qp(&e, cq);
	connect_pair(&e, c, d, 7);
	for (int i = 0; i < n; i++)
		CHECK_EQ(post_send1(c, 100 + i, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey,
				    (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED),
			 0);
	/* Wait for the QP to finish (or fail) its WRs, polling nothing. */
	double end = now_s() + 10;
	while (qp_state(c) != IBV_QPS_ERR && now_s() < end)
		usleep(1000);
	CHECK_EQ(qp_state(c), IBV_QPS_ERR);
	int held = 0, r;
	while ((r = ibv_poll_cq(small, 1, wc)) == 1 && held <= small->cqe)
		held++;
	CHECK(held <= small->cqe);
	CHECK(r < 0);
	CHECK(ibv_poll_cq(small, 1, wc) < 0);
	CHECK_EQ(ibv_destroy_qp(c), 0);
	CHECK_EQ(ibv_destroy_qp(d), 0);
	CHECK_EQ(ibv_destroy_cq(small), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("overrun: ok\n");
	return 0;
}
