// The Python peer of `trestle bench save` and `trestle bench load` (tools/peers/torch_checkpoint_peer.py): one
// long-lived process holding tensors of the same names, shapes and dtype, timing torch.distributed.checkpoint and
// torch.save / torch.load on request, so that Python's start-up stays out of the timings.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench_process.h"

namespace trestle::cli {

class TorchCheckpointPeer {
 public:
  // Finds the script in peers_dir (default: tools/peers of the sources), writes the tensor list to spec_path, starts
  // `python script --spec spec_path` and waits until its tensors exist. Only bf16 tensors.
  static Result<std::unique_ptr<TorchCheckpointPeer>> start(const std::string& python, const std::string& peers_dir,
                                                            const std::string& spec_path,
                                                            const std::vector<TensorSpec>& tensors);

  // What the peer said when ready: versions of Python and torch, and its tensors' total bytes.
  const nlohmann::json& facts() const { return facts_; }
  // Seconds the peer measured for one request ("save_dcp DIR", "load_torch FILE", ...: see the script).
  Result<double> time(const std::string& request);

 private:
  explicit TorchCheckpointPeer(std::unique_ptr<PeerProcess> process) : process_(std::move(process)) {}
  std::unique_ptr<PeerProcess> process_;
  nlohmann::json facts_;
};

}  // namespace trestle::cli
