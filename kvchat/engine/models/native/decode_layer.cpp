// One decoder layer's decode step (one token) for kvchat's quantized CPU models, in two
// halves around the cache's update: the same ATen ops, in the same order and dtypes, as
// kvchat/engine/models/decode_step.py spells them in Python (so the same bits; the Python side
// checks that on this machine before it uses this library). What it saves is Python: at one
// row per call a layer is ~50 short ops, and calling them from here costs the dispatcher
// only, not the interpreter and torch's Python bindings.
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

#include <optional>
#include <tuple>

namespace {

using at::Tensor;

Tensor rms_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  // LlamaRMSNorm.forward on float32 input.
  auto variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (hidden * at::rsqrt(variance + eps));
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
  return out.to(at::kFloat);
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
  auto x = rms_norm(hidden, norm_weight, eps);
  auto stacked = project(x, qkv_weight, qkv_scales, qkv_group, kernel, threads);
  if (qkv_bias.has_value()) stacked = stacked + *qkv_bias;
  auto qk = stacked.slice(1, 0, q_width + k_width).view({1, 1, -1, head_dim}).transpose(1, 2);
  auto half = head_dim / 2;
  auto rotated = at::cat({-qk.slice(-1, half), qk.slice(-1, 0, half)}, -1);
  qk = (qk * cos) + (rotated * sin);
  auto q_heads = q_width / head_dim;
  auto value = stacked.slice(1, q_width + k_width).view({1, 1, -1, head_dim}).transpose(1, 2);
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
  auto o = project(attended, o_weight, o_scales, o_group, kernel, threads);
  auto hidden = residual + o.reshape({1, 1, -1});
  auto x = rms_norm(hidden, norm_weight, eps);
  auto gate_up = project(x, gate_up_weight, gate_up_scales, gate_up_group, kernel, threads);
  auto gate = gate_up.slice(1, 0, gate_width).reshape({1, 1, -1});
  auto up = gate_up.slice(1, gate_width).reshape({1, 1, -1});
  auto down = project(at::silu(gate) * up, down_weight, down_scales, down_group, kernel, threads);
  return hidden + down.reshape({1, 1, -1});
}

// Gemma3RMSNorm.forward on float32 input: the normalized input times (1 + weight).
Tensor gemma_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  auto normed = hidden * at::rsqrt(hidden.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed * (1.0 + weight);
}

Tensor rotated(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  auto half = x.size(-1) / 2;
  auto turned = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (turned * sin);
}

// Gemma 3's first half: the input norm, the stacked q/k/v projection, the q and k norms
// per head and the rotary products (the layer type's table, passed in).
std::tuple<Tensor, Tensor, Tensor> gemma_before_attention(
    const Tensor& hidden, const Tensor& norm_weight, double eps, const Tensor& qkv_weight,
    const Tensor& qkv_scales, int64_t qkv_group, int64_t q_width, int64_t k_width,
    int64_t head_dim, const Tensor& q_norm_weight, double q_eps, const Tensor& k_norm_weight,
    double k_eps, const Tensor& cos, const Tensor& sin, int64_t kernel, int64_t threads) {
  auto x = gemma_norm(hidden, norm_weight, eps);
  auto stacked = project(x, qkv_weight, qkv_scales, qkv_group, kernel, threads);
  auto heads = [&](int64_t from, int64_t to) {
    return stacked.slice(1, from, to).view({1, 1, -1, head_dim}).transpose(1, 2);
  };
  auto query = gemma_norm(heads(0, q_width), q_norm_weight, q_eps);
  auto key = gemma_norm(heads(q_width, q_width + k_width), k_norm_weight, k_eps);
  auto value = heads(q_width + k_width, stacked.size(1));
  return {rotated(query, cos, sin), rotated(key, cos, sin), value};
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
  auto o = project(attended, o_weight, o_scales, o_group, kernel, threads).reshape({1, 1, -1});
  auto hidden = residual + gemma_norm(o, post_norm_weight, post_eps);
  auto x = gemma_norm(hidden, pre_ff_weight, pre_ff_eps);
  auto gate_up = project(x, gate_up_weight, gate_up_scales, gate_up_group, kernel, threads);
  auto gate = gate_up.slice(1, 0, gate_width).reshape({1, 1, -1});
  auto up = gate_up.slice(1, gate_width).reshape({1, 1, -1});
  auto down = project(at::gelu(gate, "tanh") * up, down_weight, down_scales, down_group,
                      kernel, threads);
  return hidden + gemma_norm(down.reshape({1, 1, -1}), post_ff_weight, post_ff_eps);
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
