/* SGE lists (gather at the sender, scatter at the receiver), zero-SGE RECVs taking RDMA_WRITE_WITH_IMM, PD checks (an lkey or rkey of
 * another PD), an error completion raising an armed event, poll_cq of 0
 * entries. */
#include "common.h"
#include <arpa/inet.h>

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_cq *cqa = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	struct ibv_cq *cqb = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cqa && cqb);
	struct ibv_qp *a = make_qp_caps(&e, cqa, cqa, 16, 4, 0, 1);
	struct ibv_qp *b = make_qp_caps(&e, cqb, cqb, 16, 4, 0, 1);
	connect_pair(&e, a, b, 7);
	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, ALL_ACCESS);
	CHECK(mr);
	uintptr_t base = (uintptr_t)buf;
	struct ibv_wc wc[8];
	struct ibv_send_wr w, *bad;
	struct ibv_recv_wr r, *rbad;

	CHECK_EQ(ibv_poll_cq(cqa, 0, wc), 0);

	/* Gather 3 SGEs (10 + 20 + 30 bytes) into RECV SGEs of 25 + 100. */
	for (int i = 0; i < 60; i++)
		buf[i] = (char)(i + 1);
	struct ibv_sge ss[3] = { { base, 10, mr->lkey }, { base + 100, 20, mr->lkey }, { base + 200, 30, mr->lkey } };
	memcpy(buf + 100, buf + 10, 20);
	memcpy(buf + 200, buf + 30, 30);
	for (int i = 0; i < 60; i++)
		buf[i] = (char)(i + 1);
	struct ibv_sge rs[2] = { { base + 4096, 25, mr->lkey }, { base + 8192, 100, mr->lkey } };
	memset(&r, 0, sizeof(r));
	r.wr_id = 1;
	r.sg_list = rs;
	r.num_sge = 2;
	CHECK_EQ(ibv_post_recv(b, &r, &rbad), 0);
	memset(&w, 0, sizeof(w));
	w.wr_id = 2;
	w.opcode = IBV_WR_SEND;
	w.sg_list = ss;
	w.num_sge = 3;
	w.send_flags = IBV_SEND_SIGNALED;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].byte_len, 60);
	CHECK(memcmp(buf + 4096, buf, 25) == 0);
	CHECK(memcmp(buf + 8192, buf + 25, 35) == 0);

	/* READ scattered into 2 local SGEs. */
	struct ibv_sge ls[2] = { { base + 12000, 7, mr->lkey }, { base + 13000, 9, mr->lkey } };
	memset(&w, 0, sizeof(w));
	w.wr_id = 3;
	w.opcode = IBV_WR_RDMA_READ;
	w.sg_list = ls;
	w.num_sge = 2;
	w.send_flags = IBV_SEND_SIGNALED;
	w.wr.rdma.remote_addr = base;
	w.wr.rdma.rkey = mr->rkey;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].byte_len, 16);
	CHECK(memcmp(buf + 12000, buf, 7) == 0);
	CHECK(memcmp(buf + 13000, buf + 7, 9) == 0);

	/* A RECV with no SGE takes an RDMA_WRITE_WITH_IMM; byte_len is the WRITE's. */
	memset(&r, 0, sizeof(r));
	r.wr_id = 4;
	CHECK_EQ(ibv_post_recv(b, &r, &rbad), 0);
	memset(&w, 0, sizeof(w));
	struct ibv_sge one = { base, 48, mr->lkey };
	w.wr_id = 5;
	w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	w.sg_list = &one;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.imm_data = htonl(77);
	w.wr.rdma.remote_addr = base + 20000;
	w.wr.rdma.rkey = mr->rkey;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].wr_id, 4);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc[0].byte_len, 48);
	CHECK_EQ(wc[0].imm_data, htonl(77));
	CHECK(memcmp(buf, buf + 20000, 48) == 0);
	/* Zero-length WRITE_WITH_IMM (no SGE): a notification. */
	CHECK_EQ(ibv_post_recv(b, &r, &rbad), 0);
	w.num_sge = 0;
	w.sg_list = NULL;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc[0].byte_len, 0);

	/* An lkey of another PD: LOC_PROT_ERR; the armed CQ raises an event. */
	struct ibv_comp_channel *ch = ibv_create_comp_channel(e.ctx);
	struct ibv_cq *cqc = ibv_create_cq(e.ctx, 16, NULL, ch, 0);
	struct ibv_qp *c = make_qp(&e, cqc), *d = make_qp(&e, cqb);
	connect_pair(&e, c, d, 7);
	struct ibv_pd *pd2 = ibv_alloc_pd(e.ctx);
	struct ibv_mr *mr2 = ibv_reg_mr(pd2, buf + 32768, 4096, ALL_ACCESS);
	CHECK(pd2 && mr2);
	CHECK_EQ(ibv_req_notify_cq(cqc, 0), 0);
	CHECK_EQ(post_send1(c, 7, IBV_WR_RDMA_WRITE, buf + 32768, 8, mr2->lkey, base, mr->rkey, IBV_SEND_SIGNALED), 0);
	struct ibv_cq *ecq;
	void *ectx;
	CHECK_EQ(ibv_get_cq_event(ch, &ecq, &ectx), 0);
	CHECK(ecq == cqc);
	ibv_ack_cq_events(cqc, 1);
	poll_n(cqc, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_LOC_PROT_ERR);
	/* An rkey of another PD than the target QP's: REM_ACCESS_ERR, and the
	 * QP goes to ERR (a fresh pair for the READ). */
	memset(buf + 32768, 0x5a, 8);
	CHECK_EQ(post_send1(a, 8, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, base + 32768, mr2->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR);
	struct ibv_qp *f = make_qp(&e, cqa), *g = make_qp(&e, cqb);
	connect_pair(&e, f, g, 9);
	CHECK_EQ(post_send1(f, 9, IBV_WR_RDMA_READ, buf + 64, 8, mr->lkey, base + 32768, mr2->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR);
	for (int i = 0; i < 8; i++)
		CHECK_EQ(((unsigned char *)buf)[32768 + i], 0x5a);
	CHECK_EQ(ibv_destroy_qp(f), 0);
	CHECK_EQ(ibv_destroy_qp(g), 0);

	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_destroy_qp(c), 0);
	CHECK_EQ(ibv_destroy_qp(d), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_dereg_mr(mr2), 0);
	CHECK_EQ(ibv_dealloc_pd(pd2), 0);
	CHECK_EQ(ibv_destroy_cq(cqa), 0);
	CHECK_EQ(ibv_destroy_cq(cqb), 0);
	CHECK_EQ(ibv_destroy_cq(cqc), 0);
	CHECK_EQ(ibv_destroy_comp_channel(ch), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("sge_pd ok\n");
	return 0;
}
