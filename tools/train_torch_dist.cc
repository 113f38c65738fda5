#include "tools/train_torch_dist.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/owned_dir.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/sources/canonical_source.h"
#include "convert/torch_dist_writer.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;

// The run's settings Megatron-LM keeps in common.pt's args beside the model's (check_checkpoint_args compares the
// tokenizer type with the loading run's when that one reads a vocabulary file).
nlohmann::json run_arguments(const cxxopts::ParseResult& args, const train::TrainConfig& config) {
  const ParallelLayout& layout = *config.layout;
  nlohmann::json run = {{"seq_length", config.seq_length},
                        {"micro_batch_size", config.micro_batch_size},
                        {"global_batch_size", config.global_batch_size},
                        {"world_size", layout.world_size()},
                        {"data_parallel_size", layout.dp()},
                        {"context_parallel_size", layout.cp},
                        {"use_distributed_optimizer", config.use_distributed_optimizer},
                        {"lr", config.schedule.max_lr},
                        {"min_lr", config.schedule.min_lr},
                        // trained without dropout: Megatron-LM's --use-checkpoint-args then resumes without it too
                        {"hidden_dropout", 0.0},
                        {"attention_dropout", 0.0}};
  if (config.train_iters > 0) run["train_iters"] = config.train_iters;
  if (args.count("tokenizer-type")) run["tokenizer_type"] = args["tokenizer-type"].as<std::string>();
  // What the script says, which check_checkpoint_args compares with the loading run's flags.
  run["add_position_embedding"] = !args.count("no-position-embedding");
  if (args.count("max-position-embeddings"))
    run["max_position_embeddings"] = args["max-position-embeddings"].as<std::int64_t>();
  return run;
}

// The optimizer's param groups as a Megatron-LM run given this run's flags builds them, and for the distributed
// optimizer's state as Megatron-LM saves it by default (dp_reshardable), the buffers' layout: the data-parallel size
// and bucketing, and the layer implementation.
DpReshardableWriteOptions dp_reshardable_options(const cxxopts::ParseResult& args, const train::TrainConfig& config) {
  DpReshardableWriteOptions o;
  o.dp = config.layout->dp();
  o.overlap_grad_reduce = args.count("overlap-grad-reduce") > 0;
  if (config.ddp_bucket_elements > 0) o.bucket_size = config.ddp_bucket_elements;
  o.grad_reduce_in_bf16 = config.bf16 && args.count("grad-reduce-in-bf16") > 0;
  o.lr = config.schedule.max_lr;
  o.min_lr = config.schedule.min_lr;
  o.weight_decay = args["weight-decay"].as<double>();
  o.adam_beta1 = config.adam.beta1;
  o.adam_beta2 = config.adam.beta2;
  o.adam_eps = config.adam.eps;
  o.constant_loss_scale = !config.loss_scaler.dynamic;
  // Megatron-LM's default layer implementation is Transformer Engine's, which orders the buffers' parameters.
  const bool local = args.count("transformer-impl") && args["transformer-impl"].as<std::string>() == "local";
  o.transformer_impl = local ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  return o;
}

// Moves what the writer put in `from` (a directory of the same file system) into the iteration directory `to`.
Status move_into(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  std::vector<fs::path> written;
  for (fs::directory_iterator it(from, ec), end; !ec && it != end; it.increment(ec)) written.push_back(it->path());
  if (ec) return Status::Error(from.string() + ": " + ec.message());
  for (const fs::path& path : written) {
    const fs::path target = to / path.filename();
    // The Hugging Face side files the iteration carries, which the writer copied from there.
    if (path.filename() == kSideFilesDir && fs::is_directory(fs::symlink_status(target, ec))) continue;
    if (fs::exists(fs::symlink_status(target, ec)))
      return Status::Error(target.string() + ": the torch_dist form of the checkpoint would replace this file");
    fs::rename(path, target, ec);
    if (ec) return Status::Error(target.string() + ": cannot move into place: " + ec.message());
  }
  return OkStatus();
}

}  // namespace

Status use_torch_dist_checkpoints(const cxxopts::ParseResult& args, train::TrainConfig& config) {
  if (!args.count("ckpt-format") || args["ckpt-format"].as<std::string>() != "torch_dist") return OkStatus();
  if (config.lora)
    return Status::Error(
        "--ckpt-format torch_dist: an adapter checkpoint (--lora-rank) has no torch_dist form; save it as a Trestle "
        "checkpoint and export the adapters with `trestle convert --to hf-peft`, or merge them (--merge-lora)");
  TRESTLE_ASSIGN_OR_RETURN(const BridgedModel model, bridged_model_from_json(config.model_json, "the model trained"));
  if (model.model.gemma4)
    return Status::Error("--ckpt-format torch_dist: Megatron-Core's GPTModel cannot hold " + model.model.architecture +
                         " (Gemma 4); save Trestle checkpoints");
  TorchDistWriteOptions write;
  if (!config.layout) return Status::Error("internal: --ckpt-format torch_dist before the layout is known");
  write.layout = *config.layout;
  write.model_only = !config.save_optimizer;
  if (config.save_optimizer) {
    if (args.count("decoupled-lr"))
      return Status::Error(
          "--ckpt-format torch_dist with --decoupled-lr: Megatron-Core keeps the embedding and output layer in param "
          "groups of their own, which the torch_dist form does not write; save Trestle checkpoints");
    if (model.model.is_moe() && !config.use_distributed_optimizer)
      return Status::Error(
          "--ckpt-format torch_dist: an MoE model's optimizer state is written as the distributed optimizer's (add "
          "--use-distributed-optimizer), not as Megatron-Core's chained optimizer holds it in model space; or "
          "--no-save-optim");
    if (config.use_distributed_optimizer) {
      // What the distributed optimizer's dp_reshardable buffers cannot say, refused before any step.
      if (config.layout->expert_tp() != config.layout->tp)
        return Status::Error(
            "--ckpt-format torch_dist with the distributed optimizer: its buffers are written with the experts "
            "split as the dense tensors, not at --expert-tensor-parallel-size " +
            std::to_string(config.layout->expert_tp()) + "; or --no-save-optim");
      if (args.count("ddp-num-buckets"))
        return Status::Error(
            "--ckpt-format torch_dist with --ddp-num-buckets: the buffers are laid out by --ddp-bucket-size; give "
            "that instead (Megatron-LM derives it from the model's parameter count)");
    }
    const DpReshardableWriteOptions hyper = dp_reshardable_options(args, config);
    TRESTLE_RETURN_IF_ERROR(check_dp_reshardable_options(hyper));
    (config.use_distributed_optimizer ? write.dp_reshardable : write.param_groups) = hyper;
  }
  write.extra_args = run_arguments(args, config);
  write.progress = false;
  config.save_options.before_commit = [write](const std::string& temp_dir, const Manifest& manifest) -> Status {
    const auto start = std::chrono::steady_clock::now();
    // Written beside the iteration, then moved in. Its name and lock are the save's kind: the next save removes it
    // when this process dies before it is done.
    TRESTLE_ASSIGN_OR_RETURN(OwnedDir staging, OwnedDir::create(temp_dir + ".torch_dist"));
    auto source = open_trestle_source(temp_dir, SourceOptions{});
    if (!source.ok()) {
      staging.discard();
      return Status::Error("reading the checkpoint for its torch_dist form: " + source.status().message());
    }
    TorchDistWriteOptions options = write;
    options.iteration = manifest.iteration;
    options.iteration_dir = staging.path();
    auto written = write_torch_dist(**source, "", options);
    Status moved = written.ok() ? move_into(staging.path(), temp_dir) : written.status();
    if (moved.ok()) moved = fsync_directory(temp_dir);
    staging.discard();
    if (!moved.ok())
      return Status::Error("torch_dist form of iteration " + std::to_string(manifest.iteration) + ": " +
                           moved.message());
    std::printf(" torch_dist form of iteration %lld written in %.1f s (%.2f GB)\n",
                static_cast<long long>(manifest.iteration),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                static_cast<double>(written->bytes_written) / 1e9);
    std::fflush(stdout);
    return OkStatus();
  };
  return OkStatus();
}

}  // namespace trestle::cli
