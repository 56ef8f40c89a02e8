// TorchEngine's decode step as two compiled ops: trace_core/policy/decode.py's
// ``_decode_step_python`` and ``_sample_step_python``, the same ATen calls in the same order with
// the same arguments, so their results are the Python ones' bit for bit
// (tests/policy/test_native.py). What it saves is
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

// sampling.sample with sampling.TableDraws: one token per row of ``logits``, drawn with its
// uniform for its step in ``table``, and its logprob (temperature 1, before top-p).
std::tuple<Tensor, Tensor> sample(const Tensor& logits, const Tensor& table, const Tensor& steps,
                                  double temperature, double top_p) {
  TRACE_SCOPE("sample");
  Tensor logp = at::log_softmax(logits, -1);
  Tensor tokens;
  if (temperature == 0) {
    tokens = logits.argmax(-1);
  } else {
    Tensor probs = temperature == 1 ? logp.exp() : (logits / temperature).softmax(-1);
    Tensor order;
    if (top_p < 1) {
      std::tie(probs, order) = probs.sort(-1, /*descending=*/true);
      Tensor before = probs.cumsum(-1) - probs;
      probs = probs.masked_fill(before >= top_p, 0.0);
    }
    Tensor cdf = probs.cumsum(-1, at::kDouble);
    Tensor u = table.gather(1, steps.clamp_max(table.size(1) - 1).unsqueeze(1));
    Tensor picked = at::searchsorted(cdf, u.mul_(cdf.slice(1, -1)), /*out_int32=*/false,
                                     /*right=*/true);
    picked = picked.clamp_max_(logits.size(-1) - 1);
    if (order.defined()) {
      picked = order.gather(-1, picked);
    }
    tokens = picked.squeeze(-1);
  }
  return {tokens, logp.gather(-1, tokens.unsqueeze(1)).squeeze(-1)};
}

// decode.sample_step: the head's logits (decoder.lm_logits), a token per row (``sample``)
// written with its logprob to the row's output column; steps + 1.
Tensor sample_step(const Tensor& hidden, const Tensor& lm_head, const Tensor& table,
                   const Tensor& steps, const Tensor& out_tok, const Tensor& out_lp,
                   double temperature, double top_p) {
  Tensor logits;
  {
    TRACE_SCOPE("lm_logits");
    logits = at::mm(hidden, lm_head).to(at::kFloat);
  }
  auto [tokens, logprobs] = sample(logits, table, steps, temperature, top_p);
  Tensor column = steps.clamp_max(out_tok.size(1) - 1).unsqueeze(1);
  out_tok.scatter_(1, column, tokens.unsqueeze(1));
  out_lp.scatter_(1, column, logprobs.unsqueeze(1));
  steps.add_(1);
  return tokens;
}

}  // namespace

TORCH_LIBRARY(trace_native, m) {
  m.def(
      "decode_step(Tensor embed, Tensor[] qkv, Tensor[] qk_norm, Tensor[] o, Tensor[] gate_up, "
      "Tensor[] down, Tensor(a!)[] rows, Tensor[] keys, Tensor[] values, Tensor tokens, "
      "Tensor dest, Tensor rope, Tensor(b!) mask, int span, int H, int Hkv, int D, float scale, "
      "float eps) -> Tensor");
  m.def(
      "sample_step(Tensor hidden, Tensor lm_head, Tensor table, Tensor(a!) steps, "
      "Tensor(b!) out_tok, Tensor(c!) out_lp, float temperature, float top_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(trace_native, CPU, m) {
  m.impl("decode_step", decode_step);
  m.impl("sample_step", sample_step);
}
