/* Error completions and QP -> ERR: bad lkey (LOC_PROT_ERR), bad rkey / out of
 * bounds / missing remote right (REM_ACCESS_ERR), RECV too small (LOC_LEN_ERR at
 * the receiver, REM_INV_REQ_ERR at the sender), RNR with rnr_retry 0
 * (RNR_RETRY_EXC_ERR); later WRs and posted RECVs flush (WR_FLUSH_ERR), exactly one
 * completion per WR. */
#include "common.h"

static struct env e;
static struct ibv_cq *cqa, *cqb;
static struct ibv_qp *a, *b;

static void pair(int rnr_retry)
{
	cqa = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	cqb = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cqa && cqb);
	a = make_qp(&e, cqa);
	b = make_qp(&e, cqb);
	connect_pair(&e, a, b, rnr_retry);
}

static void unpair(void)
{
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_destroy_cq(cqa), 0);
	CHECK_EQ(ibv_destroy_cq(cqb), 0);
}

/* Post [op(bad) , SEND, SEND] chained at a plus one RECV at a; expect the first
 * with `st`, the rest WR_FLUSH_ERR, a in ERR. */
static void chain_fails(enum ibv_wr_opcode op, char *buf, uint32_t len, uint32_t lkey,
			uint64_t raddr, uint32_t rkey, enum ibv_wc_status st, uint32_t recv_lkey)
{
	struct ibv_wc wc[8];
	CHECK_EQ(post_recv1(a, 90, buf + 2048, 64, recv_lkey), 0);
	struct ibv_sge s[3] = {
		{ (uintptr_t)buf, len, lkey },
		{ (uintptr_t)buf, 8, recv_lkey },
		{ (uintptr_t)buf, 8, recv_lkey },
	};
	struct ibv_send_wr w[3], *bad = NULL;
	memset(w, 0, sizeof(w));
	for (int i = 0; i < 3; i++) {
		w[i].wr_id = 1 + i;
		w[i].opcode = i ? IBV_WR_SEND : op;
		w[i].sg_list = &s[i];
		w[i].num_sge = 1;
		w[i].send_flags = IBV_SEND_SIGNALED;
		w[i].next = i < 2 ? &w[i + 1] : NULL;
	}
	w[0].wr.rdma.remote_addr = raddr;
	w[0].wr.rdma.rkey = rkey;
	if (op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
		w[0].wr.atomic.remote_addr = raddr;
		w[0].wr.atomic.rkey = rkey;
		w[0].wr.atomic.compare_add = 1;
	}
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cqa, wc, 4, 10);
	CHECK_EQ(wc[0].wr_id, 1);
	if (wc[0].status != st)
		fprintf(stderr, "op %d: got %s, expected %s\n", op,
			ibv_wc_status_str(wc[0].status), ibv_wc_status_str(st));
	CHECK_EQ(wc[0].status, st);
	CHECK_EQ(wc[0].qp_num, a->qp_num);
	int sends = 0, recvs = 0;
	for (int i = 1; i < 4; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR);
		CHECK_EQ(wc[i].qp_num, a->qp_num);
		if (wc[i].wr_id == 90)
			recvs++;
		else
			CHECK_EQ(wc[i].wr_id, 2 + sends++);
	}
	CHECK_EQ(recvs, 1);
	CHECK_EQ(sends, 2);
	CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	CHECK_EQ(a->state, IBV_QPS_ERR); /* ibv_query_qp refreshes it */
	/* Posting in ERR is accepted and flushed (rdma-core providers). */
	CHECK_EQ(post_send1(a, 7, IBV_WR_SEND, buf, 8, recv_lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(post_recv1(a, 8, buf, 8, recv_lkey), 0);
	poll_n(cqa, wc, 2, 5);
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR);
		CHECK(wc[i].wr_id == 7 || wc[i].wr_id == 8);
	}
	expect_empty(cqa, 0.2);
}

int main(void)
{
	env_open(&e);
	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 8192, ALL_ACCESS);
	struct ibv_mr *ro = ibv_reg_mr(e.pd, buf + 8192, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	CHECK(mr && ro);
	uintptr_t base = (uintptr_t)buf;

	/* Bad lkey. */
	pair(7);
	chain_fails(IBV_WR_RDMA_WRITE, buf, 8, mr->lkey + 0x100, base + 4096, mr->rkey,
		    IBV_WC_LOC_PROT_ERR, mr->lkey);
	unpair();
	/* lkey ok, range outside the MR. */
	pair(7);
	chain_fails(IBV_WR_RDMA_WRITE, buf + 8190, 8, mr->lkey, base + 4096, mr->rkey,
		    IBV_WC_LOC_PROT_ERR, mr->lkey);
	unpair();
	/* Bad rkey. */
	pair(7);
	chain_fails(IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, base + 4096, mr->rkey + 0x100,
		    IBV_WC_REM_ACCESS_ERR, mr->lkey);
	unpair();
	/* Out of bounds READ. */
	pair(7);
	chain_fails(IBV_WR_RDMA_READ, buf, 64, mr->lkey, base + 8192 - 32, mr->rkey,
		    IBV_WC_REM_ACCESS_ERR, mr->lkey);
	unpair();
	/* MR without REMOTE_WRITE. */
	pair(7);
	chain_fails(IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, base + 8192, ro->rkey,
		    IBV_WC_REM_ACCESS_ERR, mr->lkey);
	unpair();
	/* MR without REMOTE_ATOMIC. */
	pair(7);
	chain_fails(IBV_WR_ATOMIC_FETCH_AND_ADD, buf, 8, mr->lkey, base + 8192, ro->rkey,
		    IBV_WC_REM_ACCESS_ERR, mr->lkey);
	unpair();
	/* READ into a local MR without LOCAL_WRITE is a local protection error. */
	struct ibv_mr *nolw = ibv_reg_mr(e.pd, buf + 12288, 4096, IBV_ACCESS_REMOTE_READ);
	CHECK(nolw);
	pair(7);
	chain_fails(IBV_WR_RDMA_READ, buf + 12288, 8, nolw->lkey, base, mr->rkey,
		    IBV_WC_LOC_PROT_ERR, mr->lkey);
	unpair();
	CHECK_EQ(ibv_dereg_mr(nolw), 0);

	/* RECV too small: LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at the sender. */
	struct ibv_wc wc[8];
	pair(7);
	CHECK_EQ(post_recv1(b, 50, buf + 4096, 16, mr->lkey), 0);
	CHECK_EQ(post_recv1(b, 51, buf + 4096, 64, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 60, IBV_WR_SEND, buf, 64, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	/* The receiver's QP goes to ERR: the RECV behind it flushes. */
	poll_n(cqb, wc, 2, 10);
	CHECK_EQ(wc[0].wr_id, 50);
	CHECK_EQ(wc[0].status, IBV_WC_LOC_LEN_ERR);
	CHECK_EQ(wc[1].wr_id, 51);
	CHECK_EQ(wc[1].status, IBV_WC_WR_FLUSH_ERR);
	CHECK_EQ(qp_state(b), IBV_QPS_ERR);
	poll_n(cqa, wc, 1, 10);
	CHECK_EQ(wc[0].wr_id, 60);
	CHECK_EQ(wc[0].status, IBV_WC_REM_INV_REQ_ERR);
	CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	expect_empty(cqa, 0.1);
	expect_empty(cqb, 0.1);
	unpair();

	/* RNR with rnr_retry 0: RNR_RETRY_EXC_ERR, promptly. */
	pair(0);
	double t0 = now_s();
	CHECK_EQ(post_send1(a, 70, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(post_send1(a, 71, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 2, 5);
	CHECK(now_s() - t0 < 3);
	CHECK_EQ(wc[0].wr_id, 70);
	CHECK_EQ(wc[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
	CHECK_EQ(wc[1].wr_id, 71);
	CHECK_EQ(wc[1].status, IBV_WC_WR_FLUSH_ERR);
	CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	expect_empty(cqb, 0.1);
	unpair();

	/* rnr_retry 3 x the receiver's min_rnr_timer 1 (10 us): RNR_RETRY_EXC_ERR
	 * within moments; a RECV posted afterwards takes nothing of it. */
	pair(3);
	t0 = now_s();
	CHECK_EQ(post_send1(a, 72, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK(now_s() - t0 < 3);
	CHECK_EQ(wc[0].wr_id, 72);
	CHECK_EQ(wc[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
	CHECK_EQ(qp_state(b), IBV_QPS_RTS);
	CHECK_EQ(post_recv1(b, 73, buf + 4096, 64, mr->lkey), 0);
	expect_empty(cqb, 0.2);
	unpair();

	/* rnr_retry 7 (forever): the SEND waits for the RECV however late, then
	 * lands. */
	pair(7);
	memset(buf + 4096, 0, 64);
	memcpy(buf, "rnr-late", 8);
	CHECK_EQ(post_send1(a, 74, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	expect_empty(cqa, 0.3);
	CHECK_EQ(post_recv1(b, 75, buf + 4096, 64, mr->lkey), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 74);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 75);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(memcmp(buf + 4096, "rnr-late", 8), 0);
	unpair();

	/* rnr_retry 2 x min_rnr_timer 0 (655.36 ms): a RECV posted 100 ms after
	 * the SEND still takes it (a resend finds it). */
	pair(2);
	{
		struct ibv_qp_attr at;
		memset(&at, 0, sizeof(at));
		at.qp_state = IBV_QPS_RTS;
		at.min_rnr_timer = 0;
		CHECK_EQ(ibv_modify_qp(b, &at, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER), 0);
	}
	CHECK_EQ(post_send1(a, 76, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	usleep(100000);
	CHECK_EQ(post_recv1(b, 77, buf + 4096, 64, mr->lkey), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 76);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 77);
	unpair();

	/* An unsignaled WR that fails still completes (with its error). */
	cqa = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	cqb = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	a = make_qp_caps(&e, cqa, cqa, 16, 1, 0, 0);
	b = make_qp(&e, cqb);
	connect_pair(&e, a, b, 7);
	CHECK_EQ(post_send1(a, 80, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, base, mr->rkey, 0), 0);
	CHECK_EQ(post_send1(a, 81, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, base, mr->rkey + 0x100, 0), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 81);
	CHECK_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR);
	expect_empty(cqa, 0.2);
	unpair();

	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_dereg_mr(ro), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("wc_status ok\n");
	return 0;
}
