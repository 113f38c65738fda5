"""`trestle train --ckpt-format torch_dist` (Megatron-LM's default format): every checkpoint the trainer commits holds
Megatron-Core's torch_dist form of itself beside its Trestle files, in the same iteration directory.

- tp 2, Adam: megatron-core's GPTModel and optimizer load the iteration directory with dist_checkpointing.load
  (strict), and then hold the trained weights (those `trestle convert --to hf` exports) and Adam's step; every tensor
  equals `trestle convert --to megatron-dist`'s of the same checkpoint (whose optimizer state megatron-core loads
  bit-exactly: test_megatron_dist_convert.py); common.pt carries the iteration, the data position, the scheduler and
  the run's arguments (no RNG state, said so in its args); Trestle resumes from its own files with the losses of an
  uninterrupted run, and verify passes (reading the torch_dist form too: 4 KiB zeroed in it are reported);
- dp 2 with the distributed optimizer: the state is Megatron-LM's dp_reshardable buffers laid out for this run's flags,
  equal to `trestle convert --optimizer-format dp_reshardable`'s (which megatron-core's DistributedOptimizer loads:
  test_dp_reshardable.py);
- a LoRA run, or another format, is refused before training;
- a save killed, or failing, while it writes the torch_dist form commits nothing: the tracker names the previous
  checkpoint, which verifies and keeps its own torch_dist form, and the next save leaves no staging behind; the form is
  written behind training (rank 0 parked in it, the ranks train on to the next save).
"""
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402
from test_crash_consistency import run_killed, verified  # noqa: E402
from test_megatron_dist_convert import (MCORE, MCORE_OPTIM, check_against_megatron_model, read_dcp,  # noqa: E402
                                        run_mcore)
import safetensors.torch as safetensors_torch  # noqa: E402

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"
LLAMA = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             rms_norm_eps=1e-5)
GBS = 4
TORCH_DIST_FILES = {".metadata", "metadata.json", "common.pt"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("torch_dist_save")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=7)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "start", "-q")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    return root


def train_args(setup, save, iterations, *extra, load=None, procs=2, save_interval=2):
    return ["train", "--nproc-per-node", procs, "--data-path", setup / "data" / "kjv_text_document", "--split",
            "98,2,0", "--micro-batch-size", 2, "--global-batch-size", GBS, "--seq-length", 16, "--train-iters",
            iterations, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
            "--adam-beta2", "0.95", "--eval-iters", 0, "--log-interval", 1, "--save", save, "--save-interval", save_interval,
            "--load", load or setup / "start", *extra]


def losses(log):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, log.read_text().splitlines()) if "lm_loss" in r}


def common_pt(directory):
    return torch.load(directory / "common.pt", weights_only=False)


def assert_same_dcp(ours, theirs):
    """Both iteration directories hold the same DCP entries (tensors and objects) and equal tensors."""
    keys = set(dcp.FileSystemReader(ours).read_metadata().state_dict_metadata)
    assert keys == set(dcp.FileSystemReader(theirs).read_metadata().state_dict_metadata)
    a, b = read_dcp(ours), read_dcp(theirs)
    assert sorted(a) == sorted(b) and len(a) > 10
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_megatron_core_loads_the_trainers_checkpoints(setup, trestle, tmp_path):
    save = tmp_path / "save"
    log = tmp_path / "log.jsonl"
    trestle.run(*train_args(setup, save, 4, "--tensor-model-parallel-size", 2, "--ckpt-format", "torch_dist",
                            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                            "--log-json", log), timeout=300)
    for iteration in (2, 4):
        it = save / f"iter_{iteration:07d}"
        names = {p.name for p in it.iterdir()}
        assert TORCH_DIST_FILES | {"manifest.json", "__0_0.distcp", "__1_0.distcp"} <= names, names
    assert sorted(p.name for p in save.iterdir() if p.name.startswith(".tmp")) == []
    verified = trestle.run_raw("verify", save)
    assert verified.returncode == 0 and f"ok: torch_dist {save / 'iter_0000004'}: " in verified.stdout, verified.stdout

    it = save / "iter_0000004"
    # The same checkpoint through `trestle convert` (its Trestle files) with the run's hyper-parameters: the same
    # torch_dist form, param groups included. Without them the plan says that Megatron-LM's optimizer load needs them.
    hyper = ("--lr", "1e-3", "--min-lr", "1e-4", "--weight-decay", "0.1", "--adam-beta2", "0.95")
    trestle.run("convert", "--from", "trestle", save, "--to", "megatron-dist", tmp_path / "converted", "--tp", 2,
                *hyper, "-q")
    assert_same_dcp(it, tmp_path / "converted" / "iter_0000004")
    plan = trestle.run("convert", "--from", "trestle", save, "--to", "megatron-dist", tmp_path / "x", "--dry-run")
    assert "common.pt gets no param groups (give --lr" in plan, plan
    # Trestle's tools read such a root as the Trestle checkpoint it is (the format detected): the same tensors.
    same = trestle.run_raw("diff", save, tmp_path / "converted", "--all")
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    common = common_pt(it)
    converted = common_pt(tmp_path / "converted" / "iter_0000004")
    assert common["iteration"] == converted["iteration"] == 4
    assert common["opt_param_scheduler"] == converted["opt_param_scheduler"]
    assert common["opt_param_scheduler"]["num_steps"] == 4 * GBS
    args = vars(common["args"])
    assert args["consumed_train_samples"] == 4 * GBS and args["tensor_model_parallel_size"] == 2
    assert args["no_save_rng"] is True and args["no_save_optim"] is False  # Megatron-LM then loads no RNG state
    assert args["tokenizer_type"] == "HuggingFaceTokenizer" and args["seq_length"] == 16
    assert args["global_batch_size"] == GBS and args["world_size"] == 2 and args["lr"] == 1e-3
    assert args["hidden_dropout"] == args["attention_dropout"] == 0.0  # (what Megatron-LM's --use-checkpoint-args forces)
    assert common["optimizer"] == converted["optimizer"] and common["optimizer"]["state"]["common_step"] == 4
    assert len(common["optimizer"]["param_groups"]) == 2  # weights with decay, norms without

    # megatron-core (tp 1, world of one) loads the model strictly: the weights are the trained ones.
    result, out = run_mcore(tmp_path, "load", it, free_port(), None, MCORE, config=LLAMA)
    assert result.returncode == 0, result.stderr[-3000:]
    trestle.run("convert", "--from", "trestle", save, "--to", "hf", tmp_path / "hf", "-q")
    state = safetensors_torch.load_file(out / "model.safetensors")
    check_against_megatron_model(str(tmp_path / "hf"), {k: v for k, v in state.items() if "_extra_state" not in k})
    # And its Adam state, as Megatron-LM's load_checkpoint loads it into the optimizer: every parameter's moments
    # (those megatron-core's dist_checkpointing reads), the step, and the param groups with this run's
    # hyper-parameters (the optimizer was built with others).
    result, out = run_mcore(tmp_path, "load-into-optimizer", it, free_port(), None, MCORE_OPTIM, config=LLAMA)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.load(open(out / "step.json")) == {"step": 4.0}
    read = safetensors_torch.load_file(out / "optimizer.safetensors")
    moments = safetensors_torch.load_file(out / "optimizer_held.safetensors")
    assert sorted(moments) == sorted(read) and len(moments) == 2 * 15
    for key, value in moments.items():
        assert torch.equal(value, read[key]) and value.abs().sum() > 0, key
    state = json.load(open(out / "state.json"))
    assert state["steps"] == [4.0]
    groups = sorted(state["groups"], key=lambda g: -g["wd_mult"])
    assert [(g["wd_mult"], g["weight_decay"]) for g in groups] == [(1.0, 0.1), (0.0, 0.0)]
    for g in groups:
        assert g["betas"] == [0.9, 0.95] and g["eps"] == 1e-8 and g["max_lr"] == 1e-3 and g["min_lr"] == 1e-4

    # Trestle resumes from its own files: iterations 3 and 4 as the uninterrupted run's.
    resumed = tmp_path / "resumed.jsonl"
    result = trestle.run_raw(*train_args(setup, tmp_path / "again", 4, "--tensor-model-parallel-size", 2,
                                         "--ckpt-step", 2, "--log-json", resumed, load=save), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting the Megatron torch_dist checkpoint" not in result.stdout
    trained = losses(log)
    assert losses(resumed) == {3: trained[3], 4: trained[4]}

    # A copy of the torch_dist form that lost common.pt: Adam's moments without its step (and the scheduler) were
    # loaded "with optimizer state" and the losses went another way. Refused naming the file; --no-load-optim (or
    # --model-only) reads the weights.
    torn = torch_dist_only(save, 4, tmp_path / "torn")
    (torn / "iter_0000004" / "common.pt").unlink()
    for command in (["verify", torn], train_args(setup, tmp_path / "t", 6, "--tensor-model-parallel-size", 2, load=torn)):
        result = trestle.run_raw(*command, timeout=300)
        assert result.returncode == 1 and "common.pt (missing)" in result.stderr and "--model-only" in result.stderr, \
            result.stdout[-2000:] + result.stderr[-2000:]
    trestle.run(*train_args(setup, tmp_path / "t", 5, "--tensor-model-parallel-size", 2, "--no-load-optim",
                            load=torn), timeout=300)

    # The manifest does not checksum the torch_dist form's files: verify reads that form whole too, so 4 KiB zeroed
    # in a weight's data there (which Megatron-LM's load would take) is reported naming the file.
    damaged = tmp_path / "damaged"
    shutil.copytree(save, damaged)
    dcp_metadata = dcp.FileSystemReader(str(damaged / "iter_0000004")).read_metadata()
    stored = next(info for index, info in dcp_metadata.storage_data.items()
                  if index.fqn == "embedding.word_embeddings.weight" and info.relative_path == "__0_0.distcp")
    with open(damaged / "iter_0000004" / "__0_0.distcp", "r+b") as f:
        f.seek(stored.offset + stored.length // 2)
        f.write(bytes(4096))
    result = trestle.run_raw("verify", damaged)
    assert result.returncode == 1 and "__0_0.distcp: tensor 'embedding.word_embeddings.weight'" in result.stderr and \
        "CRC-32" in result.stderr, result.stdout[-2000:] + result.stderr[-2000:]


def test_distributed_optimizer_state_is_megatrons_dp_reshardable(setup, trestle, tmp_path):
    save = tmp_path / "save"
    flags = ("--overlap-grad-reduce", "--ddp-bucket-size", 20000)
    out = trestle.run(*train_args(setup, save, 2, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                                  *flags), timeout=300)
    assert "torch_dist form of iteration 2 written" in out
    assert "--overlap-grad-reduce" not in out  # not among the flags "without effect": it lays the buffers out
    it = save / "iter_0000002"
    assert TORCH_DIST_FILES <= {p.name for p in it.iterdir()}
    # As `trestle convert` writes it for a Megatron-LM run with these flags (Transformer Engine's layer order, its
    # default).
    trestle.run("convert", "--from", "trestle", save, "--to", "megatron-dist", tmp_path / "converted",
                "--optimizer-format", "dp_reshardable", "--dp", 2, *flags, "--lr", "1e-3", "--min-lr", "1e-4",
                "--weight-decay", "0.1", "--adam-beta2", "0.95", "--transformer-impl", "transformer_engine", "-q")
    assert_same_dcp(it, tmp_path / "converted" / "iter_0000002")
    keys = set(dcp.FileSystemReader(it).read_metadata().state_dict_metadata)
    assert any(".bucket_idx_1." in k and k.endswith(".exp_avg") for k in keys), sorted(keys)  # several buckets
    args = vars(common_pt(it)["args"])
    assert args["data_parallel_size"] == 2 and args["use_distributed_optimizer"] is True
    assert args["transformer_impl"] == "transformer_engine"


def test_what_has_no_torch_dist_form_is_refused(setup, trestle, tmp_path):
    result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dist", "--lora-rank", 4,
                                         "--pretrained-checkpoint", setup / "start", load=tmp_path / "s", procs=1),
                             timeout=120)
    assert result.returncode != 0 and "--ckpt-format torch_dist" in result.stderr and "hf-peft" in result.stderr, \
        result.stderr[-2000:]
    result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dist", "--decoupled-lr",
                                         "1e-4", procs=1), timeout=120)
    assert result.returncode != 0 and "--decoupled-lr" in result.stderr and "param groups" in result.stderr, \
        result.stderr[-2000:]
    # What the distributed optimizer's buffers cannot say: refused before any step.
    for flags, message in [(("--ddp-num-buckets", 4), "--ddp-bucket-size")]:
        result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dist",
                                             "--use-distributed-optimizer", *flags, procs=1), timeout=120)
        assert result.returncode != 0 and message in result.stderr and "iteration" not in result.stdout, \
            result.stdout[-2000:] + result.stderr[-2000:]
    # An MoE model's optimizer state: as the distributed optimizer's only.
    save_tiny_model(tmp_path / "moe_hf", "MixtralConfig", dict(LLAMA, num_local_experts=4, num_experts_per_tok=2),
                    seed=3)
    trestle.run("convert", "--from", "hf", tmp_path / "moe_hf", "--to", "trestle", tmp_path / "moe", "-q")
    result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dist",
                                         load=tmp_path / "moe", procs=1), timeout=120)
    assert result.returncode != 0 and "--use-distributed-optimizer" in result.stderr, result.stderr[-2000:]
    result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dist",
                                         "--use-distributed-optimizer", "--tensor-model-parallel-size", 2,
                                         "--expert-tensor-parallel-size", 1, load=tmp_path / "moe"), timeout=120)
    assert result.returncode != 0 and "--expert-tensor-parallel-size 1" in result.stderr, result.stderr[-2000:]
    result = trestle.run_raw("convert", "--from", "trestle", tmp_path / "moe", "--to", "megatron-dist", tmp_path / "d",
                             "--lr", "1e-3")
    assert result.returncode != 0 and "chained dense and expert" in result.stderr, result.stderr[-2000:]
    trestle.run("convert", "--from", "trestle", tmp_path / "moe", "--to", "megatron-dist", tmp_path / "d", "--lr",
                "1e-3", "--model-only", "-q")  # (no optimizer state: nothing to refuse)
    result = trestle.run_raw(*train_args(setup, tmp_path / "s", 2, "--ckpt-format", "torch_dcp", procs=1))
    assert result.returncode != 0 and "--ckpt-format torch_dcp" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "s" / "latest_checkpointed_iteration.txt").exists()


# megatron-core's DynamicGradScaler (on CPU: its scale lives on 'cuda') given a saved state: the state it then holds.
GRAD_SCALER = textwrap.dedent("""
    import json, sys, torch
    tensor = torch.tensor
    torch.tensor = lambda *a, **k: tensor(*a, **(dict(k, device="cpu") if k.get("device") == "cuda" else k))
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: 0
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    state = torch.load(sys.argv[1], weights_only=False)
    scaler = DynamicGradScaler(initial_scale=2.0 ** 16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=3, hysteresis=2)
    scaler.load_state_dict(state)
    held = scaler.state_dict()
    print(json.dumps({"scale": held["scale"].tolist(), "dtype": str(held["scale"].dtype),
                      "growth_tracker": held["growth_tracker"], "hysteresis_tracker": held["hysteresis_tracker"]}))
""")


def torch_dist_only(save, iteration, to):
    """The torch_dist form of a trainer's checkpoint (its Trestle files left out), as Megatron-LM would have saved."""
    it = f"iter_{iteration:07d}"
    (to / it).mkdir(parents=True)
    for f in (save / it).iterdir():
        if f.name in TORCH_DIST_FILES or f.suffix == ".distcp" or f.name == "trestle_model.json":
            shutil.copy(f, to / it / f.name)
        elif f.name == "hf_files":  # the tokenizer and config files kept beside it
            shutil.copytree(f, to / it / f.name)
    (to / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return to


def test_a_release_loads_its_weights_and_consumed_samples_from_iteration_0(setup, trestle, tmp_path):
    """Megatron's release checkpoint (a torch_dist root whose tracker says "release"): load_checkpoint takes its
    weights and the consumed samples its args record, from iteration 0, and neither its optimizer's and scheduler's
    state nor its RNG's: the run logs iteration 1 after the recorded samples, its learning rate warming up afresh, and
    --ckpt-step with --pretrained-checkpoint reaches the pretrained root's iteration when --load holds none yet."""
    save = tmp_path / "save"
    trestle.run(*train_args(setup, save, 4, "--ckpt-format", "torch_dist", procs=1), timeout=300)
    released = torch_dist_only(save, 4, tmp_path / "mc")
    (released / "iter_0000004").rename(released / "release")
    (released / "latest_checkpointed_iteration.txt").write_text("release")
    fresh, out = tmp_path / "fresh.jsonl", tmp_path / "release.jsonl"
    trestle.run(*train_args(setup, tmp_path / "s1", 2, "--log-json", fresh, procs=1), timeout=300)
    printed = trestle.run(*train_args(setup, tmp_path / "s2", 2, "--log-json", out, load=released, procs=1),
                          timeout=300)
    assert "its weights and consumed samples from iteration 0 (a release checkpoint" in printed, printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["iteration"], r["consumed_samples"]) for r in records] == [(1, 5 * GBS), (2, 6 * GBS)], records
    first = json.loads(fresh.read_text().splitlines()[0])
    assert records[0]["learning_rate"] == first["learning_rate"], (records[0], first)
    # --ckpt-step N of --pretrained-checkpoint P where --load holds nothing yet: P's iteration N, fine-tuned.
    log = tmp_path / "step.jsonl"
    printed = trestle.run(*train_args(setup, tmp_path / "job", 2, "--pretrained-checkpoint", save, "--ckpt-step", 2,
                                      "--log-json", log, load=tmp_path / "job", procs=1), timeout=300)
    assert "fine-tuning from --pretrained-checkpoint" in printed and "iter_0000002" in printed, printed
    assert json.loads(log.read_text().splitlines()[0])["iteration"] == 1


def grad_scaler_objects(it):
    """The distributed optimizer's 'grad_scaler' object (data-parallel group 0's, the only one here), as torch DCP
    loads it: the list torch.save wrote."""
    keys = [k for k in dcp.FileSystemReader(it).read_metadata().state_dict_metadata if ".grad_scaler" in k]
    assert keys == ["optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1"], keys  # a ShardedObject's key
    state = {keys[0]: io.BytesIO()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(it), no_dist=True)
    return state[keys[0]]


@pytest.mark.parametrize("optimizer", ["model-space", "distributed"])
def test_fp16_loss_scaler_travels_in_the_torch_dist_form(setup, trestle, tmp_path, optimizer):
    """An fp16 run's dynamic loss scaler (halved after overflows, grown after clean windows) is saved where
    Megatron-Core keeps it: beside the fp16 optimizer in common.pt, or as each data-parallel group's 'grad_scaler'
    object of the distributed optimizer. megatron-core's DynamicGradScaler loads it; Trestle resumes from the
    torch_dist form alone as the uninterrupted run goes on, loss scale and losses."""
    extra = ("--use-distributed-optimizer",) if optimizer == "distributed" else ()
    save, log = tmp_path / "save", tmp_path / "log.jsonl"
    # 2^17 trains this model in fp16 and 2^18 overflows: the scale grows after iteration 3's clean window, iteration 4
    # overflows (hysteresis 2: kept), and the state saved there is no fresh scaler's.
    fp16 = ("--fp16", "--initial-loss-scale", 2.0 ** 17, "--loss-scale-window", 3, "--ckpt-format", "torch_dist",
            *extra)
    trestle.run(*train_args(setup, save, 6, *fp16, "--log-json", log), timeout=300)

    def records(path):
        return {r["iteration"]: (r.get("lm_loss"), r["loss_scale"])
                for r in map(json.loads, path.read_text().splitlines()) if "loss_scale" in r}
    run = records(log)
    saved = json.loads((save / "iter_0000004" / "manifest.json").read_text())["training"]["loss_scaler"]
    assert saved != {"scale": 2.0 ** 17, "growth_tracker": 0, "hysteresis_tracker": 2}, saved
    it = save / "iter_0000004"
    if optimizer == "model-space":
        scaler = common_pt(it)["optimizer"]["grad_scaler"]
    else:
        (scaler,) = grad_scaler_objects(it)
    assert sorted(scaler) == ["growth_tracker", "hysteresis_tracker", "scale"]
    assert scaler["scale"].dtype == torch.float32 and scaler["scale"].shape == (1,)
    torch.save(scaler, tmp_path / "scaler.pt")
    result = subprocess.run([sys.executable, "-c", GRAD_SCALER, tmp_path / "scaler.pt"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == {"scale": [saved["scale"]], "dtype": "torch.float32",
                                         "growth_tracker": saved["growth_tracker"],
                                         "hysteresis_tracker": saved["hysteresis_tracker"]}

    # Resumed from the torch_dist files alone (converted for loading): iterations 5 and 6 as the run's own.
    mc = torch_dist_only(save, 4, tmp_path / "megatron")
    resumed = tmp_path / "resumed.jsonl"
    result = trestle.run_raw(*train_args(setup, tmp_path / "again", 6, *fp16, "--log-json", resumed, load=mc),
                             timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting the Megatron torch_dist checkpoint" in result.stdout
    assert records(resumed) == {i: run[i] for i in (5, 6)}, (records(resumed), run)


def test_a_constant_loss_scale_is_megatrons_empty_grad_scaler(setup, trestle, tmp_path):
    """--loss-scale with the distributed optimizer (here bf16): Megatron-Core keeps a ConstantGradScaler, whose state
    ({}) its load of the dp_reshardable buffers asks for as each group's 'grad_scaler' object; `trestle convert
    --loss-scale` writes the same, and Trestle resumes from the torch_dist files alone as the run goes on."""
    save, log = tmp_path / "save", tmp_path / "log.jsonl"
    flags = ("--bf16", "--loss-scale", 1024, "--use-distributed-optimizer", "--ckpt-format", "torch_dist")
    trestle.run(*train_args(setup, save, 4, *flags, "--log-json", log), timeout=300)
    it = save / "iter_0000002"
    assert grad_scaler_objects(it) == [{}]
    trestle.run("convert", "--from", "trestle", save, "--to", "megatron-dist", tmp_path / "converted", "--iteration",
                2, "--optimizer-format", "dp_reshardable", "--dp", 2, "--loss-scale", 1024, "--lr", "1e-3",
                "--min-lr", "1e-4", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--transformer-impl",
                "transformer_engine", "-q")
    assert_same_dcp(it, tmp_path / "converted" / "iter_0000002")
    refused = trestle.run_raw("convert", "--from", "trestle", save, "--to", "megatron-dist", tmp_path / "x",
                              "--loss-scale", 1024, "--lr", "1e-3")
    assert refused.returncode != 0 and "--optimizer-format dp_reshardable" in refused.stderr, refused.stderr[-2000:]
    resumed = tmp_path / "resumed.jsonl"
    result = trestle.run_raw(*train_args(setup, tmp_path / "again", 4, *flags, "--log-json", resumed,
                                         load=torch_dist_only(save, 2, tmp_path / "megatron")), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(resumed) == {i: losses(log)[i] for i in (3, 4)}


def test_a_save_cut_short_while_writing_the_torch_dist_form_commits_nothing(setup, trestle_bin, tmp_path):
    def run(save, iterations, *extra, load=None, **faults):
        args = train_args(setup, save, iterations, *extra, load=load)
        return run_killed(trestle_bin, [trestle_bin, *map(str, args)], **faults)

    first = tmp_path / "first"
    assert run(first, 2, "--ckpt-format", "torch_dist").returncode == 0

    def traced(name, *extra):
        result = run(tmp_path / name, 4, *extra, load=first, trace=tmp_path / f"{name}.%p")
        assert result.returncode == 0, result.stderr[-3000:]
        return max((t.read_text().splitlines() for t in tmp_path.glob(f"{name}.*")), key=len)  # rank 0 commits

    # Rank 0's fault points: the torch_dist form's (and its manifest's, written before it) come before the commit.
    plain, dual = traced("plain"), traced("dual", "--ckpt-format", "torch_dist")
    start = next(i for i, (a, b) in enumerate(zip(plain, dual)) if a != b)
    extra = len(dual) - len(plain)
    assert extra >= 4 and dual[start + extra:] == plain[start:], (plain, dual)
    for n, faults in [(start + extra // 2 + 1, dict(kill_at=start + extra // 2 + 1)),
                      (start + 1, dict(env_extra={"TRESTLE_TEST_FAIL_POINT": str(start + 1),
                                                  "TRESTLE_TEST_FAIL_ERRNO": "ENOSPC"})),
                      (start + extra, dict(env_extra={"TRESTLE_TEST_FAIL_POINT": str(start + extra)}))]:
        root = tmp_path / f"root{n}"
        assert run(root, 2, "--ckpt-format", "torch_dist").returncode == 0
        faults.setdefault("env_extra", {})["TRESTLE_TEST_FAULT_RANK"] = "0"
        result = run(root, 4, "--ckpt-format", "torch_dist", load=root, **faults)
        assert result.returncode != 0, (n, result.stdout[-2000:])
        if "kill_at" in faults:  # killed while writing the torch_dist form: its staging is left
            assert any(p.name.endswith(".torch_dist") for p in root.iterdir()), sorted(os.listdir(root))
        else:
            assert "the checkpoint of iteration 4" in result.stderr and "injected fault" in result.stderr, \
                result.stderr[-3000:]
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert not (root / "iter_0000004").exists()
        assert verified(trestle_bin, root, 2)
        assert TORCH_DIST_FILES <= {p.name for p in (root / "iter_0000002").iterdir()}
        # The next save removes what the cut one left.
        result = run(root, 4, "--ckpt-format", "torch_dist", load=root)
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [], sorted(os.listdir(root))
        assert verified(trestle_bin, root, 4)

    # The torch_dist form is written behind training: with rank 0 parked halfway through it (iteration 4's save), the
    # ranks train on through iteration 8, whose own save then waits for it; nothing of iteration 4 is committed yet.
    behind, log = tmp_path / "behind", tmp_path / "behind.jsonl"
    args = train_args(setup, behind, 12, "--ckpt-format", "torch_dist", "--log-json", log, load=first,
                      save_interval=4)
    env = dict(os.environ, TRESTLE_TEST_HANG_POINT=str(start + extra // 2 + 1), TRESTLE_TEST_FAULT_RANK="0")
    env.pop("TRESTLE_TEST_KILL_TRACE", None)
    process = subprocess.Popen([trestle_bin, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while 8 not in (losses(log) if log.exists() else {}):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training stopped while rank 0 wrote the torch_dist form"
            time.sleep(0.1)
        assert process.poll() is None and not (behind / "iter_0000004").exists(), sorted(os.listdir(behind))
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
