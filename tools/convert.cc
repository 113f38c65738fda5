// trestle convert --from FORMAT SRC --to FORMAT DST: moves a model between checkpoint formats, streaming.
#include <cxxopts.hpp>
#include <iostream>
#include <vector>

#include "ckpt/byte_size.h"
#include "convert/operations.h"
#include "tools/command.h"
#include "tools/dist_optimizer_options.h"

namespace trestle::cli {
namespace {

Result<ParallelLayout> layout_from_args(const cxxopts::ParseResult& args) {
  for (const char* option : {"tp", "pp", "vpp", "ep"}) TRESTLE_RETURN_IF_ERROR(check_at_least<int>(args, option, 1));
  TRESTLE_RETURN_IF_ERROR(check_vocab_size_divisible_by(args["make-vocab-size-divisible-by"].as<std::int64_t>(),
                                                        "--make-vocab-size-divisible-by"));
  TRESTLE_RETURN_IF_ERROR(check_at_least<std::int64_t>(args, "first-stage-layers", 0));
  TRESTLE_RETURN_IF_ERROR(check_at_least<std::int64_t>(args, "last-stage-layers", 0));
  ParallelLayout l;
  l.tp = args["tp"].as<int>();
  l.pp = args["pp"].as<int>();
  l.vpp = args["vpp"].as<int>();
  l.ep = args["ep"].as<int>();
  l.make_vocab_size_divisible_by = args["make-vocab-size-divisible-by"].as<std::int64_t>();
  l.first_stage_layers = args["first-stage-layers"].as<std::int64_t>();
  l.last_stage_layers = args["last-stage-layers"].as<std::int64_t>();
  if (l.vpp > 1 && l.pp == 1) return Status::Error("--vpp " + std::to_string(l.vpp) + " needs --pp above 1");
  if ((l.first_stage_layers > 0 || l.last_stage_layers > 0) && l.pp == 1)
    return Status::Error("--first-stage-layers and --last-stage-layers need --pp above 1");
  if (args.count("pipeline-model-parallel-layout"))
    for (const char* other : {"vpp", "first-stage-layers", "last-stage-layers"})
      if (args.count(other))
        return Status::Error(std::string("--pipeline-model-parallel-layout and --") + other +
                             " exclude each other (the layout gives every stage's layers)");
  return l;
}

// An option given for a conversion it does not change is a usage error naming what it applies to, rather than ignored
// (--tp for hf -> hf, --hf-expert-layout for hf -> hf, --codec for a Hugging Face output).
Status check_options_apply(const cxxopts::ParseResult& args, CheckpointFormat from, CheckpointFormat to) {
  using F = CheckpointFormat;
  const bool sharded_output = to == F::kTrestle || to == F::kTorchDist;
  const bool megatron_source = from == F::kTrestle || from == F::kTorchDist || from == F::kLegacy;
  struct Scope {
    std::vector<const char*> options;
    bool applies;
    const char* where;
  };
  const std::vector<Scope> scopes = {
      {{"tp", "pp", "vpp", "ep", "first-stage-layers", "last-stage-layers", "pipeline-model-parallel-layout"},
       sharded_output,
       "the layout of a trestle or megatron-dist output"},
      {{"norms"},
       sharded_output && !megatron_source,
       "the layer-norm names of a model converted from Hugging Face; a Megatron checkpoint keeps its own"},
      {{"make-vocab-size-divisible-by"},
       sharded_output && (!megatron_source || to == F::kTorchDist),
       "the vocab padding of a model converted from Hugging Face or written as megatron-dist; a Megatron "
       "checkpoint converted to trestle keeps its own"},
      {{"codec"}, to == F::kTrestle, "a trestle output's chunks"},
      {{"max-shard-size"}, to == F::kHf, "a Hugging Face output's shards"},
      {{"hf-expert-layout"},
       (to == F::kHf && from != F::kHf) || to == F::kHfPeft,
       "the experts of a Hugging Face model or PEFT adapter written from a Megatron checkpoint; hf -> hf keeps the "
       "source's"},
      {{"iteration"}, from != F::kHf || to != F::kHf, "a Megatron checkpoint read or written"},
      {{"model-only"}, megatron_source || to == F::kTorchDist, "a megatron-dist or Megatron source"},
      {{"hf-config"}, megatron_source, "a Megatron checkpoint read"},
      {{"lr", "min-lr", "weight-decay", "adam-beta1", "adam-beta2", "adam-eps"},
       to == F::kTorchDist,
       "a megatron-dist output's optimizer state"},
  };
  for (const Scope& scope : scopes)
    for (const char* option : scope.options)
      if (args.count(option) && !scope.applies)
        return Status::Error(std::string("--") + option + " does not apply to " + std::string(format_name(from)) +
                             " -> " + std::string(format_name(to)) + ": it sets " + scope.where);
  return OkStatus();
}

// Every option of a conversion, checked before anything is read: a bad value is a usage error (exit 2).
Result<ConvertRequest> parse_request(const cxxopts::ParseResult& args) {
  // (two positionals of their own: a list option would split a path at its commas)
  if (!args.count("from") || !args.count("to") || !args.count("src") || !args.count("dst"))
    return Status::Error("--from, --to, SRC and DST are required");
  const std::vector<std::string> paths = {args["src"].as<std::string>(), args["dst"].as<std::string>()};
  if (paths[0].empty() || paths[1].empty())
    return Status::Error(std::string(paths[0].empty() ? "SRC" : "DST") + " is an empty path");
  ConvertRequest r;
  r.src = paths[0];
  r.dst = paths[1];
  TRESTLE_ASSIGN_OR_RETURN(r.from, parse_format(args["from"].as<std::string>()));
  TRESTLE_ASSIGN_OR_RETURN(r.to, parse_format(args["to"].as<std::string>()));
  TRESTLE_RETURN_IF_ERROR(check_options_apply(args, r.from, r.to));
  TRESTLE_ASSIGN_OR_RETURN(r.layout, layout_from_args(args));
  if (args.count("pipeline-model-parallel-layout"))
    r.pipeline_layout = args["pipeline-model-parallel-layout"].as<std::string>();
  // A Megatron checkpoint written as megatron-dist keeps the vocabulary padding it records unless one is given.
  r.keep_vocab_divisor = !args.count("make-vocab-size-divisible-by") && r.from != CheckpointFormat::kHf;
  const auto norms = args["norms"].as<std::string>();
  if (norms != "te" && norms != "local") return Status::Error("--norms '" + norms + "' is not one of te, local");
  r.norms = norms == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  auto dtype = parse_conversion_dtype(args["dtype"].as<std::string>());
  if (!dtype.ok()) return dtype.status().with_context("--dtype");
  r.dtype = *dtype;
  auto shard = parse_byte_size(args["max-shard-size"].as<std::string>());
  if (!shard.ok()) return shard.status().with_context("--max-shard-size");
  if (*shard == 0) return Status::Error("--max-shard-size must be more than 0 bytes");
  r.max_shard_bytes = *shard;
  const auto codec = args["codec"].as<std::string>();
  if (codec != "raw" && codec != "zstd") return Status::Error("--codec '" + codec + "' is not one of raw, zstd");
  r.codec = codec == "zstd" ? Codec::kZstd : Codec::kRaw;
  const auto experts = args["hf-expert-layout"].as<std::string>();
  if (experts != "source") {
    r.experts = expert_layout_from_name(experts);
    if (!r.experts)
      return Status::Error("--hf-expert-layout '" + experts +
                           "' is not one of source, original, fused, fused_transposed");
  }
  if (args.count("iteration")) r.iteration = args["iteration"].as<std::int64_t>();
  r.model_only = args.count("model-only") > 0;
  TRESTLE_ASSIGN_OR_RETURN(const DistOptimizerOptions optimizer, parse_dist_optimizer_options(args, true));
  r.dp_reshardable = optimizer.dp_reshardable;
  r.param_groups = optimizer.param_groups;
  r.dry_run = args.count("dry-run") > 0;
  r.progress = !args.count("quiet");
  if (args.count("hf-config")) r.source.hf_config = args["hf-config"].as<std::string>();
  if (args.count("base")) r.base = args["base"].as<std::string>();
  r.merge_lora = args.count("merge-lora") > 0;
  TRESTLE_RETURN_IF_ERROR(check_convert_request(r));
  return r;
}

Outcome run_convert(const cxxopts::ParseResult& args) {
  auto request = parse_request(args);
  if (!request.ok()) return usage_error(request.status());
  auto shown = run_convert_request(*request);
  if (!shown.ok()) return failure(shown.status());
  std::cout << *shown;
  return finished();
}

void declare_convert(cxxopts::Options& spec) {
  spec.add_options()("from", "source format", cxxopts::value<std::string>())("to", "destination format",
                                                                             cxxopts::value<std::string>())(
      "max-shard-size", "largest safetensors shard written, as save_pretrained cuts them",
      cxxopts::value<std::string>()->default_value("5GB"))("dtype",
                                                           "keep, bf16, fp16 or fp32 (casts floating-point tensors)",
                                                           cxxopts::value<std::string>()->default_value("keep"))(
      "tp", "tensor parallel size (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "pp", "pipeline parallel size (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "vpp", "virtual pipeline chunks per stage (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "ep", "expert parallel size, MoE models (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "first-stage-layers", "layers of the first pipeline stage (0: even split)",
      cxxopts::value<std::int64_t>()->default_value("0"))("last-stage-layers",
                                                          "layers of the last pipeline stage (0: even split)",
                                                          cxxopts::value<std::int64_t>()->default_value("0"))(
      "pipeline-model-parallel-layout",
      "Megatron's layout string: every virtual pipeline stage's layers in order, '|' between stages, E the "
      "embedding, t a decoder layer, m an MTP layer, L the loss (e.g. \"Ettt|tt|tt|ttL\" at --pp 4, "
      "\"E(tt|)*4L\" at --pp 2 with two chunks each); in place of --vpp and the stage sizes",
      cxxopts::value<std::string>())("make-vocab-size-divisible-by",
                                     "vocab padding multiple (times tp); a Megatron source keeps its own unless given",
                                     cxxopts::value<std::int64_t>()->default_value("128"))(
      "norms", "layer-norm naming: te (Transformer Engine spec) or local",
      cxxopts::value<std::string>()->default_value("te"))("codec", "chunk codec: raw or zstd (to trestle)",
                                                          cxxopts::value<std::string>()->default_value("raw"))(
      "iteration",
      "iteration to write (hf -> trestle / megatron-dist; default 0) or read (default: the tracker's latest)",
      cxxopts::value<std::int64_t>())("hf-config",
                                      "config.json (or its directory) describing a Megatron checkpoint's model",
                                      cxxopts::value<std::string>())(
      "hf-expert-layout",
      "MoE export layout (also of a PEFT adapter's expert adapters: fused ones are target_parameters): source (as "
      "converted from), original (per-expert tensors), fused (transformers 5's "
      "gate_up_proj [E, 2I, H], down_proj [E, H, I]) or fused_transposed ([E, H, 2I] and "
      "[E, I, H], as Qwen publishes Qwen3-VL-MoE)",
      cxxopts::value<std::string>()->default_value("source"))(
      "model-only",
      "a Megatron source (trestle too) or a megatron-dist output: model weights only, leaving optimizer state out")(
      "base",
      "LoRA: the base Trestle checkpoint of a PEFT adapter (--from hf-peft), or where an adapter "
      "checkpoint's base now is (--merge-lora)",
      cxxopts::value<std::string>())(
      "merge-lora", "trestle adapter checkpoint -> hf: the base with (alpha / r) B A added to each adapted weight")(
      "dry-run", "print the plan and memory estimate, write nothing")("q,quiet", "no progress output")(
      "src", "SRC", cxxopts::value<std::string>())("dst", "DST", cxxopts::value<std::string>());
  declare_dist_optimizer_options(spec, true);
  spec.parse_positional({"src", "dst"});
  spec.positional_help("SRC DST");
}

}  // namespace

const CommandSpec kConvertCommand = {
    .name = "convert",
    .summary =
        "convert a model between formats (hf <-> trestle in any Megatron TP/PP/VPP/EP layout, hf -> hf, "
        "LoRA adapters <-> hf-peft)",
    .description =
        "Convert a model checkpoint between formats without loading it whole.\n\n"
        "  trestle convert --from hf SRC_DIR --to hf DST_DIR [--max-shard-size 5GB] [--dtype bf16]\n"
        "  trestle convert --from hf SRC_DIR --to trestle CKPT --tp 2 --pp 2 [--vpp 2] [--ep 4] [--dry-run]\n"
        "  trestle convert --from trestle CKPT --to hf DST_DIR [--dtype bf16] [--hf-expert-layout fused]\n"
        "  trestle convert --from hf|trestle|megatron-dist|megatron-legacy SRC --to megatron-dist DST --tp 2 ...\n"
        "  trestle convert --from megatron-dist|megatron-legacy SRC --to hf|trestle DST [--hf-config CONFIG]\n"
        "  trestle convert --from trestle ADAPTER_CKPT --to hf-peft DIR            (LoRA adapters -> PEFT)\n"
        "  trestle convert --from trestle ADAPTER_CKPT --to hf DIR --merge-lora    (the merged full model)\n"
        "  trestle convert --from hf-peft DIR --base BASE --to trestle ADAPTER_CKPT [--tp 2 ...]\n\n"
        "Formats: hf (Hugging Face safetensors, sharded with an index, config and tokenizer files\n"
        "copied through); trestle (a Trestle checkpoint in Megatron-Core layout: one file per TP/PP/EP\n"
        "rank, canonical Megatron tensor names); megatron-dist (Megatron-Core torch_dist, i.e. PyTorch\n"
        "DCP: a root with latest_checkpointed_iteration.txt and iter_N/, or an iter_N directory itself;\n"
        "written with stacked layer keys and padded vocab as Megatron-LM saves it, common.pt with the\n"
        "args Namespace); megatron-legacy (read only: Megatron's mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt\n"
        "trees, including virtual-pipeline model0, model1, ...). The model of a Megatron checkpoint is\n"
        "read from what Trestle kept beside it, else --hf-config, else Megatron's args; the layout flags\n"
        "(--tp --pp --vpp --ep ...) describe the destination. Architectures: Llama 2/3/3.1/3.2, Mistral,\n"
        "Qwen2/2.5, Qwen3, Phi-3, Gemma 2, Gemma 3 (text), OLMo 2, Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS,\n"
        "DeepSeek-V3, GLM-4.5/4.7, Qwen3-Next, Qwen3.5/3.6 (dense and MoE), Nemotron-H (Mamba-2 hybrids,\n"
        "with MoE layers too, as Megatron-Core's MambaModel), Qwen3-VL and Gemma 3 with vision (their\n"
        "vision towers carried under Megatron-Bridge's names); `trestle inspect` on a Hugging Face directory\n"
        "says what the bridge makes of it or why it cannot convert it.\n\n"
        "Optimizer state (Adam exp_avg, exp_avg_sq, fp32 master weights, step) travels between trestle and\n"
        "megatron-dist in Megatron-Core's model-space format (optimizer.state.<state>.<weight key>, sharded\n"
        "as the weight; the step as common_step in common.pt). The distributed optimizer's dp_reshardable\n"
        "flat buffers (Megatron-LM's default) are read too: Megatron-Core's buffer and bucket layout is\n"
        "rebuilt from the model, its layout and args.transformer_impl, and checked against the stored\n"
        "buckets. --optimizer-format dp_reshardable writes that format: the buffers laid out for the run that\n"
        "will load it (--dp, --overlap-grad-reduce, --ddp-bucket-size, as Megatron-LM names them), its param\n"
        "groups from --lr, --min-lr, --weight-decay and --adam-beta1/2/eps, the step from the source. In model\n"
        "space the same flags write the param groups into common.pt, which Megatron-LM's optimizer load needs\n"
        "(it takes their betas and eps over); without --lr there are none, and the plan warns.\n"
        "Optimizer state that cannot be mapped (a legacy tree's) is an error, never dropped\n"
        "silently; --model-only reads or writes a Megatron checkpoint without it.\n\n"
        "LoRA: hf-peft is a Hugging Face PEFT adapter (adapter_config.json + adapter_model.safetensors). An\n"
        "adapter checkpoint from `trestle train --lora-rank` exports to it exactly: a fused linear_qkv or\n"
        "linear_fc1 adapter becomes q_proj/k_proj/v_proj (gate_proj/up_proj) adapters with B's rows and the\n"
        "same A; canonical adapters map one to one; experts use PEFT's per-expert layout. --merge-lora writes\n"
        "the base (found where the adapters recorded it, or at --base; the same weights as the recorded one) with\n"
        "W + (alpha / r) B A computed in fp32 and stored in W's dtype. --from hf-peft reads an adapter for the\n"
        "model of --base (a Trestle checkpoint) into an adapter checkpoint `trestle train --load` resumes from:\n"
        "separate q/k/v or gate/up adapters become the canonical form, projections the adapter leaves out are\n"
        "zero; missing or unexpected keys, wrong shapes, a rank other than the config's and modules the model\n"
        "lacks are refused before anything is written.",
    .declare = declare_convert,
    .run = run_convert,
};

}  // namespace trestle::cli
