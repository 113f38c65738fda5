#include "tools/bench/bench_peer.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tools/self_exe.h"

namespace trestle::cli {

Result<std::string> find_python(const std::string& option) {
  std::string path = option, source = "--python";
  if (path.empty() && std::getenv("TRESTLE_PYTHON") != nullptr && *std::getenv("TRESTLE_PYTHON") != '\0') {
    path = std::getenv("TRESTLE_PYTHON");
    source = "$TRESTLE_PYTHON";
  }
  if (path.empty() && std::getenv("TRESTLE_VENV") != nullptr && *std::getenv("TRESTLE_VENV") != '\0') {
    path = std::string(std::getenv("TRESTLE_VENV")) + "/bin/python";
    source = "$TRESTLE_VENV";
  }
  if (path.empty()) {
    const char* home = std::getenv("HOME");
    path = std::string(home != nullptr ? home : "") + "/.cache/trestle/venv/bin/python";
    source = "the default venv (run scripts/setup)";
  }
  if (::access(path.c_str(), X_OK) != 0)
    return Status::Error("no Python at " + path + " (from " + source +
                         "); pass --python PATH, set TRESTLE_PYTHON or TRESTLE_VENV, or use --no-python");
  return path;
}

std::string corpus_file(const std::string& name) {
  if (const char* dir = std::getenv("TRESTLE_BENCH_CORPUS")) return (std::filesystem::path(dir) / name).string();
  auto here = self_exe_dir();
  return here.ok() ? (std::filesystem::path(*here) / "bench" / "corpus" / name).string() : name;
}

Result<std::string> peer_script(const std::string& peers_dir, const std::string& name) {
  std::string dir = peers_dir, source = "--peers-dir";
  const char* env = std::getenv("TRESTLE_BENCH_PEERS");
  if (dir.empty() && env != nullptr && *env != '\0') {
    dir = env;
    source = "$TRESTLE_BENCH_PEERS";
  }
  if (dir.empty()) {
    TRESTLE_ASSIGN_OR_RETURN(const std::string exe_dir, self_exe_dir());
    dir = exe_dir + "/bench/peers";
    source = "beside trestle-bench";
  }
  const std::string script = dir + "/" + name;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(script, ec))
    return Status::Error(script + " (from " + source + "): peer script not found" +
                         (ec ? ": " + ec.message() : std::string()) +
                         "; pass --peers-dir DIR (tools/bench/peers of the sources), set TRESTLE_BENCH_PEERS, or use "
                         "--no-python");
  return script;
}

Result<nlohmann::json> bf16_tensor_list(const std::vector<TensorSpec>& tensors) {
  auto list = nlohmann::json::array();
  for (const TensorSpec& t : tensors) {
    if (t.dtype != DType::kBF16) return Status::Error(t.name + ": the Python peers are only given bf16 tensors");
    list.push_back({t.name, t.shape});
  }
  return list;
}

Result<std::unique_ptr<PeerClient>> PeerClient::start(const std::string& python, const std::string& script,
                                                      const std::string& spec_path, const nlohmann::json& spec) {
  {
    std::ofstream out(spec_path);
    out << spec.dump() << "\n";
    out.close();
    if (!out) return Status::Error(spec_path + ": cannot write the peer's tensor list: " + std::strerror(errno));
  }
  TRESTLE_ASSIGN_OR_RETURN(auto process, PeerProcess::start({python, script, "--spec", spec_path}));
  std::unique_ptr<PeerClient> peer(new PeerClient(std::move(process)));
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, peer->process_->read_line());
  peer->facts_ = nlohmann::json::parse(line, nullptr, false);
  if (peer->facts_.is_discarded() || !peer->facts_.is_object() || !peer->facts_.value("ready", false))
    return Status::Error(script + ": expected a ready line, got: " + line);
  peer->facts_.erase("ready");
  return peer;
}

Result<nlohmann::json> PeerClient::ask(const std::string& request) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string line, process_->request(request));
  auto answer = nlohmann::json::parse(line, nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) return Status::Error("Python peer answered '" + line + "'");
  if (!answer.value("ok", false))
    return Status::Error("Python peer failed to " + request + ": " + answer.value("error", line));
  return answer;
}

Result<double> PeerClient::seconds(const std::string& request) {
  TRESTLE_ASSIGN_OR_RETURN(const auto answer, ask(request));
  return answer.value("seconds", 0.0);
}

}  // namespace trestle::cli
