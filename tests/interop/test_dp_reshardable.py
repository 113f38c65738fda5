"""Megatron-Core's distributed optimizer state as Megatron-LM saves it by default ('dp_reshardable': flat bucket
buffers) converts to Trestle with every parameter's Adam state in place. megatron-core itself (CPU, gloo) trains a tiny
GPTModel for two steps with its DistributedOptimizer and saves the checkpoint (mcore_dp_reshardable.py); each rank also
dumps, straight from the optimizer, the state of every parameter range it owns. After `trestle convert --from
megatron-dist`, every optimizer tensor (fp32_param, exp_avg, exp_avg_sq) equals the dumps placed into the canonical
tensor bit for bit, and the step is Adam's. Layouts: dp 2 with several buckets (parameters split across the ranks'
shards), tp 2, pp 2 with tied embeddings (the last stage's copy in a bucket of its own), a Mixtral at ep 1 (experts in
the dense buffer) and at ep 2 (the experts' own chained optimizer), a bf16 model (fp32 masters). The converted
checkpoint then reshards to torch_dist and back with the state unchanged. Args that name the other layer specification
(whose parameter order differs: Transformer Engine's input norm sits after linear_proj) are refused, as the stored
chunks straddle the parameters' edges in that order; grouped-GEMM experts (ordered and shaped otherwise) are refused.

Written the other way (`--optimizer-format dp_reshardable`), the Trestle checkpoint's state goes back into flat buckets
laid out for the loading run; megatron-core's own DistributedOptimizer (another seed) loads it as Megatron-LM does and
then holds exactly the state it saved, at the layout it saved from and at another data-parallel size, with the step
and hyper-parameters of the param groups as written; Trestle reads the written checkpoint back unchanged.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

HERE = pathlib.Path(__file__).parent
HARNESS = HERE / "mcore_dp_reshardable.py"
sys.path.insert(0, str(HERE))
from mcore_dp_reshardable import MOE, SIZES  # noqa: E402
from ports import free_port  # noqa: E402
from script_server import reference_scripts  # noqa: E402

CASES = {
    "dense-dp2-buckets": dict(WORLD=2, BUCKET=3000),
    "dense-tp2": dict(WORLD=2, TP=2),
    "dense-pp2-tied": dict(WORLD=2, PP=2, TIED=1),
    "moe-ep1": dict(WORLD=1, KIND="moe"),
    "moe-ep2": dict(WORLD=2, KIND="moe", EP=2),
    "dense-dp2-bf16": dict(WORLD=2, BF16=1),  # bf16 weights, fp32 masters and moments
}
STATES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
TIMEOUT_S = 600  # megatron-core on CPU: importing it alone takes ~30 s on a busy machine


@pytest.fixture(scope="module")
def trestle_py():
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if not path:
        pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
    sys.path.insert(0, path)
    import trestle
    return trestle


def run_megatron(out, case, load=None):
    server = reference_scripts()
    env = dict(os.environ, PORT=str(free_port()), OUT=str(out), **{k: str(v) for k, v in case.items()})
    if load:
        env["LOAD"] = str(load)
    ranks = [server.start([HARNESS], dict(env, RANK=str(r))) for r in range(case["WORLD"])]
    try:
        results = server.wait_all(ranks, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"megatron-core did not finish within {TIMEOUT_S} s")
    for r, result in enumerate(results):
        assert result.returncode == 0, f"megatron-core rank {r} failed:\n{(result.stdout + result.stderr)[-4000:]}"


def hf_config(directory, case):
    common = dict(vocab_size=SIZES["vocab_size"], hidden_size=SIZES["hidden_size"],
                  num_hidden_layers=SIZES["num_layers"], num_attention_heads=SIZES["num_attention_heads"],
                  num_key_value_heads=SIZES["num_query_groups"], head_dim=SIZES["kv_channels"],
                  tie_word_embeddings=case.get("TIED") == 1)
    if case.get("KIND") == "moe":
        config = transformers.MixtralConfig(**common, intermediate_size=MOE["moe_ffn_hidden_size"],
                                            num_local_experts=MOE["num_moe_experts"],
                                            num_experts_per_tok=MOE["moe_router_topk"],
                                            architectures=["MixtralForCausalLM"])
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=SIZES["ffn_hidden_size"],
                                          architectures=["LlamaForCausalLM"])
    config.save_pretrained(directory)
    return directory


def canonical_name(name, entry, case, names):
    """Megatron's stage- and expert-local parameter name -> the canonical tensor in the Trestle checkpoint (None: the
    last stage's copy of a tied embedding)."""
    pp, ep = case.get("PP", 1), case.get("EP", 1)
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(entry["pp_rank"] * SIZES["num_layers"] // pp + int(parts[2]))
        if parts[3:5] == ["mlp", "experts"]:
            parts[6] = str(entry["ep_rank"] * MOE["num_moe_experts"] // ep + int(parts[6]))
    if name == "output_layer.weight" and case.get("TIED") == 1:
        return None
    canonical = ".".join(parts)
    aliases = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    for local, te in aliases.items():
        if canonical not in names and canonical.endswith(local):
            canonical = canonical[:-len(local)] + te
    assert canonical in names, f"{name} ({canonical}) is not in the converted checkpoint"
    return canonical


def place(whole, local, name, tp, tp_rank):
    """Puts a tensor-parallel rank's piece into the canonical tensor (Megatron's splits)."""
    if tp == 1 or local.shape == whole.shape:
        whole.copy_(local)
    elif name.endswith("linear_fc1.weight"):  # [gate_r; up_r]
        f = whole.shape[0] // 2
        n = f // tp
        whole[tp_rank * n:(tp_rank + 1) * n] = local[:n]
        whole[f + tp_rank * n:f + (tp_rank + 1) * n] = local[n:]
    elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):  # input columns
        n = local.shape[1]
        whole[:, tp_rank * n:(tp_rank + 1) * n] = local
    else:  # output rows; the vocabulary's padding rows past the real ones are dropped
        n = local.shape[0]
        rows = whole[tp_rank * n:(tp_rank + 1) * n]
        rows.copy_(local[:rows.shape[0]])


def expected_state(out, case, manifest):
    """The canonical optimizer tensors assembled from every rank's dump."""
    tp = case.get("TP", 1)
    shapes = {name: t["global_shape"] for name, t in manifest["tensors"].items()}
    pieces = {}  # (canonical, state, tp_rank) -> flat local tensor
    for rank in range(case["WORLD"]):
        dump = load_file(out / f"state_{rank}.safetensors")
        for i, entry in enumerate(json.load(open(out / f"state_{rank}.json"))):
            name = canonical_name(entry["name"], entry, case, shapes)
            if name is None:
                continue
            numel = torch.Size(entry["shape"]).numel()
            for state in STATES:
                flat = pieces.setdefault((name, state, entry["tp_rank"]), (torch.full((numel,), float("nan")),
                                                                           entry["shape"]))[0]
                flat[entry["start"]:entry["end"]] = dump[f"{i}.{state}"]
    expected = {}
    for (name, state, tp_rank), (flat, shape) in pieces.items():
        assert not torch.isnan(flat).any(), f"{name} {state}: part of tp rank {tp_rank}'s piece is owned by no rank"
        key = f"optimizer.{STATES[state]}.{name}"
        whole = expected.setdefault(key, torch.full(shapes[name], float("nan")))
        place(whole, flat.reshape(shape), name, tp, tp_rank)
    for key, whole in expected.items():
        assert not torch.isnan(whole).any(), f"{key}: not every element came from a rank's dump"
    return expected


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """Each case's megatron-core run, made once: {name: its output directory}."""
    runs = {}

    def run(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(name)
            run_megatron(out, CASES[name])
            runs[name] = out
        return runs[name]
    return run


def convert_run(trestle, trestle_py, megatron_runs, name, tmp_path):
    """Case `name`'s megatron-core checkpoint converted to Trestle: (its directory, its manifest, the optimizer state
    megatron-core's dumps say it must hold)."""
    case = CASES[name]
    out = megatron_runs(name)
    converted = tmp_path / "trestle"
    config = hf_config(tmp_path / "config", case)
    trestle.run("convert", "--from", "megatron-dist", out / "ckpt", "--to", "trestle", converted,
                "--hf-config", config / "config.json", "--quiet")
    manifest = trestle_py.inspect(converted)
    return converted, manifest, expected_state(out, case, manifest)


@pytest.mark.parametrize("name", CASES)
def test_dp_reshardable_state_converts_in_place(trestle, trestle_py, megatron_runs, tmp_path, name):
    converted, manifest, expected = convert_run(trestle, trestle_py, megatron_runs, name, tmp_path)
    weights = [n for n in manifest["tensors"] if not n.startswith("optimizer.")]
    assert len(expected) == 3 * len(weights), sorted(set(f"optimizer.exp_avg.{w}" for w in weights) - set(expected))
    actual = trestle_py.load(converted, {k: torch.empty(v.shape) for k, v in expected.items()})
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{name}: {key} differs from megatron-core's optimizer"
    step = trestle_py.load(converted, {"optimizer.step": torch.zeros((), dtype=torch.int64)})["optimizer.step"]
    assert step.item() == 2
    saved_scheduler = torch.load(megatron_runs(name) / "ckpt" / "common.pt", weights_only=False)["opt_param_scheduler"]
    assert saved_scheduler["num_steps"] == 8  # two iterations of a global batch of 4 samples
    assert manifest["training"]["scheduler"] == saved_scheduler
    # The state carries on through torch_dist (model space) and back.
    trestle.run("reshard", converted, tmp_path / "dist", "--to-format", "megatron-dist", "--quiet")
    dist_common = torch.load(next((tmp_path / "dist").glob("iter_*")) / "common.pt", weights_only=False)
    assert dist_common["opt_param_scheduler"] == saved_scheduler
    trestle.run("reshard", tmp_path / "dist", tmp_path / "back", "--to-format", "trestle", "--quiet")
    again = trestle_py.load(tmp_path / "back", {k: torch.empty(v.shape) for k, v in expected.items()})
    for key, value in expected.items():
        assert torch.equal(again[key], value), f"{name}: {key} changed through torch_dist"


def test_the_wrong_layer_specification_is_refused(trestle, megatron_runs, tmp_path):
    case = CASES["dense-tp2"]  # one bucket per rank: the sizes agree, only the order differs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron_runs("dense-tp2") / "ckpt", ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["args"].transformer_impl = "transformer_engine"  # the model was built with the local specification
    torch.save(common, ckpt / "common.pt")
    config = hf_config(tmp_path / "config", case)
    result = trestle.run_raw("convert", "--from", "megatron-dist", ckpt, "--to", "trestle", tmp_path / "out",
                             "--hf-config", config / "config.json", "--quiet")
    assert result.returncode != 0 and "straddles the edge of" in result.stderr and \
        "Transformer Engine" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
    # --model-only reads the weights whatever the optimizer's layout
    trestle.run("convert", "--from", "megatron-dist", ckpt, "--to", "trestle", tmp_path / "weights",
                "--hf-config", config / "config.json", "--model-only", "--quiet")


def test_grouped_gemm_experts_are_refused(trestle, megatron_runs, tmp_path):
    """Grouped-GEMM experts (args.moe_grouped_gemm) register and shape their parameters otherwise: refused, not
    guessed."""
    case = CASES["moe-ep1"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron_runs("moe-ep1") / "ckpt", ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["args"].moe_grouped_gemm = True
    torch.save(common, ckpt / "common.pt")
    config = hf_config(tmp_path / "config", case)
    result = trestle.run_raw("convert", "--from", "megatron-dist", ckpt, "--to", "trestle", tmp_path / "out",
                             "--hf-config", config / "config.json", "--quiet")
    assert result.returncode != 0 and "grouped-GEMM" in result.stderr and "--model-only" in result.stderr, \
        result.stderr


# How each case's state is written back for megatron-core to load: the layout flags, and the loading run (its
# harness settings) - the layout it was saved at, and where noted another data-parallel size.
WRITES = {
    "dense-dp2-buckets": (["--dp", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"], {}),
    "dense-dp2-buckets-to-dp1": (["--dp", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"], {"WORLD": 1}),
    "dense-tp2": (["--tp", "2", "--make-vocab-size-divisible-by", "64"], {}),  # the harness's unpadded 128 rows
    "dense-pp2-tied": (["--pp", "2"], {}),
    "moe-ep1": ([], {}),
    "moe-ep2": (["--ep", "2"], {}),  # dp: the expert-parallel size
    "dense-dp2-bf16": (["--dp", "2"], {}),
    # through `trestle reshard`: saved at tp 2, loaded at tp 1 dp 2
    "dense-tp2-resharded-to-tp1-dp2": (["--tp", "1", "--dp", "2"], {"TP": 1}),
}


@pytest.mark.parametrize("write", WRITES)
def test_megatron_core_loads_the_written_dp_reshardable_state(trestle, trestle_py, megatron_runs, tmp_path, write):
    name = next(n for n in CASES if write.startswith(n))
    flags, run_change = WRITES[write]
    case = CASES[name]
    converted, manifest, expected = convert_run(trestle, trestle_py, megatron_runs, name, tmp_path)
    written = tmp_path / "written"
    settings = dict(transformer_impl="local", lr=0.002, min_lr=0.0001, weight_decay=0.05, adam_beta2=0.95)
    if write == "moe-ep1":  # through the Python package
        trestle_py.convert(converted, written, from_format="trestle", to_format="megatron-dist",
                           dist_optimizer=settings)
    else:
        command = (["reshard", converted, written, "--to-format", "megatron-dist"] if "resharded" in write else
                   ["convert", "--from", "trestle", converted, "--to", "megatron-dist", written])
        trestle.run(*command, *flags, "--optimizer-format", "dp_reshardable", "--quiet",
                    *[x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))])
    iteration = (written / "latest_checkpointed_iteration.txt").read_text().strip()
    ckpt = written / f"iter_{int(iteration):07d}"
    common = torch.load(ckpt / "common.pt", weights_only=False)
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert common["args"].use_distributed_optimizer

    run = dict(case, **run_change)
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    run_megatron(loaded, run, load=ckpt)
    again = expected_state(loaded, run, manifest)
    assert sorted(again) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(again[key], value), f"{write}: megatron-core loaded another {key}"
    for rank in range(run["WORLD"]):
        for optimizer in json.load(open(loaded / f"groups_{rank}.json")):
            for group in optimizer:
                assert group["step"] == 2 and group["lr"] == 0.002 and group["min_lr"] == 0.0001, group
                assert group["betas"] == [0.9, 0.95] and group["weight_decay"] == 0.05 * group["wd_mult"], group
        # The learning-rate scheduler's state went along: a scheduler built with the saving run's arguments takes it
        # (strictly: every value equal) and stands where the saving run's stood.
        saved = json.load(open(megatron_runs(name) / "scheduler_saved_0.json"))
        assert json.load(open(loaded / f"scheduler_{rank}.json")) == saved

    # Trestle reads what it wrote back bit for bit.
    back = tmp_path / "back"
    trestle.run("convert", "--from", "megatron-dist", written, "--to", "trestle", back, "--quiet")
    read = trestle_py.load(back, {k: torch.empty(v.shape) for k, v in expected.items()})
    for key, value in expected.items():
        assert torch.equal(read[key], value), f"{write}: {key} changed through the written dp_reshardable state"


def test_a_source_without_scheduler_state_is_written_with_a_warning(trestle, megatron_runs, tmp_path):
    """Megatron-LM's load_checkpoint stops when common.pt has optimizer state but no opt_param_scheduler: a source
    without one is still written (Megatron-Core's optimizer loads it), and the conversion says what is missing."""
    case = CASES["dense-dp2-buckets"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron_runs("dense-dp2-buckets") / "ckpt", ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=False)
    del common["opt_param_scheduler"]
    torch.save(common, ckpt / "common.pt")
    config = hf_config(tmp_path / "config", case)
    trestle.run("convert", "--from", "megatron-dist", ckpt, "--to", "trestle", tmp_path / "trestle",
                "--hf-config", config / "config.json", "--quiet")
    stdout = trestle.run("convert", "--from", "trestle", tmp_path / "trestle", "--to", "megatron-dist",
                         tmp_path / "written", "--optimizer-format", "dp_reshardable", "--lr", "0.001", "--dp", "2")
    assert "no complete learning-rate scheduler state (missing: max_lr, lr_warmup_steps, num_steps" in stdout
    # The plan names the optimizer state it writes, and does not also call it not written.
    assert "dp_reshardable buffers" in stdout and "not written" not in stdout, stdout
    written = torch.load(next((tmp_path / "written").glob("iter_*")) / "common.pt", weights_only=False)
    assert "opt_param_scheduler" not in written and written["content_metadata"]


def test_dp_reshardable_writes_refuse_what_cannot_be_loaded(trestle, trestle_py, megatron_runs, tmp_path):
    """Settings Megatron-Core could not load, or that say nothing, are refused with what to change; nothing is
    written."""
    case = CASES["dense-dp2-buckets"]
    config = hf_config(tmp_path / "config", case)
    converted = tmp_path / "trestle"
    trestle.run("convert", "--from", "megatron-dist", megatron_runs("dense-dp2-buckets") / "ckpt", "--to", "trestle",
                converted, "--hf-config", config / "config.json", "--quiet")

    def refused(*flags, code=1):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        result = trestle.run_raw("convert", "--from", "trestle", converted, "--to", "megatron-dist", out, *flags,
                                 "--quiet")
        assert result.returncode == code, result.stderr
        assert not (out / "latest_checkpointed_iteration.txt").exists()
        return result.stderr

    assert "needs --lr" in refused("--optimizer-format", "dp_reshardable", code=2)
    assert "add --optimizer-format dp_reshardable" in refused("--overlap-grad-reduce", code=2)
    # (--lr alone writes the model-space param groups; their other hyper-parameters need it)
    assert "give --lr too" in refused("--adam-beta2", "0.95", code=2)
    assert "needs --overlap-grad-reduce" in refused("--optimizer-format", "dp_reshardable", "--lr", "0.1",
                                                    "--ddp-bucket-size", "100", code=2)
    assert "not one of model-space, dp_reshardable" in refused("--optimizer-format", "flat", code=2)
    for settings, message in (({}, "needs --lr"), ({"lr": 0.1, "bucket": 3}, "unknown setting 'bucket'"),
                              ({"lr": 0.1, "min_lr": 0.2}, "--min-lr must be at most --lr")):
        with pytest.raises(ValueError, match=message):
            trestle_py.convert(converted, tmp_path / "py", from_format="trestle", to_format="megatron-dist",
                               dist_optimizer=settings)
    assert not (tmp_path / "py").exists()
    # 64 data-parallel ranks over buckets of ~1000 elements: some rank's shard lies in the padding between
    # parameters, which Megatron-Core cannot save or load as dp_reshardable.
    message = refused("--optimizer-format", "dp_reshardable", "--lr", "0.1", "--dp", "64", "--overlap-grad-reduce",
                      "--ddp-bucket-size", "1000")
    assert "holds no parameter" in message and "--dp" in message, message
    # A Hugging Face model has no optimizer state to write.
    hf = tmp_path / "hf"
    trestle.run("convert", "--from", "trestle", converted, "--to", "hf", hf, "--quiet")
    result = trestle.run_raw("convert", "--from", "hf", hf, "--to", "megatron-dist", tmp_path / "from-hf",
                             "--optimizer-format", "dp_reshardable", "--lr", "0.1", "--quiet")
    assert result.returncode == 1 and "holds no optimizer state" in result.stderr, result.stderr
    result = trestle.run_raw("reshard", converted, tmp_path / "to-trestle", "--to-format", "trestle",
                             "--optimizer-format", "dp_reshardable", "--lr", "0.1", "--quiet")
    assert result.returncode != 0 and "megatron-dist only" in result.stderr, result.stderr
