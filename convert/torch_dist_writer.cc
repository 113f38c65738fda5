#include "convert/torch_dist_writer.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "ckpt/aligned_buffer.h"
#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/progress.h"
#include "convert/bridge/megatron_args.h"
#include "convert/bridge/megatron_dist_names.h"
#include "convert/bridge/megatron_grad_scaler.h"
#include "convert/bridge/megatron_scheduler.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/output_dir.h"
#include "parallel/layout/placement.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

// One chunk a rank writes: `box` of key's global tensor, whose first `canonical.numel()` elements are canonical box
// `canonical` of the tensor (the rest, vocab padding rows, are zeros).
struct DistItem {
  std::size_t tensor;
  Box canonical;
  DistPlacement placement;
  Shape global_shape;
  Box box;
};

struct SharedProgress {
  Progress progress;
  std::mutex mutex;
  Status advance(std::uint64_t bytes) {
    std::lock_guard lock(mutex);
    return progress.advance(bytes);
  }
};

struct DistPlan {
  std::vector<LayoutTensor> tensors;  // weights, each followed by its optimizer states
  std::uint64_t optimizer_tensors = 0;
  std::optional<std::int64_t> step;  // the optimizer's step, kept in common.pt
  bool mixed_precision = false;      // fp32 master weights are written: Megatron's mixed-precision optimizer layout
  std::vector<std::vector<DistItem>> ranks;
  std::vector<std::vector<std::string>> objects;  // per rank: the _extra_state items it writes
  std::optional<DpReshardablePlan> flat;          // the optimizer state as the distributed optimizer's buckets
  // With optimizer state: the learning-rate scheduler's state to keep beside it, and the keys missing when the
  // source's is incomplete (or absent: then all of them).
  std::optional<nlohmann::json> scheduler;
  std::vector<std::string> scheduler_missing;
  // In model space, an fp16 model's loss scaler (a trainer's "loss_scaler"), kept beside the optimizer in common.pt.
  std::optional<nlohmann::json> grad_scaler;
  // A training checkpoint's data position (consumed_train/valid_samples, skipped_train_samples), which Megatron-LM
  // reads back from args: written only at the source's own iteration.
  std::vector<std::pair<std::string, std::int64_t>> consumed;
  // The sequence length the checkpoint's run trained with (its training "megatron_args"), which Megatron-LM's
  // --use-checkpoint-args takes when its command line gives none.
  std::optional<std::int64_t> seq_length;
};

// Vocab tensors are placed here rather than by place_on_ranks: Megatron stores each TP rank's padded rows, including
// ranks that hold only padding.
void place_vocab(const BridgeTensor& t, std::size_t index, const ParallelLayout& layout, std::int64_t padded,
                 const DistPlacement& p, std::vector<std::vector<DistItem>>& ranks) {
  const int stage = t.placement == Placement::kFirstStage ? 0 : layout.pp - 1;
  const std::int64_t per = padded / layout.tp;
  for (int k = 0; k < layout.tp; ++k) {
    Box box = whole_box(t.shape);
    box.offset[0] = std::min(per * k, t.shape[0]);
    box.shape[0] = std::min(per * (k + 1), t.shape[0]) - box.offset[0];
    Box stored = box;
    stored.offset[0] = per * k;
    stored.shape[0] = per;
    ranks[static_cast<std::size_t>(global_rank(layout, {.tp_rank = k, .pp_rank = stage}))].push_back(
        {index, box, p, dist_global_shape(p, t, padded), dist_box(p, stored)});
  }
}

// The source's optimizer state of weight `t` (named as the source names it) in Megatron's model-space states, one
// (state, tensor) per state it has.
std::vector<std::pair<const DistOptimizerState*, const LayoutTensor*>> optimizer_states(const CanonicalSource& source,
                                                                                        const BridgeTensor& t) {
  std::vector<std::pair<const DistOptimizerState*, const LayoutTensor*>> out;
  std::set<std::string_view> named;
  for (const DistOptimizerState& state : dist_optimizer_states())
    if (named.insert(state.trestle).second)
      if (const LayoutTensor* stored = source.find(trestle_optimizer_name(state.trestle, t.name)))
        out.push_back({&state, stored});
  return out;
}

// `plan` names tensors as the source does; `keys` is the same plan under Transformer Engine norm names, which
// torch_dist uses whatever the spec (Megatron-Core's local spec maps its norm names to these when saving). Each
// weight's optimizer states (unless model_only) are placed like the weight, under their own keys: Megatron-Core's
// model-space optimizer state is sharded exactly as its parameter.
// Megatron-Core saves a model whose layers differ (DeepSeek's dense first layers: moe_layer_freq a list; Qwen3-Next's
// Gated DeltaNet layers among attention ones: hetereogenous_dist_checkpoint) with a key per layer, others with the
// layers stacked.
LayerKeys layer_keys(const BridgeModel& model) {
  return model.first_dense_layers > 0 || model.gated_delta_net || model.nemotron_h() ? LayerKeys::kPerLayer
                                                                                      : LayerKeys::kStacked;
}

Result<DistPlan> plan_ranks(const CanonicalSource& source, const BridgePlan& plan, const BridgePlan& keys,
                            const ParallelLayout& layout, bool model_only) {
  const BridgedModel& m = source.model();
  const auto& c = m.model.hf;
  const std::int64_t padded = padded_vocab_size(c.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  const std::int64_t experts = m.model.is_moe() ? c.num_experts : 0;
  const GptModelSpec spec = megatron_spec(m.model, m.norms);
  DistPlan out;
  out.ranks.resize(static_cast<std::size_t>(layout.world_size()));
  std::vector<PlacedTensor> placed;
  std::vector<DistPlacement> where;
  std::vector<const BridgeTensor*> weight_of;  // per entry of out.tensors
  const VisionStacks stacks = vision_stacks(keys);
  auto add = [&](const BridgeTensor& t, const LayoutTensor& stored, DistPlacement p) {
    out.tensors.push_back(stored);
    where.push_back(std::move(p));
    weight_of.push_back(&t);
    placed.push_back({&t, Holding::kModelWeight, t.shape});
    if (t.split == TpSplit::kVocab) place_vocab(t, out.tensors.size() - 1, layout, padded, where.back(), out.ranks);
  };
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    const BridgeTensor& t = plan.tensors[i];
    const LayoutTensor* stored = source.find(t.name);
    if (!stored) return Status::Error(source.description() + ": no tensor '" + t.name + "'");
    if (stored->shape != t.shape)
      return Status::Error(source.description() + ": tensor '" + t.name + "' has shape " + to_string(stored->shape) +
                           ", expected " + to_string(t.shape));
    DistPlacement p = dist_placement(keys.tensors[i], layer_keys(m.model), m.norms, c.num_layers, experts,
                                     spec.multi_latent_attention() || spec.hybrid());
    if (m.model.vision_language()) {
      p.key = vision_language_key(p.key);
      stack_vision_placement(p, stacks);
    }
    add(t, *stored, p);
    if (model_only) continue;
    for (const auto& [state, moment] : optimizer_states(source, t)) {
      if (moment->shape != t.shape)
        return Status::Error(source.description() + ": tensor '" + moment->name + "' has shape " +
                             to_string(moment->shape) + ", but its weight " + t.name + " has " + to_string(t.shape));
      DistPlacement q = p;
      q.key = dist_optimizer_key(state->megatron, p.key);
      add(t, *moment, std::move(q));
      ++out.optimizer_tensors;
      // (an fp32 model's masters are its weights: Megatron-LM trains it with its FP32Optimizer)
      out.mixed_precision |= std::string_view(state->trestle) == "fp32_param" && stored->dtype != DType::kF32;
    }
  }
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks, place_on_ranks(placed, spec, layout));
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, c.num_layers));
  out.objects.resize(out.ranks.size());
  auto stage_rank = [&](int stage) { return static_cast<std::size_t>(global_rank(layout, {.pp_rank = stage})); };
  if (layer_keys(m.model) == LayerKeys::kStacked)
    for (std::int64_t layer = 0; layer < c.num_layers; ++layer)
      for (auto& key : extra_state_keys(layer, c.num_layers, experts, m.model.shared_expert_ffn_hidden_size > 0))
        out.objects[stage_rank(stage_of_layer(stages, layer))].push_back(
            m.model.vision_language() ? vision_language_key(key) : key);
  // Per-layer keys, multi-token-prediction layers and a vision tower: one object per linear module, on the stage
  // holding it.
  for (std::size_t i = 0; i < where.size(); ++i) {
    const BridgeTensor& t = *weight_of[i];
    if (out.tensors[i].name != t.name) continue;  // an optimizer state of t
    auto key = module_extra_state_key(t, where[i], experts);
    if (!key) continue;
    const int stage = t.placement == Placement::kLayer      ? stage_of_layer(stages, t.layer)
                      : t.placement == Placement::kFirstStage ? 0
                                                              : layout.pp - 1;
    auto& objects = out.objects[stage_rank(stage)];
    if (std::find(objects.begin(), objects.end(), *key) == objects.end()) objects.push_back(std::move(*key));
  }
  std::set<std::pair<std::string, Shape>> written;  // replicas (data-parallel copies) are written once
  for (const auto& items : out.ranks)
    for (const auto& item : items) written.insert({item.placement.key, item.box.offset});
  for (std::size_t r = 0; r < ranks.size(); ++r)
    for (const RankPiece& piece : ranks[r]) {
      const BridgeTensor& t = *weight_of[piece.tensor];
      if (t.split == TpSplit::kVocab) continue;
      const DistPlacement& p = where[piece.tensor];
      const Box box = dist_box(p, piece.piece.box);
      if (!written.insert({p.key, box.offset}).second) continue;
      out.ranks[r].push_back({piece.tensor, piece.piece.box, p, dist_global_shape(p, t, padded), box});
    }
  return out;
}

// The optimizer's step (Trestle's scalar optimizer.step) for common.pt; any other optimizer tensor that is not the Adam
// state of a weight has no place in Megatron's format and is an error naming it.
Status plan_step(const CanonicalSource& source, const BridgePlan& plan, DistPlan& out) {
  std::set<std::string> placed;
  for (const auto& t : plan.tensors)
    for (const auto& [state, moment] : optimizer_states(source, t)) placed.insert(moment->name);
  std::vector<std::string> left;
  for (const LayoutTensor& t : source.tensors()) {
    if (!t.name.starts_with("optimizer.") || placed.count(t.name)) continue;
    if (t.name != kTrestleOptimizerStep || numel(t.shape) != 1) {
      left.push_back(t.name);
      continue;
    }
    std::vector<std::byte> raw(dtype_size(t.dtype));
    TRESTLE_RETURN_IF_ERROR(source.read(t.name, Piece{whole_box(t.shape), std::nullopt}, raw));
    TRESTLE_ASSIGN_OR_RETURN(out.step, step_value(t.dtype, raw));
  }
  if (left.empty()) return OkStatus();
  std::string list;
  for (std::size_t i = 0; i < left.size() && i < 10; ++i) list += (i ? ", " : "") + left[i];
  return Status::Error(source.description() + ": " + std::to_string(left.size()) +
                       " optimizer tensor(s) are neither Adam state of a model weight nor the step, so torch_dist has "
                       "no place for them: " +
                       list + "; pass --model-only to write the weights without optimizer state");
}

std::string describe(const CanonicalSource& source, const ParallelLayout& l, const DistPlan& plan, int writers,
                     bool param_groups) {
  std::ostringstream out;
  const auto& m = source.model().model;
  out << "source        " << source.description() << "\nmodel         " << m.architecture << ", " << m.hf.num_layers
      << " layers, " << plan.tensors.size() << " canonical tensors, vocab " << m.hf.vocab_size << " (padded "
      << padded_vocab_size(m.hf.vocab_size, l.make_vocab_size_divisible_by, l.tp) << ")\n"
      << "to            torch_dist, tp " << l.tp << ", pp " << l.pp << ", vpp " << l.vpp << ", ep " << l.ep
      << (layer_keys(m) == LayerKeys::kStacked ? " (stacked layer keys)\n" : " (per-layer keys)\n");
  std::uint64_t largest = 0;
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    std::uint64_t bytes = 0;
    for (const auto& item : plan.ranks[r]) {
      const std::uint64_t b =
          static_cast<std::uint64_t>(item.box.numel()) * dtype_size(plan.tensors[item.tensor].dtype);
      bytes += b;
      largest = std::max(largest, b);
    }
    if (plan.ranks[r].empty()) continue;
    const auto rc = rank_coordinates(l, static_cast<int>(r));
    out << "rank " << r << "        tp " << rc.tp_rank << " pp " << rc.pp_rank << " ep " << rc.ep_rank << ": "
        << plan.ranks[r].size() << " chunks, " << format_bytes(bytes) << "\n";
  }
  const auto optimizer = std::count_if(source.tensors().begin(), source.tensors().end(),
                                       [](const LayoutTensor& t) { return t.name.starts_with("optimizer."); });
  if (plan.flat)
    out << "optimizer     the distributed optimizer's dp_reshardable buffers: " << plan.flat->buckets
        << " bucket(s) of " << plan.flat->dtypes << ", " << format_bytes(plan.flat->bytes) << " (param, exp_avg, "
        << "exp_avg_sq)" << (plan.flat->chained ? ", a dense and an expert optimizer" : "") << ", step "
        << plan.step.value_or(0) << "\n";
  else if (plan.optimizer_tensors || plan.step)
    out << "optimizer     " << plan.optimizer_tensors
        << " Adam state tensors (optimizer.state.<state>.<key>, sharded as "
        << "their weights)" << (plan.step ? ", step " + std::to_string(*plan.step) + " in common.pt" : "")
        << (param_groups ? ", param groups from --lr ..." : "") << "\n";
  if (!plan.flat && plan.step && !param_groups)
    out << "warning       common.pt gets no param groups (give --lr, and the run's --min-lr, --weight-decay, "
           "--adam-beta1, --adam-beta2, --adam-eps): Megatron-LM's load_checkpoint needs them to load the optimizer "
           "(dist_checkpointing.load alone does not)\n";
  if (optimizer && !plan.flat && !plan.optimizer_tensors && !plan.step)
    out << "not written   " << optimizer << " optimizer tensors (--model-only)\n";
  if (plan.scheduler)
    out << "scheduler     the learning-rate scheduler's state (opt_param_scheduler, num_steps "
        << plan.scheduler->at("num_steps").dump() << ") in common.pt\n";
  else if (plan.flat || plan.step) {
    std::string missing;
    for (const auto& key : plan.scheduler_missing) missing += (missing.empty() ? "" : ", ") + key;
    out << "warning       the source keeps no complete learning-rate scheduler state (missing: " << missing
        << "): common.pt gets no opt_param_scheduler, without which Megatron-LM's load_checkpoint stops when it "
           "loads the optimizer\n";
  }
  for (const std::string& caveat : megatron_args_caveats(source.model())) out << "warning       " << caveat << "\n";
  if (!plan.consumed.empty()) {
    out << "data position";
    for (const auto& [key, count] : plan.consumed) out << " " << key << " " << count;
    out << " (in common.pt's args)\n";
  }
  out << "memory        about " << format_bytes(static_cast<std::uint64_t>(writers) * largest) << " (" << writers
      << " writer(s) x largest chunk) + read buffers\n";
  return out.str();
}

Status write_rank(const CanonicalSource& source, const DistPlan& plan, const std::string& dir, int rank,
                  const IoOptions& io, DcpRankItems& items, std::atomic<std::uint64_t>& bytes,
                  SharedProgress& progress) {
  TRESTLE_ASSIGN_OR_RETURN(auto writer, DcpRankFileWriter::create(dir, rank, io));
  if (!plan.objects[static_cast<std::size_t>(rank)].empty()) {
    PickleDocument doc;
    TRESTLE_ASSIGN_OR_RETURN(const std::string no_state, torch_save_object_bytes(doc.list({doc.none()})));
    for (const auto& key : plan.objects[static_cast<std::size_t>(rank)])
      TRESTLE_RETURN_IF_ERROR(writer.add_object({key, no_state}));
  }
  AlignedBuffer buffer;  // reused; page-aligned so O_DIRECT sources read straight into it
  for (const DistItem& item : plan.ranks[static_cast<std::size_t>(rank)]) {
    const LayoutTensor& t = plan.tensors[item.tensor];
    const std::size_t es = dtype_size(t.dtype);
    const auto size = static_cast<std::size_t>(item.box.numel()) * es;
    std::span<std::byte> piece;
    try {
      piece = buffer.first(size);
    } catch (const std::bad_alloc&) {  // (on a writer thread: not thrown past it)
      return Status::Error("out of memory: tensor '" + t.name + "' needs a piece of " + std::to_string(size) +
                           " bytes in rank file " + std::to_string(rank) + ", more than could be allocated");
    }
    const std::size_t real = static_cast<std::size_t>(item.canonical.numel()) * es;
    if (real) TRESTLE_RETURN_IF_ERROR(source.read(t.name, Piece{item.canonical, std::nullopt}, piece.first(real)));
    std::fill(piece.begin() + static_cast<std::ptrdiff_t>(real), piece.end(), std::byte{0});  // vocab padding rows
    TRESTLE_RETURN_IF_ERROR(writer.add_tensor({item.placement.key, t.dtype, item.global_shape, item.box, piece}));
    bytes += size;
    TRESTLE_RETURN_IF_ERROR(progress.advance(size));
  }
  if (plan.flat) {
    for (const DcpObjectPiece& object : plan.flat->objects[static_cast<std::size_t>(rank)])
      TRESTLE_RETURN_IF_ERROR(writer.add_object(object));
    for (const FlatChunk& chunk : plan.flat->ranks[static_cast<std::size_t>(rank)]) {
      const auto size = static_cast<std::size_t>(chunk.size) * sizeof(float);
      const std::span<std::byte> piece = buffer.first(size);
      const std::span<float> values(reinterpret_cast<float*>(piece.data()), static_cast<std::size_t>(chunk.size));
      TRESTLE_RETURN_IF_ERROR(read_flat_chunk(source, chunk, values));
      TRESTLE_RETURN_IF_ERROR(
          writer.add_tensor({chunk.key, DType::kF32, {chunk.global}, Box{{chunk.offset}, {chunk.size}}, piece}));
      bytes += size;
      TRESTLE_RETURN_IF_ERROR(progress.advance(size));
    }
  }
  TRESTLE_ASSIGN_OR_RETURN(items, writer.finish());
  return OkStatus();
}

// common.pt; with the optimizer's step where Megatron-Core's optimizer state dict keeps it ('optimizer' -> 'state' ->
// 'common_step', one 'optimizer' deeper for its mixed-precision optimizers, which hold fp32 masters, and keep an fp16
// model's loss scaler beside it as 'grad_scaler').
// With the distributed optimizer's buffers, what Megatron-LM's load of them reads from common.pt instead.
Status write_common(const std::string& dir, const BridgedModel& model, std::int64_t iteration, const DistPlan& plan,
                    const std::optional<DpReshardableWriteOptions>& flat_options,
                    const TorchDistWriteOptions& options) {
  const nlohmann::json& extra_args = options.extra_args;
  PickleDocument doc;
  std::vector<std::string> storages;  // of the tensors in common.pt (the loss scale)
  BridgedModel described = model;  // as the loading run builds it
  if (flat_options && flat_options->transformer_impl) described.norms = *flat_options->transformer_impl;
  PickleValue* args = megatron_args(doc, described);
  auto& fields = args->state->entries;
  for (const auto& [key, count] : plan.consumed) fields.emplace_back(doc.string(key), doc.integer(count));
  if (plan.seq_length && !extra_args.contains("seq_length"))
    fields.emplace_back(doc.string("seq_length"), doc.integer(*plan.seq_length));
  // Megatron-LM's load_checkpoint asks for no RNG state of a checkpoint whose args say none was saved (Trestle writes
  // none), nor for optimizer state and a scheduler when there is none here.
  fields.emplace_back(doc.string("no_save_rng"), doc.boolean(true));
  fields.emplace_back(doc.string("no_save_optim"), doc.boolean(!plan.flat && !plan.step));
  for (const auto& item : extra_args.items()) {
    const std::string key = item.key();  // (a named copy: lambdas cannot capture a structured binding in C++20)
    const nlohmann::json& value = item.value();
    PickleValue* v = value.is_boolean()          ? doc.boolean(value.get<bool>())
                     : value.is_number_integer() ? doc.integer(value.get<std::int64_t>())
                     : value.is_number()         ? doc.real(value.get<double>())
                     : value.is_string()         ? doc.string(value.get<std::string>())
                     : value.is_null()           ? doc.none()
                                                 : nullptr;
    if (!v) return Status::Error("internal: common.pt argument '" + key + "' is not a scalar: " + value.dump());
    const auto same = std::find_if(fields.begin(), fields.end(), [&](const auto& f) {
      return f.first->is(PickleKind::kString) && f.first->text == key;
    });
    if (same != fields.end()) same->second = v;
    else fields.emplace_back(doc.string(key), v);
  }
  PickleValue* common = doc.dict({{doc.string("args"), args},
                                  {doc.string("checkpoint_version"), doc.real(3.0)},
                                  {doc.string("iteration"), doc.integer(iteration)}});
  if (plan.flat) {
    add_dp_reshardable_common(doc, common, args, plan.flat->chained, *flat_options);
  } else if (plan.step) {
    std::vector<std::pair<PickleValue*, PickleValue*>> state = {
        {doc.string("state"), doc.dict({{doc.string("common_step"), doc.integer(*plan.step)}})}};
    if (options.param_groups)
      state.emplace_back(doc.string("param_groups"),
                         doc.list(megatron_param_groups(doc, false, *plan.step, *options.param_groups)));
    PickleValue* optimizer = doc.dict(std::move(state));
    if (plan.mixed_precision) {
      optimizer = doc.dict({{doc.string("optimizer"), optimizer}});
      if (plan.grad_scaler)
        optimizer->entries.push_back(
            {doc.string("grad_scaler"), megatron_grad_scaler_object(doc, *plan.grad_scaler, storages)});
    }
    common->entries.push_back({doc.string("optimizer"), optimizer});
    // What Megatron-LM's save records of every checkpoint's content.
    common->entries.push_back(
        {doc.string("content_metadata"), doc.dict({{doc.string("singleton_local_shards"), doc.boolean(false)},
                                                   {doc.string("chained_optim_avoid_prefix"), doc.boolean(true)}})});
  }
  if (plan.scheduler)
    common->entries.push_back({doc.string("opt_param_scheduler"), megatron_scheduler_object(doc, *plan.scheduler)});
  TRESTLE_ASSIGN_OR_RETURN(const std::string bytes, torch_save_object_bytes(common, "common", storages));
  TRESTLE_RETURN_IF_ERROR(write_file_atomically((fs::path(dir) / "common.pt").string(), bytes));
  return write_file_atomically((fs::path(dir) / kKeptModelFile).string(), bridged_model_to_json(model).dump(2) + "\n");
}

}  // namespace

Result<TorchDistWriteReport> write_torch_dist(const CanonicalSource& source, const std::string& root,
                                              const TorchDistWriteOptions& options) {
  BridgedModel model = source.model();
  const ParallelLayout& layout = options.layout;
  const auto& c = model.model.hf;
  if (model.model.gemma4)
    return Status::Error(
        model.model.architecture +
        ": Megatron-Core's GPTModel cannot hold Gemma 4 (attention sizes that differ by layer, keys as values, KV "
        "sharing, per-layer input embeddings, the MoE block beside the MLP with norms of its own), and "
        "Megatron-Bridge's Gemma 4 bridge builds its own layer modules and folds the router's scales and the MLP's "
        "pre-norm into other weights, which does not convert back bit-exactly; convert it to a Trestle checkpoint "
        "(--to trestle) instead");
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, c.num_layers, c.num_kv_heads, model.model.is_moe() ? c.num_experts : 0));
  TRESTLE_RETURN_IF_ERROR(check_linear_attention_tp(model.model, layout.tp));
  TRESTLE_RETURN_IF_ERROR(check_mlp_split(megatron_spec(model.model, model.norms), layout.tp, layout.expert_tp()));
  {
    BridgedModel written = model;
    written.layout = layout;
    TRESTLE_RETURN_IF_ERROR(checked_bridged_model_json(written, root).status());
  }
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(model.model, model.norms, model.experts));
  // Keys under Transformer Engine's norm names (the local spec renames its own to them on save), except with
  // multi-latent attention, whose local spec saves local names.
  const bool mla = megatron_spec(model.model, model.norms).multi_latent_attention();
  TRESTLE_ASSIGN_OR_RETURN(
      const BridgePlan keys,
      make_bridge_plan(model.model, mla ? model.norms : NormNaming::kTransformerEngine, model.experts));
  if (keys.tensors.size() != plan.tensors.size()) return Status::Error("internal: norm namings give different plans");
  {  // every stored weight is one the model describes (the optimizer's are accounted for by plan_step)
    std::map<std::string, Shape> present;
    for (const LayoutTensor& t : source.tensors())
      if (!t.name.starts_with("optimizer.")) present[t.name] = t.shape;
    TRESTLE_RETURN_IF_ERROR(check_accounting(canonical_shapes(plan), present, source.description()));
  }
  const bool flat = options.dp_reshardable && !options.model_only;
  if (options.param_groups && !options.model_only && !flat && model.model.is_moe())
    return Status::Error(model.model.architecture +
                         ": an MoE model's param groups in model space (Megatron-Core's chained dense and expert "
                         "optimizers) are not written; write the optimizer state as the distributed optimizer's "
                         "(--optimizer-format dp_reshardable), or leave --lr out");
  std::optional<DpReshardableWriteOptions> flat_options = options.dp_reshardable;
  if (flat_options && flat_options->dp == 0) flat_options->dp = layout.dp();
  TRESTLE_ASSIGN_OR_RETURN(DistPlan dist, plan_ranks(source, plan, keys, layout, options.model_only || flat));
  if (!options.model_only) TRESTLE_RETURN_IF_ERROR(plan_step(source, plan, dist));
  if (flat) {
    if (std::none_of(source.tensors().begin(), source.tensors().end(),
                     [](const LayoutTensor& t) { return t.name.starts_with("optimizer."); }))
      return Status::Error(source.description() +
                           " holds no optimizer state to write as the distributed optimizer's dp_reshardable "
                           "buffers (drop --optimizer-format, or pass --model-only)");
    if (!dist.step)
      return Status::Error(source.description() + ": no " + std::string(kTrestleOptimizerStep) +
                           ": the distributed optimizer's param groups carry Adam's step");
    std::vector<const CanonicalTensor*> canonical;
    for (const auto& t : plan.tensors) canonical.push_back(&t);
    TRESTLE_ASSIGN_OR_RETURN(
        dist.flat,
        plan_dp_reshardable(source, canonical, layout,
                            padded_vocab_size(c.vocab_size, layout.make_vocab_size_divisible_by, layout.tp),
                            flat_options->transformer_impl.value_or(model.norms), *dist.step, *flat_options));
  }
  if (dist.flat || dist.step) {
    const auto scheduler = source.training().find("scheduler");
    dist.scheduler_missing =
        missing_megatron_scheduler_keys(scheduler == source.training().end() ? nlohmann::json::object() : *scheduler);
    if (dist.scheduler_missing.empty()) dist.scheduler = *scheduler;
  }
  if (dist.step && !dist.flat && dist.mixed_precision) {
    const auto scaler = source.training().find("loss_scaler");
    const bool fp16 = std::any_of(plan.tensors.begin(), plan.tensors.end(), [&](const auto& t) {
      const LayoutTensor* weight = source.find(t.name);
      return weight && weight->dtype == DType::kF16;
    });
    if (fp16 && scaler != source.training().end() && is_megatron_grad_scaler_state(*scaler)) dist.grad_scaler = *scaler;
  }
  if (!options.iteration || *options.iteration == source.iteration())
    for (const char* key : kMegatronDataPositionArgs) {
      const auto found = source.training().find(key);
      if (found != source.training().end() && found->is_number_integer() && found->get<std::int64_t>() >= 0)
        dist.consumed.emplace_back(key, found->get<std::int64_t>());
    }
  if (const auto kept = source.training().find("megatron_args"); kept != source.training().end())
    dist.seq_length = kept_seq_length(*kept);
  // At least tp writers: the tensor-parallel ranks of a stage, which cut their pieces from the same source tensors,
  // write at the same time (ranks are taken in order).
  const int writers = std::max(1, std::min(std::max(options.concurrent_writers, layout.tp), layout.world_size()));
  TorchDistWriteReport report;
  report.plan = describe(source, layout, dist, writers, options.param_groups.has_value());
  if (options.dry_run) {
    if (options.iteration_dir.empty()) TRESTLE_RETURN_IF_ERROR(StagedOutput::check_destination(root, source.path()));
    return report;
  }
  std::optional<StagedOutput> output;
  if (options.iteration_dir.empty()) {
    TRESTLE_ASSIGN_OR_RETURN(auto staged, StagedOutput::begin(root, source.path()));
    output.emplace(std::move(staged));
  }

  const std::int64_t iteration = options.iteration.value_or(source.iteration());
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(iteration));
  const std::string dir = output ? (fs::path(output->path()) / name).string() : options.iteration_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::Error(dir + ": cannot create: " + ec.message());

  std::uint64_t total = dist.flat ? dist.flat->bytes : 0;
  for (const auto& items : dist.ranks)
    for (const auto& item : items)
      total += static_cast<std::uint64_t>(item.box.numel()) * dtype_size(dist.tensors[item.tensor].dtype);
  SharedProgress progress{
      Progress("-> torch_dist " + fs::path(output ? root : dir).filename().string(), total, options.progress), {}};
  std::vector<DcpRankItems> items(dist.ranks.size());
  {  // the writers take the ranks in order, each its items in order
    std::vector<std::string> reads;
    for (const auto& rank : dist.ranks)
      for (const DistItem& item : rank)
        if (item.canonical.numel() > 0) reads.push_back(dist.tensors[item.tensor].name);
    source.expect_reads(reads);
  }
  std::vector<Status> status(dist.ranks.size(), OkStatus());
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> bytes{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < writers; ++w)
    threads.emplace_back([&] {
      for (std::size_t r; (r = next++) < dist.ranks.size();)
        try {  // what a writer thread throws would end the process: it fails its rank file instead
          status[r] = write_rank(source, dist, dir, static_cast<int>(r), options.io, items[r], bytes, progress);
        } catch (const std::exception& e) {
          status[r] = Status::Error("rank file " + std::to_string(r) + ": " + e.what());
        }
    });
  for (auto& t : threads) t.join();
  for (const Status& s : status) TRESTLE_RETURN_IF_ERROR(s);
  progress.progress.finish();
  TRESTLE_RETURN_IF_ERROR(write_dcp_metadata_file(dir, items));
  TRESTLE_RETURN_IF_ERROR(write_megatron_metadata_json(dir));
  model.layout = layout;
  TRESTLE_RETURN_IF_ERROR(write_common(dir, model, iteration, dist, flat_options, options));
  TRESTLE_RETURN_IF_ERROR(copy_side_files(source, (fs::path(dir) / kSideFilesDir).string()));
  if (output) {
    TRESTLE_RETURN_IF_ERROR(write_file_atomically(
        (fs::path(output->path()) / "latest_checkpointed_iteration.txt").string(), std::to_string(iteration)));
    TRESTLE_RETURN_IF_ERROR(output->commit());
  }
  report.tensors = dist.tensors.size();
  report.optimizer_tensors = dist.flat ? 3 * plan.tensors.size() : dist.optimizer_tensors;
  for (const auto& r : dist.ranks) report.pieces += r.size();
  report.bytes_written = bytes;
  return report;
}

}  // namespace trestle
