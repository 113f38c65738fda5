#include "convert/lora_convert.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "ckpt/byte_size.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/dtype_cast.h"
#include "ckpt/layout_save.h"
#include "ckpt/load.h"
#include "ckpt/printable_text.h"
#include "ckpt/regular_file.h"
#include "convert/checkpoint_diff.h"
#include "convert/formats/safetensors/safetensors_file.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "convert/lora_modules.h"
#include "convert/output_dir.h"
#include "convert/peft_files.h"
#include "convert/reshard.h"
#include "parallel/layout/placement.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

// A row-major fp32 matrix.
struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<float> data;
  Matrix() = default;
  Matrix(std::int64_t r, std::int64_t c) : rows(r), cols(c), data(static_cast<std::size_t>(r * c), 0.0f) {}
  float* row(std::int64_t r) { return data.data() + r * cols; }
  const float* row(std::int64_t r) const { return data.data() + r * cols; }
};

using AdapterWeights = std::map<std::string, Matrix>;  // Megatron adapter tensor name -> values

Status to_f32(DType dtype, std::span<const std::byte> bytes, Matrix& out) {
  return cast_elements(dtype, bytes, DType::kF32, std::as_writable_bytes(std::span<float>(out.data)));
}

// A B stored in pieces (lora_spec.h: <B's name>.<piece>) is worked on whole under its own name: the pieces' rows in
// order. The whole's name of a piece; empty for a tensor stored whole.
std::string whole_of_piece(const std::string& name) {
  constexpr std::string_view kOut = ".linear_out.weight.";
  const std::size_t at = name.rfind(kOut);
  return at == std::string::npos ? "" : name.substr(0, at + kOut.size() - 1);
}

// Adds each pieced B whole to `w`, which holds its pieces (`tensors`' order is the pieces' order).
void join_pieces(AdapterWeights& w, const std::vector<CanonicalTensor>& tensors) {
  std::map<std::string, std::vector<const Matrix*>> pieces;
  std::vector<std::string> order;
  for (const CanonicalTensor& t : tensors)
    if (const std::string whole = whole_of_piece(t.name); !whole.empty()) {
      if (!pieces.count(whole)) order.push_back(whole);
      pieces[whole].push_back(&w.at(t.name));
    }
  for (const std::string& whole : order) {
    std::int64_t rows = 0;
    for (const Matrix* m : pieces[whole]) rows += m->rows;
    Matrix joined(rows, pieces[whole].front()->cols);
    std::int64_t at = 0;
    for (const Matrix* m : pieces[whole]) {
      std::copy(m->data.begin(), m->data.end(), joined.row(at));
      at += m->rows;
    }
    w[whole] = std::move(joined);
  }
}

// Adds an empty whole for each pieced B of `tensors` to `w`.
void add_wholes(AdapterWeights& w, const std::vector<CanonicalTensor>& tensors) {
  for (const CanonicalTensor& t : tensors)
    if (const std::string whole = whole_of_piece(t.name); !whole.empty()) {
      Matrix& m = w[whole];
      m.cols = t.shape[1];
      m.rows += t.shape[0];
      m.data.resize(static_cast<std::size_t>(m.rows * m.cols), 0.0f);
    }
}

// Copies each pieced B's whole in `w` back into its pieces.
void split_pieces(AdapterWeights& w, const std::vector<CanonicalTensor>& tensors) {
  std::map<std::string, std::int64_t> next_row;
  for (const CanonicalTensor& t : tensors)
    if (const std::string whole = whole_of_piece(t.name); !whole.empty()) {
      const Matrix& from = w.at(whole);
      Matrix& piece = w.at(t.name);
      std::copy_n(from.row(next_row[whole]), piece.rows * piece.cols, piece.data.begin());
      next_row[whole] += piece.rows;
    }
}

// The adapter checkpoint's configuration, model and weights (fp32), every tensor lora_tensors() names checked present
// The one dtype adapters are stored in, from the dtypes of the tensors they were read from: theirs when they agree,
// else f32, which holds f16 and bf16 exactly. Adapters are combined in fp32, so f64 ones are rounded to f32. The note
// (empty when nothing changed) says so, naming `what`.
struct AdapterDType {
  DType dtype = DType::kF32;
  std::string note;
};
AdapterDType adapter_dtype(const std::set<DType>& found, const std::string& what) {
  AdapterDType out;
  if (found.count(DType::kF64)) {
    out.note = "note: " + what + " holds f64 adapters; they are combined in fp32 and stored as f32\n";
  } else if (found.size() == 1) {
    out.dtype = *found.begin();
  } else if (found.size() > 1) {
    std::string names;
    for (const DType d : found) names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
    out.note = "note: " + what + " mixes " + names + " adapters; all are stored as f32, which holds each exactly " +
               "(--dtype to choose)\n";
  }
  return out;
}

// with its shape.
struct AdapterCheckpoint {
  LoraConfig config;
  LoraBase base;
  BridgedModel model;
  std::vector<CanonicalTensor> tensors;
  AdapterWeights weights;
  AdapterDType dtype;  // the stored adapters'
  std::string directory;
};

Result<AdapterCheckpoint> read_adapter_checkpoint(const std::string& path, std::optional<std::int64_t> iteration) {
  TRESTLE_ASSIGN_OR_RETURN(CheckpointReader reader, open_checkpoint_path(path, iteration));
  const Manifest& m = reader.manifest();
  const std::string source = reader.directory() + "/manifest.json";
  if (!is_adapter_checkpoint(reader))
    return Status::Error(reader.directory() + " is not a LoRA adapter checkpoint (its manifest's model has no lora)");
  AdapterCheckpoint a;
  a.directory = reader.directory();
  TRESTLE_ASSIGN_OR_RETURN(a.config, lora_config_from_json(m.model["lora"], source));
  TRESTLE_ASSIGN_OR_RETURN(a.base, lora_base_from_json(m.model["lora"], source));
  TRESTLE_ASSIGN_OR_RETURN(a.model, bridged_model_from_json(m.model, reader.directory()));
  const GptModelSpec spec = megatron_spec(a.model.model, a.model.norms);
  auto tensors = lora_tensors(spec, a.config);
  if (!tensors.ok()) return tensors.status().with_context(source + " (model.lora)");
  a.tensors = std::move(*tensors);
  std::vector<std::vector<std::byte>> stored(a.tensors.size());
  std::vector<LoadRequest> requests;
  std::set<DType> dtypes;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const CanonicalTensor& t = a.tensors[i];
    const auto it = m.tensors.find(t.name);
    if (it == m.tensors.end()) return Status::Error(source + ": the adapter tensor " + t.name + " is missing");
    if (it->second.global_shape != t.shape)
      return Status::Error(source + ": " + t.name + " is " + to_string(it->second.global_shape) + ", expected " +
                           to_string(t.shape) + " for rank " + std::to_string(a.config.rank));
    if (!is_floating(it->second.dtype) || !can_cast(it->second.dtype, DType::kF32))
      return Status::Error(source + ": " + t.name + " is not a floating-point tensor");
    dtypes.insert(it->second.dtype);
    stored[i].resize(static_cast<std::size_t>(numel(t.shape)) * dtype_size(it->second.dtype));
    requests.push_back({t.name, Piece{whole_box(t.shape), std::nullopt}, stored[i].data()});
  }
  // Every stored adapter tensor must be one the manifest's adapter description names: one it does not (its module
  // dropped from the targets) would otherwise be left out of the merge and the export without a word.
  std::set<std::string> described;
  for (const CanonicalTensor& t : a.tensors) described.insert(t.name);
  for (const auto& [name, stored_tensor] : m.tensors)
    if (!name.starts_with("optimizer.") && !described.count(name))
      return Status::Error(source + ": the stored tensor " + name +
                           " is not one of the adapters model.lora describes (rank " + std::to_string(a.config.rank) +
                           " on target_modules " + nlohmann::json(a.config.targets).dump() +
                           "); an adapter the manifest does not account for is refused rather than left out");
  a.dtype = adapter_dtype(dtypes, a.directory);
  TRESTLE_RETURN_IF_ERROR(reader.load(requests));
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    Matrix mat(a.tensors[i].shape[0], a.tensors[i].shape[1]);
    TRESTLE_RETURN_IF_ERROR(to_f32(m.tensors.at(a.tensors[i].name).dtype, stored[i], mat));
    a.weights.emplace(a.tensors[i].name, std::move(mat));
  }
  join_pieces(a.weights, a.tensors);
  return a;
}

bool targeted(const LoraConfig& c, const std::string& target) {
  return std::find(c.targets.begin(), c.targets.end(), target) != c.targets.end();
}

// The modules the configuration adapts, each checked mappable onto a PEFT adapter.
Result<std::vector<const LoraModule*>> adapted_modules(const std::vector<LoraModule>& modules, const LoraConfig& c,
                                                       bool fused_experts) {
  std::vector<const LoraModule*> out;
  for (const LoraModule& m : modules) {
    if (!targeted(c, m.target)) continue;
    if (!m.problem.empty()) return Status::Error(m.module + " has no Hugging Face counterpart: " + m.problem);
    if (m.target == "out_proj" && m.module.find(".mixer.") != std::string::npos)
      return Status::Error("the adapter on " + m.module +
                           " has no PEFT form: peft refuses LoRA on a Mamba mixer's "
                           "out_proj (its fused kernels read the weight directly); export the merged model with "
                           "--to hf --merge-lora, or train without the out_proj target");
    for (const HfLoraModule* hf : peft_form(m, fused_experts))
      if (!hf->problem.empty())
        return Status::Error("the adapter on " + m.module + " cannot be a PEFT adapter on " +
                             (hf->parameter.empty() ? hf->name : hf->parameter) + ": " + hf->problem);
    out.push_back(&m);
  }
  return out;
}

// Whether `m`'s adapter has canonical parts (each its own A) under configuration `c`.
bool has_parts(const LoraConfig& c, const LoraModule& m) {
  return !m.parts.empty() && module_lora_type(c.type, m.routed_expert) == LoraType::kCanonical;
}

std::string part_name(const LoraModule& m, int part) { return part < 0 ? "" : m.parts[static_cast<std::size_t>(part)]; }
const Matrix& adapter(const AdapterWeights& w, const LoraModule& m, int part, bool in) {
  return w.at(lora_tensor_name(m.module, part_name(m, part), in));
}

// The PEFT factors of Hugging Face module `hf` of `m`: A [k, in] and B [hf's rows, k]. The canonical parts its rows
// span are stacked along the rank, each part's B in its own columns, so a PEFT module fusing several parts is still
// exact, at rank parts · r (r where the parts' A are one).
std::pair<Matrix, Matrix> peft_factors(const AdapterWeights& w, const LoraConfig& c, const LoraModule& m,
                                       const HfLoraModule& hf) {
  const bool parts = has_parts(c, m);
  std::vector<int> spanned{-1};
  if (parts) {
    std::set<int> seen;
    for (const std::int64_t row : hf.rows) seen.insert(m.part_of_row[static_cast<std::size_t>(row)]);
    spanned.assign(seen.begin(), seen.end());
  }
  // Parts sharing one A (imported from one PEFT module, not trained since) are that module again: one A.
  const bool shared_a = std::all_of(spanned.begin(), spanned.end(), [&](int p) {
    return adapter(w, m, p, true).data == adapter(w, m, spanned.front(), true).data;
  });
  const std::int64_t r = c.rank, blocks = shared_a ? 1 : static_cast<std::int64_t>(spanned.size());
  Matrix a(r * blocks, m.in), b(static_cast<std::int64_t>(hf.rows.size()), a.rows);
  for (std::int64_t j = 0; j < blocks; ++j) {
    const Matrix& part_a = adapter(w, m, spanned[static_cast<std::size_t>(j)], true);
    std::copy(part_a.data.begin(), part_a.data.end(), a.row(j * r));
  }
  for (std::size_t h = 0; h < hf.rows.size(); ++h) {
    const auto row = static_cast<std::size_t>(hf.rows[h]);
    const int part = parts ? m.part_of_row[row] : -1;
    const auto j = shared_a ? 0 : std::find(spanned.begin(), spanned.end(), part) - spanned.begin();
    const Matrix& part_b = adapter(w, m, part, false);
    std::copy_n(part_b.row(parts ? m.row_in_part[row] : hf.rows[h]), r, b.row(static_cast<std::int64_t>(h)) + j * r);
  }
  return {std::move(a), std::move(b)};
}

// Drops the rank components whose row of A and column of B are zero in every one of `factors` (an adapter imported
// at a lower rank than the others is padded with such components; they change nothing). Returns the rank left.
std::int64_t drop_zero_components(const std::vector<std::pair<Matrix, Matrix>*>& factors) {
  const std::int64_t rank = factors.front()->first.rows;
  std::vector<std::int64_t> kept;
  for (std::int64_t k = 0; k < rank; ++k) {
    bool used = false;
    for (const auto* f : factors) {
      const float* a = f->first.row(k);
      used = used || std::any_of(a, a + f->first.cols, [](float v) { return v != 0.0f; });
      for (std::int64_t h = 0; h < f->second.rows && !used; ++h) used = f->second.row(h)[k] != 0.0f;
    }
    if (used) kept.push_back(k);
  }
  const auto left = static_cast<std::int64_t>(kept.size());
  if (left == rank) return rank;
  for (auto* f : factors) {
    Matrix a(left, f->first.cols), b(f->second.rows, left);
    for (std::int64_t j = 0; j < left; ++j) {
      std::copy_n(f->first.row(kept[static_cast<std::size_t>(j)]), a.cols, a.row(j));
      for (std::int64_t h = 0; h < b.rows; ++h) b.row(h)[j] = f->second.row(h)[kept[static_cast<std::size_t>(j)]];
    }
    *f = {std::move(a), std::move(b)};
  }
  return left;
}

// One PEFT adapter as written: on a linear (A [r, in], B [out, r]) or on a fused expert parameter, one ParamWrapper
// over all E experts (A [E·r, in], expert e's rows e·r ...; B [out, r·E], expert e's column j at j·E + e).
struct PeftAdapter {
  std::string module;     // the linear, or the fused parameter's module
  std::string parameter;  // the fused parameter; empty for a linear
  int order = 0;          // among one module's fused parameters: registration order (fc1's, then fc2's)
  std::int64_t experts = 1;
  Matrix a, b;
  std::int64_t rank() const { return a.rows / experts; }
  const std::string& name() const { return parameter.empty() ? module : parameter; }  // what PEFT's patterns match
};

// Expert slices of one fused parameter, gathered before they make one PeftAdapter.
struct FusedSlices {
  PeftAdapter adapter;
  std::vector<std::optional<std::pair<Matrix, Matrix>>> experts;
};

// The PEFT keys' module of each adapter: a fused parameter's wrapper is nested in the wrappers of the parameters of
// its module registered after it (PEFT wraps them in registration order), each adding ".base_layer" inside.
std::map<const PeftAdapter*, std::string> peft_key_modules(const std::vector<PeftAdapter>& adapters) {
  std::map<std::string, std::vector<const PeftAdapter*>> by_module;
  std::map<const PeftAdapter*, std::string> out;
  for (const PeftAdapter& a : adapters) {
    if (a.parameter.empty()) out[&a] = a.module;
    else by_module[a.module].push_back(&a);
  }
  for (auto& [module, wrapped] : by_module) {
    std::sort(wrapped.begin(), wrapped.end(),
              [](const PeftAdapter* x, const PeftAdapter* y) { return x->order < y->order; });
    for (std::size_t i = 0; i < wrapped.size(); ++i) {
      std::string key = module;
      for (std::size_t outer = i + 1; outer < wrapped.size(); ++outer) key += ".base_layer";
      out[wrapped[i]] = key;
    }
  }
  return out;
}

Status write_json(const std::string& path, const nlohmann::ordered_json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return Status::Error(path + ": cannot write");
  return OkStatus();
}

std::string leaf(const std::string& module) { return module.substr(module.rfind('.') + 1); }

// A regular expression matching `name` alone, or (any_number) with any number in place of each component of digits
// (its layer and expert numbers).
std::string module_pattern(const std::string& name, bool any_number) {
  std::string out;
  for (std::size_t i = 0; i < name.size();) {
    std::size_t end = i;
    while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
    if (any_number && (i == 0 || name[i - 1] == '.') && end > i && (end == name.size() || name[end] == '.')) {
      out += "\\d+";
      i = end;
      continue;
    }
    if (std::string_view("\\^$.|?*+()[]{}").find(name[i]) != std::string_view::npos) out += '\\';
    out += name[i++];
  }
  return out;
}

// PEFT's target_modules for the adapted Hugging Face modules: their last components, unless those also name modules
// left without an adapter (a vision tower's q_proj beside the language model's), then a regular expression PEFT
// full-matches against exactly the adapted modules, their layer numbers generalised; where that would select others
// too, their full names listed (or, where those would, a regular expression of the full names).
void choose_peft_targets(const std::set<std::string>& adapted, const std::vector<std::string>& modules,
                         PeftAdapterConfig& config) {
  std::set<std::string> leaves;
  for (const std::string& m : adapted) leaves.insert(leaf(m));
  config.target_modules.assign(leaves.begin(), leaves.end());
  const bool exact = std::none_of(modules.begin(), modules.end(), [&](const std::string& m) {
    return !adapted.count(m) && peft_targets(config.target_modules, m);
  });
  if (exact) return;
  auto alternation = [](const std::set<std::string>& patterns) {
    std::string out = "(?:";
    for (const std::string& p : patterns) out += (out.size() > 3 ? "|" : "") + p;
    return out + ")";
  };
  auto selects_others = [&](auto&& selects) {
    return std::any_of(modules.begin(), modules.end(),
                       [&](const std::string& m) { return !adapted.count(m) && selects(m); });
  };
  std::set<std::string> general, literal;
  for (const std::string& m : adapted) {
    general.insert(module_pattern(m, true));
    literal.insert(module_pattern(m, false));
  }
  if (peft_pattern_readable(alternation(general))) {
    const std::regex generalised(alternation(general));
    if (!selects_others([&](const std::string& m) { return std::regex_match(m, generalised); })) {
      config.target_modules.clear();
      config.target_string = alternation(general);
      return;
    }
  }
  config.target_modules.assign(adapted.begin(), adapted.end());
  // (A full name also selects a module whose name ends in "." + it, as a tower's copy of the language model's might.)
  if (selects_others([&](const std::string& m) { return peft_targets(config.target_modules, m); }) &&
      peft_pattern_readable(alternation(literal))) {
    config.target_modules.clear();
    config.target_string = alternation(literal);
  }
}

// The routed experts' linears kept per expert in the files where transformers 5 fuses them on load (DeepSeek-V3,
// Qwen3-MoE, Mixtral, ...), and those linears' last names (gate_proj, up_proj, down_proj; w1, w3, w2).
struct FusedOnLoad {
  std::set<std::string> modules, leaves;
};

FusedOnLoad fused_on_load(const std::vector<LoraModule>& modules) {
  FusedOnLoad out;
  for (const LoraModule& m : modules) {
    const bool fused_too =
        std::any_of(m.hf.begin(), m.hf.end(), [](const HfLoraModule& hf) { return !hf.parameter.empty(); });
    for (const HfLoraModule& hf : m.hf)
      if (fused_too && hf.parameter.empty()) {
        out.leaves.insert(leaf(hf.name));
        out.modules.insert(hf.name);
      }
  }
  return out;
}

// Whether `module`, outside the routed experts, bears one of their linears' names (a dense layer's or a shared
// expert's MLP). Loading an adapter of such a model, peft (0.21, for DeepSeek-V3, Qwen3-MoE, Mixtral, GLM-4.5,
// Qwen3-Next) moves target_modules of those names onto the fused experts, and the adapters of these modules do not
// load; named in target_parameters by their 2-D weight instead, peft wraps each as one linear (lora_A [r, in],
// lora_B [out, r]: the same keys) and leaves them where they are.
bool named_as_experts(const FusedOnLoad& experts, const std::string& module) {
  return !experts.modules.count(module) && experts.leaves.count(leaf(module));
}

// A note on a per-expert export whose adapters on such modules peft on transformers 5 would not load, or empty.
std::string retargeted_mlp_note(const FusedOnLoad& experts, const std::vector<PeftAdapter>& adapters,
                                const std::string& architecture) {
  std::vector<std::string> outside;
  for (const PeftAdapter& p : adapters)
    if (p.parameter.empty() && named_as_experts(experts, p.module)) outside.push_back(p.module);
  if (outside.empty()) return "";
  return "note: peft on transformers 5 moves the target_modules named as the experts' projections onto the fused "
         "experts when it loads an adapter of some " +
         architecture + " models (peft 0.21 does for DeepSeek-V3, Qwen3-MoE, Mixtral, GLM-4.5, Qwen3-Next): the " +
         std::to_string(outside.size()) + " adapters on other MLPs of those names (" + outside.front() +
         (outside.size() > 1 ? ", ..." : "") +
         ") would then not load there; --hf-expert-layout fused writes them as target_parameters on their weights, "
         "which it loads (and --to hf --merge-lora exports them merged)\n";
}

// PEFT's r and lora_alpha (the most common rank, alpha keeping the adapters' scale) and rank_pattern / alpha_pattern
// for the adapters of another rank (a fused module of several canonical parts, a fused expert parameter): one pattern
// per name, with its layer and expert numbers generalised where that selects only adapters of the same rank.
void choose_peft_ranks(const std::vector<PeftAdapter>& adapters, double scale, PeftAdapterConfig& config) {
  std::map<std::int64_t, int> count;
  for (const PeftAdapter& p : adapters) ++count[p.rank()];
  config.r = std::max_element(count.begin(), count.end(), [](const auto& x, const auto& y) {
               return x.second < y.second;
             })->first;
  config.alpha = static_cast<double>(config.r) * scale;
  std::set<std::string> written;
  for (const PeftAdapter& p : adapters) {
    if (p.rank() == config.r) continue;
    std::string key = module_pattern(p.name(), true);
    const std::regex general(key);
    // (PEFT's match adds a repetition: "(.*\.)?(key)$".)
    if (!peft_pattern_key_readable(key) || std::any_of(adapters.begin(), adapters.end(), [&](const PeftAdapter& q) {
          return q.rank() != p.rank() && std::regex_match(q.name(), general);
        }))
      key = module_pattern(p.name(), false);
    if (!written.insert(key).second) continue;
    config.rank_pattern.push_back({key, nullptr, static_cast<double>(p.rank())});
    config.alpha_pattern.push_back({key, nullptr, static_cast<double>(p.rank()) * scale});
  }
}

// PEFT's target_parameters for the adapted fused parameters: their module's and their own last names ("experts.
// gate_up_proj"), unless those also name a fused parameter left without an adapter, then the full names.
std::vector<std::string> peft_parameter_targets(const std::set<std::string>& adapted,
                                                const std::set<std::string>& all) {
  std::set<std::string> endings;
  for (const std::string& p : adapted) {
    const std::size_t last = p.rfind('.');
    const std::size_t module = last == std::string::npos || last == 0 ? std::string::npos : p.rfind('.', last - 1);
    endings.insert(module == std::string::npos ? p : p.substr(module + 1));
  }
  const std::vector<std::string> short_names(endings.begin(), endings.end());
  const bool exact = std::none_of(
      all.begin(), all.end(), [&](const std::string& p) { return !adapted.count(p) && peft_targets(short_names, p); });
  return exact ? short_names : std::vector<std::string>(adapted.begin(), adapted.end());
}

// The Hugging Face model name the base was converted from, else the base's path.
std::string base_model_name(const BridgedModel& model, const std::string& base_path) {
  const auto it = model.model.hf.raw.find("_name_or_path");
  if (it != model.model.hf.raw.end() && it->is_string() && !it->get<std::string>().empty()) return *it;
  return base_path;
}

// --- import ---------------------------------------------------------------------------------------------------------

// DIR/adapter_model.safetensors, a plain file inside the directory (no symbolic link followed out of it).
Result<std::string> peft_weights_file(const std::string& dir) {
  const std::string path = (fs::path(dir) / kPeftWeightsFile).string();
  std::error_code ec;
  if (fs::is_symlink(path, ec))
    return Status::Error(path + ": a symbolic link; the adapter's files must be in its directory");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return Status::Error(path + ": not a regular file (" + file_kind(st.st_mode) + "); refused without reading it");
  if (!fs::is_regular_file(path, ec))
    return Status::Error(path + " is missing" +
                         (fs::exists(fs::path(dir) / "adapter_model.bin", ec)
                              ? " (adapter_model.bin, a pickle, is not read: save the adapter with safetensors)"
                              : ""));
  return path;
}

struct PeftTensor {
  const SafetensorsEntry* a = nullptr;
  const SafetensorsEntry* b = nullptr;
};

Status check_peft_entry(const SafetensorsEntry& e, const Shape& expected, const std::string& file,
                        const std::string& what) {
  if (!is_floating(e.dtype) || !can_cast(e.dtype, DType::kF32))
    return Status::Error(file + ": " + e.name + " is not a floating-point tensor");
  if (e.shape != expected)
    return Status::Error(file + ": " + e.name + " is " + to_string(e.shape) + ", expected " + to_string(expected) +
                         " (" + what + ")");
  return OkStatus();
}

Result<Matrix> read_entry(const SafetensorsFile& file, const SafetensorsEntry& e) {
  Matrix m(e.shape[0], e.shape[1]);
  TRESTLE_RETURN_IF_ERROR(to_f32(e.dtype, file.view(e).bytes(), m));
  return m;
}

// Copies box `box` of the whole fp32 matrix into `out` in `dtype`.
Status fill_box(const Matrix& m, const Box& box, DType dtype, std::span<std::byte> out) {
  const std::int64_t r0 = box.offset[0], c0 = box.offset[1], rows = box.shape[0], cols = box.shape[1];
  std::vector<float> part(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) std::copy_n(m.row(r0 + r) + c0, cols, part.data() + r * cols);
  return cast_elements(DType::kF32, std::as_bytes(std::span<const float>(part)), dtype, out);
}

// --- merging --------------------------------------------------------------------------------------------------------

// A weight's update as one product scale · B · A: canonical parts stacked (B block-diagonal by part rows).
struct Update {
  Matrix b, a;
  float scale = 1;
};

Update fused_update(const AdapterWeights& w, const LoraConfig& c, const LoraModule& m) {
  Update u;
  u.scale = static_cast<float>(c.scale());
  if (!has_parts(c, m)) {
    u.a = adapter(w, m, -1, true);
    u.b = adapter(w, m, -1, false);
    return u;
  }
  const std::int64_t parts = static_cast<std::int64_t>(m.parts.size()), r = c.rank;
  u.a = Matrix(parts * r, m.in);
  u.b = Matrix(m.out, parts * r);
  for (int p = 0; p < parts; ++p) {
    const Matrix& a = adapter(w, m, p, true);
    std::copy(a.data.begin(), a.data.end(), u.a.row(p * r));
  }
  for (std::int64_t row = 0; row < m.out; ++row) {
    const int p = m.part_of_row[static_cast<std::size_t>(row)];
    const Matrix& b = adapter(w, m, p, false);
    std::copy_n(b.row(m.row_in_part[static_cast<std::size_t>(row)]), r, u.b.row(row) + p * r);
  }
  return u;
}

class MergedSource final : public CanonicalSource {
 public:
  // `base_path`: the base checkpoint's directory, what a conversion must not write into (path()).
  MergedSource(std::unique_ptr<CanonicalSource> base, std::map<std::string, Update> updates, std::string adapter,
               std::string base_path)
      : base_(std::move(base)), updates_(std::move(updates)), adapter_(std::move(adapter)) {
    path_ = std::move(base_path);
    model_ = base_->model();
    tensors_ = base_->tensors();
    iteration_ = base_->iteration();
    side_files_dir_ = base_->side_files_dir();
    side_file_links_ = base_->side_file_links();
  }

  std::string description() const override { return base_->description() + " merged with " + adapter_; }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    TRESTLE_RETURN_IF_ERROR(base_->read(name, piece, out));
    bytes_read_ = base_->bytes_read();
    const auto it = updates_.find(name);
    if (it == updates_.end()) return OkStatus();
    if (piece.flat || piece.box.shape.size() != 2)
      return Status::Error(name + ": a merged weight is read in 2-D boxes, not " + to_string(piece));
    const LayoutTensor* t = find(name);
    const Update& u = it->second;
    const std::int64_t r0 = piece.box.offset[0], c0 = piece.box.offset[1];
    const std::int64_t rows = piece.box.shape[0], cols = piece.box.shape[1];
    std::vector<float> w(static_cast<std::size_t>(rows * cols));
    const auto w_bytes = std::as_writable_bytes(std::span<float>(w));
    TRESTLE_RETURN_IF_ERROR(cast_elements(t->dtype, out, DType::kF32, w_bytes));
    std::vector<float> delta(static_cast<std::size_t>(cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      std::fill(delta.begin(), delta.end(), 0.0f);
      const float* b = u.b.row(r0 + r);
      for (std::int64_t k = 0; k < u.a.rows; ++k) {
        const float bk = b[k];
        // (A fused adapter's B is block-diagonal: a zero leaves another module's A out, as PEFT's merge of each
        // module alone does, so that a non-finite value there stays in its own module's rows.)
        if (bk == 0.0f) continue;
        const float* a = u.a.row(k) + c0;
        for (std::int64_t c = 0; c < cols; ++c) delta[static_cast<std::size_t>(c)] += bk * a[c];
      }
      float* row = w.data() + r * cols;
      for (std::int64_t c = 0; c < cols; ++c) row[c] += u.scale * delta[static_cast<std::size_t>(c)];
    }
    return cast_elements(DType::kF32, w_bytes, t->dtype, out);
  }

 private:
  std::unique_ptr<CanonicalSource> base_;
  std::map<std::string, Update> updates_;
  std::string adapter_;
};

}  // namespace

bool is_adapter_checkpoint(const CheckpointReader& reader) { return reader.manifest().model.contains("lora"); }

Result<std::string> export_peft_adapter(const std::string& adapter_ckpt, const std::string& dst,
                                        const PeftExportOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const AdapterCheckpoint a, read_adapter_checkpoint(adapter_ckpt, options.iteration));
  TRESTLE_ASSIGN_OR_RETURN(const auto modules, lora_modules(a.model));
  TRESTLE_ASSIGN_OR_RETURN(const auto adapted, adapted_modules(modules, a.config, options.fused_experts));
  const DType dtype = options.dtype.value_or(a.dtype.dtype);
  std::vector<PeftAdapter> adapters;
  std::map<std::string, FusedSlices> fused;  // by parameter
  for (const LoraModule* m : adapted)
    for (const HfLoraModule* hf : peft_form(*m, options.fused_experts)) {
      auto factors = peft_factors(a.weights, a.config, *m, *hf);
      if (hf->parameter.empty()) {
        if (drop_zero_components({&factors}) > 0)
          adapters.push_back({hf->name, "", 0, 1, std::move(factors.first), std::move(factors.second)});
        continue;
      }
      FusedSlices& slices = fused[hf->parameter];
      slices.adapter.module = hf->name;
      slices.adapter.parameter = hf->parameter;
      slices.adapter.order = m->target == "linear_fc2" ? 1 : 0;
      slices.adapter.experts = hf->num_experts;
      slices.experts.resize(static_cast<std::size_t>(hf->num_experts));
      slices.experts.at(static_cast<std::size_t>(hf->expert)) = std::move(factors);
    }
  for (auto& [parameter, slices] : fused) {
    std::vector<std::pair<Matrix, Matrix>*> experts;
    for (auto& e : slices.experts) {
      if (!e) return Status::Error("the adapters of " + a.directory + " do not cover every expert of " + parameter);
      experts.push_back(&*e);
    }
    const std::int64_t rank = drop_zero_components(experts), num = slices.adapter.experts;
    if (rank == 0) continue;
    PeftAdapter& out = slices.adapter;
    out.a = Matrix(num * rank, experts.front()->first.cols);
    out.b = Matrix(experts.front()->second.rows, rank * num);
    for (std::int64_t e = 0; e < num; ++e) {
      const auto& [ea, eb] = *experts[static_cast<std::size_t>(e)];
      std::copy(ea.data.begin(), ea.data.end(), out.a.row(e * rank));
      for (std::int64_t o = 0; o < eb.rows; ++o)
        for (std::int64_t j = 0; j < rank; ++j) out.b.row(o)[j * num + e] = eb.row(o)[j];
    }
    adapters.push_back(std::move(out));
  }
  if (adapters.empty()) return Status::Error("the adapters of " + a.directory + " are all zero: nothing to export");
  const FusedOnLoad experts = fused_on_load(modules);
  TRESTLE_ASSIGN_OR_RETURN(auto all_modules, hf_modules(a.model));
  std::string note = options.dtype ? "" : a.dtype.note;
  if (options.fused_experts) {
    // As transformers 5 builds the model: no per-expert linears, and the MLPs named as them adapted by their weight.
    std::erase_if(all_modules, [&](const std::string& m) { return experts.modules.count(m) > 0; });
    for (PeftAdapter& p : adapters)
      if (p.parameter.empty() && named_as_experts(experts, p.module)) p.parameter = p.module + ".weight";
  } else {
    note = retargeted_mlp_note(experts, adapters, a.model.model.architecture);
  }

  PeftAdapterConfig config;
  choose_peft_ranks(adapters, a.config.scale(), config);
  config.dropout = a.config.dropout;
  const bool any_parameter =
      std::any_of(adapters.begin(), adapters.end(), [](const PeftAdapter& p) { return !p.parameter.empty(); });
  if (any_parameter && config.dropout > 0) {
    config.dropout = 0;
    note += "lora_dropout is written as 0 (it was " + std::to_string(a.config.dropout) +
            "): peft refuses dropout on target_parameters; dropout acts in training only\n";
  }
  std::set<std::string> hf_adapted, parameters_adapted, all_parameters;
  for (const PeftAdapter& p : adapters) (p.parameter.empty() ? hf_adapted : parameters_adapted).insert(p.name());
  for (const LoraModule& m : modules)
    for (const HfLoraModule& hf : m.hf)
      if (!hf.parameter.empty()) all_parameters.insert(hf.parameter);
  for (const std::string& m : all_modules) all_parameters.insert(m + ".weight");
  choose_peft_targets(hf_adapted, all_modules, config);
  config.target_parameters = peft_parameter_targets(parameters_adapted, all_parameters);
  config.base_model = base_model_name(a.model, a.base.path);
  const auto key_modules = peft_key_modules(adapters);
  std::map<std::string, const Matrix*> out;  // PEFT key -> values
  for (const PeftAdapter& p : adapters) {
    out.emplace(peft_key(key_modules.at(&p), true), &p.a);
    out.emplace(peft_key(key_modules.at(&p), false), &p.b);
  }

  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, adapter_ckpt));
  std::vector<TensorSpec> specs;
  std::uint64_t bytes = 0;
  for (const auto& [key, m] : out) {
    specs.push_back({key, dtype, Shape{m->rows, m->cols}});
    bytes += specs.back().nbytes();
  }
  {
    TRESTLE_ASSIGN_OR_RETURN(
        auto writer, SafetensorsWriter::create(output.path() + "/" + kPeftWeightsFile, specs, {{"format", "pt"}}));
    for (const auto& [key, m] : out) {
      std::vector<std::byte> bytes_out(static_cast<std::size_t>(m->rows * m->cols) * dtype_size(dtype));
      TRESTLE_RETURN_IF_ERROR(
          cast_elements(DType::kF32, std::as_bytes(std::span<const float>(m->data)), dtype, bytes_out));
      TRESTLE_RETURN_IF_ERROR(writer->write(key, bytes_out));
    }
    TRESTLE_RETURN_IF_ERROR(writer->commit());
  }
  TRESTLE_RETURN_IF_ERROR(write_json(output.path() + "/" + kPeftConfigFile, peft_config_json(config)));
  TRESTLE_RETURN_IF_ERROR(output.commit());
  std::ostringstream summary;
  summary << "wrote " << dst << ": a PEFT LoRA adapter of rank " << config.r << ", alpha " << config.alpha
          << (config.rank_pattern.empty() ? "" : " (other ranks in rank_pattern)") << " on " << hf_adapted.size()
          << " modules ("
          << (config.target_string.empty() ? nlohmann::json(config.target_modules)
                                           : nlohmann::json(config.target_string))
                 .dump()
          << ")";
  if (!parameters_adapted.empty())
    summary << " and " << parameters_adapted.size() << " parameters ("
            << nlohmann::json(config.target_parameters).dump() << ")";
  summary << ", " << format_bytes(bytes) << " (" << dtype_name(dtype) << ") from " << a.directory << "\n" << note;
  return summary.str();
}

Result<std::string> import_peft_adapter(const std::string& peft_dir, const std::string& base, const std::string& dst,
                                        const PeftImportOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const PeftAdapterConfig peft, read_peft_config(peft_dir));
  TRESTLE_ASSIGN_OR_RETURN(const std::string file_path, peft_weights_file(peft_dir));
  TRESTLE_ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::open(file_path));

  // The base and its modules.
  TRESTLE_ASSIGN_OR_RETURN(CheckpointReader base_reader, open_checkpoint_path(base, std::nullopt));
  if (is_adapter_checkpoint(base_reader))
    return Status::Error("--base " + base_reader.directory() + " is itself an adapter checkpoint; give the full model");
  TRESTLE_ASSIGN_OR_RETURN(const LoraBase recorded_base, lora_base_of(base_reader));
  const std::string& base_dir = recorded_base.path;
  TRESTLE_ASSIGN_OR_RETURN(BridgedModel model, bridged_model_from_json(base_reader.manifest().model, base_dir));
  TRESTLE_ASSIGN_OR_RETURN(const auto modules, lora_modules(model));
  if (!peft.layers_to_transform.empty()) {
    // Trestle's adapters sit on every decoder layer: a list naming them all is no restriction, a subset is one.
    std::set<std::int64_t> listed(peft.layers_to_transform.begin(), peft.layers_to_transform.end());
    for (std::int64_t layer = 0; layer < model.model.hf.num_layers; ++layer)
      if (!listed.count(layer))
        return Status::Error(peft_dir + "/adapter_config.json (layers_to_transform) = " +
                             nlohmann::json(peft.layers_to_transform).dump() + ": a subset of the " +
                             std::to_string(model.model.hf.num_layers) + " layers (layer " + std::to_string(layer) +
                             " is not adapted), which Trestle's LoRA adapters cannot be restricted to");
  }

  // Every Hugging Face module an adapter could sit on, and every fused expert parameter (one slice per expert); the
  // targets must each select at least one.
  std::map<std::string, std::pair<const LoraModule*, const HfLoraModule*>> by_hf;
  struct FusedTarget {
    std::string module;
    int order = 0;
    std::vector<std::pair<const LoraModule*, const HfLoraModule*>> experts;
  };
  std::map<std::string, FusedTarget> by_parameter;
  // (PEFT wraps linears: a fused experts' parameter, which target_modules' names may also match, is not one.)
  for (const LoraModule& m : modules)
    for (const HfLoraModule& hf : m.hf) {
      if (hf.linear) by_hf[hf.name] = {&m, &hf};
      if (hf.parameter.empty() || hf.expert < 0) continue;
      FusedTarget& t = by_parameter[hf.parameter];
      t.module = hf.name;
      t.order = m.target == "linear_fc2" ? 1 : 0;
      t.experts.resize(static_cast<std::size_t>(hf.num_experts));
      t.experts.at(static_cast<std::size_t>(hf.expert)) = {&m, &hf};
    }
  const std::string config_path = peft_dir + "/" + kPeftConfigFile;
  if (!peft.target_string.empty() &&
      std::none_of(by_hf.begin(), by_hf.end(), [&](const auto& e) { return peft_targets(peft, e.first); }))
    return Status::Error(config_path + " (target_modules): " + nlohmann::json(peft.target_string).dump() +
                         " selects no linear of the " + model.model.architecture + " model of " + base_dir +
                         " that LoRA adapts");
  // As peft: a listed name that selects nothing in this model is passed over (one list serves many models), one that
  // selects a module LoRA cannot adapt is refused, and the list must select something.
  TRESTLE_ASSIGN_OR_RETURN(const auto all_modules, hf_modules(model));
  for (const std::string& t : peft.target_modules) {
    const bool found =
        std::any_of(by_hf.begin(), by_hf.end(), [&](const auto& e) { return peft_targets({t}, e.first); });
    const auto other = std::find_if(all_modules.begin(), all_modules.end(),
                                    [&](const std::string& m) { return peft_targets({t}, m); });
    if (!found && other != all_modules.end())
      return Status::Error(config_path + " (target_modules): '" + t + "' selects " + *other + ", no linear of the " +
                           model.model.architecture + " model of " + base_dir + " that LoRA adapts");
  }
  if (!peft.target_modules.empty() && peft.target_parameters.empty() &&
      std::none_of(by_hf.begin(), by_hf.end(), [&](const auto& e) { return peft_targets(peft, e.first); }))
    return Status::Error(config_path + " (target_modules): " + nlohmann::json(peft.target_modules).dump() +
                         " selects no linear of the " + model.model.architecture + " model of " + base_dir +
                         " that LoRA adapts");
  // target_parameters may also name a linear's 2-D weight ("mlp.gate_proj.weight"): peft wraps it as one linear. The
  // routed experts' per-expert linears are not among them where transformers 5 fuses them (their fused parameters are).
  const FusedOnLoad fused_experts = fused_on_load(modules);
  auto weight_targeted = [&](const std::string& linear) {
    return !fused_experts.modules.count(linear) && peft_targets_parameter(peft, linear + ".weight");
  };
  for (const std::string& t : peft.target_parameters) {
    const bool found = std::any_of(by_parameter.begin(), by_parameter.end(),
                                   [&](const auto& e) { return peft_targets({t}, e.first); }) ||
                       std::any_of(by_hf.begin(), by_hf.end(), [&](const auto& e) {
                         return !fused_experts.modules.count(e.first) && peft_targets({t}, e.first + ".weight");
                       });
    if (!found)
      return Status::Error(config_path + " (target_parameters): '" + t +
                           "' is neither a fused expert parameter nor a linear's weight of the " +
                           model.model.architecture + " model of " + base_dir + " that LoRA adapts");
  }

  // What the adapter must hold: per PEFT key module, a linear or a fused parameter, with its rank and alpha.
  struct Expected {
    const std::pair<const LoraModule*, const HfLoraModule*>* linear = nullptr;
    const FusedTarget* fused = nullptr;
    std::string name;  // the module or the parameter, as PEFT's patterns and errors name it
    std::int64_t rank = 0;
    double alpha = 0;
    const char* field = "target_modules";  // what selects it
  };
  std::map<std::string, Expected> expected;
  for (const auto& [name, entry] : by_hf) {
    const bool as_module = peft_targets(peft, name), as_weight = weight_targeted(name);
    if (as_module && as_weight)
      return Status::Error(config_path + ": " + name + " is selected by target_modules and by target_parameters (" +
                           name + ".weight); peft refuses to wrap one linear twice");
    if (as_module) expected[name] = {&entry, nullptr, name, 0, 0};
    if (as_weight) expected[name] = {&entry, nullptr, name + ".weight", 0, 0, "target_parameters"};
  }
  {
    std::vector<PeftAdapter> wrapped;  // the selected fused parameters, for their keys' nesting
    std::vector<const std::string*> names;
    for (const auto& [name, target] : by_parameter)
      if (peft_targets_parameter(peft, name)) {
        wrapped.push_back({target.module, name, target.order, 1, {}, {}});
        names.push_back(&name);
      }
    const auto keys = peft_key_modules(wrapped);
    for (std::size_t i = 0; i < wrapped.size(); ++i)
      expected[keys.at(&wrapped[i])] = {nullptr, &by_parameter.at(*names[i]), *names[i], 0, 0, "target_parameters"};
  }
  // Routed experts' per-expert linears that transformers 5 does not build (it fuses them): target_modules naming them
  // (a regular expression over the MLP's projections) adapt nothing there, so an adapter without a key for any of
  // them is read as made on transformers 5; one with some keys must have all.
  {
    std::set<std::string> in_file;
    for (const SafetensorsEntry& t : file.tensors())
      if (const auto key = parse_peft_key(t.name)) in_file.insert(key->module);
    const bool per_expert_in_file = std::any_of(expected.begin(), expected.end(), [&](const auto& e) {
      return e.second.linear && fused_experts.modules.count(e.first) && in_file.count(e.first);
    });
    if (!per_expert_in_file)
      std::erase_if(expected, [&](const auto& e) { return e.second.linear && fused_experts.modules.count(e.first); });
    if (expected.empty())
      return Status::Error(config_path +
                           ": the targets select only routed experts' per-expert linears, which "
                           "transformers 5 fuses, and " +
                           file_path + " holds none of their adapters");
  }
  for (auto& [key, e] : expected) {
    e.rank = peft_rank(peft, e.name);
    e.alpha = peft_alpha(peft, e.name);
  }
  // The keys: exactly lora_A and lora_B of every selected module or parameter.
  std::map<std::string, PeftTensor> present;
  for (const SafetensorsEntry& e : file.tensors()) {
    const auto key = parse_peft_key(e.name);
    if (!key || !expected.count(key->module))
      return Status::Error(file_path + ": unexpected tensor " + e.name + " (not lora_A / lora_B of a target module " +
                           "or parameter of the " + model.model.architecture + " model)");
    (key->a ? present[key->module].a : present[key->module].b) = &e;
  }
  // One scale for all (Trestle's adapters share alpha / rank): the rank is the highest, lower ranks padded with zero
  // components, which change nothing and stay zero in training.
  std::int64_t rank = 0;
  double scale = 0;
  std::string scale_of;
  for (const auto& [key, e] : expected) {
    const auto it = present.find(key);
    for (const bool a : {true, false})
      if (it == present.end() || !(a ? it->second.a : it->second.b))
        return Status::Error(file_path + ": missing " + peft_key(key, a) + " (" + e.field + " selects " + e.name + ")");
    if (e.linear && (!e.linear->first->problem.empty() || !e.linear->second->problem.empty()))
      return Status::Error(file_path + ": the adapter on " + e.name + " has no Trestle counterpart: " +
                           (e.linear->first->problem.empty() ? e.linear->second->problem : e.linear->first->problem));
    const double s = e.alpha / static_cast<double>(e.rank);
    if (scale_of.empty()) {
      scale = s;
      scale_of = e.name;
    } else if (std::abs(s - scale) > 1e-12 * scale) {
      return Status::Error(config_path + ": " + e.name + " has the scale alpha / r = " + std::to_string(s) + " and " +
                           scale_of + " " + std::to_string(scale) +
                           " (rank_pattern, alpha_pattern); Trestle's adapters share one scale");
    }
    rank = std::max(rank, e.rank);
  }

  // The Trestle configuration: canonical when a fused Megatron linear has separate Hugging Face projections; peft
  // when besides those only routed experts have one PEFT module over several parts (a fused gate_up_proj).
  LoraConfig config;
  config.rank = rank;
  config.alpha = scale * static_cast<double>(rank);
  config.dropout = peft.dropout;
  config.targets.clear();
  std::set<const LoraModule*> adapted;
  bool separate = false, separate_expert = false, shared = false, shared_outside_experts = false;
  auto weigh = [&](const LoraModule& m, const HfLoraModule& hf) {
    adapted.insert(&m);
    if (m.parts.empty()) return;
    (hf.part >= 0 ? separate : shared) = true;
    separate_expert = separate_expert || (hf.part >= 0 && m.routed_expert);
    shared_outside_experts = shared_outside_experts || (hf.part < 0 && !m.routed_expert);
  };
  for (const auto& [key, e] : expected) {
    if (e.linear) weigh(*e.linear->first, *e.linear->second);
    if (e.fused)
      for (const auto& [m, hf] : e.fused->experts) {
        if (!m) return Status::Error(e.name + ": the model's plan lacks some of its experts' slices");
        if (!hf->problem.empty())
          return Status::Error(file_path + ": the adapter on " + e.name +
                               " has no Trestle counterpart: " + hf->problem);
        weigh(*m, *hf);
      }
  }
  config.type = !separate                                               ? LoraType::kLora
                : shared && !shared_outside_experts && !separate_expert ? LoraType::kPeft
                                                                        : LoraType::kCanonical;
  for (const std::string& target : lora_target_modules())
    if (std::any_of(adapted.begin(), adapted.end(), [&](const LoraModule* m) { return m->target == target; }))
      config.targets.push_back(target);
  const GptModelSpec spec = megatron_spec(model.model, model.norms);
  TRESTLE_ASSIGN_OR_RETURN(const auto tensors, lora_tensors(spec, config));
  AdapterWeights weights;
  for (const CanonicalTensor& t : tensors) weights.emplace(t.name, Matrix(t.shape[0], t.shape[1]));
  add_wholes(weights, tensors);
  std::set<DType> dtypes;
  std::map<const LoraModule*, std::set<int>> taken;  // per module, the parts (or -1: the whole) whose A is set
  // Places one PEFT module's A [k, in] and B [rows, k] (k <= rank) on `hf`'s rows of `m`.
  auto place = [&](const LoraModule& m, const HfLoraModule& hf, const Matrix& a, const Matrix& b) -> Status {
    const bool parts = has_parts(config, m);
    // Each part (or the whole) this module's rows feed takes its A; its B rows go to their place.
    std::set<int> fed;
    for (std::size_t h = 0; h < hf.rows.size(); ++h) {
      const std::int64_t row = hf.rows[h];
      const int part = parts ? m.part_of_row[static_cast<std::size_t>(row)] : -1;
      fed.insert(part);
      Matrix& out_b = weights.at(lora_tensor_name(m.module, part_name(m, part), false));
      std::copy_n(b.row(static_cast<std::int64_t>(h)), b.cols,
                  out_b.row(parts ? m.row_in_part[static_cast<std::size_t>(row)] : row));
    }
    for (const int part : fed) {
      const std::string a_name = lora_tensor_name(m.module, part_name(m, part), true);
      if (!taken[&m].insert(part).second)
        return Status::Error(file_path + ": " + (hf.parameter.empty() ? hf.name : hf.parameter) +
                             " and another PEFT module both adapt " + a_name + " with their own A");
      std::copy(a.data.begin(), a.data.end(), weights.at(a_name).data.begin());
    }
    return OkStatus();
  };
  for (const auto& [key, e] : expected) {
    const PeftTensor& p = present.at(key);
    dtypes.insert({p.a->dtype, p.b->dtype});
    const std::string what = "rank " + std::to_string(e.rank) + " of " + kPeftConfigFile;
    if (e.linear) {
      const auto [m, hf] = *e.linear;
      TRESTLE_RETURN_IF_ERROR(check_peft_entry(*p.a, Shape{e.rank, m->in}, file_path, what));
      TRESTLE_RETURN_IF_ERROR(
          check_peft_entry(*p.b, Shape{static_cast<std::int64_t>(hf->rows.size()), e.rank}, file_path, what));
      TRESTLE_ASSIGN_OR_RETURN(const Matrix a, read_entry(file, *p.a));
      TRESTLE_ASSIGN_OR_RETURN(const Matrix b, read_entry(file, *p.b));
      TRESTLE_RETURN_IF_ERROR(place(*m, *hf, a, b));
      continue;
    }
    // A fused parameter: expert j's A is rows [j·r, (j+1)·r), its B column k is column k·E + j.
    const auto num = static_cast<std::int64_t>(e.fused->experts.size());
    const auto& [m0, hf0] = e.fused->experts.front();
    const std::string fused_what = what + ", " + std::to_string(num) + " experts";
    TRESTLE_RETURN_IF_ERROR(check_peft_entry(*p.a, Shape{num * e.rank, m0->in}, file_path, fused_what));
    TRESTLE_RETURN_IF_ERROR(check_peft_entry(*p.b, Shape{static_cast<std::int64_t>(hf0->rows.size()), e.rank * num},
                                             file_path, fused_what));
    TRESTLE_ASSIGN_OR_RETURN(const Matrix a, read_entry(file, *p.a));
    TRESTLE_ASSIGN_OR_RETURN(const Matrix b, read_entry(file, *p.b));
    for (std::int64_t j = 0; j < num; ++j) {
      const auto& [m, hf] = e.fused->experts[static_cast<std::size_t>(j)];
      Matrix ea(e.rank, a.cols), eb(b.rows, e.rank);
      std::copy_n(a.row(j * e.rank), e.rank * a.cols, ea.data.begin());
      for (std::int64_t o = 0; o < b.rows; ++o)
        for (std::int64_t k = 0; k < e.rank; ++k) eb.row(o)[k] = b.row(o)[k * num + j];
      TRESTLE_RETURN_IF_ERROR(place(*m, *hf, ea, eb));
    }
  }
  const AdapterDType found = adapter_dtype(dtypes, file_path);
  const DType dtype = options.dtype.value_or(found.dtype);
  split_pieces(weights, tensors);
  // A PEFT module over several canonical parts beside modules of one part each: canonical adapters hold it exactly,
  // but give each part its own A from here on.
  std::string note = options.dtype ? "" : found.note;
  if (config.type == LoraType::kCanonical)
    for (const auto& [key, e] : expected) {
      const auto [m, hf] = e.linear ? *e.linear : e.fused->experts.front();
      if (m->parts.empty() || hf->part >= 0) continue;
      note = "note: " + e.name + " is one PEFT adapter over several of " + m->target +
             "'s parts; imported exactly as canonical adapters (the file's other modules need them), which give each "
             "part its own A from here on, so training departs from peft's\n" +
             note;
      break;
    }
  // Per-expert gate and up adapters (transformers 4's layout; Trestle's default export): peft on transformers 5 loads
  // them as one adapter on each expert's fused gate_up_proj, whose off-diagonal blocks then train too.
  for (const auto& [key, e] : expected)
    if (e.linear && e.linear->first->routed_expert && e.linear->first->target == "linear_fc1" &&
        e.linear->second->part >= 0) {
      note = "note: " + file_path +
             " holds per-expert gate and up adapters; peft on transformers 5 loads them as one adapter on each "
             "expert's fused gate_up_proj (rank 2r, B block-diagonal) and trains B's off-diagonal blocks too: here "
             "they train as the separate adapters the file holds, so training departs from peft's there\n" +
             note;
      break;
    }

  // The adapter checkpoint, in the asked layout.
  ParallelLayout layout = options.layout;
  if (options.pipeline_layout) {
    TRESTLE_ASSIGN_OR_RETURN(layout, with_pipeline_layout(layout, *options.pipeline_layout, model.model));
  }
  TRESTLE_RETURN_IF_ERROR(
      check_layout(layout, spec.num_layers, spec.num_query_groups, spec.is_moe() ? spec.num_experts : 0));
  std::vector<PlacedTensor> placed;
  for (const CanonicalTensor& t : tensors) placed.push_back({&t, Holding::kModelWeight, t.shape});
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks, place_on_ranks(placed, spec, layout));
  std::vector<LayoutTensor> layout_tensors;
  for (const CanonicalTensor& t : tensors) layout_tensors.push_back({t.name, dtype, t.shape});
  BridgedModel written = model;
  written.layout = layout;
  CheckpointInfo info;
  info.iteration = options.iteration;
  info.layout = layout_sizes_to_json(layout);
  TRESTLE_ASSIGN_OR_RETURN(info.model, checked_bridged_model_json(written, dst));
  info.model["lora"] = lora_to_json(config, recorded_base);
  TRESTLE_RETURN_IF_ERROR(check_output_outside_source(dst, base));
  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, peft_dir));
  auto fill = [&](const RankPiece& piece, std::span<std::byte> out) -> Status {
    return fill_box(weights.at(tensors[piece.tensor].name), piece.piece.box, dtype, out);
  };
  LayoutSaveOptions save{options.save, 2, options.progress, "hf-peft -> trestle " + fs::path(dst).filename().string()};
  TRESTLE_ASSIGN_OR_RETURN(const LayoutSaveReport saved,
                           save_layout(output.path(), info, layout_tensors, ranks, fill, save));
  TRESTLE_RETURN_IF_ERROR(output.commit());
  std::ostringstream summary;
  summary << "wrote " << dst << ": " << lora_type_name(config.type) << " adapters of rank " << config.rank << ", alpha "
          << config.alpha << " on " << nlohmann::json(config.targets).dump() << " (" << adapted.size()
          << " Megatron linears from " << present.size() << " PEFT modules), " << tensors.size() << " tensors, "
          << format_bytes(saved.bytes_written) << "; base " << base_dir << "\n"
          << note;
  return summary.str();
}

Result<LoraBase> lora_base_of(const CheckpointReader& base) {
  const std::string dir = fs::absolute(base.directory()).lexically_normal().string();
  TRESTLE_ASSIGN_OR_RETURN(std::string digest, manifest_file_digest(dir + "/" + kManifestFile));
  TRESTLE_ASSIGN_OR_RETURN(std::string origin,
                           weights_origin_digest(base.manifest().training, dir + "/" + kManifestFile));
  return LoraBase{dir, std::move(digest), std::move(origin)};
}

namespace {

// The first place two JSON values differ, as a dotted path under `at` ("model.hf.config.dtype").
std::string first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at) {
  if (!a.is_object() || !b.is_object()) return at;
  for (const auto* side : {&a, &b})
    for (const auto& [name, value] : side->items()) {
      const auto other = (side == &a ? b : a).find(name);
      if (other == (side == &a ? b : a).end()) return at + "." + name;
      if (*other != value) return first_difference(a[name], b[name], at + "." + name);
    }
  return at;
}

}  // namespace

Result<std::string> check_lora_base(const LoraBase& recorded, LoraBase& given, const std::string& adapters,
                                    bool progress) {
  if (given.manifest_digest == recorded.manifest_digest) return std::string();
  if (given.weights_origin == recorded.weights_origin)
    return "note: the base " + given.path + " holds the weights the adapters of " + adapters + " were trained on (" +
           recorded.path + ") in another layout or copy: their weights origin is " + given.weights_origin;
  const std::string differs = given.path + " is not the base the adapters of " + adapters + " were trained on: its " +
                              "manifest's digest is " + given.manifest_digest + " (weights origin " +
                              given.weights_origin + "), the adapters recorded " + recorded.manifest_digest +
                              " (weights origin " + recorded.weights_origin + ") at " + recorded.path;
  // Not known as the same weights: compared with the recorded base itself, where it is still there as recorded.
  const std::string unreadable = differs + "; the recorded base cannot be read to compare their tensors: ";
  auto original = open_checkpoint_path(recorded.path, std::nullopt);
  if (!original.ok()) return Status::Error(unreadable + original.status().message());
  auto there = lora_base_of(*original);
  if (!there.ok()) return Status::Error(unreadable + there.status().message());
  if (there->manifest_digest != recorded.manifest_digest)
    return Status::Error(differs + "; " + recorded.path + " now holds another manifest (digest " +
                         there->manifest_digest + "), so the base the adapters were trained on is gone");
  auto current = open_checkpoint_path(given.path, std::nullopt);
  if (!current.ok()) return current.status();
  nlohmann::json model = current->manifest().model, recorded_model = original->manifest().model;
  for (nlohmann::json* m : {&model, &recorded_model})
    if (m->is_object()) m->erase("parallel");  // (the layout may differ)
  if (model != recorded_model)
    return Status::Error(differs + "; their manifests describe other models (" +
                         first_difference(model, recorded_model, "model") + " differs)");
  SourceOptions options;
  options.model_only = true;
  if (progress)
    std::fprintf(stderr, "note: comparing every tensor of %s with the recorded base %s (their manifests differ)\n",
                 given.path.c_str(), recorded.path.c_str());
  TRESTLE_ASSIGN_OR_RETURN(const auto ours, open_trestle_source(given.path, options));
  auto theirs = open_trestle_source(recorded.path, options);
  if (!theirs.ok()) return Status::Error(unreadable + theirs.status().message());
  auto diff = diff_checkpoints(*ours, **theirs, progress);
  if (!diff.ok()) return Status::Error(differs + "; comparing their tensors failed: " + diff.status().message());
  for (const TensorDiff& t : diff->tensors) {
    if (t.bit_equal()) continue;
    std::string what;
    switch (t.kind) {
      case TensorDiff::Kind::kOnlyInFirst:
        what = "is not in the recorded base";
        break;
      case TensorDiff::Kind::kOnlyInSecond:
        what = "is missing (the recorded base has it)";
        break;
      case TensorDiff::Kind::kIncompatible:
        what = "is another tensor (" + t.detail + ")";
        break;
      default:
        what = "differs from the recorded base's in " + std::to_string(t.bits_differing) + " of " +
               std::to_string(t.elements) + " elements";
    }
    return Status::Error(differs + "; its tensor " + t.name + " " + what);
  }
  given.weights_origin = recorded.weights_origin;  // the same weights, bit for bit
  return "note: the base " + given.path + " is another checkpoint than the one the adapters of " + adapters +
         " recorded (" + recorded.path + "), with the same model and every tensor equal bit for bit (" +
         std::to_string(diff->tensors.size()) + " compared)";
}

Result<std::unique_ptr<CanonicalSource>> open_merged_lora_source(const std::string& adapter_ckpt,
                                                                 std::optional<std::int64_t> iteration,
                                                                 const std::optional<std::string>& base,
                                                                 bool progress) {
  TRESTLE_ASSIGN_OR_RETURN(const AdapterCheckpoint a, read_adapter_checkpoint(adapter_ckpt, iteration));
  const std::string base_path = base.value_or(a.base.path);
  auto base_reader = open_checkpoint_path(base_path, std::nullopt);
  if (!base_reader.ok())
    return Status::Error("the base of " + a.directory + " (" + base_path + "): " + base_reader.status().message() +
                         (base ? "" : "; give its location with --base"));
  const std::string base_dir = base_reader->directory();
  if (is_adapter_checkpoint(*base_reader))
    return Status::Error("--base " + base_dir +
                         " is itself an adapter checkpoint; give the full model the adapters of " + a.directory +
                         " were trained on");
  TRESTLE_ASSIGN_OR_RETURN(LoraBase given, lora_base_of(*base_reader));
  TRESTLE_ASSIGN_OR_RETURN(const std::string base_note, check_lora_base(a.base, given, a.directory, progress));
  if (!base_note.empty()) std::fprintf(stderr, "trestle convert: %s\n", printable_text(base_note).c_str());
  SourceOptions source_options;
  source_options.iteration = base_reader->manifest().iteration;
  const std::string base_root = fs::path(base_dir).parent_path().string();
  TRESTLE_ASSIGN_OR_RETURN(auto source, open_trestle_source(base_root, source_options));
  TRESTLE_ASSIGN_OR_RETURN(const auto modules, lora_modules(a.model));
  std::map<std::string, Update> updates;
  for (const LoraModule& m : modules) {
    if (!targeted(a.config, m.target)) continue;
    if (!m.problem.empty()) return Status::Error(m.module + ": " + m.problem);
    // The weight, or each of its pieces with its rows of B.
    std::vector<std::pair<std::string, std::int64_t>> stored = m.pieces;
    if (stored.empty()) stored.emplace_back("", m.out);
    Update whole = fused_update(a.weights, a.config, m);
    std::int64_t first = 0;
    for (const auto& [piece, rows] : stored) {
      const std::string name = m.module + ".weight" + (piece.empty() ? "" : "." + piece);
      const LayoutTensor* weight = source->find(name);
      if (!weight || weight->shape != Shape{rows, m.in})
        return Status::Error(source->description() + " has no " + name + " of shape " + to_string(Shape{rows, m.in}));
      Update u{Matrix(rows, whole.b.cols), whole.a, whole.scale};
      std::copy_n(whole.b.row(first), rows * whole.b.cols, u.b.data.begin());
      updates.emplace(name, std::move(u));
      first += rows;
    }
  }
  return std::unique_ptr<CanonicalSource>(
      new MergedSource(std::move(source), std::move(updates), a.directory, base_root));
}

std::string describe_adapter_checkpoint(const CheckpointReader& reader) {
  const std::string source = reader.directory() + "/manifest.json";
  const auto config = lora_config_from_json(reader.manifest().model["lora"], source);
  const auto base = lora_base_from_json(reader.manifest().model["lora"], source);
  if (!config.ok()) return "LoRA adapters: " + printable_text(config.status().message()) + "\n";
  std::ostringstream out;
  out << "LoRA adapters  " << lora_type_name(config->type) << ", rank " << config->rank << ", alpha " << config->alpha
      << " (scale " << config->scale() << "), dropout " << config->dropout << ", on "
      << nlohmann::json(config->targets).dump() << "\n";
  if (!base.ok()) out << "base           (" << printable_text(base.status().message()) << ")\n";
  if (base.ok())
    out << "base           " << printable_text(base->path) << " (manifest xxh3 " << base->manifest_digest
        << (base->weights_origin == base->manifest_digest ? "" : ", weights origin " + base->weights_origin) << ")\n";
  return out.str();
}

Result<nlohmann::ordered_json> summarize_peft_dir(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(const PeftAdapterConfig c, read_peft_config(dir));
  TRESTLE_ASSIGN_OR_RETURN(const std::string file_path, peft_weights_file(dir));
  TRESTLE_ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::open(file_path));
  std::set<std::string> modules;
  std::uint64_t bytes = 0;
  for (const SafetensorsEntry& e : file.tensors()) {
    const auto key = parse_peft_key(e.name);
    if (!key) return Status::Error(file_path + ": " + e.name + " is not a PEFT LoRA tensor");
    modules.insert(key->module);
    bytes += e.nbytes();
  }
  return nlohmann::ordered_json{
      {"format", "hf-peft"},
      {"path", dir},
      {"r", c.r},
      {"lora_alpha", c.alpha},
      {"lora_dropout", c.dropout},
      {"target_modules", c.target_string.empty() ? nlohmann::json(c.target_modules) : nlohmann::json(c.target_string)},
      {"target_parameters", c.target_parameters},
      {"rank_pattern", peft_config_json(c)["rank_pattern"]},
      {"base_model_name_or_path", c.base_model},
      {"modules", modules.size()},
      {"tensors", file.tensors().size()},
      {"bytes", bytes}};
}

}  // namespace trestle
