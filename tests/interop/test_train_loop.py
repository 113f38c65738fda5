"""`trestle train` end to end on the bundled KJV corpus and a tiny random Llama converted from `transformers`:

- the losses of the first 20 iterations agree within 1e-5 relative at tp1/dp1, tp2/dp1, tp1/dp2 and tp2/dp2 with
  sequence parallelism (fp32, the same global batch and data), and a model initialised from scratch is the same
  model at every layout;
- --log-params-norm and --log-num-zeros-in-grad log the saved weights' norm and the zeros of the first step's
  gradient at tp 1 and tp 2;
- --exit-duration-in-mins saves and stops after the first iteration past the duration, and the run resumes
  bit-identically;
- stopping at iteration 10 (--exit-interval) and resuming to 20 gives bit-identical losses and weights to an
  uninterrupted run, and resuming the same checkpoint at other layouts gives the same iteration-11 loss (1e-5);
- the trained checkpoint converts to Hugging Face, and `transformers`' loss on the validation samples (as
  megatron-core's GPTDataset builds them) equals the trainer's validation loss;
- a megatron-core-written torch_dist checkpoint (GPTModel + Adam state) loads at tp2/dp2: the first loss is
  transformers' on the same model and samples, and the loaded Adam state changes the following steps;
- with --eod-mask-loss, cp 1 and cp 2 train as megatron-core does (each context-parallel rank's mean over its own
  counted tokens, gradients averaged over the ranks), the logged loss the mean over every counted token; with
  --calculate-per-token-loss on one rank, cp 2 x dp 2 and pp 2 x dp 2 the gradient is the global batch's token mean;
- with --reset-attention-mask each document attends only to itself, as transformers trains given megatron-core's
  GPTDataset masks, at one rank, tp 2, cp 2 (the ring's blocks masked by document), pp 2 x dp 2 and cp 2 x tp 2;
- a Megatron-LM script's flags run unchanged (its model flags checked against the model, its kernel, overlap, backend
  and tokenizer choices accepted without effect and named), a model flag that does not describe the model refused;
- fp16 with Megatron's dynamic loss scaling skips overflowing iterations, follows fp32 and resumes its state;
- the TensorBoard events hold the logged losses; killing one worker mid-run ends the job, naming the rank.
"""
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time
import types

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ci_scope import ci_cases  # noqa: E402
from hf_training import auto_model, train_transformers  # noqa: E402
from models import save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"
SEQ, MBS, GBS, ITERS = 32, 2, 8, 20
LLAMA = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("train")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=3)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "ckpt", "--quiet")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    return root


def train(trestle, setup, out, *extra, tp=1, dp=1, cp=1, pp=1, iters=ITERS, load=None, timeout=300, seq=SEQ,
          data=None):
    """Runs `trestle train` and returns {iteration: lm loss} and the validation losses from its JSON log."""
    trestle.run(*train_args(setup, out, *extra, tp=tp, dp=dp, cp=cp, pp=pp, iters=iters, load=load, seq=seq,
                            data=data), timeout=timeout)
    return read_losses(out / "log.jsonl")


def train_args(setup, out, *extra, tp=1, dp=1, cp=1, pp=1, iters=ITERS, load=None, seq=SEQ, data=None):
    """`trestle train`'s arguments for the tests' runs (on `data`, a dataset prefix, or the KJV corpus), logging JSON
    lines to out/log.jsonl."""
    log = out / "log.jsonl"
    return ["train", "--nproc-per-node", tp * dp * cp * pp, "--tensor-model-parallel-size", tp,
            "--context-parallel-size", cp, "--pipeline-model-parallel-size", pp,
            "--data-path", data or setup / "data" / "kjv_text_document", "--split", "98,2,0",
            "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", seq, "--train-iters", iters,
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", 3, "--lr-decay-style", "cosine",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95", "--log-interval", 1,
            "--eval-interval", 1000, "--eval-iters", 0, "--log-json", log,
            "--load", load if load is not None else setup / "ckpt", *extra]


def read_losses(log):
    """A `trestle train --log-json` log's {iteration: lm loss} and its validation losses in order."""
    losses, valid = {}, []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "validation" in record:
            valid.append(record["lm_loss"])
        elif "lm_loss" in record:  # (an interval of skipped steps only logs no loss, as Megatron's)
            losses[record["iteration"]] = record["lm_loss"]
    return losses, valid


def close(a, b, rel=1e-5):
    return abs(a - b) <= rel * abs(b)


LAYOUTS = [(2, 1, False), (1, 2, False), (2, 2, True)]


@pytest.fixture(scope="module")
def reference(setup, trestle, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1dp1")
    losses, _ = train(trestle, setup, out, "--save", out / "save", "--tensorboard-dir", out / "tb")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return out, losses


@pytest.mark.parametrize("tp,dp,sp", LAYOUTS)
def test_losses_agree_across_layouts(setup, trestle, reference, tmp_path, tp, dp, sp):
    _, expected = reference
    losses, _ = train(trestle, setup, tmp_path, *(["--sequence-parallel"] if sp else []), tp=tp, dp=dp)
    assert sorted(losses) == sorted(expected)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"tp{tp}/dp{dp}{' sp' if sp else ''}: losses differ from tp1/dp1 at {bad}"
    assert expected[ITERS] < expected[1] - 0.05, "the loss does not go down"


def test_gradient_accumulation_fusion_changes_no_loss(setup, trestle, reference, tmp_path):
    """The weight-gradient GEMMs accumulating into the gradient buffers (the default) and autograd's own weight
    gradients added into them (--no-gradient-accumulation-fusion) train the same model: tp2/dp2 with sequence
    parallelism, 1e-5 relative to the fused tp1/dp1 run."""
    _, expected = reference
    losses, _ = train(trestle, setup, tmp_path, "--sequence-parallel", "--no-gradient-accumulation-fusion", tp=2, dp=2)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert sorted(losses) == sorted(expected) and not bad, bad


def test_from_scratch_is_the_same_model_at_every_layout(setup, trestle, tmp_path):
    first = {}
    for tp, dp in [(1, 1), (2, 1), (1, 2)]:
        out = tmp_path / f"tp{tp}dp{dp}"
        out.mkdir()
        log = out / "log.jsonl"
        trestle.run("train", "--nproc-per-node", tp * dp, "--tensor-model-parallel-size", tp,
                    "--model-config", setup / "hf" / "config.json",
                    "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
                    "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 3,
                    "--lr", "1e-3", "--log-interval", 1, "--eval-iters", 0, "--log-json", log, timeout=300)
        first[(tp, dp)] = [json.loads(line)["lm_loss"] for line in log.read_text().splitlines()]
    # A random model's first loss is about log(vocab).
    assert abs(first[(1, 1)][0] - math.log(LLAMA["vocab_size"])) < 0.5
    for layout, losses in first.items():
        assert all(close(a, b) for a, b in zip(losses, first[(1, 1)], strict=True)), (layout, losses, first[(1, 1)])


def test_a_config_too_large_for_memory_is_refused_before_anything_is_allocated(setup, trestle, tmp_path):
    """A config.json whose weights alone (2^30 x 64 embedding rows, fp32) pass this machine's memory: exit 1, naming
    the file, the sizes and both amounts; no LibTorch abort."""
    config = json.loads((setup / "hf" / "config.json").read_text())
    config["vocab_size"] = 2**30
    (tmp_path / "huge.json").write_text(json.dumps(config))
    result = trestle.run_raw("train", "--model-config", tmp_path / "huge.json", "--mock-data", "--micro-batch-size", 1,
                             "--global-batch-size", 1, "--seq-length", 16, "--train-iters", 1, "--lr", "1e-3",
                             timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    for words in (str(tmp_path / "huge.json"), "vocabulary 1073741824", "GiB of its weights alone", "GiB of memory"):
        assert words in result.stderr, result.stderr[-2000:]
    assert "terminate called" not in result.stderr


def test_heads_too_odd_for_rope_are_refused_naming_the_config(setup, trestle, tmp_path):
    """head_dim 15 (transformers' RoPE fails on it too): refused naming config.json and the head dim (the refusal
    named neither the file nor which size was the head's before)."""
    config = json.loads((setup / "hf" / "config.json").read_text())
    config.update(head_dim=15)
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = trestle.run_raw("train", "--model-config", tmp_path / "config.json", "--mock-data", "--micro-batch-size",
                             1, "--global-batch-size", 1, "--seq-length", 16, "--train-iters", 1, "--lr", "1e-3",
                             timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert f"{tmp_path / 'config.json'}: RoPE needs an even number of rotary dims per head, at least 2: head dim " \
           "(kv_channels) 15 x rotary_percent 1 gives 15" in result.stderr, result.stderr[-2000:]


def test_the_json_log_goes_on_after_a_torn_record_and_a_failed_write_ends_the_run(setup, trestle, tmp_path):
    """A log whose last record a killed run cut short: the next run's records start on a line of their own, saying
    so, and each is whole. A log that cannot be written (/dev/full, a full disk) ends the run naming the file; its
    records were dropped without a word before."""
    out = tmp_path / "run"
    out.mkdir()
    torn = '{"iteration":7,"lm_loss":3.25'
    (out / "log.jsonl").write_text('{"iteration":6,"lm_loss":3.5}\n' + torn)
    result = trestle.run_raw(*train_args(setup, out, iters=4), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"note: {out / 'log.jsonl'} ends inside a record" in result.stdout, result.stdout[-2000:]
    lines = (out / "log.jsonl").read_text().split("\n")
    assert lines[:2] == ['{"iteration":6,"lm_loss":3.5}', torn] and lines[-1] == ""
    assert [json.loads(line)["iteration"] for line in lines[2:-1]] == [1, 2, 3, 4]

    args = train_args(setup, out, iters=4)
    args[args.index("--log-json") + 1] = "/dev/full"
    full = trestle.run_raw(*args, timeout=300)
    assert full.returncode == 1, (full.returncode, full.stderr[-2000:])
    assert "/dev/full: cannot append to the JSON log" in full.stderr, full.stderr[-2000:]


def test_a_load_directory_without_a_checkpoint_starts_from_scratch_as_megatron(setup, trestle, tmp_path):
    """Megatron's idiom of one directory for --load and --save: while it holds no checkpoint the run starts from
    scratch (--model-config here), saying so, and the same command later resumes from what it saved;
    --exit-on-missing-checkpoint ends the job instead, and without --model-config the error says what to give."""
    root = tmp_path / "ckpt"
    run = ["--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size", MBS,
           "--global-batch-size", GBS, "--seq-length", SEQ, "--lr", "1e-3", "--log-interval", 1, "--eval-iters", 0]
    config = ["--model-config", setup / "hf" / "config.json"]
    common = ["train", *config, "--load", root, "--save", root, "--save-interval", 2, *run]
    first = trestle.run_raw(*common, "--train-iters", 2, "--log-json", tmp_path / "first.jsonl", timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"--load {root} holds no checkpoint yet: training from scratch" in first.stdout
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    second = trestle.run_raw(*common, "--train-iters", 3, "--log-json", tmp_path / "second.jsonl", timeout=300)
    assert second.returncode == 0 and "holds no checkpoint" not in second.stdout, second.stderr[-2000:]
    assert [json.loads(line)["iteration"] for line in (tmp_path / "second.jsonl").read_text().splitlines()] == [3]
    empty = tmp_path / "empty"
    empty.mkdir()
    for extra, message in [(config + ["--exit-on-missing-checkpoint"],
                            f"--load {empty} holds no checkpoint (--exit-on-missing-checkpoint)"),
                           ([], f"--load {empty} holds no checkpoint yet: give --model-config CONFIG.json")]:
        result = trestle.run_raw("train", "--load", empty, *extra, *run, "--train-iters", 1, timeout=120)
        assert result.returncode != 0 and message in result.stderr, (extra, result.returncode, result.stderr[-2000:])
        assert list(empty.iterdir()) == []


def test_pretrained_checkpoint_fine_tunes_until_load_holds_the_jobs_saves(setup, trestle, tmp_path):
    """Megatron's --pretrained-checkpoint (without LoRA): while --load (the job's own --save) holds no checkpoint, the
    run starts from the pretrained weights as --finetune does (iteration 1, optimizer, schedule and data from zero),
    saying so; the same command run again resumes what the job saved. --override-ckpt-iteration applies to such a load
    (Megatron refuses it only beside --finetune); a --pretrained-checkpoint that holds nothing is refused."""
    for name in ("pre", "finetune", "first", "again", "override"):
        (tmp_path / name).mkdir()
    pretrained = tmp_path / "pre" / "save"
    train(trestle, setup, tmp_path / "pre", "--save", pretrained, "--save-interval", 4, iters=4)
    tuned, _ = train(trestle, setup, tmp_path / "finetune", "--finetune", iters=4, load=pretrained)
    job = tmp_path / "job"
    common = ["--pretrained-checkpoint", pretrained, "--save", job, "--save-interval", 2]
    out = trestle.run(*train_args(setup, tmp_path / "first", *common, iters=4, load=job), timeout=300)
    assert f"--load {job} holds no checkpoint yet: fine-tuning from --pretrained-checkpoint {pretrained}" in out, out
    assert "weights only (fine-tuning from --pretrained-checkpoint)" in out, out
    first, _ = read_losses(tmp_path / "first" / "log.jsonl")
    assert first == tuned
    assert (job / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    out = trestle.run(*train_args(setup, tmp_path / "again", *common, iters=6, load=job), timeout=300)
    assert "fine-tuning" not in out and "with optimizer state" in out, out
    again, _ = read_losses(tmp_path / "again" / "log.jsonl")
    assert sorted(again) == [5, 6]
    # No --load at all, and the data rewound to iteration 3's end.
    args = train_args(setup, tmp_path / "override", "--pretrained-checkpoint", pretrained, "--override-ckpt-iteration",
                      3, iters=5)
    del args[args.index("--load"):args.index("--load") + 2]
    out = trestle.run(*args, timeout=300)
    assert "no --load: fine-tuning from --pretrained-checkpoint" in out and "resuming as iteration 3" in out, out
    records = [json.loads(line) for line in (tmp_path / "override" / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [4, 5] and records[0]["consumed_samples"] == 4 * GBS, records
    missing = trestle.run_raw(*train_args(setup, tmp_path, "--pretrained-checkpoint", tmp_path / "nothing", iters=1,
                                          load=tmp_path / "none"), timeout=120)
    assert missing.returncode == 1 and f"--pretrained-checkpoint {tmp_path / 'nothing'} holds no checkpoint (and " \
        f"--load {tmp_path / 'none'} holds no checkpoint yet)" in missing.stderr, missing.stderr[-2000:]


def test_params_norm_and_zero_gradients_are_logged_as_megatron(setup, trestle, tmp_path):
    """--log-params-norm and --log-num-zeros-in-grad (Megatron's): after one step the logged parameter norm is the saved
    weights' L2 norm (fp32: the masters are the weights) and the count of zero gradients is the count of zeros in
    Adam's first moment ((1 - beta1) g after one step: the embedding rows of the tokens the batch lacks, among others);
    at tp 2 with sequence parallelism (each replica counted once) the same values. The console line carries them."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "docs" / "examples"))
    import read_trestle
    logged = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        result = trestle.run_raw(*train_args(setup, out, "--log-params-norm", "--log-num-zeros-in-grad", "--save",
                                             out / "save", "--exit-interval", 1,
                                             *(["--sequence-parallel"] if tp > 1 else []), tp=tp, iters=4), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert re.search(r"grad norm: [0-9.]+ \| num zeros: [0-9]+ \| params norm: [0-9.]+ \|", result.stdout), \
            result.stdout[-2000:]
        record = json.loads((out / "log.jsonl").read_text().splitlines()[0])
        logged[tp] = record["params_norm"], record["num_zeros"]
    _, tensors = read_trestle.read_checkpoint(str(tmp_path / "tp1" / "save"))
    weights = {n: t for n, t in tensors.items() if not n.startswith("optimizer.")}
    norm = math.sqrt(sum(float((torch.as_tensor(t).double() ** 2).sum()) for t in weights.values()))
    zeros = sum(int((torch.as_tensor(tensors[f"optimizer.exp_avg.{n}"]) == 0).sum()) for n in weights)
    assert zeros > 1000, zeros  # unseen tokens' embedding rows
    for tp, (params_norm, num_zeros) in logged.items():
        assert close(params_norm, norm, rel=1e-6) and num_zeros == zeros, (tp, params_norm, norm, num_zeros, zeros)


def test_exit_duration_saves_stops_and_resumes_bit_identically(setup, trestle, tmp_path, reference):
    """--exit-duration-in-mins (Megatron's): the first iteration that ends past the duration (1e-4 minutes: the first)
    is saved and committed, the job says why it stops and exits 0, and the resumed run continues the uninterrupted
    run's losses bit for bit."""
    _, expected = reference
    (tmp_path / "first").mkdir()
    result = trestle.run_raw(*train_args(setup, tmp_path / "first", "--save", tmp_path / "save",
                                         "--exit-duration-in-mins", "1e-4"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"exiting at iteration 1 after [0-9.e-]+ minutes \(--exit-duration-in-mins\)", result.stdout), \
        result.stdout[-2000:]
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    first, _ = read_losses(tmp_path / "first" / "log.jsonl")
    assert first == {1: expected[1]}
    (tmp_path / "resumed").mkdir()
    resumed, _ = train(trestle, setup, tmp_path / "resumed", load=tmp_path / "save")
    assert resumed == {i: expected[i] for i in range(2, ITERS + 1)}
    bad = trestle.run_raw(*train_args(setup, tmp_path, "--exit-duration-in-mins", "-1"), timeout=60)
    assert bad.returncode == 2 and "--exit-duration-in-mins must be a number of minutes" in bad.stderr, bad.stderr


def test_stop_and_resume_is_bit_identical(setup, trestle, tmp_path, reference):
    _, expected = reference
    # Uninterrupted at tp2/dp2, saving at 10 and 20.
    full, _ = train(trestle, setup, tmp_path, "--save", tmp_path / "full", "--save-interval", 10, tp=2, dp=2)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    first, _ = train(trestle, setup, stopped, "--save", tmp_path / "part", "--exit-interval", 10, tp=2, dp=2)
    assert sorted(first) == list(range(1, 11))
    assert (tmp_path / "part" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    resumed, _ = train(trestle, setup, resumed_dir, "--save", tmp_path / "part", tp=2, dp=2, load=tmp_path / "part")
    assert sorted(resumed) == list(range(11, ITERS + 1))
    for i in range(1, 11):
        assert first[i] == full[i], f"iteration {i}: {first[i]!r} != {full[i]!r}"
    for i in range(11, ITERS + 1):
        assert resumed[i] == full[i], f"iteration {i} after resume: {resumed[i]!r} != {full[i]!r}"
    # The final weights and optimizer state are bit-identical too.
    assert (tmp_path / "part" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    trestle.run("diff", tmp_path / "full", tmp_path / "part", "--quiet")
    # Resuming the iteration-10 checkpoint on other layouts: the next loss is the same.
    for tp, dp in [(1, 1), (2, 1), (1, 2)]:
        out = tmp_path / f"other_tp{tp}dp{dp}"
        out.mkdir()
        other, _ = train(trestle, setup, out, "--ckpt-step", 10, tp=tp, dp=dp, iters=12, load=tmp_path / "part")
        assert sorted(other) == [11, 12]
        assert close(other[11], full[11]), f"tp{tp}/dp{dp} from the tp2/dp2 checkpoint: {other[11]} vs {full[11]}"
    # --finetune: the weights of iteration 10, everything else from zero (iteration, data position, optimizer).
    out = tmp_path / "finetune"
    out.mkdir()
    tuned, _ = train(trestle, setup, out, "--finetune", "--ckpt-step", 10, iters=4, load=tmp_path / "part")
    assert sorted(tuned) == [1, 2, 3, 4]
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert first["consumed_samples"] == GBS
    assert tuned[1] < expected[1] - 0.05, "the fine-tuned run did not start from the trained weights"


class _Tokenizer:
    def __init__(self):
        import collections
        self.unique_identifiers = collections.OrderedDict([("class", "TestTokenizer")])
        self.vocab_size = LLAMA["vocab_size"]
        self.eod = 0


def test_override_ckpt_iteration_replays_the_data_from_that_iteration(setup, trestle, tmp_path):
    """--override-ckpt-iteration N (Megatron-LM's): the checkpoint saved at iteration 4 resumes as iteration N, its
    consumed samples N x global batch size (the data replays from iteration N + 1), while the optimizer and the
    learning-rate scheduler carry on from their saved state, as Megatron's load does. --no-save-rng saves no generator
    state. With --finetune the flag is refused, as Megatron refuses it."""
    def records(log):
        return {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines()) if "validation" not in r}
    first = tmp_path / "first"
    first.mkdir()
    trestle.run(*train_args(setup, first, "--save", first / "save", "--save-interval", 4, "--no-save-rng", iters=8))
    manifest = json.loads((first / "save" / "iter_0000004" / "manifest.json").read_text())
    assert manifest["training"]["ranks"] == [{}], manifest["training"]["ranks"]
    again = tmp_path / "again"
    again.mkdir()
    result = trestle.run_raw(*train_args(setup, again, "--ckpt-step", 4, "--override-ckpt-iteration", 2, iters=8,
                                         load=first / "save"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming as iteration 2 (--override-ckpt-iteration)" in result.stdout
    # Megatron-LM stops at a checkpoint without RNG state unless given --no-load-rng; Trestle seeds and says so.
    assert "note: the checkpoint holds no RNG state for this layout's ranks (saved with --no-save-rng?): the " \
        "generators start from --seed 1234" in result.stdout, result.stdout[-3000:]
    full, replayed = records(first / "log.jsonl"), records(again / "log.jsonl")
    assert sorted(replayed) == list(range(3, 9))
    for i, r in replayed.items():
        assert r["consumed_samples"] == i * GBS, (i, r)
        if i + 2 <= 8:  # the scheduler two steps ahead of the iteration
            assert r["learning_rate"] == full[i + 2]["learning_rate"], (i, r["learning_rate"], full[i + 2])
    assert replayed[3]["lm_loss"] != full[3]["lm_loss"] and replayed[3]["lm_loss"] != full[5]["lm_loss"]
    refused = trestle.run_raw(*train_args(setup, again, "--finetune", "--override-ckpt-iteration", 2, iters=8,
                                          load=first / "save"), timeout=120)
    assert refused.returncode == 2 and "cannot override checkpoint iteration together with --finetune" in \
        refused.stderr, refused.stderr[-2000:]


def test_iterations_to_skip_pass_over_their_batches(setup, trestle, tmp_path):
    """--iterations-to-skip 3 5 (1-indexed, as Megatron-LM reads them since core_v0.17: iterations 3 and 5): those
    iterations read their global batch and nothing else happens (no step, no scheduler step, no log line), so the later iterations train on their own batches with the schedule one or two
    steps behind. transformers trained that way gives the losses (at dp 2, the batches split over the ranks)."""
    iters = 8
    samples = megatron_samples(setup, 0, iters * GBS, tmp_path)
    common = dict(iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=3,
                  weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    expected = train_transformers(setup / "hf", samples, skipped_iterations={3, 5}, **common)
    every = train_transformers(setup / "hf", samples, **common)
    assert not close(expected[6], every[6]), "skipping changes nothing: nothing tested"
    losses, _ = train(trestle, setup, tmp_path, "--iterations-to-skip", 3, 5, iters=iters, dp=2)
    assert sorted(losses) == [1, 2, 4, 6, 7, 8]
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"--iterations-to-skip: losses differ from transformers' at {bad}"
    # Each later line names the samples passed over so far (Megatron's skipped_train_samples), saved and resumed.
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {r["iteration"]: r.get("skipped_samples", 0) for r in records} == \
        {1: 0, 2: 0, 4: GBS, 6: 2 * GBS, 7: 2 * GBS, 8: 2 * GBS}, records
    for value in (-1, 0):
        refused = trestle.run_raw(*train_args(setup, tmp_path, "--iterations-to-skip", value, iters=iters), timeout=120)
        assert refused.returncode == 2 and "iterations are counted from 1" in refused.stderr, refused.stderr
    # A list flag given again replaces the earlier one, as argparse's nargs (a script's appended override).
    again = tmp_path / "again"
    again.mkdir()
    losses, _ = train(trestle, setup, again, "--iterations-to-skip", 6, "--iterations-to-skip", 3, 5, iters=iters, dp=2)
    assert sorted(losses) == [1, 2, 4, 6, 7, 8]


def test_megatron_argument_defaults_and_refusals(setup, trestle, tmp_path):
    """Megatron's validate_args: without --global-batch-size it is micro-batch x data-parallel size (2 x 2 here), and
    an incremented weight decay (--weight-decay-incr-style linear or cosine) needs both its ends, a constant one
    neither."""
    args = train_args(setup, tmp_path, iters=4, dp=2)
    at = args.index("--global-batch-size")
    del args[at:at + 2]
    trestle.run(*args, timeout=300)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["global_batch_size"] for r in records] == [2 * MBS] * 4, records
    for style in ("linear", "cosine"):
        refused = trestle.run_raw(*train_args(setup, tmp_path, "--weight-decay-incr-style", style,
                                              "--start-weight-decay", "0.01", iters=1), timeout=120)
        assert refused.returncode == 2 and "needs --start-weight-decay and --end-weight-decay" in refused.stderr, \
            refused.stderr[-2000:]
    # ... and the constant style (the default) takes neither end: they used to replace --weight-decay silently.
    refused = trestle.run_raw(*train_args(setup, tmp_path, "--start-weight-decay", "0.5", "--end-weight-decay", "0.5",
                                          iters=1), timeout=120)
    assert refused.returncode == 2 and "need --weight-decay-incr-style linear or cosine" in refused.stderr, \
        refused.stderr[-2000:]


def test_bad_flag_values_are_usage_errors_found_before_training(setup, trestle, trestle_bin, tmp_path):
    """Values torch's Adam, Megatron's batch calculator and its OptimizerParamScheduler refuse exit 2 before anything
    is read: Adam's betas and epsilon out of range trained (beta1 1.5 to the end, beta2 1.0 to a NaN), and the batch
    and schedule checks ran after the model was built (exit 1; a negative warmup "must be shorter than the decay").
    (A warmup as long as the decay is checked with the length the run trains, when it starts.)"""
    def replaced(args, flag, value):
        args = list(args)
        args[args.index(flag) + 1] = value
        return args

    base = train_args(setup, tmp_path, iters=4)
    cases = [(base + ["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), not 1.5"),
             (replaced(base, "--adam-beta2", "1.0"), "--adam-beta2 must be in [0, 1), not 1"),
             (base + ["--adam-eps", "-1e-08"], "--adam-eps must be 0 or more, not -1e-08"),
             (replaced(base, "--global-batch-size", GBS + 1), f"global batch size ({GBS + 1}) is not divisible by"),
             (replaced(base, "--lr-warmup-iters", -1), "must not be negative (--lr-warmup-iters"),
             (replaced(base, "--min-lr", "1e-2"), "--lr must be at least --min-lr")]
    for args, message in cases:
        refused = trestle.run_raw(*args, timeout=120)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr[-2000:])
        assert not (tmp_path / "log.jsonl").exists()
    # --nproc-per-node in a process torchrun or srun started as one of several ran a whole job per process.
    for env in ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
                {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77",
                 "MASTER_ADDR": "127.0.0.1"}):
        nested = subprocess.run([str(trestle_bin), *map(str, base)], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, **env))
        assert nested.returncode == 2 and "--nproc-per-node starts a job of its own" in nested.stderr, nested.stderr
    zero = trestle.run_raw(*replaced(base, "--nproc-per-node", 0), timeout=60)
    assert zero.returncode == 2 and "--nproc-per-node must be 1 to 1024" in zero.stderr, zero.stderr


def test_log_lines_fall_where_megatrons_do(setup, trestle, reference, tmp_path):
    """Megatron's training_log: a line after the run's first iteration and at every --log-interval-th one (none at a
    last iteration between them), the interval's line the mean over all of it (the first line does not cut it), and
    the time stamped to the microsecond; the skipped-samples field only once samples were passed over. The JSON
    records each cover the iterations since the previous record."""
    _, expected = reference
    result = trestle.run_raw(*train_args(setup, tmp_path, "--log-interval", 6), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 6, 12, 18], records  # none at iteration 20

    def mean(first, last):
        return sum(expected[i] for i in range(first, last + 1)) / (last - first + 1)
    own = {1: expected[1], 6: mean(2, 6), 12: mean(7, 12), 18: mean(13, 18)}
    assert all(close(r["lm_loss"], own[r["iteration"]]) for r in records), (records, own)
    lines = [line for line in result.stdout.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 4 and all(re.search(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration ", line)
                                   for line in lines), lines
    printed = [float(re.search(r"\| lm loss: ([0-9.E+-]+) \|", line)[1]) for line in lines]
    assert all(close(p, m) for p, m in zip(printed, [expected[1], mean(1, 6), mean(7, 12), mean(13, 18)])), printed
    assert not any("skipped samples" in line for line in lines), lines
    # --log-interval 1: Megatron's first line resets nothing, so its second line is the mean of iterations 1 and 2;
    # the JSON records stay each iteration's own.
    once = tmp_path / "once"
    once.mkdir()
    result = trestle.run_raw(*train_args(setup, once, "--log-interval", 1, iters=4), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [float(m) for m in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", result.stdout)]
    own = [json.loads(line)["lm_loss"] for line in (once / "log.jsonl").read_text().splitlines()]
    assert len(printed) == 4 and len(own) == 4 and close(own[0], expected[1]), (printed, own)
    assert own[0] != own[1], own
    assert close(printed[0], own[0]) and close(printed[2], own[2]) and close(printed[3], own[3]), (printed, own)
    assert close(printed[1], (own[0] + own[1]) / 2, rel=2e-6), (printed, own)


def test_skip_train_evaluates_the_validation_and_test_splits(setup, trestle, tmp_path):
    """--skip-train (Megatron's): nothing trains or saves; the loaded model's losses on the validation and the test
    split (their first --eval-iters global batches, as megatron-core's GPTDataset cuts --split 90,5,5) are logged as
    Megatron logs them, and equal transformers' on the same samples. A run that trains ends with both too."""
    args = train_args(setup, tmp_path, "--skip-train", "--eval-iters", 2, "--save", tmp_path / "save",
                      "--tensorboard-dir", tmp_path / "tb")
    args[args.index("--split") + 1] = "90,5,5"
    result = trestle.run_raw(*args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping training (--skip-train)" in result.stdout
    # (Megatron's --skip-train evaluations write nothing to TensorBoard)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["scalars"] == [], events.Tags()
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["validation"] for r in records] == ["iteration 0 on validation set", "iteration 0 on test set"], records
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())
    for record, split in zip(records, (1, 2), strict=True):
        expected = hf_loss(setup / "hf", megatron_samples(setup, split, 2 * GBS, tmp_path, splits="90,5,5"))
        assert close(expected, record["lm_loss"]), (split, expected, record["lm_loss"])
    assert " validation loss at iteration 0 on test set | lm loss value: " in result.stdout
    # Megatron-LM 0.19's evaluation batches (4 samples in micro-batches of 1), and --skip-train's one evaluation's
    # worth of validation samples (megatron-core 0.19 sizes the split so), whatever --eval-interval says.
    (tmp_path / "eval").mkdir()
    args = train_args(setup, tmp_path / "eval", "--skip-train", "--eval-iters", 2, "--eval-global-batch-size", 4,
                      "--eval-micro-batch-size", 1, "--eval-interval", 1)
    args[args.index("--split") + 1] = "90,5,5"
    trestle.run(*args, timeout=300)
    records = [json.loads(line) for line in (tmp_path / "eval" / "log.jsonl").read_text().splitlines()]
    for record, split in zip(records, (1, 2), strict=True):
        samples = megatron_samples(setup, split, 8, tmp_path, splits="90,5,5", sizes=[ITERS * GBS, 8, 8])
        assert close(hf_loss(setup / "hf", samples), record["lm_loss"]), (split, record)
    refused = trestle.run_raw(*train_args(setup, tmp_path, "--eval-global-batch-size", 5), timeout=120)
    assert refused.returncode == 2 and "eval_global_batch_size (5) must be divisible by eval_micro_batch_size (2)" in \
        refused.stderr, refused.stderr[-2000:]


def test_rampup_batch_size_grows_the_global_batch_as_megatron_core(setup, trestle, tmp_path):
    """--rampup-batch-size 4 2 24 with --global-batch-size 8 and --train-samples 80: each iteration's global batch is
    what megatron-core's RampupBatchsizeNumMicroBatchesCalculator gives for the samples consumed before it, the
    iterations are Megatron-LM's update_train_iters count (the ramp-up's, then whole batches), the learning-rate
    scheduler steps by each batch, and transformers trained on those batches gives the losses (at dp 2). Megatron's
    refusals: an interval the increment does not divide, and a ramp-up with --train-iters."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    start, increment, ramp, final, train_samples = 4, 2, 24, 8, 80
    calculator = RampupBatchsizeNumMicroBatchesCalculator(final, 1, 2, False, 0, start, increment, ramp)
    sizes, consumed = [], 0
    while consumed <= ramp and consumed <= train_samples:  # Megatron-LM's update_train_iters
        calculator.update(consumed, consistency_check=False)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    sizes += [final] * ((train_samples - consumed) // final)
    assert sizes[:6] == [4, 4, 4, 6, 6, 8] and len(sizes) == 12, sizes
    samples = megatron_samples(setup, 0, sum(sizes), tmp_path, train_samples=train_samples)
    expected = train_transformers(setup / "hf", samples, iters=len(sizes), global_batch=final, micro_batch=1, lr=3e-3,
                                  min_lr=3e-4, warmup_iters=0, warmup_steps=24, decay_steps=train_samples,
                                  wd_incr_steps=train_samples, weight_decay=0.1, clip_grad=1.0, beta2=0.95,
                                  batch_sizes=sizes)

    def args(*extra, out=tmp_path):
        words = train_args(setup, out, *extra, dp=2)
        at = words.index("--train-iters")
        words[at:at + 2] = ["--train-samples", train_samples]
        at = words.index("--lr-warmup-iters")
        words[at:at + 2] = ["--lr-warmup-samples", 24]
        words[words.index("--micro-batch-size") + 1] = 1
        return words
    trestle.run(*args("--rampup-batch-size", start, increment, ramp), timeout=300)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["global_batch_size"] for r in records] == sizes
    assert [r["consumed_samples"] for r in records] == [sum(sizes[:i + 1]) for i in range(len(sizes))]
    losses = {r["iteration"]: r["lm_loss"] for r in records}
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"--rampup-batch-size: losses differ from transformers' at {bad}"
    # Saved mid-ramp (after iteration 4: 18 samples, the batch 6) and resumed: the rest as the uninterrupted run.
    for name, extra in (("first", ("--save", tmp_path / "save", "--save-interval", 4, "--exit-interval", 4)),
                        ("resumed", ())):
        (tmp_path / name).mkdir()
        words = args("--rampup-batch-size", start, increment, ramp, *extra, out=tmp_path / name)
        if name == "resumed":
            words[words.index("--load") + 1] = tmp_path / "save"
        trestle.run(*words, timeout=300)
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["global_batch_size"], r["lm_loss"]) for r in resumed] == \
        [(r["iteration"], r["global_batch_size"], r["lm_loss"]) for r in records[4:]]
    # A ramp-up reaching a batch the interleaved pipeline schedule refuses (3 micro-batches in groups of pp 2) is
    # refused before the first step (megatron-core's schedule raises when the ramp-up gets there, 6 iterations in).
    early = tmp_path / "early"
    early.mkdir()
    words = train_args(setup, early, LAYOUT, "E|t|t|L", "--rampup-batch-size", 2, 1, 24, pp=2)
    words[words.index("--train-iters"):words.index("--train-iters") + 2] = ["--train-samples", 40]
    words[words.index("--lr-warmup-iters"):words.index("--lr-warmup-iters") + 2] = ["--lr-warmup-samples", 8]
    words[words.index("--micro-batch-size") + 1] = 1
    words[words.index("--global-batch-size") + 1] = 4
    refused = trestle.run_raw(*words, timeout=120)
    assert refused.returncode == 1 and "--rampup-batch-size's global batch 3 (at 12 consumed samples): pipeline " \
        "schedule: 3 microbatches in groups of 2 leave a last group of 1, fewer than pp (2)" in refused.stderr, \
        refused.stderr[-2000:]
    assert not (early / "log.jsonl").exists()
    refused = trestle.run_raw(*args("--rampup-batch-size", 3, 2, 24), timeout=120)
    assert refused.returncode == 2 and "expected global batch size interval (5) to be divisible by global batch " \
        "size increment (2)" in refused.stderr, refused.stderr[-2000:]
    refused = trestle.run_raw(*train_args(setup, tmp_path, "--rampup-batch-size", 4, 2, 24), timeout=120)
    assert refused.returncode == 2 and "expected no batch-size rampup for iteration-based training" in \
        refused.stderr, refused.stderr[-2000:]


def test_decrease_batch_size_if_needed_runs_megatron_cores_running_batch(setup, trestle, tmp_path):
    """Megatron-LM's --decrease-batch-size-if-needed (refused as an unknown flag): a global batch that does not divide
    into micro-batches of every data-parallel rank runs as megatron-core's calculators' running batch, constant or
    ramped up; consumed samples count the running batches. Without it the batch is refused."""
    from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator,
                                                           RampupBatchsizeNumMicroBatchesCalculator)
    constant = ConstantNumMicroBatchesCalculator(7, 2, 1, True, 0).get_current_running_global_batch_size()
    words = train_args(setup, tmp_path, iters=4)
    words[words.index("--global-batch-size") + 1] = 7
    refused = trestle.run_raw(*words, timeout=120)
    assert refused.returncode == 2 and "global batch size (7) is not divisible" in refused.stderr, refused.stderr
    trestle.run(*words, "--decrease-batch-size-if-needed", timeout=300)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in records] == \
        [(constant, i * constant) for i in range(1, 5)], records

    start, increment, ramp, final, train_samples = 3, 2, 20, 7, 48
    calculator = RampupBatchsizeNumMicroBatchesCalculator(final, 1, 2, True, 0, start, increment, ramp)
    sizes, consumed = [], 0
    while consumed <= ramp and consumed <= train_samples:  # Megatron-LM's update_train_iters: configured sizes
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        sizes.append(calculator.get_current_global_batch_size())
    iterations = len(sizes) + (train_samples - consumed) // final
    running, consumed = [], 0
    for _ in range(iterations):  # the training loop: it consumes the running batches
        calculator.update(consumed, consistency_check=False)
        running.append(calculator.get_current_running_global_batch_size())
        consumed += running[-1]
    out = tmp_path / "ramp"
    out.mkdir()
    words = train_args(setup, out, dp=2)
    words[words.index("--train-iters"):words.index("--train-iters") + 2] = ["--train-samples", train_samples]
    words[words.index("--lr-warmup-iters"):words.index("--lr-warmup-iters") + 2] = ["--lr-warmup-samples", 8]
    words[words.index("--micro-batch-size") + 1] = 1
    words[words.index("--global-batch-size") + 1] = final
    trestle.run(*words, "--rampup-batch-size", start, increment, ramp, "--decrease-batch-size-if-needed", timeout=300)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["global_batch_size"] for r in records] == running and len(set(running)) > 1, (records, running)
    assert [r["consumed_samples"] for r in records] == [sum(running[:i + 1]) for i in range(len(running))]


# megatron-core 0.19's step schedule (the venv's 0.16 has none), from the wheel scripts/setup unzips: the global batch
# its calculator gives before each iteration, iterating as Megatron-LM 0.19's update_train_iters does, as JSON.
STEP_SCHEDULE_SIZES = textwrap.dedent("""
    import json, sys, typing
    import typing_extensions
    typing.override = typing_extensions.override  # megatron-core 0.19 wants Python 3.12's
    sys.path.insert(0, sys.argv[1])
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator
    import megatron.core
    assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
    schedule, seq, micro, dp, train_samples = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), \\
        int(sys.argv[6])
    calculator = StepBatchsizeNumMicroBatchesCalculator(micro, dp, False, 0, schedule, seq)
    sizes, consumed = [], 0
    while consumed < train_samples:
        calculator.update(consumed, consistency_check=True)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    print(json.dumps(sizes))
""")


def test_step_batch_size_schedule_sets_the_global_batch_as_megatron_core_019(setup, trestle, tmp_path):
    """--step-batch-size-schedule "0:2 256:4 768:8" (thresholds in tokens, batches in samples; Megatron-LM 0.19's) with
    --train-samples 64: each iteration's global batch is what megatron-core 0.19's StepBatchsizeNumMicroBatchesCalculator
    gives (2 samples of 32 tokens, 4 from the 8th sample on, 8 from the 24th), the iterations are Megatron-LM 0.19's count, and transformers trained on those batches gives
    the losses (at dp 2). --global-batch-size beside it is refused, as Megatron-LM 0.19 refuses it."""
    schedule, train_samples = "0:2 256:4 768:8", 64
    script = tmp_path / "step_sizes.py"
    script.write_text(STEP_SCHEDULE_SIZES)
    wheels = pathlib.Path(os.environ.get("TRESTLE_MEGATRON_BRIDGE", "~/.cache/trestle/megatron-bridge")).expanduser()
    run = subprocess.run([sys.executable, script, wheels / "megatron_core", schedule, str(SEQ), "1", "2",
                          str(train_samples)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"megatron-core 0.19's calculator failed:\n{run.stderr[-3000:]}"
    sizes = json.loads(run.stdout.strip().splitlines()[-1])
    assert sizes == [2] * 4 + [4] * 4 + [8] * 5, sizes
    samples = megatron_samples(setup, 0, sum(sizes), tmp_path, train_samples=train_samples)
    expected = train_transformers(setup / "hf", samples, iters=len(sizes), global_batch=2, micro_batch=1, lr=3e-3,
                                  min_lr=3e-4, warmup_iters=0, warmup_steps=16, decay_steps=train_samples,
                                  wd_incr_steps=train_samples, weight_decay=0.1, clip_grad=1.0, beta2=0.95,
                                  batch_sizes=sizes)
    words = train_args(setup, tmp_path, "--step-batch-size-schedule", schedule, dp=2)
    at = words.index("--train-iters")
    words[at:at + 2] = ["--train-samples", train_samples]
    at = words.index("--lr-warmup-iters")
    words[at:at + 2] = ["--lr-warmup-samples", 16]
    words[words.index("--micro-batch-size") + 1] = 1
    at = words.index("--global-batch-size")
    refused = trestle.run_raw(*words, timeout=120)
    assert refused.returncode == 2 and "Cannot specify both --step-batch-size-schedule and --global-batch-size" in \
        refused.stderr, refused.stderr[-2000:]
    del words[at:at + 2]
    trestle.run(*words, timeout=300)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["global_batch_size"] for r in records] == sizes
    losses = {r["iteration"]: r["lm_loss"] for r in records}
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"--step-batch-size-schedule: losses differ from transformers' at {bad}"


def test_start_eval_at_iter_evaluates_from_that_iteration(setup, trestle, tmp_path):
    """--start-eval-at-iter 4 (Megatron-LM 0.19's) with --eval-interval 2 over 6 iterations: evaluation at iteration 4
    and at the end, not at 2."""
    prefixes = {}
    for name, extra in (("from-4", ("--start-eval-at-iter", 4)), ("every", ())):
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, "--eval-interval", 2, "--eval-iters", 1, *extra, iters=6)
        trestle.run(*args, timeout=300)
        prefixes[name] = [r["validation"] for r in map(json.loads, (tmp_path / name / "log.jsonl").read_text()
                                                       .splitlines()) if "validation" in r]
    assert prefixes["every"] == ["iteration 2", "iteration 4", "iteration 6", "iteration 6 on validation set"], \
        prefixes
    assert prefixes["from-4"] == ["iteration 4", "iteration 6", "iteration 6 on validation set"], prefixes


def test_each_validation_reads_the_next_samples_of_the_split_as_megatron_does(setup, trestle, tmp_path):
    """Megatron reads the validation split through one iterator: each periodic evaluation (the last iteration's too)
    takes the next eval-iters global batches, the run's final one those after them, and a resumed run goes on where
    the checkpoint's evaluations left it (args.consumed_valid_samples; for a checkpoint without it, the evaluation
    points its iterations passed). At --lr 0 (the model unchanged) every evaluation is transformers' loss on its
    batches of megatron-core's validation split, sized (6 // 2 + 1) x 1 x GBS."""
    lr0 = ("--lr", "0", "--min-lr", "0", "--eval-interval", 2, "--eval-iters", 1)
    (tmp_path / "whole").mkdir()
    _, valid = train(trestle, setup, tmp_path / "whole", *lr0, iters=6)
    samples = megatron_samples(setup, 1, 4 * GBS, tmp_path, sizes=[6 * GBS, 4 * GBS, GBS])
    expected = [hf_loss(setup / "hf", samples[i * GBS:(i + 1) * GBS]) for i in range(4)]
    assert len(valid) == 4 and all(close(v, e) for v, e in zip(valid, expected)), (valid, expected)
    assert len(set(expected)) == 4, "the evaluations' batches give equal losses: the test cannot tell them apart"
    # Stopped at iteration 4 (saved after its evaluation), resumed to 6: the same evaluations, the same losses; so
    # too from that checkpoint with its consumed_valid_samples taken out (Megatron's rule: 4 // 2 evaluations).
    (tmp_path / "first").mkdir()
    _, first = train(trestle, setup, tmp_path / "first", *lr0, "--save", tmp_path / "save", "--save-interval", 4,
                     "--exit-interval", 4, iters=6)
    assert first == valid[:2], (first, valid)
    manifest = next((tmp_path / "save").glob("iter_*/manifest.json"))
    assert json.loads(manifest.read_text())["training"]["consumed_valid_samples"] == 2 * GBS
    # Converted to torch_dist, the data position is in Megatron's args (where Megatron-LM resumes from), and read
    # back from there.
    trestle.run("convert", "--from", "trestle", tmp_path / "save", "--to", "megatron-dist", tmp_path / "dist",
                "--quiet")
    args = torch.load(next((tmp_path / "dist").glob("iter_*/common.pt")), weights_only=False)["args"]
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (4 * GBS, 2 * GBS), vars(args)
    trestle.run("convert", "--from", "megatron-dist", tmp_path / "dist", "--to", "trestle", tmp_path / "back",
                "--hf-config", setup / "hf" / "config.json", "--quiet")
    training = json.loads(next((tmp_path / "back").glob("iter_*/manifest.json")).read_text())["training"]
    assert (training["consumed_train_samples"], training["consumed_valid_samples"]) == (4 * GBS, 2 * GBS), training
    # Megatron-LM's --use-checkpoint-args trains with the dropout in the checkpoint's args: a note says Trestle does not
    common_path = next((tmp_path / "dist").glob("iter_*/common.pt"))
    common = torch.load(common_path, weights_only=False)
    assert common["args"].seq_length == SEQ, vars(common["args"])  # (the trainer's run's, which the save records)
    common["args"].hidden_dropout, common["args"].attention_dropout = 0.1, 0.0
    torch.save(common, common_path)
    # Under --use-checkpoint-args a left-out --seq-length is the checkpoint's (torch_dist: its args'; a Trestle save
    # from before the trainer recorded it: the --seq-length its command line gave).
    for name, load, extra in (("resumed", "save", ()),
                              ("torch_dist", "dist", ("--hf-config", setup / "hf", "--use-checkpoint-args")),
                              ("legacy", "save", ("--use-checkpoint-args",))):
        if name == "legacy":
            record = json.loads(manifest.read_text())
            record.pop("manifest_xxh3_64", None)  # optional; the edit would not match it
            del record["training"]["consumed_valid_samples"]
            assert record["training"].pop("megatron_args") == {"seq_length": SEQ}, record["training"]
            manifest.write_text(json.dumps(record))
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, *lr0, *extra, iters=6, load=tmp_path / load)
        if "--use-checkpoint-args" in extra:
            del args[args.index("--seq-length"):args.index("--seq-length") + 2]
        out = trestle.run(*args, timeout=300)
        assert ("the sequence length is the checkpoint's run's, 32" in out) == (name != "resumed"), out[-3000:]
        _, rest = read_losses(tmp_path / name / "log.jsonl")
        assert rest == valid[2:], (name, rest, valid)
        dropout_note = f"note: --use-checkpoint-args: {tmp_path / 'dist'}"
        assert (dropout_note in out) == (name == "torch_dist"), out[-3000:]
        if name == "torch_dist":
            assert "'s args set hidden_dropout 0.1, which Megatron-LM trains with; Trestle trains without dropout" \
                in out, out[-3000:]
            # (the notes name the checkpoint given, not the converted copy the run loads)
            assert "the model flags Megatron sets from the checkpoint are " + str(tmp_path / "dist") in out, out[-3000:]


def test_a_changed_schedule_on_resume_is_named_and_chosen_as_megatron_flags_say(setup, trestle, tmp_path, reference):
    """Resuming with another --train-iters (so other decay steps) and --lr: a note names both values of each, and this
    run's schedule trains, as with Megatron's --override-opt_param-scheduler (accepted); with
    --use-checkpoint-opt_param-scheduler the checkpoint's does (as if --train-iters were still 20)."""
    out, _ = reference
    runs = {}
    for flag in ("", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        (tmp_path / f"run{flag}").mkdir()
        args = train_args(setup, tmp_path / f"run{flag}", "--lr", "2e-3", *([flag] if flag else []), iters=ITERS + 4,
                          load=out / "save")
        result = trestle.run_raw(*args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "note: the learning-rate schedule differs from the checkpoint's (learning rate 0.002 here, " \
               "0.0030000000000000001 in the checkpoint; decay steps (samples) 192 here, 160 in the checkpoint" \
               in result.stdout, result.stdout[-3000:]
        runs[flag], _ = read_losses(tmp_path / f"run{flag}" / "log.jsonl")
        assert sorted(runs[flag]) == list(range(ITERS + 1, ITERS + 5))
    assert runs[""] == runs["--override-opt_param-scheduler"]
    assert runs[""] != runs["--use-checkpoint-opt_param-scheduler"]
    # Older Megatron named the scheduler's step count num_iters (a converted checkpoint keeps its names): restored the
    # same way, not taken for a schedule at step 0.
    old = tmp_path / "num_iters"
    shutil.copytree(out / "save", old / "save")
    manifest_path = next((old / "save").glob("iter_*")) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.pop("manifest_xxh3_64", None)  # optional; the edit would not match it
    scheduler = manifest["training"]["scheduler"]
    scheduler["num_iters"] = scheduler.pop("num_steps")
    manifest_path.write_text(json.dumps(manifest))
    losses, _ = train(trestle, setup, old, "--lr", "2e-3", "--use-checkpoint-opt_param-scheduler", iters=ITERS + 4,
                      load=old / "save")
    assert losses == runs["--use-checkpoint-opt_param-scheduler"]
    # A scheduler state that is not one (a string, a list) resumed with this run's schedule, without a word.
    for bad in ("x", [1, 2]):
        manifest["training"]["scheduler"] = bad
        manifest_path.write_text(json.dumps(manifest))
        result = trestle.run_raw(*train_args(setup, tmp_path, "--use-checkpoint-opt_param-scheduler",
                                             load=old / "save"), timeout=60)
        assert result.returncode == 1, (bad, result.returncode, result.stderr[-2000:])
        assert f"training state: scheduler is {json.dumps(bad, separators=(',', ':'))}, expected an object" \
            in result.stderr, result.stderr
    # Counts that are not whole numbers (1.5 was read as 1) or past int64 (wrapped around) are refused.
    manifest["training"]["scheduler"] = scheduler
    for bad in (1.5, 2 ** 63, "8"):
        manifest["training"]["consumed_train_samples"] = bad
        manifest_path.write_text(json.dumps(manifest))
        result = trestle.run_raw(*train_args(setup, tmp_path, load=old / "save"), timeout=60)
        assert result.returncode == 1, (bad, result.returncode, result.stderr[-2000:])
        assert f"training state: consumed_train_samples is {json.dumps(bad)}, expected a count (a whole number, 0 " \
            "or more)" in result.stderr, result.stderr
    result = trestle.run_raw(*train_args(setup, tmp_path, "--override-opt_param-scheduler",
                                         "--use-checkpoint-opt_param-scheduler", load=out / "save"), timeout=60)
    assert result.returncode != 0 and "exclude each other" in result.stderr, result.stderr[-2000:]


def test_an_odd_sequence_length_trains_as_transformers(setup, trestle, tmp_path):
    """Megatron splits sequences into 2 x cp chunks only under context parallelism: seq 17 trains at tp 2 and dp 2."""
    seq, iters = 17, 8
    expected = train_transformers(setup / "hf", megatron_samples(setup, 0, iters * GBS, tmp_path, seq=seq),
                                  iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4,
                                  warmup_iters=3, weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    for tp, dp in ((2, 1), (1, 2)):
        (tmp_path / f"tp{tp}dp{dp}").mkdir()
        losses, _ = train(trestle, setup, tmp_path / f"tp{tp}dp{dp}", tp=tp, dp=dp, iters=iters, seq=seq)
        assert sorted(losses) == sorted(expected)
        bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
        assert not bad, f"seq {seq} at tp{tp}/dp{dp}: losses differ from transformers' at {bad}"


# A Megatron-LM pretraining script's flags for the test Llama: its model description, and choices of kernels,
# overlaps, backends and tokenizer that do not change what is computed.
MEGATRON_SCRIPT_FLAGS = [
    "--use-mcore-models", "--transformer-impl", "local", "--num-layers", 2, "--hidden-size", 64, "--ffn-hidden-size",
    96, "--num-attention-heads", 4, "--group-query-attention", "--num-query-groups", 2, "--kv-channels", 16,
    "--max-position-embeddings", 256, "--position-embedding-type", "rope", "--use-rotary-position-embeddings",
    "--rotary-base", 10000, "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--vocab-size", 4096, "--attention-dropout",
    "0.0", "--hidden-dropout", "0.0", "--make-vocab-size-divisible-by", 64, "--no-masked-softmax-fusion",
    "--attention-backend", "auto", "--overlap-grad-reduce", "--distributed-backend", "gloo", "--tokenizer-type",
    "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json", "--num-workers", 2, "--log-throughput",
    "--no-create-attention-mask-in-dataloader", "--moe-token-dispatcher-type", "alltoall", "--reset-position-ids"]


def test_a_megatron_scripts_flags_run_unchanged_and_its_model_flags_are_checked(setup, trestle, reference, tmp_path):
    """A Megatron-LM script's flags run as they are: the model flags describe the loaded Llama and the flags that
    choose kernels, overlaps, backends or a tokenizer change nothing (the losses are the plain run's, bit for bit) and
    are named in one note. A model flag that does not describe the model is refused naming both values; dropout, a
    choice Megatron does not offer and a vocabulary padding below 1 are usage errors."""
    _, expected = reference
    (tmp_path / "script").mkdir()
    result = trestle.run_raw(*train_args(setup, tmp_path / "script", *MEGATRON_SCRIPT_FLAGS), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses, _ = read_losses(tmp_path / "script" / "log.jsonl")
    assert losses == expected
    notes = [line for line in result.stdout.splitlines() if "Megatron-LM flags without effect here" in line]
    assert len(notes) == 1 and "--use-mcore-models, --transformer-impl local, --attention-backend auto" in notes[0] \
        and "--num-workers 2" in notes[0] and "--reset-position-ids" in notes[0] and "--hidden-size" not in notes[0] \
        and "--no-create-attention-mask-in-dataloader" in notes[0], \
        notes
    assert "Megatron's defaults would build another model" not in result.stdout  # the script describes the model
    assert "dropout" not in result.stdout
    lines = [line for line in result.stdout.splitlines() if "consumed samples:" in line]
    assert lines and all(re.search(r"elapsed time per iteration \(ms\): [0-9.]+ \| throughput per GPU "
                                   r"\(TFLOP/s/GPU\): [0-9.]+ \| learning rate:", line) for line in lines), lines
    # A script that leaves out flags whose Megatron defaults describe another model (GPT-3's example: LayerNorm, learned
    # positions, GELU, tied output, biases, no GQA; dropout 0.1) is told so, the model trained as it is.
    (tmp_path / "gpt3").mkdir()
    out = trestle.run(*train_args(setup, tmp_path / "gpt3", "--num-layers", 2, "--hidden-size", 64, iters=4),
                      timeout=120)
    note = [line for line in out.splitlines() if "Megatron's defaults would build another model" in line]
    assert len(note) == 1 and all(flag in note[0] for flag in (
        "--normalization", "--position-embedding-type", "--swiglu", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--group-query-attention --num-query-groups 2")), note
    # and the numbers Megatron-LM's validate_args fills in: 4 h for the MLP (not the model's 96). With --swiglu, two
    # thirds of it rounded to 64 (128); a RoPE base and norm epsilon other than the defaults are named too.
    assert "--ffn-hidden-size 96 (Megatron's default here: 256)" in note[0], note
    (tmp_path / "swiglu").mkdir()
    out = trestle.run(*train_args(setup, tmp_path / "swiglu", "--num-layers", 2, "--hidden-size", 64, "--swiglu",
                                  iters=4), timeout=120)
    assert "--ffn-hidden-size 96 (Megatron's default here: 128)" in out and "--rotary-base" not in out, out
    assert "default --hidden-dropout and --attention-dropout are 0.1" in out
    for flags, code, message in [
            (["--hidden-size", 128], 1, "--hidden-size 128 differs from the model's 64"),
            (["--ffn-hidden-size", 64], 1, "--ffn-hidden-size 64 differs from the model's 96"),
            (["--group-query-attention", "--num-query-groups", 4], 1,
             "--group-query-attention / --num-query-groups give 4 key/value heads; the model has 2"),
            (["--num-query-groups", 2], 1, "give 4 key/value heads; the model has 2"),  # read only with GQA
            (["--rotary-base", 500000], 1, "--rotary-base 500000 differs from the model's 10000"),
            (["--qk-layernorm"], 1, "--qk-layernorm: the model does not norm its queries and keys"),
            (["--normalization", "LayerNorm"], 1, "--normalization LayerNorm differs from the model's RMSNorm"),
            (["--attention-dropout", "0.1"], 2, "--attention-dropout 0.1: Trestle trains without dropout"),
            (["--transformer-impl", "te"], 2, "--transformer-impl te: not one of local, transformer_engine"),
            (["--make-vocab-size-divisible-by", 0], 2,
             "--make-vocab-size-divisible-by must be an integer from 1 to 1073741824, not 0"),
            (["--max-position-embeddings", 16], 2, "--max-position-embeddings 16 is less than --seq-length 32"),
            # the sizes Megatron's --use-checkpoint-args fills in only where a script leaves them out
            (["--use-checkpoint-args", "--hidden-size", 128], 1, "--hidden-size 128 differs from the model's 64")]:
        run = trestle.run_raw(*train_args(setup, tmp_path, *flags, iters=1), timeout=120)
        assert run.returncode == code and message in run.stderr, (flags, run.returncode, run.stderr[-2000:])
    # --use-checkpoint-args: the flags Megatron's load_args_from_checkpoint then sets from the checkpoint (RoPE,
    # normalization, GQA, MLP kind, ...) are the model's over those given, a note naming the first that differs, and
    # the defaults' note has nothing to say.
    (tmp_path / "checkpoint_args").mkdir()
    out = trestle.run(*train_args(setup, tmp_path / "checkpoint_args", "--use-checkpoint-args", "--num-layers", 2,
                                  "--hidden-size", 64, "--rotary-base", 500000, "--normalization", "LayerNorm",
                                  "--attention-dropout", "0.1", iters=4), timeout=120)
    assert "--use-checkpoint-args: the model flags Megatron sets from the checkpoint are" in out and \
        "over those given (--" in out, out
    assert "Megatron's defaults would build another model" not in out and "dropout" not in out, out
    assert read_losses(tmp_path / "checkpoint_args" / "log.jsonl")[0][1] == expected[1]
    # and, as Megatron asserts, it needs a checkpoint
    args = train_args(setup, tmp_path, "--use-checkpoint-args", "--model-config", setup / "hf" / "config.json", iters=4)
    del args[args.index("--load"):args.index("--load") + 2]
    refused = trestle.run_raw(*args, timeout=120)
    assert refused.returncode == 2 and "--use-checkpoint-args requires --load or --pretrained-checkpoint" in \
        refused.stderr, refused.stderr[-2000:]
    # Megatron-LM takes a left-out --seq-length from the checkpoint's args: a Hugging Face conversion records none
    args = train_args(setup, tmp_path, "--use-checkpoint-args", iters=4)
    del args[args.index("--seq-length"):args.index("--seq-length") + 2]
    refused = trestle.run_raw(*args, timeout=120)
    assert refused.returncode == 2 and "--seq-length is required: --use-checkpoint-args found no sequence length " \
        f"in {setup / 'ckpt'} (" in refused.stderr, refused.stderr[-2000:]


LAYOUT = "--pipeline-model-parallel-layout"
PIPELINE_LAYOUTS = {  # flags, pp: the test Llama's 2 layers split as Megatron's layouts
    "even": ((LAYOUT, "Et|tL"), 2),
    "embedding-alone": ((LAYOUT, "E|ttL"), 2),
    "loss-alone": ((LAYOUT, "Ett|L"), 2),
    "interleaved-with-empty-chunks": ((LAYOUT, "E|t||tL"), 2),
    "repeats": ((LAYOUT, "E(t|)*2,L"), 3),
    # Both counted as layers of the even split over 2 x 2 chunks: the first and last chunks hold no decoder layer.
    "accounted": (("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                   "--num-virtual-stages-per-pipeline-rank", 2), 2),
}


@pytest.mark.parametrize("name", ci_cases(PIPELINE_LAYOUTS, ["interleaved-with-empty-chunks"]))
def test_pipeline_layout_strings_train_as_one_rank(setup, trestle, reference, tmp_path, name):
    """Megatron's --pipeline-model-parallel-layout places each virtual stage's layers as the string says, stages and
    model chunks without a decoder layer included (the embedding alone, the loss alone, an empty chunk between), and
    --account-for-embedding/loss-in-pipeline-split counts those as layers of the even split: the losses equal the
    one-rank run's within 1e-5."""
    _, expected = reference
    flags, pp = PIPELINE_LAYOUTS[name]
    losses, _ = train(trestle, setup, tmp_path, *flags, pp=pp)
    assert sorted(losses) == sorted(expected)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"{flags} at pp {pp}: losses differ at {bad}"


def test_a_pipeline_stage_without_parameters_resumes_on_its_layout(setup, trestle, reference, tmp_path):
    """A layout string that leaves a pipeline stage without layers or parameters (Et||tL at pp 3) saves and resumes on
    its own layout with the optimizer's state (the empty stage's ranks refused it as "no optimizer state", their own
    first parameter's moments being what they looked for): the resumed losses are the one-rank run's (1e-5). Resharded
    to pp 1, `reshard --pipeline-model-parallel-layout` rebuilds it piece for piece."""
    _, expected = reference
    saved, half = tmp_path / "save", ITERS // 2
    for run in ("first", "resumed"):
        (tmp_path / run).mkdir()
    first, _ = train(trestle, setup, tmp_path / "first", LAYOUT, "Et||tL", "--save", saved, "--exit-interval", half,
                     pp=3)
    assert sorted(first) == list(range(1, half + 1))
    # Resharded away (pp 1) and back with the layout string, the checkpoint is the saved one again: the same split
    # (model.parallel), every piece on the same rank, the same bits, model and optimizer.
    trestle.run("reshard", saved, tmp_path / "pp1", "--pp", 1, "--quiet")
    trestle.run("reshard", tmp_path / "pp1", tmp_path / "back", "--pp", 3, LAYOUT, "Et||tL", "--quiet")
    trestle.run("diff", saved, tmp_path / "back", "--quiet")
    original, rebuilt = (json.loads(next((root).glob("iter_*/manifest.json")).read_text())
                         for root in (saved, tmp_path / "back"))
    assert rebuilt["model"]["parallel"] == original["model"]["parallel"], rebuilt["model"]["parallel"]

    def placement(m):
        # (the trainer's one-replica optimizer pieces are flat ranges of the whole box; a reshard writes the box)
        where = lambda c: json.dumps({k: v for k, v in c.items() if k in ("file", "offset", "shape")})
        return {name: sorted(map(where, t["chunks"])) for name, t in m["tensors"].items()}
    assert placement(rebuilt) == placement(original)
    # Converted from Hugging Face with the layout string, the model's pieces go where the trainer put them.
    trestle.run("convert", "--from", "hf", setup / "hf", "--to", "trestle", tmp_path / "converted", "--pp", 3, LAYOUT,
                "Et||tL", "--quiet")
    converted = json.loads(next((tmp_path / "converted").glob("iter_*/manifest.json")).read_text())
    assert converted["model"]["parallel"] == original["model"]["parallel"], converted["model"]["parallel"]
    weights = {name: where for name, where in placement(original).items() if not name.startswith("optimizer.")}
    assert placement(converted) == weights
    # A string's virtual stages go with it: resharded to another pp, the split is even again with one chunk per stage.
    trestle.run("convert", "--from", "hf", setup / "hf", "--to", "trestle", tmp_path / "chunked", "--pp", 2, LAYOUT,
                "E|t|t|L", "--quiet")
    trestle.run("reshard", tmp_path / "chunked", tmp_path / "unchunked", "--pp", 1, "--quiet")
    trestle.run("diff", tmp_path / "chunked", tmp_path / "unchunked", "--quiet")
    for layout, pp, message in (("", 2, "--pipeline-model-parallel-layout is empty"),
                                ("Et|tL", 1, "2 virtual stages at pipeline-parallel size 1; give the size")):
        refused = trestle.run_raw("convert", "--from", "hf", setup / "hf", "--to", "trestle", tmp_path / "bad", "--pp",
                                  pp, LAYOUT, layout)
        assert refused.returncode == 1 and message in refused.stderr and not (tmp_path / "bad").exists(), \
            refused.stderr
    refused = trestle.run_raw("reshard", tmp_path / "pp1", tmp_path / "bad", "--pp", 3, LAYOUT, "Et||tL", "--vpp", 2)
    assert refused.returncode == 2 and "exclude each other" in refused.stderr, refused.stderr
    refused = trestle.run_raw("reshard", tmp_path / "pp1", tmp_path / "bad", "--pp", 3, LAYOUT, "Et||ttL")
    assert refused.returncode == 1 and "holds 3 decoder layers (t); the model has 2" in refused.stderr, refused.stderr
    resumed, _ = train(trestle, setup, tmp_path / "resumed", LAYOUT, "Et||tL", pp=3, load=saved)
    assert sorted(resumed) == list(range(half + 1, ITERS + 1))
    bad = {i: (resumed[i], expected[i]) for i in resumed if not close(resumed[i], expected[i])}
    assert not bad, f"resumed at Et||tL: losses differ from the one-rank run's at {bad}"


def test_a_pipeline_layout_that_does_not_describe_the_model_is_refused(setup, trestle, tmp_path):
    """A layout with another number of decoder layers than the model's, or beside another way of splitting the
    stages, is refused before the run starts, naming the layout and the fault (test_pipeline_layout_megatron checks
    the parser against megatron-core's)."""
    for layout, extra, message in [
            ("Et|ttL", (), "--pipeline-model-parallel-layout Et|ttL: holds 3 decoder layers (t); the model has 2"),
            ("Et|tL", ("--num-virtual-stages-per-pipeline-rank", 1), "exclude each other")]:
        run = trestle.run_raw(*train_args(setup, tmp_path, "--pipeline-model-parallel-layout", layout, *extra, pp=2,
                                          iters=1), timeout=120)
        assert run.returncode == 1 and message in run.stderr, (layout, run.returncode, run.stderr[-2000:])


def test_an_mlp_that_does_not_split_over_tp_is_refused_naming_its_size(setup, trestle, tmp_path):
    """An intermediate_size of 97 cannot split over tp 2: the trainer's ranks (before building their model), the
    converter and reshard say so by the size's name, where they named the split of one tensor (linear_fc1's gate
    rows)."""
    save_tiny_model(tmp_path / "hf", "LlamaConfig", dict(LLAMA, intermediate_size=97), seed=5)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "ckpt", "--quiet")
    message = "ffn_hidden_size (the MLP's hidden size: intermediate_size in config.json) 97 is not divisible by the " \
              "tensor-parallel size 2"
    run = trestle.run_raw(*train_args(setup, tmp_path, tp=2, iters=1, load=tmp_path / "ckpt"), timeout=120)
    assert run.returncode == 1 and message in run.stderr, run.stderr[-2000:]
    for command in (("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "tp2", "--tp", 2),
                    ("reshard", tmp_path / "ckpt", tmp_path / "tp2", "--tp", 2)):
        run = trestle.run_raw(*command)
        assert run.returncode == 1 and message in run.stderr and not (tmp_path / "tp2").exists(), run.stderr


def clause_documents(trestle, tmp_path, append_eod=True):
    """A dataset of documents of a few words (the first chapters' clauses): several end-of-document tokens in each
    sequence (none without append_eod: the documents then end only in the index). Returns its prefix."""
    clauses = []
    for line in (CORPUS / "kjv.jsonl").read_text().splitlines()[:40]:
        clauses += [c.strip() for c in re.split(r"[,;:.\n]", json.loads(line)["text"]) if c.strip()]
    (tmp_path / "clauses.jsonl").write_text("".join(json.dumps({"text": c}) + "\n" for c in clauses))
    trestle.run("preprocess", "--input", tmp_path / "clauses.jsonl", "--output-prefix", tmp_path / "clauses",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                *(("--append-eod",) if append_eod else ()), "--quiet")
    return tmp_path / "clauses_text_document"


def test_masked_end_of_document_tokens_train_as_megatron_core_under_context_parallelism(setup, trestle, tmp_path):
    """--eod-mask-loss leaves the end-of-document tokens (many in a 32-token window of verses) out of the loss, so the
    counted tokens differ between a sequence's context-parallel chunks: megatron-core trains each cp rank on the mean
    over its own tokens, averaging the gradients over the ranks, and logs the mean over all counted tokens.
    transformers trained that way (hf_training's context_parallel) gives the losses at cp 1 and cp 2, and the two
    differ (so the rule is what is tested)."""
    iters = 8
    data = clause_documents(trestle, tmp_path)
    samples = megatron_samples(setup, 0, iters * GBS, tmp_path, eod_mask_loss=True, data=data)
    masks = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).view(-1, MBS, 4, SEQ // 4)
    outer, inner = masks[:, :, [0, 3]].sum((1, 2, 3)), masks[:, :, [1, 2]].sum((1, 2, 3))
    assert (outer != inner).float().mean() > 0.5, "few micro-batches are masked unevenly between the cp ranks"
    expected = {}
    for cp in (1, 2):
        expected[cp] = train_transformers(setup / "hf", samples, iters=iters, global_batch=GBS, micro_batch=MBS,
                                          lr=3e-3, min_lr=3e-4, warmup_iters=3, weight_decay=0.1, clip_grad=1.0,
                                          beta2=0.95, context_parallel=cp)
        (tmp_path / f"cp{cp}").mkdir()
        # Megatron takes the end of document from its tokenizer: the corpus tokenizer's eos_token, id 0.
        eod = ["--eod-token-id", 0] if cp == 1 else ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                     CORPUS / "tokenizer.json"]
        out = trestle.run(*train_args(setup, tmp_path / f"cp{cp}", "--eod-mask-loss", *eod, cp=cp, iters=iters,
                                      data=data), timeout=300)
        losses, _ = read_losses(tmp_path / f"cp{cp}" / "log.jsonl")
        assert "--tokenizer-" not in out, out  # the tokenizer gave the end of document: not a flag without effect
        assert sorted(losses) == sorted(expected[cp])
        bad = {i: (losses[i], expected[cp][i]) for i in expected[cp] if not close(losses[i], expected[cp][i])}
        assert not bad, f"--eod-mask-loss at cp {cp}: losses differ from megatron-core's rule at {bad}"
    assert not close(expected[1][iters], expected[2][iters]), "cp 1 and cp 2 train alike: nothing tested"


DOCUMENT_LAYOUTS = {"one-rank": {}, "tp2-sp": dict(tp=2), "cp2": dict(cp=2), "pp2-dp2": dict(pp=2, dp=2),
                    "cp2-tp2-sp": dict(cp=2, tp=2)}


@pytest.mark.parametrize("name", ci_cases(DOCUMENT_LAYOUTS, ["cp2", "pp2-dp2"]))
def test_documents_attend_only_within_themselves_with_reset_attention_mask(setup, trestle, tmp_path, name):
    """--reset-attention-mask: a token attends only to its own document's tokens (those after the last end-of-document
    token before it), as the attention masks megatron-core's GPTDataset builds with reset_attention_mask. transformers
    trained with those masks as its 4-D attention masks gives the losses (the clause documents put several documents
    in each 32-token sequence, and masking them changes the losses, so the mask is what is tested); under context
    parallelism the ring's blocks are masked by document, under pipeline parallelism every stage masks."""
    iters = 6
    data = clause_documents(trestle, tmp_path)
    samples = megatron_samples(setup, 0, iters * GBS, tmp_path, data=data, reset_attention_mask=True)
    hidden = torch.stack([torch.as_tensor(s["attention_mask"]) for s in samples])
    assert (hidden != ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril()).any(dim=(1, 2, 3)).float().mean() > 0.9, \
        "few samples hold more than one document"
    common = dict(iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=3,
                  weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    expected = train_transformers(setup / "hf", samples, **common)
    causal = train_transformers(setup / "hf", [{k: v for k, v in s.items() if k != "attention_mask"} for s in samples],
                                **common)
    assert not close(expected[1], causal[1]), "the document mask changes nothing: nothing tested"
    extra = ("--reset-attention-mask", "--eod-token-id", 0)
    losses, _ = train(trestle, setup, tmp_path, *extra, iters=iters, data=data, **DOCUMENT_LAYOUTS[name])
    assert sorted(losses) == sorted(expected)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"--reset-attention-mask at {name}: losses differ from transformers' with Megatron's masks at {bad}"


def test_reset_attention_mask_follows_megatrons_data_loader_flags(setup, trestle, tmp_path):
    """With --no-create-attention-mask-in-dataloader Megatron's data loader makes no mask, so --reset-attention-mask
    masks nothing: the losses are the causal run's, and the log says the flag had no effect. Without --eod-token-id
    the documents cannot be found, and the run is refused before it starts."""
    data = clause_documents(trestle, tmp_path)
    runs = {}
    for name, extra in (("causal", ()), ("no-mask", ("--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
                                                     "--eod-token-id", 0))):
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, *extra, iters=4, data=data)
        result = trestle.run_raw(*args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = read_losses(tmp_path / name / "log.jsonl")[0]
    assert runs["no-mask"] == runs["causal"]
    assert "--reset-attention-mask (with --no-create-attention-mask-in-dataloader" in result.stdout
    result = trestle.run_raw(*train_args(setup, tmp_path, "--reset-attention-mask", iters=4, data=data), timeout=120)
    assert result.returncode == 2 and "--reset-attention-mask needs --eod-token-id" in result.stderr, result.stderr


# megatron-core 0.19's GPTDataset (the venv's 0.16 has no inter_document_masking), from the wheel scripts/setup unzips
# for the Megatron-Bridge tests, run in a process of its own so the venv's megatron-core stays the one imported here.
# Its helpers_cpp (the index builders, the same helpers.cpp in both) is the venv's build: the wheel's is for Python 3.12.
INTER_DOCUMENT_SAMPLES = textwrap.dedent("""
    import glob, importlib.util, os, sys, typing
    import typing_extensions
    import torch
    typing.override = typing_extensions.override  # megatron-core 0.19 wants Python 3.12's
    import megatron.core.datasets as venv_datasets
    helpers = glob.glob(os.path.join(os.path.dirname(venv_datasets.__file__), "helpers_cpp*.so"))[0]
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    sys.path.insert(0, sys.argv[1])
    import megatron.core.datasets
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", helpers)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    import megatron.core
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
    prefix, seq, count, sizes, cache, out = sys.argv[2:]

    class Tokenizer:
        unique_identifiers = {"class": "TestTokenizer"}
        eod = 0
        vocab_size = None  # (0.19 reads it only to pick the token dtype of --per-dataset-sequences-path)

    torch.distributed.init_process_group("gloo", init_method=f"file://{cache}.store", rank=0, world_size=1)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=int(seq), blend=([prefix], None), split="98,2,0",
                              tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False, inter_document_masking=True,
                              path_to_cache=cache)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [int(n) for n in sizes.split(",")], lambda: True,
                                          config).build()[0]
    torch.save([train[i] for i in range(int(count))], out)
""")


def megatron_inter_document_samples(count, tmp_path, data):
    """The first `count` training samples of `data` as megatron-core 0.19's GPTDataset gives them with
    inter_document_masking (each with its cu_seqlens and the positions restarting at each document), the splits sized
    as megatron_samples sizes them; each with "attention_mask" ([1, seq, seq] bool, True = hidden) hiding the other
    documents, made from its cu_seqlens."""
    script = tmp_path / "inter_document_samples.py"
    script.write_text(INTER_DOCUMENT_SAMPLES)
    wheels = pathlib.Path(os.environ.get("TRESTLE_MEGATRON_BRIDGE", "~/.cache/trestle/megatron-bridge")).expanduser()
    sizes = f"{ITERS * GBS},{(ITERS // 1000 + 1) * 2 * GBS},{2 * GBS}"
    out = tmp_path / "inter_document_samples.pt"
    run = subprocess.run([sys.executable, script, wheels / "megatron_core", data, str(SEQ), str(count), sizes,
                          tmp_path / "inter_document_cache", out], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"megatron-core 0.19's GPTDataset failed:\n{run.stderr[-3000:]}"
    samples = torch.load(out)
    for s in samples:
        cu = s["cu_seqlens"].long()
        cu = torch.cat([cu[:1], cu[1:][cu[1:] > cu[:-1]]])  # the padding entries (repeats of seq) dropped
        document = torch.bucketize(torch.arange(SEQ), cu[1:], right=True)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        s["attention_mask"] = ~(causal & (document.view(-1, 1) == document.view(1, -1))).unsqueeze(0)
    return samples


INTER_DOCUMENT_LAYOUTS = {"one-rank": {}, "tp2-sp": dict(tp=2), "cp2": dict(cp=2), "pp2-dp2": dict(pp=2, dp=2)}


@pytest.mark.parametrize("name", ci_cases(INTER_DOCUMENT_LAYOUTS, ["cp2"]))
def test_dataset_documents_mask_attention_and_restart_positions(setup, trestle, tmp_path, name):
    """--dataloader-inter-document-masking (Megatron-LM's, megatron-core 0.19's GPTDataset inter_document_masking):
    attention keeps within the documents each sample was read from, and positions (RoPE's) restart at each. The
    clause documents here carry no end-of-document token, so only the dataset's index knows where they end.
    transformers trained on megatron-core 0.19's samples, with masks made from their cu_seqlens and their position
    ids, gives the losses, and trains otherwise without the masks (so the documents are what is tested). Restarting
    RoPE's positions within a document that attends only to itself changes no product of a query and a key (RoPE is
    relative), so the positions change the losses only by rounding here."""
    iters = 6
    data = clause_documents(trestle, tmp_path, append_eod=False)
    samples = megatron_inter_document_samples(iters * GBS, tmp_path, data)
    restarts = torch.stack([s["position_ids"] for s in samples]) != torch.arange(SEQ)
    assert restarts.any(dim=1).float().mean() > 0.9, "few samples hold more than one document"
    common = dict(iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=3,
                  weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    expected = train_transformers(setup / "hf", samples, **common)
    causal = train_transformers(setup / "hf", [{k: v for k, v in s.items() if k not in ("cu_seqlens", "attention_mask")}
                                               for s in samples], **common)
    assert not close(expected[1], causal[1]), "the document mask changes nothing: nothing tested"
    losses, _ = train(trestle, setup, tmp_path, "--dataloader-inter-document-masking", iters=iters, data=data,
                      **INTER_DOCUMENT_LAYOUTS[name])
    assert sorted(losses) == sorted(expected)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert not bad, f"--dataloader-inter-document-masking at {name}: losses differ from transformers' at {bad}"


def test_inter_document_masking_is_refused_where_megatron_core_packs_otherwise(setup, trestle, tmp_path):
    """--dataloader-inter-document-masking beside --reset-attention-mask: Megatron's data loader then makes no
    attention mask, so the EOD documents mask nothing and the note says so (the documents here carry no EOD token, so
    the EOD rule alone would mask nothing: the inter-document run differs from the causal one). The layers whose
    document boundaries megatron-core handles its own way (Mamba, Gated DeltaNet, multi-token prediction) are refused
    naming them."""
    data = clause_documents(trestle, tmp_path, append_eod=False)
    runs = {}
    for name, extra in (("inter", ("--dataloader-inter-document-masking",)),
                        ("both", ("--dataloader-inter-document-masking", "--reset-attention-mask", "--eod-token-id", 0)),
                        ("causal", ())):
        (tmp_path / name).mkdir()
        result = trestle.run_raw(*train_args(setup, tmp_path / name, *extra, iters=4, data=data), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        if name == "both":
            assert "--reset-attention-mask (with --dataloader-inter-document-masking" in result.stdout
        runs[name] = read_losses(tmp_path / name / "log.jsonl")[0]
    assert runs["both"] == runs["inter"]
    assert runs["inter"] != runs["causal"], "the documents mask nothing: nothing tested"
    # The test Llama's family has no multi-token prediction in Trestle: --mtp-num-layers is refused for it, not dropped.
    args = train_args(setup, tmp_path, iters=4, data=data)
    at = args.index("--load")
    args[at:at + 2] = ["--model-config", setup / "hf" / "config.json", "--mtp-num-layers", 1]
    result = trestle.run_raw(*args, timeout=120)
    assert result.returncode == 1 and "--mtp-num-layers 1: Trestle trains multi-token-prediction layers in the " \
        "families that have them" in result.stderr, result.stderr[-2000:]


def test_per_token_loss_trains_on_the_mean_over_the_global_batchs_counted_tokens(setup, trestle, tmp_path):
    """--calculate-per-token-loss (Megatron's): each micro-batch's loss is its sum, the gradients are summed over the
    ranks and divided by the global batch's counted tokens (passed from the last pipeline stage to the others). With
    --eod-mask-loss the micro-batches count different numbers of tokens, so this is not the default mean of the
    micro-batches' means: transformers trained both ways gives the losses on one rank, at cp 2 x dp 2 and at pp 2 x
    dp 2 with the distributed optimizer, and the two rules' losses differ."""
    iters = 8
    data = clause_documents(trestle, tmp_path)
    samples = megatron_samples(setup, 0, iters * GBS, tmp_path, eod_mask_loss=True, data=data)
    common = dict(iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=3,
                  weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    expected = train_transformers(setup / "hf", samples, per_token_loss=True, **common)
    default_rule = train_transformers(setup / "hf", samples, **common)
    assert not close(expected[iters], default_rule[iters]), "the two rules train alike: nothing tested"
    for name, layout, extra in (("one-rank", {}, ()), ("cp2dp2", dict(cp=2, dp=2), ()),
                                ("pp2dp2-distopt", dict(pp=2, dp=2), ("--use-distributed-optimizer",))):
        (tmp_path / name).mkdir()
        losses, _ = train(trestle, setup, tmp_path / name, "--eod-mask-loss", "--eod-token-id", 0,
                          "--calculate-per-token-loss", *extra, iters=iters, data=data, **layout)
        assert sorted(losses) == sorted(expected)
        bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
        assert not bad, f"--calculate-per-token-loss {name}: losses differ from the per-token rule's at {bad}"


def test_sample_based_training_and_a_decoupled_learning_rate_train_as_megatron(setup, trestle, tmp_path):
    """Megatron's sample-based training: --train-samples 100 trains whole global batches of 8 (12 iterations) on a
    training split of 100 samples, the schedule's lengths in samples (--lr-decay-samples 90; --lr-warmup-fraction 0.1,
    a warmup of 9 samples, not a whole batch) and --decoupled-lr / --decoupled-min-lr for the word embeddings and the
    output layer: transformers trained with megatron-core's scheduler over the same parameter groups gives the losses
    at tp 1 and at tp 2 x dp 2 with the distributed optimizer; the decoupled rate changes them (so it is tested), and the
    logged learning rate is the default groups'. (The run without it gives its length as --encoder-seq-length.) Mixing iterations and samples, or a warmup fraction and a length, is
    refused as Megatron's argument checks refuse it."""
    train_samples, decay, fraction = 100, 90, 0.1
    iters = train_samples // GBS
    samples = megatron_samples(setup, 0, iters * GBS, tmp_path, train_samples=train_samples)
    common = dict(iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=0,
                  warmup_steps=fraction * decay, decay_steps=decay, wd_incr_steps=train_samples, weight_decay=0.1,
                  clip_grad=1.0, beta2=0.95)
    expected = train_transformers(setup / "hf", samples, decoupled_lr=1e-2, decoupled_min_lr=1e-4, **common)
    plain = train_transformers(setup / "hf", samples, **common)
    assert not close(expected[iters], plain[iters], rel=1e-3), "the decoupled rate trains alike: nothing tested"

    def run(name, *extra, seq=SEQ, **layout):
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, *extra, **layout)
        for flag in ("--train-iters", "--lr-warmup-iters") + (("--seq-length",) if seq is None else ()):
            i = args.index(flag)
            del args[i:i + 2]
        trestle.run(*args, "--train-samples", train_samples, "--lr-decay-samples", decay, "--lr-warmup-fraction",
                    fraction, timeout=300)
        return read_losses(tmp_path / name / "log.jsonl")[0], [
            json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    for name, extra, layout in (("tp1", (), {}), ("tp2dp2-distopt", ("--use-distributed-optimizer",), dict(tp=2, dp=2))):
        losses, records = run(name, "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-4", *extra, **layout)
        assert sorted(losses) == list(range(1, iters + 1))
        bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
        assert not bad, f"--train-samples with --decoupled-lr at {name}: losses differ from megatron's rule at {bad}"
    plain_losses, records = run("plain", "--encoder-seq-length", SEQ, seq=None)  # Megatron's older name
    bad = {i: (plain_losses[i], plain[i]) for i in plain if not close(plain_losses[i], plain[i])}
    assert not bad, f"--train-samples: losses differ from megatron's rule at {bad}"
    # Logged as Megatron logs it, after the scheduler's step: at 8 of the 9 warmup samples, then 7 of the 81 decaying.
    lrs = {r["iteration"]: r["learning_rate"] for r in records if "validation" not in r}
    assert lrs[1] == pytest.approx(3e-3 * 8 / 9, rel=1e-12), lrs
    assert lrs[2] == pytest.approx(3e-4 + 0.5 * (math.cos(math.pi * 7 / 81) + 1) * 2.7e-3, rel=1e-12), lrs
    for flags, message in [
            (["--lr-decay-samples", 90], "--lr-decay-samples is for --train-samples; with --train-iters give "
                                         "--lr-decay-iters"),
            (["--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction and --lr-warmup-iters exclude each other"),
            (["--train-samples", 100], "--train-iters and --train-samples exclude each other")]:
        result = trestle.run_raw(*train_args(setup, tmp_path, *flags, iters=1), timeout=120)
        assert result.returncode == 2 and message in result.stderr, (flags, result.returncode, result.stderr[-2000:])
    args = train_args(setup, tmp_path, iters=1)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = args.index(flag)
        del args[i:i + 2]
    result = trestle.run_raw(*args, "--train-samples", 7, timeout=120)
    assert result.returncode == 2 and "--train-samples 7 is less than one global batch (--global-batch-size 8)" \
        in result.stderr, result.stderr[-2000:]


def test_each_split_from_its_own_datasets_trains_as_megatron(setup, trestle, tmp_path):
    """--train-data-path / --valid-data-path (megatron-core's blend_per_split): the training split is every document
    of its datasets (not --split's share), so the losses are transformers' on megatron-core's per-split samples; the
    validation split comes from its own datasets. The same words from files (--data-args-path,
    --per-split-data-args-path) train identically; mixing the two ways, or --split with per-split data, is refused."""
    iters = 8
    kjv, clauses = setup / "data" / "kjv_text_document", clause_documents(trestle, tmp_path)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend_per_split=[([str(kjv)], None),
                              ([str(clauses)], None), None], tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    evaluations = iters // 4 + 1
    train_split = BlendedMegatronDatasetBuilder(GPTDataset, [iters * GBS, evaluations * GBS, GBS], lambda: True,
                                                config).build()[0]
    expected = train_transformers(setup / "hf", [train_split[i] for i in range(iters * GBS)], iters=iters,
                                  global_batch=GBS, micro_batch=MBS, lr=3e-3, min_lr=3e-4, warmup_iters=3,
                                  weight_decay=0.1, clip_grad=1.0, beta2=0.95)

    def run(name, *data_flags):
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, iters=iters)
        for flag in ("--data-path", "--split", "--eval-interval", "--eval-iters"):
            i = args.index(flag)
            del args[i:i + 2]
        trestle.run(*args, *data_flags, "--eval-interval", 4, "--eval-iters", 1, timeout=300)
        return read_losses(tmp_path / name / "log.jsonl")
    losses, valid = run("flags", "--train-data-path", kjv, "--valid-data-path", clauses)
    bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
    assert sorted(losses) == sorted(expected) and not bad, f"per-split data: losses differ from megatron's at {bad}"
    assert len(valid) >= 2 and all(math.isfinite(v) for v in valid), valid
    (tmp_path / "per_split.json").write_text(json.dumps({"train": [str(kjv)], "valid": f"1.0 {clauses}",
                                                         "test": None}))
    assert run("file", "--per-split-data-args-path", tmp_path / "per_split.json") == (losses, valid)
    (tmp_path / "words.txt").write_text(f"0.5 {kjv}\n0.5 {kjv}\n")
    (tmp_path / "words").mkdir()
    args = train_args(setup, tmp_path / "words", iters=4)
    i = args.index("--data-path")
    del args[i:i + 2]
    result = trestle.run_raw(*args, "--data-args-path", tmp_path / "words.txt", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for flags, message in [
            (["--train-data-path", kjv], "--data-path / --data-args-path and the per-split data flags"),
            (["--data-args-path", tmp_path / "words.txt"], "--data-path and --data-args-path exclude each other")]:
        result = trestle.run_raw(*train_args(setup, tmp_path, *flags, iters=1), timeout=120)
        assert result.returncode == 2 and message in result.stderr, (flags, result.returncode, result.stderr[-2000:])
    args = train_args(setup, tmp_path, iters=1)
    i = args.index("--data-path")
    del args[i:i + 2]
    result = trestle.run_raw(*args, "--train-data-path", kjv, timeout=120)
    assert result.returncode == 2 and "--split does not apply to --train-data-path" in result.stderr, \
        result.stderr[-2000:]


def test_mock_data_trains_as_megatron_on_megatron_cores_mock_samples(setup, trestle, tmp_path):
    """--mock-data: megatron-core's MockGPTDataset (its tokenizer's vocabulary the model's 4096, the end of document its
    last id: Megatron's NullTokenizer of --vocab-size 4095) gives the samples; transformers trained on them gives
    trestle's losses, at tp 1 and tp 2 x dp 2 (there with Megatron's tokenizer flags). A NullTokenizer whose ids are
    not the model's vocabulary is refused: --vocab-size 4096 has 4097."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    iters = 6
    tokenizer = _Tokenizer()
    tokenizer.eod = LLAMA["vocab_size"] - 1
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, split="969, 30, 1", tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    assert config.mock
    train_split = BlendedMegatronDatasetBuilder(MockGPTDataset, [iters * GBS, (iters // 1000 + 1) * GBS, GBS],
                                                lambda: True, config).build()[0]
    samples = [train_split[i] for i in range(iters * GBS)]
    assert max(int(torch.as_tensor(s["tokens"]).max()) for s in samples) > 100, "the mock tokens do not count up"
    expected = train_transformers(setup / "hf", samples, iters=iters, global_batch=GBS, micro_batch=MBS, lr=3e-3,
                                  min_lr=3e-4, warmup_iters=3, weight_decay=0.1, clip_grad=1.0, beta2=0.95)
    null_tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", LLAMA["vocab_size"] - 1]
    for name, layout, extra in (("tp1", {}, []), ("tp2dp2", dict(tp=2, dp=2), null_tokenizer)):
        (tmp_path / name).mkdir()
        args = train_args(setup, tmp_path / name, iters=iters, **layout)
        i = args.index("--data-path")
        del args[i:i + 2]
        trestle.run(*args, "--mock-data", "--eval-iters", 0, *extra, timeout=300)
        losses, _ = read_losses(tmp_path / name / "log.jsonl")
        bad = {i: (losses[i], expected[i]) for i in expected if not close(losses[i], expected[i])}
        assert sorted(losses) == sorted(expected) and not bad, f"--mock-data at {name}: losses differ at {bad}"
    result = trestle.run_raw(*train_args(setup, tmp_path, "--mock-data", iters=1), timeout=120)
    assert result.returncode == 2 and "--mock-data and the data paths exclude each other" in result.stderr
    args = train_args(setup, tmp_path, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 4096, iters=1)
    i = args.index("--data-path")
    del args[i:i + 2]
    result = trestle.run_raw(*args, timeout=120)
    assert result.returncode == 1 and "NullTokenizer --vocab-size 4096 has 4097 ids" in result.stderr, result.stderr


def megatron_samples(setup, split, count, tmp_path, seq=SEQ, eod_mask_loss=False, data=None, train_samples=None,
                     reset_attention_mask=False, splits="98,2,0", sizes=None):
    """The first `count` samples of split 0 (train), 1 (validation) or 2 (test) of `data` (a dataset prefix, or the KJV
    corpus; `splits` Megatron's --split, `sizes` the three splits' sample counts)
    as megatron-core's GPTDataset builds them (the training split sized for --train-samples when given); with
    reset_attention_mask each carries its attention mask, the documents hidden from each other (end-of-document token
    0), and without it none."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq,
                              blend=([str(data or setup / "data" / "kjv_text_document")], None), split=splits,
                              tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                              create_attention_mask=reset_attention_mask, path_to_cache=str(tmp_path / "cache"))
    # Megatron's sample counts for --train-iters 20, --eval-interval 1000, --eval-iters 2.
    evaluations = ITERS // 1000 + 1
    sizes = sizes or [train_samples or ITERS * GBS, evaluations * 2 * GBS, 2 * GBS]
    splits = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return [splits[split][i] for i in range(count)]


def hf_loss(hf_dir, samples):
    """transformers' mean token loss (fp32) over Megatron samples."""
    model = auto_model(hf_dir).from_pretrained(hf_dir, dtype=torch.float32).eval()  # (a vision-language model's text)
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for s in samples:
            logits = model(s["tokens"].unsqueeze(0).long()).logits[0].float()
            losses = torch.nn.functional.cross_entropy(logits, s["labels"].long(), reduction="none")
            total += float((losses * s["loss_mask"]).sum())
            tokens += float(s["loss_mask"].sum())
    return total / tokens


def test_trained_model_converts_to_hf_with_the_same_validation_loss(setup, trestle, tmp_path):
    _, valid = train(trestle, setup, tmp_path, "--save", tmp_path / "save", "--eval-iters", 2, tp=2, dp=2, iters=6)
    assert len(valid) == 1
    trestle.run("convert", "--from", "trestle", tmp_path / "save", "--to", "hf", tmp_path / "hf", "--quiet")
    expected = hf_loss(tmp_path / "hf", megatron_samples(setup, 1, 2 * GBS, tmp_path))
    assert close(expected, valid[0]), f"transformers: {expected}, trainer: {valid[0]}"


def test_resumes_from_a_megatron_core_torch_dist_checkpoint(setup, trestle, tmp_path):
    """megatron-core's GPTModel (CPU, local spec) with two Adam steps saved by dist_checkpointing as torch_dist:
    `trestle train --load` trains from it at tp2/dp2. Its first loss is transformers' on the same samples of the same
    model (converted to Hugging Face), and the Adam state it loaded shapes the next steps."""
    import test_megatron_dist_convert as mdc
    mdc.MCORE_CONFIGS["train"] = ("LlamaConfig", dict(vocab_size=4096, hidden_size=32, intermediate_size=48,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5))
    (tmp_path / "mc").mkdir()
    result, _ = mdc.run_mcore(tmp_path, "save", tmp_path / "mc", free_port(), "train", mdc.MCORE_OPTIM)
    assert result.returncode == 0, result.stderr[-3000:]
    mdc.mcore_hf_config("train").save_pretrained(tmp_path / "cfg")
    runs = {}
    for name, extra in [("with_optim", []), ("no_optim", ["--no-load-optim"])]:
        out = tmp_path / name
        out.mkdir()
        runs[name], _ = train(trestle, setup, out, "--hf-config", tmp_path / "cfg", *extra, tp=2, dp=2, iters=4,
                              load=tmp_path / "mc")
    trestle.run("convert", "--from", "megatron-dist", tmp_path / "mc", "--to", "hf", tmp_path / "hf",
                "--hf-config", tmp_path / "cfg", "--quiet")
    expected = hf_loss(tmp_path / "hf", megatron_samples(setup, 0, GBS, tmp_path))
    assert close(runs["with_optim"][1], expected), f"trainer {runs['with_optim'][1]}, transformers {expected}"
    assert runs["no_optim"][1] == runs["with_optim"][1]
    # The first update runs at the warmup's lr 0; the second one's result shows in iteration 3's loss.
    assert runs["no_optim"][3] != runs["with_optim"][3], "the loaded Adam state changed nothing"
    # The same checkpoint as Megatron's release (a root whose tracker says "release"): its weights (and the consumed
    # samples its args record, none here), as Megatron's load_checkpoint takes a release: neither its optimizer's
    # state nor its scheduler's.
    shutil.copytree(tmp_path / "mc", tmp_path / "rel" / "release")
    (tmp_path / "rel" / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "release").mkdir()
    out = trestle.run(*train_args(setup, tmp_path / "release", "--hf-config", tmp_path / "cfg", tp=2, dp=2, iters=4,
                                  load=tmp_path / "rel"), timeout=300)
    assert f"loaded {tmp_path / 'rel' / 'release'} (iteration 0, 0 consumed samples), its weights and consumed " \
        "samples from iteration 0 (a release checkpoint, as Megatron loads one)" in out, out
    assert read_losses(tmp_path / "release" / "log.jsonl")[0] == runs["no_optim"]


def test_a_megatron_legacy_checkpoint_trains_from_its_weights(setup, trestle, reference, tmp_path):
    """A Megatron legacy (torch format) checkpoint, mp_rank_XX/model_optim_rng.pt at tp 2, converted for loading as a
    torch_dist one is: --finetune trains from its weights (the first loss is the converted Hugging Face model's, the
    reference run's). Its optimizer state is not read, so resuming it without --no-load-optim is refused saying so."""
    import test_megatron_dist_convert as mdc
    _, expected = reference
    mdc.write_legacy_tree(setup / "hf", tmp_path / "legacy", 2, 1, 1)
    config = ("--hf-config", setup / "hf" / "config.json")
    refused = trestle.run_raw(*train_args(setup, tmp_path, *config, iters=4, load=tmp_path / "legacy"), timeout=120)
    assert refused.returncode == 1 and "is a Megatron legacy (torch) checkpoint" in refused.stderr and \
        "give --no-load-optim" in refused.stderr, refused.stderr[-2000:]
    # Under --use-checkpoint-args a left-out --seq-length is the rank files' args.seq_length (refused while they have
    # none).
    without_seq = train_args(setup, tmp_path / "tuned", *config, "--finetune", "--use-checkpoint-args", iters=4,
                             load=tmp_path / "legacy")
    del without_seq[without_seq.index("--seq-length"):without_seq.index("--seq-length") + 2]
    refused = trestle.run_raw(*without_seq, timeout=120)
    assert refused.returncode == 2 and "--use-checkpoint-args found no sequence length in " \
        f"{tmp_path / 'legacy'}" in refused.stderr, refused.stderr[-2000:]
    for rank_file in (tmp_path / "legacy").glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(rank_file, weights_only=False)
        state["args"].seq_length = SEQ
        torch.save(state, rank_file)
    (tmp_path / "tuned").mkdir()
    printed = trestle.run(*without_seq, timeout=300)
    assert f"loaded {tmp_path / 'legacy' / 'iter_0000020'} (iteration 20" in printed, printed
    assert f"the sequence length is the checkpoint's run's, {SEQ}" in printed, printed
    tuned, _ = read_losses(tmp_path / "tuned" / "log.jsonl")
    assert sorted(tuned) == [1, 2, 3, 4] and close(tuned[1], expected[1]), (tuned, expected[1])


def test_no_load_optim_starts_the_schedule_afresh_as_megatron(setup, trestle, tmp_path):
    """Megatron-LM loads the learning-rate schedule with the optimizer's state: under --no-load-optim a resumed run's
    schedule starts again from its first step (the warmup again), which a fresh run's first iterations show."""
    def learning_rates(out):
        records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        return {r["iteration"]: r["learning_rate"] for r in records if "learning_rate" in r}
    for name in ("fresh", "saved", "resumed", "resumed_optim"):
        (tmp_path / name).mkdir()
    train(trestle, setup, tmp_path / "fresh", iters=6)
    train(trestle, setup, tmp_path / "saved", "--save", tmp_path / "ckpt", "--exit-interval", 2, iters=6)
    train(trestle, setup, tmp_path / "resumed", "--no-load-optim", iters=6, load=tmp_path / "ckpt")
    train(trestle, setup, tmp_path / "resumed_optim", iters=6, load=tmp_path / "ckpt")
    fresh, resumed = learning_rates(tmp_path / "fresh"), learning_rates(tmp_path / "resumed")
    assert [resumed[3], resumed[4]] == [fresh[1], fresh[2]], (fresh, resumed)
    assert learning_rates(tmp_path / "resumed_optim")[3] != fresh[1]


# megatron-core's GPTModel (CPU, fp32, local spec, no dropout), saved as torch_dist, then one training step on a global
# batch: its loss and its gradients, clipped to a global norm of 1.0 by torch.nn.utils.clip_grad_norm_. It writes the
# weights it saved, the clipped gradients (under its state-dict names), the loss and the gradient norm.
MCORE_STEP = textwrap.dedent("""
    import contextlib, json, os, sys, torch
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from safetensors.torch import save_file

    def main():
        ckpt, out, port, batch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
        c, clip = json.loads(sys.argv[5]), float(sys.argv[6])
        _, model = build(c, port, hidden_dropout=0.0, attention_dropout=0.0, **json.loads(sys.argv[7]))
        # dropout is off, but attention still forks the CUDA RNG tracker, which has no state on CPU
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        with torch.no_grad():  # a trained model's scale, so the loss is near ln(vocab) rather than ~20
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if "norm" in name else 0.0))
        dist_checkpointing.save(model.sharded_state_dict(), ckpt,
                                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
        save_file({k: p.detach().clone() for k, p in model.named_parameters()}, os.path.join(out, "initial.safetensors"))
        b = torch.load(batch)
        seq = b["tokens"].shape[1]
        causal = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]  # True: masked out
        mask = b.get("attention_mask", causal)  # GPTDataset's, [batch, 1, seq, seq], with reset_attention_mask
        positions = torch.arange(seq).unsqueeze(0).expand_as(b["tokens"])
        losses = model(b["tokens"], positions, mask, labels=b["labels"])  # [batch, seq]
        loss = (losses * b["loss_mask"]).sum() / b["loss_mask"].sum()
        loss.backward()
        # The norm summed in fp64, as a GPU's reduction gives it (the CPU's fp32 vector norm, which clip_grad_norm_
        # reports, drifts by ~4e-5 relative on a 131k-element output layer).
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        save_file({k: p.grad.contiguous() for k, p in model.named_parameters()}, os.path.join(out, "grads.safetensors"))
        record = {"loss": float(loss), "grad_norm": float(norm)}
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        if "values" in MTPLossLoggingHelper.tracker:  # multi-token prediction's losses, one micro-batch's means
            record["mtp_losses"] = MTPLossLoggingHelper.tracker["values"].tolist()
        json.dump(record, open(os.path.join(out, "step.json"), "w"))
        torch.distributed.destroy_process_group()

    if __name__ == "__main__":
        main()
""")
# The local spec keeps its norms under Transformer Engine's checkpoint keys (its sharded_state_dict_keys_map).
NORM_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# variant: (Hugging Face family, megatron-core TransformerConfig arguments)
STEP_VARIANTS = {"llama": ("Llama", {}), "qwen2": ("Qwen2", dict(add_qkv_bias=True)),
                 "qwen3": ("Qwen3", dict(qk_layernorm=True))}


def checkpoint_key(name):
    """megatron-core's state-dict name -> (torch_dist key, layer index or None)."""
    layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not layer:
        return name, None
    return "decoder.layers." + NORM_KEYS.get(layer[2], layer[2]), int(layer[1])


@pytest.mark.parametrize("variant,tp,dp,sp", [("llama", 1, 1, False), ("qwen2", 2, 1, False), ("qwen3", 2, 2, True)])
def test_first_step_matches_megatron_core_and_torch_adamw(setup, trestle, tmp_path, variant, tp, dp, sp):
    """On the same torch_dist checkpoint (written by megatron-core) and global batch (megatron-core's GPTDataset's
    first samples), `trestle train`'s first loss equals megatron-core GPTModel's within 1e-5 relative and its clipped
    gradients (read back from the saved Adam state: exp_avg = (1 - beta1) g after one step) agree with megatron-core's;
    the weights after its step equal torch.optim.AdamW's update of the same gradients within 1e-6. Everything is read
    from the saved checkpoint converted back to torch_dist."""
    import test_megatron_dist_convert as mdc
    hf = dict(vocab_size=4096, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)
    family, extra = STEP_VARIANTS[variant]
    lr, wd, beta1, beta2, clip = 3e-3, 0.1, 0.9, 0.95, 1.0
    samples = megatron_samples(setup, 0, GBS, tmp_path)
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")}
    torch.save({k: v.float() if k == "loss_mask" else v.long() for k, v in batch.items()}, tmp_path / "batch.pt")
    script = tmp_path / "mcore_step.py"
    script.write_text(mdc.MCORE.split("\ndef main():")[0] + MCORE_STEP)
    (tmp_path / "mc").mkdir()
    (tmp_path / "ref").mkdir()
    result = mdc.reference_scripts().run([script, tmp_path / "mc", tmp_path / "ref", free_port(),
                                          tmp_path / "batch.pt", json.dumps(hf), clip, json.dumps(extra)],
                                         timeout=mdc.MCORE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads((tmp_path / "ref" / "step.json").read_text())

    config = getattr(transformers, f"{family}Config")(**hf)
    config.architectures = [f"{family}ForCausalLM"]
    config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "trestle"
    out.mkdir()
    losses, _ = train(trestle, setup, out, "--hf-config", tmp_path / "cfg", "--save", out / "save", "--lr", lr,
                      "--min-lr", lr, "--lr-warmup-iters", 0, "--lr-decay-style", "constant", "--weight-decay", wd,
                      "--adam-beta1", beta1, "--adam-beta2", beta2, "--adam-eps", "1e-8", "--clip-grad", clip,
                      *(["--sequence-parallel"] if sp else []), tp=tp, dp=dp, iters=1, load=tmp_path / "mc")
    assert close(losses[1], expected["loss"]), f"trestle {losses[1]}, megatron-core {expected['loss']}"
    print(f"\n{variant} tp{tp} dp{dp} sp{sp}: loss trestle {losses[1]!r} megatron-core {expected['loss']!r}")
    record = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert close(record["grad_norm"], expected["grad_norm"]), (record["grad_norm"], expected["grad_norm"])

    trestle.run("convert", "--from", "trestle", out / "save", "--to", "megatron-dist", tmp_path / "back", "--quiet")
    saved = mdc.read_dcp(mdc.iteration_dir(tmp_path / "back"))
    # The schedule's state is what megatron-core's scheduler holds after the same run (Megatron-LM's load needs it).
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    reference = OptimizerParamScheduler(types.SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=lr, min_lr=lr,
                                        lr_warmup_steps=0, lr_decay_steps=GBS, lr_decay_style="constant",
                                        start_wd=wd, end_wd=wd, wd_incr_steps=GBS, wd_incr_style="constant")
    reference.step(GBS)
    common = torch.load(pathlib.Path(mdc.iteration_dir(tmp_path / "back")) / "common.pt", weights_only=False)
    assert common["opt_param_scheduler"] == reference.state_dict()
    initial = safetensors.torch.load_file(tmp_path / "ref" / "initial.safetensors")
    reference_grads = safetensors.torch.load_file(tmp_path / "ref" / "grads.safetensors")
    names = list(initial)
    stored = {}
    for name in names:
        key, layer = checkpoint_key(name)
        stored[name] = [saved[k] if layer is None else saved[k][layer]
                        for k in (key, f"optimizer.state.exp_avg.{key}", f"optimizer.state.exp_avg_sq.{key}")]
    grads = {n: stored[n][1] / (1 - beta1) for n in names}  # Trestle's clipped gradients
    for n in names:
        scale = float(reference_grads[n].abs().max())  # fp32 sums in another order: relative to the largest element
        assert torch.allclose(grads[n], reference_grads[n], rtol=1e-4, atol=1e-5 * scale), \
            f"{n}: gradient differs from megatron-core's by {float((grads[n] - reference_grads[n]).abs().max())}"
        assert torch.allclose(stored[n][2], (1 - beta2) * grads[n] ** 2, rtol=1e-5, atol=1e-20), n
    params = {n: initial[n].clone().requires_grad_(True) for n in names}
    for n in names:
        params[n].grad = grads[n].clone()
    groups = [{"params": [params[n] for n in names if params[n].dim() > 1], "weight_decay": wd},
              {"params": [params[n] for n in names if params[n].dim() <= 1], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=1e-8, foreach=False).step()
    for n in names:
        diff = float((stored[n][0] - params[n].detach()).abs().max())
        assert diff <= 1e-6, f"{n}: the updated weight is {diff} from torch.optim.AdamW's"
    assert len(names) >= 9


def test_tensorboard_holds_the_logged_losses(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, expected = reference
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(scalars) == list(range(1, ITERS + 1))
    for i, loss in expected.items():
        assert scalars[i] == pytest.approx(loss, rel=1e-6)
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [i * GBS for i in range(1, ITERS + 1)]
    # Megatron's defaults: the loss scale written, its timers, world size and validation perplexity not.
    tags = set(events.Tags()["scalars"])
    assert "loss-scale" in tags and not tags & {"iteration-time", "world-size", "lm loss validation ppl"}, tags


def test_tensorboard_gets_each_iterations_own_values_on_its_own_interval(setup, trestle, reference, tmp_path):
    """As Megatron's training_log: TensorBoard's scalars are each iteration's own (not the console interval's means),
    every --tensorboard-log-interval iterations, whatever --log-interval is; the interval's timing comes with the
    console line (iteration-time with --log-timers-to-tensorboard). Megatron's flags choose its optional scalars:
    --no-log-loss-scale-to-tensorboard leaves the loss scale out, --log-world-size-to-tensorboard and
    --log-validation-ppl-to-tensorboard add theirs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, expected = reference
    train(trestle, setup, tmp_path, "--log-interval", 5, "--tensorboard-log-interval", 2, "--tensorboard-dir",
          tmp_path / "tb", "--wandb-save-dir", tmp_path / "wandb", "--tensorboard-queue-size", 5,
          "--log-timers-to-tensorboard", "--no-log-loss-scale-to-tensorboard", "--log-world-size-to-tensorboard",
          "--log-validation-ppl-to-tensorboard", "--eval-interval", 10, "--eval-iters", 1)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(losses) == list(range(2, ITERS + 1, 2))
    for i, loss in losses.items():
        assert loss == pytest.approx(expected[i], rel=1e-6), (i, loss, expected[i])
    assert [e.step for e in events.Scalars("learning-rate")] == list(range(2, ITERS + 1, 2))
    assert [e.step for e in events.Scalars("iteration-time")] == list(range(5, ITERS + 1, 5))
    tags = set(events.Tags()["scalars"])
    assert "loss-scale" not in tags and [e.value for e in events.Scalars("world-size")] == [1.0] * (ITERS // 2)
    ppl = {e.step: e.value for e in events.Scalars("lm loss validation ppl")}
    validation = {e.step: e.value for e in events.Scalars("lm loss validation")}
    assert sorted(ppl) == [10, 20] and all(ppl[i] == pytest.approx(math.exp(validation[i]), rel=1e-5) for i in ppl)


def test_killed_worker_ends_the_job_naming_the_rank(setup, trestle, tmp_path):
    start = time.monotonic()
    result = trestle.run_raw("train", "--nproc-per-node", 2, "--data-path", setup / "data" / "kjv_text_document",
                             "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS,
                             "--seq-length", SEQ, "--train-iters", 10, "--lr", "1e-3", "--eval-iters", 0,
                             "--load", setup / "ckpt", "--distributed-timeout-seconds", 30,
                             "--test-kill-rank", 1, "--test-kill-iteration", 3, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1" in result.stderr, result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"


def ignores_sigpipe(process, timeout=30):
    """Whether the process ignores SIGPIPE (SigIgn in its /proc status) once its worker has started: polled until
    then, while it lives."""
    import signal
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                ignored = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
        except FileNotFoundError:  # it ended between poll() and open()
            return False
        if ignored >> (signal.SIGPIPE - 1) & 1:
            return True
        time.sleep(0.05)
    return False


def test_dead_peer_ends_a_torchrun_style_worker_naming_its_group(setup, trestle, tmp_path):
    """Workers started by another launcher (torchrun's variables, no trestle launcher to stop them): when rank 1 dies,
    rank 0's next collective fails within the timeout and says which group of ranks it was waiting on."""
    import os
    port = free_port()
    workers = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        workers.append(subprocess.Popen(
            [str(a) for a in [trestle.path, "train", "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
             "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 10,
             "--lr", "1e-3", "--eval-iters", 0, "--load", setup / "ckpt", "--distributed-timeout-seconds", 30,
             "--test-kill-rank", 1, "--test-kill-iteration", 3]], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    # Rank 0 may be writing to rank 1's sockets as they close: the write must fail, not end rank 0 with SIGPIPE
    # (CI once saw it killed by signal 13), so every worker ignores SIGPIPE as Python's do.
    assert ignores_sigpipe(workers[0]) and ignores_sigpipe(workers[1])
    _, err0 = workers[0].communicate(timeout=120)
    workers[1].communicate(timeout=120)
    assert workers[1].returncode == -9
    assert workers[0].returncode == 1, err0
    assert "data-parallel group of ranks [0, 1]" in err0 and "a peer died or hung" in err0, err0
    # (well within the 30 s timeout: the dead peer's sockets close at once, and rank 0, which serves the store and
    # failed, does not wait for its peers to leave the store)
    assert time.monotonic() - start < 40


def test_bf16_accumulates_gradients_in_fp32(setup, trestle, reference, tmp_path):
    """bf16 parameters with fp32 masters, gradients accumulated over the 4 micro-batches and all-reduced in fp32 (Megatron's
    default for bf16): the losses follow fp32's (within 5% over 10 iterations: bf16 activations and weights; measured
    2.6%), --grad-reduce-in-bf16 changes them, and the checkpoint holds bf16 weights beside fp32 masters."""
    _, fp32 = reference
    runs = {}
    for name, extra in [("fp32_grads", []), ("bf16_grads", ["--grad-reduce-in-bf16"])]:
        out = tmp_path / name
        out.mkdir()
        runs[name], _ = train(trestle, setup, out, "--bf16", "--save", out / "save", *extra, tp=2, dp=2, iters=10)
    drift = {name: max(abs(loss - fp32[i]) / fp32[i] for i, loss in losses.items()) for name, losses in runs.items()}
    assert drift["fp32_grads"] < 5e-2, drift
    assert runs["fp32_grads"] != runs["bf16_grads"], "the gradient dtype changed nothing"
    # Megatron-LM's validate_args: under bf16, --grad-reduce-in-bf16 turns --accumulate-allreduce-grads-in-fp32 off.
    out = tmp_path / "both"
    out.mkdir()
    both, _ = train(trestle, setup, out, "--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                    tp=2, dp=2, iters=10)
    assert both == runs["bf16_grads"]
    manifest = json.loads((tmp_path / "fp32_grads" / "save" / "iter_0000010" / "manifest.json").read_text())
    assert manifest["tensors"]["decoder.final_layernorm.weight"]["dtype"] == "bf16"
    assert manifest["tensors"]["optimizer.fp32_param.decoder.final_layernorm.weight"]["dtype"] == "f32"
    print(f"\nbf16 loss drift from fp32 over 10 iterations: {drift}")
    # A constant --loss-scale under bf16 scales the loss as Megatron's optimizer does (a power of two: the same steps).
    out = tmp_path / "scaled"
    out.mkdir()
    scaled, _ = train(trestle, setup, out, "--bf16", "--loss-scale", 1024, tp=2, dp=2, iters=10)
    assert scaled == runs["fp32_grads"]
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert {r["loss_scale"] for r in records if "loss_scale" in r} == {1024.0}


def test_fp16_with_loss_scaling(setup, trestle, reference, tmp_path):
    """fp16 parameters, fp32 masters: Megatron's default initial scale (2^32) overflows, so the first iterations are
    skipped while the dynamic scale halves (hysteresis 1 here); from a workable scale the losses follow fp32's, the
    scale doubles after --loss-scale-window clean iterations, and the scaler's state is saved and resumed."""
    _, fp32 = reference
    out = tmp_path / "overflow"
    out.mkdir()
    train(trestle, setup, out, "--fp16", "--hysteresis", 1, "--log-num-zeros-in-grad", "--log-params-norm", iters=4)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in records] == [2.0 ** 31, 2.0 ** 30, 2.0 ** 29, 2.0 ** 28]
    # Each line counts its interval's skipped steps and, having no stepped one, logs no loss (Megatron's training_log).
    assert [r["skipped_iterations"] for r in records] == [1, 1, 1, 1]
    assert not any("lm_loss" in r for r in records), records
    # A skipped step logs no gradient norm or zero count; its parameter norm, as Megatron's (computed after every
    # train_step), is the unchanged weights'.
    assert not any(key in r for r in records for key in ("grad_norm", "num_zeros")), records
    assert all(r["params_norm"] > 0 for r in records) and len({r["params_norm"] for r in records}) == 1, records

    out = tmp_path / "scaled"
    out.mkdir()
    losses, _ = train(trestle, setup, out, "--fp16", "--initial-loss-scale", 4096, "--loss-scale-window", 4,
                      "--save", tmp_path / "save", "--exit-interval", 10, tp=2, dp=2)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all(r["skipped_iterations"] == 0 for r in records)
    assert [r["loss_scale"] for r in records][:9] == [4096.0] * 3 + [8192.0] * 4 + [16384.0] * 2
    for i, loss in losses.items():
        assert abs(loss - fp32[i]) < 2e-3 * fp32[i], (i, loss, fp32[i])
    manifest = json.loads((tmp_path / "save" / "iter_0000010" / "manifest.json").read_text())
    assert manifest["training"]["loss_scaler"] == {"scale": 16384.0, "growth_tracker": 2, "hysteresis_tracker": 2}
    assert manifest["tensors"]["decoder.final_layernorm.weight"]["dtype"] == "f16"
    assert manifest["tensors"]["optimizer.fp32_param.decoder.final_layernorm.weight"]["dtype"] == "f32"
    # A NaN loss under the dynamic scale is the scaler's to skip (Megatron-LM's validate_args turns
    # --check-for-nan-in-loss-and-grad off for fp16 without --loss-scale): the step is skipped and counted as a nan
    # iteration, and the run goes on; with a constant --loss-scale the check stays on and ends the run.
    out = tmp_path / "nan"
    out.mkdir()
    printed = trestle.run(*train_args(setup, out, "--fp16", "--initial-loss-scale", 4096, "--test-nan", "0:3:loss",
                                      iters=4), timeout=300)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [(r["skipped_iterations"], r["nan_iterations"]) for r in records] == [(0, 0), (0, 0), (1, 1), (0, 0)]
    # Its line prints the loss as 0, as Megatron's does once an earlier step's loss was logged.
    line = [line for line in printed.splitlines() if " iteration        3/" in line]
    assert len(line) == 1 and "| lm loss: 0.000000E+00 |" in line[0] and "lm_loss" not in records[2], line
    constant = trestle.run_raw(*train_args(setup, out, "--fp16", "--loss-scale", 4096, "--test-nan", "0:2:loss",
                                           iters=4), timeout=300)
    assert constant.returncode == 1 and "found NaN or Inf in rank 0" in constant.stderr, constant.stderr[-2000:]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    train(trestle, setup, resumed, "--fp16", "--initial-loss-scale", 4096, "--loss-scale-window", 4, tp=2, dp=2,
          iters=12, load=tmp_path / "save")
    records = [json.loads(line) for line in (resumed / "log.jsonl").read_text().splitlines()]
    # growth tracker 2 restored: iteration 12 is the fourth clean one since the last doubling (a fresh scaler: 4096)
    assert [r["loss_scale"] for r in records] == [16384.0, 32768.0]


def test_megatron_checkpoint_flags_under_their_other_names(setup, trestle, tmp_path):
    """--persistent-save-interval is Megatron-LM's other name for --save-interval (it was an unknown option); the
    non-persistent checkpoints' flags a script gives with --non-persistent-save-interval are accepted and named as
    without effect; --ckpt-step 0 is the tracker's latest, as Megatron reads it (`if args.ckpt_step`), and a negative
    one is refused (it named iter_-000001)."""
    save = tmp_path / "save"
    out = trestle.run(*train_args(setup, tmp_path, "--save", save, "--persistent-save-interval", 2,
                                  "--non-persistent-save-interval", 1, "--non-persistent-ckpt-type", "global", iters=4),
                      timeout=300)
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert "--non-persistent-ckpt-type global" in out, out
    (tmp_path / "resumed").mkdir()
    out = trestle.run(*train_args(setup, tmp_path / "resumed", "--ckpt-step", 0, load=save, iters=6), timeout=300)
    assert f"loaded {save}/iter_0000004 (iteration 4" in out, out
    refused = trestle.run_raw(*train_args(setup, tmp_path / "resumed", "--ckpt-step", -1, load=save, iters=6),
                              timeout=300)
    assert refused.returncode != 0 and "--ckpt-step -1 is not an iteration" in refused.stderr, refused.stderr[-2000:]
