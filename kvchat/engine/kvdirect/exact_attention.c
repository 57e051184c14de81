/* kvchat's attention sum: one accumulation order on every path.
 *
 * Every query row keeps a running (max, sum, weighted values) state and folds the keys in
 * position order, one key at a time. Nothing in a row's arithmetic depends on how the keys
 * were split into calls, on which other rows share the call, or on how many threads ran it:
 *
 *   - keys are folded one by one, so a call over keys [a, c) gives the bits of a call over
 *     [a, b) followed by one over [b, c) (whole, in-place and streamed K/V agree);
 *   - rows are computed in lanes of LANES, each lane with the same scalar arithmetic, so a
 *     row's bits do not depend on its neighbours (a decode step, a prefill chunk of any
 *     size and a recompute agree);
 *   - threads split the work by (kv head, run of rows), never inside a row.
 *
 * The arithmetic is spelled out (no -ffast-math, -ffp-contract=off, fmaf where a fused
 * multiply-add is meant) and exp is our own, so a vectorised lane and a scalar one give
 * the same result; where the compiler vectorises only changes the speed.
 *
 * Per key and row:  s = (q * scale) . k, as 16 partial sums over dim (element e goes to
 * sum e % 16, in order) added in a fixed tree;  m' = max(m, s);  alpha = exp(m - m') (1 when the
 * max is unchanged);  p = exp(s - m');  l = l * alpha + p;  acc = acc * alpha + p * v.
 * Invisible keys (causal, sliding window) change nothing.
 */

#include <math.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "worker_pool.h"

#define LANES 16  /* rows per tile in the many-rows layout */
#define PARTS 16  /* partial sums of a dot product */
#define FEW_ROWS 8  /* below this many rows per kv head, the one-row layout serves */

static inline float bf16_to_f32(uint16_t bits) {
  uint32_t wide = (uint32_t)bits << 16;
  float out;
  memcpy(&out, &wide, sizeof out);
  return out;
}

/* exp(x) for x <= 0 (x may be -inf), about 1 ulp; Cody-Waite reduction and a degree-6
 * polynomial (Cephes' expf coefficients). exp(0) is exactly 1. */
static inline float exp_nonpositive(float x) {
  const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  float clamped = x < -87.0f ? -87.0f : x;
  float t = fmaf(clamped, 1.44269504088896341f, magic);
  float n = t - magic;
  float r = fmaf(n, -0.693359375f, clamped);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  float r2 = r * r;
  float y = fmaf(p, r2, r) + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, sizeof scale);
  float out = y * scale;
  return x < -87.0f ? 0.0f : out;
}

typedef struct {
  const float *q;      /* [heads][q_len][dim], contiguous */
  int64_t heads, q_len, dim, kv_heads;
  const int64_t *q_pos; /* [q_len]: each query's position */
  float scale;
  int64_t window;       /* sliding window (0: none): key visible iff q - window < key <= q */
  const void *k, *v;
  int32_t dtype;        /* 0: float32, 1: bfloat16 */
  int64_t k_head_stride, k_row_stride, v_head_stride, v_row_stride; /* in elements */
  int64_t n_keys, key_pos0;
  float *m, *l, *acc;   /* state: [heads * q_len], [heads * q_len], [heads * q_len][dim] */
  int64_t unit_rows;      /* rows of a kv head per unit of work: LANES, fewer to share few rows */
  int64_t units_per_head, n_units;
  atomic_llong next_unit;
} Job;

static inline void load_row(const void *base, int32_t dtype, int64_t at, int64_t dim,
                            float *out) {
  if (dtype == 1) {
    const uint16_t *src = (const uint16_t *)base + at;
    for (int64_t e = 0; e < dim; e++) out[e] = bf16_to_f32(src[e]);
  } else {
    memcpy(out, (const float *)base + at, (size_t)dim * sizeof(float));
  }
}

static inline int is_visible(int64_t key, int64_t query, int64_t window) {
  return key <= query && (window <= 0 || key > query - window);
}

/* The fixed tree over the PARTS partial sums: halves added until one is left. */
static inline float tree_sum(float *part) {
  for (int width = PARTS / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; i++) part[i] = part[i] + part[i + width];
  return part[0];
}

/* Rows of kv head `kv_head` from `first` (at most a unit's), state loaded and stored around. */
static void rows_span(const Job *job, int64_t kv_head, int64_t first, int64_t *row0,
                      int64_t *lanes) {
  const int64_t rows = (job->heads / job->kv_heads) * job->q_len;
  *row0 = kv_head * rows + first; /* a kv head's query rows are adjacent */
  *lanes = rows - first < job->unit_rows ? rows - first : job->unit_rows;
}

/* Many rows: LANES rows side by side, each lane one row's scalar arithmetic. */
static void fold_tile(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  float qt[dim][LANES], acc[dim][LANES], kr[dim], vr[dim];
  float m[LANES], l[LANES];
  int64_t pos[LANES];
  int64_t max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int t = 0; t < LANES; t++) {
    int live = t < lanes;
    int64_t row = row0 + t;
    pos[t] = live ? job->q_pos[(first + t) % q_len] : INT64_MIN / 2;
    m[t] = live ? job->m[row] : -INFINITY;
    l[t] = live ? job->l[row] : 0.0f;
    for (int64_t e = 0; e < dim; e++) {
      qt[e][t] = live ? job->q[row * dim + e] * job->scale : 0.0f;
      acc[e][t] = live ? job->acc[row * dim + e] : 0.0f;
    }
    if (live && pos[t] > max_pos) max_pos = pos[t];
    if (live && pos[t] < min_pos) min_pos = pos[t];
  }
  for (int64_t j = 0; j < job->n_keys; j++) {
    const int64_t kp = job->key_pos0 + j;
    if (kp > max_pos) break; /* keys come in position order: none later is visible */
    if (window > 0 && kp <= min_pos - window) continue; /* out of every lane's window */
    load_row(job->k, job->dtype, kv_head * job->k_head_stride + j * job->k_row_stride, dim, kr);
    load_row(job->v, job->dtype, kv_head * job->v_head_stride + j * job->v_row_stride, dim, vr);
    float part[PARTS][LANES], s[LANES], mx[LANES], p[LANES], alpha[LANES];
    int visible[LANES];
    for (int i = 0; i < PARTS; i++)
      for (int t = 0; t < LANES; t++) part[i][t] = 0.0f;
    for (int64_t c = 0; c < dim; c += PARTS) {
      const int64_t width = dim - c < PARTS ? dim - c : PARTS;
      for (int64_t i = 0; i < width; i++) {
        const float ke = kr[c + i];
        const float *qe = qt[c + i];
        float *sum = part[i];
        for (int t = 0; t < LANES; t++) sum[t] = fmaf(qe[t], ke, sum[t]); /* q * k */
      }
    }
    for (int width = PARTS / 2; width >= 1; width /= 2)
      for (int i = 0; i < width; i++)
        for (int t = 0; t < LANES; t++) part[i][t] = part[i][t] + part[i + width][t];
    int changed = 0;
    for (int t = 0; t < LANES; t++) {
      s[t] = part[0][t];
      visible[t] = is_visible(kp, pos[t], window);
      float x = visible[t] ? s[t] : -INFINITY;
      mx[t] = x > m[t] ? x : m[t];
      changed |= mx[t] != m[t];
    }
    for (int t = 0; t < LANES; t++) {
      float e = exp_nonpositive(visible[t] ? s[t] - mx[t] : 0.0f);
      p[t] = visible[t] ? e : 0.0f;
    }
    if (changed) {
      for (int t = 0; t < LANES; t++) {
        float e = exp_nonpositive(mx[t] == m[t] ? 0.0f : m[t] - mx[t]);
        alpha[t] = mx[t] == m[t] ? 1.0f : e;
        l[t] = l[t] * alpha[t];
      }
      for (int64_t e = 0; e < dim; e++)
        for (int t = 0; t < LANES; t++) acc[e][t] = acc[e][t] * alpha[t];
    }
    for (int t = 0; t < LANES; t++) {
      l[t] = l[t] + p[t];
      m[t] = mx[t];
    }
    for (int64_t e = 0; e < dim; e++) {
      const float ve = vr[e];
      for (int t = 0; t < LANES; t++) acc[e][t] = fmaf(p[t], ve, acc[e][t]);
    }
  }
  for (int64_t t = 0; t < lanes; t++) {
    int64_t row = row0 + t;
    job->m[row] = m[t];
    job->l[row] = l[t];
    for (int64_t e = 0; e < dim; e++) job->acc[row * dim + e] = acc[e][t];
  }
}

/* Few rows (a decode step): one row at a time, vectorised over dim, KEY_BLOCK keys
 * scored before their softmax updates run in order. The same arithmetic per (row, key) as
 * fold_tile: the same partial sums and tree, the same update. */
#define KEY_BLOCK 16
static void fold_rows(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  const int64_t padded = (dim + PARTS - 1) / PARTS * PARTS;
  float qs[lanes][padded], kt[padded][KEY_BLOCK], vr[KEY_BLOCK][dim], kr[padded];
  float *m = job->m + row0, *l = job->l + row0, *acc = job->acc + row0 * dim;
  int64_t pos[LANES], max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int64_t t = 0; t < lanes; t++) {
    pos[t] = job->q_pos[(first + t) % q_len];
    if (pos[t] > max_pos) max_pos = pos[t];
    if (pos[t] < min_pos) min_pos = pos[t];
    for (int64_t e = 0; e < padded; e++)
      qs[t][e] = e < dim ? job->q[(row0 + t) * dim + e] * job->scale : 0.0f;
  }
  for (int64_t e = 0; e < padded; e++)
    for (int b = 0; b < KEY_BLOCK; b++) kt[e][b] = 0.0f;
  int64_t j0 = 0;
  if (window > 0 && min_pos - window + 1 > job->key_pos0) j0 = min_pos - window + 1 - job->key_pos0;
  int64_t j_end = max_pos - job->key_pos0 + 1;
  if (j_end > job->n_keys) j_end = job->n_keys;
  for (int64_t jb = j0; jb < j_end; jb += KEY_BLOCK) {
    const int64_t count = j_end - jb < KEY_BLOCK ? j_end - jb : KEY_BLOCK;
    for (int64_t b = 0; b < count; b++) {
      const int64_t j = jb + b;
      load_row(job->k, job->dtype, kv_head * job->k_head_stride + j * job->k_row_stride, dim, kr);
      for (int64_t e = 0; e < dim; e++) kt[e][b] = kr[e]; /* keys side by side */
      load_row(job->v, job->dtype, kv_head * job->v_head_stride + j * job->v_row_stride, dim,
               vr[b]);
    }
    for (int64_t t = 0; t < lanes; t++) {
      float s[KEY_BLOCK], mx[KEY_BLOCK], p[KEY_BLOCK], alpha[KEY_BLOCK];
      float part[PARTS][KEY_BLOCK];
      int visible[KEY_BLOCK];
      const float *qrow = qs[t];
      for (int i = 0; i < PARTS; i++)
        for (int b = 0; b < KEY_BLOCK; b++) part[i][b] = 0.0f;
      for (int64_t c = 0; c < padded; c += PARTS)
        for (int i = 0; i < PARTS; i++) {
          const float qe = qrow[c + i];
          const float *ke = kt[c + i];
          float *sum = part[i];
          for (int b = 0; b < KEY_BLOCK; b++) sum[b] = fmaf(qe, ke[b], sum[b]);
        }
      for (int width = PARTS / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++)
          for (int b = 0; b < KEY_BLOCK; b++) part[i][b] = part[i][b] + part[i + width][b];
      for (int b = 0; b < KEY_BLOCK; b++) s[b] = part[0][b];
      float running = m[t];
      for (int64_t b = 0; b < KEY_BLOCK; b++) {
        visible[b] = b < count && is_visible(job->key_pos0 + jb + b, pos[t], window);
        const float before = running;
        if (visible[b] && s[b] > running) running = s[b];
        mx[b] = running;
        alpha[b] = before; /* the max before this key, turned into alpha below */
      }
      for (int64_t b = 0; b < KEY_BLOCK; b++) {
        float e = exp_nonpositive(visible[b] ? s[b] - mx[b] : 0.0f);
        p[b] = visible[b] ? e : 0.0f;
        float a = exp_nonpositive(mx[b] == alpha[b] ? 0.0f : alpha[b] - mx[b]);
        alpha[b] = mx[b] == alpha[b] ? 1.0f : a;
      }
      float *a = acc + t * dim;
      float sum = l[t];
      for (int64_t b = 0; b < count; b++) {
        if (!visible[b]) continue;
        if (alpha[b] != 1.0f) {
          sum = sum * alpha[b];
          for (int64_t e = 0; e < dim; e++) a[e] = a[e] * alpha[b];
        }
        sum = sum + p[b];
        const float pb = p[b], *v = vr[b];
        for (int64_t e = 0; e < dim; e++) a[e] = fmaf(pb, v[e], a[e]);
      }
      l[t] = sum;
      m[t] = running;
    }
  }
}

#if defined(__AVX512F__)
/* The same functions with AVX-512 registers: one lane per row (fold_tile) or per key
 * (fold_rows), each lane the portable code's operations (fused multiply-adds, adds,
 * products, max, the same exp), so the bits are the portable code's. */
static inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  /* max(-87, x) returns x when x is NaN, as the scalar clamp does: NaN in, NaN out */
  __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  __m512 t = _mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), magic);
  __m512 n = _mm512_sub_ps(t, magic);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), clamped);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(under, out, _mm512_setzero_ps());
}

/* Element i of four keys (k0..k3) times the rows' element i (a), into four running sums. */
static inline __attribute__((always_inline)) void fma_keys(__m512 *sums, __m512 a,
                                                           const float *k0, const float *k1,
                                                           const float *k2, const float *k3,
                                                           int i) {
  sums[0] = _mm512_fmadd_ps(a, _mm512_set1_ps(k0[i]), sums[0]);
  sums[1] = _mm512_fmadd_ps(a, _mm512_set1_ps(k1[i]), sums[1]);
  sums[2] = _mm512_fmadd_ps(a, _mm512_set1_ps(k2[i]), sums[2]);
  sums[3] = _mm512_fmadd_ps(a, _mm512_set1_ps(k3[i]), sums[3]);
}

/* Up to KEYS keys' dot products with the tile's LANES query rows (qt[e * LANES + t]: element
 * e of row t), each the portable code's: PARTS partial sums (element e to sum e % PARTS, in
 * order of e), then the fixed tree. The tree is walked depth first, a quarter of the sums at
 * a time ({0, 8, 4, 12} makes ((p0 + p8) + (p4 + p12)), the tree's b0; then b2, b1, b3; then
 * (b0 + b2) + (b1 + b3)): the same additions in the same order, with few sums live at once,
 * so that the keys share every load of the rows' elements. With fewer than KEYS keys the
 * last one stands in for the missing ones, whose sums are dropped. */
#define KEYS 4
static inline __attribute__((always_inline)) void dot16_keys(const float *qt,
                                                             const float *const *krow, int nk,
                                                             int64_t dim, __m512 *s) {
  static const int quarter[4][4] = {{0, 8, 4, 12}, {2, 10, 6, 14}, {1, 9, 5, 13}, {3, 11, 7, 15}};
  const float *k0 = krow[0], *k1 = krow[nk > 1 ? 1 : nk - 1];
  const float *k2 = krow[nk > 2 ? 2 : nk - 1], *k3 = krow[nk > 3 ? 3 : nk - 1];
  __m512 half[2][KEYS], first_b[KEYS];
  for (int h = 0; h < 2; h++) {
    for (int qd = 0; qd < 2; qd++) {
      const int *leaf = quarter[2 * h + qd];
      __m512 p[4][KEYS];
      for (int u = 0; u < 4; u++)
        for (int key = 0; key < KEYS; key++) p[u][key] = _mm512_setzero_ps();
      const float *q = qt, *a0 = k0, *a1 = k1, *a2 = k2, *a3 = k3;
      int64_t c = 0;
      for (; c + PARTS <= dim; c += PARTS) {
        for (int u = 0; u < 4; u++)
          fma_keys(p[u], _mm512_loadu_ps(q + leaf[u] * LANES), a0, a1, a2, a3, leaf[u]);
        q += PARTS * LANES;
        a0 += PARTS;
        a1 += PARTS;
        a2 += PARTS;
        a3 += PARTS;
      }
      /* A last, partial block: the sums of its missing elements take nothing. */
      if (__builtin_expect(c < dim, 0))
        for (int u = 0; u < 4; u++)
          if (leaf[u] < dim - c)
            fma_keys(p[u], _mm512_loadu_ps(q + leaf[u] * LANES), a0, a1, a2, a3, leaf[u]);
      for (int key = 0; key < KEYS; key++) {
        const __m512 b = _mm512_add_ps(_mm512_add_ps(p[0][key], p[1][key]),
                                       _mm512_add_ps(p[2][key], p[3][key]));
        if (qd == 0) first_b[key] = b;
        else half[h][key] = _mm512_add_ps(first_b[key], b);
      }
    }
  }
  for (int key = 0; key < nk; key++) s[key] = _mm512_add_ps(half[0][key], half[1][key]);
}

static void fold_tile_avx512(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  float qt[dim * LANES], acc[dim * LANES], buf[LANES];
  int64_t pos[LANES], max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int t = 0; t < LANES; t++) {
    int live = t < lanes;
    int64_t row = row0 + t;
    pos[t] = live ? job->q_pos[(first + t) % q_len] : INT64_MIN / 2;
    for (int64_t e = 0; e < dim; e++) {
      qt[e * LANES + t] = live ? job->q[row * dim + e] * job->scale : 0.0f;
      acc[e * LANES + t] = live ? job->acc[row * dim + e] : 0.0f;
    }
    if (live && pos[t] > max_pos) max_pos = pos[t];
    if (live && pos[t] < min_pos) min_pos = pos[t];
  }
  const __mmask16 live = (__mmask16)((1u << lanes) - 1);
  for (int t = 0; t < LANES; t++) buf[t] = t < lanes ? job->m[row0 + t] : -INFINITY;
  __m512 m = _mm512_loadu_ps(buf);
  for (int t = 0; t < LANES; t++) buf[t] = t < lanes ? job->l[row0 + t] : 0.0f;
  __m512 l = _mm512_loadu_ps(buf);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
  /* Keys in groups of GROUP: the group's scores are taken together (dot16_keys), then each
   * key's max, weights and rescale are worked out in order, then one pass over the
   * accumulators applies them key after key (rescale, then add): the order a key-at-a-time
   * loop would take, with a fraction of the loads and stores. */
  enum { GROUP = 2 * KEYS };
  float kbuf[GROUP][dim], vbuf[GROUP][dim];
  const float *krow[GROUP], *vrow[GROUP];
  int64_t kpos[GROUP];
  int64_t j = 0;
  int stop = 0;
  while (j < job->n_keys && !stop) {
    int count = 0;
    for (; count < GROUP && j < job->n_keys; j++) {
      const int64_t kp = job->key_pos0 + j;
      if (kp > max_pos) { /* keys come in position order: none later is visible */
        stop = 1;
        break;
      }
      if (window > 0 && kp <= min_pos - window) continue;
      const int64_t k_at = kv_head * job->k_head_stride + j * job->k_row_stride;
      const int64_t v_at = kv_head * job->v_head_stride + j * job->v_row_stride;
      if (job->dtype == 0) {
        krow[count] = (const float *)job->k + k_at;
        vrow[count] = (const float *)job->v + v_at;
      } else {
        load_row(job->k, job->dtype, k_at, dim, kbuf[count]);
        load_row(job->v, job->dtype, v_at, dim, vbuf[count]);
        krow[count] = kbuf[count];
        vrow[count] = vbuf[count];
      }
      kpos[count] = kp;
      count++;
    }
    __m512 sg[GROUP], pg[GROUP], ag[GROUP];
    __mmask16 cg[GROUP];
    for (int g = 0; g < count; g += KEYS)
      dot16_keys(qt, krow + g, count - g < KEYS ? count - g : KEYS, dim, sg + g);
    for (int g = 0; g < count; g++) {
      const __m512 s = sg[g];
      __mmask16 visible = 0;
      if (kpos[g] <= min_pos && (window <= 0 || kpos[g] > max_pos - window))
        visible = live;
      else
        for (int t = 0; t < LANES; t++)
          visible |= (__mmask16)(is_visible(kpos[g], pos[t], window) << t);
      __m512 mx = _mm512_max_ps(_mm512_mask_blend_ps(visible, minus_inf, s), m);
      __mmask16 changed = _mm512_cmp_ps_mask(mx, m, _CMP_NEQ_UQ);
      __m512 p = _mm512_maskz_mov_ps(
          visible, exp_nonpositive16(_mm512_maskz_sub_ps(visible, s, mx)));
      __m512 alpha = _mm512_set1_ps(1.0f);
      if (changed) {
        __m512 a = exp_nonpositive16(_mm512_maskz_sub_ps(changed, m, mx));
        alpha = _mm512_mask_blend_ps(changed, alpha, a);
        l = _mm512_mul_ps(l, alpha);
      }
      l = _mm512_add_ps(l, p);
      m = mx;
      pg[g] = p;
      ag[g] = alpha;
      cg[g] = changed;
    }
    __mmask16 rescaled = 0;
    for (int g = 0; g < count; g++) rescaled |= cg[g];
    if (count == GROUP && !rescaled) {
      for (int64_t e = 0; e < dim; e++) {
        __m512 a = _mm512_loadu_ps(acc + e * LANES);
        for (int g = 0; g < GROUP; g++)
          a = _mm512_fmadd_ps(pg[g], _mm512_set1_ps(vrow[g][e]), a);
        _mm512_storeu_ps(acc + e * LANES, a);
      }
      continue;
    }
    for (int64_t e = 0; e < dim; e++) {
      __m512 a = _mm512_loadu_ps(acc + e * LANES);
      for (int g = 0; g < count; g++) {
        if (cg[g]) a = _mm512_mul_ps(a, ag[g]);
        a = _mm512_fmadd_ps(pg[g], _mm512_set1_ps(vrow[g][e]), a);
      }
      _mm512_storeu_ps(acc + e * LANES, a);
    }
  }
  float ms[LANES], ls[LANES];
  _mm512_storeu_ps(ms, m);
  _mm512_storeu_ps(ls, l);
  (void)zero;
  for (int64_t t = 0; t < lanes; t++) {
    int64_t row = row0 + t;
    job->m[row] = ms[t];
    job->l[row] = ls[t];
    for (int64_t e = 0; e < dim; e++) job->acc[row * dim + e] = acc[e * LANES + t];
  }
}

/* One row's dot product with a key, vectorised over dim: the PARTS partial sums are the
 * lanes of one register, and the tree halves it (lane i gets lane i + width added). */
static inline float dot_lanes(const float *q, const float *k, int64_t dim) {
  __m512 part = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + PARTS <= dim; c += PARTS)
    part = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), part);
  if (c < dim) {
    __mmask16 tail = (__mmask16)((1u << (dim - c)) - 1);
    part = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + c),
                                 _mm512_maskz_loadu_ps(tail, k + c), part, tail);
  }
  part = _mm512_add_ps(part, _mm512_shuffle_f32x4(part, part, _MM_SHUFFLE(3, 2, 3, 2)));
  part = _mm512_add_ps(part, _mm512_shuffle_f32x4(part, part, _MM_SHUFFLE(0, 0, 0, 1)));
  part = _mm512_add_ps(part, _mm512_permute_ps(part, _MM_SHUFFLE(1, 0, 3, 2)));
  part = _mm512_add_ps(part, _mm512_permute_ps(part, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(part);
}

/* Heads up to this wide take fold_rows_avx512's small-head path: a block's scores together
 * (scores_of_block) and the accumulators in four registers. */
#define SMALL_HEAD (4 * 16)

/* A key block's scores for one row: key b's PARTS partial sums are the lanes of part[b]
 * (element e into lane e % PARTS, in order of e; elements past dim take nothing), then every
 * key's fixed tree (lane i gets lane i + width added, width 8, 4, 2, 1) runs on 16 keys at
 * once: each level packs the halves it adds from two registers side by side, so the keys
 * share its adds. Per (row, key) these are the portable code's operations; the scores come
 * back in key order. */
static inline __m512 scores_of_block(const float *q, const float *const *k, int64_t dim) {
  __m512 part[KEY_BLOCK];
  for (int b = 0; b < KEY_BLOCK; b++) part[b] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + PARTS <= dim; c += PARTS) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int b = 0; b < KEY_BLOCK; b++)
      part[b] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[b] + c), part[b]);
  }
  if (c < dim) {
    const __mmask16 tail = (__mmask16)((1u << (dim - c)) - 1);
    const __m512 qc = _mm512_maskz_loadu_ps(tail, q + c);
    for (int b = 0; b < KEY_BLOCK; b++)
      part[b] = _mm512_mask3_fmadd_ps(qc, _mm512_maskz_loadu_ps(tail, k[b] + c), part[b], tail);
  }
  /* width 8: keys b, b + 1 -> blocks [b: lanes 0-3, 4-7 | b + 1: lanes 0-3, 4-7] */
  __m512 w8[KEY_BLOCK / 2];
  for (int b = 0; b < KEY_BLOCK / 2; b++) {
    const __m512 x = part[2 * b], y = part[2 * b + 1];
    w8[b] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  /* width 4: block j of w4[b] is key 4b + j's lanes 0-3 */
  __m512 w4[KEY_BLOCK / 4];
  for (int b = 0; b < KEY_BLOCK / 4; b++) {
    const __m512 x = w8[2 * b], y = w8[2 * b + 1];
    w4[b] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  /* width 2: block j of w2[b] is [key 4b + j: lanes 0, 1 | key 4b + 8 + j: lanes 0, 1] */
  __m512 w2[2];
  for (int b = 0; b < 2; b++) {
    const __m512d x = _mm512_castps_pd(w4[b]), y = _mm512_castps_pd(w4[b + 2]);
    w2[b] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  /* width 1: block j holds keys j, j + 8, j + 4, j + 12; then into key order */
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i lane_of_key =
      _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(lane_of_key, sums);
}

/* One row's accumulators from element e0, `vectors` registers of them (a constant where
 * inlined, so they stay in registers), through a block's keys in order: each element's
 * rescales and fused multiply-adds are the portable code's, in its order, without a store
 * and reload between keys. Lanes past dim are masked off. */
static inline __attribute__((always_inline)) void accumulate_block(
    float *out, int64_t e0, int64_t dim, const float *const *vr, const float *p,
    const float *alpha, const int *visible, int64_t count, const int vectors) {
  __m512 a[16];
  __mmask16 live[16];
  for (int u = 0; u < vectors; u++) {
    const int64_t left = dim - e0 - 16 * u;
    live[u] = left >= 16 ? (__mmask16)0xFFFF
              : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
    a[u] = _mm512_maskz_loadu_ps(live[u], out + e0 + 16 * u);
  }
  for (int64_t b = 0; b < count; b++) {
    if (!visible[b]) continue;
    if (alpha[b] != 1.0f) {
      const __m512 va = _mm512_set1_ps(alpha[b]);
      for (int u = 0; u < vectors; u++) a[u] = _mm512_mul_ps(a[u], va);
    }
    const __m512 vp = _mm512_set1_ps(p[b]);
    const float *v = vr[b] + e0;
    for (int u = 0; u < vectors; u++)
      a[u] = _mm512_fmadd_ps(vp, _mm512_maskz_loadu_ps(live[u], v + 16 * u), a[u]);
  }
  for (int u = 0; u < vectors; u++) _mm512_mask_storeu_ps(out + e0 + 16 * u, live[u], a[u]);
}

static void fold_rows_avx512(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  const int small_head = dim <= SMALL_HEAD;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  float qs[lanes][dim], kbuf[KEY_BLOCK][dim], vbuf[KEY_BLOCK][dim];
  const float *kr[KEY_BLOCK], *vr[KEY_BLOCK];
  float *m = job->m + row0, *l = job->l + row0, *acc = job->acc + row0 * dim;
  int64_t pos[LANES], max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int64_t t = 0; t < lanes; t++) {
    pos[t] = job->q_pos[(first + t) % q_len];
    if (pos[t] > max_pos) max_pos = pos[t];
    if (pos[t] < min_pos) min_pos = pos[t];
    for (int64_t e = 0; e < dim; e++) qs[t][e] = job->q[(row0 + t) * dim + e] * job->scale;
  }
  int64_t j0 = 0;
  if (window > 0 && min_pos - window + 1 > job->key_pos0) j0 = min_pos - window + 1 - job->key_pos0;
  int64_t j_end = max_pos - job->key_pos0 + 1;
  if (j_end > job->n_keys) j_end = job->n_keys;
  for (int64_t jb = j0; jb < j_end; jb += KEY_BLOCK) {
    const int64_t count = j_end - jb < KEY_BLOCK ? j_end - jb : KEY_BLOCK;
    for (int64_t b = 0; b < count; b++) {
      const int64_t j = jb + b;
      const int64_t k_at = kv_head * job->k_head_stride + j * job->k_row_stride;
      const int64_t v_at = kv_head * job->v_head_stride + j * job->v_row_stride;
      if (job->dtype == 0) {
        kr[b] = (const float *)job->k + k_at;
        vr[b] = (const float *)job->v + v_at;
      } else {
        load_row(job->k, job->dtype, k_at, dim, kbuf[b]);
        load_row(job->v, job->dtype, v_at, dim, vbuf[b]);
        kr[b] = kbuf[b];
        vr[b] = vbuf[b];
      }
    }
    for (int64_t b = count; b < KEY_BLOCK; b++) kr[b] = kr[0]; /* scored, never seen */
    for (int64_t t = 0; t < lanes; t++) {
      float s[KEY_BLOCK], mx[KEY_BLOCK], before[KEY_BLOCK], p[KEY_BLOCK], alpha[KEY_BLOCK];
      int visible[KEY_BLOCK];
      float running = m[t];
      /* Small heads: the block's scores together, which shares the trees' adds. Larger
       * ones key by key: on K/V beyond the caches, 16 rows read side by side come slower
       * than one after another (measured on Gemma 3's 256-wide heads). */
      if (small_head) _mm512_storeu_ps(s, scores_of_block(qs[t], kr, dim));
      for (int64_t b = 0; b < KEY_BLOCK; b++) {
        visible[b] = b < count && is_visible(job->key_pos0 + jb + b, pos[t], window);
        if (!visible[b]) s[b] = 0.0f;
        else if (!small_head) s[b] = dot_lanes(qs[t], kr[b], dim);
        before[b] = running;
        if (visible[b] && s[b] > running) running = s[b];
        mx[b] = running;
      }
      __m512 vs = _mm512_loadu_ps(s), vmx = _mm512_loadu_ps(mx), vb = _mm512_loadu_ps(before);
      __mmask16 vis = 0;
      for (int b = 0; b < KEY_BLOCK; b++) vis |= (__mmask16)(visible[b] << b);
      __mmask16 changed = _mm512_cmp_ps_mask(vmx, vb, _CMP_NEQ_UQ);
      _mm512_storeu_ps(p, _mm512_maskz_mov_ps(vis, exp_nonpositive16(_mm512_maskz_sub_ps(vis, vs, vmx))));
      __m512 a = exp_nonpositive16(_mm512_maskz_sub_ps(changed, vb, vmx));
      _mm512_storeu_ps(alpha, _mm512_mask_blend_ps(changed, _mm512_set1_ps(1.0f), a));
      float sum = l[t];
      for (int64_t b = 0; b < count; b++) {
        if (!visible[b]) continue;
        if (alpha[b] != 1.0f) sum = sum * alpha[b];
        sum = sum + p[b];
      }
      /* Small heads in four registers, larger ones sixteen at a time: each V row is read
       * in as few passes as the registers allow. */
      float *out = acc + t * dim;
      if (small_head) {
        accumulate_block(out, 0, dim, vr, p, alpha, visible, count, 4);
      } else {
        for (int64_t e0 = 0; e0 < dim; e0 += 16 * 16)
          accumulate_block(out, e0, dim, vr, p, alpha, visible, count, 16);
      }
      l[t] = sum;
      m[t] = running;
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The many-rows layout with AVX2 registers, for CPUs without AVX-512: a tile's LANES rows
 * are two registers of 8, each lane the portable code's operations (fused multiply-adds,
 * adds, products, max, the same exp, the same partial sums and tree), so the bits are the
 * portable code's; only the speed changes. */
typedef struct {
  __m256 lo, hi;
} Lanes16;

static inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  /* max(-87, x) returns x when x is NaN, as the scalar clamp does: NaN in, NaN out */
  __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  __m256 t = _mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504088896341f), magic);
  __m256 n = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), clamped);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), under);
}

static void fold_tile_avx2(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  float qt[dim * LANES], acc[dim * LANES], buf[LANES];
  int64_t pos[LANES], max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int t = 0; t < LANES; t++) {
    int live = t < lanes;
    int64_t row = row0 + t;
    pos[t] = live ? job->q_pos[(first + t) % q_len] : INT64_MIN / 2;
    for (int64_t e = 0; e < dim; e++) {
      qt[e * LANES + t] = live ? job->q[row * dim + e] * job->scale : 0.0f;
      acc[e * LANES + t] = live ? job->acc[row * dim + e] : 0.0f;
    }
    if (live && pos[t] > max_pos) max_pos = pos[t];
    if (live && pos[t] < min_pos) min_pos = pos[t];
  }
  for (int t = 0; t < LANES; t++) buf[t] = t < lanes ? job->m[row0 + t] : -INFINITY;
  Lanes16 m = {_mm256_loadu_ps(buf), _mm256_loadu_ps(buf + 8)};
  for (int t = 0; t < LANES; t++) buf[t] = t < lanes ? job->l[row0 + t] : 0.0f;
  Lanes16 l = {_mm256_loadu_ps(buf), _mm256_loadu_ps(buf + 8)};
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f);
  int32_t vis_bits[LANES];
  /* Keys in groups of GROUP: each key's max, weights and rescale are worked out in order,
   * then one pass over the accumulators applies them key after key (rescale, then add),
   * the order a key-at-a-time loop takes, with a quarter of the loads and stores. */
  enum { GROUP = 4 };
  float kbuf[dim], vbuf[GROUP][dim];
  const float *vrow[GROUP];
  int64_t j = 0;
  int stop = 0;
  while (j < job->n_keys && !stop) {
    Lanes16 pg[GROUP], ag[GROUP];
    int cg[GROUP];
    int count = 0;
    for (; count < GROUP && j < job->n_keys; j++) {
      const int64_t kp = job->key_pos0 + j;
      if (kp > max_pos) { /* keys come in position order: none later is visible */
        stop = 1;
        break;
      }
      if (window > 0 && kp <= min_pos - window) continue;
      const int64_t k_at = kv_head * job->k_head_stride + j * job->k_row_stride;
      const int64_t v_at = kv_head * job->v_head_stride + j * job->v_row_stride;
      const float *kr;
      if (job->dtype == 0) {
        kr = (const float *)job->k + k_at;
        vrow[count] = (const float *)job->v + v_at;
      } else {
        load_row(job->k, job->dtype, k_at, dim, kbuf);
        load_row(job->v, job->dtype, v_at, dim, vbuf[count]);
        kr = kbuf;
        vrow[count] = vbuf[count];
      }
      /* s = (q * scale) . k: PARTS partial sums (element e to sum e % PARTS), then the tree.
       * Four sums at a time run over every element block (each sum's additions in the same
       * order), so their registers stay live without spilling the other twelve. */
      Lanes16 part[PARTS];
      for (int i0 = 0; i0 < PARTS; i0 += 4) {
        Lanes16 run[4];
        for (int u = 0; u < 4; u++) run[u].lo = run[u].hi = _mm256_setzero_ps();
        for (int64_t c = 0; c < dim; c += PARTS) {
          const int64_t width = dim - c < PARTS ? dim - c : PARTS;
          for (int u = 0; u < 4; u++) {
            const int64_t i = i0 + u;
            if (i >= width) break;
            const __m256 ke = _mm256_set1_ps(kr[c + i]);
            const float *qe = qt + (c + i) * LANES;
            run[u].lo = _mm256_fmadd_ps(_mm256_loadu_ps(qe), ke, run[u].lo);
            run[u].hi = _mm256_fmadd_ps(_mm256_loadu_ps(qe + 8), ke, run[u].hi);
          }
        }
        for (int u = 0; u < 4; u++) part[i0 + u] = run[u];
      }
      for (int width = PARTS / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) {
          part[i].lo = _mm256_add_ps(part[i].lo, part[i + width].lo);
          part[i].hi = _mm256_add_ps(part[i].hi, part[i + width].hi);
        }
      for (int t = 0; t < LANES; t++) vis_bits[t] = is_visible(kp, pos[t], window) ? -1 : 0;
      const __m256 vis_lo = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)vis_bits));
      const __m256 vis_hi =
          _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(vis_bits + 8)));
      Lanes16 s = part[0], mx, p, alpha;
      mx.lo = _mm256_max_ps(_mm256_blendv_ps(minus_inf, s.lo, vis_lo), m.lo);
      mx.hi = _mm256_max_ps(_mm256_blendv_ps(minus_inf, s.hi, vis_hi), m.hi);
      const __m256 ch_lo = _mm256_cmp_ps(mx.lo, m.lo, _CMP_NEQ_UQ);
      const __m256 ch_hi = _mm256_cmp_ps(mx.hi, m.hi, _CMP_NEQ_UQ);
      const int changed = _mm256_movemask_ps(ch_lo) | _mm256_movemask_ps(ch_hi);
      p.lo = _mm256_and_ps(vis_lo, exp_nonpositive8(_mm256_and_ps(vis_lo, _mm256_sub_ps(s.lo, mx.lo))));
      p.hi = _mm256_and_ps(vis_hi, exp_nonpositive8(_mm256_and_ps(vis_hi, _mm256_sub_ps(s.hi, mx.hi))));
      alpha.lo = alpha.hi = one;
      if (changed) {
        alpha.lo = _mm256_blendv_ps(
            one, exp_nonpositive8(_mm256_and_ps(ch_lo, _mm256_sub_ps(m.lo, mx.lo))), ch_lo);
        alpha.hi = _mm256_blendv_ps(
            one, exp_nonpositive8(_mm256_and_ps(ch_hi, _mm256_sub_ps(m.hi, mx.hi))), ch_hi);
        l.lo = _mm256_mul_ps(l.lo, alpha.lo);
        l.hi = _mm256_mul_ps(l.hi, alpha.hi);
      }
      l.lo = _mm256_add_ps(l.lo, p.lo);
      l.hi = _mm256_add_ps(l.hi, p.hi);
      m = mx;
      pg[count] = p;
      ag[count] = alpha;
      cg[count] = changed;
      count++;
    }
    int rescaled = 0;
    for (int g = 0; g < count; g++) rescaled |= cg[g];
    if (count == GROUP && !rescaled) { /* the usual group once the max settles: adds only */
      for (int64_t e = 0; e < dim; e++) {
        float *a = acc + e * LANES;
        __m256 lo = _mm256_loadu_ps(a), hi = _mm256_loadu_ps(a + 8);
        for (int g = 0; g < GROUP; g++) {
          const __m256 ve = _mm256_set1_ps(vrow[g][e]);
          lo = _mm256_fmadd_ps(pg[g].lo, ve, lo);
          hi = _mm256_fmadd_ps(pg[g].hi, ve, hi);
        }
        _mm256_storeu_ps(a, lo);
        _mm256_storeu_ps(a + 8, hi);
      }
      continue;
    }
    for (int64_t e = 0; e < dim; e++) {
      float *a = acc + e * LANES;
      __m256 lo = _mm256_loadu_ps(a), hi = _mm256_loadu_ps(a + 8);
      for (int g = 0; g < count; g++) {
        if (cg[g]) {
          lo = _mm256_mul_ps(lo, ag[g].lo);
          hi = _mm256_mul_ps(hi, ag[g].hi);
        }
        const __m256 ve = _mm256_set1_ps(vrow[g][e]);
        lo = _mm256_fmadd_ps(pg[g].lo, ve, lo);
        hi = _mm256_fmadd_ps(pg[g].hi, ve, hi);
      }
      _mm256_storeu_ps(a, lo);
      _mm256_storeu_ps(a + 8, hi);
    }
  }
  float ms[LANES], ls[LANES];
  _mm256_storeu_ps(ms, m.lo);
  _mm256_storeu_ps(ms + 8, m.hi);
  _mm256_storeu_ps(ls, l.lo);
  _mm256_storeu_ps(ls + 8, l.hi);
  for (int64_t t = 0; t < lanes; t++) {
    int64_t row = row0 + t;
    job->m[row] = ms[t];
    job->l[row] = ls[t];
    for (int64_t e = 0; e < dim; e++) job->acc[row * dim + e] = acc[e * LANES + t];
  }
}

/* A load mask for 8 floats of which `left` remain: lane i is live when i < left. */
static inline __m256i live_lanes8(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t n = left < 0 ? 0 : left > 8 ? 8 : (int32_t)left;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), index);
}

/* Four keys' partial sums after the tree's first level (width 8): key b's PARTS sums are the
 * lanes of two registers (element e into part e % PARTS, in order of e; a short tail loads
 * zeros, as the portable code pads), and lane i of part 8-15 is added to lane i of 0-7. */
static inline void halves_of_four(const float *q, const float *const *k, int64_t dim,
                                  __m256 *w8) {
  __m256 lo[4], hi[4];
  for (int b = 0; b < 4; b++) lo[b] = hi[b] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + PARTS <= dim; c += PARTS) {
    const __m256 qlo = _mm256_loadu_ps(q + c), qhi = _mm256_loadu_ps(q + c + 8);
    for (int b = 0; b < 4; b++) {
      lo[b] = _mm256_fmadd_ps(qlo, _mm256_loadu_ps(k[b] + c), lo[b]);
      hi[b] = _mm256_fmadd_ps(qhi, _mm256_loadu_ps(k[b] + c + 8), hi[b]);
    }
  }
  if (c < dim) {
    const __m256i mlo = live_lanes8(dim - c), mhi = live_lanes8(dim - c - 8);
    const __m256 qlo = _mm256_maskload_ps(q + c, mlo), qhi = _mm256_maskload_ps(q + c + 8, mhi);
    for (int b = 0; b < 4; b++) {
      lo[b] = _mm256_fmadd_ps(qlo, _mm256_maskload_ps(k[b] + c, mlo), lo[b]);
      hi[b] = _mm256_fmadd_ps(qhi, _mm256_maskload_ps(k[b] + c + 8, mhi), hi[b]);
    }
  }
  for (int b = 0; b < 4; b++) w8[b] = _mm256_add_ps(lo[b], hi[b]);
}

/* Eight keys' scores for one row: after the first level, the rest of every key's tree (lane
 * i gets lane i + width added, width 4, 2, 1) runs on eight keys at once, each level packing
 * the halves it adds from two registers side by side. Per (row, key) these are the portable
 * code's operations; the scores come back in key order. */
static inline __m256 scores_of_eight(const float *q, const float *const *k, int64_t dim) {
  __m256 w8[8];
  halves_of_four(q, k, dim, w8);
  halves_of_four(q, k + 4, dim, w8 + 4);
  /* width 4: w4[b] = [key 2b: lanes 0-3 | key 2b + 1: lanes 0-3] */
  __m256 w4[4];
  for (int b = 0; b < 4; b++) {
    const __m256 x = w8[2 * b], y = w8[2 * b + 1];
    w4[b] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  /* width 2: w2[b] = [key 4b: 0, 1, key 4b + 2: 0, 1 | key 4b + 1: 0, 1, key 4b + 3: 0, 1] */
  __m256 w2[2];
  for (int b = 0; b < 2; b++) {
    const __m256 x = w4[2 * b], y = w4[2 * b + 1];
    w2[b] = _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  /* width 1: [keys 0, 2, 4, 6 | keys 1, 3, 5, 7], then into key order */
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A running max over 8 keys in order, as the portable code takes it (a later score replaces
 * the max only when greater; invisible lanes, and NaN scores, which never compare greater,
 * hold -inf): a prefix scan that combines an earlier run with a later one as max(later,
 * earlier), which keeps the earlier on ties. `before` gets each key's max before it (lane 0:
 * `start`). */
static inline __m256 running_max8(__m256 x, __m256 start, __m256 *before) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 shifted = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6));
  x = _mm256_max_ps(x, _mm256_blend_ps(shifted, minus_inf, 0x01));
  shifted = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 0, 0, 1, 2, 3, 4, 5));
  x = _mm256_max_ps(x, _mm256_blend_ps(shifted, minus_inf, 0x03));
  shifted = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3));
  x = _mm256_max_ps(x, _mm256_blend_ps(shifted, minus_inf, 0x0F));
  const __m256 mx = _mm256_max_ps(x, start);
  *before = _mm256_blend_ps(
      _mm256_permutevar8x32_ps(mx, _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6)), start, 0x01);
  return mx;
}

/* One row through keys [from, to] of a block, all visible, in order: each element's
 * accumulator, and the sum when `sum` is given (the first pass over a row's elements; a
 * constant pointer where inlined, so the test folds away), gets the portable code's rescale
 * (when alpha is not 1) and then the key's weight, in its order. The accumulators from
 * element e0 sit in `vectors` registers of 8 (a constant where inlined), without a store and
 * reload between keys; lanes past dim load and store nothing. */
static inline __attribute__((always_inline)) void accumulate_block8(
    float *out, int64_t e0, int64_t dim, const float *const *vr, const float *p,
    const float *alpha, int64_t from, int64_t to, float *sum, const int vectors) {
  __m256 a[8];
  __m256i live[8];
  const int whole = dim - e0 >= 8 * vectors;
  for (int u = 0; u < vectors; u++) {
    live[u] = live_lanes8(dim - e0 - 8 * u);
    a[u] = whole ? _mm256_loadu_ps(out + e0 + 8 * u) : _mm256_maskload_ps(out + e0 + 8 * u, live[u]);
  }
  for (int64_t b = from; b <= to; b++) {
    if (alpha[b] != 1.0f) {
      if (sum) *sum = *sum * alpha[b];
      const __m256 va = _mm256_set1_ps(alpha[b]);
      for (int u = 0; u < vectors; u++) a[u] = _mm256_mul_ps(a[u], va);
    }
    if (sum) *sum = *sum + p[b];
    const __m256 vp = _mm256_set1_ps(p[b]);
    const float *v = vr[b] + e0;
    if (whole)
      for (int u = 0; u < vectors; u++)
        a[u] = _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + 8 * u), a[u]);
    else
      for (int u = 0; u < vectors; u++)
        a[u] = _mm256_fmadd_ps(vp, _mm256_maskload_ps(v + 8 * u, live[u]), a[u]);
  }
  for (int u = 0; u < vectors; u++) {
    if (whole) _mm256_storeu_ps(out + e0 + 8 * u, a[u]);
    else _mm256_maskstore_ps(out + e0 + 8 * u, live[u], a[u]);
  }
}

/* The few-rows layout (a decode step) with AVX2 registers: per row and block of keys, the
 * visible keys (a run: causal and sliding masks both cut a run of positions), their scores
 * together (scores_of_eight), the running max as a scan and the exp over the block, then
 * the accumulators in registers, 64 elements a pass; per (row, key) the portable fold_rows'
 * operations in its order, so the same bits. */
static void fold_rows_avx2(const Job *job, int64_t kv_head, int64_t first) {
  const int64_t dim = job->dim, q_len = job->q_len, window = job->window;
  int64_t row0, lanes;
  rows_span(job, kv_head, first, &row0, &lanes);
  float qs[lanes][dim], kbuf[KEY_BLOCK][dim], vbuf[KEY_BLOCK][dim];
  const float *kr[KEY_BLOCK], *vr[KEY_BLOCK];
  float *m = job->m + row0, *l = job->l + row0, *acc = job->acc + row0 * dim;
  int64_t pos[LANES], max_pos = INT64_MIN, min_pos = INT64_MAX;
  for (int64_t t = 0; t < lanes; t++) {
    pos[t] = job->q_pos[(first + t) % q_len];
    if (pos[t] > max_pos) max_pos = pos[t];
    if (pos[t] < min_pos) min_pos = pos[t];
    for (int64_t e = 0; e < dim; e++) qs[t][e] = job->q[(row0 + t) * dim + e] * job->scale;
  }
  int64_t j0 = 0;
  if (window > 0 && min_pos - window + 1 > job->key_pos0) j0 = min_pos - window + 1 - job->key_pos0;
  int64_t j_end = max_pos - job->key_pos0 + 1;
  if (j_end > job->n_keys) j_end = job->n_keys;
  const __m256 one = _mm256_set1_ps(1.0f), minus_inf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t jb = j0; jb < j_end; jb += KEY_BLOCK) {
    const int64_t count = j_end - jb < KEY_BLOCK ? j_end - jb : KEY_BLOCK;
    for (int64_t b = 0; b < count; b++) {
      const int64_t j = jb + b;
      const int64_t k_at = kv_head * job->k_head_stride + j * job->k_row_stride;
      const int64_t v_at = kv_head * job->v_head_stride + j * job->v_row_stride;
      if (job->dtype == 0) {
        kr[b] = (const float *)job->k + k_at;
        vr[b] = (const float *)job->v + v_at;
      } else {
        load_row(job->k, job->dtype, k_at, dim, kbuf[b]);
        load_row(job->v, job->dtype, v_at, dim, vbuf[b]);
        kr[b] = kbuf[b];
        vr[b] = vbuf[b];
      }
    }
    for (int64_t b = count; b < KEY_BLOCK; b++) kr[b] = kr[0]; /* scored, never seen */
    const int64_t block_pos = job->key_pos0 + jb;
    for (int64_t t = 0; t < lanes; t++) {
      /* the visible keys of this block for row t: b in [from, to] */
      int64_t from = window > 0 ? pos[t] - window + 1 - block_pos : 0;
      int64_t to = pos[t] - block_pos;
      if (from < 0) from = 0;
      if (to > count - 1) to = count - 1;
      if (from > to) continue;
      float p[KEY_BLOCK], alpha[KEY_BLOCK];
      __m256 running = _mm256_set1_ps(m[t]);
      for (int half = 0; half < KEY_BLOCK && half <= to; half += 8) {
        const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(half));
        const __m256 vis = _mm256_castsi256_ps(_mm256_andnot_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)from), index),
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)to + 1), index)));
        const __m256 vs = scores_of_eight(qs[t], kr + half, dim);
        __m256 before;
        const __m256 ordered = _mm256_and_ps(vis, _mm256_cmp_ps(vs, vs, _CMP_ORD_Q));
        const __m256 vmx = running_max8(_mm256_blendv_ps(minus_inf, vs, ordered), running, &before);
        const __m256 ch = _mm256_cmp_ps(vmx, before, _CMP_NEQ_UQ);
        _mm256_storeu_ps(p + half, _mm256_and_ps(vis, exp_nonpositive8(_mm256_and_ps(vis, _mm256_sub_ps(vs, vmx)))));
        __m256 a = one; /* the max mostly holds: no exp to take */
        if (_mm256_movemask_ps(ch))
          a = _mm256_blendv_ps(one, exp_nonpositive8(_mm256_and_ps(ch, _mm256_sub_ps(before, vmx))), ch);
        _mm256_storeu_ps(alpha + half, a);
        running = _mm256_permutevar8x32_ps(vmx, _mm256_set1_epi32(7));
      }
      float *out = acc + t * dim;
      float sum = l[t];
      accumulate_block8(out, 0, dim, vr, p, alpha, from, to, &sum, 8);
      for (int64_t e0 = 64; e0 < dim; e0 += 64)
        accumulate_block8(out, e0, dim, vr, p, alpha, from, to, NULL, 8);
      l[t] = sum;
      m[t] = _mm256_cvtss_f32(running);
    }
  }
}
#endif

static void fold_unit(Job *job, int64_t unit) {
  const int64_t kv_head = unit / job->units_per_head;
  const int64_t first = (unit % job->units_per_head) * job->unit_rows;
  const int64_t rows = (job->heads / job->kv_heads) * job->q_len;
#if defined(__AVX512F__)
  if (rows - first < FEW_ROWS)
    fold_rows_avx512(job, kv_head, first);
  else
    fold_tile_avx512(job, kv_head, first);
#elif defined(__AVX2__) && defined(__FMA__)
  if (rows - first < FEW_ROWS)
    fold_rows_avx2(job, kv_head, first);
  else
    fold_tile_avx2(job, kv_head, first);
#else
  if (rows - first < FEW_ROWS)
    fold_rows(job, kv_head, first);
  else
    fold_tile(job, kv_head, first);
#endif
}

/* One thread's share: units taken in turn until none is left. */
static void fold_units(void *context, int index) {
  Job *job = (Job *)context;
  (void)index;
  for (;;) {
    const int64_t unit = atomic_fetch_add_explicit(&job->next_unit, 1, memory_order_relaxed);
    if (unit >= job->n_units) return;
    fold_unit(job, unit);
  }
}

/* Fold keys [0, n_keys) (at positions key_pos0 + j) into every query row's state. */
void kvchat_attention_fold(const float *q, int64_t heads, int64_t q_len, int64_t dim,
                           int64_t kv_heads, const int64_t *q_pos, float scale, int64_t window,
                           const void *k, const void *v, int32_t dtype, int64_t k_head_stride,
                           int64_t k_row_stride, int64_t v_head_stride, int64_t v_row_stride,
                           int64_t n_keys, int64_t key_pos0, float *m, float *l, float *acc,
                           int32_t threads) {
  Job job = {q, heads, q_len, dim, kv_heads, q_pos, scale, window, k, v, dtype,
             k_head_stride, k_row_stride, v_head_stride, v_row_stride, n_keys, key_pos0,
             m, l, acc, LANES, 0, 0, 0};
  const int64_t rows = (heads / kv_heads) * q_len;
  /* Handing work to the pool's waiting workers costs a few microseconds: worth it from a
     fifth of a million multiply-adds (a decode step's few hundred keys). */
  const double work = (double)heads * q_len * (double)n_keys * (double)dim;
  int64_t n_threads = threads;
  if (work < 2.0e5) n_threads = 1;
  if (n_threads > POOL_MAX_THREADS) n_threads = POOL_MAX_THREADS;
  if (n_threads < 1) n_threads = 1;
  /* A decode step has a few rows per kv head, one unit each: with fewer kv heads than
     threads, each head's rows are shared out instead (the threads then read the same keys,
     each row still folded whole by one thread). */
  if (rows < FEW_ROWS && kv_heads < n_threads) {
    const int64_t shares = (n_threads + kv_heads - 1) / kv_heads;
    job.unit_rows = (rows + shares - 1) / shares;
  }
  job.units_per_head = (rows + job.unit_rows - 1) / job.unit_rows;
  job.n_units = job.units_per_head * kv_heads;
  if (n_threads > job.n_units) n_threads = job.n_units;
  if (n_threads <= 1) {
    for (int64_t unit = 0; unit < job.n_units; unit++) fold_unit(&job, unit);
    return;
  }
  pool_run(fold_units, &job, (int)n_threads);
}


/* A fresh state: max -inf, sum and weighted values 0. */
void kvchat_attention_init(float *m, float *l, float *acc, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; r++) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  memset(acc, 0, (size_t)(rows * dim) * sizeof(float));
}

/* The output acc / sum, laid out [q_len][heads][dim] (transformers' attention output). */
void kvchat_attention_finish(const float *l, const float *acc, int64_t heads, int64_t q_len,
                             int64_t dim, float *out) {
  for (int64_t h = 0; h < heads; h++)
    for (int64_t i = 0; i < q_len; i++) {
      const int64_t row = h * q_len + i;
      const float sum = l[row];
      float *dst = out + (i * heads + h) * dim;
      for (int64_t e = 0; e < dim; e++) dst[e] = acc[row * dim + e] / sum;
    }
}

/* One call over every key it sees (a decode step, a prefill chunk): kvchat_attention_init,
   kvchat_attention_fold from key position 0 and kvchat_attention_finish, with the state in
   scratch of its own, so the caller makes one call instead of three. Query i sits at
   position q_pos0 + i. Returns 0, or -1 when the scratch cannot be had (out untouched). */
int32_t kvchat_attention(const float *q, int64_t heads, int64_t q_len, int64_t dim,
                         int64_t kv_heads, int64_t q_pos0, float scale, int64_t window,
                         const void *k, const void *v, int32_t dtype, int64_t k_head_stride,
                         int64_t k_row_stride, int64_t v_head_stride, int64_t v_row_stride,
                         int64_t n_keys, float *out, int32_t threads) {
  const int64_t rows = heads * q_len;
  float *state = malloc((size_t)rows * (size_t)(dim + 2) * sizeof(float));
  int64_t *positions = malloc((size_t)q_len * sizeof(int64_t));
  if (state == NULL || positions == NULL) {
    free(state);
    free(positions);
    return -1;
  }
  float *m = state, *l = state + rows, *acc = state + 2 * rows;
  for (int64_t i = 0; i < q_len; i++) positions[i] = q_pos0 + i;
  kvchat_attention_init(m, l, acc, rows, dim);
  kvchat_attention_fold(q, heads, q_len, dim, kv_heads, positions, scale, window, k, v, dtype,
                        k_head_stride, k_row_stride, v_head_stride, v_row_stride, n_keys, 0, m,
                        l, acc, threads);
  kvchat_attention_finish(l, acc, heads, q_len, dim, out);
  free(state);
  free(positions);
  return 0;
}
