#include "train/model/gated_delta_rule.h"

#include <ATen/ATen.h>

#include <limits>
#include <vector>

#include "train/model/sequence_chunks.h"

namespace trestle::train {

// Within a chunk, with γ the running sum of g from its start and S₀ the state it starts from, unrolling the recurrence
// gives S_t = e^{γ_t} S₀ + Σ_{s≤t} e^{γ_t − γ_s} k_s u_sᵀ. The corrections u of the chunk's C tokens then solve
// (I + A) U = βV − (β e^{γ} K) S₀ with A strictly lower triangular, A[t, s] = β_t e^{γ_t − γ_s} (k_t · k_s), so
// U = U_v − W S₀ where U_v and W do not depend on S₀ and are solved for every chunk at once. Then
//   O = (e^{γ} Q) S₀ + ((Q Kᵀ) ∘ D) U   with D[t, s] = e^{γ_t − γ_s} for s ≤ t, else 0,
//   S_C = e^{γ_C} S₀ + (K ∘ e^{γ_C − γ})ᵀ U.
// Every exponent is ≤ 0 (g ≤ 0). Tokens past the end are padded with g = β = k = v = q = 0, which leave the state alone.
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, std::int64_t chunk) {
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), dk = q.size(3), dv = v.size(3);
  const std::int64_t n = (s + chunk - 1) / chunk;
  auto chunks = [&](const at::Tensor& t) { return sequence_chunks(t, chunk); };
  const at::Tensor Q = chunks(q), K = chunks(k), V = chunks(v), G = chunks(g), B = chunks(beta);
  const at::Tensor gamma = G.cumsum(-1), decay = gamma.exp();              // [b, h, n, C]
  const at::Tensor causal = at::ones({chunk, chunk}, Q.options().dtype(at::kBool)).tril();
  const at::Tensor D = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2))
                           .masked_fill(causal.logical_not(), -std::numeric_limits<float>::infinity())
                           .exp();                                          // [b, h, n, C, C]
  const at::Tensor strictly = at::ones({chunk, chunk}, Q.options().dtype(at::kBool)).tril(-1);
  const at::Tensor A = (B.unsqueeze(-1) * at::matmul(K, K.transpose(-1, -2)) * D).masked_fill(strictly.logical_not(), 0);
  const at::Tensor I_plus_A = A + at::eye(chunk, Q.options());
  const at::Tensor rhs = at::cat({B.unsqueeze(-1) * V, (B * decay).unsqueeze(-1) * K}, -1);
  const at::Tensor solved = at::linalg_solve_triangular(I_plus_A, rhs, /*upper=*/false, /*left=*/true,
                                                        /*unitriangular=*/true);
  const at::Tensor Uv = solved.narrow(-1, 0, dv), W = solved.narrow(-1, dv, dk);
  const at::Tensor QKD = at::matmul(Q, K.transpose(-1, -2)) * D;            // [b, h, n, C, C]
  const at::Tensor Qg = Q * decay.unsqueeze(-1);
  const at::Tensor last = gamma.narrow(-1, chunk - 1, 1);                   // [b, h, n, 1]
  const at::Tensor Kc = K * (last - gamma).exp().unsqueeze(-1), last_decay = decay.narrow(-1, chunk - 1, 1);
  at::Tensor state = at::zeros({b, h, dk, dv}, Q.options());
  std::vector<at::Tensor> outputs;
  for (std::int64_t i = 0; i < n; ++i) {
    const at::Tensor U = Uv.select(2, i) - at::matmul(W.select(2, i), state);
    outputs.push_back(at::matmul(Qg.select(2, i), state) + at::matmul(QKD.select(2, i), U));
    if (i + 1 < n)
      state = state * last_decay.select(2, i).unsqueeze(-1) + at::matmul(Kc.select(2, i).transpose(-1, -2), U);
  }
  return at::cat(outputs, 2).narrow(2, 0, s).to(v.scalar_type());
}

at::Tensor gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta) {
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), dk = q.size(3), dv = v.size(3);
  at::Tensor state = at::zeros({b, h, dk, dv}, q.options().dtype(at::kFloat));
  std::vector<at::Tensor> outputs;
  for (std::int64_t t = 0; t < s; ++t) {
    const at::Tensor qt = q.select(2, t).to(at::kFloat), kt = k.select(2, t).to(at::kFloat);
    const at::Tensor vt = v.select(2, t).to(at::kFloat);
    const at::Tensor decayed = state * g.select(2, t).to(at::kFloat).exp().view({b, h, 1, 1});
    const at::Tensor remembered = (decayed * kt.unsqueeze(-1)).sum(-2);    // [b, h, dv]
    const at::Tensor u = (vt - remembered) * beta.select(2, t).to(at::kFloat).unsqueeze(-1);
    state = decayed + kt.unsqueeze(-1) * u.unsqueeze(-2);
    outputs.push_back((state * qt.unsqueeze(-1)).sum(-2));
  }
  return at::stack(outputs, 2).to(v.scalar_type());
}

}  // namespace trestle::train
