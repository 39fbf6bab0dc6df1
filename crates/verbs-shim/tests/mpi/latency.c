/* MPI ping-pong latency at the sizes given on the command line (bytes; default 4096
 * and 1048576), for scripts/bench-ucx.sh: rank 0 prints, per size, the median
 * one-way time (half a round trip) over the iterations, after a warm-up, in µs.
 * The buffers are allocated once per size and reused, as benchmarks (OSU's) do. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void measure(int rank, size_t n)
{
	int iters = n <= 65536 ? 2000 : 200, warm = iters / 10;
	char *b = malloc(n);
	double *t = malloc(sizeof(double) * iters);
	if (!b || !t)
		MPI_Abort(MPI_COMM_WORLD, 2);
	memset(b, rank + 1, n);
	for (int i = -warm; i < iters; i++) {
		double s = MPI_Wtime();
		if (rank == 0) {
			MPI_Send(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
			MPI_Recv(b, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		} else {
			MPI_Recv(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			MPI_Send(b, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
		}
		if (i >= 0)
			t[i] = (MPI_Wtime() - s) / 2 * 1e6;
	}
	qsort(t, iters, sizeof(double), cmp);
	if (rank == 0)
		printf("latency %zu B: median %.2f us one-way over %d round trips\n", n,
		       t[iters / 2], iters);
	free(b);
	free(t);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	if (argc > 1)
		for (int i = 1; i < argc; i++)
			measure(rank, strtoull(argv[i], NULL, 0));
	else {
		measure(rank, 4096);
		measure(rank, 1048576);
	}
	MPI_Finalize();
	return 0;
}
