// A Hugging Face directory as a canonical source: the bridge plan says which runs of which safetensors tensors make
// each canonical box; reads gather them from the memory-mapped shards and release the pages afterwards.
#include "convert/bridge_convert.h"
#include "convert/bridge_copy.h"
#include "convert/canonical_source.h"
#include "convert/safetensors_checkpoint.h"

#include <filesystem>
#include <map>

namespace trestle {
namespace {

class HfSource final : public CanonicalSource {
 public:
  HfSource(SafetensorsCheckpoint ckpt, BridgedModel model, BridgePlan plan, std::vector<ConstTensorView> views,
           std::vector<DType> dtypes, const std::string& dir)
      : ckpt_(std::move(ckpt)), plan_(std::move(plan)), views_(std::move(views)), dir_(dir) {
    model_ = std::move(model);
    for (std::size_t i = 0; i < plan_.tensors.size(); ++i) {
      index_[plan_.tensors[i].name] = i;
      tensors_.push_back({plan_.tensors[i].name, dtypes[i], plan_.tensors[i].shape});
    }
    side_files_dir_ = dir;
  }

  std::string description() const override { return "hf " + dir_; }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    const auto it = index_.find(name);
    if (it == index_.end()) return Status::Error(description() + ": no tensor '" + name + "'");
    if (piece.flat) return Status::Error(description() + ": '" + name + "': flat pieces are not read from safetensors");
    const BridgeTensor& t = plan_.tensors[it->second];
    TRESTLE_RETURN_IF_ERROR(gather_box(t, piece.box, views_, tensors_[it->second].dtype, out));
    for (const auto& r : t.runs) release_mapped(views_[r.hf_index].bytes());
    return OkStatus();
  }

 private:
  SafetensorsCheckpoint ckpt_;
  BridgePlan plan_;
  std::vector<ConstTensorView> views_;
  std::map<std::string, std::size_t> index_;
  std::string dir_;
};

}  // namespace

Result<std::unique_ptr<CanonicalSource>> open_hf_source(const std::string& path, const SourceOptions& options) {
  const std::string config_path =
      options.hf_config.empty() ? (std::filesystem::path(path) / "config.json").string() : options.hf_config;
  TRESTLE_ASSIGN_OR_RETURN(const auto config, read_hf_config(config_path));
  BridgedModel model;
  TRESTLE_ASSIGN_OR_RETURN(model.model, bridge_model_from_config(config));
  model.layout.norms = options.hf_norms;
  TRESTLE_ASSIGN_OR_RETURN(auto ckpt, SafetensorsCheckpoint::open(path));
  TRESTLE_ASSIGN_OR_RETURN(BridgePlan plan,
                           make_bridge_plan(model.model, options.hf_norms, detect_expert_layout(ckpt.names())));
  model.experts = plan.experts;
  model.side_files = hf_side_files(path);
  std::map<std::string, Shape> present;
  for (const auto& name : ckpt.names()) present[name] = ckpt.find(name)->entry->shape;
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, path));
  std::vector<ConstTensorView> views;
  for (const auto& t : plan.hf) {
    TRESTLE_ASSIGN_OR_RETURN(auto view, ckpt.view(t.name));
    views.push_back(view);
  }
  std::vector<DType> dtypes;
  for (const auto& t : plan.tensors) {
    const DType in = views[t.runs.front().hf_index].dtype;
    for (const auto& r : t.runs)
      if (views[r.hf_index].dtype != in)
        return Status::Error(path + ": '" + t.name + "': its sources " + plan.hf[t.runs.front().hf_index].name +
                             " and " + plan.hf[r.hf_index].name + " have different dtypes");
    dtypes.push_back(in);
  }
  return std::unique_ptr<CanonicalSource>(
      new HfSource(std::move(ckpt), std::move(model), std::move(plan), std::move(views), std::move(dtypes), path));
}

}  // namespace trestle
