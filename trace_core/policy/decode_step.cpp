// TorchEngine's decode step as one compiled op: trace_core/policy/decode.py's
// ``_decode_step_python``, the same ATen calls in the same order with the same arguments, so
// its results are the Python step's bit for bit (tests/policy/test_native.py). What it saves is
// the Python side of every call: argument parsing, tensor wrapping and the interpreter, which
// on a small policy cost more than the arithmetic of its ≈80 operations a step.
//
// Built and loaded by trace_core/policy/native.py (a shared library linked against the torch
// the process imports); registered as torch.ops.trace_native.decode_step for CPU tensors.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

namespace {

using at::Tensor;

// Scopes named as the profiler names a Python frame, "<file>: <function>": `bench engine
// --profile` (bench/engine_profile.py) puts the operations inside them in the same parts of the
// step as the Python step's (its norms, its rope). Free while no profiler runs.
#define TRACE_SCOPE(function) \
  RECORD_FUNCTION("trace_core/policy/decode_step.cpp: " function, std::vector<c10::IValue>())

// decoder.normalize: x · rsqrt(‖x‖² / C + eps) over the last dimension, in float32.
Tensor normalize(const Tensor& x, const Tensor& eps) {
  TRACE_SCOPE("normalize");
  if (x.scalar_type() != at::kFloat) {
    return normalize(x.to(at::kFloat), eps).to(x.scalar_type());
  }
  Tensor norm = at::linalg_vector_norm(x, 2, at::IntArrayRef{-1}, /*keepdim=*/true);
  return x * at::addcmul(eps, norm, norm, 1.0 / static_cast<double>(x.size(-1))).rsqrt_();
}

// decode.decode_step's arguments, with the weights as one list per kind (one entry per layer;
// qk_norm empty for Llama) and scale = head_dim ** -0.5 as Python computes it.
Tensor decode_step(const Tensor& embed, at::TensorList qkv_w, at::TensorList qk_norm,
                   at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                   at::TensorList rows, at::TensorList keys, at::TensorList values,
                   const Tensor& tokens, const Tensor& dest, const Tensor& rope, const Tensor& mask,
                   int64_t span, int64_t H, int64_t Hkv, int64_t D, double scale, double eps_value) {
  const int64_t B = tokens.size(0);
  const int64_t layers = static_cast<int64_t>(qkv_w.size());
  TORCH_CHECK(o_w.size() == qkv_w.size() && gate_up_w.size() == qkv_w.size() &&
                  down_w.size() == qkv_w.size() && rows.size() == qkv_w.size() &&
                  keys.size() == qkv_w.size() && values.size() == qkv_w.size(),
              "decode_step: one weight and KV view of each kind per layer");
  TORCH_CHECK(qk_norm.empty() || qk_norm.size() == qkv_w.size(),
              "decode_step: qk_norm holds one tensor per layer, or none");
  const at::ScalarType dtype = embed.scalar_type();
  Tensor eps = at::full({1, 1}, eps_value, tokens.options().dtype(at::kFloat));
  mask.view({-1}).index_fill_(0, dest.slice(0, 0, B * Hkv), 0.0);
  std::vector<Tensor> cos_sin = rope.unsqueeze(1).chunk(2, -1);
  const Tensor& cos = cos_sin[0];
  const Tensor& sin = cos_sin[1];
  Tensor visible = mask.slice(2, 0, span);
  Tensor x = at::embedding(embed, tokens);
  const int64_t qk_width = (H + Hkv) * D;
  for (int64_t i = 0; i < layers; ++i) {
    Tensor qkv = at::mm(normalize(x, eps), qkv_w[i]);
    Tensor qk = qkv.slice(1, 0, qk_width).view({B, H + Hkv, D});
    if (!qk_norm.empty()) {
      qk = normalize(qk, eps) * qk_norm[i];
    }
    {
      TRACE_SCOPE("apply_rope");
      qk = at::addcmul(qk * cos, qk.roll({D / 2}, {-1}), sin);
    }
    Tensor new_kv = at::cat({qk.slice(1, H), qkv.slice(1, qk_width).view({B, Hkv, D})});
    rows[i].index_copy_(0, dest, new_kv.view({-1, D}));
    Tensor q = qk.slice(1, 0, H).reshape({B * Hkv, H / Hkv, D});
    Tensor scores = at::baddbmm(visible, q, keys[i].slice(2, 0, span), 1.0, scale);
    Tensor probs = at::softmax(scores, -1, at::kFloat);
    if (probs.scalar_type() != dtype) {
      probs = probs.to(dtype);
    }
    x = at::addmm(x, at::bmm(probs, values[i].slice(1, 0, span)).view({B, H * D}), o_w[i]);
    std::vector<Tensor> gate_up = at::mm(normalize(x, eps), gate_up_w[i]).chunk(2, -1);
    x = at::addmm(x, at::silu(gate_up[0]).mul_(gate_up[1]), down_w[i]);
  }
  return normalize(x, eps);
}

}  // namespace

TORCH_LIBRARY(trace_native, m) {
  m.def(
      "decode_step(Tensor embed, Tensor[] qkv, Tensor[] qk_norm, Tensor[] o, Tensor[] gate_up, "
      "Tensor[] down, Tensor(a!)[] rows, Tensor[] keys, Tensor[] values, Tensor tokens, "
      "Tensor dest, Tensor rope, Tensor(b!) mask, int span, int H, int Hkv, int D, float scale, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(trace_native, CPU, m) { m.impl("decode_step", decode_step); }
