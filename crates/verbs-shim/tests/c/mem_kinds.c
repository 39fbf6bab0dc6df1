/* Memory of every kind a program registers: heap (unaligned, sub-page), stack,
 * .bss, shared anonymous, shared and private file mappings, transparent huge
 * pages, hugetlbfs pages (where reserved), read-only memory, and two MRs over
 * one buffer. Each is the target of
 * RDMA WRITE, READ, SEND and atomics from another QP of this process; the bytes
 * are checked through the CPU, a file mapping's also through the file after
 * deregistration, and the memory stays the program's after ibv_dereg_mr. */
#include "common.h"
#include <fcntl.h>
#include <sys/mman.h>

static struct env e;
static struct ibv_cq *cqa, *cqb;
static struct ibv_qp *qa, *qb;
static char *src;		/* the initiator's buffer */
static struct ibv_mr *src_mr;
static char bss_buf[3 * 4096 + 123];

static void fill(char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (char)(seed * 31 + i * 7 + (i >> 9));
}

static void op_ok(struct ibv_cq *cq, uint64_t id, const char *what)
{
	struct ibv_wc wc;
	poll_n(cq, &wc, 1, 10);
	if (wc.status != IBV_WC_SUCCESS || wc.wr_id != id) {
		fprintf(stderr, "%s: wr_id %llu status %s\n", what,
			(unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
		exit(1);
	}
}

/* WRITE src -> [t, t+n), READ it back into src+n, SEND into it, two atomics
 * on its first 8-byte aligned word; every step checked through the CPU. */
static void exercise(const char *kind, char *t, size_t n, struct ibv_mr *mr, unsigned seed)
{
	CHECK(n + 16 <= (1 << 20) / 2);
	fill(src, n, seed);
	CHECK_EQ(post_send1(qa, 1, IBV_WR_RDMA_WRITE, src, n, src_mr->lkey,
			    (uintptr_t)t, mr->rkey, IBV_SEND_SIGNALED), 0);
	op_ok(cqa, 1, kind);
	if (memcmp(t, src, n) != 0) {
		fprintf(stderr, "%s: WRITE of %zu bytes did not land\n", kind, n);
		exit(1);
	}
	/* The program's own store, then a READ sees it. */
	t[n / 2] ^= 0x5a;
	memset(src + n, 0, n);
	CHECK_EQ(post_send1(qa, 2, IBV_WR_RDMA_READ, src + n, n, src_mr->lkey,
			    (uintptr_t)t, mr->rkey, IBV_SEND_SIGNALED), 0);
	op_ok(cqa, 2, kind);
	if (memcmp(src + n, t, n) != 0) {
		fprintf(stderr, "%s: READ of %zu bytes differs\n", kind, n);
		exit(1);
	}
	/* SEND into it (a RECV of the target QP). */
	fill(src, n, seed + 1);
	CHECK_EQ(post_recv1(qb, 3, t, n, mr->lkey), 0);
	CHECK_EQ(post_send1(qa, 4, IBV_WR_SEND, src, n, src_mr->lkey, 0, 0,
			    IBV_SEND_SIGNALED), 0);
	op_ok(cqa, 4, kind);
	op_ok(cqb, 3, kind);
	if (memcmp(t, src, n) != 0) {
		fprintf(stderr, "%s: SEND of %zu bytes did not land\n", kind, n);
		exit(1);
	}
	/* Atomics on the first aligned word. */
	uint64_t *w = (uint64_t *)(((uintptr_t)t + 7) & ~(uintptr_t)7);
	if ((char *)(w + 1) > t + n)
		return;
	*w = 40;
	uint64_t *res = (uint64_t *)src;
	struct ibv_sge s = { .addr = (uintptr_t)res, .length = 8, .lkey = src_mr->lkey };
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 5;
	wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	wr.sg_list = &s;
	wr.num_sge = 1;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.atomic.remote_addr = (uintptr_t)w;
	wr.wr.atomic.rkey = mr->rkey;
	wr.wr.atomic.compare_add = 2;
	CHECK_EQ(ibv_post_send(qa, &wr, &bad), 0);
	op_ok(cqa, 5, kind);
	CHECK_EQ(*res, 40);
	CHECK_EQ(*w, 42);
	wr.wr_id = 6;
	wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
	wr.wr.atomic.compare_add = 42;
	wr.wr.atomic.swap = 7;
	CHECK_EQ(ibv_post_send(qa, &wr, &bad), 0);
	op_ok(cqa, 6, kind);
	CHECK_EQ(*res, 42);
	CHECK_EQ(*w, 7);
}

static struct ibv_mr *reg(void *p, size_t n)
{
	struct ibv_mr *mr = ibv_reg_mr(e.pd, p, n, ALL_ACCESS);
	if (!mr) {
		fprintf(stderr, "ibv_reg_mr(%p, %zu): %s\n", p, n, strerror(errno));
		exit(1);
	}
	CHECK(mr->addr == p && mr->length == n);
	return mr;
}

static void one(const char *kind, char *t, size_t n, unsigned seed)
{
	struct ibv_mr *mr = reg(t, n);
	exercise(kind, t, n, mr, seed);
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	/* Still the program's memory. */
	memset(t, 0x33, n);
	CHECK(t[0] == 0x33 && t[n - 1] == 0x33);
}

static char *map_file(int flags, int *fd_out, size_t n)
{
	char path[] = "/tmp/nprdma-mem-kinds-XXXXXX";
	int fd = mkstemp(path);
	CHECK(fd >= 0);
	unlink(path);
	CHECK_EQ(ftruncate(fd, n), 0);
	char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, flags, fd, 0);
	CHECK(p != MAP_FAILED);
	*fd_out = fd;
	return p;
}

int main(void)
{
	env_open(&e);
	cqa = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	cqb = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cqa && cqb);
	qa = make_qp(&e, cqa);
	qb = make_qp(&e, cqb);
	connect_pair(&e, qa, qb, 7);
	src = xalloc(1 << 20);
	src_mr = reg(src, 1 << 20);

	/* Heap: unaligned start, sub-page and multi-page lengths. */
	char *h = malloc(70000);
	CHECK(h);
	one("heap sub-page", h + 3, 1000, 1);
	one("heap multi-page", h + 5, 65000, 2);
	free(h);

	/* Stack. */
	{
		char st[5000];
		one("stack", st + 1, sizeof(st) - 1, 3);
	}

	/* .bss */
	one("bss", bss_buf + 7, sizeof(bss_buf) - 7, 4);

	/* Shared anonymous memory. */
	size_t n = 8 * 4096;
	char *sh = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK(sh != MAP_FAILED);
	one("shared anonymous", sh, n, 5);
	CHECK_EQ(munmap(sh, n), 0);

	/* A shared file mapping: what RDMA wrote reaches the file. */
	int fd;
	char *fm = map_file(MAP_SHARED, &fd, n);
	struct ibv_mr *mr = reg(fm, n);
	exercise("shared file mapping", fm, n, mr, 6);
	fill(src, n, 60);
	CHECK_EQ(post_send1(qa, 9, IBV_WR_RDMA_WRITE, src, n, src_mr->lkey,
			    (uintptr_t)fm, mr->rkey, IBV_SEND_SIGNALED), 0);
	op_ok(cqa, 9, "shared file mapping");
	CHECK_EQ(ibv_dereg_mr(mr), 0);
	CHECK_EQ(msync(fm, n, MS_SYNC), 0);
	char *back = malloc(n);
	CHECK_EQ(pread(fd, back, n, 0), (long)n);
	if (memcmp(back, src, n) != 0) {
		fprintf(stderr, "shared file mapping: the file does not hold what RDMA wrote\n");
		exit(1);
	}
	CHECK_EQ(munmap(fm, n), 0);
	close(fd);

	/* A private file mapping: the file keeps its bytes. */
	char *pm = map_file(MAP_PRIVATE, &fd, n);
	one("private file mapping", pm, n, 7);
	CHECK_EQ(pread(fd, back, n, 0), (long)n);
	for (size_t i = 0; i < n; i++)
		if (back[i] != 0) {
			fprintf(stderr, "private file mapping: the file changed at %zu\n", i);
			exit(1);
		}
	CHECK_EQ(munmap(pm, n), 0);
	close(fd);
	free(back);

	/* Transparent huge pages (when the kernel gives them). */
	size_t hn = 4 << 20;
	char *raw = mmap(NULL, hn + (2 << 20), PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(raw != MAP_FAILED);
	char *hp = (char *)(((uintptr_t)raw + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
	madvise(hp, hn, MADV_HUGEPAGE);
	memset(hp, 1, hn);
	one("huge pages", hp + (1 << 20) - 100, 300000, 8);
	CHECK_EQ(munmap(raw, hn + (2 << 20)), 0);

	/* hugetlbfs pages (where the system reserved some). */
	char *hg = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE,
			MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
	if (hg == MAP_FAILED) {
		fprintf(stderr, "no hugetlbfs pages reserved: that case skipped\n");
	} else {
		/* Both huge pages, the second never touched: one 4 MiB WRITE
		 * and READ back. */
		memset(hg, 2, 4096);
		size_t hn = 4 << 20;
		char *big = xalloc(2 * hn);
		struct ibv_mr *bmr = reg(big, 2 * hn), *hmr = reg(hg, hn);
		fill(big, hn, 16);
		CHECK_EQ(post_send1(qa, 30, IBV_WR_RDMA_WRITE, big, hn, bmr->lkey,
				    (uintptr_t)hg, hmr->rkey, IBV_SEND_SIGNALED), 0);
		op_ok(cqa, 30, "hugetlbfs, 4 MiB WRITE");
		CHECK(memcmp(hg, big, hn) == 0);
		CHECK_EQ(post_send1(qa, 31, IBV_WR_RDMA_READ, big + hn, hn, bmr->lkey,
				    (uintptr_t)hg, hmr->rkey, IBV_SEND_SIGNALED), 0);
		op_ok(cqa, 31, "hugetlbfs, 4 MiB READ");
		CHECK(memcmp(big + hn, big, hn) == 0);
		CHECK_EQ(ibv_dereg_mr(hmr), 0);
		CHECK_EQ(ibv_dereg_mr(bmr), 0);
		free(big);
		one("hugetlbfs", hg + (2 << 20) - 5000, 300000, 14);
		CHECK_EQ(munmap(hg, 4 << 20), 0);
	}

	/* Read-only memory: REMOTE_READ without LOCAL_WRITE is allowed and reads
	 * what the program put there; LOCAL_WRITE on it is refused. */
	char *ro = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(ro != MAP_FAILED);
	fill(ro, n, 9);
	CHECK_EQ(mprotect(ro, n, PROT_READ), 0);
	struct ibv_mr *rmr = ibv_reg_mr(e.pd, ro, n, IBV_ACCESS_REMOTE_READ);
	if (!rmr) {
		fprintf(stderr, "read-only memory, REMOTE_READ: %s\n", strerror(errno));
		exit(1);
	}
	memset(src, 0, n);
	CHECK_EQ(post_send1(qa, 10, IBV_WR_RDMA_READ, src, n, src_mr->lkey,
			    (uintptr_t)ro, rmr->rkey, IBV_SEND_SIGNALED), 0);
	op_ok(cqa, 10, "read-only memory");
	CHECK(memcmp(src, ro, n) == 0);
	CHECK_EQ(ibv_dereg_mr(rmr), 0);
	errno = 0;
	struct ibv_mr *wmr = ibv_reg_mr(e.pd, ro, n, IBV_ACCESS_LOCAL_WRITE);
	if (wmr) {
		fprintf(stderr, "read-only memory registered for LOCAL_WRITE\n");
		exit(1);
	}
	CHECK_EQ(munmap(ro, n), 0);

	/* Two MRs over one buffer: each works, and after one is gone the other
	 * still does. */
	char *two = xalloc(n);
	struct ibv_mr *m1 = reg(two, n);
	struct ibv_mr *m2 = reg(two + 4096, n - 4096);
	exercise("first of two MRs", two, n, m1, 10);
	CHECK_EQ(ibv_dereg_mr(m1), 0);
	exercise("second of two MRs", two + 4096, n - 4096, m2, 11);
	CHECK_EQ(ibv_dereg_mr(m2), 0);
	free(two);

	/* A registered file mapping unmapped, and another file mapped at its
	 * address: the old MR does not reach the new mapping — a WRITE and a
	 * READ with its rkey fail (a pinning NIC would reach the old pages; never
	 * the new mapping) and the new mapping keeps its bytes. Last: the
	 * failures put the QP in the error state. */
	{
		char *fmap = map_file(MAP_SHARED, &fd, n);
		struct ibv_mr *fmr = reg(fmap, n);
		exercise("file mapping before its munmap", fmap, n, fmr, 12);
		/* The other file is made before the munmap, so that nothing of this
		 * thread runs between the munmap and the mmap at the freed address
		 * (MAP_FIXED_NOREPLACE: never over another mapping). That address
		 * not being free any more right after its munmap is a failure. */
		char path[] = "/tmp/nprdma-mem-kinds-XXXXXX";
		int ofd = mkstemp(path);
		CHECK(ofd >= 0);
		unlink(path);
		CHECK_EQ(ftruncate(ofd, n), 0);
		CHECK_EQ(munmap(fmap, n), 0);
		close(fd);
		fd = ofd;
		char *other = mmap(fmap, n, PROT_READ | PROT_WRITE,
				   MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
		if (other == MAP_FAILED || other != fmap) {
			fprintf(stderr, "could not map anew at the old address %p: %s (got %p)\n",
				(void *)fmap, other == MAP_FAILED ? strerror(errno) : "elsewhere",
				(void *)other);
			exit(1);
		}
		memset(other, 0x11, n);
		struct ibv_wc wc;
		fill(src, 64, 13);
		CHECK_EQ(post_send1(qa, 20, IBV_WR_RDMA_WRITE, src, 64, src_mr->lkey,
				    (uintptr_t)fmap, fmr->rkey, IBV_SEND_SIGNALED), 0);
		poll_n(cqa, &wc, 1, 10);
		CHECK(wc.status != IBV_WC_SUCCESS);
		memset(src + 64, 0, 64);
		CHECK_EQ(post_send1(qa, 21, IBV_WR_RDMA_READ, src + 64, 64, src_mr->lkey,
				    (uintptr_t)fmap + 4096, fmr->rkey, IBV_SEND_SIGNALED), 0);
		poll_n(cqa, &wc, 1, 10);
		CHECK(wc.status != IBV_WC_SUCCESS);
		for (size_t i = 0; i < 64; i++)
			CHECK(src[64 + i] != 0x11);
		for (size_t i = 0; i < n; i++)
			if (other[i] != 0x11) {
				fprintf(stderr, "the new mapping was written at %zu\n", i);
				exit(1);
			}
		CHECK_EQ(munmap(other, n), 0);
		close(fd);
		CHECK_EQ(ibv_dereg_mr(fmr), 0);
	}

	CHECK_EQ(ibv_destroy_qp(qa), 0);
	CHECK_EQ(ibv_destroy_qp(qb), 0);
	CHECK_EQ(ibv_dereg_mr(src_mr), 0);
	free(src);
	CHECK_EQ(ibv_destroy_cq(cqa), 0);
	CHECK_EQ(ibv_destroy_cq(cqb), 0);
	CHECK_EQ(ibv_dealloc_pd(e.pd), 0);
	CHECK_EQ(ibv_close_device(e.ctx), 0);
	printf("mem_kinds: ok\n");
	return 0;
}
