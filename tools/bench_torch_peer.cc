#include "tools/bench_torch_peer.h"

#include <filesystem>
#include <fstream>

#ifndef TRESTLE_SOURCE_DIR
#define TRESTLE_SOURCE_DIR "."
#endif

namespace trestle::cli {
namespace {

Status write_spec(const std::string& path, const std::vector<TensorSpec>& tensors) {
  nlohmann::json spec = {{"dtype", "bf16"}, {"tensors", nlohmann::json::array()}};
  for (const TensorSpec& t : tensors) {
    if (t.dtype != DType::kBF16) return Status::Error("the Python peer is only given bf16 tensors");
    spec["tensors"].push_back({t.name, t.shape});
  }
  std::ofstream out(path);
  out << spec.dump() << "\n";
  out.close();
  if (!out) return Status::Error(path + ": cannot write the peer's tensor list");
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<TorchCheckpointPeer>> TorchCheckpointPeer::start(const std::string& python,
                                                                        const std::string& peers_dir,
                                                                        const std::string& spec_path,
                                                                        const std::vector<TensorSpec>& tensors) {
  const std::string script =
      (peers_dir.empty() ? std::string(TRESTLE_SOURCE_DIR) + "/tools/peers" : peers_dir) + "/torch_checkpoint_peer.py";
  if (!std::filesystem::exists(script))
    return Status::Error(script +
                         ": peer script not found; pass --peers-dir DIR (the tools/peers folder of the "
                         "Trestle sources) or --no-python");
  TRESTLE_RETURN_IF_ERROR(write_spec(spec_path, tensors));
  TRESTLE_ASSIGN_OR_RETURN(auto process, PeerProcess::start({python, script, "--spec", spec_path}));
  std::unique_ptr<TorchCheckpointPeer> peer(new TorchCheckpointPeer(std::move(process)));
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, peer->process_->read_line());
  peer->facts_ = nlohmann::json::parse(line, nullptr, false);
  if (peer->facts_.is_discarded() || !peer->facts_.value("ready", false))
    return Status::Error(script + ": expected a ready line, got: " + line);
  peer->facts_.erase("ready");
  return peer;
}

Result<double> TorchCheckpointPeer::time(const std::string& request) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, process_->request(request));
  const auto answer = nlohmann::json::parse(line, nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) return Status::Error("Python peer answered '" + line + "'");
  if (!answer.value("ok", false))
    return Status::Error("Python peer failed to " + request + ": " + answer.value("error", line));
  return answer.value("seconds", 0.0);
}

}  // namespace trestle::cli
