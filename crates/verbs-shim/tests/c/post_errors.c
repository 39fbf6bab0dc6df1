/* ibv_post_send / ibv_post_recv refusals: too many SGEs, queue overflow (ENOMEM),
 * inline larger than max_inline_data, bad opcode; *bad_wr points at the failing WR
 * and the WRs before it are posted (and complete). */
#include "common.h"
#include <endian.h>

#define DEPTH 4

/* w[0..n): a chain of signaled RDMA WRITEs of sge to remote/rkey, wr_ids from id0. */
static void write_chain(struct ibv_send_wr *w, int n, uint64_t id0, struct ibv_sge *sge,
			uint64_t remote, uint32_t rkey)
{
	memset(w, 0, n * sizeof(*w));
	for (int i = 0; i < n; i++) {
		w[i].wr_id = id0 + i;
		w[i].opcode = IBV_WR_RDMA_WRITE;
		w[i].sg_list = sge;
		w[i].num_sge = 1;
		w[i].send_flags = IBV_SEND_SIGNALED;
		w[i].wr.rdma.remote_addr = remote;
		w[i].wr.rdma.rkey = rkey;
		w[i].next = i < n - 1 ? &w[i + 1] : NULL;
	}
}

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp *a = make_qp_caps(&e, cq, cq, DEPTH, 1, 16, 1);
	struct ibv_qp *b = make_qp_caps(&e, cq, cq, DEPTH, 1, 0, 1);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK_EQ(ibv_query_qp(a, &qa, IBV_QP_CAP, &qi), 0);
	uint32_t sdepth = qa.cap.max_send_wr, rdepth = qa.cap.max_recv_wr;
	uint32_t max_inline = qa.cap.max_inline_data, max_sge = qa.cap.max_send_sge;
	CHECK(sdepth >= DEPTH && rdepth >= DEPTH && max_inline >= 16);
	connect_pair(&e, a, b, 7);
	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, ALL_ACCESS);
	CHECK(mr);

	struct ibv_sge sge[64];
	for (int i = 0; i < 64; i++) {
		sge[i].addr = (uintptr_t)buf + 64 * i;
		sge[i].length = 8;
		sge[i].lkey = mr->lkey;
	}
	struct ibv_send_wr w[8], *bad;
	struct ibv_recv_wr r[8], *rbad;
	struct ibv_wc wc[64];

	/* Chain: good, too many SGEs, good. bad_wr = second; first posted. */
	write_chain(w, 3, 100, sge, (uintptr_t)buf + 32768, mr->rkey);
	w[1].num_sge = max_sge + 1;
	bad = NULL;
	int rc = ibv_post_send(a, w, &bad);
	CHECK(rc == EINVAL || rc == ENOMEM);
	CHECK(bad == &w[1]);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 100);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	expect_empty(cq, 0.1);

	/* Recv with too many SGEs. */
	memset(r, 0, sizeof(r));
	for (int i = 0; i < 2; i++) {
		r[i].wr_id = 200 + i;
		r[i].sg_list = sge;
		r[i].num_sge = 1;
		r[i].next = i < 1 ? &r[i + 1] : NULL;
	}
	r[1].num_sge = qa.cap.max_recv_sge + 1;
	rbad = NULL;
	rc = ibv_post_recv(b, r, &rbad);
	CHECK(rc == EINVAL || rc == ENOMEM);
	CHECK(rbad == &r[1]);

	/* Inline larger than max_inline_data: EINVAL, bad_wr the WR. */
	memset(w, 0, sizeof(w));
	struct ibv_sge big = { .addr = (uintptr_t)buf, .length = max_inline + 1, .lkey = mr->lkey };
	w[0].wr_id = 300;
	w[0].opcode = IBV_WR_RDMA_WRITE;
	w[0].sg_list = &big;
	w[0].num_sge = 1;
	w[0].send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	w[0].wr.rdma.remote_addr = (uintptr_t)buf + 32768;
	w[0].wr.rdma.rkey = mr->rkey;
	bad = NULL;
	rc = ibv_post_send(a, w, &bad);
	CHECK(rc != 0);
	CHECK(bad == &w[0]);
	expect_empty(cq, 0.1);
	/* Inline at the limit (lkey not checked for inline). */
	big.length = max_inline;
	big.lkey = 0xdeadbeef;
	for (uint32_t i = 0; i < max_inline; i++)
		buf[i] = (char)i;
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].wr_id, 300);
	CHECK_EQ(wc[0].opcode, IBV_WC_RDMA_WRITE);
	CHECK(memcmp(buf, buf + 32768, max_inline) == 0);

	/* Bad opcode: error, bad_wr it, earlier posted. */
	write_chain(w, 2, 400, sge, (uintptr_t)buf + 32768, mr->rkey);
	w[1].opcode = (enum ibv_wr_opcode)77;
	bad = NULL;
	rc = ibv_post_send(a, w, &bad);
	CHECK(rc == EINVAL || rc == EOPNOTSUPP);
	CHECK(bad == &w[1]);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 400);
	expect_empty(cq, 0.1);

	/* The RECV posted before the refused one (wr_id 200) takes a SEND. */
	CHECK_EQ(post_send1(a, 450, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(cq, wc, 2, 5);
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[i].wr_id, wc[i].opcode == IBV_WC_RECV ? 200 : 450);
	}

	/* Send queue overflow: ENOMEM at WR sdepth, the first sdepth posted. No
	 * RECVs posted at b, so the SENDs wait (RNR retry 7 = infinite). */
	struct ibv_send_wr *many = calloc(sdepth + 2, sizeof(*many));
	for (uint32_t i = 0; i < sdepth + 2; i++) {
		many[i].wr_id = 1000 + i;
		many[i].opcode = IBV_WR_SEND;
		many[i].sg_list = sge;
		many[i].num_sge = 1;
		many[i].send_flags = IBV_SEND_SIGNALED;
		many[i].next = i + 1 < sdepth + 2 ? &many[i + 1] : NULL;
	}
	bad = NULL;
	rc = ibv_post_send(a, many, &bad);
	CHECK_EQ(rc, ENOMEM);
	if (bad != &many[sdepth]) fprintf(stderr, "bad idx %ld sdepth %u\n", bad ? (long)(bad - many) : -1L, sdepth);
	CHECK(bad == &many[sdepth]);
	/* The RQ: ENOMEM past its depth too. */
	struct ibv_recv_wr *rmany = calloc(rdepth + 2, sizeof(*rmany));
	for (uint32_t i = 0; i < rdepth + 2; i++) {
		rmany[i].wr_id = 2000 + i;
		rmany[i].sg_list = &sge[10];
		rmany[i].num_sge = 1;
		rmany[i].next = i + 1 < rdepth + 2 ? &rmany[i + 1] : NULL;
	}
	rbad = NULL;
	rc = ibv_post_recv(b, rmany, &rbad);
	CHECK_EQ(rc, ENOMEM);
	if (rbad != &rmany[rdepth]) fprintf(stderr, "rbad idx %ld rdepth %u\n", rbad ? (long)(rbad - rmany) : -1L, rdepth);
	CHECK(rbad == &rmany[rdepth]);
	/* sdepth SENDs complete at a, rdepth (>= sdepth) RECVs... sdepth of them at b. */
	poll_n(cq, wc, 2 * sdepth, 10);
	int sends = 0, recvs = 0;
	for (uint32_t i = 0; i < 2 * sdepth; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		if (wc[i].opcode == IBV_WC_SEND) {
			CHECK_EQ(wc[i].wr_id, 1000 + sends);
			sends++;
		} else {
			CHECK_EQ(wc[i].opcode, IBV_WC_RECV);
			CHECK_EQ(wc[i].wr_id, 2000 + recvs);
			CHECK_EQ(wc[i].byte_len, 8);
			recvs++;
		}
	}
	CHECK_EQ(sends, sdepth);
	CHECK_EQ(recvs, sdepth);
	expect_empty(cq, 0.1);

	/* num_sge 0 SEND (zero length) is legal. */
	CHECK_EQ(post_recv1(b, 501, buf + 1024, 64, mr->lkey), 0);
	memset(w, 0, sizeof(w));
	w[0].wr_id = 500;
	w[0].opcode = IBV_WR_SEND;
	w[0].send_flags = IBV_SEND_SIGNALED;
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 2, 5);
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		if (wc[i].opcode == IBV_WC_RECV)
			CHECK_EQ(wc[i].byte_len, 0);
		else
			CHECK_EQ(wc[i].wr_id, 500);
	}

	/* Zero-length RDMA operations: the responder validates neither R_Key nor VA
	 * (IBTA o9-20; rxe's check_rkey). UCX's rc_verbs flushes with an inline,
	 * SGE-less RDMA WRITE to address 0 with rkey 0; a READ and a WRITE_WITH_IMM
	 * of length 0 are the same rule (the IMM still consumes a receive). */
	memset(w, 0, sizeof(w));
	w[0].wr_id = 510;
	w[0].opcode = IBV_WR_RDMA_WRITE;
	w[0].send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 510);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_RDMA_WRITE);
	CHECK_EQ(post_send1(a, 511, IBV_WR_RDMA_WRITE, buf, 0, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 511);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	memset(w, 0, sizeof(w));
	w[0].wr_id = 512;
	w[0].opcode = IBV_WR_RDMA_READ;
	w[0].send_flags = IBV_SEND_SIGNALED;
	w[0].wr.rdma.remote_addr = 0x1000;
	w[0].wr.rdma.rkey = 0xdead;
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 512);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	CHECK_EQ(wc[0].opcode, IBV_WC_RDMA_READ);
	CHECK_EQ(post_recv1(b, 514, buf + 1024, 64, mr->lkey), 0);
	memset(w, 0, sizeof(w));
	w[0].wr_id = 513;
	w[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	w[0].send_flags = IBV_SEND_SIGNALED;
	w[0].imm_data = htobe32(0x5a5a);
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 2, 5);
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		if (wc[i].wr_id == 514) {
			CHECK_EQ(wc[i].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
			CHECK_EQ(wc[i].byte_len, 0);
			CHECK(wc[i].wc_flags & IBV_WC_WITH_IMM);
			CHECK_EQ(be32toh(wc[i].imm_data), 0x5a5a);
		} else {
			CHECK_EQ(wc[i].wr_id, 513);
			CHECK_EQ(wc[i].opcode, IBV_WC_RDMA_WRITE);
		}
	}
	/* A zero-length WRITE still keeps the QP's order: the SEND posted before it
	 * completes first (an RC QP completes in order). */
	CHECK_EQ(post_recv1(b, 516, buf + 1024, 64, mr->lkey), 0);
	memset(w, 0, sizeof(w));
	w[0].wr_id = 515;
	w[0].opcode = IBV_WR_SEND;
	w[0].sg_list = &(struct ibv_sge){ .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	w[0].num_sge = 1;
	w[0].send_flags = IBV_SEND_SIGNALED;
	w[0].next = &w[1];
	w[1].wr_id = 517;
	w[1].opcode = IBV_WR_RDMA_WRITE;
	w[1].send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	CHECK_EQ(ibv_post_send(a, w, &bad), 0);
	poll_n(cq, wc, 3, 5);
	int seen_send = 0;
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		if (wc[i].wr_id == 515)
			seen_send = 1;
		if (wc[i].wr_id == 517)
			CHECK(seen_send);
	}

	close_pair(&e, a, b, mr, cq);
	printf("post_errors ok\n");
	return 0;
}
