#include "train/model/chunked_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <functional>
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

// What the loss's passes share: the rows, each token's column on this rank, whether its target is another rank's.
struct LossInputs {
  at::Tensor rows, local_target, outside;
  LossInputs(const at::Tensor& hidden, const at::Tensor& targets, const VocabRange& range) {
    const std::int64_t n = targets.numel();
    rows = hidden.reshape({n, hidden.size(-1)});
    const at::Tensor ids = targets.reshape({n});
    outside = (ids < range.start) | (ids >= range.start + range.valid);
    local_target = (ids - range.start).masked_fill(outside, 0);
  }
};

// One chunk's logits as the forward pass makes them: the GEMM's output in the layer's dtype for the fused passes, else
// fp32 (soft-capped, with tanh(z / cap) in `capped`).
struct ChunkLogits {
  at::Tensor logits, capped;
};
ChunkLogits logits_of(const at::Tensor& rows, const at::Tensor& weight, const VocabRange& range, double softcap,
                      bool fused) {
  ChunkLogits chunk;
  if (fused) chunk.logits = at::linear(rows, weight.narrow(0, 0, range.valid));
  else chunk.logits = chunk_logits(rows, weight, range, softcap, &chunk.capped);
  return chunk;
}

// The forward pass over the chunks: each chunk's logits, the vocab-parallel log-sum-exp into lse [n] and the loss into
// loss [n] (fp32); `each` (when given) gets every chunk's logits once its lse is known.
void forward_chunks(const LossInputs& in, const at::Tensor& weight, const VocabRange& range, const TpGroup& group,
                    const OutputLossOptions& options, bool fused, at::Tensor& lse, at::Tensor& loss,
                    const std::function<void(std::int64_t, std::int64_t, const ChunkLogits&)>& each) {
  const std::int64_t n = in.rows.size(0);
  lse = at::empty({n}, in.rows.options().dtype(at::kFloat));
  loss = at::empty({n}, in.rows.options().dtype(at::kFloat));
  for (std::int64_t begin = 0; begin < n; begin += options.chunk_tokens) {
    const std::int64_t c = std::min(options.chunk_tokens, n - begin);
    const at::Tensor outside = in.outside.narrow(0, begin, c), local_target = in.local_target.narrow(0, begin, c);
    const ChunkLogits chunk =
        range.valid > 0 ? logits_of(in.rows.narrow(0, begin, c), weight, range, options.softcap, fused) : ChunkLogits{};
    at::Tensor max, target, sum_exp, sums;
    if (range.valid > 0 && fused) {
      max = cross_entropy_max(chunk.logits, options.softcap);
      group.all_reduce_max(max);
      sums = cross_entropy_sums(chunk.logits, local_target, outside, max, options.softcap);
    } else if (range.valid > 0) {
      max = std::get<0>(chunk.logits.max(-1)).contiguous();
      group.all_reduce_max(max);
      const at::Tensor shifted = chunk.logits - max.unsqueeze(-1);
      target = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
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
    if (each && range.valid > 0) each(begin, c, chunk);
  }
}

// A chunk's logits' gradient (softmax − one-hot) · grad_loss (· the soft-cap's derivative): fp32 and in the layer's
// dtype (one tensor on the fused path).
struct LogitsGrad {
  at::Tensor fp32, typed;
};
LogitsGrad logits_grad(const ChunkLogits& chunk, const at::Tensor& local_target, const at::Tensor& outside,
                       const at::Tensor& lse, const at::Tensor& grad_loss, double softcap, bool fused,
                       at::ScalarType type) {
  if (fused) {
    at::Tensor g = cross_entropy_grad(chunk.logits, local_target, outside, lse, grad_loss, softcap);
    return {g, g};
  }
  at::Tensor g = (chunk.logits - lse.unsqueeze(-1)).exp_();
  g.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(at::kFloat).unsqueeze(-1));
  g.mul_(grad_loss.unsqueeze(-1));
  if (softcap > 0) g.mul_(1 - chunk.capped * chunk.capped);
  return {g, g.to(type)};
}

// Adds a chunk's weight gradient into `main` (rows of the weight's gradient or of its main-grad buffer; written when
// `overwrite`): on a GPU from the logits' gradient in the model's dtype, as Megatron's output layer receives it
// through autograd (for bf16, one GEMM accumulating in fp32 rather than an fp32 SIMT GEMM); elsewhere the fp32 one,
// widened x.
void add_weight_grad(at::Tensor main, const LogitsGrad& g, const at::Tensor& x, bool overwrite) {
  accumulate_weight_grad(main, x.is_cuda() ? g.typed : g.fp32, x, overwrite);
}

// The sink's buffer about to take a micro-batch's gradient: zeroed first when the buffer was reset.
at::Tensor sink_rows(WeightGradSink& sink, std::int64_t valid) {
  if (sink.overwrite) {
    sink.main_grad.zero_();
    sink.overwrite = false;
  }
  return sink.main_grad.narrow(0, 0, valid);
}

struct ChunkedOutputCrossEntropy : torch::autograd::Function<ChunkedOutputCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, const VocabRange& range, const TpGroup& group,
                            const OutputLossOptions& options) {
    const LossInputs in(hidden, targets, range);
    // One chunk holds every token: its logits (and tanh(z / cap)) are kept for backward instead of computed again.
    // They take no more memory than a chunk's at its peak, and small micro-batches (CPU runs) skip a GEMM.
    const bool keep_logits = in.rows.size(0) <= options.chunk_tokens;
    // The fused passes read the logits in the layer's dtype (kept so when one chunk holds every token).
    const bool fused = options.fused_kernels && supports(hidden);
    ChunkLogits kept;
    at::Tensor lse, loss;
    forward_chunks(in, weight, range, group, options, fused, lse, loss,
                   [&](std::int64_t, std::int64_t, const ChunkLogits& chunk) {
                     if (keep_logits) kept = chunk;
                   });
    ctx->save_for_backward({hidden, weight, in.local_target, in.outside, lse, kept.logits, kept.capped});
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
                     &lse = saved[4];
    const ChunkLogits kept{saved[5], saved[6]};
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
    const at::Tensor weight_valid = weight.narrow(0, 0, range.valid);
    for (std::int64_t begin = 0; begin < n && range.valid > 0; begin += chunk) {
      const std::int64_t c = std::min(chunk, n - begin);
      const at::Tensor x = rows.narrow(0, begin, c);
      at::NoGradGuard no_grad;
      const ChunkLogits logits = kept.logits.defined() ? kept : logits_of(x, weight, range, softcap, fused);
      const LogitsGrad g =
          logits_grad(logits, local_target.narrow(0, begin, c), outside.narrow(0, begin, c), lse.narrow(0, begin, c),
                      grad_loss.narrow(0, begin, c), softcap, fused, hidden.scalar_type());
      if (want_input) grad_hidden.narrow(0, begin, c).copy_(at::matmul(g.typed, weight_valid));
      if (!want_weight) continue;
      add_weight_grad(sink ? sink_rows(*sink, range.valid) : grad_weight.narrow(0, 0, range.valid), g, x, false);
    }
    if (want_weight && sink) {
      sink_rows(*sink, range.valid);  // no chunk ran (this rank holds only padding): the gradient is zero
      if (sink->on_accumulated) sink->on_accumulated();
    }
    return {want_input ? grad_hidden.view(hidden.sizes()) : at::Tensor(), grad_weight, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// The weighted sum Σ w·loss with the gradients made in the forward pass, chunk by chunk while each chunk's logits
// are at hand (for a loss weighted by w, the logits' gradient is w · (softmax − one-hot)); backward scales them by
// the sum's gradient. Output 0: the sum (0-dim fp32); output 1: the per-token loss, without gradient.
struct WeightedOutputCrossEntropy : torch::autograd::Function<WeightedOutputCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& targets, const at::Tensor& token_weights, const VocabRange& range,
                               const TpGroup& group, const OutputLossOptions& options, bool want_input,
                               bool want_weight) {
    const LossInputs in(hidden, targets, range);
    const bool fused = options.fused_kernels && supports(hidden);
    const at::Tensor w = token_weights.reshape({-1}).to(at::kFloat);
    // Every row's gradient is written by its chunk (zeros where this rank holds only padding rows).
    at::Tensor grad_rows;
    if (want_input)
      grad_rows = range.valid > 0 ? at::empty(in.rows.sizes(), in.rows.options())
                                  : at::zeros(in.rows.sizes(), in.rows.options());
    // The weight's gradient for this micro-batch alone, in the dtype of what it goes into (the main-grad buffer's
    // or the weight's): the sink's buffer may be read by the gradient reduction before this node's backward runs.
    at::Tensor grad_weight;
    if (want_weight && range.valid > 0)
      grad_weight = at::empty(
          {range.valid, hidden.size(-1)},
          weight.options().dtype(options.sink ? options.sink->main_grad.scalar_type() : weight.scalar_type()));
    const at::Tensor weight_valid = weight.narrow(0, 0, range.valid);
    at::Tensor lse, loss;
    forward_chunks(in, weight, range, group, options, fused, lse, loss,
                   [&](std::int64_t begin, std::int64_t c, const ChunkLogits& chunk) {
                     if (!want_input && !want_weight) return;
                     const LogitsGrad g = logits_grad(
                         chunk, in.local_target.narrow(0, begin, c), in.outside.narrow(0, begin, c),
                         lse.narrow(0, begin, c), w.narrow(0, begin, c), options.softcap, fused, hidden.scalar_type());
                     if (want_input) grad_rows.narrow(0, begin, c).copy_(at::matmul(g.typed, weight_valid));
                     if (want_weight) add_weight_grad(grad_weight, g, in.rows.narrow(0, begin, c), begin == 0);
                   });
    if (grad_weight.defined() && in.rows.size(0) == 0) grad_weight.zero_();
    ctx->save_for_backward({grad_rows, grad_weight, weight});
    ctx->saved_data["sink"] = pointer_value(options.sink);
    ctx->saved_data["hidden_sizes"] = hidden.sizes().vec();
    const at::Tensor sum = (loss * w).sum();
    const at::Tensor per_token = loss.view(targets.sizes());
    ctx->mark_non_differentiable({per_token});
    return {sum, per_token};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &grad_rows = saved[0], &grad_weight = saved[1], &weight = saved[2];
    auto* sink = from_value<WeightGradSink>(ctx->saved_data["sink"]);
    const at::Tensor scale = grad[0].to(at::kFloat);
    at::NoGradGuard no_grad;
    at::Tensor grad_hidden;
    if (ctx->needs_input_grad(0)) {
      const std::vector<std::int64_t> sizes = ctx->saved_data["hidden_sizes"].toIntVector();
      grad_hidden = (grad_rows * scale).view(sizes);  // a 0-dim scale keeps grad_rows' dtype
    }
    at::Tensor weight_grad;
    if (ctx->needs_input_grad(1)) {
      const std::int64_t valid = grad_weight.defined() ? grad_weight.size(0) : 0;
      if (sink) {
        at::Tensor main = sink_rows(*sink, valid);
        if (valid > 0) main.addcmul_(grad_weight, scale.to(main.scalar_type()));
        if (sink->on_accumulated) sink->on_accumulated();
      } else {
        weight_grad = at::zeros_like(weight);
        if (valid > 0) weight_grad.narrow(0, 0, valid).copy_(grad_weight * scale);
      }
    }
    return {grad_hidden,  weight_grad,  at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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

WeightedOutputLoss weighted_output_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& targets, const at::Tensor& token_weights,
                                                 const VocabRange& range, const TpGroup& group,
                                                 const OutputLossOptions& options) {
  TORCH_CHECK(options.chunk_tokens > 0, "weighted_output_cross_entropy: chunk_tokens must be positive");
  TORCH_CHECK(hidden.dim() == targets.dim() + 1 && weight.size(0) == range.rows,
              "weighted_output_cross_entropy: hidden [..., h], targets [...], weight [rows, h]");
  TORCH_CHECK(token_weights.sizes() == targets.sizes() && !token_weights.requires_grad(),
              "weighted_output_cross_entropy: the token weights must be targets' shape, without gradient");
  const bool grad = at::GradMode::is_enabled();
  const variable_list out =
      WeightedOutputCrossEntropy::apply(hidden, weight, targets, token_weights, range, group, options,
                                        grad && hidden.requires_grad(), grad && weight.requires_grad());
  return {out[0], out[1]};
}

}  // namespace trestle::train
