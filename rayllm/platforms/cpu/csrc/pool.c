/* A pool of helper threads for one kernel call at a time, that never makes the caller wait for a thread
 * that has not started.
 *
 * Served on few cores, a serving process or a Ray daemon often holds the second core for a few ms. An
 * OpenMP region splits its work up front and meets at a barrier, so a preempted thread stalls the step.
 * Here the work is a list of chunks claimed one at a time from a shared counter: the caller claims too,
 * and only waits for the chunks a helper has already claimed. A helper that wakes late finds nothing left.
 *
 * Helpers spin briefly after a job (a step's kernels come tens of microseconds apart), then sleep on a
 * futex, so an idle engine leaves the cores to the serving processes. They also run POOL_HELPER_NICE
 * levels below the thread that created them (cluster.yaml runs the serving processes 10 below the engine):
 * a helper takes the second core when the ingress and the replica leave it, and since the caller never
 * waits for an unclaimed chunk, that costs the step nothing it would have had. One job at a time: a second
 * caller (the other half of a half step) runs its chunks alone.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>
#include <errno.h>
#include <sys/resource.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#define POOL_FUTEX 1
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

typedef void (*pool_fn)(void *ctx, int chunk);

#define POOL_MAX_HELPERS 15
#define POOL_SPINS 4096 /* pause iterations before a helper sleeps: tens of microseconds */
#define POOL_HELPER_NICE 10

typedef struct {
    _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int chunks;
    _Atomic int helpers; /* helpers 0 .. helpers-1 may join */
} pool_job;

static struct {
    pthread_mutex_t lock;       /* held by the caller for a whole job */
    pool_job jobs[2];           /* the job of generation g is jobs[g & 1]: a late helper reading the other
                                   slot is refused by the claim's compare-and-swap, never misled */
    _Atomic uint64_t state;     /* generation << 32 | next unclaimed chunk */
    _Atomic int done;           /* chunks finished in this generation */
    _Atomic uint32_t wake;      /* futex word: the generation's low bits */
    _Atomic int sleepers;
    int started;                /* helpers created in this process */
    pid_t pid;                  /* the process that created them (a forked child starts its own) */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Claims and runs chunks of the current job until none is left; helper h < 0 is the caller. */
static void pool_work(int h) {
    for (;;) {
        uint64_t s = atomic_load(&P.state);
        uint32_t gen = (uint32_t)(s >> 32), next = (uint32_t)s;
        pool_job *j = &P.jobs[gen & 1];
        int chunks = atomic_load_explicit(&j->chunks, memory_order_relaxed);
        if ((h >= 0 && h >= atomic_load_explicit(&j->helpers, memory_order_relaxed)) || (int)next >= chunks) return;
        pool_fn fn = atomic_load_explicit(&j->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&j->ctx, memory_order_relaxed);
        /* Success means the generation was still running, so its slot was not being rewritten. */
        if (atomic_compare_exchange_weak(&P.state, &s, s + 1)) {
            fn(ctx, (int)next);
            atomic_fetch_add(&P.done, 1);
        }
    }
}

static void *pool_helper(void *arg) {
    int h = (int)(intptr_t)arg;
#ifdef POOL_FUTEX
    id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, tid); /* per thread on Linux, inherited from the creator */
    if (errno == 0) setpriority(PRIO_PROCESS, tid, nice + POOL_HELPER_NICE < 19 ? nice + POOL_HELPER_NICE : 19);
#endif
    uint32_t seen = atomic_load(&P.wake);
    for (;;) {
        uint32_t w;
        int spins = 0;
        while ((w = atomic_load(&P.wake)) == seen) {
            if (++spins < POOL_SPINS) {
                POOL_PAUSE();
                continue;
            }
            atomic_fetch_add(&P.sleepers, 1);
#ifdef POOL_FUTEX
            syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0); /* returns at once if changed */
#else
            usleep(50);
#endif
            atomic_fetch_sub(&P.sleepers, 1);
            spins = 0;
        }
        seen = w;
        pool_work(h);
    }
    return NULL;
}

/* Runs fn(ctx, i) for every i in [0, chunks) on the caller and up to threads - 1 helpers; returns when all
 * are done. Falls back to the caller alone when another job runs or a helper cannot be created. */
void pool_run(int threads, int chunks, pool_fn fn, void *ctx) {
    int helpers = threads - 1 < chunks - 1 ? threads - 1 : chunks - 1;
    if (helpers > POOL_MAX_HELPERS) helpers = POOL_MAX_HELPERS;
    if (helpers <= 0 || pthread_mutex_trylock(&P.lock) != 0) {
        for (int i = 0; i < chunks; i++) fn(ctx, i);
        return;
    }
    if (P.pid != getpid()) { /* first use, or a forked child: the parent's helpers are not here */
        P.pid = getpid();
        P.started = 0;
    }
    while (P.started < helpers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&t, &attr, pool_helper, (void *)(intptr_t)P.started) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        P.started++;
    }
    if (helpers > P.started) helpers = P.started;
    uint32_t gen = (uint32_t)(atomic_load(&P.state) >> 32) + 1;
    pool_job *j = &P.jobs[gen & 1];
    atomic_store_explicit(&j->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&j->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&j->chunks, chunks, memory_order_relaxed);
    atomic_store_explicit(&j->helpers, helpers, memory_order_relaxed);
    atomic_store(&P.done, 0);
    atomic_store(&P.state, (uint64_t)gen << 32); /* publishes the slot (sequentially consistent) */
    atomic_store(&P.wake, gen);
    if (atomic_load(&P.sleepers) > 0) {
#ifdef POOL_FUTEX
        syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, P.started, NULL, NULL, 0);
#endif
    }
    pool_work(-1);
    while (atomic_load(&P.done) < chunks) POOL_PAUSE(); /* only chunks a helper claimed and is running */
    pthread_mutex_unlock(&P.lock);
}
