#include "tools/bench/bench_model.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench/bench_report.h"
#include "tools/self_exe.h"

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
  const std::string config_path = (fs::path(dir) / "config.json").string();
  std::ofstream out(config_path);
  out << config.dump(2) << "\n";
  out.close();
  if (!out) return Status::Error(config_path + ": cannot write: " + std::strerror(errno));
  return OkStatus();
}

Result<std::string> trestle_exe() {
  TRESTLE_ASSIGN_OR_RETURN(const std::string dir, self_exe_dir());
  const std::string path = dir + "/trestle";
  if (::access(path.c_str(), X_OK) != 0)
    return Status::Error(path + ": the trestle CLI is not beside trestle-bench: " + std::strerror(errno));
  return path;
}

}  // namespace trestle::cli
