/* kvchat's int8 head kernel: out[r][n] = scale[n] * sum_k x[r][k] * q[n][k], float32
   activations, int8 weights with one scale per output row.

   Why: the output head of a small model is its largest matrix (SmolLM2's 49,152-row tied
   vocabulary: 28 MB of int8, seventy times its largest decoder layer), read once per decoded
   token. torch's _weight_int8pack_mm casts the activations to bf16 and rounds its outputs to
   bf16, which ties near-equal logits (so the head then recomputed its best 16 in float32),
   and on a CPU without AVX-512 it reads the weights at a fraction of the memory's speed.
   Here each weight is widened to a float32 and multiplied with the float32 activation, one
   output row of weights after the other (a stream the hardware prefetcher follows; a
   software prefetch 4 KiB ahead helps it along), with four independent sums per output so
   that the multiply-adds do not wait on each other: a one-row call reads the weights near
   the memory's speed, and every logit is a float32 sum.

   Exactness: each output is summed in one fixed order that depends on neither the row count
   nor the thread count nor the build: the columns in blocks of 8, block j added by fused
   multiply-adds into sum j mod 4 (eight lanes each), in order; then the four sums lane by
   lane as (s0 + s1) + (s2 + s3); then the lanes as (l0 + l4) + (l2 + l6) plus
   (l1 + l5) + (l3 + l7); times the scale. The plain C below computes the AVX2 code's
   operations in the AVX2 code's order (fmaf where it uses FMA; built with
   -ffp-contract=off), so both builds give the same bits. The caller passes k a multiple
   of 8. */

#include <math.h>
#include <stdint.h>

#include "worker_pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVCHAT_AVX2 1
#endif

#define AHEAD 4096 /* bytes of weights ahead of the sums that a one-row call prefetches */

typedef struct {
  const float *x;
  int64_t rows, k;
  const int8_t *q;
  const float *scales;
  int64_t n;
  float *out;
  int64_t n0, n1;
} Job;

#ifdef KVCHAT_AVX2
static inline float hsum8(__m256 v) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

static inline __m256 widen8(const int8_t *q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline __m256 block(const int8_t *q, const float *x, int64_t i, __m256 sum) {
  return _mm256_fmadd_ps(widen8(q + i), _mm256_loadu_ps(x + i), sum);
}

static inline void one_output(const Job *job, int64_t r, int64_t n) {
  const int64_t k = job->k;
  const float *x = job->x + r * k;
  const int8_t *q = job->q + n * k;
  /* The first row reads the weights from memory; later rows find them in the cache. */
  const int64_t ahead = r == 0 ? job->n * k - n * k - AHEAD : 0; /* prefetch while i < it */
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    if (i < ahead && (i & 63) == 0) _mm_prefetch((const char *)(q + i + AHEAD), _MM_HINT_T0);
    s0 = block(q, x, i, s0);
    s1 = block(q, x, i + 8, s1);
    s2 = block(q, x, i + 16, s2);
    s3 = block(q, x, i + 24, s3);
  }
  if (i < k) s0 = block(q, x, i, s0);
  if (i + 8 < k) s1 = block(q, x, i + 8, s1);
  if (i + 16 < k) s2 = block(q, x, i + 16, s2);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  job->out[r * job->n + n] = hsum8(sum) * job->scales[n];
}

#else

static inline void one_output(const Job *job, int64_t r, int64_t n) {
  const int64_t k = job->k;
  const float *x = job->x + r * k;
  const int8_t *q = job->q + n * k;
  float s[4][8] = {{0}};
  for (int64_t i = 0; i < k; i += 8)
    for (int l = 0; l < 8; l++) s[(i / 8) % 4][l] = fmaf((float)q[i + l], x[i + l], s[(i / 8) % 4][l]);
  float t[8];
  for (int l = 0; l < 8; l++) t[l] = (s[0][l] + s[1][l]) + (s[2][l] + s[3][l]);
  const float a0 = t[0] + t[4], a1 = t[1] + t[5], a2 = t[2] + t[6], a3 = t[3] + t[7];
  job->out[r * job->n + n] = ((a0 + a2) + (a1 + a3)) * job->scales[n];
}

#endif

/* One output column at a time, every row for it: its weights (k bytes) stay in the core's
   cache while the rows go by, so a call of many rows reads the matrix once. */
static void run_job(void *jobs, int index) {
  const Job *job = &((const Job *)jobs)[index];
  for (int64_t n = job->n0; n < job->n1; n++)
    for (int64_t r = 0; r < job->rows; r++) one_output(job, r, n);
}

/* out [rows][n] = x [rows][k] times (q [n][k], each row scaled) transposed; k % 8 == 0.
   Threads split the output columns, which changes no sum. */
void kvchat_int8_matmul(const float *x, int64_t rows, int64_t k, const int8_t *q,
                        const float *scales, int64_t n, float *out, int32_t threads) {
  /* Handing a job to a waiting worker costs a few microseconds: not worth it below a fifth
     of a million multiply-adds. */
  if ((double)n * (double)k * (double)rows < 2.0e5) threads = 1;
  if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
  if (threads < 1) threads = 1;
  Job jobs[POOL_MAX_THREADS];
  const int64_t per = (n + threads - 1) / threads;
  for (int32_t t = 0; t < threads; t++) {
    const int64_t n0 = t * per < n ? t * per : n, n1 = (t + 1) * per < n ? (t + 1) * per : n;
    jobs[t] = (Job){x, rows, k, q, scales, n, out, n0, n1};
  }
  pool_run(run_job, jobs, threads);
}
