"""Megatron's --profile --use-pytorch-profiler in `trestle train`: PyTorch's profiler records the iterations after
--profile-step-start up to --profile-step-end and writes a Chrome trace (JSON that chrome://tracing and Perfetto read:
its traceEvents hold the operators the trainer ran) into --tensorboard-dir, and prints the operators by time; the
other iterations and the losses are those of a run without it; a bad range or --profile alone is refused. `bench
train --data-path --profile`: both sides train on a given indexed dataset, and one more trainer run is profiled."""
import json
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import test_train_loop as loop  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu"}


@pytest.fixture(scope="module")
def data(trestle, tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "kjv",
                "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    (root / "config.json").write_text(json.dumps(CONFIG))
    return root


def train(trestle, data, out, *extra):
    return trestle.run_raw("train", "--model-config", data / "config.json", "--data-path", data / "kjv_text_document",
                           "--split", "98,2,0", "--micro-batch-size", 2, "--global-batch-size", 4, "--seq-length", 32,
                           "--train-iters", 5, "--lr", 1e-3, "--log-interval", 1, "--eval-iters", 0, "--log-json",
                           out / "log.jsonl", "--device", "cpu", *extra, timeout=300)


def test_profile_writes_a_trace_and_a_table_and_changes_no_loss(trestle, data, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "profiled").mkdir()
    plain = train(trestle, data, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    profiled = train(trestle, data, tmp_path / "profiled", "--profile", "--use-pytorch-profiler",
                     "--profile-step-start", 2, "--profile-step-end", 4, "--tensorboard-dir", tmp_path / "tb")
    assert profiled.returncode == 0, profiled.stderr
    assert loop.read_losses(tmp_path / "profiled" / "log.jsonl") == loop.read_losses(tmp_path / "plain" / "log.jsonl")
    trace = tmp_path / "tb" / "trace_rank0_iterations_3-4.json"
    assert "profile of rank 0, iterations 3-4" in profiled.stdout and str(trace) in profiled.stdout, profiled.stdout
    assert re.search(r"\baten::\w+ ", profiled.stdout), profiled.stdout  # the table's ATen rows (load orders them)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert any(n and n.startswith("aten::") for n in names), sorted(n for n in names if n)[:20]


@pytest.mark.parametrize("flag", ["--pytorch-profiler-collect-shapes", "--record-shapes"])
def test_collect_shapes_records_each_operators_inputs(trestle, data, tmp_path, flag):
    # Megatron's --pytorch-profiler-collect-shapes: the trace's operators carry their inputs' shapes and dtypes (as
    # PyTorch's record_shapes writes them) and the table names each operator with its inputs.
    result = train(trestle, data, tmp_path, "--profile", "--use-pytorch-profiler", "--profile-step-start", 2,
                   "--profile-step-end", 3, "--tensorboard-dir", tmp_path / "tb", flag)
    assert result.returncode == 0, result.stderr
    assert flag not in result.stdout + result.stderr, "taken as a flag without effect"
    events = json.loads((tmp_path / "tb" / "trace_rank0_iterations_3-3.json").read_text())["traceEvents"]
    dims = [e["args"]["Input Dims"] for e in events if e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {})]
    # Micro-batches of 2 x 32 tokens, hidden 64: the forward's fused qkv GEMM (4 query heads and 2 key / value heads
    # of 16: 128 columns) and fc1's (SwiGLU, 2 x 96 columns) on 64 rows.
    firsts = [d[:2] for d in dims]
    assert [[64, 64], [64, 128]] in firsts and [[64, 64], [64, 192]] in firsts, dims
    # (the table's rows are the most expensive operators, which the machine's load reorders: any ATen one will do)
    assert re.search(r"aten::\w+ \((\d+x)+\d+ Float", result.stdout), result.stdout


def test_without_collect_shapes_the_trace_has_no_inputs(trestle, data, tmp_path):
    result = train(trestle, data, tmp_path, "--profile", "--use-pytorch-profiler", "--profile-step-start", 2,
                   "--profile-step-end", 3, "--tensorboard-dir", tmp_path / "tb")
    assert result.returncode == 0, result.stderr
    events = json.loads((tmp_path / "tb" / "trace_rank0_iterations_3-3.json").read_text())["traceEvents"]
    assert not any("Input Dims" in e.get("args", {}) for e in events)
    assert not re.search(r"aten::\w+ \(\d", result.stdout), result.stdout


@pytest.mark.parametrize("extra,needle", [
    (["--profile"], "add --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", 4, "--profile-step-end", 4],
     "--profile-step-end (4) must be above --profile-step-start (4)"),
])
def test_profile_refuses_what_it_cannot_do(trestle, data, tmp_path, extra, needle):
    result = train(trestle, data, tmp_path, *extra)
    assert result.returncode != 0 and needle in result.stderr, result.stderr


def test_bench_train_on_a_given_dataset_with_a_profile(trestle, data, tmp_path):
    report = tmp_path / "bench.json"
    out = trestle.run("bench", "train", "--hidden", 64, "--layers", 1, "--ffn", 96, "--heads", 4, "--kv-heads", 2,
                      "--vocab", 512, "--seq-length", 32, "--micro-batch-size", 1, "--global-batch-size", 2,
                      "--iters", 5, "--warmup", 2, "--python", sys.executable, "--data-path",
                      data / "kjv_text_document", "--profile", tmp_path / "prof", "--json", report, timeout=300)
    result = json.loads(report.read_text())
    assert result["sizes"]["vocab"] == 512 and result["trestle"]["tokens_per_s"] > 0, result
    assert result["pytorch"]["tokens_per_s"] > 0, result
    assert "profile of rank 0, iterations 3-4" in out, out  # two of the three timed iterations
    assert (tmp_path / "prof" / "trace_rank0_iterations_3-4.json").is_file()
    missing = trestle.run_raw("bench", "train", "--data-path", tmp_path / "nothing")
    assert missing.returncode == 2 and "no " in missing.stderr and ".bin and .idx" in missing.stderr, missing.stderr
