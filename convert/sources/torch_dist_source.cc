// A torch_dist (PyTorch DCP) checkpoint as a canonical source: each canonical tensor is found under its stacked or
// per-layer key (megatron_dist_names.h) and read with DcpCheckpoint::read_box, which reads only the chunks a box
// overlaps. Adam state in Megatron-Core's model space (`optimizer.state.<state>.<weight key>`) is listed as Trestle's
// `optimizer.<state>.<weight>` and read the same way; the common step Megatron keeps in the common state
// (`optimizer[.optimizer].state.common_step`) as the scalar `optimizer.step`, and with them the learning-rate
// scheduler's state (`opt_param_scheduler`) as training()["scheduler"] and an fp16 model's loss scaler
// (`grad_scaler`, megatron_grad_scaler.h) as training()["loss_scaler"]; the data position in Megatron's args
// (consumed_train/valid_samples, skipped_train_samples) as training()'s keys of those names, its dropout as
// training()["megatron_args"]. The distributed optimizer's flat buffers ('dp_reshardable', Megatron-LM's default) are
// located per tensor by dp_reshardable.h and read from there. Every stored tensor must be one of these or non-model
// state (_extra_state, RNG); other optimizer entries are an error unless SourceOptions::model_only, which leaves all
// optimizer state out.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <mutex>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/json_file.h"
#include "ckpt/regular_file.h"
#include "convert/bridge/megatron_args.h"
#include "convert/bridge/megatron_dist_names.h"
#include "convert/bridge/megatron_grad_scaler.h"
#include "convert/bridge/megatron_scheduler.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/sources/canonical_source.h"
#include "convert/sources/dp_reshardable.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

class TorchDistSource final : public CanonicalSource {
 public:
  TorchDistSource(DcpCheckpoint ckpt, BridgedModel model, std::int64_t iteration,
                  std::map<std::string, DistPlacement> keys, std::vector<LayoutTensor> tensors,
                  std::optional<std::int64_t> step, DpReshardableState flat, nlohmann::json training)
      : ckpt_(std::move(ckpt)), keys_(std::move(keys)), step_(step), flat_(std::move(flat)) {
    model_ = std::move(model);
    tensors_ = std::move(tensors);
    iteration_ = iteration;
    training_ = std::move(training);
    side_files_dir_ = (fs::path(ckpt_.directory()) / kSideFilesDir).string();
  }

  std::string description() const override { return "torch_dist " + ckpt_.directory(); }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    if (step_ && name == kTrestleOptimizerStep) {
      if (out.size() != sizeof *step_) return Status::Error(description() + ": '" + name + "' is one int64");
      std::memcpy(out.data(), &*step_, sizeof *step_);
      return OkStatus();
    }
    if (const auto flat = flat_.segments.find(name); flat != flat_.segments.end()) {
      if (Status s = read_flat_state(ckpt_, flat->second, flat_.dtypes.at(name), piece, out); !s.ok())
        return Status::Error(description() + ": reading tensor '" + name + "' " + to_string(piece) + ": " +
                             s.message());
      std::lock_guard lock(mutex_);
      bytes_read_ += out.size();
      return OkStatus();
    }
    const auto it = keys_.find(name);
    if (it == keys_.end()) return Status::Error(description() + ": no tensor '" + name + "'");
    const Box box = dist_box(it->second, piece.box);
    // A flat piece (a distributed-optimizer shard of the box) is read as its whole box, then cut.
    std::vector<std::byte> whole(
        piece.flat ? out.size() / static_cast<std::size_t>(piece.numel()) * static_cast<std::size_t>(box.numel()) : 0);
    if (Status s = ckpt_.read_box(it->second.key, box, piece.flat ? whole.data() : out.data()); !s.ok())
      return Status::Error("reading tensor '" + name + "' (key '" + it->second.key + "' box " + to_string(box) +
                           "): " + s.message());
    if (piece.flat) {
      const std::size_t es = whole.size() / static_cast<std::size_t>(box.numel());
      std::memcpy(out.data(), whole.data() + static_cast<std::size_t>(piece.flat->start) * es, out.size());
    }
    std::lock_guard lock(mutex_);
    bytes_read_ += out.size();
    return OkStatus();
  }

 private:
  DcpCheckpoint ckpt_;
  std::map<std::string, DistPlacement> keys_;  // canonical name -> where it is stored
  std::optional<std::int64_t> step_;
  DpReshardableState flat_;  // the distributed optimizer's flat buffers ('dp_reshardable'), per optimizer tensor
  mutable std::mutex mutex_;
};

// Why a Megatron dist-checkpoint directory without .metadata is none Trestle reads, when its metadata.json says:
// another sharded backend (zarr, Megatron's older default); empty otherwise.
std::string other_backend(const fs::path& dir) {
  const auto metadata = read_json_file((dir / "metadata.json").string());
  if (!metadata.ok() || !metadata->is_object()) return {};
  const auto backend = metadata->find("sharded_backend");
  if (backend == metadata->end() || !backend->is_string() || *backend == "torch_dist") return {};
  return "; its metadata.json names Megatron's '" + backend->get<std::string>() +
         "' sharded backend, which Trestle does not read (torch_dist only: a Megatron-LM that reads it re-saves "
         "it with --ckpt-convert-format torch_dist --ckpt-convert-save DIR)";
}

}  // namespace

Result<std::pair<std::string, std::int64_t>> torch_dist_iteration_dir(const std::string& path,
                                                                      std::optional<std::int64_t> iteration) {
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(p / ".metadata", ec)) {
    std::int64_t it = 0;
    const std::string name =
        p.filename().string().empty() ? p.parent_path().filename().string() : p.filename().string();
    if (name.starts_with("iter_")) it = std::atoll(name.c_str() + 5);
    return std::make_pair(path, it);
  }
  if (!iteration) {
    TRESTLE_ASSIGN_OR_RETURN(const Tracker tracker, read_tracker(path));
    if (!tracker.present)
      return Status::Error(path + ": neither a torch_dist directory (.metadata) nor a root with " + kTrackerFile +
                           other_backend(p));
    if (tracker.release) return std::make_pair(tracked_iteration_dir(path, tracker), std::int64_t{0});
    iteration = tracker.iteration;
  }
  const std::string name = iteration_dir_name(*iteration);
  TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link((p / name).string()));
  if (!fs::exists(p / name / ".metadata", ec)) {
    std::string have;
    for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code file_ec;
      const std::string dir = it->path().filename().string();
      if (dir.starts_with("iter_") && fs::exists(it->path() / ".metadata", file_ec))
        have += (have.empty() ? "" : ", ") + dir;
    }
    return Status::Error((p / name).string() + ": iteration " + std::to_string(*iteration) +
                         " is not a torch_dist checkpoint here (no .metadata" +
                         (have.empty() ? ")" : "; saved: " + have + ")") + other_backend(p / name));
  }
  return std::make_pair((p / name).string(), *iteration);
}

namespace {

// Megatron's args: in common.pt (older) or the common_state item (newer).
Result<std::optional<TorchSavedObject>> common_state(const DcpCheckpoint& ckpt) {
  if (ckpt.common_state()) return ckpt.common_state();
  for (const auto& item : ckpt.metadata().bytes)
    if (item.name == "common_state" || item.name.starts_with("common_state/")) {
      TRESTLE_ASSIGN_OR_RETURN(auto object, ckpt.read_object(item));
      return std::optional<TorchSavedObject>(std::move(object));
    }
  return std::optional<TorchSavedObject>();
}

// The optimizer's common step: Megatron-Core's optimizers move Adam's per-parameter step into `common_step` of their
// state dict, which the save keeps in the common state ('optimizer' -> ['optimizer' ->] 'state' -> 'common_step'; the
// inner 'optimizer' for mixed-precision optimizers). A tensor (torch's Adam) or a number.
Result<std::optional<std::int64_t>> common_step(const TorchSavedObject& common) {
  const PickleValue* optimizer = common.root()->get("optimizer");
  if (optimizer && optimizer->get("optimizer")) optimizer = optimizer->get("optimizer");
  const PickleValue* state = optimizer ? optimizer->get("state") : nullptr;
  const PickleValue* step = state ? state->get("common_step") : nullptr;
  if (!step) return std::optional<std::int64_t>();
  if (step->is(PickleKind::kInt)) return std::optional<std::int64_t>(step->integer);
  if (step->is(PickleKind::kFloat)) return std::optional<std::int64_t>(std::llround(step->real));
  TRESTLE_ASSIGN_OR_RETURN(const auto tensor, common.archive->tensor(step));
  if (!tensor || numel(tensor->shape) != 1)
    return Status::Error(common.context + ": optimizer common_step is " + pickle_repr(step) + ", expected a number");
  std::vector<std::byte> raw(dtype_size(tensor->dtype));
  common.archive->copy_tensor(*tensor, raw.data());
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t value, step_value(tensor->dtype, raw));
  return std::optional<std::int64_t>(value);
}

}  // namespace

Result<nlohmann::json> read_torch_dist_run_args(const std::string& path, std::optional<std::int64_t> iteration) {
  TRESTLE_ASSIGN_OR_RETURN(const auto located, torch_dist_iteration_dir(path, iteration));
  DcpCheckpoint::OpenOptions options;
  options.refuse_unreadable = false;  // (its tensors are not read here)
  TRESTLE_ASSIGN_OR_RETURN(const auto ckpt, DcpCheckpoint::open(located.first, options));
  TRESTLE_ASSIGN_OR_RETURN(const auto common, common_state(ckpt));
  return kept_megatron_args(common && common->root() ? common->root()->get("args") : nullptr);
}

Result<std::unique_ptr<CanonicalSource>> open_torch_dist_source(const std::string& path, const SourceOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const auto located, torch_dist_iteration_dir(path, options.iteration));
  const auto& [dir, iteration] = located;
  TRESTLE_ASSIGN_OR_RETURN(auto ckpt, DcpCheckpoint::open(dir));
  TRESTLE_ASSIGN_OR_RETURN(const auto common, common_state(ckpt));
  const PickleValue* args = common && common->root() ? common->root()->get("args") : nullptr;
  TRESTLE_ASSIGN_OR_RETURN(BridgedModel model,
                           megatron_source_model(options, (fs::path(dir) / kKeptModelFile).string(), args, dir));
  std::vector<std::string> keys;
  for (const auto& t : ckpt.metadata().tensors) keys.push_back(t.name);
  model.norms = detect_norm_naming(keys);
  count_stored_mtp_layers(model, keys);  // DeepSeek's, GLM's and Qwen3-Next's, when a config describes the model
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(model.model, model.norms, model.experts));
  const GptModelSpec model_spec = megatron_spec(model.model, model.norms);
  const bool own_names = model_spec.multi_latent_attention() || model_spec.hybrid();

  const auto& c = model.model.hf;
  const std::int64_t experts = model.model.is_moe() ? c.num_experts : 0;
  const VisionStacks stacks = vision_stacks(plan);
  std::map<std::string, DistPlacement> where;
  std::map<std::string, bool> used;
  std::vector<LayoutTensor> tensors;
  std::int64_t padded_vocab = 0;  // the stored embedding's rows
  for (const auto& t : plan.tensors) {
    // Stacked or per-layer keys, as either spec names an MoE layer's pre-MLP norm.
    std::vector<DistPlacement> candidates;
    for (const NormNaming spec : {NormNaming::kTransformerEngine, NormNaming::kLocal})
      for (const LayerKeys style : {LayerKeys::kStacked, LayerKeys::kPerLayer})
        candidates.push_back(dist_placement(t, style, spec, c.num_layers, experts, own_names));
    if (model.model.vision_language())  // Megatron-Bridge's language_model.* beside vision_model.*
      for (auto& candidate : candidates) {
        candidate.key = vision_language_key(candidate.key);
        stack_vision_placement(candidate, stacks);
      }
    const DcpTensor* stored = nullptr;
    DistPlacement p;
    for (const auto& candidate : candidates)
      if ((stored = ckpt.metadata().find_tensor(candidate.key))) {
        p = candidate;
        break;
      }
    if (!stored)
      return Status::Error(dir + ": canonical tensor '" + t.name + "' is stored under neither '" + candidates[0].key +
                           "' (stacked layers) nor '" + candidates[1].key + "' (per-layer keys)");
    const std::int64_t rows = stored->shape.size() > p.leading.size() ? stored->shape[p.leading.size()] : 0;
    const std::int64_t padded = t.split == TpSplit::kVocab && rows >= t.shape[0] ? rows : t.shape.front();
    const Shape expected = dist_global_shape(p, t, padded);
    if (stored->shape != expected)
      return Status::Error(dir + ": tensor '" + p.key + "' has global shape " + to_string(stored->shape) +
                           ", expected " + to_string(expected) + " for " + t.name +
                           (t.split == TpSplit::kVocab ? " (vocab rows at least the model's vocab)" : ""));
    used[p.key] = true;
    if (t.name == "embedding.word_embeddings.weight") padded_vocab = padded;
    tensors.push_back({t.name, stored->dtype, t.shape});
    where[t.name] = p;
    if (options.model_only) continue;
    for (const DistOptimizerState& state : dist_optimizer_states()) {
      const std::string name = trestle_optimizer_name(state.trestle, t.name);
      DistPlacement q = p;
      q.key = dist_optimizer_key(state.megatron, p.key);
      const DcpTensor* moment = ckpt.metadata().find_tensor(q.key);
      if (!moment || where.count(name)) continue;
      if (moment->shape != stored->shape)
        return Status::Error(dir + ": optimizer tensor '" + q.key + "' has global shape " + to_string(moment->shape) +
                             ", expected its weight's " + to_string(stored->shape));
      used[q.key] = true;
      tensors.push_back({name, moment->dtype, t.shape});
      where[name] = std::move(q);
    }
  }
  // The distributed optimizer's flat buffers (Megatron-LM's default 'dp_reshardable'), mapped through Megatron-Core's
  // buffer layout rebuilt here.
  DpReshardableState flat;
  if (!options.model_only) {
    std::vector<const CanonicalTensor*> canonical;
    for (const auto& t : plan.tensors) canonical.push_back(&t);
    // Megatron-LM's default layer specification is Transformer Engine's, unless its args say otherwise.
    TRESTLE_ASSIGN_OR_RETURN(
        flat, locate_dp_reshardable_state(ckpt, model, canonical, padded_vocab, megatron_module_spec_from_args(args)));
    for (const auto& t : plan.tensors)
      for (const DistOptimizerState& state : dist_optimizer_states()) {
        const std::string name = trestle_optimizer_name(state.trestle, t.name);
        if (!flat.segments.count(name)) continue;
        if (where.count(name))
          return Status::Error(dir + ": " + name +
                               " is stored both in model space and in the distributed "
                               "optimizer's flat buffers");
        if (std::none_of(tensors.begin(), tensors.end(), [&](const LayoutTensor& l) { return l.name == name; }))
          tensors.push_back({name, flat.dtypes.at(name), t.shape});
      }
  }
  // Optimizer entries, with the chained optimizers' prefix ("chained_<i>.optimizer...") under expert parallelism.
  auto optimizer_entry = [](const std::string& k) {
    if (k.starts_with("optimizer.")) return true;
    if (!k.starts_with("chained_")) return false;
    const std::size_t dot = k.find('.');
    return dot != std::string::npos && k.compare(dot + 1, 10, "optimizer.") == 0;
  };
  std::vector<std::string> unknown, optimizer;
  for (const auto& k : keys) {
    if (used.count(k) || is_non_model_dist_key(k) || flat.entries.count(k)) continue;
    if (!optimizer_entry(k)) unknown.push_back(k);
    else if (!options.model_only) optimizer.push_back(k);
  }
  for (const auto& item : ckpt.metadata().bytes)  // the distributed optimizer's ShardedObjects
    if (optimizer_entry(item.name) && !options.model_only && !flat.entries.count(item.name))
      optimizer.push_back(item.name);
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < names.size() && i < 10; ++i) out += (i ? ", " : "") + names[i];
    return out;
  };
  if (!unknown.empty())
    return Status::Error(dir + ": " + std::to_string(unknown.size()) + " stored tensor(s) are not weights of the " +
                         model.model.architecture + " model described by the checkpoint: " + list(unknown));
  if (!optimizer.empty())
    return Status::Error(dir + ": " + std::to_string(optimizer.size()) +
                         " optimizer entries are neither Adam state of a model weight (optimizer.state.<exp_avg | "
                         "exp_avg_sq | fp32_param | param>.<weight key>) nor the distributed optimizer's "
                         "'dp_reshardable' flat buffers: " +
                         list(optimizer) + "; pass --model-only to read the weights without the optimizer state");
  std::optional<std::int64_t> step;
  if (common && !options.model_only) {
    TRESTLE_ASSIGN_OR_RETURN(step, common_step(*common));
  }
  if (!step && flat.step) step = flat.step;
  // Adam's moments without its step (and the scheduler beside it) would resume as another optimizer: common.pt lost
  // from a copy, or a common state without the optimizer's.
  const bool moments = std::any_of(tensors.begin(), tensors.end(),
                                   [](const LayoutTensor& t) { return t.name.starts_with("optimizer."); });
  if (moments && !step)
    return Status::Error(
        dir + ": holds optimizer state but not the optimizer's step, which Megatron-Core keeps in " +
        (common ? "the common state (" + common->context + " has no optimizer common_step)"
                : (fs::path(dir) / "common.pt").string() + " (missing)") +
        "; pass --model-only (train: --no-load-optim) to read the weights without the optimizer state");
  if (step) tensors.push_back({std::string(kTrestleOptimizerStep), DType::kI64, {}});
  // The learning-rate scheduler goes with the optimizer state (Trestle keeps it as the training's "scheduler").
  nlohmann::json training = nlohmann::json::object();
  if (step && common) {
    TRESTLE_ASSIGN_OR_RETURN(const auto scheduler, read_megatron_scheduler(common->root(), common->context));
    if (scheduler) training["scheduler"] = *scheduler;
  }
  // An fp16 model's loss scaler: beside the optimizer in common.pt (model space), or the distributed optimizer's.
  if (step) {
    std::optional<nlohmann::json> scaler = flat.loss_scaler;
    const PickleValue* kept = common ? common->root()->get("optimizer") : nullptr;
    if (kept && kept->get("grad_scaler")) {
      TRESTLE_ASSIGN_OR_RETURN(scaler, read_megatron_grad_scaler(kept->get("grad_scaler"), *common->archive,
                                                                 common->context + ": 'optimizer'"));
    }
    if (scaler) training["loss_scaler"] = *scaler;
  }
  if (is_megatron_args(args)) {
    // The data position Megatron-LM resumes from (its args'), the validation split's included.
    for (const char* key : kMegatronDataPositionArgs)
      if (const PickleValue* count = args->attr(key); count && count->is(PickleKind::kInt) && count->integer >= 0)
        training[key] = count->integer;
    // The run's dropout and sequence length, which Megatron-LM's --use-checkpoint-args takes.
    training["megatron_args"] = kept_megatron_args(args);
  }
  return std::unique_ptr<CanonicalSource>(new TorchDistSource(std::move(ckpt), std::move(model), iteration,
                                                              std::move(where), std::move(tensors), step,
                                                              std::move(flat), std::move(training)));
}

}  // namespace trestle
