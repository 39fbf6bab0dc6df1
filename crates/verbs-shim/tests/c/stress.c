#define _GNU_SOURCE
/* Memory-pressure stress through <infiniband/verbs.h> only, as a user's program:
 * a server registers a large, mostly never-touched MR (its budget set through the
 * library's own variable, so pages are swapped out while peers work on them); a
 * client runs random READ / WRITE (signaled, and unsignaled bursts ended by a
 * signaled one) / FETCH_ADD / CMP_SWAP from several threads over shared and
 * separate QPs, every byte checked against a model of the server's memory, then a
 * final sweep reads back every page it touched (and some it never did). While it
 * runs the server samples, from the kernel (mincore), how many pages of the MR are
 * resident, and fails when a sample exceeds STRESS_MAX_RESIDENT.
 *
 * Environment (all optional):
 *   STRESS_OPS          operations in all (default 200000)
 *   STRESS_SECS         stop issuing new operations after this (default 60)
 *   STRESS_THREADS      client threads (default 4)
 *   STRESS_QPS          QPs (default threads - 1: thread t uses QP t % QPS, so QP 0
 *                       is shared by two threads and the others are a thread's own)
 *   STRESS_MR_MB        the server's MR (default 256)
 *   STRESS_HOT_KB       the hot part at the MR's start most operations go to
 *                       (default 1024); the rest go anywhere in the MR
 *   STRESS_DEPTH        outstanding WRs per thread (default 16)
 *   STRESS_SEED         (default 1)
 *   STRESS_CLIENTS      client processes, each with its own threads and QPs, on
 *                       disjoint parts of the one MR (default 1)
 *   STRESS_SERVER_BUDGET_PAGES  NPRDMA_BUDGET_PAGES of the server (default 64; 0:
 *                       no budget)
 *   STRESS_MAX_RESIDENT the server fails if a sample of its MR's resident pages
 *                       exceeds this (default: not checked)
 *   STRESS_INIT_KB      the server's CPU writes a pattern over this much of the MR's
 *                       start before the client begins (default 4096)
 *   STRESS_SERVER_CPU   1 (default): while the client runs, a server thread reads
 *                       random pages anywhere in the MR (CPU faults racing the
 *                       remote operations) and writes and checks its own last MiB of
 *                       the MR, which the client never reaches; 0: none
 *   STRESS_SERVER_FORK_EVERY  that thread forks a child every this many page reads
 *                       (default 0: never); the child checks the server's own MiB
 *                       (swapped-out pages included) and reads random pages
 *   STRESS_GID_INDEX    the GID index peers connect to (default 0)
 * Two hosts: `stress tcp-server PORT` (its budget from NPRDMA_BUDGET_PAGES) and
 * `stress tcp-client HOST PORT` (STRESS_CLIENT_IDX for the second of several) exchange
 * over TCP instead of the orchestrator's pipes.
 * Exit 0 only if every completion succeeded, every byte matched and the server
 * kept the resident bound. */
#include "common.h"
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#define MAXQ 16
#define MAXC 4
#define MAXT 16
#define CHUNK 65536 /* a thread owns every T-th chunk of the MR */
#define PAGE 4096

static long envl(const char *k, long d)
{
	const char *v = getenv(k);
	return v && *v ? strtol(v, NULL, 0) : d;
}

struct srv_info {
	union ibv_gid gid;
	uint32_t qpn[MAXQ];
	uint32_t rkey;
	uint64_t addr, len;
};

struct cli_info {
	union ibv_gid gid;
	uint32_t qpn[MAXQ];
};

static int rd_atom(struct ibv_context *ctx)
{
	struct ibv_device_attr a;
	CHECK_EQ(ibv_query_device(ctx, &a), 0);
	int n = a.max_qp_rd_atom < a.max_qp_init_rd_atom ? a.max_qp_rd_atom
							  : a.max_qp_init_rd_atom;
	return n < 1 ? 1 : n > 16 ? 16 : n;
}

static void connect_rc(struct ibv_qp *qp, union ibv_gid gid, uint32_t dqpn, int atom)
{
	CHECK_EQ(to_init(qp, ALL_ACCESS), 0);
	CHECK_EQ(to_rtr_rd(qp, gid, dqpn, atom), 0);
	CHECK_EQ(to_rts_rd(qp, 14, 7, 7, atom), 0);
}


/* STRESS_GID_INDEX: the GID the peers connect to (default 0, the device address):
 * an IP GID when server and client run on two hosts (the tcp-server / tcp-client
 * forms below). */
static void stress_gid(struct env *e)
{
	long i = envl("STRESS_GID_INDEX", 0);
	if (i)
		CHECK_EQ(ibv_query_gid(e->ctx, 1, (int)i, &e->gid), 0);
}

/* The two-host forms: the server listens on TCP `port` (IPv4 and IPv6) for its
 * clients, a client connects to `host` `port`; each exchange then runs over that
 * stream instead of the orchestrator's pipes. */
static int tcp_listen_accept(const char *port, int n, int *fds)
{
	int l = socket(AF_INET6, SOCK_STREAM, 0), one = 1, zero = 0;
	CHECK(l >= 0);
	CHECK_EQ(setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)), 0);
	CHECK_EQ(setsockopt(l, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero)), 0);
	struct sockaddr_in6 a = { .sin6_family = AF_INET6, .sin6_port = htons((uint16_t)atoi(port)) };
	CHECK_EQ(bind(l, (struct sockaddr *)&a, sizeof(a)), 0);
	CHECK_EQ(listen(l, n), 0);
	printf("stress server: listening on %s\n", port);
	fflush(stdout);
	for (int c = 0; c < n; c++) {
		fds[c] = accept(l, NULL, NULL);
		CHECK(fds[c] >= 0);
	}
	close(l);
	return 0;
}

static int tcp_connect(const char *host, const char *port)
{
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *res;
	CHECK_EQ(getaddrinfo(host, port, &hints, &res), 0);
	int fd = -1;
	for (int tries = 0; tries < 100 && fd < 0; tries++) {
		fd = socket(res->ai_family, SOCK_STREAM, 0);
		CHECK(fd >= 0);
		if (connect(fd, res->ai_addr, res->ai_addrlen)) {
			close(fd);
			fd = -1;
			usleep(50000);
		}
	}
	freeaddrinfo(res);
	CHECK(fd >= 0);
	return fd;
}

/* ---------------------------------------------------------------- server */

#define OWN_TAIL (1u << 20) /* the server CPU's own part of the MR */

static inline uint8_t init_byte(uint64_t off)
{
	return (uint8_t)(off * 131 + (off >> 12) * 7 + 1);
}

static char *srv_mem;
static size_t srv_len;
static atomic_int srv_stop;
static long srv_bound, srv_max, srv_samples, srv_over;

static void *sampler(void *arg)
{
	(void)arg;
	size_t pages = srv_len / PAGE;
	unsigned char *vec = malloc(pages);
	CHECK(vec);
	while (!atomic_load(&srv_stop)) {
		CHECK_EQ(mincore(srv_mem, srv_len, vec), 0);
		long n = 0;
		for (size_t i = 0; i < pages; i++)
			n += vec[i] & 1;
		srv_samples++;
		if (n > srv_max)
			srv_max = n;
		if (srv_bound > 0 && n > srv_bound) {
			if (srv_over++ < 5)
				fprintf(stderr,
					"stress server: sample %ld: %ld pages of the MR resident, "
					"bound %ld\n",
					srv_samples, n, srv_bound);
		}
		usleep(2000);
	}
	free(vec);
	return NULL;
}

static long cpu_reads, cpu_writes, cpu_bad, forks, fork_every;
static double fork_max; /* the longest fork() in the server, seconds */

/* The server's own CPU on registered memory while peers work on it: reads of random
 * pages anywhere (they change nothing), and writes of its last MiB, checked. */
static void *cpu_user(void *arg)
{
	(void)arg;
	uint64_t s = 0x1234567;
	size_t pages = srv_len / PAGE, own0 = (srv_len - OWN_TAIL) / PAGE;
	uint32_t gen[OWN_TAIL / PAGE] = { 0 };
	volatile uint64_t sink = 0;
	while (!atomic_load(&srv_stop)) {
		s ^= s << 13, s ^= s >> 7, s ^= s << 17;
		size_t p = s % pages;
		if (p >= own0) {
			uint32_t *w = (uint32_t *)(srv_mem + p * PAGE), g = gen[p - own0];
			for (int i = 0; i < PAGE / 4; i += 97)
				if (w[i] != (g ? g + i : 0) && cpu_bad++ < 5)
					fprintf(stderr, "stress server: own page %zu word %d: %u, "
							"expected %u\n", p, i, w[i], g ? g + i : 0);
			g = gen[p - own0] = (uint32_t)(s >> 32) | 1;
			for (int i = 0; i < PAGE / 4; i += 97)
				w[i] = g + i;
			cpu_writes++;
		} else {
			sink += *(volatile uint64_t *)(srv_mem + p * PAGE + (s >> 40) % (PAGE / 8) * 8);
			cpu_reads++;
		}
		if (cpu_reads % 64 == 0)
			usleep(100);
		if (fork_every && cpu_reads % fork_every == 0) {
			/* A child that reads the registered memory (what the parent wrote
			 * there, swapped-out pages included), then exits. */
			double f0 = now_s();
			pid_t c = fork();
			CHECK(c >= 0);
			if (c > 0 && now_s() - f0 > fork_max)
				fork_max = now_s() - f0;
			if (c == 0) {
				int bad = 0;
				for (size_t q = own0; q < pages; q++) {
					uint32_t *w = (uint32_t *)(srv_mem + q * PAGE), g = gen[q - own0];
					for (int i = 0; i < PAGE / 4; i += 97)
						bad += w[i] != (g ? g + i : 0);
				}
				uint64_t x = s, sum = 0;
				for (int i = 0; i < 256; i++) {
					x ^= x << 13, x ^= x >> 7, x ^= x << 17;
					sum += *(volatile uint8_t *)(srv_mem + x % srv_len);
				}
				(void)sum;
				_exit(bad ? 3 : 0);
			}
			int st;
			CHECK_EQ(waitpid(c, &st, 0), c);
			if (!WIFEXITED(st) || WEXITSTATUS(st)) {
				fprintf(stderr, "stress server: a forked child %s (status %#x)\n",
					WIFEXITED(st) && WEXITSTATUS(st) == 3
						? "read other bytes than the server wrote"
						: "failed",
					st);
				cpu_bad++;
			}
			forks++;
		}
	}
	(void)sink;
	return NULL;
}

static int server(int nc, int *rfd, int *wfd)
{
	int nq = (int)envl("STRESS_QPS", 0);
	struct env e;
	env_open(&e);
	stress_gid(&e);
	int atom = rd_atom(e.ctx);
	srv_len = (size_t)envl("STRESS_MR_MB", 256) << 20;
	srv_bound = envl("STRESS_MAX_RESIDENT", 0);
	srv_mem = mmap(NULL, srv_len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	CHECK(srv_mem != MAP_FAILED);
	struct ibv_mr *mr = ibv_reg_mr(e.pd, srv_mem, srv_len, ALL_ACCESS);
	CHECK(mr);
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp *qp[MAXC * MAXQ];
	struct srv_info me = { .gid = e.gid, .rkey = mr->rkey, .addr = (uintptr_t)srv_mem,
			       .len = srv_len };
	for (int q = 0; q < nc * nq; q++)
		qp[q] = make_qp_caps(&e, cq, cq, 64, 1, 0, 0);
	size_t init = (size_t)envl("STRESS_INIT_KB", 4096) << 10;
	if (init > srv_len - OWN_TAIL)
		init = srv_len - OWN_TAIL;
	for (size_t o = 0; o < init; o++)
		srv_mem[o] = (char)init_byte(o);
	pthread_t th, cpu;
	int use_cpu = (int)envl("STRESS_SERVER_CPU", 1);
	fork_every = envl("STRESS_SERVER_FORK_EVERY", 0);
	CHECK_EQ(pthread_create(&th, NULL, sampler, NULL), 0);
	if (use_cpu)
		CHECK_EQ(pthread_create(&cpu, NULL, cpu_user, NULL), 0);
	for (int c = 0; c < nc; c++) {
		struct cli_info peer;
		xread(rfd[c], &peer, sizeof(peer));
		for (int q = 0; q < nq; q++) {
			connect_rc(qp[c * nq + q], peer.gid, peer.qpn[q], atom);
			me.qpn[q] = qp[c * nq + q]->qp_num;
		}
		xwrite(wfd[c], &me, sizeof(me));
	}
	char c;
	if (envl("STRESS_SERVER_POLL", 0)) {
		/* A server that polls its CQ while it waits (what many do). */
		struct pollfd pf = { .fd = rfd[0], .events = POLLIN };
		struct ibv_wc w;
		while (poll(&pf, 1, 0) == 0)
			CHECK_EQ(ibv_poll_cq(cq, 1, &w), 0);
	}
	for (int i = 0; i < nc; i++)
		xread(rfd[i], &c, 1); /* the clients are done */
	atomic_store(&srv_stop, 1);
	CHECK_EQ(pthread_join(th, NULL), 0);
	if (use_cpu)
		CHECK_EQ(pthread_join(cpu, NULL), 0);
	/* A passive target polls nothing; its CQ stays empty (one-sided only). */
	struct ibv_wc wc;
	CHECK_EQ(ibv_poll_cq(cq, 1, &wc), 0);
	for (int q = 0; q < nc * nq; q++)
		CHECK_EQ(ibv_destroy_qp(qp[q]), 0);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(ibv_destroy_cq(cq), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("stress server: %ld samples of the MR's resident pages (mincore): max %ld, "
	       "bound %ld, over it %ld; CPU: %ld page reads, %ld own-page writes, %ld "
	       "differ; %ld forks, the longest %.1f ms\n",
	       srv_samples, srv_max, srv_bound, srv_over, cpu_reads, cpu_writes, cpu_bad, forks,
	       fork_max * 1e3);
	fflush(stdout);
	long bad = srv_over + cpu_bad;
	for (int i = 0; i < nc; i++)
		xwrite(wfd[i], &bad, sizeof(bad));
	return bad ? 1 : 0;
}

/* ---------------------------------------------------------------- client */

enum kind { K_READ, K_WRITE, K_FADD, K_CSWAP };
static const char *kname[] = { "READ", "WRITE", "FETCH_ADD", "CMP_SWAP" };

struct op {
	atomic_int busy;
	int kind, signaled, burst; /* burst: unsignaled slots this one ends */
	int burst_slot[8];
	uint64_t off;
	uint32_t len;
	char *local;   /* in the local MR */
	char *expect;  /* READ / atomics: what must arrive */
	struct cthread *owner;
};

struct cthread {
	int id;
	struct ibv_qp *qp;
	struct ibv_cq *cq;
	uint32_t lkey;
	uint64_t seed;
	struct op *ops;
	long issued, done, unsignaled, by_kind[4];
	atomic_long completed; /* signaled completions of this thread's ops */
};

static struct cthread thr[MAXT];
static int nthreads, depth, client_idx, nclients = 1;
static long per_thread_ops;
static double end_issue;
static char *model;
static unsigned char *touched;
static uint64_t mr_len, hot_len, raddr;
static uint32_t rkey;
static atomic_long errors;

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

static void fail_op(struct op *o, int tid, const char *what, size_t at)
{
	fprintf(stderr,
		"stress client: thread %d %s of %u B at MR offset %#llx: %s (byte %zu)\n", tid,
		kname[o->kind], o->len, (unsigned long long)o->off, what, at);
	atomic_fetch_add(&errors, 1);
}

/* Check a finished op and free its slot (and those of the burst it ends). Any
 * thread polling the CQ may finish any thread's op. */
static void finish(struct ibv_wc *wc)
{
	struct op *o = (struct op *)(uintptr_t)wc->wr_id;
	struct cthread *t = o->owner;
	int tid = t->id;
	if (wc->status != IBV_WC_SUCCESS) {
		fprintf(stderr, "stress client: thread %d %s of %u B at %#llx: status %s\n", tid,
			kname[o->kind], o->len, (unsigned long long)o->off,
			ibv_wc_status_str(wc->status));
		atomic_fetch_add(&errors, 1);
	} else if (o->kind == K_READ || o->kind == K_FADD || o->kind == K_CSWAP) {
		uint32_t n = o->kind == K_READ ? o->len : 8;
		if (memcmp(o->local, o->expect, n)) {
			size_t i = 0;
			while (o->local[i] == o->expect[i])
				i++;
			fail_op(o, tid, "data differs from the model", i);
		}
	}
	for (int i = 0; i < o->burst; i++)
		atomic_store(&t->ops[o->burst_slot[i]].busy, 0);
	atomic_store(&o->busy, 0);
	atomic_fetch_add(&t->completed, 1);
}

static void poll_some(struct cthread *t)
{
	struct ibv_wc wc[16];
	int n = ibv_poll_cq(t->cq, 16, wc);
	CHECK(n >= 0);
	for (int i = 0; i < n; i++)
		finish(&wc[i]);
}

static int free_slot(struct cthread *t)
{
	for (int i = 0; i < depth; i++)
		if (!atomic_load(&t->ops[i].busy))
			return i;
	return -1;
}

/* An offset of `len` bytes inside a chunk of thread `tid` (hot part mostly). */
static uint64_t pick_off(struct cthread *t, uint32_t len, uint32_t align)
{
	uint64_t span = rnd(&t->seed) % 100 < 85 ? hot_len : mr_len;
	uint64_t stride = (uint64_t)nclients * nthreads;
	uint64_t chunks = span / CHUNK / stride;
	if (chunks == 0)
		chunks = 1;
	uint64_t c = (rnd(&t->seed) % chunks) * stride + client_idx * nthreads + t->id;
	uint64_t in = rnd(&t->seed) % (CHUNK - len + 1);
	in &= ~(uint64_t)(align - 1);
	return c * CHUNK + in;
}

static void mark(uint64_t off, uint32_t len)
{
	for (uint64_t p = off / PAGE; p <= (off + len - 1) / PAGE; p++)
		touched[p] = 1;
}

static int post(struct cthread *t, struct op *o)
{
	struct ibv_sge s = { .addr = (uintptr_t)o->local, .length = o->len, .lkey = t->lkey };
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = (uintptr_t)o;
	wr.sg_list = &s;
	wr.num_sge = 1;
	wr.send_flags = o->signaled ? IBV_SEND_SIGNALED : 0;
	if (o->kind == K_READ || o->kind == K_WRITE) {
		wr.opcode = o->kind == K_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
		wr.wr.rdma.remote_addr = raddr + o->off;
		wr.wr.rdma.rkey = rkey;
	} else {
		wr.opcode = o->kind == K_FADD ? IBV_WR_ATOMIC_FETCH_AND_ADD
					      : IBV_WR_ATOMIC_CMP_AND_SWP;
		wr.wr.atomic.remote_addr = raddr + o->off;
		wr.wr.atomic.rkey = rkey;
		uint64_t cur;
		memcpy(&cur, model + o->off, 8);
		memcpy(o->expect, &cur, 8);
		if (o->kind == K_FADD) {
			uint64_t add = rnd(&t->seed) % 1000 + 1;
			wr.wr.atomic.compare_add = add;
			cur += add;
		} else {
			uint64_t cmp = rnd(&t->seed) % 2 ? cur : rnd(&t->seed);
			uint64_t swp = rnd(&t->seed);
			wr.wr.atomic.compare_add = cmp;
			wr.wr.atomic.swap = swp;
			if (cmp == cur)
				cur = swp;
		}
		memcpy(model + o->off, &cur, 8);
	}
	return ibv_post_send(t->qp, &wr, &bad);
}

/* Fill slot `i` with a random op (the model advanced as the server will see it). */
static struct op *make_op(struct cthread *t, int i, int kind, int signaled)
{
	struct op *o = &t->ops[i];
	o->kind = kind;
	o->signaled = signaled;
	o->burst = 0;
	if (kind == K_FADD || kind == K_CSWAP) {
		o->len = 8;
		o->off = pick_off(t, 8, 8);
	} else {
		uint64_t r = rnd(&t->seed) % 100;
		o->len = r < 40 ? 1 + rnd(&t->seed) % 64
			 : r < 75 ? 65 + rnd(&t->seed) % 4032
				  : 4097 + rnd(&t->seed) % (CHUNK - 4096);
		o->off = pick_off(t, o->len, 1);
	}
	mark(o->off, o->len);
	if (kind == K_WRITE) {
		for (uint32_t k = 0; k < o->len; k += 8) {
			uint64_t v = rnd(&t->seed);
			memcpy(o->local + k, &v, o->len - k < 8 ? o->len - k : 8);
		}
		memcpy(model + o->off, o->local, o->len);
	} else if (kind == K_READ) {
		memcpy(o->expect, model + o->off, o->len);
		memset(o->local, 0xa5, o->len);
	} else {
		memset(o->local, 0xa5, 8);
	}
	atomic_store(&o->busy, 1);
	t->by_kind[kind]++;
	t->issued++;
	return o;
}

static void *client_thread(void *arg)
{
	struct cthread *t = arg;
	double last = now_s();
	long last_done = 0;
	while (t->issued < per_thread_ops && now_s() < end_issue && !atomic_load(&errors)) {
		poll_some(t);
		long c = atomic_load(&t->completed);
		if (c != last_done) {
			last_done = c;
			last = now_s();
		} else if (now_s() - last > 30) {
			fprintf(stderr, "stress client: thread %d: no completion for 30 s\n", t->id);
			atomic_fetch_add(&errors, 1);
			break;
		}
		int i = free_slot(t);
		if (i < 0)
			continue;
		uint64_t r = rnd(&t->seed) % 100;
		if (r < 15) {
			/* A burst of unsignaled WRITEs ended by a signaled one. */
			int want = 2 + (int)(rnd(&t->seed) % 5), k = 0, slots[8];
			slots[k++] = i;
			atomic_store(&t->ops[i].busy, 1);
			while (k < want) {
				int j = free_slot(t);
				if (j < 0)
					break;
				atomic_store(&t->ops[j].busy, 1);
				slots[k++] = j;
			}
			for (int b = 0; b < k; b++) {
				int last_one = b == k - 1;
				struct op *o = make_op(t, slots[b], K_WRITE, last_one);
				if (last_one) {
					o->burst = k - 1;
					memcpy(o->burst_slot, slots, sizeof(int) * (k - 1));
				} else {
					t->unsignaled++;
				}
				CHECK_EQ(post(t, o), 0);
			}
			continue;
		}
		int kind = r < 50 ? K_READ : r < 80 ? K_WRITE : r < 90 ? K_FADD : K_CSWAP;
		CHECK_EQ(post(t, make_op(t, i, kind, 1)), 0);
	}
	/* Drain. */
	double end = now_s() + 60;
	for (;;) {
		int busy = 0;
		for (int i = 0; i < depth; i++)
			busy += atomic_load(&t->ops[i].busy);
		if (!busy)
			break;
		poll_some(t);
		if (now_s() > end) {
			fprintf(stderr, "stress client: thread %d: %d ops never completed\n",
				t->id, busy);
			atomic_fetch_add(&errors, 1);
			break;
		}
	}
	return NULL;
}

static int client(int rfd, int wfd)
{
	nthreads = (int)envl("STRESS_THREADS", 4);
	int nq = (int)envl("STRESS_QPS", 0);
	CHECK(nthreads >= 1 && nthreads <= MAXT && nq >= 1 && nq <= MAXQ);
	depth = (int)envl("STRESS_DEPTH", 16);
	CHECK(depth >= 8 && depth <= 64);
	long total = envl("STRESS_OPS", 200000);
	per_thread_ops = (total + nthreads - 1) / nthreads;
	struct env e;
	env_open(&e);
	stress_gid(&e);
	int atom = rd_atom(e.ctx);
	struct ibv_cq *cq[MAXQ];
	struct ibv_qp *qp[MAXQ];
	struct cli_info me = { .gid = e.gid };
	for (int q = 0; q < nq; q++) {
		cq[q] = ibv_create_cq(e.ctx, 4 * depth, NULL, NULL, 0);
		CHECK(cq[q]);
		qp[q] = make_qp_caps(&e, cq[q], cq[q], 2 * depth + 8, 1, 0, 0);
		me.qpn[q] = qp[q]->qp_num;
	}
	/* Local buffers of every slot of every thread: one MR. */
	size_t slot = CHUNK, lbytes = (size_t)nthreads * depth * slot;
	char *local = mmap(NULL, lbytes, PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(local != MAP_FAILED);
	struct ibv_mr *lmr = ibv_reg_mr(e.pd, local, lbytes, ALL_ACCESS);
	CHECK(lmr);
	xwrite(wfd, &me, sizeof(me));
	struct srv_info peer;
	xread(rfd, &peer, sizeof(peer));
	for (int q = 0; q < nq; q++)
		connect_rc(qp[q], peer.gid, peer.qpn[q], atom);
	mr_len = peer.len - OWN_TAIL; /* the server CPU's own MiB is left out */
	raddr = peer.addr;
	rkey = peer.rkey;
	hot_len = (uint64_t)envl("STRESS_HOT_KB", 1024) << 10;
	if (hot_len > mr_len)
		hot_len = mr_len;
	CHECK(hot_len >= (uint64_t)CHUNK * nthreads * nclients);
	model = mmap(NULL, mr_len, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	CHECK(model != MAP_FAILED);
	touched = calloc(mr_len / PAGE, 1);
	CHECK(touched);
	/* Pages of other clients' chunks are theirs to check: marked so that the
	 * sweep (and its never-touched picks) leave them alone. */
	uint64_t stride = (uint64_t)nclients * nthreads;
	for (uint64_t p = 0; p < mr_len / PAGE; p++)
		if (p * PAGE / CHUNK % stride / nthreads != (uint64_t)client_idx)
			touched[p] = 2;
	size_t init = (size_t)envl("STRESS_INIT_KB", 4096) << 10;
	if (init > mr_len)
		init = mr_len;
	for (size_t o = 0; o < init; o++)
		model[o] = (char)init_byte(o);
	for (size_t p = 0; p < init / PAGE; p++)
		if (!touched[p])
			touched[p] = 1;
	double t0 = now_s();
	end_issue = t0 + (double)envl("STRESS_SECS", 60);
	uint64_t seed = (uint64_t)envl("STRESS_SEED", 1);
	for (int i = 0; i < nthreads; i++) {
		struct cthread *t = &thr[i];
		t->id = i;
		t->qp = qp[i % nq];
		t->cq = cq[i % nq];
		t->lkey = lmr->lkey;
		t->seed = seed * 0x9e3779b97f4a7c15ull + i + 1;
		t->ops = calloc(depth, sizeof(struct op));
		CHECK(t->ops);
		for (int k = 0; k < depth; k++) {
			t->ops[k].owner = t;
			t->ops[k].local = local + ((size_t)i * depth + k) * slot;
			t->ops[k].expect = malloc(CHUNK);
			CHECK(t->ops[k].expect);
		}
	}
	pthread_t th[MAXT];
	for (int i = 0; i < nthreads; i++)
		CHECK_EQ(pthread_create(&th[i], NULL, client_thread, &thr[i]), 0);
	for (int i = 0; i < nthreads; i++)
		CHECK_EQ(pthread_join(th[i], NULL), 0);
	double t1 = now_s();
	long ops = 0, unsig = 0, k[4] = { 0 };
	for (int i = 0; i < nthreads; i++) {
		ops += thr[i].issued;
		unsig += thr[i].unsignaled;
		for (int j = 0; j < 4; j++)
			k[j] += thr[i].by_kind[j];
	}

	/* The final sweep: every touched page, and 64 never-touched ones (zeroes),
	 * read back by one thread (QP 0) 16 at a time. */
	long pages = 0, bad = 0, zero_checked = 0;
	uint64_t np = mr_len / PAGE, seed2 = seed + 77;
	struct cthread *t = &thr[0];
	int inflight = 0;
	uint64_t next = 0;
	int extra = 0;
	while (!atomic_load(&errors)) {
		while (inflight < depth) {
			uint64_t p = UINT64_MAX;
			while (next < np && touched[next] != 1)
				next++;
			if (next < np)
				p = next++;
			else if (extra < 64) {
				uint64_t q = rnd(&seed2) % np;
				if (touched[q])
					continue;
				touched[q] = 1; /* never picked twice */
				p = q;
				extra++;
				zero_checked++;
			}
			if (p == UINT64_MAX)
				break;
			int i = free_slot(t);
			CHECK(i >= 0);
			struct op *o = &t->ops[i];
			o->kind = K_READ;
			o->signaled = 1;
			o->burst = 0;
			o->off = p * PAGE;
			o->len = PAGE;
			memcpy(o->expect, model + o->off, PAGE);
			memset(o->local, 0x5a, PAGE);
			atomic_store(&o->busy, 1);
			CHECK_EQ(post(t, o), 0);
			inflight++;
			pages++;
		}
		if (!inflight)
			break;
		struct ibv_wc wc[16];
		int n = ibv_poll_cq(t->cq, 16, wc);
		CHECK(n >= 0);
		for (int i = 0; i < n; i++) {
			struct op *o = (struct op *)(uintptr_t)wc[i].wr_id;
			if (wc[i].status != IBV_WC_SUCCESS) {
				fprintf(stderr, "stress sweep: READ of page %#llx: status %s\n",
					(unsigned long long)(o->off / PAGE),
					ibv_wc_status_str(wc[i].status));
				atomic_fetch_add(&errors, 1);
			} else if (memcmp(o->local, o->expect, PAGE)) {
				if (bad++ < 5)
					fprintf(stderr, "stress sweep: page %#llx differs\n",
						(unsigned long long)(o->off / PAGE));
			}
			atomic_store(&o->busy, 0);
			inflight--;
		}
	}
	if (bad)
		atomic_fetch_add(&errors, 1);
	double t2 = now_s();
	xwrite(wfd, "d", 1);
	long over = 0;
	xread(rfd, &over, sizeof(over));
	printf("stress client %d: %ld ops (%ld READ, %ld WRITE of which %ld unsignaled, %ld "
	       "FETCH_ADD, %ld CMP_SWAP) on %d threads over %d QPs in %.2f s: %.0f ops/s; "
	       "sweep: %ld pages (%ld never touched) in %.2f s, %ld differ; errors %ld\n",
	       client_idx, ops, k[K_READ], k[K_WRITE], unsig, k[K_FADD], k[K_CSWAP], nthreads, nq, t1 - t0,
	       ops / (t1 - t0), pages, zero_checked, t2 - t1, bad, (long)atomic_load(&errors));
	fflush(stdout);
	for (int q = 0; q < nq; q++)
		CHECK_EQ(ibv_destroy_qp(qp[q]), 0);
	CHECK_EQ(ibv_dereg_mr(lmr), 0);
	for (int q = 0; q < nq; q++)
		CHECK_EQ(ibv_destroy_cq(cq[q]), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	return atomic_load(&errors) || over ? 1 : 0;
}

/* Start `argv` as a process of its own keeping only the pipe ends `keep` (the
 * pipes are close-on-exec: a process that dies closes its ends for its peers). */
static pid_t spawn(char **argv, const int *keep, int nkeep)
{
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed run */
		for (int i = 0; i < nkeep; i++)
			CHECK_EQ(fcntl(keep[i], F_SETFD, 0), 0);
		execv("/proc/self/exe", argv);
		perror("exec");
		_exit(127);
	}
	return pid;
}

/* The orchestrator calls no verbs: it starts the server and the clients as
 * processes of their own (each loads the library afresh) and collects them. */
int main(int argc, char **argv)
{
	if (!getenv("STRESS_QPS") || !*getenv("STRESS_QPS")) {
		char v[24];
		long t = envl("STRESS_THREADS", 4);
		snprintf(v, sizeof(v), "%ld", t > 1 ? t - 1 : 1);
		setenv("STRESS_QPS", v, 1);
	}
	nclients = (int)envl("STRESS_CLIENTS", 1);
	CHECK(nclients >= 1 && nclients <= MAXC);
	if (argc >= 3 && !strcmp(argv[1], "server")) {
		int nc = atoi(argv[2]), r[MAXC], w[MAXC];
		CHECK(nc == nclients && argc == 3 + 2 * nc);
		for (int c = 0; c < nc; c++) {
			r[c] = atoi(argv[3 + 2 * c]);
			w[c] = atoi(argv[4 + 2 * c]);
		}
		return server(nc, r, w);
	}
	if (argc == 3 && !strcmp(argv[1], "tcp-server")) {
		int fds[MAXC];
		tcp_listen_accept(argv[2], nclients, fds);
		return server(nclients, fds, fds);
	}
	if (argc == 4 && !strcmp(argv[1], "tcp-client")) {
		client_idx = (int)envl("STRESS_CLIENT_IDX", 0);
		int fd = tcp_connect(argv[2], argv[3]);
		return client(fd, fd);
	}
	if (argc == 5 && !strcmp(argv[1], "client")) {
		client_idx = atoi(argv[2]);
		return client(atoi(argv[3]), atoi(argv[4]));
	}
	int c2s[MAXC][2], s2c[MAXC][2];
	char fds[MAXC][2][2][16], nc[16], idx[MAXC][16];
	char *sargv[4 + 2 * MAXC] = { argv[0], "server", nc };
	snprintf(nc, sizeof(nc), "%d", nclients);
	for (int c = 0; c < nclients; c++) {
		CHECK_EQ(pipe2(c2s[c], O_CLOEXEC), 0);
		CHECK_EQ(pipe2(s2c[c], O_CLOEXEC), 0);
		snprintf(fds[c][0][0], 16, "%d", c2s[c][0]); /* server reads */
		snprintf(fds[c][0][1], 16, "%d", s2c[c][1]); /* server writes */
		snprintf(fds[c][1][0], 16, "%d", s2c[c][0]); /* client reads */
		snprintf(fds[c][1][1], 16, "%d", c2s[c][1]); /* client writes */
		sargv[3 + 2 * c] = fds[c][0][0];
		sargv[4 + 2 * c] = fds[c][0][1];
	}
	char b[32];
	snprintf(b, sizeof(b), "%ld", envl("STRESS_SERVER_BUDGET_PAGES", 64));
	const char *own_budget = getenv("NPRDMA_BUDGET_PAGES");
	char *keep = own_budget ? strdup(own_budget) : NULL;
	if (envl("STRESS_SERVER_BUDGET_PAGES", 64) > 0)
		setenv("NPRDMA_BUDGET_PAGES", b, 1);
	else
		unsetenv("NPRDMA_BUDGET_PAGES"); /* 0: no budget */
	pid_t pids[1 + MAXC];
	int skeep[2 * MAXC];
	for (int c = 0; c < nclients; c++)
		skeep[2 * c] = c2s[c][0], skeep[2 * c + 1] = s2c[c][1];
	pids[0] = spawn(sargv, skeep, 2 * nclients);
	if (keep)
		setenv("NPRDMA_BUDGET_PAGES", keep, 1);
	else
		unsetenv("NPRDMA_BUDGET_PAGES");
	for (int c = 0; c < nclients; c++) {
		snprintf(idx[c], 16, "%d", c);
		char *cargv[] = { argv[0], "client", idx[c], fds[c][1][0], fds[c][1][1], NULL };
		int ckeep[2] = { s2c[c][0], c2s[c][1] };
		pids[1 + c] = spawn(cargv, ckeep, 2);
	}
	for (int c = 0; c < nclients; c++) {
		close(c2s[c][0]), close(c2s[c][1]), close(s2c[c][0]), close(s2c[c][1]);
	}
	int failed = 0;
	for (int i = 0; i <= nclients; i++) {
		int st = 0;
		CHECK_EQ(waitpid(pids[i], &st, 0), pids[i]);
		if (!WIFEXITED(st) || WEXITSTATUS(st)) {
			if (i)
				fprintf(stderr, "stress: client %d failed (status %#x)\n", i - 1, st);
			else
				fprintf(stderr, "stress: the server failed (status %#x)\n", st);
			failed = 1;
		}
	}
	printf("stress: %s\n", failed ? "FAILED" : "passed");
	return failed;
}
