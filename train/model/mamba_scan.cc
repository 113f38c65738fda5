#include "train/model/mamba_scan.h"

#include <ATen/ATen.h>

#include <limits>
#include <vector>

#include "train/model/sequence_chunks.h"

namespace trestle::train {
namespace {

// [b, s, groups, n] -> [b, heads, s, n] fp32, each group's row repeated for its heads.
at::Tensor per_head(const at::Tensor& t, std::int64_t heads) {
  const std::int64_t groups = t.size(2);
  at::Tensor x = t.to(at::kFloat);
  if (heads != groups) x = x.repeat_interleave(heads / groups, 2);
  return x.transpose(1, 2);
}

}  // namespace

// The scan is linear attention with a scalar decay per step: queries C, keys B, values dt · x, log decay g = dt · A.
// Within a chunk, with γ the running sum of g from its start and S₀ the state it starts from,
//   Y = ((C Bᵀ) ∘ L) V + (e^{γ} C) S₀   with L[t, s] = e^{γ_t − γ_s} for s ≤ t, else 0,
//   S_end = e^{γ_last} S₀ + (B ∘ e^{γ_last − γ})ᵀ V.
// Every exponent is ≤ 0 (A < 0 < dt). Tokens past the end are padded with zeros (dt = 0: no decay, no input).
at::Tensor mamba_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                      const at::Tensor& C, std::int64_t chunk) {
  const std::int64_t b = x.size(0), s = x.size(1), heads = x.size(2), p = x.size(3), n = B.size(3);
  chunk = std::min(chunk, s);
  const std::int64_t chunks = (s + chunk - 1) / chunk;
  const at::Tensor step = dt.to(at::kFloat).transpose(1, 2);                        // [b, h, s]
  const at::Tensor values = x.to(at::kFloat).transpose(1, 2) * step.unsqueeze(-1);  // [b, h, s, p]
  const at::Tensor decay_log = step * A.to(at::kFloat).view({1, heads, 1});         // [b, h, s]
  auto chunked = [&](const at::Tensor& t) { return sequence_chunks(t, chunk); };
  const at::Tensor Q = chunked(per_head(C, heads)), K = chunked(per_head(B, heads)), V = chunked(values);
  const at::Tensor gamma = chunked(decay_log).cumsum(-1);  // [b, h, chunks, chunk]
  const at::Tensor causal = at::ones({chunk, chunk}, Q.options().dtype(at::kBool)).tril();
  const at::Tensor L = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2))
                           .masked_fill(causal.logical_not(), -std::numeric_limits<float>::infinity())
                           .exp();                                                  // [b, h, chunks, chunk, chunk]
  const at::Tensor within = at::matmul(at::matmul(Q, K.transpose(-1, -2)) * L, V);  // [b, h, chunks, chunk, p]
  if (chunks == 1) return within.select(2, 0).narrow(2, 0, s).transpose(1, 2).contiguous();
  const at::Tensor last = gamma.narrow(-1, chunk - 1, 1);  // [b, h, chunks, 1]
  const at::Tensor added = at::matmul((K * (last - gamma).exp().unsqueeze(-1)).transpose(-1, -2), V);  // [.., n, p]
  const at::Tensor Qg = Q * gamma.exp().unsqueeze(-1), last_decay = last.exp().unsqueeze(-1);
  at::Tensor state = at::zeros({b, heads, n, p}, Q.options());
  std::vector<at::Tensor> outputs{within.select(2, 0)};
  for (std::int64_t i = 1; i < chunks; ++i) {
    state = state * last_decay.select(2, i - 1) + added.select(2, i - 1);
    outputs.push_back(within.select(2, i) + at::matmul(Qg.select(2, i), state));
  }
  return at::cat(outputs, 2).narrow(2, 0, s).transpose(1, 2).contiguous();
}

at::Tensor mamba_scan_recurrent(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                const at::Tensor& C) {
  const std::int64_t b = x.size(0), s = x.size(1), heads = x.size(2), p = x.size(3), n = B.size(3);
  const at::Tensor keys = per_head(B, heads), queries = per_head(C, heads);  // [b, h, s, n]
  at::Tensor state = at::zeros({b, heads, n, p}, x.options().dtype(at::kFloat));
  std::vector<at::Tensor> outputs;
  for (std::int64_t t = 0; t < s; ++t) {
    const at::Tensor step = dt.select(1, t).to(at::kFloat);  // [b, h]
    const at::Tensor decay = (step * A.to(at::kFloat)).exp().view({b, heads, 1, 1});
    const at::Tensor input = x.select(1, t).to(at::kFloat) * step.unsqueeze(-1);  // [b, h, p]
    state = decay * state + keys.select(2, t).unsqueeze(-1) * input.unsqueeze(-2);
    outputs.push_back((state * queries.select(2, t).unsqueeze(-1)).sum(-2));  // [b, h, p]
  }
  return at::stack(outputs, 1);
}

}  // namespace trestle::train
