/* MPI ping-pong over sizes 1 B .. 64 MiB (written against mpi.h only, as a user's
 * program; tests/mpi.rs runs it under mpirun --mca pml ucx over libnprdma.so): rank 0
 * sends a pattern, rank 1 checks every byte, answers with each byte changed, and rank
 * 0 checks every byte of the answer. Buffers are fresh allocations of each size, so
 * large ones are mostly memory nobody touched before. Exits non-zero on a mismatch. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned char pattern(size_t i, size_t n)
{
	return (unsigned char)(i * 7 + n + (i >> 12));
}

static void fail(const char *what, size_t i, size_t n)
{
	fprintf(stderr, "pingpong: %s differs at byte %zu of %zu\n", what, i, n);
	MPI_Abort(MPI_COMM_WORLD, 1);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size != 2) {
		fprintf(stderr, "pingpong: needs 2 ranks, has %d\n", size);
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	size_t sizes = 0;
	for (size_t n = 1; n <= ((size_t)64 << 20); n *= 4) {
		unsigned char *b = malloc(n);
		if (!b)
			MPI_Abort(MPI_COMM_WORLD, 2);
		if (rank == 0) {
			for (size_t i = 0; i < n; i++)
				b[i] = pattern(i, n);
			MPI_Send(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
			MPI_Recv(b, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			for (size_t i = 0; i < n; i++)
				if (b[i] != (unsigned char)(pattern(i, n) ^ 0x5a))
					fail("answer", i, n);
		} else {
			MPI_Status st;
			MPI_Recv(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, &st);
			int got;
			MPI_Get_count(&st, MPI_BYTE, &got);
			if ((size_t)got != n)
				fail("length", (size_t)got, n);
			for (size_t i = 0; i < n; i++) {
				if (b[i] != pattern(i, n))
					fail("message", i, n);
				b[i] ^= 0x5a;
			}
			MPI_Send(b, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
		}
		free(b);
		sizes++;
	}
	if (rank == 0)
		printf("pingpong ok: %zu sizes, 1 B to 64 MiB\n", sizes);
	MPI_Finalize();
	return 0;
}
