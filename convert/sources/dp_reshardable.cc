#include "convert/sources/dp_reshardable.h"

#include <algorithm>
#include <cstring>
#include <regex>
#include <tuple>

#include "convert/bridge/megatron_dist_names.h"
#include "convert/bridge/megatron_grad_scaler.h"
#include "parallel/layout/grad_buffer_layout.h"
#include "parallel/layout/megatron_buffer_params.h"

namespace trestle {
namespace {

// The three states of each parameter, under Megatron's and Trestle's names ('param': the fp32 main parameter).
constexpr std::pair<const char*, const char*> kStates[] = {
    {"param", "fp32_param"}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}};

struct Bucket {
  std::map<std::string, const DcpTensor*> states;
};
struct Buffer {
  std::string dtype;
  std::map<int, Bucket> buckets;
};
using BufferId = std::tuple<int, int, int>;  // chain (-1: none), dp_group_idx, gbuf_idx

// Adam's step from an optimizer object ({'param_groups': [{..., 'step': n}, ...]}, possibly in a one-element list).
std::optional<std::int64_t> param_group_step(const PickleValue* root) {
  if (root && root->is_sequence() && root->items.size() == 1) root = root->items[0];
  const PickleValue* groups = root ? root->get("param_groups") : nullptr;
  if (!groups || !groups->is_sequence() || groups->items.empty()) return std::nullopt;
  const PickleValue* step = groups->items[0]->get("step");
  if (step && step->is(PickleKind::kInt)) return step->integer;
  if (step && step->is(PickleKind::kFloat) && std::isfinite(step->real) && step->real >= 0 && step->real < 9e18)
    return static_cast<std::int64_t>(std::llround(step->real));
  return std::nullopt;
}

}  // namespace

Result<DpReshardableState> locate_dp_reshardable_state(const DcpCheckpoint& ckpt, const BridgedModel& model,
                                                       const std::vector<const CanonicalTensor*>& tensors,
                                                       std::int64_t padded_vocab,
                                                       const MegatronModuleSpec& module_spec) {
  static const std::regex kBucketKey(
      R"(^(chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_(\d{1,6})\.gbuf_idx_(\d{1,4})\.dtype_(.+)\.bucket_idx_(\d{1,6})\.(param|exp_avg|exp_avg_sq)$)");
  static const std::regex kObjectKey(
      R"(^(chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_(\d{1,6})\.(optimizer|per_bucket_numel|per_bucket_numel_unpadded|grad_scaler)(/.*)?$)");
  const std::string dir = ckpt.directory();
  DpReshardableState state;
  std::map<BufferId, Buffer> buffers;
  std::set<int> chains;
  // Names come from the file: only plausible ones go to std::regex (whose matcher recurses per character).
  auto plausible = [](const std::string& name) {
    return name.size() <= 512 && (name.starts_with("optimizer.distributed.") || name.starts_with("chained_"));
  };
  for (const DcpTensor& t : ckpt.metadata().tensors) {
    std::smatch m;
    if (!plausible(t.name) || !std::regex_match(t.name, m, kBucketKey)) continue;
    const int chain = m[2].matched ? std::stoi(m[2]) : -1;
    Buffer& buffer = buffers[{chain, std::stoi(m[3]), std::stoi(m[4])}];
    if (!buffer.dtype.empty() && buffer.dtype != m[5].str())
      return Status::Error(dir + ": the distributed optimizer's buffer of '" + t.name +
                           "' holds several dtypes; Megatron-Core keeps one per buffer");
    buffer.dtype = m[5];
    if (t.shape.size() != 1)
      return Status::Error(dir + ": distributed optimizer entry '" + t.name + "' has shape " + to_string(t.shape) +
                           ", expected a flat bucket");
    buffer.buckets[std::stoi(m[6])].states[m[7]] = &t;
    chains.insert(chain);
    state.entries.insert(t.name);
  }
  const DcpBytesItem* step_item = nullptr;
  const DcpBytesItem* scaler_item = nullptr;  // an fp16 model's loss scaler (every group holds the same)
  for (const DcpBytesItem& item : ckpt.metadata().bytes) {
    std::smatch m;
    if (!plausible(item.name) || !std::regex_match(item.name, m, kObjectKey)) continue;
    state.entries.insert(item.name);
    if (m[4] == "optimizer" && (!m[2].matched || m[2] == "0") && m[3] == "0") step_item = &item;
    if (m[4] == "grad_scaler" && (!m[2].matched || m[2] == "0") && m[3] == "0") scaler_item = &item;
  }
  if (buffers.empty()) return DpReshardableState{};  // no flat buffers: nothing here is accounted for

  const ParallelLayout& layout = model.layout;
  const bool moe = model.model.is_moe();
  if (moe && module_spec.grouped_gemm)
    return Status::Error(dir +
                         ": the distributed optimizer's flat buffers of grouped-GEMM experts "
                         "(args.moe_grouped_gemm) are not mapped: their parameters are ordered and shaped otherwise; "
                         "pass --model-only to read the weights without the optimizer state");
  const std::int64_t experts = moe ? model.model.hf.num_experts : 0;
  // The sizes come from the checkpoint's args: they must fit the model before any loop runs over them.
  if (Status s = check_layout(layout, model.model.hf.num_layers, model.model.hf.num_query_groups(), experts); !s.ok())
    return Status::Error(dir + ": the layout in its args does not fit the model: " + s.message());
  TRESTLE_ASSIGN_OR_RETURN(const auto expected,
                           megatron_optimizer_buffers(tensors, layout, model.model.hf.num_layers, experts,
                                                      model.model.tied(), padded_vocab, module_spec.norms));
  std::set<int> expected_chains;
  for (const auto& b : expected) expected_chains.insert(b.chain);
  if (chains != expected_chains)
    return Status::Error(dir + ": the distributed optimizer's state comes in " + std::to_string(chains.size()) +
                         " chained optimizer(s); expected " + std::to_string(expected_chains.size()) +
                         " (with expert parallelism a dense and an expert one, else one) for this model's layout (ep " +
                         std::to_string(layout.ep) + ")");
  for (const MegatronOptimizerBuffer& expect : expected) {
    const BufferOwner& owner = expect.owner;
    const auto found = buffers.find({expect.chain, expect.group, owner.chunk});
    const std::string where = dp_reshardable_bucket_key(expect.chain, expect.group, owner.chunk, "...", 0);
    if (found == buffers.end())
      return Status::Error(dir + ": no distributed optimizer state for model chunk " + std::to_string(owner.chunk) +
                           " of tp rank " + std::to_string(owner.tp_rank) + ", pp rank " +
                           std::to_string(owner.pp_rank) +
                           (expect.kind == BufferKind::kExperts ? ", ep rank " + std::to_string(owner.ep_rank) : "") +
                           " (expected '" + where + "')");
    const Buffer& buffer = found->second;
    std::vector<std::int64_t> sizes;
    for (const auto& [index, bucket] : buffer.buckets) {
      const std::string key = dp_reshardable_bucket_key(expect.chain, expect.group, owner.chunk, buffer.dtype, index);
      if (index != static_cast<int>(sizes.size()))
        return Status::Error(dir + ": distributed optimizer bucket '" + key + "' follows bucket " +
                             std::to_string(sizes.size() - 1) + " (buckets are numbered from 0)");
      for (const auto& [megatron, trestle_name] : kStates) {
        const auto s = bucket.states.find(megatron);
        if (s == bucket.states.end())
          return Status::Error(dir + ": distributed optimizer bucket '" + key + "' has no '" + megatron + "'");
        if (s->second->shape != bucket.states.begin()->second->shape)
          return Status::Error(dir + ": the states of distributed optimizer bucket '" + key + "' differ in size");
      }
      sizes.push_back(bucket.states.begin()->second->shape[0]);
    }
    const auto& params = expect.params;
    std::vector<std::int64_t> numels;
    std::vector<bool> shared;
    for (const auto& p : params) {
      numels.push_back(p.numel);
      shared.push_back(p.shared_embedding);
    }
    GradBufferOptions options;
    options.dp = expect.dp;
    options.distributed_optimizer = true;
    // The bucket size that saved it: Megatron closes a bucket at the first parameter end reaching it, so one of
    // the stored sizes (a bucket but the last) closes every bucket where it was closed, unless there was one.
    std::vector<std::optional<std::int64_t>> candidates{std::nullopt};
    for (std::size_t k = 0; k + 1 < sizes.size(); ++k) candidates.push_back(sizes[k]);
    std::sort(candidates.begin() + 1, candidates.end());
    GradBufferLayout laid;
    for (const auto& candidate : candidates) {
      options.bucket_size = candidate;
      laid = grad_buffer_layout(numels, shared, options);
      if (laid.bucket_numel_unpadded == sizes) break;
    }
    const std::vector<std::int64_t>& laid_sizes = laid.bucket_numel_unpadded;
    if (laid_sizes != sizes) {
      auto list = [](const std::vector<std::int64_t>& v) {
        std::string s;
        for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
        return "[" + s + "]";
      };
      return Status::Error(
          dir + ": the distributed optimizer's buckets of '" + where + "' hold " + list(sizes) +
          " elements, but Megatron-Core's layout of that chunk's " + std::to_string(params.size()) +
          " parameters gives " + list(laid_sizes) +
          " (a different model or layout, or another parameter order: was the model built with Transformer "
          "Engine's layer specification, as its args say?)");
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      const MegatronBufferParam& p = params[i];
      const BufferParam& at = laid.params[i];
      const std::int64_t start = at.start - laid.buckets[static_cast<std::size_t>(at.bucket)].first;
      // Megatron saves each parameter's part of a shard (and each padding) as a chunk of its own: a chunk that
      // straddles a parameter's edge means the parameters are not where this layout puts them (another order).
      const DcpTensor* first_state = buffer.buckets.at(at.bucket).states.begin()->second;
      for (const DcpChunk& chunk : first_state->chunks) {
        const std::int64_t begin = chunk.box.offset.at(0), end = begin + chunk.box.shape.at(0);
        const std::int64_t edges[] = {start, start + p.numel};
        for (const std::int64_t edge : edges)
          if (begin < edge && edge < end)
            return Status::Error(dir + ": chunk [" + std::to_string(begin) + ", " + std::to_string(end) + ") of '" +
                                 first_state->name + "' straddles the edge of " +
                                 (p.tied_copy ? std::string("the tied output layer") : p.tensor->name) +
                                 " at element " + std::to_string(edge) +
                                 " of Megatron-Core's layout (a different parameter order: was the model built "
                                 "with Transformer Engine's layer specification, as its args say?)");
      }
      if (p.tied_copy) continue;  // the last stage's copy of a tied embedding: the embedding's own state is read
      for (const auto& [megatron, trestle_name] : kStates) {
        const DcpTensor* stored = buffer.buckets.at(at.bucket).states.at(megatron);
        const std::string name = trestle_optimizer_name(trestle_name, p.tensor->name);
        state.dtypes[name] = stored->dtype;
        auto& segments = state.segments[name];
        std::int64_t offset = start;
        for (const Box& box : p.boxes) {
          const bool replica =
              std::any_of(segments.begin(), segments.end(), [&](const FlatStateSegment& s) { return s.box == box; });
          if (!replica) segments.push_back({stored->name, offset, box});
          offset += box.numel();
        }
      }
    }
  }
  if (buffers.size() != expected.size())
    return Status::Error(dir + ": the checkpoint holds " + std::to_string(buffers.size()) +
                         " distributed optimizer buffers; this model's layout has " + std::to_string(expected.size()));
  for (const CanonicalTensor* t : tensors)
    for (const auto& [megatron, trestle_name] : kStates) {
      const std::string name = trestle_optimizer_name(trestle_name, t->name);
      std::int64_t covered = 0;
      for (const auto& s : state.segments[name]) covered += s.box.numel();
      if (covered != numel(t->shape))
        return Status::Error(dir + ": the distributed optimizer's buffers hold " + std::to_string(covered) +
                             " of the " + std::to_string(numel(t->shape)) + " elements of " + name);
    }
  if (step_item) {
    TRESTLE_ASSIGN_OR_RETURN(const auto object, ckpt.read_object(*step_item));
    state.step = param_group_step(object.root());
  }
  if (scaler_item) {
    TRESTLE_ASSIGN_OR_RETURN(const auto object, ckpt.read_object(*scaler_item));
    const PickleValue* root = object.root();  // DCP keeps a ShardedObject as torch.save([value])
    if (root && root->is(PickleKind::kList) && root->items.size() == 1) root = root->items[0];
    TRESTLE_ASSIGN_OR_RETURN(state.loss_scaler, read_megatron_grad_scaler(root, *object.archive, object.context));
  }
  return state;
}

Status read_flat_state(const DcpCheckpoint& ckpt, const std::vector<FlatStateSegment>& segments, DType dtype,
                       const Piece& piece, std::span<std::byte> out) {
  const std::size_t es = dtype_size(dtype);
  if (out.size() != static_cast<std::size_t>(piece.numel()) * es)
    return Status::Error("flat optimizer state: the destination does not hold " + to_string(piece));
  std::int64_t filled = 0;
  std::vector<std::byte> segment;
  for (const FlatStateSegment& s : segments) {
    const Piece stored{s.box, std::nullopt};
    if (shared_elements(stored, piece) == 0) continue;
    segment.resize(static_cast<std::size_t>(s.box.numel()) * es);
    if (Status st = ckpt.read_box(s.key, Box{{s.offset}, {s.box.numel()}}, segment.data()); !st.ok())
      return Status::Error("'" + s.key + "' elements [" + std::to_string(s.offset) + ", " +
                           std::to_string(s.offset + s.box.numel()) + "): " + st.message());
    for_each_shared_run(stored, piece, [&](const SharedRun& run) {
      std::memcpy(out.data() + static_cast<std::size_t>(run.b_index) * es,
                  segment.data() + static_cast<std::size_t>(run.a_index) * es,
                  static_cast<std::size_t>(run.count) * es);
      filled += run.count;
    });
  }
  if (filled != piece.numel())
    return Status::Error("the distributed optimizer's buffers cover " + std::to_string(filled) + " of the " +
                         std::to_string(piece.numel()) + " elements of " + to_string(piece));
  return OkStatus();
}

}  // namespace trestle
