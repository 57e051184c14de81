/* kvchat's int4 weight kernel: out[r][n] = sum_k x[r][k] * W[n][k] with float32 activations.

   Why: torch's int4 CPU kernel casts activations to bf16, and on CPUs without AVX-512 it is
   compute bound well under the memory's speed. Here each weight group is unpacked once into
   floats and multiplied with float32 activations, so a decode step reads the weights about
   as fast as the memory delivers them and keeps float32's precision.

   Weights (kvchat.engine.models.int4_kernel): codes uint8 [N][K/2], where byte j of group g
   holds column 32g + j in its low nibble and column 32g + 16 + j in its high nibble (GGUF's
   Q4 block order); scale_min fp16 [N][2][K/32]: each row's group scales, then its group
   minimums, so that W[n][32g + j] = q * scale + min; or, symmetric (a GGUF Q4_0 tensor's
   form), [N][1][K/32]: the scales alone, each group's minimum being -8 * scale.

   Exactness: every output is summed in one fixed order that depends on neither the row count
   nor the thread count nor the build: a row's result is the same alone or in a prefill chunk,
   and the plain C below computes the AVX2 code's operations in the AVX2 code's order (fmaf
   where it uses FMA; built with -ffp-contract=off), so both builds give the same bits. */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVCHAT_AVX2 1
#if defined(__AVX512F__)
#define KVCHAT_AVX512 1
#endif
#endif

#define GROUP 32
#define ROW_TILE 8 /* activation rows sharing one unpacked weight group */
#define PAIR_TILE 16 /* the same with AVX-512, two rows to a register */
#define K_BLOCK 8    /* groups per pass over a pair tile's activations (16 KiB of them) */
#define N_BLOCK 16   /* output columns per pass */

typedef struct {
  const float *x;
  const float *xsum;
  int64_t rows, k;
  const uint8_t *codes;
  const uint16_t *scale_min;
  int32_t symmetric;
  int64_t n;
  float *out;
  int64_t n0, n1;
} Job;

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: normalize */
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      exponent--;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

/* The sum of 8 lanes in the order the AVX2 code adds them. */
static inline float lane_sum(const float *l) {
  const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
  return (a0 + a2) + (a1 + a3);
}

#ifdef KVCHAT_AVX2
static inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pair = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif

/* Each group's activation sum, for the minimums' term. */
static void group_sums(const float *x, int64_t rows, int64_t k, float *xsum) {
  const int64_t groups = k / GROUP;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float *p = x + r * k + GROUP * g;
#ifdef KVCHAT_AVX2
      __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      xsum[r * groups + g] = hsum8(a);
#else
      float lanes[8];
      for (int l = 0; l < 8; l++) lanes[l] = (p[l] + p[8 + l]) + (p[16 + l] + p[24 + l]);
      xsum[r * groups + g] = lane_sum(lanes);
#endif
    }
}

#ifdef KVCHAT_AVX2
static inline void scales_to_float(const uint16_t *h, int64_t groups, float *out) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
  for (; g < groups; g++) out[g] = _cvtsh_ss(h[g]);
}

/* A group's 32 codes as floats: columns 0-7, 8-15 (low nibbles), 16-23, 24-31 (high). */
static inline void unpack_group(const uint8_t *c, __m256 q[4]) {
  const __m256i low = _mm256_set1_epi32(0x0f);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8)));
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

/* The group's dot product with one row's 32 activations, in one order. */
static inline __m256 group_dot(const __m256 q[4], const float *x) {
  __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
  a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), a);
  a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), a);
  return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), a);
}

/* Output (r, n): the scaled sums, then the minimums' term. */
static inline void finish(const Job *job, int64_t r, int64_t n, __m256 total) {
  const int64_t groups = job->k / GROUP;
  const uint16_t *scale = job->scale_min + n * (job->symmetric ? 1 : 2) * groups;
  const uint16_t *minv = job->symmetric ? scale : scale + groups;
  /* A symmetric row's minimums are -8 * its scales (exact in float32). */
  const float factor = job->symmetric ? -8.0f : 1.0f;
  const float *xs = job->xsum + r * groups;
  __m256 m = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minv + g)));
    m = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_set1_ps(factor)), _mm256_loadu_ps(xs + g), m);
  }
  float rest = 0.0f;
  for (; g < groups; g++) rest = fmaf(_cvtsh_ss(minv[g]) * factor, xs[g], rest);
  job->out[r * job->n + n] = hsum8(total) + (hsum8(m) + rest);
}

/* Inlined for each row count, so the compiler keeps the rows' sums in registers (a sum
   kept in memory waits on a store and a load at every group). */
static inline __attribute__((always_inline)) void rows_tile_of(const Job *job, int64_t r0,
                                                               const int nr) {
  const int64_t k = job->k, groups = k / GROUP;
  const int64_t stride = (job->symmetric ? 1 : 2) * groups;
  float scales[groups];
  for (int64_t n = job->n0; n < job->n1; n++) {
    const uint8_t *codes = job->codes + n * (k / 2);
    scales_to_float(job->scale_min + n * stride, groups, scales);
    __m256 total[ROW_TILE];
    for (int r = 0; r < nr; r++) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      /* One row reads each column once, from memory: ask for the codes two columns ahead
         (a cache line every fourth group), which the hardware prefetcher alone does not
         bring in time. */
      if (nr == 1 && (g & 3) == 0) _mm_prefetch((const char *)(codes + k + 16 * g), _MM_HINT_T0);
      __m256 q[4];
      unpack_group(codes + 16 * g, q);
      const __m256 s = _mm256_broadcast_ss(scales + g);
      for (int r = 0; r < nr; r++)
        total[r] = _mm256_fmadd_ps(group_dot(q, job->x + (r0 + r) * k + GROUP * g), s, total[r]);
    }
    for (int r = 0; r < nr; r++) finish(job, r0 + r, n, total[r]);
  }
}

static void rows_tile(const Job *job, int64_t r0, int64_t nr) {
  switch (nr) {
    case 1: rows_tile_of(job, r0, 1); break;
    case 2: rows_tile_of(job, r0, 2); break;
    case 3: rows_tile_of(job, r0, 3); break;
    case 4: rows_tile_of(job, r0, 4); break;
    case 5: rows_tile_of(job, r0, 5); break;
    case 6: rows_tile_of(job, r0, 6); break;
    case 7: rows_tile_of(job, r0, 7); break;
    default: rows_tile_of(job, r0, 8); break;
  }
}

#else

static void rows_tile(const Job *job, int64_t r0, int64_t nr) {
  const int64_t k = job->k, groups = k / GROUP;
  for (int64_t n = job->n0; n < job->n1; n++) {
    const uint8_t *codes = job->codes + n * (k / 2);
    const uint16_t *scale = job->scale_min + n * (job->symmetric ? 1 : 2) * groups;
    const uint16_t *minv = job->symmetric ? scale : scale + groups;
    const float factor = job->symmetric ? -8.0f : 1.0f;
    float total[ROW_TILE][8];
    memset(total, 0, sizeof total);
    for (int64_t g = 0; g < groups; g++) {
      float q[GROUP];
      for (int j = 0; j < 16; j++) {
        q[j] = (float)(codes[16 * g + j] & 0x0f);
        q[16 + j] = (float)(codes[16 * g + j] >> 4);
      }
      const float s = half_to_float(scale[g]);
      for (int r = 0; r < nr; r++) {
        const float *x = job->x + (r0 + r) * k + GROUP * g;
        for (int l = 0; l < 8; l++) {
          float a = q[l] * x[l];
          a = fmaf(q[8 + l], x[8 + l], a);
          a = fmaf(q[16 + l], x[16 + l], a);
          a = fmaf(q[24 + l], x[24 + l], a);
          total[r][l] = fmaf(a, s, total[r][l]);
        }
      }
    }
    for (int r = 0; r < nr; r++) {
      const float *xs = job->xsum + (r0 + r) * groups;
      float m[8] = {0};
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8)
        for (int l = 0; l < 8; l++)
          m[l] = fmaf(half_to_float(minv[g + l]) * factor, xs[g + l], m[l]);
      float rest = 0.0f;
      for (; g < groups; g++) rest = fmaf(half_to_float(minv[g]) * factor, xs[g], rest);
      job->out[(r0 + r) * job->n + n] = lane_sum(total[r]) + (lane_sum(m) + rest);
    }
  }
}

#endif

#ifdef KVCHAT_AVX512
/* With AVX-512 a register holds two rows: each pair of rows is laid out a quarter group at a
   time, one row's 8 activations then the next row's, so that one 512-bit load feeds both and
   each half of every register runs the AVX2 code's operations in its order: the same bits,
   with half the multiply instructions. */
static void interleave_pairs(const float *x, int64_t k, int pairs, float *out) {
  for (int p = 0; p < pairs; p++) {
    const float *a = x + 2 * p * k, *b = a + k;
    for (int64_t c = 0; c < k; c += 8, out += 16) {
      memcpy(out, a + c, 8 * sizeof(float));
      memcpy(out + 8, b + c, 8 * sizeof(float));
    }
  }
}

/* unpack_group's four registers, each in both halves of one 512-bit register. */
static inline void unpack_group_twice(const uint8_t *c, __m512 q[4]) {
  const __m512i low = _mm512_set1_epi32(0x0f);
  const __m512i b0 = _mm512_cvtepu8_epi32(_mm_castpd_si128(_mm_loaddup_pd((const double *)c)));
  const __m512i b1 =
      _mm512_cvtepu8_epi32(_mm_castpd_si128(_mm_loaddup_pd((const double *)(c + 8))));
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b0, low));
  q[1] = _mm512_cvtepi32_ps(_mm512_and_si512(b1, low));
  q[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4));
  q[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4));
}

static inline __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Rows r0..r0+nr-1 (nr >= 2): pairs from xi (interleave_pairs' layout), an odd last row in
   the low halves, as the AVX2 code computes it. The groups are taken a block at a time
   (K_BLOCK) for N_BLOCK columns, so the tile's activations for that block stay in the
   first-level cache instead of streaming from the second for every column; each column's
   sums wait between blocks in `partial`, and every sum still adds its groups in order, so
   blocking changes no bit. */
static inline __attribute__((always_inline)) void pairs_tile_of(const Job *job, int64_t r0,
                                                                const int nr, const float *xi) {
  const int64_t k = job->k, groups = k / GROUP;
  const int64_t stride = (job->symmetric ? 1 : 2) * groups;
  const int pairs = nr / 2, odd = nr & 1;
  const float *last_row = job->x + (r0 + nr - 1) * k;
  __m512 partial[N_BLOCK][PAIR_TILE / 2];
  __m256 partial_last[N_BLOCK];
  float scales[K_BLOCK];
  for (int64_t n0 = job->n0; n0 < job->n1; n0 += N_BLOCK) {
    const int64_t nb = job->n1 - n0 < N_BLOCK ? job->n1 - n0 : N_BLOCK;
    for (int64_t j = 0; j < nb; j++) {
      for (int p = 0; p < pairs; p++) partial[j][p] = _mm512_setzero_ps();
      partial_last[j] = _mm256_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += K_BLOCK) {
      const int64_t g1 = groups - g0 < K_BLOCK ? groups : g0 + K_BLOCK;
      for (int64_t j = 0; j < nb; j++) {
        const int64_t n = n0 + j;
        const uint8_t *codes = job->codes + n * (k / 2);
        scales_to_float(job->scale_min + n * stride + g0, g1 - g0, scales);
        __m512 total[PAIR_TILE / 2];
        for (int p = 0; p < pairs; p++) total[p] = partial[j][p];
        __m256 last = partial_last[j];
        for (int64_t g = g0; g < g1; g++) {
          __m512 q[4];
          unpack_group_twice(codes + 16 * g, q);
          const __m512 s = _mm512_set1_ps(scales[g - g0]);
          for (int p = 0; p < pairs; p++) {
            const float *x = xi + 2 * p * k + 2 * GROUP * g;
            __m512 a = _mm512_mul_ps(q[0], _mm512_loadu_ps(x));
            a = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16), a);
            a = _mm512_fmadd_ps(q[2], _mm512_loadu_ps(x + 32), a);
            a = _mm512_fmadd_ps(q[3], _mm512_loadu_ps(x + 48), a);
            total[p] = _mm512_fmadd_ps(a, s, total[p]);
          }
          if (odd) {
            const __m256 half[4] = {_mm512_castps512_ps256(q[0]), _mm512_castps512_ps256(q[1]),
                                    _mm512_castps512_ps256(q[2]), _mm512_castps512_ps256(q[3])};
            last = _mm256_fmadd_ps(group_dot(half, last_row + GROUP * g),
                                   _mm512_castps512_ps256(s), last);
          }
        }
        for (int p = 0; p < pairs; p++) partial[j][p] = total[p];
        partial_last[j] = last;
      }
    }
    for (int64_t j = 0; j < nb; j++) {
      for (int p = 0; p < pairs; p++) {
        finish(job, r0 + 2 * p, n0 + j, _mm512_castps512_ps256(partial[j][p]));
        finish(job, r0 + 2 * p + 1, n0 + j, high_half(partial[j][p]));
      }
      if (odd) finish(job, r0 + nr - 1, n0 + j, partial_last[j]);
    }
  }
}

static void pairs_tile(const Job *job, int64_t r0, int64_t nr, const float *xi) {
  switch (nr) {
#define KVCHAT_PAIRS_CASE(c) \
  case c:                    \
    pairs_tile_of(job, r0, c, xi); \
    break;
    KVCHAT_PAIRS_CASE(2) KVCHAT_PAIRS_CASE(3) KVCHAT_PAIRS_CASE(4) KVCHAT_PAIRS_CASE(5)
    KVCHAT_PAIRS_CASE(6) KVCHAT_PAIRS_CASE(7) KVCHAT_PAIRS_CASE(8) KVCHAT_PAIRS_CASE(9)
    KVCHAT_PAIRS_CASE(10) KVCHAT_PAIRS_CASE(11) KVCHAT_PAIRS_CASE(12) KVCHAT_PAIRS_CASE(13)
    KVCHAT_PAIRS_CASE(14) KVCHAT_PAIRS_CASE(15)
#undef KVCHAT_PAIRS_CASE
    default: pairs_tile_of(job, r0, PAIR_TILE, xi); break;
  }
}
#endif

static void run_job(const Job *job) {
#ifdef KVCHAT_AVX512
  /* A few rows (a decode step) gain nothing from pairing what they read once: the AVX2 code
     serves them, and any rows when the pairs' buffer cannot be had. The buffer is aligned to
     the cache line, since a 512-bit load across two lines costs twice one within a line. */
  float *xi = job->rows >= 4 ? aligned_alloc(64, PAIR_TILE * job->k * sizeof *xi) : NULL;
  if (xi != NULL) {
    for (int64_t r = 0; r < job->rows; r += PAIR_TILE) {
      const int64_t nr = job->rows - r < PAIR_TILE ? job->rows - r : PAIR_TILE;
      if (nr == 1) {
        rows_tile(job, r, 1);
        continue;
      }
      interleave_pairs(job->x + r * job->k, job->k, (int)(nr / 2), xi);
      pairs_tile(job, r, nr, xi);
    }
    free(xi);
    return;
  }
#endif
  for (int64_t r = 0; r < job->rows; r += ROW_TILE)
    rows_tile(job, r, job->rows - r < ROW_TILE ? job->rows - r : ROW_TILE);
}

/* Worker threads kept between calls. Why: a decode step makes a few hundred calls of tens to
   hundreds of microseconds, and starting a thread per call cost a large share of each. A
   worker polls for its next job a while (the next call usually comes within that),
   yielding its core at each poll so that torch's threads, busy between two calls, lose
   nothing to it (a plain spin took a core from them during prefill), then sleeps on a
   condition variable. Each worker has its own slot, so a job is only ever seen by the
   worker it was given to. */
#define MAX_THREADS 16
#define SPINS 20000 /* the caller's polls of a worker's slot before it yields its core */
#define YIELDS 100  /* a worker's polls before sleeping, each giving way to any thread */

typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  pthread_t id;
  const Job *job;
  atomic_uint given, done; /* tickets: the worker runs a job when given moves past done */
} Slot;

static Slot slots[MAX_THREADS];
static int workers = 0; /* slots 1..workers have a running thread */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void *worker_loop(void *arg) {
  Slot *slot = (Slot *)arg;
  unsigned seen = atomic_load(&slot->done);
  for (;;) {
    for (int i = 0; i < YIELDS && atomic_load_explicit(&slot->given, memory_order_acquire) == seen;
         i++)
      sched_yield();
    pthread_mutex_lock(&slot->lock);
    while (atomic_load_explicit(&slot->given, memory_order_acquire) == seen)
      pthread_cond_wait(&slot->wake, &slot->lock);
    pthread_mutex_unlock(&slot->lock);
    seen++;
    run_job(slot->job);
    atomic_store_explicit(&slot->done, seen, memory_order_release);
  }
  return NULL;
}

/* A child of fork() has none of its parent's workers: start afresh. */
static void forget_workers(void) {
  workers = 0;
  pthread_mutex_init(&pool_lock, NULL);
}

/* Slots 1..want with running workers, as many as could be started; returns how many. */
static int start_workers(int want) {
  static int registered = 0;
  if (!registered) {
    pthread_atfork(NULL, NULL, forget_workers);
    registered = 1;
  }
  for (; workers < want; workers++) {
    Slot *slot = &slots[workers + 1];
    pthread_mutex_init(&slot->lock, NULL);
    pthread_cond_init(&slot->wake, NULL);
    atomic_store(&slot->given, 0);
    atomic_store(&slot->done, 0);
    if (pthread_create(&slot->id, NULL, worker_loop, slot) != 0) break;
  }
  return workers < want ? workers : want;
}

/* Runs jobs[0..count-1]: jobs[0] here, the rest on workers; what no worker takes, here. */
static void run_jobs(const Job *jobs, int count) {
  /* One caller at a time owns the workers; a concurrent caller runs its jobs itself. */
  int helpers = 0;
  const int owner = count > 1 && pthread_mutex_trylock(&pool_lock) == 0;
  if (owner) helpers = start_workers(count - 1);
  for (int t = 1; t <= helpers; t++) {
    Slot *slot = &slots[t];
    slot->job = &jobs[t];
    pthread_mutex_lock(&slot->lock);
    atomic_fetch_add_explicit(&slot->given, 1, memory_order_release);
    pthread_cond_signal(&slot->wake);
    pthread_mutex_unlock(&slot->lock);
  }
  for (int t = helpers + 1; t < count; t++) run_job(&jobs[t]);
  run_job(&jobs[0]);
  for (int t = 1; t <= helpers; t++) {
    const unsigned ticket = atomic_load(&slots[t].given);
    for (int i = 0; atomic_load_explicit(&slots[t].done, memory_order_acquire) != ticket; i++)
      if (i > SPINS) sched_yield();
      else relax();
  }
  if (owner) pthread_mutex_unlock(&pool_lock);
}

/* out [rows][n] = x [rows][k] times W [n][k] transposed; xsum is scratch of rows * k / 32
   floats. Threads split the output columns, which changes no sum. */
void kvchat_int4_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *codes,
                        const uint16_t *scale_min, int32_t symmetric, int64_t n, float *out,
                        float *xsum, int32_t threads) {
  group_sums(x, rows, k, xsum);
  /* Handing a job to a waiting worker costs a few microseconds: worth it from a fifth of a
     million multiply-adds (a small model's projections of one row). */
  if ((double)n * (double)k * (double)rows < 2.0e5) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads < 1) threads = 1;
  Job jobs[MAX_THREADS];
  const int64_t per = (n + threads - 1) / threads;
  for (int32_t t = 0; t < threads; t++) {
    const int64_t n0 = t * per < n ? t * per : n, n1 = (t + 1) * per < n ? (t + 1) * per : n;
    jobs[t] = (Job){x, xsum, rows, k, codes, scale_min, symmetric, n, out, n0, n1};
  }
  run_jobs(jobs, threads);
}
