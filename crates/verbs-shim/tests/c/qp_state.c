/* QP state machine: posts per state, illegal transitions and attr masks (EINVAL),
 * ibv_query_qp returning what was set. */
#include "common.h"

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp *a = make_qp_caps(&e, cq, cq, 8, 2, 64, 0);
	struct ibv_qp *b = make_qp(&e, cq);
	char *buf = xalloc(4096);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 4096, ALL_ACCESS);
	CHECK(mr);

	CHECK_EQ(a->state, IBV_QPS_RESET);
	CHECK_EQ(qp_state(a), IBV_QPS_RESET);
	/* Posting a send in RESET fails (rxe: EINVAL). */
	CHECK(post_send1(a, 1, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) != 0);
	/* So does a RECV (rxe: EINVAL before INIT). */
	CHECK(post_recv1(a, 9, buf, 64, mr->lkey) != 0);

	/* Illegal transitions and masks. */
	struct ibv_qp_attr at;
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE), EINVAL);
	at.qp_state = IBV_QPS_RTR;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE), EINVAL);
	/* RESET->INIT without the required PORT / ACCESS_FLAGS / PKEY. */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_INIT;
	at.port_num = 1;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE | IBV_QP_PORT), EINVAL);
	/* RESET->INIT with an attribute that transition does not take. */
	at.timeout = 14;
	CHECK_EQ(ibv_modify_qp(a, &at,
			       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				       IBV_QP_ACCESS_FLAGS | IBV_QP_TIMEOUT),
		 EINVAL);
	/* Port 2 does not exist. */
	at.port_num = 2;
	CHECK_EQ(ibv_modify_qp(a, &at,
			       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				       IBV_QP_ACCESS_FLAGS),
		 EINVAL);
	CHECK_EQ(qp_state(a), IBV_QPS_RESET);
	CHECK_EQ(a->state, IBV_QPS_RESET);

	int acc = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
	CHECK_EQ(to_init(a, acc), 0);
	CHECK_EQ(a->state, IBV_QPS_INIT);
	CHECK_EQ(qp_state(a), IBV_QPS_INIT);
	/* RECVs may be posted in INIT; sends may not. */
	CHECK_EQ(post_recv1(a, 10, buf, 64, mr->lkey), 0);
	CHECK(post_send1(a, 2, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) != 0);
	/* INIT->RTS is illegal; INIT->RTR without AV is EINVAL. */
	CHECK_EQ(to_rts(a, 14, 7, 7), EINVAL);
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTR;
	at.path_mtu = IBV_MTU_1024;
	at.dest_qp_num = b->qp_num;
	CHECK_EQ(ibv_modify_qp(a, &at,
			       IBV_QP_STATE | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
				       IBV_QP_MIN_RNR_TIMER),
		 EINVAL);
	CHECK_EQ(qp_state(a), IBV_QPS_INIT);
	/* INIT->INIT is legal (access flags change). */
	CHECK_EQ(to_init(a, ALL_ACCESS), 0);
	CHECK_EQ(qp_state(a), IBV_QPS_INIT);

	CHECK_EQ(to_rtr(a, e.gid, b->qp_num), 0);
	CHECK_EQ(a->state, IBV_QPS_RTR);
	CHECK_EQ(post_recv1(a, 11, buf, 64, mr->lkey), 0);
	CHECK(post_send1(a, 3, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) != 0);
	/* RTR->RTS without the required TIMEOUT etc. */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE), EINVAL);
	CHECK_EQ(qp_state(a), IBV_QPS_RTR);
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	at.timeout = 12;
	at.retry_cnt = 5;
	at.rnr_retry = 3;
	at.sq_psn = 0;
	at.max_rd_atomic = 1;
	CHECK_EQ(ibv_modify_qp(a, &at,
			       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				       IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				       IBV_QP_MAX_QP_RD_ATOMIC),
		 0);
	CHECK_EQ(a->state, IBV_QPS_RTS);
	/* RTS->RTR is illegal. */
	CHECK_EQ(to_rtr(a, e.gid, b->qp_num), EINVAL);
	CHECK_EQ(qp_state(a), IBV_QPS_RTS);

	/* Query returns what was set. */
	struct ibv_qp_attr q;
	struct ibv_qp_init_attr qi;
	memset(&q, 0xff, sizeof(q));
	memset(&qi, 0xff, sizeof(qi));
	CHECK_EQ(ibv_query_qp(a, &q,
			      IBV_QP_STATE | IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS |
				      IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_TIMEOUT |
				      IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				      IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MTU |
				      IBV_QP_DEST_QPN | IBV_QP_AV | IBV_QP_CAP |
				      IBV_QP_MAX_QP_RD_ATOMIC |
				      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_SQ_PSN |
				      IBV_QP_RQ_PSN,
			      &qi),
		 0);
	CHECK_EQ(q.qp_state, IBV_QPS_RTS);
	CHECK_EQ(q.cur_qp_state, IBV_QPS_RTS);
	CHECK_EQ(q.qp_access_flags, ALL_ACCESS);
	CHECK_EQ(q.port_num, 1);
	CHECK_EQ(q.pkey_index, 0);
	CHECK_EQ(q.timeout, 12);
	CHECK_EQ(q.retry_cnt, 5);
	CHECK_EQ(q.rnr_retry, 3);
	CHECK_EQ(q.min_rnr_timer, 1);
	CHECK_EQ(q.path_mtu, IBV_MTU_1024);
	CHECK_EQ(q.dest_qp_num, b->qp_num);
	CHECK_EQ(q.ah_attr.is_global, 1);
	CHECK(memcmp(&q.ah_attr.grh.dgid, &e.gid, 16) == 0);
	CHECK_EQ(q.ah_attr.port_num, 1);
	CHECK_EQ(q.max_rd_atomic, 1);
	CHECK_EQ(q.max_dest_rd_atomic, 1);
	CHECK_EQ(q.sq_psn, 0);
	CHECK_EQ(q.rq_psn, 0);
	CHECK(q.cap.max_send_wr >= 8);
	CHECK(q.cap.max_recv_wr >= 8);
	CHECK(q.cap.max_send_sge >= 2);
	CHECK(q.cap.max_recv_sge >= 2);
	CHECK(q.cap.max_inline_data >= 64);
	CHECK_EQ(qi.qp_type, IBV_QPT_RC);
	CHECK(qi.send_cq == cq);
	CHECK(qi.recv_cq == cq);
	CHECK_EQ(qi.sq_sig_all, 0);
	CHECK_EQ(qi.cap.max_send_wr, q.cap.max_send_wr);
	CHECK_EQ(qi.cap.max_inline_data, q.cap.max_inline_data);

	/* RTS->RTS takes MIN_RNR_TIMER / ACCESS_FLAGS, not TIMEOUT (IB state table). */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RTS;
	at.timeout = 16;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE | IBV_QP_TIMEOUT), EINVAL);
	at.min_rnr_timer = 12;
	at.qp_access_flags = IBV_ACCESS_REMOTE_READ;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER | IBV_QP_ACCESS_FLAGS), 0);
	CHECK_EQ(ibv_query_qp(a, &q, IBV_QP_TIMEOUT | IBV_QP_MIN_RNR_TIMER | IBV_QP_ACCESS_FLAGS, &qi), 0);
	CHECK_EQ(q.timeout, 12);
	CHECK_EQ(q.min_rnr_timer, 12);
	CHECK_EQ(q.qp_access_flags, IBV_ACCESS_REMOTE_READ);

	/* Any state -> ERR; posted RECVs flush, each once. */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_ERR;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE), 0);
	CHECK_EQ(a->state, IBV_QPS_ERR);
	CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	struct ibv_wc wc[4];
	poll_n(cq, wc, 2, 5);
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR);
		CHECK_EQ(wc[i].wr_id, 10 + i);
		CHECK_EQ(wc[i].qp_num, a->qp_num);
	}
	expect_empty(cq, 0.1);
	/* ERR -> RESET -> INIT works again (rxe, mlx5). */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_RESET;
	CHECK_EQ(ibv_modify_qp(a, &at, IBV_QP_STATE), 0);
	CHECK_EQ(qp_state(a), IBV_QPS_RESET);
	CHECK_EQ(to_init(a, ALL_ACCESS), 0);
	CHECK_EQ(qp_state(a), IBV_QPS_INIT);

	/* A fresh QP: RESET -> ERR directly is legal. */
	memset(&at, 0, sizeof(at));
	at.qp_state = IBV_QPS_ERR;
	CHECK_EQ(ibv_modify_qp(b, &at, IBV_QP_STATE), 0);
	CHECK_EQ(qp_state(b), IBV_QPS_ERR);

	/* A used pair, one QP sent to RESET through ERR, the other straight from
	 * RTS with a RECV posted (drained here whatever its fate: rxe drops it,
	 * NP-RDMA mode flushes it), connected again: the same QP numbers carry
	 * SEND, WRITE and READ; what was posted before the reset never lands. */
	{
		struct ibv_cq *cq2 = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
		CHECK(cq2);
		struct ibv_qp *x = make_qp(&e, cq2), *y = make_qp(&e, cq2);
		uint32_t xn = x->qp_num, yn = y->qp_num;
		connect_pair(&e, x, y, 7);
		memcpy(buf, "first", 5);
		CHECK_EQ(post_send1(x, 30, IBV_WR_RDMA_WRITE, buf, 5, mr->lkey, (uintptr_t)buf + 100, mr->rkey, IBV_SEND_SIGNALED), 0);
		poll_n(cq2, wc, 1, 5);
		CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
		CHECK_EQ(post_recv1(y, 31, buf + 1024, 64, mr->lkey), 0);
		memset(&at, 0, sizeof(at));
		at.qp_state = IBV_QPS_ERR;
		CHECK_EQ(ibv_modify_qp(x, &at, IBV_QP_STATE), 0);
		/* One side is reset and connected again before the other is reset
		 * (pyverbs' restate order). */
		memset(&at, 0, sizeof(at));
		at.qp_state = IBV_QPS_RESET;
		CHECK_EQ(ibv_modify_qp(x, &at, IBV_QP_STATE), 0);
		CHECK_EQ(qp_state(x), IBV_QPS_RESET);
		CHECK_EQ(x->qp_num, xn);
		/* RESET refuses posts again. */
		CHECK(post_send1(x, 32, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) != 0);
		connect_qp(x, e.gid, yn, ALL_ACCESS, 7);
		CHECK_EQ(ibv_modify_qp(y, &at, IBV_QP_STATE), 0);
		CHECK_EQ(qp_state(y), IBV_QPS_RESET);
		CHECK_EQ(y->qp_num, yn);
		while (ibv_poll_cq(cq2, 4, wc) > 0)
			;
		connect_qp(y, e.gid, xn, ALL_ACCESS, 7);
		CHECK_EQ(qp_state(x), IBV_QPS_RTS);
		memcpy(buf + 200, "again", 5);
		CHECK_EQ(post_recv1(y, 33, buf + 1024, 64, mr->lkey), 0);
		CHECK_EQ(post_send1(x, 34, IBV_WR_SEND, buf + 200, 5, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
		CHECK_EQ(post_send1(x, 35, IBV_WR_RDMA_WRITE, buf + 200, 5, mr->lkey, (uintptr_t)buf + 300, mr->rkey, IBV_SEND_SIGNALED), 0);
		CHECK_EQ(post_send1(x, 36, IBV_WR_RDMA_READ, buf + 400, 5, mr->lkey, (uintptr_t)buf + 100, mr->rkey, IBV_SEND_SIGNALED), 0);
		int seen = 0;
		for (int k = 0; k < 4; k++) {
			poll_n(cq2, wc, 1, 5);
			CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
			seen |= 1 << (wc[0].wr_id - 33);
			if (wc[0].wr_id == 33) {
				CHECK_EQ(wc[0].qp_num, yn);
				CHECK_EQ(wc[0].byte_len, 5);
			}
		}
		CHECK_EQ(seen, 0xf);
		CHECK_EQ(memcmp(buf + 1024, "again", 5), 0);
		CHECK_EQ(memcmp(buf + 300, "again", 5), 0);
		CHECK_EQ(memcmp(buf + 400, "first", 5), 0);
		expect_empty(cq2, 0.1);
		CHECK_EQ(ibv_destroy_qp(x), 0);
		CHECK_EQ(ibv_destroy_qp(y), 0);
		CHECK_EQ(ibv_destroy_cq(cq2), 0);
	}

	close_pair(&e, a, b, mr, cq);
	printf("qp_state ok\n");
	return 0;
}
