/* Memory accesses of the NIC that end with an error instead of killing the process
 * when the memory under them vanishes (see fault_guard.rs): a SIGSEGV or SIGBUS
 * raised inside a guarded access to its own ranges returns from it with -1. Every
 * other fault goes to the handler that was installed before ours, or to the default
 * action. */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

static __thread sigjmp_buf *volatile guard_env;
static __thread uintptr_t guard_lo[2], guard_hi[2];
static struct sigaction prev_segv, prev_bus;

static void chain(int sig, siginfo_t *si, void *uc) {
    struct sigaction *p = sig == SIGBUS ? &prev_bus : &prev_segv;
    if (p->sa_flags & SA_SIGINFO) {
        if (p->sa_sigaction) {
            p->sa_sigaction(sig, si, uc);
            return;
        }
    } else if (p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN) {
        p->sa_handler(sig);
        return;
    }
    /* Default: put it back; returning re-executes the access, which then ends the
     * process exactly as it would have without us. */
    sigaction(sig, p, NULL);
}

static void on_fault(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *e = guard_env;
    uintptr_t a = (uintptr_t)si->si_addr;
    if (e && ((a >= guard_lo[0] && a < guard_hi[0]) || (a >= guard_lo[1] && a < guard_hi[1]))) {
        guard_env = NULL;
        siglongjmp(*e, 1);
    }
    chain(sig, si, uc);
}

static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    /* NODEFER: siglongjmp out of the handler leaves the signal unblocked. ONSTACK:
     * a stack overflow still reaches the previous handler on the alternate stack. */
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &prev_segv);
    sigaction(SIGBUS, &sa, &prev_bus);
}

static pthread_once_t installed = PTHREAD_ONCE_INIT;

void rnic_guard_install(void) { pthread_once(&installed, install); }

static void ranges(const void *a, size_t an, const void *b, size_t bn) {
    guard_lo[0] = (uintptr_t)a;
    guard_hi[0] = (uintptr_t)a + an;
    guard_lo[1] = (uintptr_t)b;
    guard_hi[1] = (uintptr_t)b + bn;
}

int rnic_guarded_copy(void *dst, const void *src, size_t n) {
    sigjmp_buf env;
    ranges(dst, n, src, n);
    if (sigsetjmp(env, 0))
        return -1;
    guard_env = &env;
    memmove(dst, src, n);
    guard_env = NULL;
    return 0;
}

int rnic_guarded_set(void *dst, int byte, size_t n) {
    sigjmp_buf env;
    ranges(dst, n, dst, 0);
    if (sigsetjmp(env, 0))
        return -1;
    guard_env = &env;
    memset(dst, byte, n);
    guard_env = NULL;
    return 0;
}

int rnic_guarded_fetch_add(uint64_t *p, uint64_t add, uint64_t *old) {
    sigjmp_buf env;
    ranges(p, 8, p, 0);
    if (sigsetjmp(env, 0))
        return -1;
    guard_env = &env;
    *old = __atomic_fetch_add(p, add, __ATOMIC_SEQ_CST);
    guard_env = NULL;
    return 0;
}

int rnic_guarded_cas(uint64_t *p, uint64_t cmp, uint64_t swp, uint64_t *old) {
    sigjmp_buf env;
    ranges(p, 8, p, 0);
    if (sigsetjmp(env, 0))
        return -1;
    guard_env = &env;
    uint64_t expected = cmp;
    __atomic_compare_exchange_n(p, &expected, swp, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    *old = expected;
    guard_env = NULL;
    return 0;
}
