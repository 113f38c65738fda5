#include "train/model/blockwise_attention.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

// The shapes every block shares: b batches of g groups of r query heads each, s positions.
struct Shape {
  std::int64_t b, g, r, s;
  Shape(const at::Tensor& q, const at::Tensor& k)
      : b(q.size(0)), g(k.size(1)), r(q.size(1) / k.size(1)), s(q.size(2)) {}
};

// A block of queries: rows [start, start + rows), scored against keys [key_begin, key_end).
struct Block {
  std::int64_t start, rows, key_begin, key_end;
  std::int64_t keys() const { return key_end - key_begin; }
};

// Rows [start, start + rows) of x [b, g · r, s, e] as [b, g, rows · r, e]: a group's query heads one position after
// another, so that each group's block is one matrix against its keys.
at::Tensor rows_of(const at::Tensor& x, const Shape& shape, const Block& block) {
  return x.view({shape.b, shape.g, shape.r, shape.s, x.size(3)})
      .narrow(3, block.start, block.rows)
      .transpose(2, 3)
      .reshape({shape.b, shape.g, block.rows * shape.r, x.size(3)});
}

// rows_of's inverse: `rows` [b, g, rows · r, e] written into x [b, g · r, s, e] (contiguous).
void put_rows(at::Tensor& x, const at::Tensor& rows, const Shape& shape, const Block& block) {
  x.view({shape.b, shape.g, shape.r, shape.s, x.size(3)})
      .narrow(3, block.start, block.rows)
      .copy_(rows.view({shape.b, shape.g, block.rows, shape.r, x.size(3)}).transpose(2, 3));
}

// The softmax's and the sums' dtype: fp32, or double for double inputs.
at::ScalarType wide(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The block's keys or values [b, g, keys, e].
at::Tensor keys_of(const at::Tensor& t, const Block& block) { return t.narrow(2, block.key_begin, block.keys()); }

std::vector<Block> blocks_of(const Shape& shape, std::int64_t window, std::int64_t block_scores) {
  const std::int64_t per_row = shape.b * shape.g * shape.r * shape.s;
  const std::int64_t rows = std::max<std::int64_t>(1, block_scores / std::max<std::int64_t>(per_row, 1));
  std::vector<Block> blocks;
  for (std::int64_t start = 0; start < shape.s; start += rows) {
    Block block{start, std::min(rows, shape.s - start), 0, 0};
    block.key_end = block.start + block.rows;
    block.key_begin = window > 0 ? std::max<std::int64_t>(0, block.start - window + 1) : 0;
    blocks.push_back(block);
  }
  return blocks;
}

// The block's hidden keys as a mask over its scores viewed [b, g, rows, r, keys].
at::Tensor hidden_keys(const std::optional<at::Tensor>& allowed, const Block& block, const at::Device& device) {
  if (allowed) {
    return allowed->narrow(-2, block.start, block.rows)
        .narrow(-1, block.key_begin, block.keys())
        .logical_not()
        .unsqueeze(-2);
  }
  const auto positions = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor query = at::arange(block.start, block.start + block.rows, positions).view({-1, 1, 1});
  const at::Tensor key = at::arange(block.key_begin, block.key_end, positions).view({1, 1, -1});
  return key > query;
}

// A block's softmax inputs: the scaled (and capped) scores, fp32 [b, g, rows · r, keys], hidden keys at -inf;
// `capped` gets tanh(score / cap).
at::Tensor block_scores(const at::Tensor& q_rows, const at::Tensor& k, const Shape& shape, const Block& block,
                        const ScoresAttention& o, at::Tensor* capped) {
  at::Tensor scores = at::matmul(q_rows, keys_of(k, block).transpose(-2, -1)).to(wide(q_rows)).mul_(o.scale);
  if (o.softcap > 0) {
    at::Tensor t = scores.div_(o.softcap).tanh_();
    if (capped) *capped = t.clone();
    scores = t.mul_(o.softcap);
  }
  scores.view({shape.b, shape.g, block.rows, shape.r, block.keys()})
      .masked_fill_(hidden_keys(o.allowed, block, scores.device()), kMinusInfinity);
  return scores;
}

// The sinks as [1, g, 1, r] in `type`, against a block's rows viewed [b, g, rows, r].
at::Tensor sink_rows(const at::Tensor& sinks, const Shape& shape, at::ScalarType type) {
  return sinks.to(type).view({1, shape.g, 1, shape.r});
}

// -inf (a query that sees nothing and has no sink) as 0, so that its weights exp(-inf - 0) are 0.
at::Tensor finite_lse(const at::Tensor& lse) { return lse.masked_fill(at::isinf(lse), 0.0); }

// What backward takes from forward beyond the tensors: the options without their tensors.
void save_options(AutogradContext* ctx, const ScoresAttention& o) {
  ctx->saved_data["scale"] = o.scale;
  ctx->saved_data["softcap"] = o.softcap;
  ctx->saved_data["window"] = o.window;
  ctx->saved_data["block_scores"] = o.block_scores;
  if (o.allowed) ctx->saved_data["allowed"] = *o.allowed;
}

ScoresAttention saved_options(AutogradContext* ctx, const at::Tensor& sinks) {
  ScoresAttention o;
  o.scale = ctx->saved_data["scale"].toDouble();
  o.softcap = ctx->saved_data["softcap"].toDouble();
  o.window = ctx->saved_data["window"].toInt();
  o.block_scores = ctx->saved_data["block_scores"].toInt();
  if (ctx->saved_data.count("allowed")) o.allowed = ctx->saved_data["allowed"].toTensor();
  o.sinks = sinks;
  return o;
}

struct BlockwiseAttention : torch::autograd::Function<BlockwiseAttention> {
  // `given_sinks` empty: none.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& given_sinks, const ScoresAttention& o) {
    const at::Tensor sinks = given_sinks.numel() > 0 ? given_sinks : at::Tensor();
    const Shape shape(q, k);
    at::Tensor out = at::empty({shape.b, q.size(1), shape.s, v.size(3)}, v.options());
    at::Tensor lse = at::empty({shape.b, shape.g, shape.s * shape.r}, q.options().dtype(wide(q)));
    for (const Block& block : blocks_of(shape, o.window, o.block_scores)) {
      at::Tensor scores = block_scores(rows_of(q, shape, block), k, shape, block, o, nullptr);
      at::Tensor block_lse = at::logsumexp(scores, -1);
      if (sinks.defined()) {
        const at::Tensor by_head = block_lse.view({shape.b, shape.g, block.rows, shape.r});
        block_lse = at::logaddexp(by_head, sink_rows(sinks, shape, lse.scalar_type())).view_as(block_lse);
      }
      lse.narrow(2, block.start * shape.r, block.rows * shape.r).copy_(block_lse);
      const at::Tensor weights = scores.sub_(finite_lse(block_lse).unsqueeze(-1)).exp_();
      put_rows(out, at::matmul(weights.to(v.scalar_type()), keys_of(v, block)), shape, block);
    }
    save_options(ctx, o);
    ctx->save_for_backward({q, k, v, given_sinks, out, lse});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[4], &lse = saved[5];
    const at::Tensor sinks = saved[3].numel() > 0 ? saved[3] : at::Tensor();
    const ScoresAttention o = saved_options(ctx, sinks);
    const at::Tensor grad_out = grad[0].contiguous();
    const Shape shape(q, k);
    at::Tensor grad_q = at::empty({shape.b, q.size(1), shape.s, q.size(3)}, q.options());
    at::Tensor grad_k = at::zeros(k.sizes(), k.options().dtype(wide(k)));
    at::Tensor grad_v = at::zeros(v.sizes(), v.options().dtype(wide(v)));
    at::Tensor grad_sinks = sinks.defined() ? at::zeros({shape.g, shape.r}, lse.options()) : at::Tensor();
    for (const Block& block : blocks_of(shape, o.window, o.block_scores)) {
      const at::Tensor q_rows = rows_of(q, shape, block);
      at::Tensor capped;
      at::Tensor scores = block_scores(q_rows, k, shape, block, o, &capped);
      const at::Tensor block_lse = finite_lse(lse.narrow(2, block.start * shape.r, block.rows * shape.r));
      const at::Tensor weights = scores.sub_(block_lse.unsqueeze(-1)).exp_();
      const at::Tensor grad_rows = rows_of(grad_out, shape, block);
      // Σ_j p_j dp_j = the output's row · its gradient's (the softmax's backward, with a sink's term as any key's).
      const at::Tensor row_dot = (grad_rows.to(wide(q)) * rows_of(out, shape, block).to(wide(q))).sum(-1);
      keys_of(grad_v, block).add_(at::matmul(weights.to(v.scalar_type()).transpose(-2, -1), grad_rows));
      at::Tensor grad_scores = at::matmul(grad_rows, keys_of(v, block).transpose(-2, -1)).to(wide(q));
      grad_scores.sub_(row_dot.unsqueeze(-1)).mul_(weights);
      if (o.softcap > 0) grad_scores.mul_(capped.square_().neg_().add_(1.0));
      grad_scores.mul_(o.scale);
      const at::Tensor typed = grad_scores.to(q.scalar_type());
      put_rows(grad_q, at::matmul(typed, keys_of(k, block)), shape, block);
      keys_of(grad_k, block).add_(at::matmul(typed.transpose(-2, -1), q_rows));
      if (sinks.defined()) {  // the sink's weight exp(sink - lse) times (0 - row_dot), over batches and rows
        const at::Tensor sink_weight =
            (sink_rows(sinks, shape, lse.scalar_type()) - block_lse.view({shape.b, shape.g, block.rows, shape.r}))
                .exp();
        grad_sinks.sub_((sink_weight * row_dot.view_as(sink_weight)).sum({0, 2}));
      }
    }
    return {grad_q, grad_k.to(k.scalar_type()), grad_v.to(v.scalar_type()),
            sinks.defined() ? grad_sinks.view(sinks.sizes()).to(sinks.scalar_type()) : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ScoresAttention& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "blockwise attention takes [b, heads, s, d] tensors, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0 && v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "blockwise attention: keys ", k.sizes(), " and values ", v.sizes(), " do not serve queries ", q.sizes(),
              " (keys [b, groups, s, d] with groups dividing the heads, values [b, groups, s, dv])");
  TORCH_CHECK(!options.sinks.defined() || options.sinks.numel() == q.size(1),
              "blockwise attention: ", options.sinks.numel(), " sinks for ", q.size(1), " heads");
  if (options.allowed) {
    const at::Tensor& a = *options.allowed;
    TORCH_CHECK(a.scalar_type() == at::kBool && a.size(-1) == q.size(2) && a.size(-2) == q.size(2) &&
                    (a.dim() == 2 || (a.dim() == 4 && a.size(1) == 1 && (a.size(0) == 1 || a.size(0) == q.size(0)))),
                "blockwise attention: the mask must be bool [s, s] or [b, 1, s, s] for s = ", q.size(2), ", got ",
                a.scalar_type(), " ", a.sizes());
  }
  ScoresAttention o = options;
  if (o.block_scores <= 0) o.block_scores = q.is_cuda() ? std::int64_t{1} << 26 : std::int64_t{1} << 21;
  // autograd's functions take no undefined tensor: no sinks as an empty one.
  const at::Tensor sinks = options.sinks.defined() ? options.sinks : at::empty({0}, q.options().dtype(at::kFloat));
  return BlockwiseAttention::apply(q, k, v, sinks, o);
}

}  // namespace trestle::train
