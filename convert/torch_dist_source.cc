// A torch_dist (PyTorch DCP) checkpoint as a canonical source: each canonical tensor is found under its stacked or
// per-layer key (megatron_dist_names.h) and read with DcpCheckpoint::read_box, which reads only the chunks a box
// overlaps. Every stored tensor must be a model weight of the plan or non-model state (_extra_state, optimizer, RNG).
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "convert/canonical_source.h"
#include "convert/dcp_checkpoint.h"
#include "convert/megatron_dist_names.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {


class TorchDistSource final : public CanonicalSource {
 public:
  TorchDistSource(DcpCheckpoint ckpt, BridgedModel model, std::int64_t iteration,
                  std::map<std::string, DistPlacement> keys, std::vector<LayoutTensor> tensors)
      : ckpt_(std::move(ckpt)), keys_(std::move(keys)) {
    model_ = std::move(model);
    tensors_ = std::move(tensors);
    iteration_ = iteration;
    side_files_dir_ = (fs::path(ckpt_.directory()) / kSideFilesDir).string();
  }

  std::string description() const override { return "torch_dist " + ckpt_.directory(); }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    const auto it = keys_.find(name);
    if (it == keys_.end()) return Status::Error(description() + ": no tensor '" + name + "'");
    if (piece.flat) return Status::Error(description() + ": '" + name + "': flat pieces are not read from torch_dist");
    const Box box = dist_box(it->second, piece.box);
    if (Status s = ckpt_.read_box(it->second.key, box, out.data()); !s.ok())
      return Status::Error("reading tensor '" + name + "' (key '" + it->second.key + "' box " + to_string(box) +
                           "): " + s.message());
    std::lock_guard lock(mutex_);
    bytes_read_ += out.size();
    return OkStatus();
  }

 private:
  DcpCheckpoint ckpt_;
  std::map<std::string, DistPlacement> keys_;  // canonical name -> where it is stored
  mutable std::mutex mutex_;
};

}  // namespace

Result<std::pair<std::string, std::int64_t>> torch_dist_iteration_dir(const std::string& path,
                                                                      std::optional<std::int64_t> iteration) {
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(p / ".metadata", ec)) {
    std::int64_t it = 0;
    const std::string name = p.filename().string().empty() ? p.parent_path().filename().string() : p.filename().string();
    if (name.starts_with("iter_")) it = std::atoll(name.c_str() + 5);
    return std::make_pair(path, it);
  }
  if (!iteration) {
    std::ifstream tracker(p / "latest_checkpointed_iteration.txt");
    std::string text;
    if (!(tracker >> text))
      return Status::Error(path + ": neither a torch_dist directory (.metadata) nor a root with "
                                  "latest_checkpointed_iteration.txt");
    if (text == "release") return std::make_pair((p / "release").string(), std::int64_t{0});
    iteration = std::atoll(text.c_str());
  }
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(*iteration));
  if (!fs::exists(p / name / ".metadata", ec))
    return Status::Error((p / name).string() + ": no torch_dist checkpoint (.metadata) for iteration " +
                         std::to_string(*iteration));
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

}  // namespace

Result<std::unique_ptr<CanonicalSource>> open_torch_dist_source(const std::string& path, const SourceOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const auto located, torch_dist_iteration_dir(path, options.iteration));
  const auto& [dir, iteration] = located;
  TRESTLE_ASSIGN_OR_RETURN(auto ckpt, DcpCheckpoint::open(dir));
  TRESTLE_ASSIGN_OR_RETURN(const auto common, common_state(ckpt));
  const PickleValue* args = common && common->root() ? common->root()->get("args") : nullptr;
  TRESTLE_ASSIGN_OR_RETURN(BridgedModel model, megatron_source_model(options, (fs::path(dir) / kKeptModelFile).string(),
                                                                     args, dir));
  std::vector<std::string> keys;
  for (const auto& t : ckpt.metadata().tensors) keys.push_back(t.name);
  model.layout.norms = detect_norm_naming(keys);
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(model.model, model.layout.norms, model.experts));

  const auto& c = model.model.hf;
  const std::int64_t experts = model.model.is_moe() ? c.num_experts : 0;
  std::map<std::string, DistPlacement> where;
  std::map<std::string, bool> used;
  std::vector<LayoutTensor> tensors;
  for (const auto& t : plan.tensors) {
    // Stacked or per-layer keys, as either spec names an MoE layer's pre-MLP norm.
    std::vector<DistPlacement> candidates;
    for (const NormNaming spec : {NormNaming::kTransformerEngine, NormNaming::kLocal})
      for (const LayerKeys style : {LayerKeys::kStacked, LayerKeys::kPerLayer})
        candidates.push_back(dist_placement(t, style, spec, c.num_layers, experts));
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
    tensors.push_back({t.name, stored->dtype, t.shape});
    where[t.name] = std::move(p);
  }
  std::vector<std::string> unknown;
  for (const auto& k : keys)
    if (!used.count(k) && !is_non_model_dist_key(k)) unknown.push_back(k);
  if (!unknown.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unknown.size() && i < 10; ++i) list += (i ? ", " : "") + unknown[i];
    return Status::Error(dir + ": " + std::to_string(unknown.size()) + " stored tensor(s) are not weights of the " +
                         model.model.architecture + " model described by the checkpoint: " + list);
  }
  return std::unique_ptr<CanonicalSource>(
      new TorchDistSource(std::move(ckpt), std::move(model), iteration, std::move(where), std::move(tensors)));
}

}  // namespace trestle
