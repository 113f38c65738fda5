// Megatron-LM's flags that `trestle train` takes so a Megatron script runs unchanged: the model-description flags
// (--hidden-size, --swiglu, --multi-latent-attention, --moe-layer-freq, --window-size, ...), each checked against the
// model being trained, and the flags that choose how Megatron computes or logs something Trestle does its own way
// (fusions, overlaps, backends), accepted without effect.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"

namespace trestle::cli {

// Declares both kinds in the help groups "megatron model" and "megatron (no effect)".
void declare_megatron_flags(cxxopts::Options& spec);
inline constexpr const char* kMegatronModelGroup = "megatron model";
inline constexpr const char* kMegatronNoEffectGroup = "megatron (no effect)";

// The flags of both kinds that take several words in Megatron (argparse's nargs '+': "--recompute-modules mlp moe").
// cxxopts takes one comma-separated value (or the flag repeated), so a caller that reads Megatron's spelling joins
// the words that follow each of these with commas before parsing.
const std::vector<std::string>& megatron_list_flags();

// Values no model can take here, found before anything is read: a dropout other than 0 (Trestle trains without
// dropout), an unknown choice for an enumerated flag, a pattern that does not parse, FP8, a load-balancing or router
// precision the trainer does not compute, flags Megatron itself refuses together. The error names the flag.
Status check_megatron_flag_values(const cxxopts::ParseResult& args);

// Every model-description flag given must describe `model` (from `source`, named in the error with both values):
// sizes and bases as given; a switch (--swiglu, --qk-layernorm, ...) given must be a property the model has. A flag
// Megatron reads only with another (--q-lora-rank with multi-latent attention, --mscale with YaRN) is checked where it
// takes effect. `checkpoint_args` (--use-checkpoint-args with a checkpoint's model): the flags Megatron then sets from
// the checkpoint over the command line (forced_by_checkpoint_args) are not checked.
Status check_megatron_model_flags(const cxxopts::ParseResult& args, const GptModelSpec& model,
                                  const std::string& source, bool checkpoint_args = false);
bool forced_by_checkpoint_args(std::string_view flag);

// A Megatron-LM model description given (--num-layers or --hidden-size) that leaves out flags whose Megatron defaults
// describe another model than `model` (LayerNorm, learned absolute positions, a GELU MLP, a tied output layer, linear
// biases, one key/value head per query head): each such flag with what the defaults and the model say, for a note.
// Megatron would build that other model; the model trained here is `model`.
std::vector<std::string> megatron_defaults_unlike(const cxxopts::ParseResult& args, const GptModelSpec& model);

// The no-effect flags given, as "--name" (or "--name VALUE"), in declaration order: for the one note that lists them.
std::vector<std::string> given_flags_without_effect(const cxxopts::ParseResult& args);

// Megatron's per-layer patterns (--moe-layer-freq, --window-attn-skip-freq): an integer N, or a Python list expression
// of integers in digits, commas, brackets, parentheses, + and * ("[0]*3+[1]*58", "([1]*3+[0])*2", "[1,0,1]"), evaluated
// as Python evaluates it, without eval. Anything else (spaces, a tuple, a list inside a list, a subscript) is an error
// saying what was expected.
struct LayerPattern {
  std::optional<std::int64_t> every;  // the integer form
  std::vector<std::int64_t> layers;   // the list form: one entry per layer
};
Result<LayerPattern> parse_layer_pattern(std::string_view text);

// The shortest decimal that reads back as v: how the errors show a flag's number and the model's.
std::string shortest_decimal(double v);

// Megatron's --window-size (its tuple_type: "(127, 0)" or "127,0"): two integers (left, right), -1 meaning unlimited.
Result<std::pair<std::int64_t, std::int64_t>> parse_window_size(std::string_view text);

}  // namespace trestle::cli
