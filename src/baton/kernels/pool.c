/* The thread pool of small steps' native calls (layer.c, linear.c): tasks any thread may
 * take, and a caller that never waits for a thread that took none.
 *
 * Why not OpenMP's: a small step is hundreds of parallel regions of tens of microseconds,
 * and every OpenMP region ends in a barrier that waits for *every* thread of the team. In a
 * server on 2 cores the second core is shared with the HTTP thread and the clients, so the
 * second OpenMP thread is often off its core for a scheduler slice (milliseconds) and each
 * region waits for it: 2 threads served ~1.5x slower than 1. Here the caller publishes a
 * job and takes tasks itself; a helper joins if it is awake and takes tasks until none are
 * left; the caller then waits only for tasks a helper has actually taken. A helper that is
 * off its core costs nothing, one that is on it halves the work.
 *
 * The job is one 64-bit word, ``ticket``: generation | threads allowed | tasks | next task.
 * A task is taken by a compare-and-swap of that word, so a taker sees the job it takes from
 * (a helper that slept through many jobs and wakes mid-job takes a task of the current job,
 * never a stale one), and reads the job's function and context only after taking a task,
 * when the caller cannot be writing them. Helpers spin for ``SPIN_NS`` after their last
 * task (the gap between one step's calls is tens of microseconds), then sleep on a
 * condition variable until a new job comes. Calls from a second thread while a job runs, and
 * calls with one thread or one task, run inline on the caller. After a fork the child has
 * no helpers; the child's calls run inline until it makes its own.
 */
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

#ifndef BATON_POOL_SPIN_NS
#define BATON_POOL_SPIN_NS 200000
#endif

enum { MAX_THREADS = 64, SPIN_NS = BATON_POOL_SPIN_NS };

/* ticket = gen:20 | threads:7 | tasks:18 | next:18 (bits, high to low) */
#define NEXT_BITS 18
#define TASKS_SHIFT NEXT_BITS
#define THREADS_SHIFT (2 * NEXT_BITS)
#define GEN_SHIFT (THREADS_SHIFT + 7)
#define FIELD(t, shift, bits) ((int)(((t) >> (shift)) & ((1ull << (bits)) - 1)))
#define NEXT(t) FIELD(t, 0, NEXT_BITS)
#define TASKS(t) FIELD(t, TASKS_SHIFT, NEXT_BITS)
#define THREADS(t) FIELD(t, THREADS_SHIFT, 7)
#define GEN(t) FIELD(t, GEN_SHIFT, 20)
#define MAX_TASKS ((1 << NEXT_BITS) - 1)

static _Atomic uint64_t ticket;
static _Atomic int done;     /* tasks of the current job finished by helpers */
static _Atomic int busy;     /* a caller's job is running */
static _Atomic int sleepers; /* helpers waiting on `wake` */
static _Atomic int64_t helper_tasks; /* tasks helpers have run, ever (tests read it) */
static baton_task job_fn;    /* written by the caller before it publishes the ticket */
static void *job_ctx;
static int num_helpers;      /* started so far (only the caller holding `busy` starts more) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take the next task of the job in `t` for `worker`: its index, or -1 when there is none. */
static int take(uint64_t *t, int worker) {
    while (NEXT(*t) < TASKS(*t) && worker < THREADS(*t)) {
        if (atomic_compare_exchange_weak_explicit(&ticket, t, *t + 1, memory_order_acquire,
                                                  memory_order_acquire))
            return NEXT(*t);
    }
    return -1;
}

static void *helper(void *arg) {
    const int me = (int)(intptr_t)arg;
    int64_t idle_since = now_ns();
    for (int spins = 0;; spins++) {
        uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
        const int task = take(&t, me);
        if (task >= 0) {
            job_fn(job_ctx, task, me);
            atomic_fetch_add_explicit(&helper_tasks, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&done, 1, memory_order_release);
            idle_since = now_ns(), spins = 0;
            continue;
        }
        RELAX();
        if ((spins & 63) != 63 || now_ns() - idle_since < SPIN_NS) continue;
        /* Sleep until a job of another generation is published. NOTE: `sleepers` goes up
         * before the ticket is read again and the caller reads `sleepers` after publishing
         * (both sequentially consistent): either the caller wakes us or we see its job. */
        pthread_mutex_lock(&lock);
        atomic_fetch_add(&sleepers, 1);
        while (GEN(atomic_load(&ticket)) == GEN(t)) pthread_cond_wait(&wake, &lock);
        atomic_fetch_sub(&sleepers, 1);
        pthread_mutex_unlock(&lock);
        idle_since = now_ns(), spins = 0;
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* The child has only the forking thread: no helpers, nothing running -- and no task of
     * a job another parent thread had running may be taken (its caller does not exist). */
    atomic_store(&ticket, (uint64_t)GEN(atomic_load(&ticket)) << GEN_SHIFT);
    atomic_store(&done, 0);
    num_helpers = 0;
    atomic_store(&busy, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
}

static void install_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* Start helpers until `wanted` run (or starting one fails); how many run. */
static int ensure_helpers(int wanted) {
    pthread_once(&once, install_fork_handler);
    while (num_helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed =
            pthread_create(&thread, &attr, helper, (void *)(intptr_t)(num_helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        num_helpers++;
    }
    return num_helpers;
}

void baton_parallel(baton_task fn, void *ctx, int tasks, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int expected = 0;
    if (tasks <= 1 || threads <= 1 || tasks > MAX_TASKS ||
        !atomic_compare_exchange_strong(&busy, &expected, 1)) {
        for (int i = 0; i < tasks; i++) fn(ctx, i, 0);
        return;
    }
    const int helpers = ensure_helpers(threads - 1);
    if (helpers + 1 < threads) threads = helpers + 1;
    job_fn = fn, job_ctx = ctx;
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    const uint64_t gen = (uint64_t)(GEN(atomic_load(&ticket)) + 1) & ((1u << 20) - 1);
    uint64_t t = gen << GEN_SHIFT | (uint64_t)threads << THREADS_SHIFT |
                 (uint64_t)tasks << TASKS_SHIFT;
    atomic_store(&ticket, t); /* sequentially consistent: see helper() */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    int mine = 0;
    for (int task; (task = take(&t, 0)) >= 0; mine++) fn(ctx, task, 0);
    /* Only tasks a helper took are left: wait for those (yielding now and then, in case it
     * shares this core). */
    for (int spins = 1; atomic_load_explicit(&done, memory_order_acquire) + mine < tasks; spins++) {
        RELAX();
        if ((spins & 1023) == 0) sched_yield();
    }
    atomic_store(&busy, 0);
}

/* A large call inside a step that runs torch's ops (a prompt chunk through the panels) runs
 * on OpenMP's threads -- the runtime torch loaded, which this library links (see
 * kernels/__init__.py) -- instead of this pool's: torch's ops leave that runtime's workers
 * spinning for milliseconds, and a helper of this pool would share a core with one.
 * Measured on a Zen 4 (2 cores, AVX2 kernels), a 496 x 1024 -> 4096 matmul took 19.6 ms
 * alone and 25.1 ms right after a torch op with this pool, 20.3 ms on OpenMP's threads
 * (MKL's sgemm: 23.6 ms). Tasks go to the team's threads by an atomic counter, as here;
 * the region ends in OpenMP's barrier. */
void baton_parallel_openmp(baton_task fn, void *ctx, int tasks, int threads) {
    if (tasks <= 1 || threads <= 1) {
        for (int i = 0; i < tasks; i++) fn(ctx, i, 0);
        return;
    }
    if (threads > tasks) threads = tasks;
    _Atomic int next = 0;
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num();
        for (int task; (task = atomic_fetch_add(&next, 1)) < tasks;) fn(ctx, task, me);
    }
}

/* Tasks run by helpers since the library was loaded: tests check the pool really shares. */
int baton_threads_for(int64_t work, int64_t per_thread, int threads) {
    const int64_t wanted = per_thread > 0 ? work / per_thread : threads;
    return wanted < 1 ? 1 : wanted < threads ? (int)wanted : threads;
}

int64_t baton_pool_helper_tasks(void) { return atomic_load(&helper_tasks); }
