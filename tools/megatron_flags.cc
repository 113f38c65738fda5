#include "tools/megatron_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>

namespace trestle::cli {
namespace {

// A flag Megatron-LM takes to choose how it computes or logs something Trestle does its own way: a switch (no
// choices), a value from `choices`, a count ({"COUNT"}), any integer ({"INT"}), any number ({"NUMBER"}) or any
// text ({"TEXT"}: a path, a tokenizer's name); `several` takes one or more of the choices, or of any text (argparse's
// nargs '+').
struct NoEffectFlag {
  const char* name;
  const char* why;
  std::vector<std::string> choices;
  bool several = false;
};

constexpr const char* kFp8Only = "FP8 only (Megatron reads it with --fp8-format, which Trestle does not take)";
constexpr const char* kTokenized = "the data is tokenized; the vocabulary is the model's";
constexpr const char* kOtherOptimizer = "read by Megatron's other optimizers only (--optimizer adam here)";
constexpr const char* kOptimizerPlacement = "where the optimizer's state lives and runs (the same step)";
constexpr const char* kTelemetry = "NVIDIA's one-logger telemetry";
constexpr const char* kFaultTolerance =
    "NVIDIA's fault-tolerance package (Trestle's jobs restart through torchrun or Slurm and resume from --save)";
constexpr const char* kCheckpointIo = "how Megatron writes or checks its own checkpoint files";
constexpr const char* kDatasetIndexIo = "how Megatron reads the dataset's cached indices (the same indices)";
constexpr const char* kGradientCommunication = "how the data-parallel gradients are communicated (the same mean)";
constexpr const char* kFsdp =
    "what Megatron-FSDP shards and how it gathers it: the same training; --use-distributed-optimizer shards the "
    "optimizer here";
constexpr const char* kInProcessRestart =
    "NVIDIA's in-process restart (Trestle's jobs restart through torchrun or Slurm and resume from --save)";
constexpr const char* kFimOnly = "read with --fim-data only, which is refused here";
constexpr const char* kMuonOnly = "read by Megatron's Muon optimizer only (--optimizer adam here)";
constexpr const char* kPrecisionAwareOnly =
    "read with --use-precision-aware-optimizer only, which takes fp32 alone here";

// Megatron-LM flags whose meaning Trestle does not train, each refused naming why.
struct RefusedFlag {
  const char* name;
  const char* why;
  bool takes_value;
};

const std::vector<RefusedFlag>& refused_flags() {
  static const std::vector<RefusedFlag> flags = {
      {"full-validation", "Megatron's evaluation of the whole validation split; --eval-iters batches are read here",
       false},
      {"data-parallel-random-init", "each data-parallel replica initialised apart: one model is trained here", false},
      {"fp32-residual-connection", "the residual stream stays in the training dtype here", false},
      {"openai-gelu", "OpenAI's GELU approximation: the model's activation is its config's", false},
      {"apply-residual-connection-post-layernorm", "the residual is taken before the norm in every model here", false},
      {"init-method-xavier-uniform", "weights are initialised from a normal of --init-method-std here", false},
      {"moe-input-jitter-eps", "the router's input is not jittered here (noise outside the model)", true},
      {"yaml-cfg", "a YAML file of arguments: give them as flags", true},
      {"use-legacy-models", "Megatron's legacy model code: the model here is megatron-core's", false},
      {"hybrid-attention-ratio",
       "hybrid layers allocated by ratios: give the layers' pattern (--hybrid-override-pattern, beside which Megatron "
       "only compares them), as the model's",
       true},
      {"fim-data",
       "Megatron's fill-in-the-middle dataset, which rearranges documents around sentinel tokens (the documents are "
       "read as they are here)",
       false},
      {"sft", "Megatron's supervised fine-tuning dataset of conversations (the GPT dataset is read here)", false},
      {"sft-tokenizer-prompt-format", "the prompt format of Megatron's --sft dataset, which is refused here", true},
      {"kitchen-config-file", "NVIDIA Kitchen's quantized layers (Trestle trains in fp32, bf16 or fp16)", true},
      {"kitchen-recipe-number", "NVIDIA Kitchen's quantized layers (Trestle trains in fp32, bf16 or fp16)", true},
      {"moe-use-upcycling",
       "upcycling a dense checkpoint into a mixture of experts (convert or train the mixture's own checkpoint)", false},
      {"hybrid-mlp-ratio",
       "hybrid layers allocated by ratios: give the layers' pattern (--hybrid-override-pattern, beside which Megatron "
       "only compares them), as the model's",
       true},
  };
  return flags;
}

const std::vector<NoEffectFlag>& no_effect_flags() {
  static const std::vector<NoEffectFlag> flags = {
      {"use-mcore-models", "Trestle's model is megatron-core's GPTModel's layout", {}},
      {"transformer-impl", "the layer implementation (the math is the same)", {"local", "transformer_engine"}},
      {"attention-backend",
       "the attention kernel (LibTorch's SDPA here)",
       {"auto", "flash", "fused", "unfused", "local"}},
      {"use-flash-attn", "the attention kernel (LibTorch's SDPA here)", {}},
      {"export-force-local-attention", "the attention kernel (ModelOpt's model builder's choice)", {}},
      {"attention-softmax-in-fp32", "how Megatron's unfused attention computes its softmax (LibTorch's SDPA here)", {}},
      {"no-masked-softmax-fusion", "a fusion", {}},
      {"no-bias-swiglu-fusion", "a fusion", {}},
      {"no-bias-dropout-fusion", "a fusion", {}},
      {"no-bias-gelu-fusion", "a fusion", {}},
      {"no-persist-layer-norm", "a fusion", {}},
      {"no-rope-fusion", "a fusion (--no-fused-kernels chooses Trestle's)", {}},
      {"cross-entropy-loss-fusion", "a fusion", {}},
      {"cross-entropy-fusion-impl", "a fusion", {"native", "te"}},
      {"moe-permute-fusion", "a fusion", {}},
      {"cuda-graph-impl",
       "CUDA graphs replay the same kernels",
       {"none", "local", "transformer_engine", "full_iteration"}},
      {"recompute-activations",
       "Megatron's selective recompute of attention's core: the same values (Trestle recomputes whole layers or "
       "nothing)",
       {}},
      {"recompute-modules",
       "what Megatron's selective recompute recomputes (memory only)",
       {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out",
        "gdp_in_proj", "gdp_qkv", "mhc"},
       true},
      {"tp-comm-overlap", "an overlap of communication", {}},
      {"overlap-grad-reduce", "an overlap of communication (gradients are reduced in buckets during backward)", {}},
      {"overlap-param-gather", "an overlap of communication", {}},
      {"no-async-tensor-model-parallel-allreduce", "an overlap of communication", {}},
      {"disable-async-tensor-model-parallel-allreduce", "an overlap of communication", {}},
      {"disable-ckpt-fully-parallel-save", "every rank writes its own pieces here", {}},
      {"distributed-timeout-seconds-after-init",
       "the collectives' timeout after the start (--distributed-timeout-minutes here throughout)",
       {"COUNT"}},
      {"rerun-mode",
       "Megatron's rerun state machine, which re-runs a step to tell a transient fault from a real NaN (a NaN ends "
       "the job here, --check-for-nan-in-loss-and-grad)",
       {"disabled", "validate_results", "report_stats"}},
      {"save-retain-interval", "Megatron's removal of older checkpoints (Trestle keeps every one it saves)", {"COUNT"}},
      {"non-persistent-save-interval",
       "Megatron's extra non-persistent (local) checkpoints; --save-interval saves here",
       {"COUNT"}},
      {"non-persistent-ckpt-type",
       "Megatron's extra non-persistent (local) checkpoints; --save-interval saves here",
       {"global", "local", "in_memory"}},
      {"non-persistent-global-ckpt-dir", "Megatron's extra non-persistent checkpoints' directory", {"TEXT"}},
      {"non-persistent-local-ckpt-dir", "Megatron's extra non-persistent checkpoints' directory", {"TEXT"}},
      {"non-persistent-local-ckpt-algo",
       "Megatron's extra non-persistent checkpoints' algorithm",
       {"fully_parallel", "atomic"}},
      {"use-torch-fsdp2",
       "where the parameters live (FSDP): the same training; --use-distributed-optimizer shards the optimizer here",
       {}},
      {"use-megatron-fsdp",
       "where the parameters live (FSDP): the same training; --use-distributed-optimizer shards the optimizer here",
       {}},
      {"data-parallel-sharding-strategy", kFsdp, {"no_shard", "optim", "optim_grads", "optim_grads_params"}},
      {"outer-dp-sharding-strategy", kFsdp, {"no_shard", "optim"}},
      {"megatron-fsdp-version", kFsdp, {"1", "2"}},
      {"fsdp-double-buffer", kFsdp, {}},
      {"fsdp-manual-registration", kFsdp, {}},
      {"fsdp-db-use-persist-buf-on-alloc-fail", kFsdp, {}},
      {"megatron-fsdp-max-pool-double-buffer", kFsdp, {}},
      {"megatron-fsdp-enable-fine-grained-param-gather", kFsdp, {}},
      {"enable-full-sharding-in-hsdp", kFsdp, {}},
      {"suggested-communication-unit-size", kFsdp, {"COUNT"}},
      {"torch-fsdp2-no-reshard-after-forward", kFsdp, {}},
      {"megatron-fsdp-main-params-dtype",
       "Megatron-FSDP's master weights (fp32 here)",
       {"fp32", "bf16", "fp16", "auto"}},
      {"megatron-fsdp-main-grads-dtype",
       "Megatron-FSDP's gradient buffer (fp32 here; bf16 with --grad-reduce-in-bf16)",
       {"fp32", "bf16", "fp16", "auto"}},
      {"megatron-fsdp-grad-comm-dtype",
       "Megatron-FSDP's gradient reduction (fp32 here; bf16 with --grad-reduce-in-bf16)",
       {"fp32", "bf16", "fp16", "auto"}},
      {"inprocess-restart", kInProcessRestart, {}},
      {"inprocess-max-iterations", kInProcessRestart, {"COUNT"}},
      {"inprocess-monitor-thread-interval", kInProcessRestart, {"NUMBER"}},
      {"inprocess-monitor-process-interval", kInProcessRestart, {"NUMBER"}},
      {"inprocess-progress-watchdog-interval", kInProcessRestart, {"NUMBER"}},
      {"inprocess-heartbeat-interval", kInProcessRestart, {"NUMBER"}},
      {"inprocess-soft-timeout", kInProcessRestart, {"NUMBER"}},
      {"inprocess-hard-timeout", kInProcessRestart, {"NUMBER"}},
      {"inprocess-heartbeat-timeout", kInProcessRestart, {"NUMBER"}},
      {"inprocess-barrier-timeout", kInProcessRestart, {"NUMBER"}},
      {"inprocess-completion-timeout", kInProcessRestart, {"NUMBER"}},
      {"inprocess-last-call-wait", kInProcessRestart, {"NUMBER"}},
      {"inprocess-termination-grace-time", kInProcessRestart, {"NUMBER"}},
      {"inprocess-granularity", kInProcessRestart, {"node", "rank"}},
      {"inprocess-active-world-size", kInProcessRestart, {"COUNT"}},
      {"inprocess-empty-cuda-cache", kInProcessRestart, {}},
      {"adlr-autoresume", kFaultTolerance, {}},
      {"adlr-autoresume-interval", kFaultTolerance, {"COUNT"}},
      {"ft-num-warmup-iters", kFaultTolerance, {"COUNT"}},
      {"fim-rate", kFimOnly, {"NUMBER"}},
      {"fim-spm-rate", kFimOnly, {"NUMBER"}},
      {"fim-split-sample", kFimOnly, {"TEXT"}},
      {"fim-fragment-rate", kFimOnly, {"NUMBER"}},
      {"fim-no-prefix", kFimOnly, {"TEXT"}},
      {"fim-prefix-token", kFimOnly, {"TEXT"}},
      {"fim-middle-token", kFimOnly, {"TEXT"}},
      {"fim-suffix-token", kFimOnly, {"TEXT"}},
      {"fim-pad-token", kFimOnly, {"TEXT"}},
      {"fim-eod-token", kFimOnly, {"TEXT"}},
      {"muon-momentum", kMuonOnly, {"NUMBER"}},
      {"muon-nesterov", kMuonOnly, {}},
      {"muon-num-ns-steps", kMuonOnly, {"COUNT"}},
      {"muon-scale-mode", kMuonOnly, {"spectral", "unit_rms_norm", "shape_scaling"}},
      {"muon-extra-scale-factor", kMuonOnly, {"NUMBER"}},
      {"muon-no-split-qkv", kMuonOnly, {}},
      {"muon-tp-mode", kMuonOnly, {"blockwise", "duplicated", "distributed"}},
      {"muon-fp32-matmul-prec", kMuonOnly, {"low", "medium", "high"}},
      {"muon-coefficient-type", kMuonOnly, {"TEXT"}},
      {"muon-use-syrk", kMuonOnly, {}},
      {"muon-scalar-optimizer", kMuonOnly, {"adam", "lion"}},
      {"no-use-layer-wise-param-layout", kMuonOnly, {}},
      {"spec",
       "the module that builds Megatron's layers (its standard Mamba stack; the model is the checkpoint's)",
       {"megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"},
       true},
      {"moe-token-dispatcher-type",
       "how tokens reach their experts (all-to-all here; the same result)",
       {"allgather", "alltoall", "flex"}},
      {"moe-flex-dispatcher-backend",
       "how tokens reach their experts (all-to-all here; the same result)",
       {"deepep", "hybridep", "ncclep"}},
      {"distributed-backend", "the collectives' library (Gloo on the CPU, NCCL on GPUs)", {"nccl", "gloo"}},
      {"use-cpu-initialization", "where weights are initialised", {}},
      {"init-model-with-meta-device", "where Megatron builds the model before its weights are set", {}},
      {"empty-unused-memory-level", "when the allocator's cache is emptied", {"0", "1", "2"}},
      {"manual-gc", "Python's garbage collector", {}},
      {"manual-gc-interval", "Python's garbage collector", {"COUNT"}},
      {"num-workers", "data-loader processes", {"COUNT"}},
      {"num-dataset-builder-threads", "dataset-building threads", {"COUNT"}},
      {"no-mmap-bin-files", "how the dataset's .bin files are read", {}},
      {"tokenizer-type", kTokenized, {"TEXT"}},
      {"tokenizer-model", kTokenized, {"TEXT"}},
      {"vocab-file", kTokenized, {"TEXT"}},
      {"merge-file", kTokenized, {"TEXT"}},
      {"tiktoken-pattern", kTokenized, {"v1", "v2"}},
      {"async-save", "saves are asynchronous here", {}},
      {"use-persistent-ckpt-worker", "saves are asynchronous here", {}},
      {"ckpt-fully-parallel-save", "every rank writes its own pieces here", {}},
      {"ckpt-fully-parallel-load", "every rank reads its own pieces here", {}},
      {"ckpt-assume-constant-structure", "a save-plan cache", {}},
      {"auto-detect-ckpt-format", "--load's format is detected here", {}},
      {"dist-ckpt-strictness",
       "torch_dist key checks (a loaded checkpoint is checked whole here)",
       {"assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all", "return_unexpected",
        "return_all", "ignore_all"}},
      {"enable-gpt-oss",
       "read by ModelOpt's model builder only (a ModelOpt checkpoint loaded), where it sets YaRN RoPE; Megatron's "
       "GPTModel, and this trainer, take the RoPE from the model",
       {}},
      {"fp8-recipe", kFp8Only, {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"}},
      {"fp8-margin", kFp8Only, {"INT"}},
      {"fp8-interval", kFp8Only, {"COUNT"}},
      {"fp8-amax-history-len", kFp8Only, {"COUNT"}},
      {"fp8-amax-compute-algo", kFp8Only, {"most_recent", "max"}},
      {"fp8-dot-product-attention", kFp8Only, {}},
      {"fp8-multi-head-attention", kFp8Only, {}},
      {"logging-level", "Python's logging level", {"COUNT"}},
      {"timing-log-level", "Megatron's timers", {"0", "1", "2"}},
      {"log-memory-to-tensorboard", "GPU memory scalars (peak memory is in --log-json's records)", {}},
      {"tensorboard-queue-size", "TensorBoard's writer queue (events are flushed each iteration)", {"COUNT"}},
      {"wandb-save-dir", "Weights & Biases logging (TensorBoard and --log-json here)", {"TEXT"}},
      {"log-progress", "Megatron's progress.txt (the JSON lines log has the same figures)", {}},
      {"log-energy", "GPU energy readings", {}},
      {"log-straggler", "straggler detection", {}},
      {"barrier-with-L1-time", "Megatron's timers", {}},
      {"train-sync-interval", "a CPU-GPU synchronisation for timing", {"COUNT"}},
      {"check-weight-hash-across-dp-replicas-interval", "a debugging check of the replicas", {"COUNT"}},
      {"reset-position-ids",
       "megatron-core's RoPE reads each token's place in the sequence, not the position ids (those feed learned "
       "absolute position embeddings only, which these models lack)",
       {}},
      {"record-memory-history", "a memory profile", {}},
      {"memory-snapshot-path", "a memory profile", {"TEXT"}},
      {"wandb-project", "Weights & Biases logging (TensorBoard and --log-json here)", {"TEXT"}},
      {"wandb-exp-name", "Weights & Biases logging (TensorBoard and --log-json here)", {"TEXT"}},
      {"use-fused-weighted-squared-relu", "a fusion", {}},
      {"enable-experimental", "Megatron's experimental code paths (kernels and fusions)", {}},
      {"disable-gloo-process-groups", "Megatron's CPU-side process groups", {}},
      {"trust-remote-code", kTokenized, {}},
      {"deterministic-mode", "deterministic kernels on GPUs (Trestle's CPU runs are deterministic)", {}},
      {"dataloader-type",
       "single only: Megatron's pretraining sampler, the order Trestle reads the samples in",
       {"single", "cyclic", "external"}},
      {"cp-comm-type",
       "how context parallelism's attention communicates (each kind computes the same attention; Trestle's is the "
       "ring, p2p)",
       {"p2p", "a2a", "allgather", "a2a+p2p"},
       true},
      {"no-overlap-p2p-communication", "an overlap of the pipeline's sends and receives", {}},
      {"overlap-param-gather-with-optimizer-step", "an overlap of communication", {}},
      {"no-align-param-gather", "how the parameter all-gathers are launched", {}},
      {"use-nccl-ub", "NCCL's user buffers", {}},
      {"disable-symmetric-registration", "NCCL's buffer registration", {}},
      {"moe-shared-expert-overlap", "an overlap (the shared experts computed beside the token dispatch)", {}},
      {"moe-layer-recompute", "activation recompute of the MoE layers (memory only)", {}},
      // Megatron-LM 0.19's flags (megatron-core 0.19's training arguments).
      {"use-dist-ckpt", "deprecated in Megatron-LM, where it has no effect either (--ckpt-format chooses)", {}},
      {"dist-ckpt-format",
       "deprecated in Megatron-LM, where it has no effect either (--ckpt-format chooses)",
       {"TEXT"}},
      {"dist-ckpt-workers",
       "the processes that write Megatron's asynchronous saves (Trestle's are threads)",
       {"COUNT"}},
      {"async-strategy", "Megatron's asynchronous save machinery (saves are asynchronous here)", {"nvrx", "mcore"}},
      {"async-ckpt-cpu-priority", "Megatron's asynchronous save processes' priority", {"INT"}},
      {"async-ckpt-io-priority", "Megatron's asynchronous save processes' priority", {"INT"}},
      {"async-ckpt-use-cpu-shm", "Megatron's asynchronous save staging", {}},
      {"ckpt-drop-redundant-extra-state", "Transformer Engine's _extra_state entries (Trestle saves none)", {}},
      {"ckpt-fully-parallel-load-exchange-algo", kCheckpointIo, {"broadcast", "gather_rounds", "gather_object"}},
      {"dist-ckpt-optim-fully-reshardable", "the layout of Megatron's optimizer files (Trestle's reshard on load)", {}},
      {"distrib-optim-fully-reshardable-mem-efficient",
       "the layout of Megatron's optimizer files (Trestle's reshard on load)",
       {}},
      {"use-mp-args-from-checkpoint-args", "the model's description always comes from the checkpoint here", {}},
      {"ddp-pad-buckets-for-high-nccl-busbw", kGradientCommunication, {}},
      {"ddp-average-in-collective", kGradientCommunication, {}},
      {"ddp-reduce-scatter-with-fp32-accumulation", kGradientCommunication, {}},
      {"no-gradient-reduce-div-fusion", "a fusion", {}},
      {"no-align-grad-reduce", "how the gradient reductions are launched", {}},
      {"disable-align-grad-reduce", "how the gradient reductions are launched", {}},
      {"num-distributed-optimizer-instances", kOptimizerPlacement, {"COUNT"}},
      {"optimizer-cpu-offload", kOptimizerPlacement, {}},
      {"optimizer-offload-fraction", kOptimizerPlacement, {"NUMBER"}},
      {"overlap-cpu-optimizer-d2h-h2d", kOptimizerPlacement, {}},
      {"use-torch-optimizer-for-cpu-offload", kOptimizerPlacement, {}},
      {"no-pin-cpu-grads", kOptimizerPlacement, {}},
      {"no-pin-cpu-params", kOptimizerPlacement, {}},
      {"optimizer-cuda-graph", "CUDA graphs replay the same kernels", {}},
      {"cuda-graph-modules",
       "CUDA graphs replay the same kernels",
       {"attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full", "full_iteration",
        "full_iteration_inference"},
       true},
      {"cuda-graph-scope",
       "Megatron's older name of --cuda-graph-modules",
       {"attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full", "full_iteration",
        "full_iteration_inference"},
       true},
      {"use-precision-aware-optimizer",
       "Transformer Engine's optimizer with its states in other precisions: with them all fp32 (the only choice "
       "here), the same step",
       {}},
      {"main-grads-dtype", kPrecisionAwareOnly, {"fp32", "bf16"}},
      {"main-params-dtype", kPrecisionAwareOnly, {"fp32", "fp16"}},
      {"exp-avg-dtype", kPrecisionAwareOnly, {"fp32", "fp16", "bf16", "fp8"}},
      {"exp-avg-sq-dtype", kPrecisionAwareOnly, {"fp32", "fp16", "bf16", "fp8"}},
      {"sgd-momentum", kOtherOptimizer, {"NUMBER"}},
      {"lion-beta1", kOtherOptimizer, {"NUMBER"}},
      {"lion-beta2", kOtherOptimizer, {"NUMBER"}},
      {"head-lr-mult", "a learning-rate multiplier of Megatron's vision heads (a GPT model has none)", {"NUMBER"}},
      {"apply-query-key-layer-scaling",
       "fp16 headroom: Megatron divides the attention scores by the layer number and multiplies them back in the "
       "softmax (the same attention)",
       {}},
      {"fp16-lm-cross-entropy", "the language-model loss in fp16 (computed in fp32 here)", {}},
      {"dataloader-fast-cache-load", kDatasetIndexIo, {}},
      {"dataloader-defer-npy-index-mmap", kDatasetIndexIo, {}},
      {"per-dataset-sequences-path", "sequence counts read from a file instead of the .idx files", {"TEXT"}},
      {"object-storage-cache-path", "the index cache of object-storage data (Trestle reads local files)", {"TEXT"}},
      {"enable-msc", "Multi-Storage Client paths (Trestle reads local files)", {}},
      {"disable-msc", "deprecated in Megatron-LM, where it has no effect either", {}},
      {"no-data-sharding", "the cyclic sampler's sharding (the single sampler reads here)", {}},
      {"check-for-large-grads", "Megatron's rerun check for unexpectedly large gradients (a debugging aid)", {}},
      {"check-for-spiky-loss", "Megatron's rerun check for spiking losses (a debugging aid)", {}},
      {"no-one-logger", kTelemetry, {}},
      {"one-logger-project", kTelemetry, {"TEXT"}},
      {"one-logger-run-name", kTelemetry, {"TEXT"}},
      {"one-logger-async", kTelemetry, {}},
      {"otel-enabled", "OpenTelemetry traces and metrics", {}},
      {"otel-service-name", "OpenTelemetry traces and metrics", {"TEXT"}},
      {"otel-span-groups", "OpenTelemetry traces and metrics", {"TEXT"}},
      {"app-tag-run-name", kTelemetry, {"TEXT"}},
      {"app-tag-run-version", kTelemetry, {"TEXT"}},
      {"enable-ft-package", kFaultTolerance, {}},
      {"calc-ft-timeouts", kFaultTolerance, {}},
      {"tp-comm-overlap-cfg", "an overlap of communication", {"TEXT"}},
      {"te-precision-config-file", kFp8Only, {"TEXT"}},
      {"disable-jit-fuser", "a fusion", {}},
      {"use-te-activation-func", "the activation's kernel", {}},
      {"fused-residual-rmsnorm", "a fusion", {}},
      {"moe-router-fusion", "a fusion", {}},
      {"moe-enable-deepep", "how tokens reach their experts (all-to-all here; the same result)", {}},
      {"moe-deepep-num-sms", "how tokens reach their experts (all-to-all here; the same result)", {"COUNT"}},
      {"overlap-moe-expert-parallel-comm", "an overlap of communication", {}},
      {"delay-wgrad-compute", "when weight gradients are computed (the same gradients)", {}},
      {"distribute-saved-activations", "where recomputed layers keep their inputs (memory only)", {}},
      {"flash-attention-version", "the attention kernel (LibTorch's SDPA here)", {"2", "3", "4"}},
      {"use-sharp", "NCCL's in-network reductions", {}},
      {"use-tp-pp-dp-mapping", "the order ranks are numbered in (the same groups' results)", {}},
      {"local-rank", "launchers' per-process argument (Trestle reads LOCAL_RANK)", {"COUNT"}},
      {"lazy-mpu-init", "when Megatron sets up its process groups", {}},
      {"wandb-entity", "Weights & Biases logging (TensorBoard and --log-json here)", {"TEXT"}},
      {"log-memory-interval", "Megatron's memory report (peak memory is in the log line)", {"COUNT"}},
      {"timing-log-option", "Megatron's timers", {"max", "minmax", "all"}},
      {"no-barrier-with-level-1-timing", "Megatron's timers", {}},
      {"pytorch-profiler-collect-callstack", "the profiler's record of Python call stacks", {}},
      {"no-manual-gc-eval", "Python's garbage collector", {}},
      {"disable-manual-gc-eval", "Python's garbage collector", {}},
      {"gpu-sniff-test-interval", "Megatron's GPU performance tests", {"COUNT"}},
      {"config-logger-dir", "Megatron's dump of its modules' configurations", {"TEXT"}},
      {"vocab-extra-ids", kTokenized, {"COUNT"}},
      {"tokenizer-metadata", kTokenized, {"TEXT"}},
      {"tokenizer-special-tokens", kTokenized, {"TEXT"}, true},
      {"tiktoken-num-special-tokens", kTokenized, {"COUNT"}},
      {"tokenizer-sentencepiece-legacy", kTokenized, {}},
      {"tokenizer-hf-no-use-fast", kTokenized, {}},
      {"tokenizer-hf-use-fast", kTokenized, {}},
      {"tokenizer-hf-include-special-tokens", kTokenized, {}},
      {"legacy-tokenizer", kTokenized, {}},
      {"tokenizer-hf-no-include-special-tokens", kTokenized, {}},
      {"chat-template", kTokenized, {"TEXT"}},
      {"no-ckpt-fully-parallel-save", "every rank writes its own pieces here", {}},
      {"ckpt-fully-parallel-save-process-group", kCheckpointIo, {"dp", "ep_dp"}},
      {"ckpt-fully-parallel-load-process-group", kCheckpointIo, {"dp", "ep_dp"}},
      {"no-ckpt-load-validate-sharding-integrity",
       "a check of Megatron's loads (every load is checked whole here)",
       {}},
      {"disable-ckpt-load-validate-sharding-integrity",
       "a check of Megatron's loads (every load is checked whole here)",
       {}},
      {"pipeline-model-parallel-comm-backend", "the pipeline's send and receive library", {"nccl", "ucc"}},
      {"nccl-communicator-config-path", "NCCL's communicator settings", {"TEXT"}},
      {"symmetric-ar-type", "NCCL's symmetric-memory all-reduce kind", {"two_shot", "one_shot", "multimem_all_reduce"}},
      {"sharp-enabled-group", "NCCL's in-network reductions", {"dp", "dp_replica"}},
      {"use-ring-exchange-p2p", "how the pipeline's sends and receives are issued", {}},
      {"create-all-gather-group", "a separate process group for parameter all-gathers", {}},
      {"high-priority-a2a-comm-stream", "a CUDA stream's priority", {}},
      {"high-priority-stream-groups", "CUDA streams' priority", {"TEXT"}, true},
      {"hierarchical-context-parallel-sizes",
       "with --cp-comm-type a2a+p2p: how context parallelism communicates",
       {"TEXT"},
       true},
      {"defer-embedding-wgrad-compute", "when weight gradients are computed (the same gradients)", {}},
      {"wgrad-deferral-limit", "when weight gradients are computed (the same gradients)", {"COUNT"}},
      {"overlap-dispatch-backward-with-experts-wgrad", "an overlap of communication", {}},
      {"ep-overlap-early-attn-memory-release", "an overlap's memory release", {}},
      {"overlap-p2p-communication-warmup-flush", "an overlap of the pipeline's sends and receives", {}},
      {"fine-grained-activation-offloading", "activations kept in host memory (memory only)", {}},
      {"activation-offload-fraction", "activations kept in host memory (memory only)", {"NUMBER"}},
      {"min-offloaded-tensor-size", "activations kept in host memory (memory only)", {"COUNT"}},
      {"delay-offload-until-cuda-graph", "activations kept in host memory (memory only)", {}},
      {"delta-offload-bytes-across-pp-ranks", "activations kept in host memory (memory only)", {"INT"}},
      {"fine-grained-offloading-max-inflight-offloads", "activations kept in host memory (memory only)", {"COUNT"}},
      {"mlp-chunks-for-training", "the MLP run in chunks of the sequence (memory only)", {"COUNT"}},
      {"no-clone-scatter-output-in-embedding", "a copy in Megatron's embedding (memory only)", {}},
      {"disable-clone-scatter-output-in-embedding", "a copy in Megatron's embedding (memory only)", {}},
      {"disable-mamba-mem-eff-path", "the Mamba mixer's kernel path", {}},
      {"batch-invariant-mode", "batch-invariant kernels on GPUs", {}},
      {"te-rng-tracker", "Transformer Engine's RNG tracker (Trestle trains without dropout)", {}},
      {"use-transformer-engine-op-fuser", "a fusion", {}},
      {"mla-down-proj-fusion", "a fusion", {}},
      {"use-grouped-gemm-for-dense-mlp", "the MLP's GEMM kernel", {}},
      {"use-grouped-gemm-for-shared-expert", "the shared expert's GEMM kernel", {}},
      {"moe-flex-dispatcher-num-sms", "how tokens reach their experts (all-to-all here; the same result)", {"COUNT"}},
      {"moe-hybridep-num-sms", "how tokens reach their experts (all-to-all here; the same result)", {"COUNT"}},
      {"moe-permute-fusion-into-hybridep", "a fusion", {}},
      {"moe-router-padding-for-quantization", kFp8Only, {}},
      {"first-last-layers-bf16", kFp8Only, {}},
      {"num-layers-at-start-in-bf16", kFp8Only, {"COUNT"}},
      {"num-layers-at-end-in-bf16", kFp8Only, {"COUNT"}},
      {"flight-recorder-dump-path", "PyTorch's NCCL flight recorder", {"TEXT"}},
      {"flight-recorder-trace-buffer-size", "PyTorch's NCCL flight recorder", {"COUNT"}},
      {"flight-recorder-include-stack-trace", "PyTorch's NCCL flight recorder", {}},
      {"no-flight-recorder-dump-on-timeout", "PyTorch's NCCL flight recorder", {}},
      {"disable-flight-recorder-dump-on-timeout", "PyTorch's NCCL flight recorder", {}},
      {"log-device-memory-used", "Megatron's memory report (peak memory is in the log line)", {}},
      {"log-max-attention-logit", "Megatron's report of the largest attention logit", {}},
      {"no-tp-comm-bulk-dgrad", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-bulk-dgrad", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"no-tp-comm-bulk-wgrad", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-bulk-wgrad", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"no-tp-comm-overlap-ag", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-overlap-ag", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"no-tp-comm-overlap-rs", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-overlap-rs", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"no-tp-comm-split-ag", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-split-ag", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"no-tp-comm-split-rs", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"disable-tp-comm-split-rs", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"tp-comm-overlap-rs-dgrad", "an overlap of communication (with --tp-comm-overlap)", {}},
      {"tp-comm-bootstrap-backend", "an overlap of communication (with --tp-comm-overlap)", {"nccl", "mpi", "gloo"}},
      {"no-flight-recorder-include-only-active", "PyTorch's NCCL flight recorder", {}},
      {"disable-flight-recorder-include-only-active", "PyTorch's NCCL flight recorder", {}},
      {"no-flight-recorder-extra-dump-on-exec", "PyTorch's NCCL flight recorder", {}},
      {"disable-flight-recorder-extra-dump-on-exec", "PyTorch's NCCL flight recorder", {}},
      {"nvtx-ranges", "a profile's NVTX ranges", {}},
      {"pytorch-profiler-collect-chakra", "the profiler's Chakra execution traces", {}},
      {"fp8-output-proj", kFp8Only, {}},
      {"fp8-quantizer-factory", kFp8Only, {"TEXT"}},
      {"no-fp8-wgrad", kFp8Only, {}},
      {"disable-fp8-wgrad", kFp8Only, {}},
      {"keep-fp8-transpose-cache", kFp8Only, {}},
      {"moe-router-padding-for-fp8", kFp8Only, {}},
      {"cuda-graph-warmup-steps", "CUDA graphs replay the same kernels", {"COUNT"}},
      {"dist-ckpt-save-pre-mcore-014", kCheckpointIo, {}},
      {"ddp-param-name-patterns-for-fp32-local-accumulation", kGradientCommunication, {"TEXT"}, true},
  };
  return flags;
}

bool takes_value(const NoEffectFlag& f) { return !f.choices.empty(); }
bool takes_sentinel(const NoEffectFlag& f, const char* sentinel) {
  return f.choices.size() == 1 && f.choices[0] == sentinel;
}
bool takes_integer(const NoEffectFlag& f) { return takes_sentinel(f, "COUNT") || takes_sentinel(f, "INT"); }
bool takes_number(const NoEffectFlag& f) { return takes_sentinel(f, "NUMBER"); }

std::string joined(const std::vector<std::string>& words, const char* separator = ", ") {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : separator) + w;
  return out;
}

}  // namespace

std::string shortest_decimal(double v) {
  char text[64];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;
  }
  return text;
}

const std::vector<std::string>& megatron_list_flags() {
  static const std::vector<std::string> flags = [] {
    std::vector<std::string> out = {"--moe-router-load-balancing-type", "--moe-aux-loss-coeff"};
    for (const NoEffectFlag& f : no_effect_flags())
      if (f.several) out.push_back(std::string("--") + f.name);
    return out;
  }();
  return flags;
}

void declare_megatron_flags(cxxopts::Options& spec) {
  spec.add_options(kMegatronModelGroup)("num-layers", "checked against the model's transformer layers",
                                        cxxopts::value<std::int64_t>())(
      "hidden-size", "checked against the model's hidden size", cxxopts::value<std::int64_t>())(
      "ffn-hidden-size", "checked against the MLP's hidden size (MoE: the dense layers', else the experts')",
      cxxopts::value<std::int64_t>())("moe-ffn-hidden-size", "MoE: checked against each expert's hidden size",
                                      cxxopts::value<std::int64_t>())(
      "num-attention-heads", "checked against the model's query heads", cxxopts::value<std::int64_t>())(
      "group-query-attention", "with --num-query-groups: checked against the model's key/value heads")(
      "num-query-groups",
      "checked against the model's key/value heads (Megatron reads it with --group-query-attention)",
      cxxopts::value<std::int64_t>())("kv-channels", "checked against the model's head dim",
                                      cxxopts::value<std::int64_t>())(
      "vocab-size", "checked against the model's (unpadded) vocabulary", cxxopts::value<std::int64_t>())(
      "padded-vocab-size",
      "the output layer's rows exactly, instead of the vocabulary padded by --make-vocab-size-divisible-by: at least "
      "the model's vocabulary, divisible by the tensor-parallel size",
      cxxopts::value<std::int64_t>())("max-position-embeddings", "at least --seq-length (Megatron asserts it)",
                                      cxxopts::value<std::int64_t>())(
      "rotary-base", "checked against the model's RoPE base", cxxopts::value<double>())(
      "rotary-percent", "checked against the share of each head RoPE rotates", cxxopts::value<double>())(
      "rotary-interleaved", "refused: the model's RoPE rotates the two halves of each head, not interleaved pairs")(
      "rotary-seq-len-interpolation-factor",
      "checked against the model's linear RoPE scaling (positions divided by it; 1: none)",
      cxxopts::value<std::int64_t>())(
      "no-rope-freq", "which layers skip RoPE (N: every Nth, or a list expression): checked, none here",
      cxxopts::value<std::string>())("norm-epsilon", "checked against the norms' epsilon", cxxopts::value<double>())(
      "normalization", "RMSNorm (every model here)", cxxopts::value<std::string>())(
      "position-embedding-type", "rope (yarn for YaRN scaling; none for a Mamba hybrid)",
      cxxopts::value<std::string>())("use-rotary-position-embeddings", "the model's attention uses RoPE")(
      "no-position-embedding", "the model has no learned position embedding (Megatron takes it with rope only)")(
      "swiglu", "the model's MLP is SwiGLU")("untie-embeddings-and-output-weights",
                                             "the model has an output layer of its own")(
      "disable-bias-linear", "the model's linear layers have no biases")(
      "add-qkv-bias", "the model's query/key/value projection has biases")(
      "qk-layernorm", "the model norms its queries and keys (multi-latent attention: its latents)")(
      "qk-l2-norm", "refused: the model's queries and keys are not L2-normed (Llama 4's)")(
      "export-qk-l2-norm", "ModelOpt's name of --qk-l2-norm: refused the same")(
      "apply-layernorm-1p", "the model's norms apply (1 + w) (Gemma)")(
      "moe-router-score-function", "MoE: checked against the router's (softmax, sigmoid)",
      cxxopts::value<std::string>())("moe-router-enable-expert-bias", "MoE: the router has an expert bias")(
      "moe-apply-probs-on-input", "refused: the routing probabilities weigh the experts' outputs, not inputs")(
      "export-moe-apply-probs-on-input", "ModelOpt's name of --moe-apply-probs-on-input: refused the same")(
      "moe-router-topk-scaling-factor", "MoE: checked against the routed weights' scale", cxxopts::value<double>())(
      "moe-shared-expert-intermediate-size", "MoE: checked against the shared expert's hidden size",
      cxxopts::value<std::int64_t>())("attention-dropout", "0 only: Trestle trains without dropout",
                                      cxxopts::value<double>())(
      "hidden-dropout", "0 only: Trestle trains without dropout", cxxopts::value<double>());
  spec.add_options(kMegatronModelGroup)("multi-latent-attention", "the model's attention is multi-latent attention")(
      "q-lora-rank", "multi-latent attention: checked against the query down-projection's rank (none: no flag)",
      cxxopts::value<std::int64_t>())("kv-lora-rank", "multi-latent attention: checked against the key/value latent",
                                      cxxopts::value<std::int64_t>())(
      "qk-head-dim", "multi-latent attention: checked against the query/key head dims without RoPE",
      cxxopts::value<std::int64_t>())("qk-pos-emb-head-dim", "multi-latent attention: checked against the RoPE dims",
                                      cxxopts::value<std::int64_t>())(
      "v-head-dim", "multi-latent attention: checked against the value head dims", cxxopts::value<std::int64_t>())(
      "rope-type", "multi-latent attention's RoPE (rope, yarn; Megatron's default yarn): checked against the model's",
      cxxopts::value<std::string>())("rotary-scaling-factor", "YaRN: checked against the model's factor",
                                     cxxopts::value<double>())("mscale", "YaRN: checked against the model's mscale",
                                                               cxxopts::value<double>())(
      "mscale-all-dim", "YaRN: checked against the model's mscale_all_dim", cxxopts::value<double>())(
      "yarn-original-max-position-embeddings", "YaRN (--position-embedding-type yarn): checked against the model's",
      cxxopts::value<std::int64_t>())("yarn-beta-fast", "YaRN (--position-embedding-type yarn): checked",
                                      cxxopts::value<double>())(
      "yarn-beta-slow", "YaRN (--position-embedding-type yarn): checked", cxxopts::value<double>())(
      "yarn-correction-range-round-to-int", "YaRN: the model rounds its correction range to whole dims")(
      "no-yarn-correction-range-round-to-int", "YaRN: the model does not round its correction range")(
      "use-rope-scaling", "the model's RoPE has Llama 3.1's scaling (with --rope-scaling-factor, default 8)")(
      "rope-scaling-factor", "with --use-rope-scaling: checked against the model's Llama 3.1 factor",
      cxxopts::value<double>());
  spec.add_options(kMegatronModelGroup)(
      "hybrid-layer-pattern",
      "a Mamba hybrid (Nemotron-H): checked against the model's layers, one letter each (M Mamba, * attention, "
      "- MLP, E MoE)",
      cxxopts::value<std::string>())("hybrid-override-pattern", "Megatron's older name of --hybrid-layer-pattern",
                                     cxxopts::value<std::string>())("is-hybrid-model",
                                                                    "the model is a Mamba hybrid (older Megatron-LM)")(
      "mamba-num-heads", "a Mamba hybrid: checked against the mixers' heads", cxxopts::value<std::int64_t>())(
      "mamba-head-dim", "a Mamba hybrid: checked against the mixers' head dim", cxxopts::value<std::int64_t>())(
      "mamba-state-dim", "a Mamba hybrid: checked against the mixers' state dim", cxxopts::value<std::int64_t>())(
      "mamba-num-groups", "a Mamba hybrid: checked against the mixers' B/C groups", cxxopts::value<std::int64_t>())(
      "squared-relu", "the model's MLPs are fc2(relu(fc1 x)^2) (Nemotron-H)")(
      "experimental-attention-variant",
      "gated_delta_net: the model's linear-attention layers are Gated DeltaNet (Qwen3-Next, Qwen3.5); checked",
      cxxopts::value<std::string>())(
      "linear-attention-freq",
      "Gated DeltaNet: which layers it is (N: all but every Nth, or a list expression, 1 for Gated DeltaNet), checked",
      cxxopts::value<std::string>())("linear-conv-kernel-dim", "Gated DeltaNet: checked against its convolution width",
                                     cxxopts::value<std::int64_t>())(
      "linear-key-head-dim", "Gated DeltaNet: checked against its query/key head dim", cxxopts::value<std::int64_t>())(
      "linear-value-head-dim", "Gated DeltaNet: checked against its value head dim", cxxopts::value<std::int64_t>())(
      "linear-num-key-heads", "Gated DeltaNet: checked against its query/key heads", cxxopts::value<std::int64_t>())(
      "linear-num-value-heads", "Gated DeltaNet: checked against its value heads", cxxopts::value<std::int64_t>())(
      "attention-output-gate", "the model's attention output is gated by sigmoid(gate) (Qwen3-Next, Qwen3.5)")(
      "moe-shared-expert-gate", "MoE: the shared expert's output is gated (Qwen2-MoE, Qwen3-Next)")(
      "export-model-type",
      "ModelOpt's model class: GPTModel, or HybridModel (MambaModel, its older name) for a Mamba hybrid; checked",
      cxxopts::value<std::string>())("moe-latent-size",
                                     "MoE: checked against the latent width the routed experts work in (Nemotron 3)",
                                     cxxopts::value<std::int64_t>());
  spec.add_options(kMegatronModelGroup)(
      "moe-layer-freq",
      "MoE: which layers are MoE: N (every Nth from the first) or a list expression (\"[0]*3+[1]*58\"), checked",
      cxxopts::value<std::string>())("moe-router-pre-softmax",
                                     "MoE (softmax scores): the router takes the softmax before the top-k")(
      "moe-router-num-groups", "MoE: checked against the router's expert groups (group-limited routing)",
      cxxopts::value<std::int64_t>())("moe-router-group-topk",
                                      "MoE: checked against the groups a token may use (group-limited routing)",
                                      cxxopts::value<std::int64_t>())(
      "moe-router-load-balancing-type",
      "MoE: aux_loss (Megatron's default: each micro-batch's), seq_aux_loss (each sequence's, averaged), "
      "global_aux_loss (the experts' loads counted over the data-parallel ranks and averaged over the iteration's "
      "micro-batches) or none: the load-balancing loss that --moe-aux-loss-coeff weighs; several types, each with its "
      "own --moe-aux-loss-coeff value, add their losses",
      cxxopts::value<std::vector<std::string>>())(
      "moe-router-dtype",
      "MoE: fp32 or fp64: the router's logits, top-k, probabilities and load-balancing losses in that precision "
      "(under bf16 / fp16; its gradients return in the model's dtype), as Megatron does; default: the training dtype",
      cxxopts::value<std::string>())("moe-router-force-load-balancing",
                                     "refused: random routing for benchmarks, not the model's router")(
      "softmax-type", "attention's softmax: vanilla, or learnable (the model's attention sinks); checked",
      cxxopts::value<std::string>())("window-size",
                                     "sliding window \"(left, 0)\": checked against the model's (left + 1 positions)",
                                     cxxopts::value<std::string>())(
      "window-attn-skip-freq", "with --window-size: which layers have the window (N or a list expression), checked",
      cxxopts::value<std::string>())("glu-linear-offset", "checked against the gated MLP's offset on its linear half",
                                     cxxopts::value<double>())(
      "activation-func-clamp-value", "checked against the experts' activation clamp (GPT-OSS)",
      cxxopts::value<double>())("quick-geglu", "the model's MLP is quick GeGLU (GPT-OSS)")(
      "fp8-format", "refused: Trestle trains in fp32, bf16 or fp16", cxxopts::value<std::string>())(
      "fp8-param-gather", "refused: FP8 parameters (Megatron takes it with --fp8-format only)")(
      "fp4-format", "refused: Trestle trains in fp32, bf16 or fp16", cxxopts::value<std::string>())(
      "fp4-param-gather", "refused: FP4 parameters (Megatron takes it with --fp4-format only)")(
      "batch-size", "refused, as Megatron-LM refuses it: its old name of --micro-batch-size",
      cxxopts::value<std::int64_t>())("warmup", "refused, as Megatron-LM refuses it: use --lr-warmup-fraction",
                                      cxxopts::value<std::int64_t>())(
      "model-parallel-size", "refused, as Megatron-LM refuses it: use --tensor-model-parallel-size",
      cxxopts::value<std::int64_t>())("checkpoint-activations",
                                      "refused, as Megatron-LM refuses it: use --recompute-granularity full");
  auto refused = spec.add_options(kMegatronModelGroup);
  for (const RefusedFlag& f : refused_flags()) {
    const std::string help = std::string("refused: ") + f.why;
    if (f.takes_value) refused(f.name, help, cxxopts::value<std::string>());
    else refused(f.name, help);
  }
  auto group = spec.add_options(kMegatronNoEffectGroup);
  for (const NoEffectFlag& f : no_effect_flags()) {
    const std::string help = std::string("no effect here: ") + f.why;
    const bool free_value = takes_integer(f) || takes_number(f) || takes_sentinel(f, "TEXT");
    if (takes_integer(f)) group(f.name, help, cxxopts::value<std::int64_t>());
    else if (takes_number(f)) group(f.name, help, cxxopts::value<double>());
    else if (f.several && free_value) group(f.name, help, cxxopts::value<std::vector<std::string>>());
    else if (f.several)
      group(f.name, help + " (" + joined(f.choices) + ")", cxxopts::value<std::vector<std::string>>());
    else if (takes_value(f))
      group(f.name, free_value ? help : help + " (" + joined(f.choices) + ")", cxxopts::value<std::string>());
    else group(f.name, help);
  }
}

namespace {

Status check_choice(const cxxopts::ParseResult& args, const char* flag, const std::vector<std::string>& choices) {
  if (!args.count(flag)) return OkStatus();
  const std::string value = args[flag].as<std::string>();
  if (std::find(choices.begin(), choices.end(), value) != choices.end()) return OkStatus();
  return Status::Error(std::string("--") + flag + " " + value + ": not one of " + joined(choices));
}

Status check_no_effect_values(const cxxopts::ParseResult& args) {
  for (const NoEffectFlag& f : no_effect_flags()) {
    if (!args.count(f.name)) continue;
    if (takes_sentinel(f, "COUNT")) {
      if (args[f.name].as<std::int64_t>() < 0)
        return Status::Error(std::string("--") + f.name + " must not be negative");
    } else if (takes_number(f) || (f.several && takes_sentinel(f, "TEXT"))) {
      continue;
    } else if (f.several) {
      for (const std::string& value : args[f.name].as<std::vector<std::string>>())
        if (std::find(f.choices.begin(), f.choices.end(), value) == f.choices.end())
          return Status::Error(std::string("--") + f.name + " " + value + ": not one of " + joined(f.choices));
    } else if (takes_value(f) && !takes_integer(f) && !takes_sentinel(f, "TEXT")) {
      TRESTLE_RETURN_IF_ERROR(check_choice(args, f.name, f.choices));
    }
  }
  return OkStatus();
}

Status check_size_values(const cxxopts::ParseResult& args) {
  for (const char* flag : {"num-layers",
                           "hidden-size",
                           "ffn-hidden-size",
                           "moe-ffn-hidden-size",
                           "num-attention-heads",
                           "num-query-groups",
                           "kv-channels",
                           "vocab-size",
                           "max-position-embeddings",
                           "moe-shared-expert-intermediate-size",
                           "q-lora-rank",
                           "kv-lora-rank",
                           "qk-head-dim",
                           "qk-pos-emb-head-dim",
                           "v-head-dim",
                           "yarn-original-max-position-embeddings",
                           "moe-router-num-groups",
                           "moe-router-group-topk",
                           "padded-vocab-size",
                           "rotary-seq-len-interpolation-factor",
                           "linear-conv-kernel-dim",
                           "linear-key-head-dim",
                           "linear-value-head-dim",
                           "linear-num-key-heads",
                           "linear-num-value-heads"})
    if (args.count(flag) && args[flag].as<std::int64_t>() < 0)
      return Status::Error(std::string("--") + flag + " must not be negative");
  for (const char* flag : {"padded-vocab-size", "rotary-seq-len-interpolation-factor"})
    if (args.count(flag) && args[flag].as<std::int64_t>() < 1)
      return Status::Error(std::string("--") + flag + " must be at least 1");
  for (const char* length : {"seq-length", "encoder-seq-length"})
    if (args.count("max-position-embeddings") && args.count(length) &&
        args["max-position-embeddings"].as<std::int64_t>() < args[length].as<std::int64_t>())
      return Status::Error("--max-position-embeddings " +
                           std::to_string(args["max-position-embeddings"].as<std::int64_t>()) + " is less than --" +
                           length + " " + std::to_string(args[length].as<std::int64_t>()));
  return OkStatus();
}

// FP8 and the precision flags whose computation the trainer does not do.
Status check_precision_values(const cxxopts::ParseResult& args) {
  if (args.count("fp8-format"))
    return Status::Error("--fp8-format " + args["fp8-format"].as<std::string>() +
                         ": FP8 is not supported; Trestle trains in fp32, bf16 or fp16 (drop --fp8-format, and "
                         "--fp8-param-gather with it)");
  if (args.count("fp8-param-gather"))
    return Status::Error(
        "--fp8-param-gather: FP8 parameters, which Megatron takes only with --fp8-format and Trestle does not "
        "support; drop it");
  if (args.count("fp4-format") || args.count("fp4-param-gather"))
    return Status::Error(std::string(args.count("fp4-format") ? "--fp4-format" : "--fp4-param-gather") +
                         ": FP4 is not supported; Trestle trains in fp32, bf16 or fp16");
  if (args.count("use-precision-aware-optimizer"))
    for (const char* flag : {"main-grads-dtype", "main-params-dtype", "exp-avg-dtype", "exp-avg-sq-dtype"})
      if (args.count(flag) && args[flag].as<std::string>() != "fp32")
        return Status::Error(std::string("--") + flag + " " + args[flag].as<std::string>() +
                             " (--use-precision-aware-optimizer): Trestle keeps the optimizer's gradients, master "
                             "weights and moments in fp32; give fp32 or drop it");
  if (args.count("megatron-fsdp-main-params-dtype") &&
      args["megatron-fsdp-main-params-dtype"].as<std::string>() != "fp32")
    return Status::Error("--megatron-fsdp-main-params-dtype " +
                         args["megatron-fsdp-main-params-dtype"].as<std::string>() +
                         ": Trestle keeps the master weights in fp32; give fp32 or drop it");
  for (const char* flag : {"megatron-fsdp-main-grads-dtype", "megatron-fsdp-grad-comm-dtype"})
    if (args.count(flag) && args[flag].as<std::string>() != "fp32" && args[flag].as<std::string>() != "auto")
      return Status::Error(std::string("--") + flag + " " + args[flag].as<std::string>() +
                           ": Trestle accumulates and reduces the gradients in fp32 (in bf16 with "
                           "--grad-reduce-in-bf16); give fp32 or auto, or drop it");
  // Megatron's own check (validate_args).
  if (args.count("fp16-lm-cross-entropy") && !args.count("fp16"))
    return Status::Error(
        "--fp16-lm-cross-entropy: lm cross entropy in fp16 only support in fp16 mode (Megatron's "
        "check; give --fp16 or drop it)");
  return check_choice(args, "moe-router-dtype", {"fp32", "fp64"});
}

// Megatron-LM's old flags, refused with its messages (validate_args' deprecated arguments).
Status check_deprecated_flags(const cxxopts::ParseResult& args) {
  for (const auto& [flag, message] :
       {std::pair{"batch-size", "--batch-size argument is no longer valid, use --micro-batch-size instead"},
        std::pair{"warmup", "--warmup argument is no longer valid, use --lr-warmup-fraction instead"},
        std::pair{"model-parallel-size",
                  "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead"},
        std::pair{"checkpoint-activations",
                  "--checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
                  "--recompute-granularity and --recompute-method."}})
    if (args.count(flag)) return Status::Error(std::string(message) + " (Megatron-LM refuses it too)");
  return OkStatus();
}

Status check_router_values(const cxxopts::ParseResult& args) {
  if (args.count("moe-router-force-load-balancing"))
    return Status::Error(
        "--moe-router-force-load-balancing: Megatron then routes by random logits (a benchmark of balanced "
        "routing), not by the model's router; drop it");
  if (args.count("moe-router-load-balancing-type")) {
    const auto types = args["moe-router-load-balancing-type"].as<std::vector<std::string>>();
    const std::vector<std::string> choices = {"aux_loss", "seq_aux_loss",       "global_aux_loss",
                                              "sinkhorn", "quantile_balancing", "none"};
    for (const std::string& type : types)
      if (std::find(choices.begin(), choices.end(), type) == choices.end())
        return Status::Error("--moe-router-load-balancing-type " + type + ": not one of " + joined(choices));
    for (const std::string& type : types) {
      if (type == "sinkhorn" || type == "quantile_balancing")
        return Status::Error("--moe-router-load-balancing-type " + type +
                             " is not supported: Trestle's router adds Megatron's aux_loss, seq_aux_loss and "
                             "global_aux_loss (with --moe-aux-loss-coeff), or none");
      if (std::count(types.begin(), types.end(), type) > 1)
        return Status::Error("--moe-router-load-balancing-type " + joined(types, " ") + ": " + type +
                             " is given twice");
    }
    const std::size_t coefficients = args["moe-aux-loss-coeff"].as<std::vector<double>>().size();
    if (coefficients != types.size())
      return Status::Error("--moe-router-load-balancing-type " + joined(types, " ") + " takes " +
                           std::to_string(types.size()) +
                           " --moe-aux-loss-coeff value(s), one for each type, as "
                           "Megatron requires; " +
                           std::to_string(coefficients) + " given");
  } else if (args["moe-aux-loss-coeff"].as<std::vector<double>>().size() != 1) {
    return Status::Error(
        "--moe-aux-loss-coeff: one coefficient for Megatron's default load balancing (aux_loss); "
        "give --moe-router-load-balancing-type with one type for each");
  }
  const std::int64_t group_topk =
      args.count("moe-router-group-topk") ? args["moe-router-group-topk"].as<std::int64_t>() : 0;
  const std::int64_t groups =
      args.count("moe-router-num-groups") ? args["moe-router-num-groups"].as<std::int64_t>() : 0;
  if (group_topk > 0 && groups == 0)
    return Status::Error("--moe-router-group-topk needs --moe-router-num-groups (Megatron's group-limited routing)");
  if (group_topk > groups)
    return Status::Error("--moe-router-group-topk " + std::to_string(group_topk) +
                         " is more than --moe-router-num-groups " + std::to_string(groups));
  return OkStatus();
}

// A per-layer pattern that parses; `zero_or_one` (what 0 and 1 mean), when given, holds its list to those values.
Status check_pattern_value(const cxxopts::ParseResult& args, const char* flag, const char* zero_or_one) {
  if (!args.count(flag)) return OkStatus();
  const auto pattern = parse_layer_pattern(args[flag].as<std::string>());
  if (!pattern.ok()) return pattern.status().with_context(std::string("--") + flag);
  if (pattern->every && *pattern->every < 1)
    return Status::Error(std::string("--") + flag + " " + std::to_string(*pattern->every) + " must be at least 1");
  for (const std::int64_t v : pattern->layers)
    if (zero_or_one && v != 0 && v != 1)
      return Status::Error(std::string("--") + flag + " " + args[flag].as<std::string>() + " holds " +
                           std::to_string(v) + " (" + zero_or_one + ")");
  return OkStatus();
}

// Attention and position-embedding flags whose values, or combinations, Megatron itself refuses.
Status check_attention_values(const cxxopts::ParseResult& args) {
  TRESTLE_RETURN_IF_ERROR(check_choice(args, "rope-type", {"rope", "yarn"}));
  if (args.count("rope-type") && args["rope-type"].as<std::string>() == "yarn" && !args.count("multi-latent-attention"))
    return Status::Error(
        "--rope-type yarn: Megatron takes it with --multi-latent-attention only (other attention's "
        "YaRN is --position-embedding-type yarn)");
  TRESTLE_RETURN_IF_ERROR(check_choice(args, "softmax-type", {"vanilla", "off-by-one", "learnable"}));
  if (args.count("window-size")) {
    const auto window = parse_window_size(args["window-size"].as<std::string>());
    if (!window.ok()) return window.status().with_context("--window-size");
  }
  TRESTLE_RETURN_IF_ERROR(check_pattern_value(args, "window-attn-skip-freq", nullptr));
  TRESTLE_RETURN_IF_ERROR(check_pattern_value(args, "moe-layer-freq", "0: dense, 1: MoE"));
  TRESTLE_RETURN_IF_ERROR(check_pattern_value(args, "no-rope-freq", "0: RoPE, 1: none"));
  TRESTLE_RETURN_IF_ERROR(check_pattern_value(args, "linear-attention-freq", "0: attention, 1: Gated DeltaNet"));
  TRESTLE_RETURN_IF_ERROR(check_choice(args, "experimental-attention-variant", {"gated_delta_net", "dsa"}));
  TRESTLE_RETURN_IF_ERROR(check_choice(args, "export-model-type", {"GPTModel", "HybridModel", "MambaModel"}));
  if (args.count("quick-geglu") && args.count("swiglu"))
    return Status::Error("--quick-geglu and --swiglu exclude each other (Megatron asserts it)");
  const bool rope =
      args.count("use-rotary-position-embeddings") ||
      (args.count("position-embedding-type") && args["position-embedding-type"].as<std::string>() == "rope");
  if (args.count("no-position-embedding") && !rope)
    return Status::Error(
        "--no-position-embedding: Megatron takes this deprecated flag with --position-embedding-type "
        "rope only");
  return OkStatus();
}

}  // namespace

// A Mamba hybrid's layer pattern: one flag of the two names, one letter per layer of those Trestle's hybrids have.
Status check_hybrid_pattern_values(const cxxopts::ParseResult& args) {
  if (args.count("hybrid-layer-pattern") && args.count("hybrid-override-pattern"))
    return Status::Error(
        "--hybrid-override-pattern and --hybrid-layer-pattern: give one (the first is Megatron's older name)");
  for (const char* flag : {"hybrid-layer-pattern", "hybrid-override-pattern"}) {
    if (!args.count(flag)) continue;
    const std::string pattern = args[flag].as<std::string>();
    if (pattern.find_first_of("|/") != std::string::npos)
      return Status::Error("--" + std::string(flag) + " " + pattern +
                           ": pipeline stage boundaries ('|') and MTP patterns ('/') are not taken; give the layers "
                           "alone and the stages with --pipeline-model-parallel-size and "
                           "--decoder-first/last-pipeline-num-layers");
    const std::size_t other = pattern.find_first_not_of("M*-E");
    if (pattern.empty() || other != std::string::npos)
      return Status::Error("--" + std::string(flag) + " " + pattern + ": " +
                           (pattern.empty() ? std::string("empty")
                                            : "'" + std::string(1, pattern[other]) +
                                                  "' is not one of M (Mamba), * "
                                                  "(attention), - (MLP), E (MoE), the layers trestle train has"));
  }
  return OkStatus();
}

Status check_megatron_flag_values(const cxxopts::ParseResult& args) {
  // (Under --use-checkpoint-args Megatron takes both from the checkpoint over the command line: a Trestle
  // checkpoint's model has none.)
  const bool checkpoint_args =
      args.count("use-checkpoint-args") && (args.count("load") || args.count("pretrained-checkpoint"));
  for (const char* flag : {"attention-dropout", "hidden-dropout"})
    if (args.count(flag) && args[flag].as<double>() != 0.0 && !checkpoint_args)
      return Status::Error(std::string("--") + flag + " " + shortest_decimal(args[flag].as<double>()) +
                           ": Trestle trains without dropout; give 0 (Megatron's default is 0.1)");
  TRESTLE_RETURN_IF_ERROR(check_no_effect_values(args));
  if (args.count("dataloader-type") && args["dataloader-type"].as<std::string>() != "single")
    return Status::Error("--dataloader-type " + args["dataloader-type"].as<std::string>() +
                         ": Trestle reads the samples in the order of Megatron's pretraining sampler (single); "
                         "cyclic's reshuffled epochs and external data loaders are not supported");
  TRESTLE_RETURN_IF_ERROR(check_deprecated_flags(args));
  // Megatron allocates a hybrid's layers by its ratios only without a pattern (beside one it just compares them).
  const bool pattern = args.count("hybrid-override-pattern") || args.count("hybrid-layer-pattern");
  for (const RefusedFlag& f : refused_flags())
    if (args.count(f.name) && !(pattern && std::string_view(f.name).starts_with("hybrid-")))
      return Status::Error(std::string("--") + f.name + ": refused: " + f.why);
  TRESTLE_RETURN_IF_ERROR(check_size_values(args));
  TRESTLE_RETURN_IF_ERROR(check_precision_values(args));
  TRESTLE_RETURN_IF_ERROR(check_router_values(args));
  TRESTLE_RETURN_IF_ERROR(check_hybrid_pattern_values(args));
  return check_attention_values(args);
}

std::vector<std::string> given_flags_without_effect(const cxxopts::ParseResult& args) {
  std::vector<std::string> given;
  for (const NoEffectFlag& f : no_effect_flags()) {
    if (!args.count(f.name)) continue;
    std::string word = std::string("--") + f.name;
    if (takes_integer(f)) word += " " + std::to_string(args[f.name].as<std::int64_t>());
    else if (takes_number(f)) word += " " + shortest_decimal(args[f.name].as<double>());
    else if (f.several) word += " " + joined(args[f.name].as<std::vector<std::string>>(), " ");
    else if (takes_value(f)) word += " " + args[f.name].as<std::string>();
    given.push_back(word);
  }
  return given;
}

}  // namespace trestle::cli
