"""`trestle reshard` and `trestle diff` on checkpoints converted from `transformers` models: a checkpoint resharded
through several layouts is bit-equal to its source in canonical space (diff exit 0), converts back to a Hugging Face
directory whose tensors equal the original's and whose `transformers` logits are identical, and diff reports real
differences (exit 1) and errors (exit 2).
"""
import json
import os

import pytest
import torch

from models import hf_logits, load_hf_tensors, save_tiny_model

TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35]])


def build(directory, config_class, seed, config):
    save_tiny_model(directory, config_class, config, seed=seed, dtype=torch.bfloat16)
    return str(directory)


def manifest(root):
    iteration = int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())
    return json.load(open(os.path.join(root, f"iter_{iteration:07d}", "manifest.json")))


LLAMA = dict(vocab_size=301, hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=6)
MIXTRAL = dict(vocab_size=211, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("config_class,kwargs,start,chain", [
    ("LlamaConfig", LLAMA, ["--tp", "2", "--pp", "2"],
     [["--tp", "4", "--pp", "1"], ["--tp", "1", "--pp", "3", "--first-stage-layers", "1", "--last-stage-layers", "1"],
      ["--tp", "2", "--pp", "3", "--vpp", "2"], ["--tp", "1", "--pp", "1", "--vpp", "1", "--dp", "2"]]),
    ("MixtralConfig", MIXTRAL, ["--tp", "1", "--ep", "2"],
     [["--ep", "4"], ["--tp", "2", "--ep", "1", "--dp", "1", "--pp", "2"]]),
], ids=["llama", "mixtral"])
def test_reshard_chain_is_lossless(trestle_convert, tmp_path, config_class, kwargs, start, chain):
    trestle = trestle_convert
    hf = build(tmp_path / "hf", config_class, 5, kwargs)
    source = str(tmp_path / "source")
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", source, "-q", *start)
    current = source
    for i, change in enumerate(chain):
        out = str(tmp_path / f"step{i}")
        printed = trestle.run("reshard", current, out, "-q", *change)
        assert "resharded" in printed
        layout = manifest(out)["layout"]
        for flag, value in zip(change[::2], change[1::2], strict=True):
            key = flag.lstrip("-")
            if key in ("tp", "pp", "vpp", "ep", "dp"):
                assert layout[key] == int(value), (flag, layout)
        assert trestle.run_raw("diff", source, out, "-q").returncode == 0
        current = out
    back = str(tmp_path / "back")
    trestle.run("convert", "--from", "trestle", current, "--to", "hf", back, "-q")
    original, converted = load_hf_tensors(hf), load_hf_tensors(back)
    assert original.keys() == converted.keys()
    for name in original:
        assert torch.equal(original[name].view(torch.uint8), converted[name].view(torch.uint8)), name
    assert torch.equal(hf_logits(hf, TOKENS), hf_logits(back, TOKENS))


def test_reshard_dry_run_prints_the_plan(trestle_convert, tmp_path):
    trestle = trestle_convert
    hf = build(tmp_path / "hf", "LlamaConfig", 7, LLAMA)
    ckpt = str(tmp_path / "ckpt")
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "-q", "--tp", "2")
    printed = trestle.run("reshard", ckpt, "--tp", "4", "--pp", "2", "--dry-run")
    assert "from          tp 2, pp 1" in printed and "to            tp 4, pp 2" in printed
    assert "rank 7" in printed and "memory" in printed
    assert not os.path.exists(tmp_path / "never")
    bad = trestle.run_raw("reshard", ckpt, str(tmp_path / "never"), "--tp", "3")
    assert bad.returncode == 1 and "not divisible by 3" in bad.stderr
    assert not os.path.exists(tmp_path / "never")


def test_diff_reports_differences_and_errors(trestle_convert, tmp_path):
    trestle = trestle_convert
    a = build(tmp_path / "a", "LlamaConfig", 1, LLAMA)
    b = build(tmp_path / "b", "LlamaConfig", 2, LLAMA)
    ca, cb = str(tmp_path / "ca"), str(tmp_path / "cb")
    trestle.run("convert", "--from", "hf", a, "--to", "trestle", ca, "-q", "--tp", "2")
    trestle.run("convert", "--from", "hf", b, "--to", "trestle", cb, "-q", "--pp", "2")
    result = trestle.run_raw("diff", ca, cb, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert not report["identical"]
    different = [t for t in report["tensors"] if t["result"] == "different"]
    assert different and all(t["differing"] > 0 and t["max_abs"] > 0 for t in different)
    # Loose enough tolerances accept the difference; the exit code says so.
    assert trestle.run_raw("diff", ca, cb, "-q", "--atol", "100").returncode == 0
    missing = trestle.run_raw("diff", ca, str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "nowhere" in missing.stderr
