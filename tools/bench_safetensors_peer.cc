#include "tools/bench_safetensors_peer.h"

#include <fstream>

namespace trestle::cli {
namespace {

Status write_spec(const std::string& path, const std::vector<std::vector<TensorSpec>>& shards) {
  nlohmann::json spec = {{"dtype", "bf16"}, {"prefix", "model"}, {"shards", nlohmann::json::array()}};
  for (const auto& shard : shards) {
    auto tensors = nlohmann::json::array();
    for (const TensorSpec& t : shard) {
      if (t.dtype != DType::kBF16) return Status::Error("the Python peer is only given bf16 tensors");
      tensors.push_back({t.name, t.shape});
    }
    spec["shards"].push_back(std::move(tensors));
  }
  std::ofstream out(path);
  out << spec.dump() << "\n";
  out.close();
  if (!out) return Status::Error(path + ": cannot write the peer's tensor list");
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<SafetensorsPeer>> SafetensorsPeer::start(const std::string& python, const std::string& script,
                                                                const std::string& spec_path,
                                                                const std::vector<std::vector<TensorSpec>>& shards) {
  TRESTLE_RETURN_IF_ERROR(write_spec(spec_path, shards));
  TRESTLE_ASSIGN_OR_RETURN(auto process, PeerProcess::start({python, script, "--spec", spec_path}));
  std::unique_ptr<SafetensorsPeer> peer(new SafetensorsPeer(std::move(process)));
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, peer->process_->read_line());
  peer->facts_ = nlohmann::json::parse(line, nullptr, false);
  if (peer->facts_.is_discarded() || !peer->facts_.value("ready", false))
    return Status::Error(script + ": expected a ready line, got: " + line);
  peer->facts_.erase("ready");
  return peer;
}

Result<nlohmann::json> SafetensorsPeer::ask(const std::string& request) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, process_->request(request));
  auto answer = nlohmann::json::parse(line, nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) return Status::Error("Python peer answered '" + line + "'");
  if (!answer.value("ok", false))
    return Status::Error("Python peer failed to " + request + ": " + answer.value("error", line));
  return answer;
}

Result<double> SafetensorsPeer::write(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(const auto answer, ask("write " + dir));
  return answer.value("seconds", 0.0);
}

Result<PeerReadTiming> SafetensorsPeer::read(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(const auto answer, ask("read " + dir));
  return PeerReadTiming{answer.value("seconds", 0.0), answer.value("load_file_seconds", 0.0)};
}

}  // namespace trestle::cli
