/* kvchat's int4 weight kernel: out[r][n] = sum_k x[r][k] * W[n][k].

   Why: torch's int4 CPU kernel casts activations to bf16, and on CPUs without AVX-512 it is
   compute bound well under the memory's speed. Here, as llama.cpp does for its Q4 types,
   each row's activations are quantized to int8 in groups of 32 (one scale per group, the
   group's largest magnitude over 127, rounded to nearest even), and a weight group's codes
   multiply them in integer arithmetic (AVX2's maddubs), exact, before one float multiply-add
   per group and lane. Unpacking 4-bit codes into floats was the float form's bottleneck: it
   read Gemma-3-4B's matrices at ~11 GB/s on two cores that can stream ~25 GB/s.

   Weights (kvchat.engine.models.int4_kernel): codes uint8 [N][K/2], where byte j of group g
   holds column 32g + j in its low nibble and column 32g + 16 + j in its high nibble (GGUF's
   Q4 block order); scale_min fp16 [N][2][K/32]: each row's group scales, then its group
   minimums, so that W[n][32g + j] = q * scale + min; or, symmetric (a GGUF Q4_0 tensor's
   form), [N][1][K/32]: the scales alone, each group's minimum being -8 * scale. The
   minimums' term multiplies each group's sum of the same int8 activations.

   Exactness: every output is summed in one fixed order that depends on neither the row count
   nor the thread count nor the build: a row's quantization and sums are its own, so its
   result is the same alone or in a prefill chunk, and the plain C below computes the AVX2
   code's operations in the AVX2 code's order (integer sums are exact in any order; fmaf
   where it uses FMA; built with -ffp-contract=off), so both builds give the same bits. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVCHAT_AVX2 1
#endif

#define GROUP 32
#define ROW_TILE 8 /* activation rows sharing one unpacked weight group */

/* Rows' activations as the dot products read them: int8 codes [rows][k], each group's scale
   and float32 sum [rows][k / 32]. */
typedef struct {
  int8_t *q;
  float *scale;
  float *sum;
} Activations;

typedef struct {
  const Activations *x;
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

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

/* One group's codes (round(x * 127 / max|x|), nearest even), scale and sum: the sum of the
   quantized values (the codes' exact integer sum times the scale), so that the minimums'
   term multiplies the same activations as the codes' products. Against the float sum it
   keeps the error that of sum(x' * w) over the weights' real values, not over the unsigned
   codes' (which are off centre by 8 steps). */
static void quantize_group(const float *p, int8_t *q, float *scale, float *sum) {
  float amax, scaled[GROUP];
#ifdef KVCHAT_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
  const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
  amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3))));
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm256_storeu_ps(scaled, _mm256_round_ps(_mm256_mul_ps(v0, inverse), mode));
  _mm256_storeu_ps(scaled + 8, _mm256_round_ps(_mm256_mul_ps(v1, inverse), mode));
  _mm256_storeu_ps(scaled + 16, _mm256_round_ps(_mm256_mul_ps(v2, inverse), mode));
  _mm256_storeu_ps(scaled + 24, _mm256_round_ps(_mm256_mul_ps(v3, inverse), mode));
#else
  amax = 0.0f;
  for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(p[j]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int j = 0; j < GROUP; j++) scaled[j] = nearbyintf(p[j] * inverse);
#endif
  int32_t codes_sum = 0;
  for (int j = 0; j < GROUP; j++) {
    q[j] = (int8_t)scaled[j];
    codes_sum += q[j];
  }
  *scale = amax / 127.0f;
  *sum = (float)codes_sum * *scale;
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, const Activations *out) {
  const int64_t groups = k / GROUP;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < groups; g++) {
      const int64_t at = r * groups + g;
      quantize_group(x + r * k + GROUP * g, out->q + GROUP * at, out->scale + at, out->sum + at);
    }
}

#ifdef KVCHAT_AVX2
static inline void scales_to_float(const uint16_t *h, int64_t groups, float *out) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
  for (; g < groups; g++) out[g] = _cvtsh_ss(h[g]);
}

/* A group's 32 codes as bytes in column order: low nibbles, then high. */
static inline __m256i unpack_group(const uint8_t *c) {
  const __m128i raw = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(0x0f);
  const __m128i first = _mm_and_si128(raw, low);
  const __m128i second = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
}

/* Output (r, n): the scaled sums, then the minimums' term. */
static inline void finish(const Job *job, int64_t r, int64_t n, __m256 total) {
  const int64_t groups = job->k / GROUP;
  const uint16_t *scale = job->scale_min + n * (job->symmetric ? 1 : 2) * groups;
  const uint16_t *minv = job->symmetric ? scale : scale + groups;
  /* A symmetric row's minimums are -8 * its scales (exact in float32). */
  const float factor = job->symmetric ? -8.0f : 1.0f;
  const float *xs = job->x->sum + r * groups;
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
   kept in memory would wait on a store and a load at every group). */
static inline __attribute__((always_inline)) void rows_tile_of(const Job *job, int64_t r0,
                                                               const int nr) {
  const int64_t k = job->k, groups = k / GROUP;
  const int64_t stride = (job->symmetric ? 1 : 2) * groups;
  const __m256i ones = _mm256_set1_epi16(1);
  float scales[groups];
  for (int64_t n = job->n0; n < job->n1; n++) {
    const uint8_t *codes = job->codes + n * (k / 2);
    scales_to_float(job->scale_min + n * stride, groups, scales);
    __m256 total[ROW_TILE];
    for (int r = 0; r < nr; r++) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      const __m256i w = unpack_group(codes + 16 * g);
      for (int r = 0; r < nr; r++) {
        const int64_t at = (r0 + r) * groups + g;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(job->x->q + GROUP * at));
        /* lane l: columns 4l..4l+3, summed exactly in int32 */
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones);
        const __m256 d = _mm256_set1_ps(scales[g] * job->x->scale[at]);
        total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, total[r]);
      }
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
      int32_t w[GROUP];
      for (int j = 0; j < 16; j++) {
        w[j] = codes[16 * g + j] & 0x0f;
        w[16 + j] = codes[16 * g + j] >> 4;
      }
      const float s = half_to_float(scale[g]);
      for (int r = 0; r < nr; r++) {
        const int64_t at = (r0 + r) * groups + g;
        const int8_t *q = job->x->q + GROUP * at;
        const float d = s * job->x->scale[at];
        for (int l = 0; l < 8; l++) {
          const int32_t sum = w[4 * l] * q[4 * l] + w[4 * l + 1] * q[4 * l + 1] +
                              w[4 * l + 2] * q[4 * l + 2] + w[4 * l + 3] * q[4 * l + 3];
          total[r][l] = fmaf((float)sum, d, total[r][l]);
        }
      }
    }
    for (int r = 0; r < nr; r++) {
      const float *xs = job->x->sum + (r0 + r) * groups;
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

static void *run_job(void *arg) {
  const Job *job = (const Job *)arg;
  for (int64_t r = 0; r < job->rows; r += ROW_TILE)
    rows_tile(job, r, job->rows - r < ROW_TILE ? job->rows - r : ROW_TILE);
  return NULL;
}

/* out [rows][n] = x [rows][k] times W [n][k] transposed. Threads split the output columns,
   which changes no sum. Returns 0, or -1 when its scratch could not be allocated. */
int32_t kvchat_int4_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *codes,
                           const uint16_t *scale_min, int32_t symmetric, int64_t n, float *out,
                           int32_t threads) {
  const int64_t groups = k / GROUP;
  void *scratch = malloc((size_t)(rows * k) + 2 * sizeof(float) * (size_t)(rows * groups));
  if (scratch == NULL) return -1;
  const Activations activations = {(int8_t *)((float *)scratch + 2 * rows * groups),
                                   (float *)scratch, (float *)scratch + rows * groups};
  quantize_rows(x, rows, k, &activations);
  /* A thread costs tens of microseconds to start: only for a million multiply-adds and up. */
  if ((double)n * (double)k * (double)rows < 1.0e6) threads = 1;
  if (threads > 16) threads = 16;
  if (threads < 1) threads = 1;
  Job jobs[16];
  pthread_t ids[16];
  const int64_t per = (n + threads - 1) / threads;
  for (int32_t t = 0; t < threads; t++) {
    const int64_t n0 = t * per < n ? t * per : n, n1 = (t + 1) * per < n ? (t + 1) * per : n;
    jobs[t] = (Job){&activations, rows, k, codes, scale_min, symmetric, n, out, n0, n1};
  }
  int32_t started = 1;
  for (; started < threads; started++)
    if (pthread_create(&ids[started], NULL, run_job, &jobs[started]) != 0) break;
  for (int32_t t = started; t < threads; t++) run_job(&jobs[t]); /* what could not start */
  run_job(&jobs[0]);
  for (int32_t t = 1; t < started; t++) pthread_join(ids[t], NULL);
  free(scratch);
  return 0;
}
