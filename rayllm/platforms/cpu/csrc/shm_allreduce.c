/* The tensor-parallel all-reduce of ranks on one host, through one shared-memory segment that every rank
 * maps (rayllm/platforms/cpu/shm_allreduce.py sets it up; gloo would go through TCP loopback).
 *
 * Segment: one flag per rank (its own cache lines), then two rounds' buffers: per rank an input slot, and one
 * result area. A message larger than a slot goes through in chunks, one round each. In round R a rank
 *   1. copies its chunk into its slot of buffer R % 2 and publishes 2R+1 in its flag;
 *   2. waits until every flag is at least 2R+1;
 *   3. small chunks: sums every slot into its own data and publishes 2R+2 (no wait);
 *      large chunks: sums its 1/world share of the elements into the result area, publishes 2R+2, waits for
 *      every flag to reach 2R+2, and copies the whole result into its data.
 * Every rank sums the slots in rank order, so every rank holds the same bits. Buffer R % 2 is written again
 * in round R+2 only after the rank has seen every flag at 2R+3, which a peer publishes only once it has
 * finished round R: two buffers and one wait per round keep a fast rank from overwriting what a slow one reads.
 *
 * Waiting spins (a peer is microseconds away when the ranks have their own cores), then yields the core (a
 * descheduled peer needs it). Every rank records its pid in the header: a wait that lasts checks that the
 * ranks it waits for are still alive (gloo sees a dead peer's closed socket; here it would never publish),
 * and gives up after `timeout_s` in any case. The caller then raises instead of hanging the step.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AR_PAUSE() _mm_pause()
#else
#define AR_PAUSE() ((void)0)
#endif

#define AR_FLAG_BYTES 128 /* a flag per two cache lines: adjacent-line prefetch does not couple ranks */
#define AR_HEADER_BYTES 4096 /* the flags, then each rank's pid */
#define AR_MAX_WORLD 16
#define AR_SPINS_BEFORE_YIELD 2048
#define AR_SMALL_BYTES (128 << 10) /* up to this much per chunk, every rank sums it all (one wait, not two) */

typedef struct {
    _Atomic uint64_t value;
} ar_flag;

static inline ar_flag *flag_of(char *seg, int rank) { return (ar_flag *)(seg + (int64_t)rank * AR_FLAG_BYTES); }
static inline _Atomic int32_t *pid_of(char *seg, int rank) {
    return (_Atomic int32_t *)(seg + AR_MAX_WORLD * AR_FLAG_BYTES + 4 * rank);
}

int shm_allreduce_max_world(void) { return AR_MAX_WORLD; }

/* Records this rank's pid; every rank attaches before any calls shm_allreduce. */
void shm_allreduce_attach(char *seg, int rank) { atomic_store(pid_of(seg, rank), (int32_t)getpid()); }

/* Whether process `pid` has exited (gone, or a zombie its parent has not reaped yet). */
static int exited(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *end = strrchr(buf, ')'); /* the state follows the command name, which may hold spaces */
    return end != NULL && (end[2] == 'Z' || end[2] == 'X');
}

int64_t shm_allreduce_segment_bytes(int world, int64_t slot_bytes) {
    return AR_HEADER_BYTES + (2 * (int64_t)world + 2) * slot_bytes;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 0 once every rank's flag is at least `target`; -1 after timeout_s, -2 once a rank it waits for has exited. */
static int wait_all(char *seg, int world, uint64_t target, double timeout_s) {
    double deadline = 0.0;
    for (uint64_t spins = 0;; spins++) {
        int ready = 1;
        for (int k = 0; k < world; k++) {
            if (atomic_load_explicit(&flag_of(seg, k)->value, memory_order_acquire) < target) {
                ready = 0;
                break;
            }
        }
        if (ready) return 0;
        if (spins < AR_SPINS_BEFORE_YIELD) {
            AR_PAUSE();
            continue;
        }
        sched_yield();
        if ((spins & 1023) == 0) {
            double t = now_s();
            if (deadline == 0.0) deadline = t + timeout_s;
            else if (t > deadline) return -1;
            for (int k = 0; k < world; k++)
                if (atomic_load_explicit(&flag_of(seg, k)->value, memory_order_acquire) < target &&
                    exited((pid_t)atomic_load(pid_of(seg, k))))
                    return -2;
        }
    }
}

#define AR_BLOCK 512 /* elements summed per pass over the ranks' slots: vectorizable loops on a stack buffer */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; NaN stays a quiet NaN */
    union { float f; uint32_t u; } v = {.f = f};
    uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    uint32_t nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* dst[i] = sum over ranks of slot_k[i], i in [lo, hi), in rank order (fp32 accumulation). */
static void sum_f32(float *dst, char *slots, int64_t slot_bytes, int world, int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b += AR_BLOCK) {
        const int64_t m = hi - b < AR_BLOCK ? hi - b : AR_BLOCK;
        float acc[AR_BLOCK];
        const float *s0 = (const float *)slots + b;
        for (int64_t i = 0; i < m; i++) acc[i] = s0[i];
        for (int k = 1; k < world; k++) {
            const float *s = (const float *)(slots + k * slot_bytes) + b;
            for (int64_t i = 0; i < m; i++) acc[i] += s[i];
        }
        memcpy(dst + b, acc, (size_t)m * sizeof(float));
    }
}

static void sum_bf16(uint16_t *dst, char *slots, int64_t slot_bytes, int world, int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b += AR_BLOCK) {
        const int64_t m = hi - b < AR_BLOCK ? hi - b : AR_BLOCK;
        float acc[AR_BLOCK];
        const uint16_t *s0 = (const uint16_t *)slots + b;
        for (int64_t i = 0; i < m; i++) acc[i] = bf16_to_f32(s0[i]);
        for (int k = 1; k < world; k++) {
            const uint16_t *s = (const uint16_t *)(slots + k * slot_bytes) + b;
            for (int64_t i = 0; i < m; i++) acc[i] += bf16_to_f32(s[i]);
        }
        for (int64_t i = 0; i < m; i++) dst[b + i] = f32_to_bf16(acc[i]);
    }
}

/* In-place sum of `n` elements (fp32, or bf16 when is_bf16) at `data` across the `world` ranks mapping `seg`.
 * *round is this rank's round counter (the same on every rank; advanced once per chunk). 0; -1 when a peer
 * did not arrive within timeout_s, -2 when one exited (the segment is then out of step: the group must not be
 * used again). */
int shm_allreduce(char *seg, int world, int rank, int64_t slot_bytes, uint64_t *round, void *data, int64_t n,
                  int is_bf16, double timeout_s) {
    const int64_t elt = is_bf16 ? 2 : 4;
    const int64_t chunk_elems = slot_bytes / elt;
    char *base = seg + AR_HEADER_BYTES;
    ar_flag *mine = flag_of(seg, rank);
    for (int64_t start = 0; start < n; start += chunk_elems) {
        const int64_t len = n - start < chunk_elems ? n - start : chunk_elems;
        const uint64_t r = *round;
        const int buf = (int)(r & 1);
        char *slots = base + (int64_t)buf * world * slot_bytes;
        char *result = base + 2 * (int64_t)world * slot_bytes + (int64_t)buf * slot_bytes;
        char *chunk = (char *)data + start * elt;
        memcpy(slots + rank * slot_bytes, chunk, (size_t)(len * elt));
        atomic_store_explicit(&mine->value, 2 * r + 1, memory_order_release);
        int code = wait_all(seg, world, 2 * r + 1, timeout_s);
        if (code != 0) return code;
        if (len * elt <= AR_SMALL_BYTES) {
            if (is_bf16) sum_bf16((uint16_t *)chunk, slots, slot_bytes, world, 0, len);
            else sum_f32((float *)chunk, slots, slot_bytes, world, 0, len);
            atomic_store_explicit(&mine->value, 2 * r + 2, memory_order_release);
        } else {
            const int64_t share = (len + world - 1) / world;
            const int64_t lo = rank * share < len ? rank * share : len;
            const int64_t hi = lo + share < len ? lo + share : len;
            if (is_bf16) sum_bf16((uint16_t *)result, slots, slot_bytes, world, lo, hi);
            else sum_f32((float *)result, slots, slot_bytes, world, lo, hi);
            atomic_store_explicit(&mine->value, 2 * r + 2, memory_order_release);
            code = wait_all(seg, world, 2 * r + 2, timeout_s);
            if (code != 0) return code;
            memcpy(chunk, result, (size_t)(len * elt));
        }
        *round = r + 1;
    }
    return 0;
}
