#include "tools/dist_optimizer_options.h"

#include <string>

#include "tools/command.h"

namespace trestle::cli {

void declare_dist_optimizer_options(cxxopts::Options& spec, bool with_dp) {
  auto add = spec.add_options("torch_dist optimizer");
  add("optimizer-format",
      "megatron-dist optimizer state: model-space (optimizer.state.<state>.<weight key>) or dp_reshardable (the "
      "distributed optimizer's flat buckets, Megatron-LM's default)",
      cxxopts::value<std::string>()->default_value("model-space"));
  if (with_dp)
    add("dp", "dp_reshardable: data-parallel size of the run that loads it (default: the expert-parallel size)",
        cxxopts::value<int>());
  add("overlap-grad-reduce", "dp_reshardable: the loading run overlaps gradient reduction (buckets)");
  add("ddp-bucket-size", "dp_reshardable: its bucket size in elements (default max(40M, 1M x dp))",
      cxxopts::value<std::int64_t>());
  add("transformer-impl",
      "dp_reshardable: the loading run's layer specification, local or transformer_engine (its parameter order; "
      "default: the source's)",
      cxxopts::value<std::string>());
  add("grad-reduce-in-bf16", "dp_reshardable: a bf16 run that reduces gradients in bf16");
  add("loss-scale",
      "dp_reshardable: the loading run's constant loss scale (Megatron-Core then keeps a ConstantGradScaler, whose "
      "empty state its load asks for)",
      cxxopts::value<double>());
  add("lr",
      "the param groups' learning rate (max_lr): required by dp_reshardable; in model space it writes the param "
      "groups into common.pt (Megatron-LM's optimizer load needs them, and takes their betas and eps over)",
      cxxopts::value<double>());
  add("min-lr", "with --lr: the param groups' min_lr", cxxopts::value<double>()->default_value("0"));
  add("weight-decay", "with --lr: weight decay", cxxopts::value<double>()->default_value("0.01"));
  add("adam-beta1", "with --lr: Adam beta1", cxxopts::value<double>()->default_value("0.9"));
  add("adam-beta2", "with --lr: Adam beta2", cxxopts::value<double>()->default_value("0.999"));
  add("adam-eps", "with --lr: Adam epsilon", cxxopts::value<double>()->default_value("1e-08"));
}

Result<DistOptimizerOptions> parse_dist_optimizer_options(const cxxopts::ParseResult& args, bool with_dp) {
  const std::string format = args["optimizer-format"].as<std::string>();
  if (format != "model-space" && format != "dp_reshardable")
    return Status::Error("--optimizer-format '" + format + "' is not one of model-space, dp_reshardable");
  DpReshardableWriteOptions o;
  if (args.count("lr")) o.lr = args["lr"].as<double>();
  o.min_lr = args["min-lr"].as<double>();
  o.weight_decay = args["weight-decay"].as<double>();
  o.adam_beta1 = args["adam-beta1"].as<double>();
  o.adam_beta2 = args["adam-beta2"].as<double>();
  o.adam_eps = args["adam-eps"].as<double>();
  if (format == "model-space") {
    for (const char* option :
         {"overlap-grad-reduce", "ddp-bucket-size", "grad-reduce-in-bf16", "transformer-impl", "loss-scale"})
      if (args.count(option))
        return Status::Error(std::string("--") + option + " describes the dp_reshardable optimizer format: add " +
                             "--optimizer-format dp_reshardable");
    if (with_dp && args.count("dp"))
      return Status::Error("--dp describes the dp_reshardable optimizer format: add --optimizer-format dp_reshardable");
    for (const char* option : {"min-lr", "weight-decay", "adam-beta1", "adam-beta2", "adam-eps"})
      if (!args.count("lr") && args.count(option))
        return Status::Error(std::string("--") + option + " is a param group's: give --lr too");
    DistOptimizerOptions out;
    if (args.count("lr")) {
      TRESTLE_RETURN_IF_ERROR(check_dp_reshardable_options(o));
      out.param_groups = o;
    }
    return out;
  }
  if (with_dp) {
    TRESTLE_RETURN_IF_ERROR(check_at_least<int>(args, "dp", 1));
    if (args.count("dp")) o.dp = args["dp"].as<int>();
  }
  o.overlap_grad_reduce = args.count("overlap-grad-reduce") > 0;
  o.constant_loss_scale = args.count("loss-scale") > 0;
  if (args.count("ddp-bucket-size")) o.bucket_size = args["ddp-bucket-size"].as<std::int64_t>();
  o.grad_reduce_in_bf16 = args.count("grad-reduce-in-bf16") > 0;
  if (args.count("transformer-impl")) {
    const std::string impl = args["transformer-impl"].as<std::string>();
    if (impl != "local" && impl != "transformer_engine")
      return Status::Error("--transformer-impl '" + impl + "' is not one of local, transformer_engine");
    o.transformer_impl = impl == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  }
  TRESTLE_RETURN_IF_ERROR(check_dp_reshardable_options(o));
  return DistOptimizerOptions{o, std::nullopt};
}

}  // namespace trestle::cli
