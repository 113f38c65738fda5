#include "convert/sources/hf_model.h"

#include <filesystem>
#include <map>

namespace trestle {

Result<HfModel> open_hf_model(const std::string& dir, NormNaming norms, const std::string& config_path) {
  const std::string config_file =
      config_path.empty() ? (std::filesystem::path(dir) / "config.json").string() : config_path;
  TRESTLE_ASSIGN_OR_RETURN(const auto config, read_hf_config(config_file));
  TRESTLE_ASSIGN_OR_RETURN(BridgeModel model, bridge_model_from_config(config));
  TRESTLE_ASSIGN_OR_RETURN(auto files, SafetensorsCheckpoint::open(dir));
  TRESTLE_ASSIGN_OR_RETURN(BridgePlan plan, make_bridge_plan(model, norms, detect_expert_layout(files.names())));
  std::map<std::string, Shape> present;
  for (const auto& name : files.names()) present[name] = files.find(name)->entry->shape;
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, dir));
  std::vector<ConstTensorView> views;
  for (const auto& t : plan.hf) {
    TRESTLE_ASSIGN_OR_RETURN(auto view, files.view(t.name));
    views.push_back(view);
  }
  std::vector<DType> dtypes;
  for (const auto& t : plan.tensors) {
    const DType in = views[t.runs.front().hf_index].dtype;
    for (const auto& r : t.runs)
      if (views[r.hf_index].dtype != in)
        return Status::Error(dir + ": '" + t.name + "': its sources " + plan.hf[t.runs.front().hf_index].name +
                             " and " + plan.hf[r.hf_index].name + " have different dtypes");
    dtypes.push_back(in);
  }
  return HfModel{std::move(model), std::move(files), std::move(plan), std::move(dtypes)};
}

Result<std::vector<StoredTensor>> stored_hf_tensors(const SafetensorsCheckpoint& files,
                                                    const std::vector<HfTensor>& tensors) {
  std::vector<StoredTensor> out;
  for (const auto& t : tensors) {
    TRESTLE_ASSIGN_OR_RETURN(const auto located, files.find(t.name));
    out.push_back({t.name, located.file->path(), located.file->data_start() + located.entry->begin,
                   located.entry->dtype, located.entry->shape});
  }
  return out;
}

}  // namespace trestle
