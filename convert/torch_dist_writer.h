// Writing a model as a Megatron-Core `torch_dist` checkpoint in any layout, from any canonical source, streaming:
// <root>/latest_checkpointed_iteration.txt + <root>/iter_{:07d}/ with one `__{rank}_0.distcp` per rank of the layout
// (tp x pp x ep; data-parallel replicas are written once), `.metadata`, Megatron's metadata.json, the weightless
// `_extra_state` objects Megatron-Core's load asks for, a common.pt holding {'args': argparse.Namespace(...),
// 'checkpoint_version': 3.0, 'iteration': N}, and Trestle's own description of the model (trestle_model.json +
// hf_files/) so that export back to Hugging Face is exact.
//
// Keys are Megatron's (megatron_dist_names.h, for the spec named by the layout's norms): homogeneous layers stacked
// under `decoder.layers.<param>` with a leading [num_layers] axis (experts `…mlp.experts.experts.<param>` with
// [num_layers, num_experts] axes), vocab padded with zero rows, layer norms under Transformer Engine names. Which rank
// holds which box comes from bridge_layout.h, so a TP rank's linear_fc1 chunk is its two boxes (gate rows, up rows)
// of the global [all gate; all up]. Each rank's pieces are read from the source one at a time just before they are
// written: memory is about the largest piece per concurrent writer.
//
// Optimizer state goes in Megatron-Core's model-space format (megatron_dist_names.h): each Adam state of a weight
// (Trestle's optimizer.<exp_avg | exp_avg_sq | fp32_param>.<weight>) as `optimizer.state.<state>.<weight key>` with
// the weight key's global shape and chunks, and the step (optimizer.step) as `common_step` in common.pt, which is what
// Megatron-Core's non-distributed optimizers save and load. (Its distributed optimizer's 'fully_reshardable' format
// has the same moments but names the fp32 master `param`: read, not written.) Hyper-parameters (param_groups) are not
// Trestle state and are not written. Or, with `dp_reshardable`, as Megatron-LM's distributed optimizer saves it by
// default (dp_reshardable_write.h: flat bucket buffers laid out for the loading run, its param groups from the
// options). Any other optimizer.* tensor is an error; model_only writes the weights alone.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/io_options.h"
#include "convert/dp_reshardable_write.h"
#include "convert/sources/canonical_source.h"

namespace trestle {

struct TorchDistWriteOptions {
  ParallelLayout layout;
  std::optional<std::int64_t> iteration;      // default: the source's
  IoOptions io = {std::size_t{1} << 20, 16};  // several writers at once: small staging each
  int concurrent_writers = 2;  // raised to tp: the tensor-parallel ranks of a stage share their source tensors
  bool model_only = false;     // leave the source's optimizer state out (the plan says so)
  // Set: the optimizer state as the distributed optimizer's flat buffers ('dp_reshardable'), not in model space.
  std::optional<DpReshardableWriteOptions> dp_reshardable;
  // Model-space optimizer state: the hyper-parameters (lr, min_lr, weight_decay, adam_*; the other fields unused) of
  // the param groups common.pt gets, which Megatron-LM's optimizer load requires (it takes them over). Unset: none are
  // written, and the state loads through dist_checkpointing but not into Megatron-LM's optimizer.
  std::optional<DpReshardableWriteOptions> param_groups;
  // What the run that wrote the checkpoint knows beyond the model, for common.pt's args under Megatron-LM's names
  // ({"tokenizer_type": "GPT2BPETokenizer", "seq_length": 4096, ...}; scalars only, set after the model's own).
  nlohmann::json extra_args = nlohmann::json::object();
  // Set: the iteration's files go into this existing directory, which its caller commits (a Trestle save's temporary
  // iteration, whose files they sit beside): `root` is not used, and no tracker or staging directory is written.
  std::string iteration_dir;
  bool dry_run = false;
  bool progress = true;
};

struct TorchDistWriteReport {
  std::uint64_t tensors = 0, optimizer_tensors = 0, pieces = 0, bytes_written = 0;
  std::string plan;
};

Result<TorchDistWriteReport> write_torch_dist(const CanonicalSource& source, const std::string& root,
                                              const TorchDistWriteOptions& options);

}  // namespace trestle
