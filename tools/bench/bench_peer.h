// A benchmark's Python peer (tools/bench/peers/*.py): where the scripts and the interpreter are, and the one client
// for the long-lived peers: a tensor list written as JSON, a ready line with the peer's facts, then one JSON answer
// per request line, so that Python's start-up stays out of the timings.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench/bench_process.h"

namespace trestle::cli {

// The interpreter to run peers with: `option` when given, else $TRESTLE_PYTHON, else $TRESTLE_VENV/bin/python,
// else ~/.cache/trestle/venv/bin/python (where scripts/setup puts the venv). Fails when it is not executable.
Result<std::string> find_python(const std::string& option);
// The peer script `name` in `peers_dir` when given, else in $TRESTLE_BENCH_PEERS, else in bench/peers beside this
// executable (the build copies them there). Fails when it is not there.
Result<std::string> peer_script(const std::string& peers_dir, const std::string& name);
// A file of the shipped corpus and its tokenizer (bench/corpus beside this program, copied by the build), or of
// $TRESTLE_BENCH_CORPUS when set.
std::string corpus_file(const std::string& name);
// [[name, shape], ...] of bf16 tensors, as the peers read them; other dtypes are refused.
Result<nlohmann::json> bf16_tensor_list(const std::vector<TensorSpec>& tensors);

class PeerClient {
 public:
  // Writes `spec` to spec_path, starts `python script --spec spec_path` and waits for its ready line.
  static Result<std::unique_ptr<PeerClient>> start(const std::string& python, const std::string& script,
                                                   const std::string& spec_path, const nlohmann::json& spec);

  // What the peer said when ready (versions of Python and its packages, its tensors' total bytes).
  const nlohmann::json& facts() const { return facts_; }
  // Sends one request ("write DIR", "save_dcp DIR", ...: see the script) and returns its answer, which said ok.
  Result<nlohmann::json> ask(const std::string& request);
  // The seconds the peer measured for one request.
  Result<double> seconds(const std::string& request);

 private:
  explicit PeerClient(std::unique_ptr<PeerProcess> process) : process_(std::move(process)) {}
  std::unique_ptr<PeerProcess> process_;
  nlohmann::json facts_;
};

}  // namespace trestle::cli
