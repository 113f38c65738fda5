#include "tools/train_options.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/file_lock.h"
#include "ckpt/printable_text.h"
#include "parallel/launch_environment.h"
#include "parallel/launcher.h"
#include "tools/list_flag_words.h"
#include "tools/megatron_flags.h"
#include "train/loop/step_profiler.h"

namespace trestle::cli {
namespace {

// Megatron's list flags of the trainer: the data blends' and megatron_list_flags().
std::vector<std::string> trainer_list_flags() {
  std::vector<std::string> lists = {"--data-path",      "--train-data-path",    "--valid-data-path",
                                    "--test-data-path", "--iterations-to-skip", "--rampup-batch-size"};
  lists.insert(lists.end(), megatron_list_flags().begin(), megatron_list_flags().end());
  return lists;
}

}  // namespace

cxxopts::Options train_options() {
  cxxopts::Options spec(
      "trestle train",
      "Train a GPT model (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3/4, OLMo 2; the Mixtral, Qwen2/3-MoE,\n"
      "GPT-OSS, DeepSeek-V3, GLM-4.5 and Gemma 4 mixtures of experts; the Qwen3-Next / Qwen3.5 and\n"
      "Nemotron-H hybrids) with Megatron-style tensor, sequence, pipeline, data,\n"
      "context and expert parallelism over c10d (Gloo on CPU), from a Trestle checkpoint (--load; `trestle convert "
      "--from hf`\n"
      "makes one from a Hugging Face model) or from scratch (--model-config config.json), on Megatron\n"
      "indexed datasets (--data-path; `trestle preprocess` makes them). Flags shared with Megatron-LM\n"
      "take its names and defaults. With --nproc-per-node N, starts N local workers and forwards their\n"
      "output prefixed by rank; when one fails the others are stopped and the job exits with its code.\n"
      "Without it the process is a worker: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; the store of its c10d rendezvous,\n"
      "keys kept apart per restart) or, without RANK, srun's (SLURM_PROCID, SLURM_STEP_ID,\n"
      "SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID; a batch script, which\n"
      "has no step id, is a single process) give its place; under Slurm the store is\n"
      "MASTER_ADDR:MASTER_PORT, else on the first host of SLURM_STEP_NODELIST (or\n"
      "SLURM_JOB_NODELIST) at port 15000 + the last four digits of SLURM_JOB_ID + SLURM_STEP_ID.\n"
      "Data parallel size = world size /\n"
      "(tensor x pipeline x context parallel size). --load also takes a Megatron torch_dist checkpoint\n"
      "(converted for loading by each node's first worker; --hf-config when it keeps no model\n"
      "description). Checkpoints are saved asynchronously (--save, --save-interval) as Trestle\n"
      "checkpoints that resume on any layout and convert to Hugging Face.\n"
      "Logs like Megatron (the last rank prints), and as JSON lines (--log-json) and TensorBoard events.");
  spec.add_options("launch")("nproc-per-node", "start this many local workers", cxxopts::value<int>())(
      "master-addr", "address the workers reach the job's c10d store at (rank 0 serves it)",
      cxxopts::value<std::string>()->default_value("127.0.0.1"))(
      "master-port", "port of the job's c10d store, bound by the launcher (0: one the system chooses)",
      cxxopts::value<int>()->default_value("0"))("distributed-timeout-minutes", "rendezvous and collective timeout",
                                                 cxxopts::value<int>()->default_value("10"))(
      "exit-signal-grace",
      "with --exit-signal-handler: the launcher passes the first SIGTERM or SIGINT on to its workers (a repeat within "
      "2 s is the same request); after a later one, the workers get this many seconds to finish their save before "
      "they are killed",
      cxxopts::value<double>()->default_value("60"));
  spec.add_options("parallel")("tensor-model-parallel-size", "tensor parallel size",
                               cxxopts::value<int>()->default_value("1"))(
      "pipeline-model-parallel-size", "pipeline parallel size (stages; pipeline ranks are the outermost)",
      cxxopts::value<int>()->default_value("1"))("context-parallel-size",
                                                 "context parallel size: each sequence split into 2 x cp chunks, rank "
                                                 "r holding chunks r and 2cp-1-r, attention as ring attention",
                                                 cxxopts::value<int>()->default_value("1"))(
      "expert-model-parallel-size",
      "expert parallel size: each rank of an expert-parallel group (data-parallel ranks) holds num_experts / ep "
      "experts and tokens reach them by all-to-all; with tp > 1 it needs --sequence-parallel",
      cxxopts::value<int>()->default_value("1"))(
      "expert-tensor-parallel-size",
      "MoE models: the routed experts' own tensor-parallel size (default: tp). Megatron's expert groups: each stage's "
      "tp x cp x dp ranks cut into etp x ep x expert-data-parallel; the experts' gradients are averaged over the "
      "expert-data-parallel ranks. With tp > 1 it needs --sequence-parallel",
      cxxopts::value<int>())(
      "make-vocab-size-divisible-by",
      "the vocabulary's rows are padded to a multiple of this x tp (the padding rows take no part in the loss)",
      cxxopts::value<std::int64_t>()->default_value("128"))(
      "sequence-parallel", "split the sequence over the tensor-parallel ranks outside attention and MLP")(
      "moe-aux-loss-coeff",
      "MoE models: Megatron's load-balancing loss coefficient (one for each --moe-router-load-balancing-type)",
      cxxopts::value<std::vector<double>>()->default_value("0"))(
      "moe-router-bias-update-rate",
      "MoE models with a router expert bias (DeepSeek-V3's aux-loss-free balancing): after each global batch every "
      "expert's bias moves by this much towards balance (+ below the mean load, - above it, the loads counted over "
      "the tensor-, data- and context-parallel ranks), as Megatron does",
      cxxopts::value<double>()->default_value("1e-3"))(
      "mtp-num-layers",
      "multi-token prediction (DeepSeek-V3's MTP): depths after the decoder, depth d predicting the token d + 1 "
      "ahead. From scratch: none unless given. With --load: the checkpoint's layers train; 0 trains without them "
      "(they are then not saved)",
      cxxopts::value<std::int64_t>())(
      "mtp-loss-scaling-factor",
      "multi-token prediction: the MTP losses join the lm loss as their mean over the depths times this",
      cxxopts::value<double>()->default_value("0.1"))(
      "moe-z-loss-coeff",
      "MoE models: Megatron's router z-loss coefficient (ST-MoE: mean squared log-sum-exp of the logits)",
      cxxopts::value<double>()->default_value("0"))(
      "moe-expert-capacity-factor",
      "MoE models: Megatron's token dropping: each expert takes at most ceil(tokens x topk / experts x this) of the "
      "tokens each rank's router sees, the rest of its tokens dropped (their weight for it 0; the load-balancing "
      "losses still read every token's scores). Negative or absent: no capacity",
      cxxopts::value<double>())(
      "moe-token-drop-policy",
      "with --moe-expert-capacity-factor: which of an expert's tokens go first, those of the lowest routing "
      "probability (probs) or the latest in the micro-batch (position)",
      cxxopts::value<std::string>()->default_value("probs"))(
      "moe-pad-expert-input-to-capacity",
      "with --moe-expert-capacity-factor: every expert computes exactly its capacity of rows, filled with other "
      "tokens at weight 0 (the same outputs; aux-loss-free balancing then counts each expert's load as its "
      "capacity, as in Megatron)")(
      "no-fused-kernels",
      "compute RMSNorm, SwiGLU / GeGLU, RoPE, soft-capping and the output layer's cross-entropy with ATen's "
      "composite ops instead of Trestle's fused kernels (vectorised on the CPU, CUDA on the GPU), and soft-capped or "
      "sink attention (Gemma 2, GPT-OSS) from the whole score matrix instead of a block of queries at a time, and "
      "on the CPU the gradient norm's sum of squares from gradients widened to double; the same values within fp32 "
      "rounding")(
      "moe-grouped-gemm",
      "MoE models: run each projection of the local experts as one grouped GEMM (CUDA only) instead of one GEMM per "
      "expert; the same weights under the same names")(
      "num-experts", "MoE models: checked against the model's number of experts", cxxopts::value<std::int64_t>())(
      "moe-router-topk", "MoE models: checked against the model's experts per token", cxxopts::value<std::int64_t>())(
      "num-layers-per-virtual-pipeline-stage",
      "interleaved pipeline: layers of each model chunk (each stage holds layers / (pp x this) chunks)",
      cxxopts::value<std::int64_t>())("num-virtual-stages-per-pipeline-rank",
                                      "interleaved pipeline: model chunks per stage (instead of the flag above)",
                                      cxxopts::value<int>())(
      "microbatch-group-size-per-virtual-pipeline-stage",
      "interleaved pipeline: micro-batches run through a chunk before the next (default pp)", cxxopts::value<int>())(
      "decoder-first-pipeline-num-layers", "layers of the first pipeline stage (the others share the rest evenly)",
      cxxopts::value<std::int64_t>())("decoder-last-pipeline-num-layers",
                                      "layers of the last pipeline stage (the others share the rest evenly)",
                                      cxxopts::value<std::int64_t>())(
      "pipeline-model-parallel-layout",
      "Megatron's explicit pipeline split: the virtual stages in layer order separated by |, each a run of E "
      "(embedding: the first), t (a decoder layer), m (an MTP layer, with the loss) and L (loss: the last), with x*n "
      "and (...)*n repeats; entry v x pp + s is chunk v of stage s, so the entries / pp give the virtual pipeline "
      "size. A stage may hold no decoder layer. E.g. \"Et*3|(tt|)*2,ttmL\" at pp 4",
      cxxopts::value<std::string>())(
      "account-for-embedding-in-pipeline-split",
      "the embedding counts as one layer of the even pipeline split: the first virtual stage holds one decoder "
      "layer fewer (Megatron's)")(
      "account-for-loss-in-pipeline-split",
      "the loss counts as one layer of the even pipeline split: the last virtual stage holds one decoder layer "
      "fewer (Megatron's)");
  spec.add_options("lora")(
      "lora-rank",
      "train LoRA adapters of this rank (Megatron-Bridge's dim) on the frozen model of --pretrained-checkpoint; saves "
      "hold the adapters, their optimizer state and the training state only",
      cxxopts::value<std::int64_t>())("lora-alpha", "adapter scale alpha / rank (default: alpha = rank)",
                                      cxxopts::value<double>())("lora-dropout", "dropout on each adapter's input",
                                                                cxxopts::value<double>()->default_value("0"))(
      "lora-target-modules",
      "the linears that get adapters (of linear_qkv, linear_proj, linear_fc1, linear_fc2; in "
      "multi-latent attention (DeepSeek) linear_q_proj or linear_q_down_proj, linear_q_up_proj, and "
      "linear_kv_down_proj, linear_kv_up_proj instead of linear_qkv, which the default then skips; in Qwen3-Next / "
      "Qwen3.5's Gated DeltaNet layers and Nemotron-H's Mamba mixers, in_proj, out_proj)",
      cxxopts::value<std::vector<std::string>>()->default_value("linear_qkv,linear_proj,linear_fc1,linear_fc2"))(
      "lora-type",
      "lora: one adapter on each fused linear (linear_qkv, linear_fc1), as Megatron-Bridge's LoRA; canonical: "
      "separate q, k, v and gate, up adapters (and one per Hugging Face projection of a Gated DeltaNet's in_proj), as "
      "its CanonicalLoRA and as Hugging Face PEFT adapters are; peft: canonical, but one adapter on each routed "
      "expert's gate and up, as PEFT adapts transformers 5's fused experts (gate_up_proj)",
      cxxopts::value<std::string>()->default_value("lora"))(
      "pretrained-checkpoint",
      "a checkpoint to fine-tune (a Trestle or Megatron torch_dist root, or an iteration directory): where --load "
      "holds no checkpoint yet (or is not given), its weights start the run from iteration 0, as Megatron's "
      "--finetune; "
      "once --load holds the job's saves they resume. With --lora-rank: the frozen base model, and an adapter "
      "checkpoint given to --load must have been trained on it",
      cxxopts::value<std::string>());
  spec.add_options("model")("load", "resume or start from this Trestle checkpoint root (any saved layout)",
                            cxxopts::value<std::string>())("ckpt-step", "load this iteration instead of the latest",
                                                           cxxopts::value<std::int64_t>())(
      "finetune", "load the weights only: iteration, data position, optimizer and scheduler start from zero")(
      "use-checkpoint-args",
      "Megatron's: the model flags its load_args_from_checkpoint sets from a loaded checkpoint (--swiglu, "
      "--normalization, --rotary-base, --num-query-groups, --num-experts, --moe-router-topk, ...) are the "
      "checkpoint's, given or not, instead of refused where they differ (a note names the first, and the dropout "
      "a Megatron checkpoint's args set, without which Trestle trains)")(
      "no-load-optim",
      "do not load the optimizer state (nor the learning-rate schedule's, as Megatron's); needed to resume a later "
      "iteration that holds none")(
      "exit-on-missing-checkpoint",
      "end the job when --load holds no checkpoint (by default a run with --model-config then starts from scratch, "
      "as Megatron's)")(
      "no-save-optim",
      "save the weights and training state without the optimizer state (a resume takes --no-load-optim and starts "
      "the optimizer fresh)")("no-load-rng", "do not load the RNG states")("no-save-rng", "save no RNG states")(
      "override-ckpt-iteration",
      "resume the loaded checkpoint as if saved at this iteration: consumed samples become iteration x global batch "
      "size, so the data replays (or skips) from there; the optimizer and scheduler state load as saved (Megatron's)",
      cxxopts::value<std::int64_t>())(
      "override-opt_param-scheduler",
      "resume with this run's learning-rate schedule (--lr, --min-lr, warmup, decay iterations and style, weight "
      "decay) where it differs from the checkpoint's (the default here, with a note naming the differences; "
      "Megatron refuses them without this flag)")("use-checkpoint-opt_param-scheduler",
                                                  "resume with the checkpoint's learning-rate schedule")(
      "override-opt-param-scheduler", "Megatron-LM 0.19's spelling of --override-opt_param-scheduler")(
      "use-checkpoint-opt-param-scheduler", "Megatron-LM 0.19's spelling of --use-checkpoint-opt_param-scheduler")(
      "model-config", "Hugging Face config.json of a model to train from scratch (when there is no --load)",
      cxxopts::value<std::string>())(
      "hf-config", "config.json describing a Megatron torch_dist checkpoint given to --load that keeps no description",
      cxxopts::value<std::string>())("init-method-std", "standard deviation of the initial weights (from scratch)",
                                     cxxopts::value<double>()->default_value("0.02"))(
      "embedding-init-method-std",
      "the word embeddings' own standard deviation (from scratch; default: --init-method-std)",
      cxxopts::value<double>())(
      "recompute-granularity",
      "full: recompute each layer's activations in backward; selective (Megatron's recompute of attention's core) has "
      "no effect here (the same values; Trestle recomputes whole layers or nothing)",
      cxxopts::value<std::string>())("recompute-method", "accepted for Megatron compatibility (uniform)",
                                     cxxopts::value<std::string>())(
      "recompute-num-layers", "accepted for Megatron compatibility (1)", cxxopts::value<int>())(
      "device", "cpu (Gloo) or cuda (one GPU per local rank, NCCL); default cuda when a GPU is visible",
      cxxopts::value<std::string>())("bf16",
                                     "bf16 parameters with fp32 master weights; gradients accumulated and all-reduced "
                                     "in fp32 (as Megatron) unless --grad-reduce-in-bf16")(
      "grad-reduce-in-bf16", "with --bf16: accumulate and all-reduce gradients in bf16 (half the buffer, less exact)")(
      "accumulate-allreduce-grads-in-fp32", "accumulate and all-reduce gradients in fp32 (implied by --bf16)")(
      "no-gradient-accumulation-fusion",
      "let autograd make each linear weight's gradient and add it to the gradient buffer (default: the weight-gradient "
      "GEMM accumulates into the buffer itself, as Megatron's gradient accumulation fusion)")(
      "fp16", "fp16 parameters with fp32 master weights and loss scaling")(
      "loss-scale",
      "a constant loss scale (fp16's default: dynamic; also under --bf16 or --use-distributed-optimizer, as "
      "Megatron's optimizer takes it)",
      cxxopts::value<double>())("initial-loss-scale", "the dynamic loss scale's start",
                                cxxopts::value<double>()->default_value("4294967296"))(
      "min-loss-scale", "the dynamic loss scale's floor", cxxopts::value<double>()->default_value("1.0"))(
      "loss-scale-window", "clean iterations before the dynamic loss scale doubles",
      cxxopts::value<std::int64_t>()->default_value("1000"))("hysteresis",
                                                             "inf/NaN iterations before the dynamic loss scale halves",
                                                             cxxopts::value<std::int64_t>()->default_value("2"))(
      "seed", "random seed (initialisation, data shuffling)", cxxopts::value<std::uint64_t>()->default_value("1234"));
  spec.add_options("data")("data-path", "prefix, or weight prefix weight prefix ... of Megatron indexed datasets",
                           cxxopts::value<std::vector<std::string>>())(
      "data-args-path", "a file holding --data-path's words (for a long list)", cxxopts::value<std::string>())(
      "mock-data",
      "instead of data: megatron-core's mock documents (100000 of 1 to 4095 tokens counting up from 1, each ending "
      "in the end-of-document token: --eod-token-id, else the vocabulary's last id), split 1,1,1 as Megatron's")(
      "split", "train,valid,test proportions of --data-path's documents (Megatron's default)",
      cxxopts::value<std::string>()->default_value("969, 30, 1"))(
      "train-data-path", "instead of --data-path and --split: the training split's own datasets, as --data-path",
      cxxopts::value<std::vector<std::string>>())("valid-data-path",
                                                  "the validation split's own datasets (none: no validation)",
                                                  cxxopts::value<std::vector<std::string>>())(
      "test-data-path", "the test split's own datasets", cxxopts::value<std::vector<std::string>>())(
      "per-split-data-args-path",
      "a JSON file of the three: {\"train\": [words], \"valid\": ..., \"test\": ...} (a list of words or one string)",
      cxxopts::value<std::string>())("data-cache-path",
                                     "where the sample indices are cached (default: beside the data)",
                                     cxxopts::value<std::string>())(
      "mid-level-dataset-surplus",
      "a weighted blend builds each dataset's share of the samples times 1 + this, as Megatron's builder does",
      cxxopts::value<double>()->default_value("0.005"))(
      "seq-length", "tokens per sample (under --use-checkpoint-args, when left out: the checkpoint's run's)",
      cxxopts::value<std::int64_t>())("encoder-seq-length", "--seq-length under Megatron's older name",
                                      cxxopts::value<std::int64_t>())(
      "disable-bf16-reduced-precision-matmul",
      "with --bf16 on GPUs: matrix products without cuBLAS's reduced-precision reductions, as Megatron's (CPU GEMMs "
      "accumulate in fp32 already)")("micro-batch-size", "samples per micro-batch per data-parallel rank",
                                     cxxopts::value<std::int64_t>())(
      "global-batch-size",
      "samples per iteration over all data-parallel ranks (gradient accumulation fills the rest; default: "
      "micro-batch size x data-parallel size, as Megatron sets it)",
      cxxopts::value<std::int64_t>())("train-iters", "iterations to train to", cxxopts::value<std::int64_t>())(
      "rampup-batch-size",
      "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT in equal shares of the first SAMPLES "
      "samples, then stays --global-batch-size (Megatron's, with --train-samples; megatron-core 0.16's rule)",
      cxxopts::value<std::vector<std::int64_t>>())(
      "decrease-batch-size-if-needed",
      "a global batch (constant or ramped up) that does not divide into micro-batches of every data-parallel rank "
      "runs as the largest multiple of micro-batch x data-parallel size below it (Megatron's)")(
      "eval-micro-batch-size", "samples per evaluation micro-batch (default: --micro-batch-size; Megatron-LM 0.19's)",
      cxxopts::value<std::int64_t>())(
      "eval-global-batch-size",
      "samples per evaluation iteration over all data-parallel ranks (default: --global-batch-size; Megatron-LM "
      "0.19's)",
      cxxopts::value<std::int64_t>())(
      "step-batch-size-schedule",
      "\"THRESHOLD:BATCH ...\": from THRESHOLD tokens consumed on, the global batch is BATCH (K, M, B, T suffixes; "
      "Megatron-LM 0.19's, with --train-samples and without --global-batch-size, which becomes micro-batch x "
      "data-parallel size, evaluation's batch)",
      cxxopts::value<std::string>())(
      "train-samples",
      "samples to train on, instead of --train-iters: whole global batches of them (Megatron's sample-based "
      "training; the schedule's lengths are then given in samples)",
      cxxopts::value<std::int64_t>())("eod-mask-loss", "no loss on the end-of-document tokens")(
      "reset-attention-mask",
      "each token attends only to the tokens of its own document (after the sequence's last end-of-document token "
      "before it), in every softmax attention layer, as Megatron's data loader masks them; positions are not reset")(
      "no-create-attention-mask-in-dataloader",
      "Megatron's data loader then makes no attention mask, so --reset-attention-mask masks nothing (as in Megatron); "
      "without --reset-attention-mask no effect")(
      "dataloader-inter-document-masking",
      "each token attends only to the tokens of the dataset document it was read from (the documents each sample "
      "spans, as megatron-core's GPTDataset gives them in cu_seqlens), and its position counts from that document's "
      "start; --reset-attention-mask then has no effect. Not with Mamba or Gated DeltaNet layers or multi-token "
      "prediction")("eod-token-id", "the end-of-document token (for --eod-mask-loss and --reset-attention-mask)",
                    cxxopts::value<std::int64_t>()->default_value("-1"))(
      "calculate-per-token-loss",
      "train on the mean over the global batch's counted tokens (loss sums, gradients summed over the ranks and "
      "divided by the tokens) instead of the mean of the micro-batches' means");
  spec.add_options("optimizer")("optimizer", "adam (AdamW, decoupled weight decay)",
                                cxxopts::value<std::string>()->default_value("adam"))(
      "lr", "peak learning rate", cxxopts::value<double>())("min-lr", "learning rate at the end of the decay",
                                                            cxxopts::value<double>()->default_value("0"))(
      "lr-warmup-iters", "linear warmup iterations", cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-warmup-init", "learning rate at the start of the warmup", cxxopts::value<double>()->default_value("0"))(
      "lr-decay-iters", "iterations to decay over (default: --train-iters)", cxxopts::value<std::int64_t>())(
      "lr-warmup-samples", "linear warmup samples (with --train-samples)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-decay-samples", "samples to decay over (with --train-samples; default: --train-samples)",
      cxxopts::value<std::int64_t>())(
      "lr-warmup-fraction", "warmup as this fraction of the decay, instead of a warmup length",
      cxxopts::value<double>())("lr-decay-style", "constant, linear, cosine, inverse-square-root or WSD",
                                cxxopts::value<std::string>()->default_value("linear"))(
      "lr-wsd-decay-style", "WSD's decay: linear, cosine, exponential, minus_sqrt",
      cxxopts::value<std::string>()->default_value("exponential"))("lr-wsd-decay-iters", "WSD's decay iterations",
                                                                   cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-wsd-decay-samples", "WSD's decay samples (with --train-samples)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "decoupled-lr",
      "peak learning rate of the word embeddings and the output layer (Megatron's decoupled learning rate; the "
      "same warmup and decay)",
      cxxopts::value<double>())(
      "decoupled-min-lr", "the decoupled learning rate's minimum (default: --min-lr; only with --decoupled-lr)",
      cxxopts::value<double>())("weight-decay", "weight decay (not applied to biases and norms)",
                                cxxopts::value<double>()->default_value("0.01"))(
      "apply-wd-to-qk-layernorm",
      "weight decay on the query and key norms too (Megatron's rule for Qwen3-Next; other norms and biases have none)")(
      "no-weight-decay-cond-type",
      "apply_wd_to_qk_layernorm: Megatron-LM's older spelling of --apply-wd-to-qk-layernorm",
      cxxopts::value<std::string>())("start-weight-decay", "weight decay at the start (incremented styles)",
                                     cxxopts::value<double>())(
      "end-weight-decay", "weight decay at the end (incremented styles)", cxxopts::value<double>())(
      "weight-decay-incr-style", "constant, linear or cosine",
      cxxopts::value<std::string>()->default_value("constant"))(
      "clip-grad", "clip gradients to this global L2 norm (0: off)", cxxopts::value<double>()->default_value("1.0"))(
      "adam-beta1", "Adam beta1", cxxopts::value<double>()->default_value("0.9"))(
      "adam-beta2", "Adam beta2", cxxopts::value<double>()->default_value("0.999"))(
      "adam-eps", "Adam epsilon", cxxopts::value<double>()->default_value("1e-08"))(
      "ddp-bucket-size", "elements per data-parallel gradient bucket (default max(40M, 1M x dp))",
      cxxopts::value<std::int64_t>())(
      "ddp-num-buckets",
      "cut each rank's gradients into about N buckets instead: buckets of (the rank's parameter count / N) elements, "
      "as Megatron-LM",
      cxxopts::value<std::int64_t>())(
      "use-distributed-optimizer",
      "shard the optimizer over the data-parallel ranks (ZeRO-1, Megatron's buffer layout): gradients "
      "reduce-scattered, fp32 masters and Adam moments for this rank's shard only, parameters all-gathered after "
      "each step; saved as flat ranges that load at any layout, with or without it");
  spec.add_options("checkpointing")("save", "save checkpoints under this root", cxxopts::value<std::string>())(
      "save-interval", "save every N iterations (and at the end)", cxxopts::value<std::int64_t>()->default_value("0"))(
      "persistent-save-interval", "the same as --save-interval (Megatron-LM's other name for it)",
      cxxopts::value<std::int64_t>())(
      "ckpt-format",
      "trestle (the default), or torch_dist: each checkpoint also holds Megatron-Core's torch_dist form of itself "
      "(.metadata, __<rank>_0.distcp, common.pt, metadata.json) in the same iteration directory, for Megatron-LM to "
      "load (the distributed optimizer's state as its dp_reshardable buffers, laid out by this run's flags; no RNG "
      "state). Rank 0 writes it from the Trestle files before the commit: twice the disk, and the save takes that "
      "long more. Trestle resumes from its own files",
      cxxopts::value<std::string>())(
      "skip-train",
      "train nothing and save nothing: evaluate the loaded model on the validation and test splits (--eval-iters "
      "global batches each) and exit, as Megatron's flag")(
      "iterations-to-skip",
      "as Megatron-LM's (since core_v0.17): N (one or more numbers, from 1) passes over iteration N's global batch, "
      "which does nothing else: no step, no scheduler step, no log line, save or evaluation",
      cxxopts::value<std::vector<std::int64_t>>())(
      "exit-interval", "stop (after saving, with --save) when the iteration is a multiple of N",
      cxxopts::value<std::int64_t>())(
      "exit-duration-in-mins",
      "stop (after saving, with --save) after the first iteration that ends when any rank has trained this many "
      "minutes (from the trainer's start; a job's time limit less the time a save takes)",
      cxxopts::value<double>())(
      "exit-on-save-failure",
      "a save that fails (a write, sync or commit: a full disk, an I/O error) ends the job with the error, naming "
      "the file; the tracker keeps naming the last complete checkpoint (default true)",
      cxxopts::value<bool>()->default_value("true")->implicit_value("true"))(
      "no-exit-on-save-failure",
      "a failed save is a warning: training goes on and saves again at the next --save-interval (the last save of "
      "the run still fails it)")(
      "exit-signal-handler",
      "on SIGTERM or SIGINT (Slurm's signal before preemption), finish the step, save (with --save), wait for the save "
      "to commit and exit 0, as Megatron's flag; the launcher (--nproc-per-node) passes the signal to its workers")(
      "exit-signal",
      "with --exit-signal-handler: one more signal that does the same, by name (SIGUSR1 for sbatch --signal=USR1@120; "
      "Megatron's flag, whose default is SIGTERM)",
      cxxopts::value<std::string>());
  spec.add_options("logging")("log-interval", "print every N iterations",
                              cxxopts::value<std::int64_t>()->default_value("100"))(
      "log-params-norm", "log the L2 norm of the (fp32 master) parameters after each step, as Megatron's")(
      "log-num-zeros-in-grad", "log how many elements of the clipped gradients are zero, as Megatron's")(
      "moe-per-layer-logging",
      "MoE: also write each layer's router losses to TensorBoard (moe/<loss>_layer_<i>), as Megatron's")(
      "eval-interval", "evaluate on the validation split every N iterations",
      cxxopts::value<std::int64_t>()->default_value("1000"))(
      "start-eval-at-iter", "evaluate every --eval-interval iterations from this iteration on (Megatron-LM 0.19's)",
      cxxopts::value<std::int64_t>())(
      "eval-iters",
      "global batches per evaluation (each evaluation reads the split's next ones, as Megatron's one "
      "validation iterator does through a run and its resumes)",
      cxxopts::value<std::int64_t>()->default_value("100"))("tensorboard-dir", "write TensorBoard event files here",
                                                            cxxopts::value<std::string>())(
      "tensorboard-log-interval",
      "write every Nth iteration's own learning rate, loss, loss scale and norms to TensorBoard (Megatron's; the "
      "console line's interval is --log-interval)",
      cxxopts::value<std::int64_t>()->default_value("1"))("no-log-loss-scale-to-tensorboard",
                                                          "leave TensorBoard's loss-scale scalars out (Megatron's)")(
      "disable-log-loss-scale-to-tensorboard", "the same (Megatron-LM 0.19's spelling)")(
      "log-timers-to-tensorboard", "write TensorBoard's iteration-time at each log line (Megatron's timers' one here)")(
      "log-world-size-to-tensorboard", "write TensorBoard's world-size scalars (Megatron's)")(
      "log-validation-ppl-to-tensorboard", "write the validation perplexity to TensorBoard too (Megatron's)")(
      "log-throughput",
      "print Megatron's \"throughput per GPU (TFLOP/s/GPU)\" (its model FLOPs formula) in each line (and TensorBoard's "
      "throughput with --log-timers-to-tensorboard)")(
      "log-json", "append each logged iteration and evaluation as a JSON line to this file",
      cxxopts::value<std::string>())("peak-tflops", "peak TFLOP/s of one device, to report MFU",
                                     cxxopts::value<double>())(
      "profile",
      "record iterations with PyTorch's profiler (with --use-pytorch-profiler): a Chrome trace per profiled rank in "
      "--tensorboard-dir (else the working directory) and a table of its GPU kernels (CPU operators on the CPU) by "
      "time")("use-pytorch-profiler", "with --profile: PyTorch's profiler (Kineto), as Megatron's flag")(
      "profile-step-start", "with --profile: start recording once this many iterations are done",
      cxxopts::value<std::int64_t>()->default_value(std::to_string(train::ProfileOptions{}.step_start)))(
      "profile-step-end", "with --profile: stop once this many are done",
      cxxopts::value<std::int64_t>()->default_value(std::to_string(train::ProfileOptions{}.step_end)))(
      "profile-ranks", "with --profile: the global ranks to profile",
      cxxopts::value<std::vector<int>>()->default_value("0"))(
      "pytorch-profiler-collect-shapes",
      "with --profile: record each operator's inputs (shapes and dtypes) in the trace, and list the table's operators "
      "by name and inputs (where a copy kernel's time goes, by size)")("record-shapes",
                                                                       "the same as --pytorch-profiler-collect-shapes");
  spec.add_options("checkpointing")(
      "check-for-nan-in-loss-and-grad",
      "end the job when any rank's loss or gradients hold a NaN or Inf, naming the iteration and the rank, as "
      "Megatron's check (default true; fp16's loss scaling still skips steps whose gradients overflowed)",
      cxxopts::value<bool>()->default_value("true")->implicit_value("true"))(
      "no-check-for-nan-in-loss-and-grad", "do not check losses and gradients for NaN or Inf");
  // Hidden: used by the tests.
  spec.add_options("test")("distributed-timeout-seconds", "timeout in seconds (overrides the minutes)",
                           cxxopts::value<int>())("test-collectives", "all-reduce in every group and print the sums")(
      "test-sleep-seconds", "sleep before the collectives", cxxopts::value<int>()->default_value("0"))(
      "test-kill-rank", "this rank SIGKILLs itself (before its collectives, or at --test-kill-iteration)",
      cxxopts::value<int>()->default_value("-1"))("test-kill-iteration",
                                                  "the iteration at whose start --test-kill-rank dies",
                                                  cxxopts::value<std::int64_t>()->default_value("-1"))(
      "print-groups", "print every group's ranks for this world size as JSON and exit", cxxopts::value<int>())(
      "test-hang", "RANK:ITERATION: that rank stops answering when it starts that iteration",
      cxxopts::value<std::string>())(
      "test-nan", "RANK:ITERATION:loss|grad: that rank's loss, or a gradient, is NaN at that iteration",
      cxxopts::value<std::string>());
  declare_megatron_flags(spec);
  spec.add_options()("h,help", "show this help");
  return spec;
}

std::string train_help(const cxxopts::Options& spec) {
  return spec.help({"", "launch", "parallel", "model", "lora", "data", "optimizer", "checkpointing", "logging",
                    kMegatronModelGroup, kMegatronNoEffectGroup});
}

cxxopts::ParseResult parse_train_options(cxxopts::Options& spec, int argc, char** argv) {
  const std::vector<std::string> words = join_list_flag_words(argc, argv, trainer_list_flags());
  std::vector<char*> word_pointers;
  for (const auto& w : words) word_pointers.push_back(const_cast<char*>(w.c_str()));
  return spec.parse(static_cast<int>(word_pointers.size()), word_pointers.data());
}

Result<int> exit_signal(const cxxopts::ParseResult& args) {
  if (!args.count("exit-signal")) return SIGTERM;
  const std::string name = args["exit-signal"].as<std::string>();
  for (const auto& [known, sig] :
       {std::pair{"SIGTERM", SIGTERM}, std::pair{"SIGINT", SIGINT}, std::pair{"SIGUSR1", SIGUSR1},
        std::pair{"SIGUSR2", SIGUSR2}, std::pair{"SIGHUP", SIGHUP}, std::pair{"SIGQUIT", SIGQUIT},
        std::pair{"SIGALRM", SIGALRM}, std::pair{"SIGXCPU", SIGXCPU}, std::pair{"SIGPWR", SIGPWR}})
    if (name == known) return sig;
  return Status::Error("--exit-signal " + name +
                       ": not one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGALRM, SIGXCPU, SIGPWR");
}

void remove_abandoned_loads(const std::filesystem::path& dir) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("trestle_load_") || !name.ends_with(".lock")) continue;
    auto lock = FileLock::try_acquire(it->path().string());
    if (!lock.ok() || !*lock) continue;
    std::error_code ignored;
    std::filesystem::remove_all(dir / name.substr(0, name.size() - 5), ignored);
    (*lock)->release();
  }
}

bool check_launch_flags(const cxxopts::ParseResult& args) {
  if (!args.unmatched().empty()) {
    std::fprintf(stderr, "trestle train: unexpected argument '%s' (every value follows its option)\n",
                 printable_text(args.unmatched().front()).c_str());
    return false;
  }
  const int port = args["master-port"].as<int>();
  if (port < 0 || port > 65535) {
    std::fprintf(stderr, "trestle train: --master-port must be 0 (a free one) to 65535, not %d\n", port);
    return false;
  }
  for (const char* flag : {"distributed-timeout-minutes", "distributed-timeout-seconds"})
    if (args.count(flag) && args[flag].as<int>() < 1) {
      std::fprintf(stderr, "trestle train: --%s must be 1 or more, not %d\n", flag, args[flag].as<int>());
      return false;
    }
  // An empty path (a script's unset variable: --load "$CKPT") was read as none: --load '' trained from scratch.
  for (const char* flag :
       {"load", "save", "model-config", "hf-config", "tensorboard-dir", "log-json", "pretrained-checkpoint"})
    if (args.count(flag) && args[flag].as<std::string>().empty()) {
      std::fprintf(stderr, "trestle train: --%s is an empty path\n", flag);
      return false;
    }
  return true;
}

int launch_train_workers(const cxxopts::ParseResult& args, int argc, char** argv, const std::string& worker_program) {
  if (!check_launch_flags(args)) return 2;
  parallel::LaunchOptions launch;
  launch.nproc = args["nproc-per-node"].as<int>();
  if (launch.nproc < 1 || launch.nproc > 1024) {
    std::fprintf(stderr, "trestle train: --nproc-per-node must be 1 to 1024, not %d\n", launch.nproc);
    return 2;
  }
  // A process that torchrun or srun started as one of several (as a worker would read its environment): its own
  // job of --nproc-per-node workers would run beside the others' (each a whole job, training the same iterations)
  // instead of being one worker of theirs.
  if (const auto placed = parallel::read_launch_environment(); placed.ok() && placed->world_size > 1) {
    std::fprintf(stderr,
                 "trestle train: --nproc-per-node starts a job of its own, but %s started this process as rank %d "
                 "of %d: leave --nproc-per-node out and each of its processes is a worker of one job\n",
                 placed->launcher.c_str(), placed->rank, placed->world_size);
    return 2;
  }
  launch.master_addr = args["master-addr"].as<std::string>();
  launch.master_port = args["master-port"].as<int>();
  launch.forward_signals = args.count("exit-signal-handler") > 0;
  const auto signal = exit_signal(args);
  if (!signal.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", signal.status().message().c_str());
    return 2;
  }
  launch.exit_signal = *signal;
  const double grace = args["exit-signal-grace"].as<double>();
  if (!(grace >= 0 && grace <= 1e6)) {
    std::fprintf(stderr, "trestle train: --exit-signal-grace must be between 0 and 1e6 seconds, not %g\n", grace);
    return 2;
  }
  launch.exit_signal_grace = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(grace * 1000)));
  std::vector<std::string> command = {worker_program};
  const std::vector<std::string> given(argv, argv + argc);
  for (const auto& a : parallel::remove_options(given, {"--nproc-per-node", "--master-addr", "--master-port"}))
    command.push_back(a);
  auto outcome = parallel::launch_local_workers(command, launch);
  // Workers ended by a signal leave the converted copy of a torch_dist --load; it goes with them.
  remove_abandoned_loads(std::filesystem::temp_directory_path());
  if (!outcome.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(outcome.status().message()).c_str());
    return 1;
  }
  if (outcome->exit_code != 0) std::fprintf(stderr, "trestle train: FAILED: %s\n", outcome->failure.c_str());
  return outcome->exit_code;
}

}  // namespace trestle::cli
