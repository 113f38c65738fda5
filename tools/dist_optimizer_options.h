// The options of `convert --to megatron-dist` and `reshard --to-format megatron-dist` that write the optimizer state
// as Megatron-LM's distributed optimizer saves it by default ('dp_reshardable'), laid out for the run that will load
// it, under Megatron-LM's argument names.
#pragma once

#include <cxxopts.hpp>
#include <optional>

#include "ckpt/status.h"
#include "convert/dp_reshardable_write.h"

namespace trestle::cli {

// `with_dp`: also declares --dp (reshard has its own).
void declare_dist_optimizer_options(cxxopts::Options& spec, bool with_dp);
struct DistOptimizerOptions {
  std::optional<DpReshardableWriteOptions> dp_reshardable;  // --optimizer-format dp_reshardable
  std::optional<DpReshardableWriteOptions> param_groups;    // model-space with --lr: the param groups' hyper-parameters
};
// A usage error for a bad value, or for the buffers' settings given without the dp_reshardable format.
Result<DistOptimizerOptions> parse_dist_optimizer_options(const cxxopts::ParseResult& args, bool with_dp);

}  // namespace trestle::cli
