/* rdma_cm semantics through librdmacm's API (rdma_cma.h only), run in-process
 * against libnprdma.so: a connect to a port nobody listens on is REJECTED (status
 * 8), private data up to the IB CM limits arrives intact both ways, a reject carries
 * its private data, a SEND flows over the connection, DISCONNECTED reaches both
 * sides, a killed peer is DISCONNECTED within a bound and flushes the survivor's
 * posted RECV, bad arguments get librdmacm's errno, and N connect/disconnect cycles
 * leak no fd or thread. Usage: cm_events <port> [cycles]. Exit 0 = all held. */
#include <rdma/rdma_cma.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(c, ...) do { if (!(c)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, " (errno %d)\n", errno); exit(1); } } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

/* The next event on ch within `secs` (the fd is polled: a bounded wait). */
static struct rdma_cm_event *next_event(struct rdma_event_channel *ch, double secs) {
    struct pollfd p = { .fd = ch->fd, .events = POLLIN };
    double end = now() + secs;
    for (;;) {
        int left = (int)((end - now()) * 1000);
        CHECK(left > 0, "no event within %.1f s", secs);
        if (poll(&p, 1, left) <= 0) continue;
        struct rdma_cm_event *e;
        if (rdma_get_cm_event(ch, &e) == 0) return e;
        CHECK(errno == EAGAIN, "rdma_get_cm_event");
    }
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type t) {
    struct rdma_cm_event *e = next_event(ch, 5);
    while (e->event == RDMA_CM_EVENT_TIMEWAIT_EXIT && t != RDMA_CM_EVENT_TIMEWAIT_EXIT) {
        rdma_ack_cm_event(e);
        e = next_event(ch, 5);
    }
    CHECK(e->event == t, "expected %s, got %s (status %d)", rdma_event_str(t), rdma_event_str(e->event), e->status);
    return e;
}

static struct sockaddr_in addr(int port) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    return a;
}

static int count_dir(const char *d) {
    DIR *x = opendir(d); int n = 0; struct dirent *e;
    while ((e = readdir(x))) n += e->d_name[0] != '.';
    closedir(x);
    return n;
}

static void nonblock(struct rdma_event_channel *ch) {
    fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
}

/* Resolve addr and route for an active id to port. */
static void resolve(struct rdma_event_channel *ch, struct rdma_cm_id *id, int port) {
    struct sockaddr_in a = addr(port);
    CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&a, 2000) == 0, "resolve_addr");
    rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
    CHECK(rdma_resolve_route(id, 2000) == 0, "resolve_route");
    rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));
}

static struct rdma_cm_id *listener(struct rdma_event_channel *ch, int port) {
    struct rdma_cm_id *l;
    struct sockaddr_in a = addr(port);
    CHECK(rdma_create_id(ch, &l, NULL, RDMA_PS_TCP) == 0, "create_id");
    CHECK(rdma_bind_addr(l, (struct sockaddr *)&a) == 0, "bind");
    CHECK(rdma_listen(l, 8) == 0, "listen");
    CHECK(ntohs(rdma_get_src_port(l)) == port, "src port");
    return l;
}

static struct ibv_qp_init_attr qp_attr(void) {
    struct ibv_qp_init_attr q = { .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
    return q;
}

/* One connection client -> server in this process; returns both ids (QPs made by
 * rdma_create_qp with its own CQs). */
static void connect_pair(struct rdma_event_channel *ch, struct rdma_cm_id *l, int port,
                         struct rdma_cm_id **cli, struct rdma_cm_id **srv, int check_private) {
    unsigned char req[56], rep[196];
    for (int i = 0; i < 56; i++) req[i] = (unsigned char)(i * 7 + 1);
    for (int i = 0; i < 196; i++) rep[i] = (unsigned char)(255 - i);
    CHECK(rdma_create_id(ch, cli, NULL, RDMA_PS_TCP) == 0, "create_id");
    resolve(ch, *cli, port);
    struct ibv_qp_init_attr q = qp_attr();
    CHECK(rdma_create_qp(*cli, NULL, &q) == 0, "create_qp (client)");
    CHECK((*cli)->send_cq && (*cli)->recv_cq && (*cli)->pd, "CQs and PD made");
    struct rdma_conn_param p = { .private_data = req, .private_data_len = 56,
        .responder_resources = 1, .initiator_depth = 1, .retry_count = 7, .rnr_retry_count = 7 };
    CHECK(rdma_connect(*cli, &p) == 0, "connect");
    struct rdma_cm_event *e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
    CHECK(e->listen_id == l, "listen_id");
    if (check_private)
        CHECK(e->param.conn.private_data_len >= 56 && !memcmp(e->param.conn.private_data, req, 56),
              "REQ private data intact");
    *srv = e->id;
    rdma_ack_cm_event(e);
    q = qp_attr();
    CHECK(rdma_create_qp(*srv, NULL, &q) == 0, "create_qp (server)");
    struct rdma_conn_param a = { .private_data = rep, .private_data_len = 196,
        .responder_resources = 1, .initiator_depth = 1, .rnr_retry_count = 7 };
    CHECK(rdma_accept(*srv, &a) == 0, "accept");
    /* Both ESTABLISHED, in either order. */
    int got_cli = 0, got_srv = 0;
    while (!got_cli || !got_srv) {
        e = expect(ch, RDMA_CM_EVENT_ESTABLISHED);
        if (e->id == *cli) {
            got_cli = 1;
            if (check_private)
                CHECK(e->param.conn.private_data_len >= 196 && !memcmp(e->param.conn.private_data, rep, 196),
                      "REP private data intact");
        } else {
            CHECK(e->id == *srv, "ESTABLISHED for an unknown id");
            got_srv = 1;
        }
        rdma_ack_cm_event(e);
    }
}

static void teardown(struct rdma_event_channel *ch, struct rdma_cm_id *cli, struct rdma_cm_id *srv) {
    CHECK(rdma_disconnect(cli) == 0, "disconnect");
    int dc = 0, ds = 0;
    while (!dc || !ds) {
        struct rdma_cm_event *e = expect(ch, RDMA_CM_EVENT_DISCONNECTED);
        dc |= e->id == cli; ds |= e->id == srv;
        rdma_ack_cm_event(e);
    }
    rdma_destroy_qp(cli); rdma_destroy_qp(srv);
    CHECK(rdma_destroy_id(cli) == 0 && rdma_destroy_id(srv) == 0, "destroy_id");
}

static void send_one(struct rdma_cm_id *from, struct rdma_cm_id *to) {
    char out[8] = "cm-data", in[8] = {0};
    struct ibv_mr *mo = ibv_reg_mr(from->pd, out, 8, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mi = ibv_reg_mr(to->pd, in, 8, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mo && mi, "reg_mr");
    struct ibv_sge si = { (uintptr_t)in, 8, mi->lkey }, so = { (uintptr_t)out, 8, mo->lkey };
    struct ibv_recv_wr r = { .wr_id = 1, .sg_list = &si, .num_sge = 1 }, *br;
    struct ibv_send_wr s = { .wr_id = 2, .sg_list = &so, .num_sge = 1, .opcode = IBV_WR_SEND,
        .send_flags = IBV_SEND_SIGNALED }, *bs;
    CHECK(ibv_post_recv(to->qp, &r, &br) == 0 && ibv_post_send(from->qp, &s, &bs) == 0, "post");
    struct ibv_wc wc; int n = 0; double end = now() + 5;
    while (n == 0 && now() < end) n = ibv_poll_cq(to->recv_cq, 1, &wc);
    CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && !memcmp(in, out, 8), "SEND arrived");
    n = 0;
    while (n == 0 && now() < end) n = ibv_poll_cq(from->send_cq, 1, &wc);
    CHECK(n == 1 && wc.status == IBV_WC_SUCCESS, "SEND completed");
    ibv_dereg_mr(mo); ibv_dereg_mr(mi);
}

/* The peer that gets killed: listen, tell the parent, accept one connection, wait. */
static int peer(int port, int tell) {
    struct rdma_event_channel *c2 = rdma_create_event_channel();
    struct rdma_cm_id *l2 = listener(c2, port), *s2;
    CHECK(write(tell, "l", 1) == 1, "tell");
    struct rdma_cm_event *e = expect(c2, RDMA_CM_EVENT_CONNECT_REQUEST);
    s2 = e->id;
    rdma_ack_cm_event(e);
    struct ibv_qp_init_attr q = qp_attr();
    CHECK(rdma_create_qp(s2, NULL, &q) == 0, "peer create_qp");
    CHECK(rdma_accept(s2, NULL) == 0, "peer accept");
    rdma_ack_cm_event(expect(c2, RDMA_CM_EVENT_ESTABLISHED));
    (void)l2;
    for (;;) pause();
}

int main(int argc, char **argv) {
    if (argc > 3 && !strcmp(argv[1], "peer")) return peer(atoi(argv[2]), atoi(argv[3]));
    int port = argc > 1 ? atoi(argv[1]) : 19810;
    int cycles = argc > 2 ? atoi(argv[2]) : 200;
    struct rdma_event_channel *ch = rdma_create_event_channel();
    CHECK(ch, "create_event_channel");
    nonblock(ch);
    struct rdma_cm_event *e;

    /* Bad arguments. */
    struct rdma_cm_id *id;
    CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "create_id");
    errno = 0; CHECK(rdma_get_cm_event(ch, &e) == -1 && errno == EAGAIN, "empty non-blocking channel: EAGAIN");
    errno = 0; CHECK(rdma_resolve_route(id, 100) == -1 && errno == EINVAL, "route before addr: EINVAL");
    errno = 0; CHECK(rdma_connect(id, NULL) == -1 && errno == EINVAL, "connect before route: EINVAL");
    errno = 0; CHECK(rdma_accept(id, NULL) == -1 && errno == EINVAL, "accept without request: EINVAL");
    errno = 0; CHECK(rdma_disconnect(id) == -1 && errno == EINVAL, "disconnect unconnected: EINVAL");
    struct sockaddr_in far = { .sin_family = AF_INET, .sin_port = htons(port) };
    inet_pton(AF_INET, "203.0.113.7", &far.sin_addr);
    errno = 0; CHECK(rdma_bind_addr(id, (struct sockaddr *)&far) == -1 && errno == EADDRNOTAVAIL, "bind non-local: EADDRNOTAVAIL");
    errno = 0; CHECK(rdma_join_multicast(id, (struct sockaddr *)&far, NULL) == -1 && errno == EOPNOTSUPP, "multicast refused");
    CHECK(rdma_destroy_id(id) == 0, "destroy");

    /* A port nobody listens on: REJECTED with the IB CM's "invalid service ID". */
    CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "create_id");
    resolve(ch, id, port + 1);
    unsigned char big[57] = {0};
    struct rdma_conn_param p57 = { .private_data = big, .private_data_len = 57 };
    errno = 0; CHECK(rdma_connect(id, &p57) == -1 && errno == EINVAL, "57 B of REQ private data: EINVAL");
    double t0 = now();
    CHECK(rdma_connect(id, NULL) == 0, "connect");
    e = expect(ch, RDMA_CM_EVENT_REJECTED);
    CHECK(e->status == 8 && now() - t0 < 2, "status 8 within the timeout (%d)", e->status);
    rdma_ack_cm_event(e);
    CHECK(rdma_destroy_id(id) == 0, "destroy");

    /* Private data both ways, a SEND, a disconnect. */
    struct rdma_cm_id *l = listener(ch, port), *cli, *srv;
    connect_pair(ch, l, port, &cli, &srv, 1);
    send_one(cli, srv);
    send_one(srv, cli);
    teardown(ch, cli, srv);

    /* A reject with private data. */
    CHECK(rdma_create_id(ch, &cli, NULL, RDMA_PS_TCP) == 0, "create_id");
    resolve(ch, cli, port);
    CHECK(rdma_connect(cli, NULL) == 0, "connect");
    e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
    srv = e->id;
    rdma_ack_cm_event(e);
    unsigned char why[148];
    memset(why, 0x5a, sizeof why);
    CHECK(rdma_reject(srv, why, sizeof why) == 0, "reject");
    e = expect(ch, RDMA_CM_EVENT_REJECTED);
    CHECK(e->id == cli && e->status == 28, "consumer reject (status %d)", e->status);
    CHECK(e->param.conn.private_data_len >= sizeof why && !memcmp(e->param.conn.private_data, why, sizeof why),
          "REJ private data intact");
    rdma_ack_cm_event(e);
    CHECK(rdma_destroy_id(srv) == 0 && rdma_destroy_id(cli) == 0, "destroy");

    /* Cycles: no fd or thread left behind. */
    connect_pair(ch, l, port, &cli, &srv, 0);
    teardown(ch, cli, srv);
    int fds = count_dir("/proc/self/fd"), threads = count_dir("/proc/self/task");
    for (int i = 0; i < cycles; i++) {
        connect_pair(ch, l, port, &cli, &srv, i == 0);
        teardown(ch, cli, srv);
    }
    /* TIMEWAIT_EXITs of destroyed ids are dropped; let the last ones pass. */
    usleep(200000);
    while (rdma_get_cm_event(ch, &e) == 0) rdma_ack_cm_event(e);
    CHECK(count_dir("/proc/self/fd") == fds, "fds %d -> %d after %d cycles", fds, count_dir("/proc/self/fd"), cycles);
    CHECK(count_dir("/proc/self/task") == threads, "threads %d -> %d", threads, count_dir("/proc/self/task"));

    /* A peer that dies: the survivor sees DISCONNECTED and its posted RECV flushes. */
    rdma_destroy_id(l);
    int pipefd[2];
    CHECK(pipe(pipefd) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) {
        /* A fresh process (exec: a forked child cannot use its parent's device). */
        char port_s[16], fd_s[16];
        snprintf(port_s, sizeof port_s, "%d", port + 2);
        snprintf(fd_s, sizeof fd_s, "%d", pipefd[1]);
        execl("/proc/self/exe", argv[0], "peer", port_s, fd_s, (char *)NULL);
        _exit(127);
    }
    char b;
    CHECK(read(pipefd[0], &b, 1) == 1, "child listening");
    CHECK(rdma_create_id(ch, &cli, NULL, RDMA_PS_TCP) == 0, "create_id");
    resolve(ch, cli, port + 2);
    struct ibv_qp_init_attr q = qp_attr();
    CHECK(rdma_create_qp(cli, NULL, &q) == 0, "create_qp");
    CHECK(rdma_connect(cli, NULL) == 0, "connect");
    rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ESTABLISHED));
    char in[8];
    struct ibv_mr *mr = ibv_reg_mr(cli->pd, in, 8, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_sge sg = { (uintptr_t)in, 8, mr->lkey };
    struct ibv_recv_wr r = { .wr_id = 9, .sg_list = &sg, .num_sge = 1 }, *br;
    CHECK(ibv_post_recv(cli->qp, &r, &br) == 0, "post_recv");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    t0 = now();
    e = expect(ch, RDMA_CM_EVENT_DISCONNECTED);
    CHECK(now() - t0 < 2, "DISCONNECTED %.2f s after the peer died", now() - t0);
    rdma_ack_cm_event(e);
    struct ibv_wc wc; int n = 0; double end = now() + 5;
    while (n == 0 && now() < end) n = ibv_poll_cq(cli->recv_cq, 1, &wc);
    CHECK(n == 1 && wc.wr_id == 9 && wc.status == IBV_WC_WR_FLUSH_ERR, "posted RECV flushed (n %d status %d)", n, n ? wc.status : -1);
    ibv_dereg_mr(mr);
    rdma_destroy_qp(cli);
    CHECK(rdma_destroy_id(cli) == 0, "destroy");
    rdma_destroy_event_channel(ch);
    printf("cm_events: ok (%d cycles)\n", cycles);
    return 0;
}
