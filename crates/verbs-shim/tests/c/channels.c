/* Completion channels: req_notify_cq (one event per arm, solicited_only),
 * ibv_get_cq_event (cq and cq_context), ack_cq_events, several CQs on one channel,
 * a non-blocking channel fd (EAGAIN). */
#include "common.h"
#include <fcntl.h>
#include <poll.h>
#include <arpa/inet.h>

static struct ibv_comp_channel *ch;

/* The next event within secs, or NULL. */
static struct ibv_cq *event(double secs, void **ctx)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	double end = now_s() + secs;
	for (;;) {
		struct ibv_cq *cq = NULL;
		if (ibv_get_cq_event(ch, &cq, ctx) == 0)
			return cq;
		CHECK_EQ(errno, EAGAIN);
		if (now_s() > end)
			return NULL;
		poll(&p, 1, 10);
	}
}

int main(void)
{
	struct env e;
	env_open(&e);
	ch = ibv_create_comp_channel(e.ctx);
	CHECK(ch);
	int fl = fcntl(ch->fd, F_GETFL);
	CHECK_EQ(fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK), 0);
	int tag1, tag2;
	struct ibv_cq *c1 = ibv_create_cq(e.ctx, 64, &tag1, ch, 0);
	struct ibv_cq *c2 = ibv_create_cq(e.ctx, 64, &tag2, ch, 0);
	CHECK(c1 && c2);
	struct ibv_qp *a = make_qp(&e, c1), *b = make_qp(&e, c2);
	connect_pair(&e, a, b, 7);
	char *buf = xalloc(1 << 16);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, 1 << 16, ALL_ACCESS);
	CHECK(mr);
	struct ibv_wc wc[8];
	void *ctx;
	struct ibv_cq *got;
	unsigned acks1 = 0, acks2 = 0;

	/* Nothing armed, nothing pending: EAGAIN. */
	CHECK(event(0.05, &ctx) == NULL);
	/* Not armed: a completion raises no event. */
	CHECK_EQ(post_send1(a, 1, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(c1, wc, 1, 5);
	CHECK(event(0.1, &ctx) == NULL);

	/* Armed: one event, with the CQ and its context; then disarmed. */
	CHECK_EQ(ibv_req_notify_cq(c1, 0), 0);
	CHECK_EQ(post_send1(a, 2, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED), 0);
	got = event(5, &ctx);
	CHECK(got == c1);
	CHECK(ctx == &tag1);
	acks1++;
	poll_n(c1, wc, 1, 5);
	CHECK_EQ(post_send1(a, 3, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED), 0);
	poll_n(c1, wc, 1, 5);
	CHECK(event(0.1, &ctx) == NULL);

	/* Two CQs on the channel: an event for each, each naming its CQ. */
	CHECK_EQ(ibv_req_notify_cq(c1, 0), 0);
	CHECK_EQ(ibv_req_notify_cq(c2, 0), 0);
	CHECK_EQ(post_recv1(b, 10, buf + 8192, 64, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 4, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	int seen1 = 0, seen2 = 0;
	for (int i = 0; i < 2; i++) {
		got = event(5, &ctx);
		CHECK(got == c1 || got == c2);
		CHECK(ctx == (got == c1 ? (void *)&tag1 : (void *)&tag2));
		if (got == c1) {
			seen1++;
			acks1++;
		} else {
			seen2++;
			acks2++;
		}
	}
	CHECK_EQ(seen1, 1);
	CHECK_EQ(seen2, 1);
	CHECK(event(0.1, &ctx) == NULL);
	poll_n(c1, wc, 1, 5);
	poll_n(c2, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 10);

	/* solicited_only: an unsolicited SEND raises no event at the receiver, a
	 * solicited one does. */
	CHECK_EQ(ibv_req_notify_cq(c2, 1), 0);
	CHECK_EQ(post_recv1(b, 11, buf + 8192, 64, mr->lkey), 0);
	CHECK_EQ(post_recv1(b, 12, buf + 8192, 64, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 5, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(c1, wc, 1, 5);
	usleep(50000);
	CHECK(event(0.1, &ctx) == NULL);
	CHECK_EQ(post_send1(a, 6, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED), 0);
	poll_n(c1, wc, 1, 5);
	got = event(5, &ctx);
	CHECK(got == c2);
	acks2++;
	poll_n(c2, wc, 2, 5);
	CHECK_EQ(wc[0].wr_id, 11);
	CHECK_EQ(wc[1].wr_id, 12);

	/* A large solicited SEND (a rendezvous in NP-RDMA mode) and a
	 * solicited WRITE_WITH_IMM fire it too; an arm for any completion is not
	 * narrowed by a later solicited-only one. */
	CHECK_EQ(ibv_req_notify_cq(c2, 1), 0);
	CHECK_EQ(post_recv1(b, 13, buf + 16384, 8192, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 7, IBV_WR_SEND, buf, 8192, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(c1, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	usleep(50000);
	CHECK(event(0.1, &ctx) == NULL);
	CHECK_EQ(post_recv1(b, 14, buf + 16384, 8192, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 8, IBV_WR_SEND, buf, 8192, mr->lkey, 0, 0, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED), 0);
	poll_n(c1, wc, 1, 5);
	CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
	got = event(5, &ctx);
	CHECK(got == c2);
	acks2++;
	poll_n(c2, wc, 2, 5);
	CHECK_EQ(wc[0].wr_id, 13);
	CHECK_EQ(wc[1].wr_id, 14);
	CHECK_EQ(wc[1].byte_len, 8192);
	CHECK_EQ(ibv_req_notify_cq(c2, 1), 0);
	CHECK_EQ(post_recv1(b, 15, buf + 8192, 64, mr->lkey), 0);
	{
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 9, .sg_list = &sge, .num_sge = 1,
			.opcode = IBV_WR_RDMA_WRITE_WITH_IMM, .send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED,
			.imm_data = htonl(0x1234) }, *bad;
		wr.wr.rdma.remote_addr = (uintptr_t)buf + 4096;
		wr.wr.rdma.rkey = mr->rkey;
		CHECK_EQ(ibv_post_send(a, &wr, &bad), 0);
	}
	poll_n(c1, wc, 1, 5);
	got = event(5, &ctx);
	CHECK(got == c2);
	acks2++;
	poll_n(c2, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 15);
	CHECK_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(ibv_req_notify_cq(c2, 0), 0);
	CHECK_EQ(ibv_req_notify_cq(c2, 1), 0);
	CHECK_EQ(post_recv1(b, 16, buf + 8192, 64, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 10, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	poll_n(c1, wc, 1, 5);
	got = event(5, &ctx);
	CHECK(got == c2);
	acks2++;
	poll_n(c2, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 16);

	/* Armed solicited-only, a receive completing in error fires it: an
	 * unsolicited SEND too long for its receive (LOC_LEN_ERR; the QPs go to
	 * ERR, the last use of them). */
	CHECK_EQ(ibv_req_notify_cq(c2, 1), 0);
	CHECK_EQ(post_recv1(b, 17, buf + 8192, 16, mr->lkey), 0);
	CHECK_EQ(post_send1(a, 11, IBV_WR_SEND, buf, 64, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	got = event(5, &ctx);
	CHECK(got == c2);
	acks2++;
	poll_n(c2, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 17);
	CHECK_EQ(wc[0].status, IBV_WC_LOC_LEN_ERR);
	poll_n(c1, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 11);
	CHECK(wc[0].status != IBV_WC_SUCCESS);

	/* Acks, then everything goes. */
	ibv_ack_cq_events(c1, acks1);
	ibv_ack_cq_events(c2, acks2);
	CHECK_EQ(ibv_destroy_qp(a), 0);
	CHECK_EQ(ibv_destroy_qp(b), 0);
	CHECK_EQ(ibv_destroy_cq(c1), 0);
	CHECK_EQ(ibv_destroy_cq(c2), 0);
	CHECK_EQ(ibv_destroy_comp_channel(ch), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("channels ok\n");
	return 0;
}
