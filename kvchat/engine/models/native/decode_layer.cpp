// One decoder layer's decode step (one token) for kvchat's quantized CPU models, in two
// halves around the cache's update: the arithmetic kvchat/engine/models/decode_step.py spells
// in Python, rounded the same way (so the same bits; the Python side checks that on this
// machine before it uses this library). What it saves is Python and the dispatcher: at one
// row per call a layer is ~50 short ATen ops from Python, and ~8 from here.
//
// Which ops stay ATen's and why: the sums inside every RMSNorm (at::sum, whose order of
// additions is ATen's own and depends on the CPU's vector width), SiLU and tanh-GELU (ATen's
// vectorized exp and tanh round differently from libm's), and torch's int4/int8 kernels. The
// rest (squares, the mean's division, rsqrt, the norm's products, the rotary products, the
// residual adds, the gate times up) is one IEEE operation per element, so a plain loop rounds
// each element exactly as ATen's vectorized loop does; built with -ffp-contract=off so no
// product and sum fuse into one rounding.
//
// A projection is (weight, scales, group): group > 0 is torch's int4 CPU kernel with that
// group size, group == 0 its int8 kernel, with activations cast to bfloat16 around them as
// kvchat/engine/models/qlinear.py does; group == -1 is kvchat's int4 kernel
// (kvchat/engine/models/int4_kernel.c, float32 activations), called through the address of
// the function the Python side loaded, so both sides run the same compiled code, on the
// thread count the Python side passes (its bits do not depend on it).
//
// The attended_ ops put a decode step's attention in front of the second half: kvchat's
// exact attention kernel (kvchat/engine/kvdirect/exact_attention.c), called through the
// address the Python side loaded, with the operands exact_attention.exact_attention hands
// it, so the same bits as that function followed by the half alone; what it saves is the
// Python around a ctypes call, once per layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

namespace {

using at::Tensor;

// The float32 values of a contiguous tensor, for the loops below (which index them flat).
float* floats(const Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "decode_layer: a loop's operand must be contiguous");
  return t.data_ptr<float>();
}

// A decode step's operands: one row (one token) and, for the rotary products, one row of
// head_dim angles.
void check_step(const Tensor& hidden, const Tensor& cos, const Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(hidden.numel() == hidden.size(-1), "decode_layer: one token per call");
  TORCH_CHECK(cos.numel() == head_dim && sin.numel() == head_dim,
              "decode_layer: one position's rotary angles per call");
}

Tensor fresh_like(const Tensor& t) { return at::empty(t.sizes(), t.options()); }

// Each row's mean of squares over its last `width` values, as x.pow(2).mean(-1) rounds it:
// the squares one by one, their sum by at::sum, the division by the count.
Tensor mean_squares(const float* x, int64_t rows, int64_t width, const at::TensorOptions& opts) {
  auto squares = at::empty({rows, width}, opts);
  float* s = floats(squares);
  for (int64_t i = 0; i < rows * width; ++i) s[i] = x[i] * x[i];
  auto sums = at::sum(squares, {-1});
  float* m = floats(sums);
  const float count = static_cast<float>(width);
  for (int64_t r = 0; r < rows; ++r) m[r] = m[r] / count;
  return sums;
}

// 1 / sqrt(mean + eps) per row: rsqrt(variance + eps) with eps rounded to float first, as a
// Python float added to a float32 tensor is.
Tensor inverse_rms(const float* x, int64_t rows, int64_t width, double eps,
                   const at::TensorOptions& opts) {
  auto factors = mean_squares(x, rows, width, opts);
  float* f = floats(factors);
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) f[r] = 1.0f / std::sqrt(f[r] + e);
  return factors;
}

// An RMSNorm over the last dim of `rows` contiguous rows at `x`, into `out`, on float32
// input: LlamaRMSNorm.forward's weight * (hidden * rsqrt(variance + eps)), or with
// `one_plus` Gemma3RMSNorm.forward's (hidden * rsqrt(variance + eps)) * (1 + weight). The
// two products are one IEEE multiplication each way round, so one loop serves both.
void norm_into(const float* x, int64_t rows, int64_t width, const Tensor& weight, double eps,
               bool one_plus, float* out, const at::TensorOptions& opts) {
  auto factors = inverse_rms(x, rows, width, eps, opts);
  const float *w = floats(weight), *f = floats(factors);
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = x + r * width;
    float* to = out + r * width;
    if (one_plus)  // apart, so each loop stays a plain one the compiler can vectorize
      for (int64_t i = 0; i < width; ++i) to[i] = (row[i] * f[r]) * (1.0f + w[i]);
    else
      for (int64_t i = 0; i < width; ++i) to[i] = (row[i] * f[r]) * w[i];
  }
}

Tensor norm(const Tensor& hidden, const Tensor& weight, double eps, bool one_plus) {
  auto h = hidden.contiguous();
  const int64_t width = h.size(-1);
  auto out = fresh_like(h);
  norm_into(floats(h), h.numel() / width, width, weight, eps, one_plus, floats(out),
            h.options());
  return out;
}

Tensor rms_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  return norm(hidden, weight, eps, /*one_plus=*/false);
}

Tensor gemma_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  return norm(hidden, weight, eps, /*one_plus=*/true);
}

void gemma_norm_into(const float* x, int64_t rows, int64_t width, const Tensor& weight,
                     double eps, float* out, const at::TensorOptions& opts) {
  norm_into(x, rows, width, weight, eps, /*one_plus=*/true, out, opts);
}

// The rotary products of `heads` rows of head_dim values at `x`, into `out`:
// x * cos + rotate_half(x) * sin, cos and sin being one row of head_dim.
void rotate_into(const float* x, int64_t heads, int64_t head_dim, const float* cos,
                 const float* sin, float* out) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = x + h * head_dim;
    float* to = out + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) {
      const float turned = i < half ? -row[i + half] : row[i - half];
      const float a = row[i] * cos[i];
      const float b = turned * sin[i];
      to[i] = a + b;
    }
  }
}

// x + y, elementwise, into x (a tensor of this file's own).
void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

// x * y, elementwise, into x (a tensor of this file's own).
void multiply_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * y[i];
}

using Int4Kernel = void (*)(const float*, int64_t, int64_t, const uint8_t*, const uint16_t*,
                            int32_t, int64_t, float*, float*, int32_t);

Tensor project(const Tensor& x, const Tensor& weight, const Tensor& scales, int64_t group,
               int64_t kernel, int64_t threads) {
  if (group == -1) {
    auto rows = x.reshape({-1, x.size(-1)}).contiguous();
    const int64_t m = rows.size(0), k = rows.size(1), n = weight.size(0);
    auto out = at::empty({m, n}, rows.options());
    auto scratch = at::empty({m * (k / 32)}, rows.options());
    reinterpret_cast<Int4Kernel>(kernel)(
        rows.data_ptr<float>(), m, k, weight.data_ptr<uint8_t>(),
        reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
        static_cast<int32_t>(scales.size(1) == 1), n,
        out.data_ptr<float>(), scratch.data_ptr<float>(),
        static_cast<int32_t>(threads));
    return out;
  }
  auto rows = x.reshape({-1, x.size(-1)}).to(at::kBFloat16);
  auto out = group > 0 ? at::_weight_int4pack_mm_for_cpu(rows, weight, group, scales)
                       : at::_weight_int8pack_mm(rows, weight, scales);
  return out.to(at::kFloat).contiguous();
}

// [1, heads, 1, head_dim] heads of a one-row projection's columns [from, to), as views.
Tensor heads_of(const Tensor& stacked, int64_t from, int64_t to, int64_t head_dim) {
  return stacked.slice(1, from, to).view({1, 1, -1, head_dim}).transpose(1, 2);
}

// Input norm, the stacked q/k/v projection and the rotary products: the rotated query and
// key and the value, each [1, heads, 1, head_dim].
// Qwen2's q/k/v biases come stacked in the same order; each is added to its own columns, as
// the Python step adds them to each member's slice.
std::tuple<Tensor, Tensor, Tensor> before_attention(
    const Tensor& hidden, const Tensor& norm_weight, double eps, const Tensor& qkv_weight,
    const Tensor& qkv_scales, int64_t qkv_group, const std::optional<Tensor>& qkv_bias,
    int64_t q_width, int64_t k_width, int64_t head_dim, const Tensor& cos, const Tensor& sin,
    int64_t kernel, int64_t threads) {
  check_step(hidden, cos, sin, head_dim);
  auto x = rms_norm(hidden, norm_weight, eps);
  auto stacked = project(x, qkv_weight, qkv_scales, qkv_group, kernel, threads);
  if (qkv_bias.has_value()) add_into(floats(stacked), floats(*qkv_bias), stacked.numel());
  const int64_t heads = (q_width + k_width) / head_dim, q_heads = q_width / head_dim;
  auto qk = at::empty({1, heads, 1, head_dim}, stacked.options());
  rotate_into(floats(stacked), heads, head_dim, floats(cos.contiguous()),
              floats(sin.contiguous()), floats(qk));
  auto value = heads_of(stacked, q_width + k_width, stacked.size(1), head_dim);
  return {qk.slice(1, 0, q_heads), qk.slice(1, q_heads), value};
}

// o_proj over the attention output ([1, 1, heads * head_dim]), the residual add, the
// post-attention norm and the gated SiLU MLP: the layer's output, [1, 1, hidden].
Tensor after_attention(
    const Tensor& residual, const Tensor& attended, const Tensor& o_weight,
    const Tensor& o_scales, int64_t o_group, const Tensor& norm_weight, double eps,
    const Tensor& gate_up_weight, const Tensor& gate_up_scales, int64_t gate_up_group,
    int64_t gate_width, const Tensor& down_weight, const Tensor& down_scales,
    int64_t down_group, int64_t kernel, int64_t threads) {
  TORCH_CHECK(residual.numel() == residual.size(-1), "decode_layer: one token per call");
  auto hidden = project(attended, o_weight, o_scales, o_group, kernel, threads)
                    .reshape({1, 1, -1});
  const int64_t width = hidden.size(-1);
  // residual + o, in o's own (fresh) storage: the same rounding as a new tensor.
  add_into(floats(hidden), floats(residual.contiguous()), width);
  auto x = rms_norm(hidden, norm_weight, eps);
  auto gate_up = project(x, gate_up_weight, gate_up_scales, gate_up_group, kernel, threads);
  auto act = at::silu(gate_up.slice(1, 0, gate_width).reshape({1, 1, -1}));
  const int64_t up_width = gate_up.size(1) - gate_width;
  multiply_into(floats(act), floats(gate_up) + gate_width, up_width);
  auto down = project(act, down_weight, down_scales, down_group, kernel, threads);
  add_into(floats(hidden), floats(down), width);
  return hidden;
}

// Gemma 3's first half: the input norm, the stacked q/k/v projection, the q and k norms
// per head and the rotary products (the layer type's table, passed in).
std::tuple<Tensor, Tensor, Tensor> gemma_before_attention(
    const Tensor& hidden, const Tensor& norm_weight, double eps, const Tensor& qkv_weight,
    const Tensor& qkv_scales, int64_t qkv_group, int64_t q_width, int64_t k_width,
    int64_t head_dim, const Tensor& q_norm_weight, double q_eps, const Tensor& k_norm_weight,
    double k_eps, const Tensor& cos, const Tensor& sin, int64_t kernel, int64_t threads) {
  check_step(hidden, cos, sin, head_dim);
  auto x = gemma_norm(hidden, norm_weight, eps);
  auto stacked = project(x, qkv_weight, qkv_scales, qkv_group, kernel, threads);
  const int64_t q_heads = q_width / head_dim, k_heads = k_width / head_dim;
  const auto opts = stacked.options();
  auto normed = at::empty({q_heads + k_heads, head_dim}, opts);
  const float* s = floats(stacked);
  gemma_norm_into(s, q_heads, head_dim, q_norm_weight, q_eps, floats(normed), opts);
  gemma_norm_into(s + q_width, k_heads, head_dim, k_norm_weight, k_eps,
                  floats(normed) + q_width, opts);
  auto qk = at::empty({1, q_heads + k_heads, 1, head_dim}, opts);
  rotate_into(floats(normed), q_heads + k_heads, head_dim, floats(cos.contiguous()),
              floats(sin.contiguous()), floats(qk));
  auto value = heads_of(stacked, q_width + k_width, stacked.size(1), head_dim);
  return {qk.slice(1, 0, q_heads), qk.slice(1, q_heads), value};
}

// Gemma 3's second half: o_proj, the post-attention norm and residual add, then the
// pre-feedforward norm, the GeGLU MLP (tanh GELU) and the post-feedforward norm and add.
Tensor gemma_after_attention(
    const Tensor& residual, const Tensor& attended, const Tensor& o_weight,
    const Tensor& o_scales, int64_t o_group, const Tensor& post_norm_weight, double post_eps,
    const Tensor& pre_ff_weight, double pre_ff_eps, const Tensor& gate_up_weight,
    const Tensor& gate_up_scales, int64_t gate_up_group, int64_t gate_width,
    const Tensor& down_weight, const Tensor& down_scales, int64_t down_group,
    const Tensor& post_ff_weight, double post_ff_eps, int64_t kernel, int64_t threads) {
  TORCH_CHECK(residual.numel() == residual.size(-1), "decode_layer: one token per call");
  auto o = project(attended, o_weight, o_scales, o_group, kernel, threads);
  const int64_t width = o.size(-1);
  const auto opts = o.options();
  auto hidden = at::empty({1, 1, width}, opts);
  gemma_norm_into(floats(o), 1, width, post_norm_weight, post_eps, floats(hidden), opts);
  add_into(floats(hidden), floats(residual.contiguous()), width);
  auto x = gemma_norm(hidden, pre_ff_weight, pre_ff_eps);
  auto gate_up = project(x, gate_up_weight, gate_up_scales, gate_up_group, kernel, threads);
  auto act = at::gelu(gate_up.slice(1, 0, gate_width).reshape({1, 1, -1}), "tanh");
  const int64_t up_width = gate_up.size(1) - gate_width;
  multiply_into(floats(act), floats(gate_up) + gate_width, up_width);
  auto down = project(act, down_weight, down_scales, down_group, kernel, threads);
  gemma_norm_into(floats(down), 1, width, post_ff_weight, post_ff_eps, floats(o), opts);
  add_into(floats(hidden), floats(o), width);
  return hidden;
}

using AttentionKernel = int32_t (*)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    float, int64_t, const void*, const void*, int32_t, int64_t,
                                    int64_t, int64_t, int64_t, int64_t, float*, int32_t);

// exact_attention.exact_attention for a float32 query: the attention output, [1, 1, heads *
// head_dim], of query [1, heads, q_len, d] over the cache's key/value [1, kv_heads, n, d].
Tensor attend(const Tensor& query, Tensor key, Tensor value, double scaling, int64_t window,
              int64_t kernel, int64_t threads) {
  TORCH_CHECK(query.size(0) == 1 && query.scalar_type() == at::kFloat,
              "attend takes one float32 sequence");
  auto q = query.select(0, 0).contiguous();
  const auto dtype = key.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || dtype != value.scalar_type()) {
    key = key.to(at::kFloat);
    value = value.to(at::kFloat);
  }
  if (key.stride(-1) != 1) key = key.contiguous();
  if (value.stride(-1) != 1) value = value.contiguous();
  const int64_t heads = q.size(0), q_len = q.size(1), dim = q.size(2), n = key.size(-2);
  auto out = at::empty({1, q_len, heads, dim}, q.options());
  const int32_t failed = reinterpret_cast<AttentionKernel>(kernel)(
      q.data_ptr<float>(), heads, q_len, dim, key.size(1), n - q_len,
      static_cast<float>(scaling), window, key.data_ptr(), value.data_ptr(),
      key.scalar_type() == at::kBFloat16 ? 1 : 0, key.stride(1), key.stride(2),
      value.stride(1), value.stride(2), n, out.data_ptr<float>(), static_cast<int32_t>(threads));
  TORCH_CHECK_WITH(OutOfMemoryError, failed == 0, "no memory for attention's state");
  return out.reshape({1, 1, -1});
}

Tensor attended_after_attention(
    const Tensor& residual, const Tensor& query, const Tensor& key, const Tensor& value,
    double scaling, int64_t window, int64_t attention_kernel, const Tensor& o_weight,
    const Tensor& o_scales, int64_t o_group, const Tensor& norm_weight, double eps,
    const Tensor& gate_up_weight, const Tensor& gate_up_scales, int64_t gate_up_group,
    int64_t gate_width, const Tensor& down_weight, const Tensor& down_scales,
    int64_t down_group, int64_t kernel, int64_t threads) {
  auto attended = attend(query, key, value, scaling, window, attention_kernel, threads);
  return after_attention(residual, attended, o_weight, o_scales, o_group, norm_weight, eps,
                         gate_up_weight, gate_up_scales, gate_up_group, gate_width,
                         down_weight, down_scales, down_group, kernel, threads);
}

Tensor gemma_attended_after_attention(
    const Tensor& residual, const Tensor& query, const Tensor& key, const Tensor& value,
    double scaling, int64_t window, int64_t attention_kernel, const Tensor& o_weight,
    const Tensor& o_scales, int64_t o_group, const Tensor& post_norm_weight, double post_eps,
    const Tensor& pre_ff_weight, double pre_ff_eps, const Tensor& gate_up_weight,
    const Tensor& gate_up_scales, int64_t gate_up_group, int64_t gate_width,
    const Tensor& down_weight, const Tensor& down_scales, int64_t down_group,
    const Tensor& post_ff_weight, double post_ff_eps, int64_t kernel, int64_t threads) {
  auto attended = attend(query, key, value, scaling, window, attention_kernel, threads);
  return gemma_after_attention(residual, attended, o_weight, o_scales, o_group,
                               post_norm_weight, post_eps, pre_ff_weight, pre_ff_eps,
                               gate_up_weight, gate_up_scales, gate_up_group, gate_width,
                               down_weight, down_scales, down_group, post_ff_weight,
                               post_ff_eps, kernel, threads);
}

}  // namespace

TORCH_LIBRARY(kvchat_native, m) {
  m.def(
      "before_attention(Tensor hidden, Tensor norm_weight, float eps, Tensor qkv_weight, "
      "Tensor qkv_scales, int qkv_group, Tensor? qkv_bias, int q_width, int k_width, "
      "int head_dim, Tensor cos, Tensor sin, int kernel, int threads) -> (Tensor, Tensor, Tensor)",
      before_attention);
  m.def(
      "after_attention(Tensor residual, Tensor attended, "
      "Tensor o_weight, Tensor o_scales, int o_group, Tensor norm_weight, float eps, "
      "Tensor gate_up_weight, Tensor gate_up_scales, int gate_up_group, int gate_width, "
      "Tensor down_weight, Tensor down_scales, int down_group, int kernel, int threads) -> Tensor",
      after_attention);
  m.def(
      "gemma_before_attention(Tensor hidden, Tensor norm_weight, float eps, Tensor qkv_weight, "
      "Tensor qkv_scales, int qkv_group, int q_width, int k_width, int head_dim, "
      "Tensor q_norm_weight, float q_eps, Tensor k_norm_weight, float k_eps, Tensor cos, "
      "Tensor sin, int kernel, int threads) -> (Tensor, Tensor, Tensor)",
      gemma_before_attention);
  m.def(
      "gemma_after_attention(Tensor residual, Tensor attended, Tensor o_weight, "
      "Tensor o_scales, int o_group, Tensor post_norm_weight, float post_eps, "
      "Tensor pre_ff_weight, float pre_ff_eps, Tensor gate_up_weight, Tensor gate_up_scales, "
      "int gate_up_group, int gate_width, Tensor down_weight, Tensor down_scales, "
      "int down_group, Tensor post_ff_weight, float post_ff_eps, int kernel, int threads) -> Tensor",
      gemma_after_attention);
  m.def(
      "attended_after_attention(Tensor residual, Tensor query, Tensor key, Tensor value, "
      "float scaling, int window, int attention_kernel, "
      "Tensor o_weight, Tensor o_scales, int o_group, Tensor norm_weight, float eps, "
      "Tensor gate_up_weight, Tensor gate_up_scales, int gate_up_group, int gate_width, "
      "Tensor down_weight, Tensor down_scales, int down_group, int kernel, int threads) -> Tensor",
      attended_after_attention);
  m.def(
      "gemma_attended_after_attention(Tensor residual, Tensor query, Tensor key, Tensor value, "
      "float scaling, int window, int attention_kernel, Tensor o_weight, "
      "Tensor o_scales, int o_group, Tensor post_norm_weight, float post_eps, "
      "Tensor pre_ff_weight, float pre_ff_eps, Tensor gate_up_weight, Tensor gate_up_scales, "
      "int gate_up_group, int gate_width, Tensor down_weight, Tensor down_scales, "
      "int down_group, Tensor post_ff_weight, float post_ff_eps, int kernel, int threads) -> Tensor",
      gemma_attended_after_attention);
}
