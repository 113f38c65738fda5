#include "tools/bench_model.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench_report.h"

namespace trestle::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

Result<LlamaShape> llama_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  LlamaShape s = llama_shape_for_bytes(bytes, DType::kBF16);
  s.layers = std::max<std::int64_t>(pp, s.layers / pp * pp);
  // Narrow models have few KV heads: raise them to the next count that tp splits and that divides the heads.
  for (std::int64_t kv = s.kv_heads; kv <= s.heads && s.kv_heads % tp != 0; ++kv)
    if (kv % tp == 0 && s.heads % kv == 0) s.kv_heads = kv;
  if (s.kv_heads % tp != 0 || s.intermediate % tp != 0)
    return Status::Error("the generated model (" + std::to_string(s.kv_heads) + " KV heads, ffn " +
                         std::to_string(s.intermediate) + ", " + std::to_string(s.heads) +
                         " heads) does not split over tp " + std::to_string(tp) + "; a larger --size gives more heads");
  return s;
}

Status write_llama_hf_model(const std::string& dir, const LlamaShape& s) {
  StateDict state(llama_tensor_specs(s, DType::kBF16));
  TRESTLE_ASSIGN_OR_RETURN(auto writer,
                           ShardedSafetensorsWriter::create(dir, state.specs(), 1'000'000'000, {{"format", "pt"}}));
  for (std::size_t i = 0; i < state.size(); ++i)
    TRESTLE_RETURN_IF_ERROR(writer->write(state.specs()[i].name, state.bytes(i)));
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  const json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},         {"hidden_size", s.hidden},
      {"intermediate_size", s.intermediate},   {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},     {"head_dim", s.head_dim},        {"vocab_size", s.vocab},
      {"max_position_embeddings", 4096},       {"rms_norm_eps", 1e-5},          {"rope_theta", 500000.0},
      {"tie_word_embeddings", false},          {"hidden_act", "silu"},          {"torch_dtype", "bfloat16"}};
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2) << "\n";
  return OkStatus();
}

Result<ChildRun> run_child(const std::vector<std::string>& argv) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return Status::Error("pipe: " + std::string(std::strerror(errno)));
  Stopwatch clock;
  const pid_t pid = ::fork();
  if (pid < 0) return Status::Error("fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "%s: cannot run: %s\n", argv[0].c_str(), std::strerror(errno));
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  ChildRun run;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;)
    run.out.append(buffer, static_cast<std::size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  run.seconds = clock.seconds();
  run.peak_rss = static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Status::Error(argv[0] + " " + argv[1] + " failed (status " + std::to_string(status) + "): " + run.out);
  return run;
}

std::string self_exe() {
  std::error_code ec;
  return fs::read_symlink("/proc/self/exe", ec).string();
}

}  // namespace trestle::cli
