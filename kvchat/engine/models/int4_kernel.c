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

   Exactness: every output of kvchat_int4_matmul is summed in one fixed order that depends on
   neither the row count nor the thread count nor the build: a row's result is the same alone
   or in a prefill chunk, and the plain C below computes the AVX2 code's operations in the
   AVX2 code's order (fmaf where it uses FMA; built with -ffp-contract=off), so both builds
   give the same bits. kvchat_int4_matmul_tiles (AMX, for calls of many rows) has its own
   fixed order, the same for any row and thread count, but not this one's. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "worker_pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVCHAT_AVX2 1
#if defined(__AVX512F__)
#define KVCHAT_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__) && defined(__x86_64__)
#define KVCHAT_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
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
  const uint16_t *tiles_x; /* the tiled path's activations (tiles_activations), or NULL */
  int64_t padded_rows, steps; /* its rows rounded up to 32, its k-steps of 32 */
  uint16_t *tiles_w;         /* the job's own dequantized weights (tiles_job) */
  float *tiles_sums;         /* and its sums */
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

/* Bytes 0-7 (half 0) or 8-15 (half 1) of two columns' codes for one group, widened: lanes
   0-7 the first column's, lanes 8-15 the second's. */
static inline __m512i two_columns_bytes(const uint8_t *a, const uint8_t *b) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                          _mm_loadl_epi64((const __m128i *)b));
  return _mm512_cvtepu8_epi32(both);
}

/* One group of one row against two columns: each half of a register is one column, running
   the AVX2 code's operations on it in the AVX2 code's order (the row's activations stand in
   both halves). `twice` says where they come from: from `xg` laid out twice over
   (column_pairs_row's buffer), or broadcast from the row itself. */
static inline __attribute__((always_inline)) __m512 pair_group(const uint8_t *ca,
                                                                const uint8_t *cb,
                                                                const float *xg, const int twice,
                                                                __m512 s, __m512 total) {
  const __m512i low = _mm512_set1_epi32(0x0f);
  const __m512i b0 = two_columns_bytes(ca, cb);
  const __m512i b1 = two_columns_bytes(ca + 8, cb + 8);
  __m512 x[4];
  for (int i = 0; i < 4; i++)
    x[i] = twice ? _mm512_load_ps(xg + 16 * i)
                 : _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 8 * i));
  __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b0, low)), x[0]);
  a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b1, low)), x[1], a);
  a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), x[2], a);
  a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), x[3], a);
  return _mm512_fmadd_ps(a, s, total);
}

/* The job's columns, two at a time, against one row at `x` (laid out twice over or not, as
   `twice` says: pair_group). */
static inline __attribute__((always_inline)) void column_pairs_of(const Job *job, const float *x,
                                                                  const int twice) {
  const int64_t k = job->k, groups = k / GROUP;
  const int64_t stride = (job->symmetric ? 1 : 2) * groups;
  float scales[2][groups];
  for (int64_t n = job->n0; n < job->n1; n += 2) {
    const int64_t m = n + 1 < job->n1 ? n + 1 : n;
    const uint8_t *ca = job->codes + n * (k / 2), *cb = job->codes + m * (k / 2);
    scales_to_float(job->scale_min + n * stride, groups, scales[0]);
    scales_to_float(job->scale_min + m * stride, groups, scales[1]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      /* The next pair's codes, a cache line every fourth group (see rows_tile_of). */
      if ((g & 3) == 0) {
        _mm_prefetch((const char *)(ca + k + 16 * g), _MM_HINT_T0);
        _mm_prefetch((const char *)(ca + k + k / 2 + 16 * g), _MM_HINT_T0);
      }
      const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(scales[0][g])),
                                          _mm256_set1_ps(scales[1][g]), 1);
      total = pair_group(ca + 16 * g, cb + 16 * g, x + (twice ? 2 : 1) * GROUP * g, twice, s,
                         total);
    }
    finish(job, 0, n, _mm512_castps512_ps256(total));
    if (m != n) finish(job, 0, m, high_half(total));
  }
}

/* The largest row laid out twice on the stack (128 KiB); a longer one is broadcast as it is
   read, which gives the same bits. */
#define TWICE_MAX_K 16384

/* One row against two columns at a time (pair_group), so the bits are rows_tile's and a
   decode step issues half the instructions per weight, which is what held its reading of the
   weights under the memory's speed. The row is first laid out twice over (each quarter
   group's 8 activations, then the same 8 again), once per call, so that every multiply reads
   its operand from the first-level cache as it is, instead of broadcasting it (1.1-1.2x as
   fast at one row: benchmarks/bench_int4_kernel.py). An odd last column runs in both halves,
   its second copy dropped. */
static void column_pairs_row(const Job *job) {
  const int64_t k = job->k;
  if (k > TWICE_MAX_K) {
    column_pairs_of(job, job->x, 0);
    return;
  }
  float buffer[2 * k + 16];
  float *doubled = (float *)(((uintptr_t)buffer + 63) & ~(uintptr_t)63);
  for (int64_t c = 0; c < k; c += 8) {
    const __m256 v = _mm256_loadu_ps(job->x + c);
    _mm256_store_ps(doubled + 2 * c, v);
    _mm256_store_ps(doubled + 2 * c + 8, v);
  }
  column_pairs_of(job, doubled, 1);
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

#ifdef KVCHAT_TILES
/* The tiled path (AMX), for calls of many rows (a prefill chunk): the tile unit multiplies
   bf16 pairs into float32 sums about ten times as fast as the vector code multiplies float32.
   Each weight is held exactly as the sum of two bf16 numbers (high and low): a code times its
   fp16 scale has at most 15 significant bits, and so has a symmetric row's (q - 8) * scale;
   an asymmetric row's minimums (fp16) enter as extra k-steps, against each group's activation
   sum. Each activation is split the same way, and every output adds, for each k-step in
   order, high weights times high activations, low weights times high activations, then high
   weights times low activations (the low-times-low term, under 2^-16 of the product, is
   left out). Every output is the same sequence of tile operations whatever the row count
   above the tiled threshold and the thread count: a row's bits do not depend on the other
   rows of a tiled call. They are not the vector path's bits (see int4_kernel.py). */
#define TILE 16          /* rows and columns of a tile */
#define TILE_STEP 32     /* k values per tile step (16 bf16 pairs) */
#define TILE_BLOCK_N 128 /* weight rows dequantized per pass */
#define TILE_CHUNK 16    /* k-steps per pass (512 k values) */
#define TILE_ROWS_PER_PASS 256 /* activation rows per call of the tiles */

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} TileConfig;

static int tiles_permitted = -1; /* -1: not asked yet */

/* Linux lends the tile registers to a process that asks (once; every thread may then use
   them). */
static int tiles_ready(void) {
  if (tiles_permitted < 0) {
    const long XFEATURE_XTILEDATA = 18, ARCH_REQ_XCOMP_PERM = 0x1023;
    tiles_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  return tiles_permitted;
}

static void tiles_configure(void) {
  TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = TILE;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

/* v as a high and a low bf16 (v - high, exact for the values above). */
static inline void split_bf16(__m512 v, __m256bh *high, __m256bh *low) {
  *high = _mm512_cvtneps_pbh(v);
  const __m512 back =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)*high), 16));
  *low = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
}

/* A call's activations as the tiles read them: for each k-step and each 16 rows, the high
   tile then the low one, each 16 bf16 pairs (k, k + 1) by 16 rows; rows past the call's are
   zero. An asymmetric weight's extra k-steps hold each group's activation sum. */
static void tiles_activations(const float *x, const float *xsum, int64_t rows, int64_t k,
                              int64_t steps, int64_t padded_rows, uint16_t *out) {
  const int64_t groups = k / GROUP, row_tiles = padded_rows / TILE;
  memset(out, 0, (size_t)steps * padded_rows * TILE_STEP * 2 * sizeof *out);
  const __m512i pair_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(TILE));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t s = 0; s < steps; s++) {
      __m512 v[2];
      if (s < groups) {
        v[0] = _mm512_loadu_ps(x + r * k + TILE_STEP * s);
        v[1] = _mm512_loadu_ps(x + r * k + TILE_STEP * s + TILE);
      } else { /* the groups' sums, then zeros */
        const int64_t g0 = TILE_STEP * (s - groups);
        for (int h = 0; h < 2; h++) {
          const int64_t from = g0 + TILE * h, left = groups - from;
          const __mmask16 mask =
              left >= TILE ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
          v[h] = _mm512_maskz_loadu_ps(mask, xsum + r * groups + (left > 0 ? from : 0));
        }
      }
      __m256bh high[2], low[2];
      split_bf16(v[0], &high[0], &low[0]);
      split_bf16(v[1], &high[1], &low[1]);
      uint16_t *tile = out + ((s * row_tiles + r / TILE) * 2) * TILE * TILE_STEP;
      const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)high[0]),
                                            (__m256i)high[1], 1);
      const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)low[0]),
                                            (__m256i)low[1], 1);
      _mm512_i32scatter_epi32(tile + 2 * (r % TILE), pair_rows, hi, 4);
      _mm512_i32scatter_epi32(tile + TILE * TILE_STEP + 2 * (r % TILE), pair_rows, lo, 4);
    }
}

/* Weight rows n0..n0+count-1 (zero past the job's last), k-steps s0..s1-1, as high and low
   bf16 rows of TILE_CHUNK * TILE_STEP values. */
static void tiles_weights(const Job *job, int64_t n0, int64_t count, int64_t s0, int64_t s1,
                          uint16_t *high, uint16_t *low) {
  const int64_t k = job->k, groups = k / GROUP, width = TILE_CHUNK * TILE_STEP;
  const int64_t stride = (job->symmetric ? 1 : 2) * groups;
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  const __m512 eight = _mm512_set1_ps(job->symmetric ? 8.0f : 0.0f);
  for (int64_t j = 0; j < TILE_BLOCK_N; j++) {
    uint16_t *h = high + j * width, *l = low + j * width;
    const int64_t n = n0 + j;
    if (j >= count) {
      memset(h, 0, (size_t)width * sizeof *h);
      memset(l, 0, (size_t)width * sizeof *l);
      continue;
    }
    const uint16_t *scales = job->scale_min + n * stride;
    for (int64_t s = s0; s < s1; s++) {
      __m512 v[2];
      if (s < groups) {
        const __m512i b =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(job->codes + n * (k / 2) +
                                                                   16 * s)));
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(scales[s]));
        v[0] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, nibble)), eight),
                             scale);
        v[1] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), eight),
                             scale);
      } else { /* the minimums, then zeros */
        const int64_t g0 = TILE_STEP * (s - groups);
        for (int hh = 0; hh < 2; hh++) {
          const int64_t from = g0 + TILE * hh, left = groups - from;
          const __mmask16 mask =
              left >= TILE ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
          v[hh] = _mm512_cvtph_ps(
              _mm256_maskz_loadu_epi16(mask, scales + groups + (left > 0 ? from : 0)));
        }
      }
      /* The high half keeps a weight's top 8 significant bits (cut, not rounded), so the
         rest, at most 7 bits, is exact in the low half. */
      const __m512 top = _mm512_castsi512_ps(_mm512_set1_epi32((int)0xffff0000u));
      const __m512 h0 = _mm512_and_ps(v[0], top), h1 = _mm512_and_ps(v[1], top);
      const int64_t at = (s - s0) * TILE_STEP;
      _mm512_storeu_si512(h + at, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
      _mm512_storeu_si512(
          l + at, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v[1], h1), _mm512_sub_ps(v[0], h0)));
    }
  }
}

/* Tiles 0-3 (the sums of two weight tiles, 4 and 5, by two activation tiles, 6 and 7) plus
   their products. */
static inline __attribute__((always_inline)) void tiles_products(void) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

/* 32 weight rows by 32 activation rows over k-steps s0..s1-1: tiles 0-3 hold the sums. */
static inline void tiles_block(const uint16_t *wh, const uint16_t *wl, const uint16_t *xt,
                               int64_t row_tiles, int64_t mt, int64_t s0, int64_t s1) {
  const int64_t width = TILE_CHUNK * TILE_STEP * 2; /* bytes per weight row */
  const int64_t tile = TILE * TILE_STEP;            /* uint16 per tile */
  const int64_t second = TILE * TILE_CHUNK * TILE_STEP; /* the second weight tile's rows */
  for (int64_t s = s0; s < s1; s++) {
    const uint16_t *a = xt + ((s * row_tiles + mt) * 2) * tile;
    const uint16_t *b = xt + ((s * row_tiles + mt + 1) * 2) * tile;
    const int64_t at = (s - s0) * TILE_STEP;
    _tile_loadd(4, wh + at, width); /* high weights by high activations */
    _tile_loadd(5, wh + second + at, width);
    _tile_loadd(6, a, 64);
    _tile_loadd(7, b, 64);
    tiles_products();
    _tile_loadd(4, wl + at, width); /* low weights by high activations */
    _tile_loadd(5, wl + second + at, width);
    tiles_products();
    _tile_loadd(4, wh + at, width); /* high weights by low activations */
    _tile_loadd(5, wh + second + at, width);
    _tile_loadd(6, a + tile, 64);
    _tile_loadd(7, b + tile, 64);
    tiles_products();
  }
}

/* The job's columns through the tiles: for each block of TILE_BLOCK_N weight rows, the
   k-steps a chunk at a time (each chunk's weights dequantized once), every output's sums
   kept between chunks in `sums` (one [16][16] tile per 16 weight rows and 16 activation
   rows), then written out. The chunks run in k order, so blocking changes no bit. */
static void tiles_job(const Job *job) {
  const int64_t row_tiles = job->padded_rows / TILE, width = TILE_CHUNK * TILE_STEP;
  const int64_t col_tiles = TILE_BLOCK_N / TILE, tile_floats = TILE * TILE;
  uint16_t *high = job->tiles_w, *low = high + TILE_BLOCK_N * width;
  float *sums = job->tiles_sums;
  tiles_configure();
  for (int64_t n0 = job->n0; n0 < job->n1; n0 += TILE_BLOCK_N) {
    const int64_t count = job->n1 - n0 < TILE_BLOCK_N ? job->n1 - n0 : TILE_BLOCK_N;
    const int64_t used = (count + 2 * TILE - 1) / (2 * TILE) * 2 * TILE;
    for (int64_t s0 = 0; s0 < job->steps; s0 += TILE_CHUNK) {
      const int64_t s1 = job->steps - s0 < TILE_CHUNK ? job->steps : s0 + TILE_CHUNK;
      tiles_weights(job, n0, count, s0, s1, high, low);
      for (int64_t mt = 0; mt < row_tiles; mt += 2)
        for (int64_t ct = 0; ct < used / TILE; ct += 2) {
          float *c[4] = {sums + (mt * col_tiles + ct) * tile_floats,
                         sums + ((mt + 1) * col_tiles + ct) * tile_floats,
                         sums + (mt * col_tiles + ct + 1) * tile_floats,
                         sums + ((mt + 1) * col_tiles + ct + 1) * tile_floats};
          if (s0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, c[0], 64);
            _tile_loadd(1, c[1], 64);
            _tile_loadd(2, c[2], 64);
            _tile_loadd(3, c[3], 64);
          }
          tiles_block(high + ct * TILE * width, low + ct * TILE * width, job->tiles_x,
                      row_tiles, mt, s0, s1);
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
        }
    }
    /* A sums tile is [weight row][activation row]: each output row gathers its 16 values
       from a column of the tile. */
    const __m512i column = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(TILE));
    for (int64_t r = 0; r < job->rows; r++) {
      float *out = job->out + r * job->n + n0;
      const float *from = sums + (r / TILE) * col_tiles * tile_floats + r % TILE;
      for (int64_t j = 0; j < count; j += TILE) {
        const int64_t left = count - j;
        const __mmask16 mask = left >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        _mm512_mask_storeu_ps(out + j, mask,
                              _mm512_i32gather_ps(column, from + (j / TILE) * tile_floats, 4));
      }
    }
  }
  _tile_release();
}
#endif

static void run_job(const Job *job) {
#ifdef KVCHAT_TILES
  if (job->tiles_x != NULL) {
    tiles_job(job);
    return;
  }
#endif
#ifdef KVCHAT_AVX512
  /* One row (a decode step) pairs columns instead. Two or three rows gain nothing from
     pairing what they read once: the AVX2 code serves them, and any rows when the pairs'
     buffer cannot be had. The buffer is aligned to the cache line, since a 512-bit load
     across two lines costs twice one within a line. */
  if (job->rows == 1) {
    column_pairs_row(job);
    return;
  }
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

/* The jobs of one call on the pool's threads (worker_pool.h): job i on index i. */
#define MAX_THREADS POOL_MAX_THREADS

static void run_job_at(void *jobs, int index) { run_job(&((const Job *)jobs)[index]); }

static void run_jobs(const Job *jobs, int count) { pool_run(run_job_at, (void *)jobs, count); }

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
    jobs[t] = (Job){x, xsum, rows, k, codes, scale_min, symmetric, n, out, n0, n1, NULL, 0, 0, NULL, NULL};
  }
  run_jobs(jobs, threads);
}

/* Whether kvchat_int4_matmul_tiles can run here: built with the tile instructions, and the
   kernel lent the tile registers. */
int32_t kvchat_int4_tiles_ready(void) {
#ifdef KVCHAT_TILES
  return tiles_ready();
#else
  return 0;
#endif
}

/* kvchat_int4_matmul through the tiles (see above); returns 0, or -1 when the tiles are not
   ready or its buffers could not be had (nothing is written then). */
int32_t kvchat_int4_matmul_tiles(const float *x, int64_t rows, int64_t k, const uint8_t *codes,
                                 const uint16_t *scale_min, int32_t symmetric, int64_t n,
                                 float *out, float *xsum, int32_t threads) {
#ifdef KVCHAT_TILES
  if (!tiles_ready()) return -1;
  const int64_t groups = k / GROUP;
  const int64_t steps = groups + (symmetric ? 0 : (groups + TILE_STEP - 1) / TILE_STEP);
  const int64_t padded_rows = (rows + 2 * TILE - 1) / (2 * TILE) * 2 * TILE;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads < 1) threads = 1;
  if (rows > TILE_ROWS_PER_PASS) { /* rows are independent: a pass at a time bounds the buffers */
    for (int64_t r = 0; r < rows; r += TILE_ROWS_PER_PASS) {
      const int64_t take = rows - r < TILE_ROWS_PER_PASS ? rows - r : TILE_ROWS_PER_PASS;
      if (kvchat_int4_matmul_tiles(x + r * k, take, k, codes, scale_min, symmetric, n,
                                   out + r * n, xsum + r * groups, threads) != 0)
        return -1;
    }
    return 0;
  }
  /* The activations, then each job's weights and sums (multiples of 64 bytes). */
  const size_t x_bytes = (size_t)steps * padded_rows * TILE_STEP * 2 * sizeof(uint16_t);
  const size_t w_bytes = 2 * TILE_BLOCK_N * TILE_CHUNK * TILE_STEP * sizeof(uint16_t);
  const size_t sums_bytes = (size_t)padded_rows * TILE_BLOCK_N * sizeof(float);
  uint8_t *buffer = aligned_alloc(64, x_bytes + threads * (w_bytes + sums_bytes));
  if (buffer == NULL) return -1;
  uint16_t *tiles_x = (uint16_t *)buffer;
  if (!symmetric) group_sums(x, rows, k, xsum);
  tiles_activations(x, xsum, rows, k, steps, padded_rows, tiles_x);
  Job jobs[MAX_THREADS];
  /* Threads split the columns in whole blocks of 32. */
  const int64_t blocks = (n + 2 * TILE - 1) / (2 * TILE);
  const int64_t per = (blocks + threads - 1) / threads * 2 * TILE;
  for (int32_t t = 0; t < threads; t++) {
    const int64_t n0 = t * per < n ? t * per : n, n1 = (t + 1) * per < n ? (t + 1) * per : n;
    uint8_t *own = buffer + x_bytes + t * (w_bytes + sums_bytes);
    jobs[t] = (Job){x,     xsum, rows, k, codes, scale_min, symmetric, n, out, n0, n1, tiles_x,
                    padded_rows, steps, (uint16_t *)own, (float *)(own + w_bytes)};
  }
  run_jobs(jobs, threads);
  free(buffer);
  return 0;
#else
  (void)x, (void)rows, (void)k, (void)codes, (void)scale_min, (void)symmetric, (void)n;
  (void)out, (void)xsum, (void)threads;
  return -1;
#endif
}
