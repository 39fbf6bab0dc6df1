/* Creation limits and attributes: QP caps past the device's limits (EINVAL), a
 * QP without CQs, CQ sizes, max_rd_atomic past max_qp_rd_atom, port attributes,
 * a QP connected to a QP number nobody has (RETRY_EXC_ERR, promptly), 64-bit
 * wr_ids. */
#include "common.h"

static struct ibv_qp *try_qp(struct env *e, struct ibv_cq *cq, uint32_t wr, uint32_t sge,
			     uint32_t inl)
{
	return try_qp_caps(e, cq, cq, wr, sge, inl, 0);
}

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_device_attr da;
	CHECK_EQ(ibv_query_device(e.ctx, &da), 0);
	struct ibv_port_attr pa;
	CHECK_EQ(ibv_query_port(e.ctx, 1, &pa), 0);
	CHECK_EQ(pa.state, IBV_PORT_ACTIVE);
	CHECK(pa.gid_tbl_len >= 1);
	CHECK(pa.active_mtu >= IBV_MTU_1024);
	CHECK(ibv_query_port(e.ctx, 2, &pa) != 0);

	/* CQ sizes: 0 and past max_cqe are refused. */
	errno = 0;
	CHECK(ibv_create_cq(e.ctx, 0, NULL, NULL, 0) == NULL);
	CHECK_EQ(errno, EINVAL);
	CHECK(ibv_create_cq(e.ctx, da.max_cqe + 1, NULL, NULL, 0) == NULL);
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cq);

	/* QP caps past the device's limits. */
	errno = 0;
	CHECK(try_qp(&e, cq, da.max_qp_wr + 1, 1, 0) == NULL);
	CHECK_EQ(errno, EINVAL);
	errno = 0;
	CHECK(try_qp(&e, cq, 4, da.max_sge + 1, 0) == NULL);
	CHECK_EQ(errno, EINVAL);
	errno = 0;
	CHECK(try_qp(&e, cq, 4, 1, 1 << 20) == NULL);
	CHECK(errno != 0);
	errno = 0;
	CHECK(try_qp(&e, NULL, 4, 1, 0) == NULL);
	CHECK(errno != 0);
	struct ibv_qp *q = try_qp(&e, cq, da.max_qp_wr, da.max_sge, 0);
	CHECK(q);
	CHECK_EQ(ibv_destroy_qp(q), 0);

	/* What middleware asks of a device (qperf: 1024 WRs; libfabric and UCX: several
	 * SGEs and inline data; rxe grants 512 B inline): granted, and the granted caps
	 * written back cover the request. */
	CHECK(da.max_qp_wr >= 1024);
	CHECK(da.max_sge >= 5);
	struct ibv_qp_init_attr ia;
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = ia.recv_cq = cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = ia.cap.max_recv_wr = 1024;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 5;
	ia.cap.max_inline_data = 512;
	q = ibv_create_qp(e.pd, &ia);
	CHECK(q);
	CHECK(ia.cap.max_send_wr >= 1024 && ia.cap.max_recv_wr >= 1024);
	CHECK(ia.cap.max_send_sge >= 5 && ia.cap.max_recv_sge >= 5);
	CHECK(ia.cap.max_inline_data >= 512);
	/* A request at the granted inline size is granted again (libfabric's search). */
	uint32_t inl = ia.cap.max_inline_data;
	CHECK_EQ(ibv_destroy_qp(q), 0);
	q = try_qp(&e, cq, 4, 1, inl);
	CHECK(q);
	CHECK_EQ(ibv_destroy_qp(q), 0);

	/* max_rd_atomic past the device's max_qp_rd_atom: EINVAL. */
	struct ibv_qp *a = make_qp(&e, cq), *b = make_qp(&e, cq);
	CHECK_EQ(to_init(a, ALL_ACCESS), 0);
	CHECK_EQ(to_rtr(a, e.gid, b->qp_num), 0);
	struct ibv_qp_attr at;
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	at.timeout = 14;
	at.retry_cnt = 7;
	at.rnr_retry = 7;
	at.max_rd_atomic = da.max_qp_rd_atom + 1;
	int m = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
		IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
	if (da.max_qp_rd_atom < 255)
		CHECK_EQ(ibv_modify_qp(a, &at, m), EINVAL);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);

	/* Connected to a QP number nobody has: RTR succeeds (nothing checks it),
	 * the WR fails with RETRY_EXC_ERR after the retries (a few seconds). */
	a = make_qp(&e, cq);
	b = make_qp(&e, cq);
	uint32_t ghost = (b->qp_num + 1000) & 0xffffff;
	CHECK_EQ(to_init(a, ALL_ACCESS), 0);
	CHECK_EQ(to_rtr(a, e.gid, ghost), 0);
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	at.timeout = 10;
	at.retry_cnt = 2;
	at.rnr_retry = 7;
	at.max_rd_atomic = 1;
	CHECK_EQ(ibv_modify_qp(a, &at, m), 0);
	char *buf = xalloc(4096);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 4096, ALL_ACCESS);
	CHECK(mr);
	uint64_t id = 0xfedcba9876543210ull;
	double t0 = now_s();
	CHECK_EQ(post_send1(a, id, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	struct ibv_wc wc[2];
	poll_n(cq, wc, 1, 8);
	CHECK(now_s() - t0 < 5);
	CHECK(wc[0].wr_id == id);
	CHECK_EQ(wc[0].status, IBV_WC_RETRY_EXC_ERR);

	/* ibv_resize_cq (rxe's rules): down and up while empty, cq->cqe follows;
	 * not below the completions waiting, not 0, not past max_cqe (EINVAL);
	 * the waiting completions survive a resize. */
	{
		struct ibv_cq *rc = ibv_create_cq(e.ctx, 3, NULL, NULL, 0);
		CHECK(rc);
		CHECK_EQ(ibv_resize_cq(rc, 1), 0);
		CHECK(rc->cqe >= 1);
		CHECK_EQ(ibv_resize_cq(rc, 7), 0);
		CHECK(rc->cqe >= 7);
		struct ibv_qp *x = make_qp(&e, rc), *y = make_qp(&e, rc);
		connect_pair(&e, x, y, 7);
		for (int i = 0; i < 6; i++)
			CHECK_EQ(post_send1(x, 100 + i, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey,
					    (uintptr_t)buf + 1024, mr->rkey, IBV_SEND_SIGNALED), 0);
		/* All six are in the CQ once the last one is (in order). */
		usleep(200000);
		errno = 0;
		CHECK_EQ(ibv_resize_cq(rc, 1), EINVAL);
		CHECK_EQ(ibv_resize_cq(rc, 0), EINVAL);
		CHECK_EQ(ibv_resize_cq(rc, da.max_cqe + 1), EINVAL);
		CHECK(rc->cqe >= 7);
		CHECK_EQ(ibv_resize_cq(rc, 6), 0);
		struct ibv_wc w6[6];
		poll_n(rc, w6, 6, 5);
		for (int i = 0; i < 6; i++) {
			CHECK_EQ(w6[i].wr_id, 100 + i);
			CHECK_EQ(w6[i].status, IBV_WC_SUCCESS);
		}
		CHECK_EQ(ibv_resize_cq(rc, 2), 0);
		CHECK_EQ(rc->cqe, 2);
		CHECK_EQ(ibv_destroy_qp(x), 0);
		CHECK_EQ(ibv_destroy_qp(y), 0);
		CHECK_EQ(ibv_destroy_cq(rc), 0);
	}
	close_pair(&e, a, b, mr, cq);
	printf("limits ok\n");
	return 0;
}
