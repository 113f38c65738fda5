#include "parallel/layout/megatron_buffer_params.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

#include "parallel/layout/tp_split.h"

namespace trestle {
namespace {

// Where a layer's tensor comes in Megatron's registration order (relative to "decoder.layers.<i>."); -1: unknown. The
// input norm is a module of its own before the attention in the local spec, and part of linear_qkv (after linear_proj)
// in Transformer Engine's: `stored` says which the checkpoint's model had, whatever names `suffix` uses.
std::int64_t layer_order(std::string_view suffix, NormNaming stored) {
  if (suffix == "input_layernorm.weight" || suffix == "self_attention.linear_qkv.layer_norm_weight")
    return stored == NormNaming::kTransformerEngine ? 2 : 0;
  if (suffix == "pre_mlp_layernorm.weight" || suffix == "mlp.linear_fc1.layer_norm_weight") return 7;
  static constexpr std::pair<std::string_view, int> kFixed[] = {{"self_attention.linear_proj.weight", 1},
                                                                {"self_attention.linear_qkv.weight", 3},
                                                                {"self_attention.linear_qkv.bias", 4},
                                                                {"self_attention.q_layernorm.weight", 5},
                                                                {"self_attention.k_layernorm.weight", 6},
                                                                {"mlp.linear_fc1.weight", 9},
                                                                {"mlp.linear_fc2.weight", 10},
                                                                {"mlp.router.weight", 11}};
  for (const auto& [name, order] : kFixed)
    if (suffix == name) return order;
  constexpr std::string_view kExperts = "mlp.experts.local_experts.";
  constexpr std::int64_t kShared = std::int64_t{1} << 40;
  if (suffix.starts_with(kExperts)) {
    const std::string_view rest = suffix.substr(kExperts.size());
    const std::size_t dot = rest.find('.');
    if (dot == std::string_view::npos || dot == 0) return -1;
    std::int64_t expert = 0;
    for (char c : rest.substr(0, dot)) {
      if (c < '0' || c > '9') return -1;
      expert = expert * 10 + (c - '0');
    }
    if (rest.substr(dot + 1) == "linear_fc1.weight") return 12 + 2 * expert;
    if (rest.substr(dot + 1) == "linear_fc2.weight") return 13 + 2 * expert;
    return -1;
  }
  if (suffix == "mlp.shared_experts.gate_weight") return kShared;
  if (suffix == "mlp.shared_experts.linear_fc1.weight") return kShared + 1;
  if (suffix == "mlp.shared_experts.linear_fc2.weight") return kShared + 2;
  return -1;
}

}  // namespace

Result<std::vector<MegatronBufferParam>> megatron_buffer_params(const std::vector<const CanonicalTensor*>& tensors,
                                                                const ParallelLayout& layout, std::int64_t num_layers,
                                                                std::int64_t num_experts, bool tied_embeddings,
                                                                std::int64_t padded_vocab, NormNaming stored_norms,
                                                                const BufferOwner& owner, BufferKind kind) {
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, num_layers));
  if (owner.pp_rank < 0 || owner.pp_rank >= layout.pp || owner.tp_rank < 0 || owner.tp_rank >= layout.tp ||
      owner.ep_rank < 0 || owner.ep_rank >= layout.ep || owner.chunk < 0 ||
      owner.chunk >= static_cast<int>(stages[static_cast<std::size_t>(owner.pp_rank)].size()))
    return Status::Error("no model chunk " + std::to_string(owner.chunk) + " of tp rank " +
                         std::to_string(owner.tp_rank) + ", pp rank " + std::to_string(owner.pp_rank) + ", ep rank " +
                         std::to_string(owner.ep_rank) + " in the layout");
  const auto& chunks = stages[static_cast<std::size_t>(owner.pp_rank)];
  const LayerRange layers = chunks[static_cast<std::size_t>(owner.chunk)];
  const bool first = owner.pp_rank == 0 && owner.chunk == 0;
  const bool last = owner.pp_rank == layout.pp - 1 && owner.chunk + 1 == static_cast<int>(chunks.size());
  const LayerRange experts = experts_of_rank(layout, num_experts, owner.ep_rank);
  const bool split_embedding = tied_embeddings && layout.pp > 1;

  struct Ordered {
    std::int64_t layer, order;
    const CanonicalTensor* tensor;
  };
  std::vector<Ordered> held;
  const CanonicalTensor* embedding = nullptr;
  for (const CanonicalTensor* t : tensors) {
    if (t->name == "embedding.word_embeddings.weight") embedding = t;
    const bool expert = t->expert >= 0;
    if ((kind == BufferKind::kDense && expert) || (kind == BufferKind::kExperts && !expert)) continue;
    if (expert && (t->expert < experts.begin || t->expert >= experts.end)) continue;
    switch (t->placement) {
      case Placement::kFirstStage:
        if (first) held.push_back({-1, 0, t});
        break;
      case Placement::kLastStage:
        if (t->name.starts_with("mtp."))  // its place among Megatron-Core's buffers is not modelled
          return Status::Error("'" + t->name +
                               "': multi-token-prediction layers have no known place among Megatron-Core's "
                               "distributed-optimizer buffers (convert the model without its optimizer state)");
        if (last) held.push_back({num_layers, t->name == "output_layer.weight" ? 1 : 0, t});
        break;
      case Placement::kLayer: {
        if (t->layer < layers.begin || t->layer >= layers.end) break;
        const std::string prefix = "decoder.layers." + std::to_string(t->layer) + ".";
        const std::int64_t order = t->name.starts_with(prefix)
                                       ? layer_order(std::string_view(t->name).substr(prefix.size()), stored_norms)
                                       : -1;
        if (order < 0)
          return Status::Error("'" + t->name + "' has no known place among Megatron-Core's layer parameters");
        held.push_back({t->layer, order, t});
        break;
      }
    }
  }
  std::sort(held.begin(), held.end(), [](const Ordered& a, const Ordered& b) {
    return std::pair(a.layer, a.order) < std::pair(b.layer, b.order);
  });
  std::vector<MegatronBufferParam> params;
  for (const Ordered& o : held) {
    const CanonicalTensor& t = *o.tensor;
    MegatronBufferParam p;
    p.tensor = &t;
    TRESTLE_ASSIGN_OR_RETURN(p.boxes, tp_boxes(t.split, t.shape, layout.tp, owner.tp_rank, padded_vocab));
    if (t.split == TpSplit::kVocab) {
      p.numel = padded_vocab / layout.tp * (t.shape.size() > 1 ? t.shape[1] : 1);
    } else {
      for (const Box& b : p.boxes) p.numel += b.numel();
    }
    p.shared_embedding = split_embedding && &t == embedding;
    params.push_back(std::move(p));
  }
  // The last stage's copy of a tied embedding: an output_layer parameter of its own.
  if (split_embedding && last && kind != BufferKind::kExperts) {
    if (!embedding) return Status::Error("a tied model without embedding.word_embeddings.weight");
    MegatronBufferParam copy;
    copy.tensor = embedding;
    TRESTLE_ASSIGN_OR_RETURN(copy.boxes,
                             tp_boxes(embedding->split, embedding->shape, layout.tp, owner.tp_rank, padded_vocab));
    copy.numel = padded_vocab / layout.tp * (embedding->shape.size() > 1 ? embedding->shape[1] : 1);
    copy.shared_embedding = true;
    copy.tied_copy = true;
    params.push_back(std::move(copy));
  }
  return params;
}

Result<std::vector<MegatronOptimizerBuffer>> megatron_optimizer_buffers(
    const std::vector<const CanonicalTensor*>& tensors, const ParallelLayout& layout, std::int64_t num_layers,
    std::int64_t num_experts, bool tied_embeddings, std::int64_t padded_vocab, NormNaming stored_norms) {
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, num_layers));
  struct Chain {
    int chain;
    BufferKind kind;
  };
  std::vector<Chain> chains{{-1, BufferKind::kAll}};
  if (num_experts > 0 && layout.ep > 1) chains = {{0, BufferKind::kDense}, {1, BufferKind::kExperts}};
  std::vector<MegatronOptimizerBuffer> buffers;
  for (const Chain& chain : chains) {
    const bool experts = chain.kind == BufferKind::kExperts;
    const int groups = layout.tp * layout.pp * (experts ? layout.ep : 1);
    for (int group = 0; group < groups; ++group) {
      MegatronOptimizerBuffer buffer;
      buffer.chain = chain.chain;
      buffer.group = group;
      buffer.kind = chain.kind;
      buffer.dp = std::max(1, layout.dp() * layout.cp / (experts ? layout.ep : 1));
      buffer.owner.tp_rank = group % layout.tp;
      if (experts) {
        buffer.owner.ep_rank = group / layout.tp % layout.ep;
        buffer.owner.pp_rank = group / (layout.tp * layout.ep);
      } else {
        buffer.owner.pp_rank = group / layout.tp;
      }
      const int chunks = static_cast<int>(stages[static_cast<std::size_t>(buffer.owner.pp_rank)].size());
      for (buffer.owner.chunk = 0; buffer.owner.chunk < chunks; ++buffer.owner.chunk) {
        TRESTLE_ASSIGN_OR_RETURN(buffer.params,
                                 megatron_buffer_params(tensors, layout, num_layers, num_experts, tied_embeddings,
                                                        padded_vocab, stored_norms, buffer.owner, chain.kind));
        buffers.push_back(buffer);
      }
    }
  }
  return buffers;
}

std::string dp_reshardable_group_prefix(int chain, int group) {
  return (chain < 0 ? "" : "chained_" + std::to_string(chain) + ".") + "optimizer.distributed.dp_group_idx_" +
         std::to_string(group) + ".";
}

std::string dp_reshardable_bucket_key(int chain, int group, int chunk, std::string_view dtypes, std::int64_t bucket) {
  return dp_reshardable_group_prefix(chain, group) + "gbuf_idx_" + std::to_string(chunk) + ".dtype_" +
         std::string(dtypes) + ".bucket_idx_" + std::to_string(bucket);
}

}  // namespace trestle
