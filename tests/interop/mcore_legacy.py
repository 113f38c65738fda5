"""Legacy (mp_rank_*) trees as Megatron-LM saves megatron-core's own models: a family's megatron-core harness (its
`build(c, port)` in a gloo world of one) run as a tp x pp x ep world, each rank loading a torch_dist checkpoint (its
own slices, as megatron-core reshards on load) and torch.saving its model's state_dict() the way Megatron-LM's legacy
checkpointing does: iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt with the args of the torch_dist's common.pt
set to the new layout, in bf16 where the args say so. The files hold what megatron-core keeps per rank: fused modules
whole (a Mamba or Gated DeltaNet in_proj is its parts' tp slices one after another), experts numbered from 0 on each
ep rank, MTP layers, buffers such as the router's expert bias and token counter.

    megatron_core_legacy_tree(harness_text, hf_config, torch_dist_iteration_dir, root, tp=2, ep=1)
    legacy_tree_from_hf(trestle_convert, harness_text, hf_dir, tmp_path, tp=2, ep=1)  # through Trestle's torch_dist
    assert_converts_back(trestle_convert, root, hf_dir, tmp_path / "back")
    assert_mtp_moe_tree_converts_back(trestle_convert, harness_text, hf_dir, tmp_path, tp=2, pp=1, ep=2)  # both
"""
import json
import os
import subprocess

import pytest
import torch

from models import iteration_dir, load_hf_tensors
from ports import free_port
from script_server import reference_scripts

# The harness's single-rank world, made a tp x pp x ep one (each edit must find its text: a harness that changed
# fails).
WORLD_EDITS = [
    ('dist.init_process_group("gloo", rank=0, world_size=1)',
     'dist.init_process_group("gloo", rank=RANK, world_size=WORLD)'),
    ("parallel_state.initialize_model_parallel(1, 1)",
     "parallel_state.initialize_model_parallel(TP, PP, expert_model_parallel_size=EP)"),
    ("use_cpu_initialization=True,",
     "use_cpu_initialization=True, tensor_model_parallel_size=TP, expert_model_parallel_size=EP, "
     "pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,"),
]
# Pipeline stages: only a harness whose decoder block is get_gpt_decoder_block_spec's (sliced to the stage's layers, the
# MTP block on the last stage only) builds its stage's part of the model; it is told which stages it has.
STAGED_BLOCK = "get_gpt_decoder_block_spec(config, "
STAGE_EDITS = [
    ("mtp_block_spec=mtp)", "mtp_block_spec=mtp, pre_process=parallel_state.is_pipeline_first_stage(), "
     "post_process=parallel_state.is_pipeline_last_stage())"),
]

PRELUDE = """
import os
import torch
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD"])
TP, PP, EP = int(os.environ["TP"]), int(os.environ["PP"]), int(os.environ["EP"])
LAYOUT = os.environ.get("LAYOUT") or None  # --pipeline-model-parallel-layout, when the tree is saved with one
if not torch.cuda.is_available():  # the last stage's copy of the embedding is moved to the GPU for its all-reduce
    torch.Tensor.cuda = lambda self, *a, **k: self
"""

SAVE_LEGACY = """

def main():
    ckpt, root, port, config = sys.argv[1:5]
    built = build(json.loads(config), port)
    model = built[1] if isinstance(built, tuple) else built
    from megatron.core import dist_checkpointing, parallel_state
    # (the last stage's copy of the embedding, which MTP reads, is tied to the first's over the dp x cp group)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sharded = {k: v for k, v in model.sharded_state_dict(metadata=metadata).items() if "_extra_state" not in k}
    loaded = dist_checkpointing.load(sharded, ckpt)
    own = model.state_dict()
    missing, unexpected = model.load_state_dict({k: v for k, v in loaded.items() if k in own}, strict=False)
    assert all(k.endswith(("_extra_state", "local_tokens_per_expert")) for k in missing), missing
    args = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)["args"]
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size = TP, PP, EP
    args.pipeline_model_parallel_layout = LAYOUT  # (a string, as Megatron-LM's arguments keep it)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    name = (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if PP > 1 else "") +  # Megatron's get_checkpoint_name
            (f"_{ep_rank:03d}" if EP > 1 else ""))
    directory = os.path.join(root, "iter_0000001", name)
    os.makedirs(directory, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if args.bf16:  # Megatron-LM's bf16 model (Float16Module), its router's expert bias kept in fp32
        state = {k: v.bfloat16() if v.is_floating_point() and not k.endswith("expert_bias") else v
                 for k, v in state.items()}
    torch.save({"model": state, "args": args, "checkpoint_version": 3.0, "iteration": 1},
               os.path.join(directory, "model_optim_rng.pt"))
    dist.barrier()
    if RANK == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""

TIMEOUT_S = 600


# A pipeline layout string (the LAYOUT of the PRELUDE) placing the stages' layers.
LAYOUT_EDITS = [("pipeline_model_parallel_size=PP,", "pipeline_model_parallel_size=PP, "
                 "pipeline_model_parallel_layout=LAYOUT,")]


def legacy_script(harness, pp=1, layout=None):
    """The harness's builder made a tp x pp x ep world (its stages' layers placed by the pipeline layout string
    `layout`, when given), with a main that saves each rank's legacy file."""
    builder = harness.split("\ndef main():")[0]
    assert pp == 1 or STAGED_BLOCK in builder, "the megatron-core harness builds no pipeline stages"
    for old, new in WORLD_EDITS + (STAGE_EDITS if pp > 1 else []) + (LAYOUT_EDITS if layout else []):
        assert old in builder, f"the megatron-core harness changed: no {old!r}"
        builder = builder.replace(old, new)
    return PRELUDE + builder + SAVE_LEGACY


def megatron_core_legacy_tree(harness, config, ckpt, root, tp, ep, scratch, pp=1, layout=None):
    """Writes `root` (a legacy tree at tp x pp x ep, with the pipeline layout string `layout` when given) from the
    torch_dist iteration directory `ckpt` through megatron-core's model built by `harness` from the Hugging Face config
    dict `config`; `scratch` holds the script."""
    script = scratch / "mcore_legacy_save.py"
    script.write_text(legacy_script(harness, pp, layout))
    world, port = tp * pp * ep, str(free_port())
    server = reference_scripts()
    children = [server.start([script, ckpt, root, port, json.dumps(config)],
                             dict(os.environ, RANK=str(r), WORLD=str(world), TP=str(tp), PP=str(pp), EP=str(ep),
                                  LAYOUT=layout or ""))
                for r in range(world)]
    try:
        results = server.wait_all(children, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"megatron-core's legacy save did not finish within {TIMEOUT_S} s\nstderr:\n{e.stderr}")
    failed = {rank: result for rank, result in enumerate(results) if result.returncode != 0}
    # Each failed rank's last lines and its error lines (cut: a missing key's message lists every key).
    assert not failed, "\n".join(
        f"rank {rank}:\n{r.stderr[-1500:]}\n" + "\n".join(line[:1000] for line in r.stderr.splitlines()[-40:]
                                                       if "Error" in line)
        for rank, r in failed.items())
    return root


def legacy_tree_from_hf(trestle_convert, harness, src, tmp_path, tp, ep, *convert_args, config=None, pp=1,
                        layout=None):
    """The legacy tree (its root) megatron-core saves at tp x pp x ep holding Trestle's torch_dist of the Hugging Face
    model `src` (converted at that layout, with `convert_args`); `config` adds to the harness's config (the model's
    config.json, its vocabulary Megatron's padded one)."""
    dist = tmp_path / "dist"
    # (torch_dist holds whole tensors; with a layout its pp is the legacy save's alone, which sets the args' sizes)
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "--tp", tp, "--pp",
                        1 if layout else pp, "--ep", ep, *convert_args, "-q")
    c = dict(json.load(open(os.path.join(src, "config.json"))), **(config or {}))
    c["vocab_size"] = torch.load(os.path.join(iteration_dir(dist), "common.pt"), weights_only=False)[
        "args"].padded_vocab_size
    return megatron_core_legacy_tree(harness, c, iteration_dir(dist), tmp_path / "legacy", tp, ep, tmp_path, pp,
                                     layout)


def assert_converts_back(trestle_convert, root, hf_dir, out, *convert_args):
    """`convert --from megatron-legacy` of the tree `root` (--hf-config `hf_dir`) gives every tensor of the model in
    `hf_dir`, value for value (a megatron-core model fp32 throughout holds a bf16 source's values exactly)."""
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", out, "--hf-config", hf_dir, "-q",
                        *convert_args)
    source, back = load_hf_tensors(hf_dir), load_hf_tensors(out)
    assert sorted(back) == sorted(source)
    for name, value in source.items():
        assert torch.equal(back[name].float(), value.float()), name


def assert_mtp_moe_tree_converts_back(trestle_convert, harness, hf_dir, tmp_path, tp, pp, ep, layout=None):
    """The legacy tree of a model with MoE layers, an expert bias and one MTP layer (GLM-4.5's, DeepSeek-V3's) at
    tp x pp x ep (its layers placed by the pipeline layout string `layout`, when given) holds the MTP layer's experts
    numbered from 0 and the router's bias on the last stage, and converts back to the source's values."""
    root = legacy_tree_from_hf(trestle_convert, harness, hf_dir, tmp_path, tp, ep, "--norms", "local", pp=pp,
                               layout=layout)
    last = "mp_rank_00" + ("_001" if pp > 1 else "") + ("_001" if ep > 1 else "")  # (the MTP layer's stage)
    rank = torch.load(root / "iter_0000001" / last / "model_optim_rng.pt", weights_only=False)["model"]
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight" in rank
    assert any(k.endswith(".mlp.router.expert_bias") for k in rank)
    assert_converts_back(trestle_convert, root, hf_dir, tmp_path / "back")
