#include "train/model/blockwise_attention.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

#include "kernels/grouped_attention.h"

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

// The shapes every block shares: b batches of g groups of r query heads each, sq queries, sk keys.
struct Shape {
  std::int64_t b, g, r, sq, sk;
  Shape(const at::Tensor& q, const at::Tensor& k)
      : b(q.size(0)), g(k.size(1)), r(q.size(1) / k.size(1)), sq(q.size(2)), sk(k.size(2)) {}
};

// A block of queries: rows [start, start + rows), scored against keys [key_begin, key_end).
struct Block {
  std::int64_t start, rows, key_begin, key_end;
  std::int64_t keys() const { return key_end - key_begin; }
};

// Which keys each query sees, as blockwise_attention's options say, ready for the blocks: the positions' host copies
// (for each block's range of keys) and device copies (for its mask); undefined: the indices.
struct Visibility {
  at::Tensor q_host, k_host, q_pos, k_pos, q_doc, k_doc;
  std::optional<at::Tensor> allowed;
  std::int64_t window = 0;
};

// Rows [start, start + rows) of x [b, g · r, s, e] as [b, g, rows · r, e]: a group's query heads one position after
// another, so that each group's block is one matrix against its keys.
at::Tensor rows_of(const at::Tensor& x, const Shape& shape, const Block& block) {
  return x.view({shape.b, shape.g, shape.r, x.size(2), x.size(3)})
      .narrow(3, block.start, block.rows)
      .transpose(2, 3)
      .reshape({shape.b, shape.g, block.rows * shape.r, x.size(3)});
}

// rows_of's inverse: `rows` [b, g, rows · r, e] written into x [b, g · r, s, e] (contiguous).
void put_rows(at::Tensor& x, const at::Tensor& rows, const Shape& shape, const Block& block) {
  x.view({shape.b, shape.g, shape.r, x.size(2), x.size(3)})
      .narrow(3, block.start, block.rows)
      .copy_(rows.view({shape.b, shape.g, block.rows, shape.r, x.size(3)}).transpose(2, 3));
}

// The log-sum-exps as the blocks hold them, [b, g, sq · r], to and from [b, heads, sq].
at::Tensor lse_by_head(const at::Tensor& lse, const Shape& shape) {
  return lse.view({shape.b, shape.g, shape.sq, shape.r})
      .transpose(2, 3)
      .reshape({shape.b, shape.g * shape.r, shape.sq});
}
at::Tensor lse_by_row(const at::Tensor& lse, const Shape& shape) {
  return lse.view({shape.b, shape.g, shape.r, shape.sq})
      .transpose(2, 3)
      .reshape({shape.b, shape.g, shape.sq * shape.r});
}

// The softmax's and the sums' dtype: fp32, or double for double inputs.
at::ScalarType wide(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The block's keys or values [b, g, keys, e].
at::Tensor keys_of(const at::Tensor& t, const Block& block) { return t.narrow(2, block.key_begin, block.keys()); }

// The blocks of queries, each with the keys its queries may see: none after its last query's position, none `window`
// or more before its first's.
std::vector<Block> blocks_of(const Shape& shape, const Visibility& see, std::int64_t block_scores) {
  const std::int64_t per_row = shape.b * shape.g * shape.r * shape.sk;
  const std::int64_t rows = std::max<std::int64_t>(1, block_scores / std::max<std::int64_t>(per_row, 1));
  const std::int64_t* q_pos = see.q_host.defined() ? see.q_host.const_data_ptr<std::int64_t>() : nullptr;
  const std::int64_t* k_pos = see.k_host.defined() ? see.k_host.const_data_ptr<std::int64_t>() : nullptr;
  auto keys_up_to = [&](std::int64_t position) {  // keys at positions <= position
    if (!k_pos) return std::clamp<std::int64_t>(position + 1, 0, shape.sk);
    return static_cast<std::int64_t>(std::upper_bound(k_pos, k_pos + shape.sk, position) - k_pos);
  };
  std::vector<Block> blocks;
  for (std::int64_t start = 0; start < shape.sq; start += rows) {
    Block block{start, std::min(rows, shape.sq - start), 0, 0};
    std::int64_t first = start, last = start + block.rows - 1;
    if (q_pos) {
      first = *std::min_element(q_pos + start, q_pos + start + block.rows);
      last = *std::max_element(q_pos + start, q_pos + start + block.rows);
    }
    block.key_end = keys_up_to(last);
    block.key_begin = see.window > 0 ? std::min(block.key_end, keys_up_to(first - see.window)) : 0;
    blocks.push_back(block);
  }
  return blocks;
}

// The block's hidden keys as a mask over its scores viewed [b, g, rows, r, keys].
at::Tensor hidden_keys(const Visibility& see, const Shape& shape, const Block& block, const at::Device& device) {
  const auto positions = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor query = (see.q_pos.defined() ? see.q_pos.narrow(0, block.start, block.rows)
                                                : at::arange(block.start, block.start + block.rows, positions))
                               .view({-1, 1, 1});
  const at::Tensor key = (see.k_pos.defined() ? see.k_pos.narrow(0, block.key_begin, block.keys())
                                              : at::arange(block.key_begin, block.key_end, positions))
                             .view({1, 1, -1});
  at::Tensor hidden = key > query;
  if (see.window > 0) hidden = hidden | (query - key >= see.window);
  if (see.allowed) {
    hidden = hidden | see.allowed->narrow(-2, block.start, block.rows)
                          .narrow(-1, block.key_begin, block.keys())
                          .logical_not()
                          .unsqueeze(-2);
  }
  if (see.q_doc.defined()) {
    hidden = hidden | (see.q_doc.narrow(1, block.start, block.rows).view({shape.b, 1, block.rows, 1, 1}) !=
                       see.k_doc.narrow(1, block.key_begin, block.keys()).view({shape.b, 1, 1, 1, block.keys()}));
  }
  return hidden;
}

// The options backward needs again, with the visibility prepared.
struct Prepared {
  double scale, softcap;
  std::int64_t block_scores;
  Visibility see;
};

// A block's softmax inputs: the scaled (and capped) scores, fp32 [b, g, rows · r, keys], hidden keys at -inf;
// `capped` gets tanh(score / cap).
at::Tensor block_scores(const at::Tensor& q_rows, const at::Tensor& k, const Shape& shape, const Block& block,
                        const Prepared& o, at::Tensor* capped) {
  at::Tensor scores = at::matmul(q_rows, keys_of(k, block).transpose(-2, -1)).to(wide(q_rows)).mul_(o.scale);
  if (o.softcap > 0) {
    at::Tensor t = scores.div_(o.softcap).tanh_();
    if (capped) *capped = t.clone();
    scores = t.mul_(o.softcap);
  }
  scores.view({shape.b, shape.g, block.rows, shape.r, block.keys()})
      .masked_fill_(hidden_keys(o.see, shape, block, scores.device()), kMinusInfinity);
  return scores;
}

// The sinks as [1, g, 1, r] in `type`, against a block's rows viewed [b, g, rows, r].
at::Tensor sink_rows(const at::Tensor& sinks, const Shape& shape, at::ScalarType type) {
  return sinks.to(type).view({1, shape.g, 1, shape.r});
}

// -inf (a query that sees nothing and has no sink) as 0, so that its weights exp(-inf - 0) are 0.
at::Tensor finite_lse(const at::Tensor& lse) { return lse.masked_fill(at::isinf(lse), 0.0); }

void save_prepared(AutogradContext* ctx, const Prepared& o) {
  ctx->saved_data["scale"] = o.scale;
  ctx->saved_data["softcap"] = o.softcap;
  ctx->saved_data["block_scores"] = o.block_scores;
  ctx->saved_data["window"] = o.see.window;
  for (const auto& [name, t] :
       {std::pair{"q_host", o.see.q_host}, std::pair{"k_host", o.see.k_host}, std::pair{"q_pos", o.see.q_pos},
        std::pair{"k_pos", o.see.k_pos}, std::pair{"q_doc", o.see.q_doc}, std::pair{"k_doc", o.see.k_doc}})
    if (t.defined()) ctx->saved_data[name] = t;
  if (o.see.allowed) ctx->saved_data["allowed"] = *o.see.allowed;
}

Prepared saved_prepared(AutogradContext* ctx) {
  Prepared o;
  o.scale = ctx->saved_data["scale"].toDouble();
  o.softcap = ctx->saved_data["softcap"].toDouble();
  o.block_scores = ctx->saved_data["block_scores"].toInt();
  o.see.window = ctx->saved_data["window"].toInt();
  auto tensor = [&](const char* name) {
    return ctx->saved_data.count(name) ? ctx->saved_data[name].toTensor() : at::Tensor();
  };
  o.see.q_host = tensor("q_host");
  o.see.k_host = tensor("k_host");
  o.see.q_pos = tensor("q_pos");
  o.see.k_pos = tensor("k_pos");
  o.see.q_doc = tensor("q_doc");
  o.see.k_doc = tensor("k_doc");
  if (ctx->saved_data.count("allowed")) o.see.allowed = ctx->saved_data["allowed"].toTensor();
  return o;
}

struct BlockwiseAttention : torch::autograd::Function<BlockwiseAttention> {
  // {out [b, heads, sq, dv], lse [b, heads, sq]}; `given_sinks` empty: none.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& given_sinks, const Prepared& o) {
    const at::Tensor sinks = given_sinks.numel() > 0 ? given_sinks : at::Tensor();
    const Shape shape(q, k);
    at::Tensor out = at::empty({shape.b, q.size(1), shape.sq, v.size(3)}, v.options());
    at::Tensor lse = at::empty({shape.b, shape.g, shape.sq * shape.r}, q.options().dtype(wide(q)));
    for (const Block& block : blocks_of(shape, o.see, o.block_scores)) {
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
    save_prepared(ctx, o);
    ctx->save_for_backward({q, k, v, given_sinks, out, lse});
    return {out, lse_by_head(lse, shape)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[4], &lse = saved[5];
    const at::Tensor sinks = saved[3].numel() > 0 ? saved[3] : at::Tensor();
    const Prepared o = saved_prepared(ctx);
    const Shape shape(q, k);
    const at::Tensor grad_out = grad[0].defined() ? grad[0].contiguous() : at::zeros_like(out);
    const at::Tensor grad_lse = grad[1].defined() ? lse_by_row(grad[1].to(lse.scalar_type()), shape) : at::Tensor();
    at::Tensor grad_q = at::empty({shape.b, q.size(1), shape.sq, q.size(3)}, q.options());
    at::Tensor grad_k = at::zeros(k.sizes(), k.options().dtype(wide(k)));
    at::Tensor grad_v = at::zeros(v.sizes(), v.options().dtype(wide(v)));
    at::Tensor grad_sinks = sinks.defined() ? at::zeros({shape.g, shape.r}, lse.options()) : at::Tensor();
    for (const Block& block : blocks_of(shape, o.see, o.block_scores)) {
      const at::Tensor q_rows = rows_of(q, shape, block);
      at::Tensor capped;
      at::Tensor scores = block_scores(q_rows, k, shape, block, o, &capped);
      const std::int64_t first = block.start * shape.r, count = block.rows * shape.r;
      const at::Tensor block_lse = finite_lse(lse.narrow(2, first, count));
      const at::Tensor weights = scores.sub_(block_lse.unsqueeze(-1)).exp_();
      const at::Tensor grad_rows = rows_of(grad_out, shape, block);
      // The softmax's backward: a score's gradient is p_j (dp_j - Σ_i p_i dp_i + the log-sum-exp's gradient), where
      // Σ_i p_i dp_i is the output's row times its gradient's (a sink's term as any key's).
      at::Tensor row_dot = (grad_rows.to(wide(q)) * rows_of(out, shape, block).to(wide(q))).sum(-1);
      if (grad_lse.defined()) row_dot = row_dot - grad_lse.narrow(2, first, count);
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
        grad_sinks.sub_((sink_weight * row_dot.view_as(sink_weight)).sum(at::IntArrayRef{0, 2}));
      }
    }
    return {grad_q, grad_k.to(k.scalar_type()), grad_v.to(v.scalar_type()),
            sinks.defined() ? grad_sinks.view(sinks.sizes()).to(sinks.scalar_type()) : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

AttentionPartial blockwise_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const ScoresAttention& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "blockwise attention takes [b, heads, s, d] tensors, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                  v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "blockwise attention: keys ", k.sizes(), " and values ", v.sizes(), " do not serve queries ", q.sizes(),
              " (keys [b, groups, sk, d] with groups dividing the heads, values [b, groups, sk, dv])");
  const std::int64_t sq = q.size(2), sk = k.size(2);
  TORCH_CHECK(!options.sinks.defined() || options.sinks.numel() == q.size(1),
              "blockwise attention: ", options.sinks.numel(), " sinks for ", q.size(1), " heads");
  Prepared o{options.scale, options.softcap, options.block_scores, {}};
  if (o.block_scores <= 0) o.block_scores = q.is_cuda() ? std::int64_t{1} << 26 : std::int64_t{1} << 21;
  Visibility& see = o.see;
  see.window = options.window;
  TORCH_CHECK(options.q_positions.defined() == options.k_positions.defined(),
              "blockwise attention: positions for both the queries and the keys, or for neither");
  if (options.q_positions.defined()) {
    TORCH_CHECK(options.q_positions.numel() == sq && options.k_positions.numel() == sk &&
                    options.q_positions.scalar_type() == at::kLong && options.k_positions.scalar_type() == at::kLong,
                "blockwise attention: positions must be int64 [", sq, "] and [", sk, "], got ",
                options.q_positions.sizes(), " and ", options.k_positions.sizes());
    see.q_host = options.q_positions.to(at::kCPU).contiguous();
    see.k_host = options.k_positions.to(at::kCPU).contiguous();
    const std::int64_t* keys = see.k_host.const_data_ptr<std::int64_t>();
    TORCH_CHECK(std::is_sorted(keys, keys + sk), "blockwise attention: the keys' positions must not decrease");
    see.q_pos = options.q_positions.to(q.device());
    see.k_pos = options.k_positions.to(q.device());
  } else {
    TORCH_CHECK(sq == sk, "blockwise attention: ", sq, " queries over ", sk, " keys need their positions");
  }
  TORCH_CHECK(options.q_documents.defined() == options.k_documents.defined(),
              "blockwise attention: documents for both the queries and the keys, or for neither");
  if (options.q_documents.defined()) {
    TORCH_CHECK(options.q_documents.sizes() == at::IntArrayRef({q.size(0), sq}) &&
                    options.k_documents.sizes() == at::IntArrayRef({q.size(0), sk}),
                "blockwise attention: documents must be [", q.size(0), ", ", sq, "] and [", q.size(0), ", ", sk,
                "], got ", options.q_documents.sizes(), " and ", options.k_documents.sizes());
    see.q_doc = options.q_documents.to(q.device());
    see.k_doc = options.k_documents.to(q.device());
  }
  if (options.allowed) {
    const at::Tensor& a = *options.allowed;
    TORCH_CHECK(a.scalar_type() == at::kBool && a.dim() >= 2 && a.size(-2) == sq && a.size(-1) == sk &&
                    (a.dim() == 2 || (a.dim() == 4 && a.size(1) == 1 && (a.size(0) == 1 || a.size(0) == q.size(0)))),
                "blockwise attention: the mask must be bool [", sq, ", ", sk, "] or [b, 1, ", sq, ", ", sk, "], got ",
                a.scalar_type(), " ", a.sizes());
    see.allowed = a;
  }
  // autograd's functions take no undefined tensor: no sinks as an empty one.
  const at::Tensor sinks = options.sinks.defined() ? options.sinks : at::empty({0}, q.options().dtype(at::kFloat));
  const variable_list result = BlockwiseAttention::apply(q, k, v, sinks, o);
  return {result[0], result[1]};
}

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ScoresAttention& options) {
  return blockwise_attention_with_lse(q, k, v, options).out;
}

at::Tensor whole_matrix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const ScoresAttention& o) {
  TORCH_CHECK(
      !o.q_positions.defined() && !o.k_positions.defined() && !o.q_documents.defined() && !o.k_documents.defined(),
      "whole-matrix attention: no positions or documents (its mask is causal, the window's and `allowed`)");
  const std::int64_t heads = q.size(1), seq = q.size(2);
  at::Tensor scores = at::matmul(q, kernels::expand_groups(k, heads).transpose(-2, -1)) * o.scale;
  if (o.softcap > 0) scores = at::tanh(scores / o.softcap) * o.softcap;
  const at::Tensor i = at::arange(seq, q.options().dtype(at::kLong)).unsqueeze(1), j = i.transpose(0, 1);
  at::Tensor allowed = j <= i;
  if (o.window > 0) allowed = allowed & (i - j < o.window);
  if (o.allowed) allowed = allowed & *o.allowed;
  scores = scores.masked_fill(allowed.logical_not(), kMinusInfinity);
  const at::Tensor values = kernels::expand_groups(v, heads);
  if (!o.sinks.defined()) return at::matmul(at::softmax(scores, -1, at::kFloat).to(q.scalar_type()), values);
  const at::Tensor sink = o.sinks.to(scores.scalar_type()).view({1, -1, 1, 1}).expand({q.size(0), -1, seq, 1});
  const at::Tensor probs = at::softmax(at::cat({scores, sink}, -1), -1, at::kFloat).narrow(-1, 0, seq);
  return at::matmul(probs.to(q.scalar_type()), values);
}

}  // namespace trestle::train
