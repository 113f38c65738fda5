#include "train/model/chunked_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

#include "train/model/fused_kernels.h"

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename T>
std::int64_t pointer_value(T* p) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(p));
}
template <typename T>
T* from_value(const c10::IValue& v) {
  return reinterpret_cast<T*>(static_cast<std::intptr_t>(v.toInt()));
}

// One chunk's logits over this rank's real vocabulary, in fp32 (soft-capped when asked); `capped` gets tanh(z / cap).
at::Tensor chunk_logits(const at::Tensor& rows, const at::Tensor& weight, const VocabRange& range, double softcap,
                        at::Tensor* capped = nullptr) {
  at::Tensor logits = at::linear(rows, weight.narrow(0, 0, range.valid)).to(at::kFloat);
  if (softcap <= 0) return logits;
  at::Tensor t = at::tanh(logits / softcap);
  if (capped) *capped = t;
  return t * softcap;
}

struct ChunkedOutputCrossEntropy : torch::autograd::Function<ChunkedOutputCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, const VocabRange& range, const TpGroup& group,
                            const OutputLossOptions& options) {
    const std::int64_t h = hidden.size(-1), n = targets.numel();
    const at::Tensor rows = hidden.reshape({n, h});
    const at::Tensor ids = targets.reshape({n});
    const at::Tensor outside = (ids < range.start) | (ids >= range.start + range.valid);
    const at::Tensor local_target = (ids - range.start).masked_fill(outside, 0);
    at::Tensor lse = at::empty({n}, hidden.options().dtype(at::kFloat));
    at::Tensor loss = at::empty({n}, hidden.options().dtype(at::kFloat));
    // One chunk holds every token: its logits (and tanh(z / cap)) are kept for backward instead of computed again.
    // They take no more memory than a chunk's at its peak, and small micro-batches (CPU runs) skip a GEMM.
    const bool keep_logits = n <= options.chunk_tokens && range.valid > 0;
    // The fused passes read the logits in the layer's dtype (kept so when one chunk holds every token).
    const bool fused = options.fused_kernels && supports(hidden);
    at::Tensor kept_logits, kept_capped;
    for (std::int64_t begin = 0; begin < n; begin += options.chunk_tokens) {
      const std::int64_t c = std::min(options.chunk_tokens, n - begin);
      at::Tensor max, target, sum_exp, sums;
      if (range.valid > 0 && fused) {
        const at::Tensor logits = at::linear(rows.narrow(0, begin, c), weight.narrow(0, 0, range.valid));
        if (keep_logits) kept_logits = logits;
        max = cross_entropy_max(logits, options.softcap);
        group.all_reduce_max(max);
        sums = cross_entropy_sums(logits, local_target.narrow(0, begin, c), outside.narrow(0, begin, c), max,
                                  options.softcap);
      } else if (range.valid > 0) {
        at::Tensor capped;
        const at::Tensor logits = chunk_logits(rows.narrow(0, begin, c), weight, range, options.softcap, &capped);
        if (keep_logits) {
          kept_logits = logits;
          kept_capped = capped;
        }
        max = std::get<0>(logits.max(-1)).contiguous();
        group.all_reduce_max(max);
        const at::Tensor shifted = logits - max.unsqueeze(-1);
        target = shifted.gather(-1, local_target.narrow(0, begin, c).unsqueeze(-1)).squeeze(-1);
        target = target.masked_fill(outside.narrow(0, begin, c), 0.0);
        sum_exp = shifted.exp().sum(-1);
      } else {  // this rank holds only padding rows
        max = at::full({c}, -std::numeric_limits<float>::infinity(), lse.options());
        group.all_reduce_max(max);
        target = at::zeros({c}, lse.options());
        sum_exp = at::zeros({c}, lse.options());
      }
      if (!sums.defined()) sums = at::stack({target, sum_exp});
      group.all_reduce_sum(sums);
      lse.narrow(0, begin, c).copy_(sums[1].log() + max);
      loss.narrow(0, begin, c).copy_(sums[1].log() - sums[0]);
    }
    ctx->save_for_backward({hidden, weight, local_target, outside, lse, kept_logits, kept_capped});
    ctx->saved_data["range"] = std::vector<std::int64_t>{range.start, range.rows, range.valid};
    ctx->saved_data["softcap"] = options.softcap;
    ctx->saved_data["chunk"] = options.chunk_tokens;
    ctx->saved_data["sink"] = pointer_value(options.sink);
    ctx->saved_data["fused"] = fused;
    return loss.view(targets.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &local_target = saved[2], &outside = saved[3],
                     &lse = saved[4], &kept_logits = saved[5], &kept_capped = saved[6];
    const auto r = ctx->saved_data["range"].toIntVector();
    const VocabRange range{r[0], r[1], r[2]};
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const std::int64_t chunk = ctx->saved_data["chunk"].toInt();
    auto* sink = from_value<WeightGradSink>(ctx->saved_data["sink"]);
    const bool fused = ctx->saved_data["fused"].toBool();
    const std::int64_t h = hidden.size(-1), n = lse.numel();
    const at::Tensor rows = hidden.reshape({n, h});
    const at::Tensor grad_loss = grad[0].reshape({n}).to(at::kFloat);
    const bool want_input = ctx->needs_input_grad(0), want_weight = ctx->needs_input_grad(1);
    at::Tensor grad_hidden = want_input ? at::zeros({n, h}, hidden.options()) : at::Tensor();
    // The weight's gradient: straight into the main-grad buffer (its dtype), or a tensor autograd takes.
    at::Tensor grad_weight;
    if (want_weight && !sink) grad_weight = at::zeros(weight.sizes(), weight.options());
    at::Tensor weight_valid = weight.narrow(0, 0, range.valid);
    for (std::int64_t begin = 0; begin < n && range.valid > 0; begin += chunk) {
      const std::int64_t c = std::min(chunk, n - begin);
      const at::Tensor x = rows.narrow(0, begin, c);
      at::NoGradGuard no_grad;
      at::Tensor g, g_typed;
      if (fused) {
        const at::Tensor logits = kept_logits.defined() ? kept_logits : at::linear(x, weight_valid);
        g_typed = cross_entropy_grad(logits, local_target.narrow(0, begin, c), outside.narrow(0, begin, c),
                                     lse.narrow(0, begin, c), grad_loss.narrow(0, begin, c), softcap);
        g = g_typed;
      } else {
        at::Tensor capped = kept_capped;
        const at::Tensor logits =
            kept_logits.defined() ? kept_logits : chunk_logits(x, weight, range, softcap, &capped);
        g = (logits - lse.narrow(0, begin, c).unsqueeze(-1)).exp_();
        const at::Tensor inside = (~outside.narrow(0, begin, c)).to(at::kFloat);
        g.scatter_add_(-1, local_target.narrow(0, begin, c).unsqueeze(-1), -inside.unsqueeze(-1));
        g.mul_(grad_loss.narrow(0, begin, c).unsqueeze(-1));
        if (softcap > 0) g.mul_(1 - capped * capped);
        g_typed = g.to(hidden.scalar_type());
      }
      if (want_input) grad_hidden.narrow(0, begin, c).copy_(at::matmul(g_typed, weight_valid));
      if (!want_weight) continue;
      if (!sink) {
        grad_weight.narrow(0, 0, range.valid).addmm_(g_typed.t(), x);
        continue;
      }
      at::Tensor main = sink->main_grad.narrow(0, 0, range.valid);
      if (sink->overwrite) {
        sink->main_grad.zero_();
        sink->overwrite = false;
      }
      // On a GPU the logits' gradient in the model's dtype, as Megatron's output layer receives it through autograd
      // (for bf16, one GEMM accumulating in fp32 rather than an fp32 SIMT GEMM); elsewhere the fp32 one, widened x.
      accumulate_weight_grad(main, x.is_cuda() ? g_typed : g, x, /*overwrite=*/false);
    }
    if (want_weight && sink) {
      if (sink->overwrite) {  // no chunk ran (this rank holds only padding): the gradient is zero
        sink->main_grad.zero_();
        sink->overwrite = false;
      }
      if (sink->on_accumulated) sink->on_accumulated();
    }
    return {want_input ? grad_hidden.view(hidden.sizes()) : at::Tensor(), grad_weight, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::int64_t output_loss_chunk_tokens(std::int64_t vocab_rows, at::Device device) {
  const std::int64_t logits = std::int64_t{1} << (device.is_cuda() ? 25 : 23);
  return std::max<std::int64_t>(16, logits / std::max<std::int64_t>(vocab_rows, 1));
}

at::Tensor chunked_output_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        const VocabRange& range, const TpGroup& group,
                                        const OutputLossOptions& options) {
  TORCH_CHECK(options.chunk_tokens > 0, "chunked_output_cross_entropy: chunk_tokens must be positive");
  TORCH_CHECK(hidden.dim() == targets.dim() + 1 && weight.size(0) == range.rows,
              "chunked_output_cross_entropy: hidden [..., h], targets [...], weight [rows, h]");
  return ChunkedOutputCrossEntropy::apply(hidden, weight, targets, range, group, options);
}

}  // namespace trestle::train
