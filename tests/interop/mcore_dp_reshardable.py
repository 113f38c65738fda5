"""One rank of a megatron-core job on CPU (gloo) that trains a tiny GPTModel (local layer spec, fp32) for two Adam steps
with Megatron-Core's distributed optimizer and a learning-rate scheduler stepped as Megatron-LM's loop steps it, and
saves model and optimizer as Megatron-LM does by default: torch_dist with the optimizer 'dp_reshardable' (flat bucket
buffers), Megatron's args and the scheduler's state (opt_param_scheduler) in common.pt. Beside it each rank dumps what
its optimizer holds for every parameter it owns, straight from the optimizer (megatron-core's own range maps), to check
a reading of the checkpoint against.

    RANK=r WORLD=n PORT=p TP=1 PP=1 EP=1 KIND=dense|moe TIED=0|1 BUCKET=0 BF16=0|1 OUT=dir [LOAD=ckpt] \
        python mcore_dp_reshardable.py

BF16=1: a bf16 model with Megatron-LM's defaults for it (fp32 master weights, gradients reduced in fp32).

OUT/ckpt: the checkpoint; OUT/state_<rank>.safetensors + OUT/state_<rank>.json: per owned piece, the flat range of the
parameter it covers and the 'param' (fp32 main parameter), 'exp_avg' and 'exp_avg_sq' values. With LOAD the job
instead builds the same model from another seed, loads the optimizer from that dp_reshardable checkpoint as
Megatron-LM's load does, and dumps what its optimizer then holds (plus OUT/groups_<rank>.json: each optimizer's param
groups as loaded, without their params), then loads the scheduler's state into a scheduler built with the same
arguments as Megatron-LM's load_checkpoint does (strict: every value must equal the run's) and dumps its num_steps, lr
and weight decay (OUT/scheduler_<rank>.json)."""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.dist_checkpointing.strategies import filesystem_async

# CPU workarounds, at module level so megatron-core's writer process (which runs this file as __mp_main__) has them
# too, and only when the file runs (a test importing it for its sizes keeps its torch unpatched): its
# FileSystemWriterAsync calls torch.cuda.synchronize(), the save's finalize uses torch.cuda.current_device(), the
# writer measures its RSS with psutil (not installed), the FP32 optimizer puts a constant on 'cuda', the distributed
# optimizer accepts only parameters whose type() names a torch.cuda tensor, and a pipeline's tied embedding is moved to
# the GPU before its first all-reduce.
if __name__ in ("__main__", "__mp_main__") and not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    _tensor = torch.tensor
    torch.tensor = lambda *a, **k: _tensor(*a, **(dict(k, device="cpu") if k.get("device") == "cuda" else k))
    _type = torch.Tensor.type

    def _cuda_type(self, *a, **k):
        t = _type(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not a and not k and "cuda" not in t else t

    torch.Tensor.type = _cuda_type
    torch.Tensor.cuda = lambda self, *a, **k: self
filesystem_async._process_memory = lambda: 0

SIZES = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
             kv_channels=8, vocab_size=128)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=40)
# Megatron-LM's OptimizerParamScheduler arguments (steps in samples), stepped by a global batch of GLOBAL_BATCH.
SCHEDULER = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0, lr_decay_steps=64,
                 lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=64, wd_incr_style="linear")
GLOBAL_BATCH = 4


def main():
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD"])
    tp, pp, ep = int(env.get("TP", 1)), int(env.get("PP", 1)), int(env.get("EP", 1))
    moe, tied, out = env.get("KIND") == "moe", env.get("TIED") == "1", env["OUT"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=env["PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(7 if env.get("LOAD") else 3)  # a load must overwrite everything
    bf16 = env.get("BF16") == "1"
    dtype = torch.bfloat16 if bf16 else torch.float32
    sizes = {k: v for k, v in SIZES.items() if k != "vocab_size"}
    config = TransformerConfig(**sizes, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype, bf16=bf16,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, sequence_parallel=tp > 1 and moe,
                               pipeline_dtype=dtype,
                               **(MOE if moe else {}))
    pp_rank, ep_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=MOE["num_moe_experts"] if moe else None, normalization="RMSNorm"),
                     vocab_size=SIZES["vocab_size"], max_sequence_length=64, position_embedding_type="rope",
                     pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                     share_embeddings_and_output_weights=tied)
    bucket = int(env.get("BUCKET", 0)) or None
    if bf16:  # as Megatron-LM's get_model: every parameter bf16 (norms included)
        from megatron.core.transformer.module import Float16Module
        wrapped = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(  # buckets need overlap_grad_reduce
        use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None, bucket_size=bucket,
        grad_reduce_in_fp32=bf16), wrapped if bf16 else model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=0.0,
                                                       bf16=bf16, params_dtype=dtype, use_distributed_optimizer=True),
                                       [ddp])
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    generator = torch.Generator().manual_seed(100 + rank // tp)  # tensor-parallel replicas see the same gradients
    load = env.get("LOAD")
    scheduler = None if load else OptimizerParamScheduler(optimizer, **SCHEDULER)
    for _ in range(1 if load else 2):  # a load needs allocated state: one step (with zero gradients) first
        for p in ddp.parameters():
            p.main_grad.copy_(torch.zeros(p.shape) if load else torch.randn(p.shape, generator=generator))
        for o in chained:  # Adam itself: MegatronOptimizer.step() computes the grad norm on CUDA
            o._copy_model_grads_to_main_grads()
            o.optimizer.step()
            o._copy_main_params_to_model_params()
        if scheduler:
            scheduler.step(increment=GLOBAL_BATCH)
    if load:
        sharded = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True,
                                                             metadata={"distrib_optim_sharding_type":
                                                                       "dp_reshardable"})}
        loaded = dist_checkpointing.load(sharded, load)
        with torch.no_grad():  # an fp32 model's main parameters are views of its (grad-requiring) parameters
            optimizer.load_state_dict(loaded["optimizer"])
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups] for o in chained]
        json.dump(groups, open(os.path.join(out, f"groups_{rank}.json"), "w"))
        dump_state(model, chained, out, rank, tp_rank, pp_rank, ep_rank)
        if "opt_param_scheduler" in loaded:  # after the dumps: the scheduler sets the groups' lr and weight decay
            scheduler = OptimizerParamScheduler(optimizer, **SCHEDULER, use_checkpoint_opt_param_scheduler=False)
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
            json.dump(scheduler_position(scheduler), open(os.path.join(out, f"scheduler_{rank}.json"), "w"))
        dist.destroy_process_group()
        return
    sharded = model.sharded_state_dict()
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded, metadata={"distrib_optim_sharding_type":
                                                                          "dp_reshardable"})
    sharded["opt_param_scheduler"] = scheduler.state_dict()
    json.dump(scheduler_position(scheduler), open(os.path.join(out, f"scheduler_saved_{rank}.json"), "w"))
    sharded["args"] = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
                                         make_vocab_size_divisible_by=128, transformer_impl="local")
    ckpt = os.path.join(out, "ckpt")
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded, ckpt, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                                        thread_count=1))
    dump_state(model, chained, out, rank, tp_rank, pp_rank, ep_rank)
    dist.destroy_process_group()


def scheduler_position(scheduler):
    """Where a scheduler stands: its step count and the lr and weight decay its own values give there (a param group's
    max_lr / min_lr, which the written optimizer state sets, would override them)."""
    return {"num_steps": scheduler.num_steps, "lr": scheduler.get_lr({}), "weight_decay": scheduler.get_wd()}


def dump_state(model, chained, out, rank, tp_rank, pp_rank, ep_rank):
    """What each optimizer holds for every parameter range this rank owns (megatron-core's own range maps)."""
    from safetensors.torch import save_file
    names = {p: n for n, p in model.named_parameters()}
    tensors, index = {}, []
    for o in chained:  # fp32 parameters (their main parameters are views of them), then bf16 ones (fp32 copies)
        pairs = [*zip(o.model_fp32_groups, o.shard_fp32_groups, strict=True),
                 *zip(o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True)]
        for model_group, shard_group in pairs:
            for param, shard in zip(model_group, shard_group, strict=True):
                owned = o._get_model_param_range_map(param)["param"]
                state = o.optimizer.state[shard]
                i = len(index)
                for s, t in (("param", shard), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
                    tensors[f"{i}.{s}"] = t.detach().clone().reshape(-1).contiguous()
                index.append(dict(name=names[param], start=owned.start, end=owned.end, shape=list(param.shape),
                                  tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank))
    save_file(tensors, os.path.join(out, f"state_{rank}.safetensors"))
    json.dump(index, open(os.path.join(out, f"state_{rank}.json"), "w"))


if __name__ == "__main__":
    main()
