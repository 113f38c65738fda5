// The Python peer of `trestle bench safetensors` (tools/peers/safetensors_peer.py): one long-lived process that
// builds tensors of the same names, shapes and dtype and times safetensors.torch.save_file / load_file on request.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench_process.h"

namespace trestle::cli {

struct PeerReadTiming {
  double seconds = 0;            // load_file of every shard, then one touch per page of every tensor
  double load_file_seconds = 0;  // until the load_file calls returned (they map the files and read lazily)
};

class SafetensorsPeer {
 public:
  // Writes the shard plan to spec_path, starts `python script --spec spec_path` and waits until its tensors exist.
  static Result<std::unique_ptr<SafetensorsPeer>> start(const std::string& python, const std::string& script,
                                                        const std::string& spec_path,
                                                        const std::vector<std::vector<TensorSpec>>& shards);

  // What the peer said when ready: versions of Python, torch and safetensors, and its tensors' total bytes.
  const nlohmann::json& facts() const { return facts_; }
  // Seconds for save_file of every shard plus fsync of every file (and the index, when sharded).
  Result<double> write(const std::string& dir);
  Result<PeerReadTiming> read(const std::string& dir);

 private:
  explicit SafetensorsPeer(std::unique_ptr<PeerProcess> process) : process_(std::move(process)) {}
  Result<nlohmann::json> ask(const std::string& request);
  std::unique_ptr<PeerProcess> process_;
  nlohmann::json facts_;
};

}  // namespace trestle::cli
