/* Unreliable datagram QPs as rxe/mlx5 give them: UD transitions (Q_Key at INIT,
 * RTR with the state only, RTS with the SQ PSN), ibv_query_qp's qkey, address
 * handles (GRH required, EINVAL otherwise; PD busy while one exists), SEND and
 * SEND_WITH_IMM only; a receive gets the 40-byte GRH (sgid = the sender's GID) then
 * the payload, its completion src_qp, IBV_WC_GRH, WITH_IMM + imm_data, pkey_index,
 * slid and dlid_path_bits 0; ibv_init_ah_from_wc / ibv_create_ah_from_wc answer the
 * sender; nothing is acknowledged — a datagram with another Q_Key, for no QP, too
 * large for the receive (dropped, the receive stays) or longer than the MTU (never
 * sent) still completes successfully at the sender; the ibv_wr_* builder with
 * ibv_wr_set_ud_addr; a QP of UCX ud_verbs' size (4096 receives, 256 sends of 6 SGEs,
 * 64 B inline) and a 6-SGE gather. The same in NP-RDMA mode (its UD QPs pin a WR's
 * pages while it is posted); its user-space mode (NPRDMA_DEVICE=verbs) refuses UD
 * QPs and AHs (EOPNOTSUPP): skipped. */
#include "common.h"
#include <arpa/inet.h>

#define QKEY 0x11111111u

static struct ibv_qp *ud_qp(struct env *e, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_UD;
	a.cap.max_send_wr = 16;
	a.cap.max_recv_wr = 16;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	return ibv_create_qp(e->pd, &a);
}

static void ud_up(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qkey = QKEY;
	/* The Q_Key is required; access flags are not UD's. */
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) != 0);
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				     IBV_QP_QKEY | IBV_QP_ACCESS_FLAGS) != 0);
	CHECK_EQ(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					       IBV_QP_QKEY),
		 0);
	memset(&a, 0, sizeof(a));
	CHECK_EQ(ibv_query_qp(qp, &a, IBV_QP_QKEY, &i), 0);
	CHECK_EQ(a.qkey, QKEY);
	CHECK_EQ(i.qp_type, IBV_QPT_UD);
	a.qp_state = IBV_QPS_RTR;
	CHECK_EQ(ibv_modify_qp(qp, &a, IBV_QP_STATE), 0);
	a.qp_state = IBV_QPS_RTS;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) != 0); /* SQ_PSN required */
	a.sq_psn = 5;
	CHECK_EQ(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
	CHECK_EQ(qp_state(qp), IBV_QPS_RTS);
}

static int send_ud(struct ibv_qp *qp, uint64_t id, enum ibv_wr_opcode op, void *addr,
		   uint32_t len, uint32_t lkey, struct ibv_ah *ah, uint32_t qpn, uint32_t qkey,
		   uint32_t imm)
{
	struct ibv_sge s = { .addr = (uintptr_t)addr, .length = len, .lkey = lkey };
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = id;
	wr.opcode = op;
	wr.sg_list = &s;
	wr.num_sge = 1;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = imm;
	wr.wr.ud.ah = ah;
	wr.wr.ud.remote_qpn = qpn;
	wr.wr.ud.remote_qkey = qkey;
	int rc = ibv_post_send(qp, &wr, &bad);
	CHECK(rc == 0 || bad == &wr);
	return rc;
}

/* Send and expect the sender's successful completion. */
static void sent(struct ibv_qp *qp, struct ibv_cq *cq, uint64_t id, enum ibv_wr_opcode op,
		 void *addr, uint32_t len, uint32_t lkey, struct ibv_ah *ah, uint32_t qpn,
		 uint32_t qkey)
{
	struct ibv_wc wc;
	CHECK_EQ(send_ud(qp, id, op, addr, len, lkey, ah, qpn, qkey, htonl(0xabcd)), 0);
	poll_n(cq, &wc, 1, 5);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	CHECK_EQ(wc.wr_id, id);
	CHECK_EQ(wc.opcode, IBV_WC_SEND);
}

int main(void)
{
	struct env e;
	env_open(&e);
	struct ibv_cq *cqa = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	struct ibv_cq *cqb = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cqa && cqb);
	struct ibv_ah_attr aa;
	memset(&aa, 0, sizeof(aa));
	aa.port_num = 1;
	aa.is_global = 1;
	aa.grh.dgid = e.gid;
	aa.grh.hop_limit = 1;
	/* The device says whether it makes address handles (max_ah). */
	struct ibv_device_attr da;
	CHECK_EQ(ibv_query_device(e.ctx, &da), 0);
	const char *dev = getenv("NPRDMA_DEVICE");
	if (np_mode() && dev && !strcmp(dev, "verbs")) {
		CHECK_EQ(da.max_ah, 0);
		errno = 0;
		CHECK(ud_qp(&e, cqa) == NULL);
		CHECK_EQ(errno, EOPNOTSUPP);
		errno = 0;
		CHECK(ibv_create_ah(e.pd, &aa) == NULL);
		CHECK_EQ(errno, EOPNOTSUPP);
		printf("skipping the UD checks: NP-RDMA's user-space mode refuses UD QPs "
		       "(EOPNOTSUPP)\n");
		return 0;
	}
	CHECK(da.max_ah > 0);
	struct ibv_qp *a = ud_qp(&e, cqa), *b = ud_qp(&e, cqb);
	CHECK(a && b);
	CHECK_EQ(a->qp_type, IBV_QPT_UD);
	ud_up(a);
	ud_up(b);

	/* Address handles: without a GRH by a LID some port has (0 is none's), an
	 * sgid index inside the port's GID table, a reachable GID. */
	struct ibv_port_attr pa;
	CHECK_EQ(ibv_query_port(e.ctx, 1, &pa), 0);
	aa.is_global = 0;
	aa.dlid = 0;
	errno = 0;
	CHECK(ibv_create_ah(e.pd, &aa) == NULL);
	CHECK_EQ(errno, EINVAL);
	aa.is_global = 1;
	aa.grh.sgid_index = pa.gid_tbl_len;
	errno = 0;
	CHECK(ibv_create_ah(e.pd, &aa) == NULL);
	CHECK_EQ(errno, EINVAL);
	aa.grh.sgid_index = 0;
	struct ibv_ah *ah = ibv_create_ah(e.pd, &aa);
	CHECK(ah);
	CHECK(ah->pd == e.pd && ah->context == e.ctx);
	CHECK_EQ(ibv_dealloc_pd(e.pd), EBUSY);

	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);
	char *src = buf, *dst = buf + 16384, *dst2 = buf + 32768;
	for (int i = 0; i < 8192; i++)
		src[i] = (char)(i * 7 + 1);
	struct ibv_wc wc;

	/* Only SEND / SEND_WITH_IMM. */
	CHECK_EQ(send_ud(a, 1, IBV_WR_RDMA_WRITE, src, 8, mr->lkey, ah, b->qp_num, QKEY, 0),
		 EINVAL);
	CHECK_EQ(send_ud(a, 1, IBV_WR_RDMA_READ, src, 8, mr->lkey, ah, b->qp_num, QKEY, 0),
		 EINVAL);

	/* SEND_WITH_IMM: GRH first, then the payload. */
	CHECK_EQ(post_recv1(b, 20, dst, 40 + 100, mr->lkey), 0);
	CHECK_EQ(send_ud(a, 2, IBV_WR_SEND_WITH_IMM, src, 100, mr->lkey, ah, b->qp_num, QKEY,
			 htonl(0x12345678)),
		 0);
	poll_n(cqa, &wc, 1, 5);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	CHECK_EQ(wc.opcode, IBV_WC_SEND);
	poll_n(cqb, &wc, 1, 5);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	CHECK_EQ(wc.wr_id, 20);
	CHECK_EQ(wc.opcode, IBV_WC_RECV);
	CHECK_EQ(wc.byte_len, 140);
	CHECK_EQ(wc.qp_num, b->qp_num);
	CHECK_EQ(wc.src_qp, a->qp_num);
	CHECK_EQ(wc.wc_flags, IBV_WC_GRH | IBV_WC_WITH_IMM);
	CHECK_EQ(ntohl(wc.imm_data), 0x12345678);
	CHECK_EQ(wc.pkey_index, 0);
	CHECK_EQ(wc.slid, pa.lid); /* the sender's LID (same device here) */
	CHECK_EQ(wc.dlid_path_bits, 0);
	struct ibv_grh *g = (struct ibv_grh *)dst;
	CHECK_EQ(ntohl(g->version_tclass_flow) >> 28, 6);
	CHECK(!memcmp(&g->sgid, &e.gid, 16));
	CHECK(!memcmp(&g->dgid, &e.gid, 16));
	CHECK(!memcmp(dst + 40, src, 100));

	/* Answer the sender: an AH from the completion and its GRH. */
	struct ibv_ah_attr fw;
	CHECK_EQ(ibv_init_ah_from_wc(e.ctx, 1, &wc, g, &fw), 0);
	CHECK_EQ(fw.is_global, 1);
	CHECK(!memcmp(&fw.grh.dgid, &e.gid, 16));
	CHECK_EQ(fw.grh.sgid_index, 0);
	CHECK_EQ(fw.grh.hop_limit, 0xff);
	CHECK_EQ(fw.port_num, 1);
	struct ibv_ah *back = ibv_create_ah_from_wc(e.pd, &wc, g, 1);
	CHECK(back);
	CHECK_EQ(post_recv1(a, 30, dst2, 40 + 8, mr->lkey), 0);
	sent(b, cqb, 3, IBV_WR_SEND, src, 8, mr->lkey, back, wc.src_qp, QKEY);
	poll_n(cqa, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 30);
	CHECK_EQ(wc.byte_len, 48);
	CHECK_EQ(wc.src_qp, b->qp_num);
	CHECK_EQ(wc.wc_flags, IBV_WC_GRH);
	CHECK_EQ(ibv_destroy_ah(back), 0);

	/* Refused at the responder, successful at the sender: another Q_Key, no such
	 * QP, a receive too small (it stays), longer than the MTU (never sent). */
	CHECK_EQ(post_recv1(b, 21, dst, 40 + 64, mr->lkey), 0);
	sent(a, cqa, 4, IBV_WR_SEND, src, 10, mr->lkey, ah, b->qp_num, QKEY + 1);
	sent(a, cqa, 5, IBV_WR_SEND, src, 10, mr->lkey, ah, 0xabcdef, QKEY);
	sent(a, cqa, 6, IBV_WR_SEND, src, 65, mr->lkey, ah, b->qp_num, QKEY);
	sent(a, cqa, 7, IBV_WR_SEND, src, 4097, mr->lkey, ah, b->qp_num, QKEY);
	expect_empty(cqb, 0.05);
	/* The receive is still posted; a Q_Key with the high bit set is the QP's own. */
	sent(a, cqa, 8, IBV_WR_SEND, src, 64, mr->lkey, ah, b->qp_num, 0x80000000u);
	poll_n(cqb, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 21);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	CHECK_EQ(wc.byte_len, 104);
	CHECK(!memcmp(dst + 40, src, 64));
	CHECK_EQ(qp_state(a), IBV_QPS_RTS);
	CHECK_EQ(qp_state(b), IBV_QPS_RTS);

	/* The ibv_wr_* builder: SEND ops only on UD; ibv_wr_set_ud_addr. */
	struct ibv_qp_init_attr_ex x;
	memset(&x, 0, sizeof(x));
	x.qp_type = IBV_QPT_UD;
	x.send_cq = cqa;
	x.recv_cq = cqa;
	x.cap.max_send_wr = 4;
	x.cap.max_recv_wr = 4;
	x.cap.max_send_sge = 1;
	x.cap.max_recv_sge = 1;
	x.pd = e.pd;
	x.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	x.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
	errno = 0;
	CHECK(ibv_create_qp_ex(e.ctx, &x) == NULL);
	CHECK_EQ(errno, EOPNOTSUPP);
	x.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
	struct ibv_qp *c = ibv_create_qp_ex(e.ctx, &x);
	CHECK(c);
	ud_up(c);
	struct ibv_qp_ex *cx = ibv_qp_to_qp_ex(c);
	CHECK(cx);
	CHECK_EQ(post_recv1(b, 22, dst, 40 + 32, mr->lkey), 0);
	ibv_wr_start(cx);
	cx->wr_id = 9;
	cx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(cx, htonl(77));
	ibv_wr_set_ud_addr(cx, ah, b->qp_num, QKEY);
	ibv_wr_set_sge(cx, mr->lkey, (uintptr_t)src, 32);
	CHECK_EQ(ibv_wr_complete(cx), 0);
	poll_n(cqa, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 9);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	poll_n(cqb, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 22);
	CHECK_EQ(wc.byte_len, 72);
	CHECK_EQ(wc.src_qp, c->qp_num);
	CHECK_EQ(ntohl(wc.imm_data), 77);
	CHECK_EQ(wc.wc_flags, IBV_WC_GRH | IBV_WC_WITH_IMM);

	/* What UCX's ud_verbs asks: 4096 receives of 1 SGE, 256 sends of 6 SGEs, 64 B
	 * inline. A 6-SGE SEND gathers into one receive. */
	struct ibv_qp_init_attr u;
	memset(&u, 0, sizeof(u));
	u.send_cq = cqb;
	u.recv_cq = cqb;
	u.qp_type = IBV_QPT_UD;
	u.cap.max_send_wr = 256;
	u.cap.max_recv_wr = 4096;
	u.cap.max_send_sge = 6;
	u.cap.max_recv_sge = 1;
	u.cap.max_inline_data = 64;
	struct ibv_qp *big = ibv_create_qp(e.pd, &u);
	CHECK(big);
	u.send_cq = cqa;
	u.recv_cq = cqa;
	struct ibv_qp *tx = ibv_create_qp(e.pd, &u);
	CHECK(tx);
	ud_up(tx);
	CHECK(u.cap.max_recv_wr >= 4096 && u.cap.max_send_sge >= 6 &&
	      u.cap.max_inline_data >= 64);
	ud_up(big);
	for (int i = 0; i < 4096; i++)
		CHECK_EQ(post_recv1(big, 1000 + i, dst + (i % 4) * 1024, 40 + 600, mr->lkey), 0);
	struct ibv_sge six[6];
	for (int i = 0; i < 6; i++) {
		six[i].addr = (uintptr_t)(src + i * 1000);
		six[i].length = 100;
		six[i].lkey = mr->lkey;
	}
	struct ibv_send_wr sw, *bad = NULL;
	memset(&sw, 0, sizeof(sw));
	sw.wr_id = 10;
	sw.opcode = IBV_WR_SEND;
	sw.sg_list = six;
	sw.num_sge = 6;
	sw.send_flags = IBV_SEND_SIGNALED;
	sw.wr.ud.ah = ah;
	sw.wr.ud.remote_qpn = big->qp_num;
	sw.wr.ud.remote_qkey = QKEY;
	memset(dst, 0, 1024);
	CHECK_EQ(ibv_post_send(tx, &sw, &bad), 0);
	poll_n(cqa, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 10);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	poll_n(cqb, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 1000);
	CHECK_EQ(wc.byte_len, 640);
	for (int i = 0; i < 6; i++)
		CHECK(!memcmp(dst + 40 + i * 100, src + i * 1000, 100));
	/* Inline: the payload is taken at post time. */
	char tmp[64];
	memcpy(tmp, src, 64);
	memset(&sw, 0, sizeof(sw));
	struct ibv_sge is = { .addr = (uintptr_t)tmp, .length = 64, .lkey = 0 };
	sw.wr_id = 11;
	sw.opcode = IBV_WR_SEND;
	sw.sg_list = &is;
	sw.num_sge = 1;
	sw.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	sw.wr.ud.ah = ah;
	sw.wr.ud.remote_qpn = big->qp_num;
	sw.wr.ud.remote_qkey = QKEY;
	CHECK_EQ(ibv_post_send(tx, &sw, &bad), 0);
	memset(tmp, 0, sizeof(tmp));
	poll_n(cqa, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 11);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	poll_n(cqb, &wc, 1, 5);
	CHECK_EQ(wc.wr_id, 1001);
	CHECK_EQ(wc.byte_len, 104);
	CHECK(!memcmp(dst + 1024 + 40, src, 64));
	/* Destroyed with 4094 receives posted: no completions, nothing leaks. */
	CHECK_EQ(ibv_destroy_qp(big), 0);
	CHECK_EQ(ibv_destroy_qp(tx), 0);
	expect_empty(cqb, 0.01);

	CHECK_EQ(ibv_destroy_qp(c), 0);
	CHECK_EQ(ibv_destroy_ah(ah), 0);
	CHECK_EQ(ibv_destroy_cq(cqa), EBUSY);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_cq(cqa), 0);
	close_pair(&e, b, ud_qp(&e, cqb), mr, cqb);
	printf("ud: ok\n");
	return 0;
}
