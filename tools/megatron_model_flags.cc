// check_megatron_model_flags (the model-description flags against the model) and the parsers of Megatron's pattern
// and tuple arguments they read.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tools/megatron_flags.h"

namespace trestle::cli {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Megatron's pattern expressions as Python evaluates them: integers, lists of integers, +, * and parentheses.
class PatternParser {
 public:
  explicit PatternParser(std::string_view text) : text_(text) {}

  Result<LayerPattern> parse() {
    if (text_.find_first_not_of("0123456789,[]()+*") != std::string_view::npos)
      return error("only digits, commas, brackets, parentheses, + and * may appear (no spaces), as Megatron checks");
    TRESTLE_ASSIGN_OR_RETURN(Value v, sum());
    if (pos_ != text_.size()) return unexpected();
    if (!v.is_list) return error("it is an integer; a list expression gives one 0 or 1 per layer");
    LayerPattern pattern;
    pattern.layers = std::move(v.list);
    return pattern;
  }

 private:
  struct Value {
    bool is_list = false;
    std::int64_t number = 0;
    std::vector<std::int64_t> list;
  };
  static constexpr std::int64_t kLargest = 1'000'000;  // the largest integer and the longest list taken

  Status error(const std::string& what) const { return Status::Error(std::string(text_) + ": " + what); }
  Status unexpected() const {
    if (pos_ >= text_.size()) return error("ends too early");
    return error("unexpected '" + std::string(1, text_[pos_]) + "' at character " + std::to_string(pos_ + 1));
  }
  bool take(char c) {
    if (pos_ >= text_.size() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }

  // product ('+' product)*: integers add, lists concatenate.
  Result<Value> sum() {
    TRESTLE_ASSIGN_OR_RETURN(Value left, product());
    while (take('+')) {
      TRESTLE_ASSIGN_OR_RETURN(Value right, product());
      if (left.is_list != right.is_list) return error("a list and an integer are added");
      if (left.is_list) {
        left.list.insert(left.list.end(), right.list.begin(), right.list.end());
        if (static_cast<std::int64_t>(left.list.size()) > kLargest) return error("the list is too long");
      } else {
        left.number += right.number;
        if (left.number > kLargest) return error("a number is too large");
      }
    }
    return left;
  }

  // atom ('*' atom)*: integers multiply, a list times an integer repeats.
  Result<Value> product() {
    TRESTLE_ASSIGN_OR_RETURN(Value left, atom());
    while (take('*')) {
      TRESTLE_ASSIGN_OR_RETURN(Value right, atom());
      if (left.is_list && right.is_list) return error("two lists are multiplied");
      if (!left.is_list && !right.is_list) {
        if (left.number != 0 && right.number > kLargest / left.number) return error("a number is too large");
        left.number *= right.number;
        continue;
      }
      const std::int64_t times = left.is_list ? right.number : left.number;
      const std::vector<std::int64_t> once = left.is_list ? std::move(left.list) : std::move(right.list);
      if (times > 0 && static_cast<std::int64_t>(once.size()) > kLargest / times) return error("the list is too long");
      left = Value{true, 0, {}};
      for (std::int64_t i = 0; i < times; ++i) left.list.insert(left.list.end(), once.begin(), once.end());
    }
    return left;
  }

  // An integer, a list display [a, b, ...] of integers, or a parenthesised expression (not a tuple).
  Result<Value> atom() {
    if (++depth_ > kDeepest) return error("brackets and parentheses nest too deeply");
    const Result<Value> v = atom_within_depth();
    --depth_;
    return v;
  }
  Result<Value> atom_within_depth() {
    Value v;
    if (pos_ < text_.size() && is_digit(text_[pos_])) {
      const std::size_t start = pos_;
      while (pos_ < text_.size() && is_digit(text_[pos_])) ++pos_;
      const std::string_view digits = text_.substr(start, pos_ - start);
      if (digits.size() > 1 && digits[0] == '0' && digits.find_first_not_of('0') != std::string_view::npos)
        return error("the integer " + std::string(digits) + " has a leading zero (Python refuses it)");
      if (digits.size() > 7 || std::stoll(std::string(digits)) > kLargest) return error("a number is too large");
      v.number = std::stoll(std::string(digits));
      return v;
    }
    if (take('[')) {
      v.is_list = true;
      while (!take(']')) {
        TRESTLE_ASSIGN_OR_RETURN(Value item, sum());
        if (item.is_list) return error("a list inside a list (the pattern is one integer per layer)");
        v.list.push_back(item.number);
        if (!take(',') && !(pos_ < text_.size() && text_[pos_] == ']')) return unexpected();
      }
      if (pos_ < text_.size() && text_[pos_] == '[') return error("a list is indexed");
      return v;
    }
    if (take('(')) {
      if (pos_ < text_.size() && text_[pos_] == ')') return error("() is a tuple, not a list");
      TRESTLE_ASSIGN_OR_RETURN(v, sum());
      if (pos_ < text_.size() && text_[pos_] == ',') return error("a tuple, not a list");
      if (!take(')')) return unexpected();
      return v;
    }
    return unexpected();
  }

  static constexpr int kDeepest = 64;
  std::string_view text_;
  std::size_t pos_ = 0;
  int depth_ = 0;
};

std::string_view trimmed(std::string_view s) {
  const std::size_t first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

// Python's int() of a decimal: optional sign and digits, spaces around.
std::optional<std::int64_t> python_int(std::string_view s) {
  s = trimmed(s);
  const bool negative = !s.empty() && s[0] == '-';
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) s.remove_prefix(1);
  if (s.empty() || s.size() > 12 || std::any_of(s.begin(), s.end(), [](char c) { return !is_digit(c); }))
    return std::nullopt;
  const std::int64_t v = std::stoll(std::string(s));
  return negative ? -v : v;
}

}  // namespace

Result<LayerPattern> parse_layer_pattern(std::string_view text) {
  if (text.find('[') == std::string_view::npos) {
    // Megatron's moe_freq_type: without a bracket the text is an integer.
    const std::optional<std::int64_t> every = python_int(text);
    if (!every)
      return Status::Error(
          std::string(text) +
          ": not an integer N or a Python list expression with one 0 or 1 per layer (\"[0]*3+[1]*58\")");
    LayerPattern pattern;
    pattern.every = *every;
    return pattern;
  }
  return PatternParser(text).parse();
}

Result<std::pair<std::int64_t, std::int64_t>> parse_window_size(std::string_view text) {
  // Megatron's tuple_type: the text stripped of parentheses at both ends, split at commas, each part an int().
  std::string_view inner = trimmed(text);
  while (!inner.empty() && (inner.front() == '(' || inner.front() == ')')) inner.remove_prefix(1);
  while (!inner.empty() && (inner.back() == '(' || inner.back() == ')')) inner.remove_suffix(1);
  const std::size_t comma = inner.find(',');
  const auto left = python_int(inner.substr(0, comma));
  const auto right = comma == std::string_view::npos ? std::nullopt : python_int(inner.substr(comma + 1));
  if (!left || !right || inner.find(',', comma + 1) != std::string_view::npos)
    return Status::Error(std::string(text) + ": not two integers (left, right) such as \"(127, 0)\"");
  if (*left < -1 || *right < -1)
    return Status::Error(std::string(text) + ": a window is at least 0 positions (-1: unlimited)");
  return std::pair{*left, *right};
}

// The flags Megatron's load_args_from_checkpoint sets from the checkpoint over the command line (its _set_arg with
// force=True) under --use-checkpoint-args. (The sizes it sets only where a script leaves them out: --num-layers,
// --hidden-size, --ffn-hidden-size, --num-attention-heads, --kv-channels, stay checked.)
bool forced_by_checkpoint_args(std::string_view flag) {
  static constexpr std::string_view kForced[] = {"num-query-groups",
                                                 "group-query-attention",
                                                 "position-embedding-type",
                                                 "no-position-embedding",
                                                 "use-rotary-position-embeddings",
                                                 "rotary-base",
                                                 "rotary-percent",
                                                 "rotary-interleaved",
                                                 "disable-bias-linear",
                                                 "add-qkv-bias",
                                                 "squared-relu",
                                                 "swiglu",
                                                 "untie-embeddings-and-output-weights",
                                                 "apply-layernorm-1p",
                                                 "normalization",
                                                 "apply-query-key-layer-scaling",
                                                 "mtp-num-layers",
                                                 "num-experts",
                                                 "moe-layer-freq",
                                                 "moe-ffn-hidden-size",
                                                 "moe-router-topk",
                                                 "moe-router-pre-softmax",
                                                 "moe-grouped-gemm",
                                                 "moe-shared-expert-intermediate-size",
                                                 "moe-router-score-function",
                                                 "moe-router-enable-expert-bias",
                                                 "moe-router-topk-scaling-factor",
                                                 "mamba-state-dim",
                                                 "mamba-head-dim",
                                                 "mamba-num-groups",
                                                 "mamba-num-heads",
                                                 "moe-latent-size",
                                                 "attention-dropout",
                                                 "hidden-dropout"};
  return std::find(std::begin(kForced), std::end(kForced), flag) != std::end(kForced);
}

namespace {

// The model-description flags given and the model they must describe: each check names the flag, the value given and
// the model's.
struct ModelFlags {
  const cxxopts::ParseResult& args;
  const GptModelSpec& model;
  const std::string& source;
  bool checkpoint_args = false;  // --use-checkpoint-args: the flags it forces are the checkpoint's, as if not given

  bool given(const char* flag) const {
    return args.count(flag) > 0 && !(checkpoint_args && forced_by_checkpoint_args(flag));
  }
  std::string text(const char* flag) const { return args[flag].as<std::string>(); }
  double real_or(const char* flag, double otherwise) const { return given(flag) ? args[flag].as<double>() : otherwise; }

  Status differs(const std::string& flag, const std::string& value, const std::string& held) const {
    return Status::Error("--" + flag + " " + value + " differs from the model's " + held + " (" + source + ")");
  }
  // "--flag: the model<what> (source)"
  Status lacks(const std::string& flag, const std::string& what) const {
    return Status::Error("--" + flag + ": the model" + what + " (" + source + ")");
  }
  Status check_int(const char* flag, std::int64_t held) const {
    if (!given(flag) || args[flag].as<std::int64_t>() == held) return OkStatus();
    return differs(flag, std::to_string(args[flag].as<std::int64_t>()), std::to_string(held));
  }
  Status check_real(const char* flag, double held) const {
    if (!given(flag)) return OkStatus();
    const double value = args[flag].as<double>();
    if (std::abs(value - held) <= 1e-12 * std::max(std::abs(value), std::abs(held))) return OkStatus();
    return differs(flag, shortest_decimal(value), shortest_decimal(held));
  }
  Status check_text(const char* flag, const std::string& held) const {
    if (!given(flag) || text(flag) == held) return OkStatus();
    return differs(flag, text(flag), held);
  }
  Status check_switch(const char* flag, bool held, const char* lacking) const {
    if (!given(flag) || held) return OkStatus();
    return lacks(flag, lacking);
  }
};

// Layers as a Megatron pattern: "[0]*1+[1]*3" in runs, or "[1,0,1,0]" when that is shorter.
std::string pattern_text(const std::vector<bool>& layers) {
  std::string runs, listed;
  for (std::size_t i = 0; i < layers.size();) {
    std::size_t end = i;
    while (end < layers.size() && layers[end] == layers[i]) ++end;
    runs += (runs.empty() ? "[" : "+[") + std::string(layers[i] ? "1" : "0") + "]*" + std::to_string(end - i);
    i = end;
  }
  for (const bool layer : layers) listed += (listed.empty() ? "[" : ",") + std::string(layer ? "1" : "0");
  listed += "]";
  return runs.size() < listed.size() ? runs : listed;
}

// Megatron's layer pattern over `layers` layers: N marks the layers whose index (from `first`) N divides.
Result<std::vector<bool>> pattern_layers(const ModelFlags& f, const char* flag, std::int64_t layers, std::int64_t first,
                                         bool marked_when_divides) {
  TRESTLE_ASSIGN_OR_RETURN(const LayerPattern pattern, parse_layer_pattern(f.text(flag)));
  std::vector<bool> marked;
  if (pattern.every) {
    for (std::int64_t i = first; i < layers + first; ++i)
      marked.push_back((i % *pattern.every == 0) == marked_when_divides);
    return marked;
  }
  if (static_cast<std::int64_t>(pattern.layers.size()) != layers)
    return Status::Error("--" + std::string(flag) + " " + f.text(flag) + " gives " +
                         std::to_string(pattern.layers.size()) + " layers; the model has " + std::to_string(layers) +
                         " (" + f.source + ")");
  for (const std::int64_t v : pattern.layers) marked.push_back(v != 0);
  return marked;
}

// A per-layer flag (read by pattern_layers) against the model's layers `held`; `marked` says what a 1 is.
Status check_layers(const ModelFlags& f, const char* flag, std::int64_t first, bool marked_when_divides,
                    const std::vector<bool>& held, const char* marked) {
  TRESTLE_ASSIGN_OR_RETURN(const std::vector<bool> given,
                           pattern_layers(f, flag, static_cast<std::int64_t>(held.size()), first, marked_when_divides));
  if (given == held) return OkStatus();
  return Status::Error("--" + std::string(flag) + " " + f.text(flag) + " makes the layers " + pattern_text(given) +
                       " (1: " + marked + "); the model's are " + pattern_text(held) + " (" + f.source + ")");
}

Status check_sizes(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  // Megatron takes a hybrid's layers from its pattern and ignores --num-layers beside it.
  if (!f.given("hybrid-layer-pattern") && !f.given("hybrid-override-pattern"))
    TRESTLE_RETURN_IF_ERROR(f.check_int("num-layers", m.num_layers));
  TRESTLE_RETURN_IF_ERROR(f.check_int("hidden-size", m.hidden_size));
  TRESTLE_RETURN_IF_ERROR(f.check_int("num-attention-heads", m.num_attention_heads));
  // Megatron's NullTokenizer(--vocab-size V) has V + 1 ids, the last its end of document: the model's vocabulary.
  if (f.given("tokenizer-type") && f.args["tokenizer-type"].as<std::string>() == "NullTokenizer" &&
      f.given("vocab-size")) {
    const std::int64_t v = f.args["vocab-size"].as<std::int64_t>();
    if (v + 1 != m.vocab_size)
      return Status::Error("--tokenizer-type NullTokenizer --vocab-size " + std::to_string(v) + " has " +
                           std::to_string(v + 1) + " ids (its end of document is " + std::to_string(v) +
                           "); the model's vocabulary holds " + std::to_string(m.vocab_size) + " (" + f.source +
                           "): --vocab-size " + std::to_string(m.vocab_size - 1) + " describes it");
  } else {
    TRESTLE_RETURN_IF_ERROR(f.check_int("vocab-size", m.vocab_size));
  }
  if (f.given("padded-vocab-size") && f.args["padded-vocab-size"].as<std::int64_t>() < m.vocab_size)
    return Status::Error("--padded-vocab-size " + std::to_string(f.args["padded-vocab-size"].as<std::int64_t>()) +
                         " is less than the model's vocabulary " + std::to_string(m.vocab_size) + " (" + f.source +
                         ")");
  if (!m.multi_latent_attention()) TRESTLE_RETURN_IF_ERROR(f.check_int("kv-channels", m.kv_channels));
  if (!m.is_moe()) return f.check_int("ffn-hidden-size", m.ffn_hidden_size);
  TRESTLE_RETURN_IF_ERROR(f.check_int("moe-ffn-hidden-size", m.ffn_hidden_size));
  // Megatron's ffn_hidden_size sizes the dense layers; without any, it is the experts' size unless
  // --moe-ffn-hidden-size gives that.
  if (m.moe_first_dense_layers > 0) TRESTLE_RETURN_IF_ERROR(f.check_int("ffn-hidden-size", m.dense_ffn_hidden_size));
  else if (!f.given("moe-ffn-hidden-size")) TRESTLE_RETURN_IF_ERROR(f.check_int("ffn-hidden-size", m.ffn_hidden_size));
  return f.check_int("moe-shared-expert-intermediate-size", m.shared_expert_ffn_hidden_size);
}

Status check_attention(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  if (f.given("group-query-attention") || f.given("num-query-groups")) {
    // Megatron reads --num-query-groups (default 1) only with --group-query-attention; without it every head is its
    // own group.
    const std::int64_t heads =
        f.given("num-attention-heads") ? f.args["num-attention-heads"].as<std::int64_t>() : m.num_attention_heads;
    const std::int64_t groups = !f.given("group-query-attention") ? heads
                                : f.given("num-query-groups")     ? f.args["num-query-groups"].as<std::int64_t>()
                                                                  : 1;
    if (groups != m.num_query_groups)
      return Status::Error("--group-query-attention / --num-query-groups give " + std::to_string(groups) +
                           " key/value heads; the model has " + std::to_string(m.num_query_groups) + " (" + f.source +
                           ")");
  }
  TRESTLE_RETURN_IF_ERROR(f.check_switch("multi-latent-attention", m.multi_latent_attention(),
                                         "'s attention is not multi-latent attention"));
  if (m.multi_latent_attention()) {  // without it, Megatron reads none of these
    TRESTLE_RETURN_IF_ERROR(f.check_int("q-lora-rank", m.q_lora_rank));
    TRESTLE_RETURN_IF_ERROR(f.check_int("kv-lora-rank", m.kv_lora_rank));
    TRESTLE_RETURN_IF_ERROR(f.check_int("qk-head-dim", m.qk_head_dim));
    TRESTLE_RETURN_IF_ERROR(f.check_int("qk-pos-emb-head-dim", m.qk_pos_emb_head_dim));
    TRESTLE_RETURN_IF_ERROR(f.check_int("v-head-dim", m.v_head_dim));
  }
  for (const char* flag : {"qk-l2-norm", "export-qk-l2-norm"})
    TRESTLE_RETURN_IF_ERROR(f.check_switch(flag, false, "'s queries and keys are not L2-normed (Llama 4's)"));
  // Multi-latent attention's --qk-layernorm norms its query and key/value latents, which such a model always has.
  TRESTLE_RETURN_IF_ERROR(f.check_switch("qk-layernorm", m.qk_layernorm || m.multi_latent_attention(),
                                         " does not norm its queries and keys"));
  return f.check_text("softmax-type", m.softmax_offset ? "learnable" : "vanilla");
}

// --window-size (left, right) is Megatron's window: left + 1 positions, the query's own included, none after it
// (right 0); -1 unlimited. With --window-attn-skip-freq N the layers whose number (from 1) N divides have none.
Status check_window(const ModelFlags& f) {
  if (!f.given("window-size")) return OkStatus();  // Megatron then reads no --window-attn-skip-freq either
  const GptModelSpec& m = f.model;
  TRESTLE_ASSIGN_OR_RETURN(const auto window, parse_window_size(f.text("window-size")));
  const auto [left, right] = window;
  const std::string held = m.window_size > 0 ? "(" + std::to_string(m.window_size - 1) + ", 0): a window of " +
                                                   std::to_string(m.window_size) + " positions"
                                             : "none (no sliding window)";
  if (left == -1 ? m.window_size != 0 : (right != 0 || left + 1 != m.window_size))
    return f.differs("window-size", f.text("window-size"), held);
  if (left == -1) return OkStatus();
  std::vector<bool> windowed(static_cast<std::size_t>(m.num_layers), true), held_layers;
  if (f.given("window-attn-skip-freq")) {
    TRESTLE_ASSIGN_OR_RETURN(windowed, pattern_layers(f, "window-attn-skip-freq", m.num_layers, 1, false));
  }
  for (std::int64_t i = 0; i < m.num_layers; ++i) held_layers.push_back(m.layer_has_window(i));
  if (windowed == held_layers) return OkStatus();
  return Status::Error("--window-size with " +
                       (f.given("window-attn-skip-freq") ? "--window-attn-skip-freq " + f.text("window-attn-skip-freq")
                                                         : std::string("no --window-attn-skip-freq")) +
                       " windows the layers " + pattern_text(windowed) + " (1: windowed); the model's are " +
                       pattern_text(held_layers) + " (" + f.source + ")");
}

// Megatron's attention factor of YaRN's cos / sin tables is mscale(factor, mscale) / mscale(factor, mscale_all_dim)
// with mscale(f, m) = 0.1 m ln f + 1 (f > 1); the model's (Hugging Face's) is that with both values only when both are
// set, else mscale(factor, 1): so Megatron's mscale 1 and mscale_all_dim 0 describe the latter.
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

Status check_yarn(const ModelFlags& f, bool mla_attention) {
  const RopeScaling& r = f.model.rope_scaling;
  const bool yarn = r.type == RopeScalingType::kYarn;
  TRESTLE_RETURN_IF_ERROR(f.check_real("rotary-scaling-factor", yarn ? r.factor : 1.0));
  if (!yarn) return OkStatus();  // a factor of 1 leaves the mscales without effect
  const bool both = r.mscale > 0 && r.mscale_all_dim > 0;
  TRESTLE_RETURN_IF_ERROR(f.check_real("mscale", both ? r.mscale : 1.0));
  TRESTLE_RETURN_IF_ERROR(f.check_real("mscale-all-dim", both || mla_attention ? r.mscale_all_dim : 0.0));
  if (mla_attention) return OkStatus();  // multi-latent attention's YaRN takes no yarn_* flags
  TRESTLE_RETURN_IF_ERROR(f.check_int("yarn-original-max-position-embeddings", r.original_max_position_embeddings));
  TRESTLE_RETURN_IF_ERROR(f.check_real("yarn-beta-fast", r.beta_fast));
  TRESTLE_RETURN_IF_ERROR(f.check_real("yarn-beta-slow", r.beta_slow));
  TRESTLE_RETURN_IF_ERROR(f.check_switch("yarn-correction-range-round-to-int", r.truncate,
                                         "'s YaRN does not round its correction range to whole dims"));
  return f.check_switch("no-yarn-correction-range-round-to-int", !r.truncate,
                        "'s YaRN rounds its correction range to whole dims");
}

// Multi-latent attention's RoPE: --rope-type (default yarn); its softmax is scaled by mscale(factor, mscale_all_dim)²
// whichever the type.
Status check_latent_rope(const ModelFlags& f) {
  const RopeScaling& r = f.model.rope_scaling;
  const std::string type = f.given("rope-type") ? f.text("rope-type") : "yarn";
  const std::string held = r.type == RopeScalingType::kYarn   ? "yarn"
                           : r.type == RopeScalingType::kNone ? "rope"
                                                              : std::string(rope_scaling_name(r.type)) + " scaling";
  TRESTLE_RETURN_IF_ERROR(f.check_text("rope-type", held));
  if (type == "yarn") return check_yarn(f, true);
  const double factor = f.real_or("rotary-scaling-factor", 1.0), all_dim = f.real_or("mscale-all-dim", 0.0);
  const double scale = yarn_mscale(factor, all_dim) * yarn_mscale(factor, all_dim);
  if (scale == 1.0) return OkStatus();
  return Status::Error(
      "--rotary-scaling-factor " + shortest_decimal(factor) + " with --mscale-all-dim " + shortest_decimal(all_dim) +
      ": Megatron scales multi-latent attention's softmax by mscale(factor, mscale_all_dim)² = " +
      shortest_decimal(scale) + " even with --rope-type rope; the model's RoPE has no YaRN (" + f.source + ")");
}

// Llama 3.1's RoPE scaling as Megatron's --use-rope-scaling makes it: --rope-scaling-factor (default 8), low and high
// frequency factors 1 and 4, 8192 original positions.
Status check_llama3_rope(const ModelFlags& f) {
  if (!f.given("use-rope-scaling")) return OkStatus();  // Megatron reads --rope-scaling-factor only with it
  const RopeScaling& r = f.model.rope_scaling;
  if (r.type != RopeScalingType::kLlama3)
    return f.lacks("use-rope-scaling",
                   "'s RoPE has no Llama 3.1 scaling (its scaling: " + std::string(rope_scaling_name(r.type)) + ")");
  const double factor = f.real_or("rope-scaling-factor", 8.0);
  if (factor != r.factor)
    return f.differs(
        f.given("rope-scaling-factor") ? "rope-scaling-factor" : "use-rope-scaling's --rope-scaling-factor",
        shortest_decimal(factor), shortest_decimal(r.factor));
  if (r.low_freq_factor != 1.0 || r.high_freq_factor != 4.0 || r.original_max_position_embeddings != 8192)
    return f.lacks("use-rope-scaling",
                   "'s Llama 3.1 scaling has low_freq_factor " + shortest_decimal(r.low_freq_factor) +
                       ", high_freq_factor " + shortest_decimal(r.high_freq_factor) +
                       " and original_max_position_embeddings " + std::to_string(r.original_max_position_embeddings) +
                       "; Megatron's are 1, 4 and 8192");
  return OkStatus();
}

// Which RoPE Megatron builds: multi-latent attention's own (--rope-type), else the GPT model's from
// --position-embedding-type (which --use-rotary-position-embeddings makes rope).
Status check_position_embedding(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  const bool mla = m.multi_latent_attention();
  const bool yarn = m.rope_scaling.type == RopeScalingType::kYarn;
  TRESTLE_RETURN_IF_ERROR(f.check_real("rotary-base", m.rotary_base));
  TRESTLE_RETURN_IF_ERROR(f.check_switch("rotary-interleaved", false,
                                         "'s RoPE rotates the two halves of each head (Megatron's default), not "
                                         "interleaved pairs"));
  // Megatron divides the positions by --rotary-seq-len-interpolation-factor: linear scaling by that factor.
  const bool linear = m.rope_scaling.type == RopeScalingType::kLinear;
  if (f.given("rotary-seq-len-interpolation-factor") &&
      static_cast<double>(f.args["rotary-seq-len-interpolation-factor"].as<std::int64_t>()) !=
          (linear ? m.rope_scaling.factor : 1.0))
    return f.differs("rotary-seq-len-interpolation-factor",
                     std::to_string(f.args["rotary-seq-len-interpolation-factor"].as<std::int64_t>()),
                     linear ? "linear scaling factor " + shortest_decimal(m.rope_scaling.factor)
                            : std::string("RoPE, which has no linear scaling (1)"));
  if (f.given("no-rope-freq")) {
    // Megatron's N: every Nth layer skips RoPE (the layers a multiple of N); it asserts the layers divide by N.
    TRESTLE_ASSIGN_OR_RETURN(const LayerPattern pattern, parse_layer_pattern(f.text("no-rope-freq")));
    if (pattern.every && m.num_layers % *pattern.every != 0)
      return Status::Error("--no-rope-freq " + f.text("no-rope-freq") + ": the model's " +
                           std::to_string(m.num_layers) + " layers do not divide by it, as Megatron requires (" +
                           f.source + ")");
    TRESTLE_ASSIGN_OR_RETURN(const std::vector<bool> skipped, pattern_layers(f, "no-rope-freq", m.num_layers, 1, true));
    if (std::find(skipped.begin(), skipped.end(), true) != skipped.end())
      return Status::Error("--no-rope-freq " + f.text("no-rope-freq") + " makes the layers " + pattern_text(skipped) +
                           " (1: no RoPE); the model's all use RoPE (" + f.source + ")");
  }
  if (!mla) TRESTLE_RETURN_IF_ERROR(f.check_real("rotary-percent", m.rotary_percent));
  std::string type;  // Megatron's position embedding type, where the flags give one
  if (f.given("use-rotary-position-embeddings")) {
    if (m.mamba_num_heads > 0) return f.lacks("use-rotary-position-embeddings", "'s attention has no RoPE");
    if (yarn && !mla)
      return f.lacks("use-rotary-position-embeddings",
                     "'s RoPE is YaRN (--position-embedding-type yarn; this flag makes Megatron's plain rope)");
    type = "rope";
  } else if (f.given("position-embedding-type")) {
    type = f.text("position-embedding-type");
    const std::string held = m.mamba_num_heads > 0 ? "none" : yarn && !mla ? "yarn" : "rope";
    if (type != held && !(type == "yarn" && mla && yarn)) return f.differs("position-embedding-type", type, held);
  }
  if (mla) return check_latent_rope(f);
  if (type == "yarn") return check_yarn(f, false);
  return check_llama3_rope(f);
}

Status check_moe(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  if (!m.is_moe()) return OkStatus();  // Megatron reads no --moe-* flag without experts
  // 0 stands for none, which scales by 1: megatron-core applies the factor only when set (`if scaling_factor`).
  TRESTLE_RETURN_IF_ERROR(f.check_real("moe-router-topk-scaling-factor",
                                       m.moe_router_topk_scaling_factor == 0 ? 1.0 : m.moe_router_topk_scaling_factor));
  TRESTLE_RETURN_IF_ERROR(f.check_text("moe-router-score-function", m.moe_router_score_function));
  TRESTLE_RETURN_IF_ERROR(
      f.check_switch("moe-router-enable-expert-bias", m.moe_router_expert_bias, "'s router has no expert bias"));
  for (const char* flag : {"moe-apply-probs-on-input", "export-moe-apply-probs-on-input"})
    TRESTLE_RETURN_IF_ERROR(f.check_switch(
        flag, false, "'s routing probabilities weigh its experts' outputs, not their inputs (Llama 4's)"));
  if (m.moe_router_score_function == "softmax")  // sigmoid scores have no softmax to move
    TRESTLE_RETURN_IF_ERROR(f.check_switch("moe-router-pre-softmax", m.moe_router_pre_softmax,
                                           "'s router takes the softmax after the top-k, over the chosen experts"));
  TRESTLE_RETURN_IF_ERROR(f.check_int("moe-router-group-topk", m.moe_router_group_topk));
  if (m.moe_router_group_topk > 0 || f.given("moe-router-group-topk"))  // groups matter only in group-limited routing
    TRESTLE_RETURN_IF_ERROR(f.check_int("moe-router-num-groups", m.moe_router_num_groups));
  if (!f.given("moe-layer-freq") || m.hybrid()) return OkStatus();  // a hybrid's pattern places its MoE layers
  std::vector<bool> held;
  for (std::int64_t i = 0; i < m.num_layers; ++i) held.push_back(m.layer_is_moe(i));
  return check_layers(f, "moe-layer-freq", 0, true, held, "MoE");
}

Status check_mlp(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  const bool swiglu = !m.geglu && !m.quick_geglu && !m.squared_relu;
  TRESTLE_RETURN_IF_ERROR(f.check_switch("swiglu", swiglu, "'s MLP is not SwiGLU"));
  TRESTLE_RETURN_IF_ERROR(f.check_switch("quick-geglu", m.quick_geglu, "'s MLP is not quick GeGLU"));
  if (!m.squared_relu) TRESTLE_RETURN_IF_ERROR(f.check_real("glu-linear-offset", m.glu_linear_offset));
  // Megatron clamps quick GeGLU's halves, and SwiGLU's in experts only.
  if (f.given("activation-func-clamp-value") && (m.quick_geglu || m.is_moe()) &&
      f.args["activation-func-clamp-value"].as<double>() != m.activation_clamp)
    return f.differs("activation-func-clamp-value",
                     shortest_decimal(f.args["activation-func-clamp-value"].as<double>()),
                     m.activation_clamp > 0 ? shortest_decimal(m.activation_clamp) : "none (no clamp)");
  return OkStatus();
}

// A Mamba hybrid's layer pattern (Megatron's --hybrid-layer-pattern, or --hybrid-override-pattern before it; its form
// checked before the model is read) and its mixers' sizes. Megatron derives the layers from the pattern.
Status check_hybrid(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  const char* flag = f.given("hybrid-layer-pattern")      ? "hybrid-layer-pattern"
                     : f.given("hybrid-override-pattern") ? "hybrid-override-pattern"
                                                          : nullptr;
  if (flag) {
    const std::string pattern = f.text(flag);
    if (!m.hybrid()) return f.lacks(flag, " is not a Mamba hybrid (its layers are transformer layers)");
    if (pattern != m.hybrid_layers) return f.differs(flag, pattern, m.hybrid_layers);
  }
  TRESTLE_RETURN_IF_ERROR(f.check_switch("is-hybrid-model", m.hybrid(), " is not a Mamba hybrid"));
  if (f.given("export-model-type")) {
    const std::string type = f.text("export-model-type");
    if ((type == "GPTModel") == m.hybrid())
      return f.differs("export-model-type", type, m.hybrid() ? "HybridModel (a Mamba hybrid)" : "GPTModel");
  }
  if (!m.hybrid()) {
    for (const char* sized : {"mamba-num-heads", "mamba-head-dim", "mamba-state-dim", "mamba-num-groups"})
      if (f.given(sized)) return f.lacks(sized, " has no Mamba mixers");
  } else {
    TRESTLE_RETURN_IF_ERROR(f.check_int("mamba-num-heads", m.mamba_num_heads));
    TRESTLE_RETURN_IF_ERROR(f.check_int("mamba-head-dim", m.mamba_head_dim));
    TRESTLE_RETURN_IF_ERROR(f.check_int("mamba-state-dim", m.mamba_state_dim));
    TRESTLE_RETURN_IF_ERROR(f.check_int("mamba-num-groups", m.mamba_num_groups));
  }
  TRESTLE_RETURN_IF_ERROR(
      f.check_switch("squared-relu", m.squared_relu, "'s MLPs are not fc2(relu(fc1 x)^2) (not --squared-relu)"));
  if (!f.given("moe-latent-size")) return OkStatus();
  if (m.moe_latent_size == 0) return f.lacks("moe-latent-size", "'s experts have no latent space");
  return f.check_int("moe-latent-size", m.moe_latent_size);
}

// Qwen3-Next's and Qwen3.5's layers: Gated DeltaNet (Megatron's experimental attention variant) in some, gated full
// attention in the others, the shared expert gated.
Status check_linear_attention(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  const bool gdn = m.has_linear_attention();
  TRESTLE_RETURN_IF_ERROR(
      f.check_switch("attention-output-gate", m.attention_output_gate, "'s attention output is not gated"));
  if (m.is_moe())
    TRESTLE_RETURN_IF_ERROR(
        f.check_switch("moe-shared-expert-gate", m.shared_expert_gate, "'s shared expert is not gated"));
  if (f.given("experimental-attention-variant"))
    TRESTLE_RETURN_IF_ERROR(f.check_text("experimental-attention-variant", gdn ? "gated_delta_net" : "none"));
  if (!gdn) {
    if (f.given("linear-attention-freq")) return f.lacks("linear-attention-freq", " has no Gated DeltaNet layers");
    return OkStatus();  // Megatron reads the --linear-* sizes only for Gated DeltaNet
  }
  TRESTLE_RETURN_IF_ERROR(f.check_int("linear-conv-kernel-dim", m.linear_conv_kernel_dim));
  TRESTLE_RETURN_IF_ERROR(f.check_int("linear-key-head-dim", m.linear_key_head_dim));
  TRESTLE_RETURN_IF_ERROR(f.check_int("linear-value-head-dim", m.linear_value_head_dim));
  TRESTLE_RETURN_IF_ERROR(f.check_int("linear-num-key-heads", m.linear_num_key_heads));
  TRESTLE_RETURN_IF_ERROR(f.check_int("linear-num-value-heads", m.linear_num_value_heads));
  if (!f.given("linear-attention-freq")) return OkStatus();
  // Megatron's N: N - 1 Gated DeltaNet layers, then one attention layer, repeated.
  return check_layers(f, "linear-attention-freq", 1, false, m.linear_attention_layers, "Gated DeltaNet");
}

Status check_layer_structure(const ModelFlags& f) {
  const GptModelSpec& m = f.model;
  TRESTLE_RETURN_IF_ERROR(f.check_real("norm-epsilon", m.norm_epsilon));
  if (f.given("normalization") && f.text("normalization") != "RMSNorm")
    return f.differs("normalization", f.text("normalization"), "RMSNorm");
  TRESTLE_RETURN_IF_ERROR(f.check_switch("untie-embeddings-and-output-weights", !m.tied_embeddings,
                                         " ties its output layer to the word embeddings"));
  TRESTLE_RETURN_IF_ERROR(f.check_switch("disable-bias-linear", !m.add_bias_linear, "'s linear layers have biases"));
  TRESTLE_RETURN_IF_ERROR(f.check_switch("add-qkv-bias", m.add_qkv_bias || m.add_bias_linear,
                                         "'s query/key/value projection has no biases"));
  return f.check_switch("apply-layernorm-1p", m.zero_centered_norms, "'s norms do not apply (1 + w)");
}

}  // namespace

std::vector<std::string> megatron_defaults_unlike(const cxxopts::ParseResult& args, const GptModelSpec& m) {
  std::vector<std::string> out;
  if (!args.count("num-layers") && !args.count("hidden-size")) return out;  // no Megatron model description
  const bool given_any = args.count("normalization") > 0;
  if (!given_any) out.push_back("--normalization (Megatron's default: LayerNorm; the model's norms are RMSNorm)");
  const bool rope = !args.count("position-embedding-type") && !args.count("use-rotary-position-embeddings");
  if (rope && m.mamba_num_heads == 0)
    out.push_back("--position-embedding-type (Megatron's default: learned_absolute; the model's is RoPE)");
  if (!args.count("swiglu") && !m.geglu && !m.quick_geglu && !m.squared_relu)
    out.push_back("--swiglu (without it Megatron's MLP is GELU; the model's is SwiGLU)");
  if (!args.count("untie-embeddings-and-output-weights") && !m.tied_embeddings)
    out.push_back(
        "--untie-embeddings-and-output-weights (without it Megatron ties the output layer to the "
        "embeddings; the model's is its own)");
  if (!args.count("disable-bias-linear") && !m.add_bias_linear)
    out.push_back("--disable-bias-linear (without it Megatron's linear layers have biases; the model's have none)");
  if (!args.count("group-query-attention") && m.num_query_groups > 0 && m.num_query_groups < m.num_attention_heads)
    out.push_back("--group-query-attention --num-query-groups " + std::to_string(m.num_query_groups) +
                  " (without them Megatron's attention has a key/value head per query head)");
  // The numbers Megatron-LM fills in when a script leaves them out (validate_args): another model where the
  // checkpoint's differ.
  auto number = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return std::string(text);
  };
  if (!args.count("rotary-base") && m.mamba_num_heads == 0 && m.rotary_base != 10000.0)
    out.push_back("--rotary-base " + number(m.rotary_base) + " (Megatron's default: 10000)");
  if (!args.count("norm-epsilon") && m.norm_epsilon != 1e-5)
    out.push_back("--norm-epsilon " + number(m.norm_epsilon) + " (Megatron's default: 1e-5)");
  if (!args.count("kv-channels") && m.num_attention_heads > 0 && m.kv_channels > 0 &&
      m.kv_channels * m.num_attention_heads != m.hidden_size)
    out.push_back("--kv-channels " + std::to_string(m.kv_channels) + " (Megatron's default: hidden size / heads, " +
                  std::to_string(m.hidden_size / m.num_attention_heads) + ")");
  if (!args.count("ffn-hidden-size") && m.num_experts == 0 && m.ffn_hidden_size > 0) {
    // validate_args: 4 h, or with --swiglu two thirds of it rounded down to a multiple of 64.
    const std::int64_t fallback = args.count("swiglu") ? (4 * m.hidden_size * 2 / 3) / 64 * 64 : 4 * m.hidden_size;
    if (fallback != m.ffn_hidden_size)
      out.push_back("--ffn-hidden-size " + std::to_string(m.ffn_hidden_size) +
                    " (Megatron's default here: " + std::to_string(fallback) + ")");
  }
  if (!args.count("qk-layernorm") && m.qk_layernorm)
    out.push_back("--qk-layernorm (without it Megatron's attention has no query / key norms; the model's has)");
  if (!args.count("add-qkv-bias") && m.add_qkv_bias && !m.add_bias_linear)
    out.push_back("--add-qkv-bias (without it Megatron's query / key / value projection has no bias; the model's has)");
  return out;
}

Status check_megatron_model_flags(const cxxopts::ParseResult& args, const GptModelSpec& model,
                                  const std::string& source, bool checkpoint_args) {
  const ModelFlags flags{args, model, source, checkpoint_args};
  TRESTLE_RETURN_IF_ERROR(check_sizes(flags));
  TRESTLE_RETURN_IF_ERROR(check_moe(flags));
  TRESTLE_RETURN_IF_ERROR(check_attention(flags));
  TRESTLE_RETURN_IF_ERROR(check_window(flags));
  TRESTLE_RETURN_IF_ERROR(check_position_embedding(flags));
  TRESTLE_RETURN_IF_ERROR(check_mlp(flags));
  TRESTLE_RETURN_IF_ERROR(check_hybrid(flags));
  TRESTLE_RETURN_IF_ERROR(check_linear_attention(flags));
  return check_layer_structure(flags);
}

}  // namespace trestle::cli
