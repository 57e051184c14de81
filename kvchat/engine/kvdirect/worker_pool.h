/* Worker threads kept between calls, shared by kvchat's C kernels (exact_attention.c and
   the int4 kernel include this file; each library gets a pool of its own, which another
   library can be pointed at: kvchat_pool_share, below).

   Why: a decode step makes a few hundred kernel calls of tens to hundreds of microseconds,
   and starting a thread per call cost a large share of each. A worker polls for its next
   task a while (the next call usually comes within that), yielding its core at each poll so
   that torch's threads, busy between two calls, lose nothing to it (a plain spin took a core
   from them during prefill), then sleeps on a condition variable. Each worker has its own
   slot, so a task index is only ever seen by the worker it was given to.

   What a pool does to a kernel's bits: nothing by itself. pool_run(task, context, count)
   runs task(context, i) once for each i in [0, count), index 0 on the caller's thread; a
   kernel that gives every output to one index, computed the same way whichever thread runs
   it, gives the same bits on any count. */

#ifndef KVCHAT_WORKER_POOL_H
#define KVCHAT_WORKER_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define POOL_MAX_THREADS 16
#define POOL_SPINS 20000 /* the caller's polls of a worker's slot before it yields its core */
#define POOL_YIELDS 100  /* a worker's polls before sleeping, each giving way to any thread */

typedef void (*pool_task)(void *context, int index);

typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  pthread_t id;
  pool_task task;
  void *context;
  int index;
  atomic_uint given, done; /* tickets: the worker runs a task when given moves past done */
} PoolSlot;

static PoolSlot pool_slots[POOL_MAX_THREADS];
static int pool_workers = 0; /* slots 1..pool_workers have a running thread */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void *pool_worker_loop(void *arg) {
  PoolSlot *slot = (PoolSlot *)arg;
  unsigned seen = atomic_load(&slot->done);
  for (;;) {
    for (int i = 0;
         i < POOL_YIELDS && atomic_load_explicit(&slot->given, memory_order_acquire) == seen; i++)
      sched_yield();
    pthread_mutex_lock(&slot->lock);
    while (atomic_load_explicit(&slot->given, memory_order_acquire) == seen)
      pthread_cond_wait(&slot->wake, &slot->lock);
    pthread_mutex_unlock(&slot->lock);
    seen++;
    slot->task(slot->context, slot->index);
    atomic_store_explicit(&slot->done, seen, memory_order_release);
  }
  return NULL;
}

/* A child of fork() has none of its parent's workers: start afresh. */
static void pool_forget_workers(void) {
  pool_workers = 0;
  pthread_mutex_init(&pool_lock, NULL);
}

/* Slots 1..want with running workers, as many as could be started; returns how many. */
static int pool_start_workers(int want) {
  static int registered = 0;
  if (!registered) {
    pthread_atfork(NULL, NULL, pool_forget_workers);
    registered = 1;
  }
  for (; pool_workers < want; pool_workers++) {
    PoolSlot *slot = &pool_slots[pool_workers + 1];
    pthread_mutex_init(&slot->lock, NULL);
    pthread_cond_init(&slot->wake, NULL);
    atomic_store(&slot->given, 0);
    atomic_store(&slot->done, 0);
    if (pthread_create(&slot->id, NULL, pool_worker_loop, slot) != 0) break;
  }
  return pool_workers < want ? pool_workers : want;
}

/* task(context, i) for i in [0, count) (count <= POOL_MAX_THREADS): index 0 here, the rest
   on this library's workers; what no worker takes, here. One caller at a time owns the
   workers; a concurrent caller runs its indices itself. */
static void pool_run_here(pool_task task, void *context, int count) {
  int helpers = 0;
  const int owner = count > 1 && pthread_mutex_trylock(&pool_lock) == 0;
  if (owner) helpers = pool_start_workers(count - 1);
  for (int t = 1; t <= helpers; t++) {
    PoolSlot *slot = &pool_slots[t];
    slot->task = task;
    slot->context = context;
    slot->index = t;
    pthread_mutex_lock(&slot->lock);
    atomic_fetch_add_explicit(&slot->given, 1, memory_order_release);
    pthread_cond_signal(&slot->wake);
    pthread_mutex_unlock(&slot->lock);
  }
  for (int t = helpers + 1; t < count; t++) task(context, t);
  task(context, 0);
  for (int t = 1; t <= helpers; t++) {
    const unsigned ticket = atomic_load(&pool_slots[t].given);
    for (int i = 0; atomic_load_explicit(&pool_slots[t].done, memory_order_acquire) != ticket;
         i++)
      if (i > POOL_SPINS) sched_yield();
      else pool_relax();
  }
  if (owner) pthread_mutex_unlock(&pool_lock);
}

/* Sharing one pool between libraries. A decode step alternates the int4 kernel's calls
   (four per layer) with one attention call; with a pool per library, the attention pool's
   worker has gone to sleep by the next layer, waking it costs more than the work it takes,
   and its polls compete for the two cores with the other pool's worker. So the Python side
   points one library at another's pool_run (kvchat_pool_share); from then on every call
   of this library runs on that pool, whose workers stay warm. */
typedef void (*pool_runner)(pool_task task, void *context, int count);
static pool_runner pool_shared = NULL;

__attribute__((visibility("default"))) void kvchat_pool_run(pool_task task, void *context,
                                                            int count) {
  pool_run_here(task, context, count);
}

/* runner: another library's kvchat_pool_run, or NULL for this library's own workers. */
__attribute__((visibility("default"))) void kvchat_pool_share(pool_runner runner) {
  pool_shared = runner == kvchat_pool_run ? NULL : runner;
}

/* How many workers this library's own pool has started (tests: a sharing library starts none). */
__attribute__((visibility("default"))) int kvchat_pool_workers(void) { return pool_workers; }

static void pool_run(pool_task task, void *context, int count) {
  const pool_runner shared = pool_shared;
  if (shared != NULL && count > 1) shared(task, context, count);
  else pool_run_here(task, context, count);
}

#endif
