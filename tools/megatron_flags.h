// Megatron-LM's flags that `trestle train` takes so a Megatron script runs unchanged: the model-description flags
// (--hidden-size, --swiglu, ...), each checked against the model being trained, and the flags that choose how Megatron
// computes or logs something Trestle does its own way (fusions, overlaps, backends), accepted without effect.
#pragma once

#include <cxxopts.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"

namespace trestle::cli {

// Declares both kinds in the help groups "megatron model" and "megatron (no effect)".
void declare_megatron_flags(cxxopts::Options& spec);
inline constexpr const char* kMegatronModelGroup = "megatron model";
inline constexpr const char* kMegatronNoEffectGroup = "megatron (no effect)";

// Values no model can take here, found before anything is read: a dropout other than 0 (Trestle trains without
// dropout), an unknown choice for an enumerated flag. The error names the flag and the values it takes.
Status check_megatron_flag_values(const cxxopts::ParseResult& args);

// Every model-description flag given must describe `model` (from `source`, named in the error with both values):
// sizes and bases as given; a switch (--swiglu, --qk-layernorm, ...) given must be a property the model has.
Status check_megatron_model_flags(const cxxopts::ParseResult& args, const GptModelSpec& model,
                                  const std::string& source);

// The no-effect flags given, as "--name" (or "--name VALUE"), in declaration order: for the one note that lists them.
std::vector<std::string> given_flags_without_effect(const cxxopts::ParseResult& args);

}  // namespace trestle::cli
