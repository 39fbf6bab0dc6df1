/* Work completion fields: opcode, byte_len, wc_flags (IBV_WC_WITH_IMM), imm_data
 * (as given, network order), qp_num for SEND, SEND_WITH_IMM, RDMA_WRITE_WITH_IMM
 * (receiver: IBV_WC_RECV_RDMA_WITH_IMM), READ, atomics (8-byte result; misaligned
 * address fails); zero-length SEND/WRITE/READ; sq_sig_all=0 with unsignaled WRs;
 * a long chain of WRs in one post. */
#include "common.h"
#include <arpa/inet.h>

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_cq *cqa = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	struct ibv_cq *cqb = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	CHECK(cqa && cqb);
	struct ibv_qp *a = make_qp_caps(&e, cqa, cqa, 64, 1, 0, 0);
	struct ibv_qp *b = make_qp_caps(&e, cqb, cqb, 64, 1, 0, 1);
	connect_pair(&e, a, b, 7);
	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, ALL_ACCESS);
	CHECK(mr);
	uintptr_t base = (uintptr_t)buf;
	char *src = buf, *dst = buf + 8192;
	struct ibv_wc wc[64];
	struct ibv_send_wr w, *bad;
	struct ibv_sge s;

	/* SEND. */
	for (int i = 0; i < 100; i++)
		src[i] = (char)(i + 1);
	CHECK_EQ(post_recv1(b, 10, dst, 256, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 11, IBV_WR_SEND, src, 100, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].wr_id, 11);
	CHECK_EQ(wc[0].opcode, IBV_WC_SEND);
	CHECK_EQ(wc[0].qp_num, a->qp_num);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].wr_id, 10);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV);
	CHECK_EQ(wc[0].byte_len, 100);
	CHECK_EQ(wc[0].wc_flags & IBV_WC_WITH_IMM, 0);
	CHECK_EQ(wc[0].qp_num, b->qp_num);
	CHECK(wc[0].src_qp == 0 || wc[0].src_qp == a->qp_num);
	CHECK(memcmp(src, dst, 100) == 0);

	/* SEND_WITH_IMM: imm_data arrives as given (network order). */
	uint32_t imm = htonl(0x12345678);
	CHECK_EQ(post_recv1(b, 20, dst, 256, mr->lkey), 0);
	memset(&w, 0, sizeof(w));
	s = (struct ibv_sge){ base, 33, mr->lkey };
	w.wr_id = 21;
	w.opcode = IBV_WR_SEND_WITH_IMM;
	w.sg_list = &s;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.imm_data = imm;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_SEND);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV);
	CHECK_EQ(wc[0].byte_len, 33);
	CHECK(wc[0].wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc[0].imm_data, imm);

	/* RDMA_WRITE_WITH_IMM: consumes a RECV; RECV_RDMA_WITH_IMM, byte_len = length. */
	CHECK_EQ(post_recv1(b, 30, dst, 16, mr->lkey), 0);
	memset(&w, 0, sizeof(w));
	s = (struct ibv_sge){ base, 200, mr->lkey };
	w.wr_id = 31;
	w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	w.sg_list = &s;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.imm_data = htonl(0xabcdef01);
	w.wr.rdma.remote_addr = base + 16384;
	w.wr.rdma.rkey = mr->rkey;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_RDMA_WRITE);
	CHECK_EQ(wc[0].wr_id, 31);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].wr_id, 30);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc[0].byte_len, 200);
	CHECK(wc[0].wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc[0].imm_data, htonl(0xabcdef01));
	CHECK(memcmp(buf, buf + 16384, 200) == 0);

	/* Plain WRITE then READ back. */
	CHECK_EQ(post_send1(a, 40, IBV_WR_RDMA_WRITE, src, 64, mr->lkey, base + 20000, mr->rkey, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(post_send1(a, 41, IBV_WR_RDMA_READ, buf + 30000, 64, mr->lkey, base + 20000, mr->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 2, 5);
	CHECK_EQ(wc[0].opcode, IBV_WC_RDMA_WRITE);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[1].opcode, IBV_WC_RDMA_READ);
	CHECK_EQ(wc[1].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[1].byte_len, 64);
	CHECK(memcmp(src, buf + 30000, 64) == 0);

	/* Atomics. */
	uint64_t *target = (uint64_t *)(buf + 40000), *res = (uint64_t *)(buf + 40064);
	*target = 5;
	memset(&w, 0, sizeof(w));
	s = (struct ibv_sge){ (uintptr_t)res, 8, mr->lkey };
	w.wr_id = 50;
	w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	w.sg_list = &s;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.wr.atomic.remote_addr = (uintptr_t)target;
	w.wr.atomic.rkey = mr->rkey;
	w.wr.atomic.compare_add = 10;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_FETCH_ADD);
	CHECK_EQ(wc[0].byte_len, 8);
	CHECK_EQ(*res, 5);
	CHECK_EQ(*target, 15);
	w.wr_id = 51;
	w.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
	w.wr.atomic.compare_add = 15;
	w.wr.atomic.swap = 99;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_COMP_SWAP);
	CHECK_EQ(wc[0].byte_len, 8);
	CHECK_EQ(*res, 15);
	CHECK_EQ(*target, 99);
	w.wr_id = 52; /* compare fails: no swap, old value returned */
	w.wr.atomic.compare_add = 1;
	w.wr.atomic.swap = 7;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	poll_n(cqa, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(*res, 99);
	CHECK_EQ(*target, 99);

	/* Zero-length SEND (num_sge 0), WRITE and READ (length 0). */
	CHECK_EQ(post_recv1(b, 60, dst, 16, mr->lkey), 0);
	memset(&w, 0, sizeof(w));
	w.wr_id = 61;
	w.opcode = IBV_WR_SEND;
	w.send_flags = IBV_SEND_SIGNALED;
	CHECK_EQ(ibv_post_send(a, &w, &bad), 0);
	CHECK_EQ(post_send1(a, 62, IBV_WR_RDMA_WRITE, src, 0, mr->lkey, base + 20000, mr->rkey, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(post_send1(a, 63, IBV_WR_RDMA_READ, src, 0, mr->lkey, base + 20000, mr->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cqa, wc, 3, 5);
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[i].wr_id, 61 + i);
	}
	CHECK_EQ(wc[2].byte_len, 0);
	poll_n(cqb, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].byte_len, 0);

	/* sq_sig_all=0: only signaled WRs complete; a chain of 40 WRs in one post. */
	struct ibv_send_wr ch[40];
	struct ibv_sge cs[40];
	memset(ch, 0, sizeof(ch));
	for (int i = 0; i < 40; i++) {
		cs[i] = (struct ibv_sge){ base + i * 8, 8, mr->lkey };
		ch[i].wr_id = 100 + i;
		ch[i].opcode = IBV_WR_RDMA_WRITE;
		ch[i].sg_list = &cs[i];
		ch[i].num_sge = 1;
		ch[i].send_flags = (i % 10 == 9) ? IBV_SEND_SIGNALED : 0;
		ch[i].wr.rdma.remote_addr = base + 50000 + i * 8;
		ch[i].wr.rdma.rkey = mr->rkey;
		ch[i].next = i < 39 ? &ch[i + 1] : NULL;
	}
	CHECK_EQ(ibv_post_send(a, ch, &bad), 0);
	poll_n(cqa, wc, 4, 5);
	for (int i = 0; i < 4; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[i].wr_id, 109 + 10 * i);
	}
	expect_empty(cqa, 0.2);
	CHECK(memcmp(buf, buf + 50000, 320) == 0);

	/* Misaligned atomic: an error completion (not SUCCESS), QP to ERR. */
	memset(&w, 0, sizeof(w));
	s = (struct ibv_sge){ (uintptr_t)res, 8, mr->lkey };
	w.wr_id = 70;
	w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	w.sg_list = &s;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.wr.atomic.remote_addr = (uintptr_t)target + 4;
	w.wr.atomic.rkey = mr->rkey;
	w.wr.atomic.compare_add = 1;
	int rc = ibv_post_send(a, &w, &bad);
	if (rc == 0) {
		poll_n(cqa, wc, 1, 5);
		CHECK(wc[0].status == IBV_WC_REM_INV_REQ_ERR || wc[0].status == IBV_WC_REM_ACCESS_ERR);
		CHECK_EQ(wc[0].wr_id, 70);
		CHECK_EQ(qp_state(a), IBV_QPS_ERR);
	} else {
		CHECK_EQ(rc, EINVAL);
	}
	CHECK_EQ(*target, 99);

	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_destroy_cq(cqa), 0);
	CHECK_EQ(ibv_destroy_cq(cqb), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("wc_fields ok\n");
	return 0;
}
