/* Two processes (fork; QPN, GID, address and rkey exchanged over pipes): SEND,
 * WRITE, READ, atomics across processes; then the peer is killed with SIGKILL and
 * the survivor's WRs complete with RETRY_EXC_ERR then WR_FLUSH_ERR within a few
 * seconds. */
#include "common.h"
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

struct info {
	union ibv_gid gid;
	uint32_t qpn, rkey;
	uint64_t addr;
};

#define SZ 65536

int main(void)
{
	int p2c[2], c2p[2];
	CHECK_EQ(pipe(p2c), 0);
	CHECK_EQ(pipe(c2p), 0);
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0)
		prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed parent */
	int rfd = pid ? c2p[0] : p2c[0], wfd = pid ? p2c[1] : c2p[1];

	struct env e;
	env_open(&e);
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp *qp = make_qp(&e, cq);
	char *buf = xalloc(SZ);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, buf, SZ, ALL_ACCESS);
	CHECK(mr);
	struct info me = { e.gid, qp->qp_num, mr->rkey, (uintptr_t)buf }, peer;
	xwrite(wfd, &me, sizeof(me));
	xread(rfd, &peer, sizeof(peer));
	connect_qp(qp, peer.gid, peer.qpn, ALL_ACCESS, 7);
	struct ibv_wc wc[16];
	char c;

	if (pid == 0) {
		/* Child: a RECV, then tell the parent; check what arrived. */
		CHECK_EQ(post_recv1(qp, 1, buf, 4096, mr->lkey), 0);
		for (int i = 0; i < SZ; i++)
			buf[i] = (char)(i * 7);
		*(uint64_t *)(buf + 60000) = 40;
		xwrite(wfd, "r", 1);
		poll_n(cq, wc, 1, 10);
		CHECK_EQ(wc[0].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[0].opcode, IBV_WC_RECV);
		CHECK_EQ(wc[0].byte_len, 1000);
		CHECK_EQ(wc[0].qp_num, qp->qp_num);
		CHECK(wc[0].wc_flags & IBV_WC_WITH_IMM);
		CHECK_EQ(wc[0].imm_data, 0x01020304);
		for (int i = 0; i < 1000; i++)
			CHECK_EQ(buf[i], (char)(i + 3));
		xread(rfd, &c, 1); /* the parent's WRITE and atomic are done */
		for (int i = 0; i < 5000; i++)
			CHECK_EQ(buf[20000 + i], (char)(i + 5));
		CHECK_EQ(*(uint64_t *)(buf + 60000), 42);
		xwrite(wfd, "k", 1);
		pause(); /* killed by the parent */
		return 0;
	}

	/* Parent. */
	xread(rfd, &c, 1);
	for (int i = 0; i < SZ; i++)
		buf[i] = (char)(i + 3);
	struct ibv_sge s = { (uintptr_t)buf, 1000, mr->lkey };
	struct ibv_send_wr w, *bad;
	memset(&w, 0, sizeof(w));
	w.wr_id = 10;
	w.opcode = IBV_WR_SEND_WITH_IMM;
	w.sg_list = &s;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.imm_data = 0x01020304;
	CHECK_EQ(ibv_post_send(qp, &w, &bad), 0);
	for (int i = 0; i < 5000; i++)
		buf[10000 + i] = (char)(i + 5);
	CHECK_EQ(post_send1(qp, 11, IBV_WR_RDMA_WRITE, buf + 10000, 5000, mr->lkey, peer.addr + 20000, peer.rkey, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(post_send1(qp, 12, IBV_WR_RDMA_READ, buf + 30000, 4096, mr->lkey, peer.addr + 4096, peer.rkey, IBV_SEND_SIGNALED), 0);
	memset(&w, 0, sizeof(w));
	struct ibv_sge as = { (uintptr_t)buf + 50000, 8, mr->lkey };
	w.wr_id = 13;
	w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	w.sg_list = &as;
	w.num_sge = 1;
	w.send_flags = IBV_SEND_SIGNALED;
	w.wr.atomic.remote_addr = peer.addr + 60000;
	w.wr.atomic.rkey = peer.rkey;
	w.wr.atomic.compare_add = 2;
	CHECK_EQ(ibv_post_send(qp, &w, &bad), 0);
	poll_n(cq, wc, 4, 10);
	for (int i = 0; i < 4; i++) {
		CHECK_EQ(wc[i].status, IBV_WC_SUCCESS);
		CHECK_EQ(wc[i].wr_id, 10 + i);
	}
	CHECK_EQ(wc[2].opcode, IBV_WC_RDMA_READ);
	CHECK_EQ(wc[2].byte_len, 4096);
	for (int i = 0; i < 4096; i++)
		CHECK_EQ(buf[30000 + i], (char)((4096 + i) * 7));
	CHECK_EQ(*(uint64_t *)(buf + 50000), 40);
	xwrite(wfd, "w", 1);
	xread(rfd, &c, 1);
	CHECK_EQ(c, 'k');

	/* Kill the peer with WRITEs in flight: a prefix succeeds, the first that
	 * does not fails with RETRY_EXC_ERR, the rest and the posted RECV flush,
	 * within a few seconds; WRs posted afterwards flush too. */
	CHECK_EQ(post_recv1(qp, 30, buf + 40000, 64, mr->lkey), 0);
	enum { N = 12 }; /* + the SEND below: within the SQ's 16 */
	for (int i = 0; i < N; i++)
		CHECK_EQ(post_send1(qp, 100 + i, IBV_WR_RDMA_WRITE, buf, 32768, mr->lkey, peer.addr, peer.rkey, IBV_SEND_SIGNALED), 0);
	CHECK_EQ(kill(pid, SIGKILL), 0);
	int st;
	CHECK_EQ(waitpid(pid, &st, 0), pid);
	double t0 = now_s();
	CHECK_EQ(post_send1(qp, 200, IBV_WR_SEND, buf, 64, mr->lkey, 0, 0, IBV_SEND_SIGNALED), 0);
	struct ibv_wc all[N + 2];
	poll_n(cq, all, N + 2, 8);
	double took = now_s() - t0;
	if (took > 5)
		fprintf(stderr, "errors took %.1f s\n", took);
	CHECK(took < 5);
	int k = 0, recv_flushed = 0, ok = 0, retry = 0, flushed = 0;
	for (int i = 0; i < N + 2; i++) {
		if (all[i].wr_id == 30) {
			CHECK_EQ(all[i].status, IBV_WC_WR_FLUSH_ERR);
			recv_flushed++;
			continue;
		}
		CHECK_EQ(all[i].wr_id, k < N ? 100 + k : 200);
		k++;
		switch (all[i].status) {
		case IBV_WC_SUCCESS:
			CHECK(retry == 0 && flushed == 0);
			ok++;
			break;
		case IBV_WC_RETRY_EXC_ERR:
			CHECK(retry == 0 && flushed == 0);
			retry++;
			break;
		case IBV_WC_WR_FLUSH_ERR:
			CHECK_EQ(retry, 1);
			flushed++;
			break;
		default:
			fprintf(stderr, "wr %llu: %s\n", (unsigned long long)all[i].wr_id,
				ibv_wc_status_str(all[i].status));
			CHECK(0);
		}
	}
	CHECK_EQ(recv_flushed, 1);
	CHECK_EQ(retry, 1);
	/* Posted in ERR: flushed. */
	CHECK_EQ(post_send1(qp, 300, IBV_WR_RDMA_READ, buf, 64, mr->lkey, peer.addr, peer.rkey, IBV_SEND_SIGNALED), 0);
	poll_n(cq, wc, 1, 5);
	CHECK_EQ(wc[0].wr_id, 300);
	CHECK_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR);
	CHECK_EQ(qp_state(qp), IBV_QPS_ERR);
	expect_empty(cq, 0.2);
	CHECK_EQ(ibv_destroy_qp(qp), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("two_proc ok (peer death: %.2f s, %d WRITEs done before it)\n", took, ok);
	return 0;
}
