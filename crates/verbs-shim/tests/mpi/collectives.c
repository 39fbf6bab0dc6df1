/* MPI_Allreduce and MPI_Alltoall over large, mostly never-touched buffers (mpi.h
 * only; tests/mpi.rs runs it under mpirun --mca pml ucx over libnprdma.so). Each
 * rank's buffers are fresh mmap'ed memory of which it writes one 8-byte word in
 * every STRIDE (one page in eight); the rest is the kernel's zero pages, sent as
 * they are. Every word of every result is checked. Exits non-zero on a mismatch. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define WORDS ((size_t)4 << 20)	/* 32 MiB of uint64_t per buffer */
#define STRIDE ((size_t)4096)	/* words: one written word per 32 KiB */

static uint64_t *fresh(size_t words)
{
	void *p = mmap(NULL, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		MPI_Abort(MPI_COMM_WORLD, 2);
	return p;
}

static uint64_t word(int rank, size_t i)
{
	return i % STRIDE == 0 ? (uint64_t)(rank + 1) * 1000003u + i : 0;
}

static void fail(const char *what, size_t i, uint64_t got, uint64_t want)
{
	fprintf(stderr, "collectives: %s word %zu is %llu, expected %llu\n", what, i,
		(unsigned long long)got, (unsigned long long)want);
	MPI_Abort(MPI_COMM_WORLD, 1);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);

	/* Allreduce (sum) of WORDS words. */
	uint64_t *in = fresh(WORDS), *out = fresh(WORDS);
	for (size_t i = 0; i < WORDS; i += STRIDE)
		in[i] = word(rank, i);
	MPI_Allreduce(in, out, (int)WORDS, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
	for (size_t i = 0; i < WORDS; i++) {
		uint64_t want = 0;
		for (int r = 0; r < size; r++)
			want += word(r, i);
		if (out[i] != want)
			fail("allreduce", i, out[i], want);
	}
	munmap(in, WORDS * 8);
	munmap(out, WORDS * 8);

	/* Alltoall: WORDS / size words to each rank; block d of rank r's send buffer
	 * carries word(r * size + d, i) at its index i. */
	size_t block = WORDS / (size_t)size;
	uint64_t *snd = fresh(WORDS), *rcv = fresh(WORDS);
	for (int d = 0; d < size; d++)
		for (size_t i = 0; i < block; i += STRIDE)
			snd[d * block + i] = word(rank * size + d, i);
	MPI_Alltoall(snd, (int)block, MPI_UINT64_T, rcv, (int)block, MPI_UINT64_T, MPI_COMM_WORLD);
	for (int s = 0; s < size; s++)
		for (size_t i = 0; i < block; i++) {
			uint64_t want = word(s * size + rank, i);
			if (rcv[s * block + i] != want)
				fail("alltoall", s * block + i, rcv[s * block + i], want);
		}
	munmap(snd, WORDS * 8);
	munmap(rcv, WORDS * 8);

	if (rank == 0)
		printf("collectives ok: allreduce and alltoall of %zu MiB on %d ranks\n",
		       WORDS * 8 >> 20, size);
	/* Each rank's peak resident memory (scripts/bench-ucx.sh compares the modes). */
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, "VmHWM:", 6))
			fprintf(stderr, "rank %d %s", rank, line);
	if (f)
		fclose(f);
	MPI_Finalize();
	return 0;
}
