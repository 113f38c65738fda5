"""Hostile or unusual PEFT adapters and adapter checkpoints (checked against `peft`'s own files), refused rather than
converted wrongly or run forever: regular expressions that backtrack exponentially, adapter_config.json fields peft
applies in ways plain LoRA does not (layer_replication, PiSSA / OLoRA initialisation, aLoRA), an adapter checkpoint
whose manifest no longer accounts for its stored adapters, outputs inside the sources, special files and invalid JSON
where the adapter's files should be; and the Python package refusing a negative iteration before writing anything.
"""
import json
import os
import pathlib
import shutil
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
from test_peft_convert import HF_TARGETS, LLAMA, make_peft  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("peft_hostile")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=31)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
    make_peft(root / "hf", root / "peft", HF_TARGETS)
    trestle.run("convert", "--from", "hf-peft", root / "peft", "--base", root / "base", "--to", "trestle",
                root / "adapter", "--quiet")
    return root


def edited(setup, out, **fields):
    """A copy of the PEFT adapter with adapter_config.json's `fields` set."""
    shutil.copytree(setup / "peft", out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(fields)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def refused(trestle, *args, says):
    result = trestle.run_raw(*args, timeout=60)
    assert result.returncode != 0, result.stdout
    assert all(s in result.stderr for s in ([says] if isinstance(says, str) else says)), result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def import_args(setup, peft_dir, out):
    return ("convert", "--from", "hf-peft", peft_dir, "--base", setup / "base", "--to", "trestle", out, "--quiet")


@pytest.mark.parametrize("field", ["target_modules", "rank_pattern", "alpha_pattern"])
@pytest.mark.parametrize("pattern", ["(.|.)*q_proj", "(.?){30}.*q_proj"])
def test_exponentially_backtracking_patterns_are_refused_at_once(setup, trestle, tmp_path, field, pattern):
    value = pattern if field == "target_modules" else {pattern: 8}
    bad = edited(setup, tmp_path / "bad", **{field: value})
    start = time.monotonic()
    refused(trestle, *import_args(setup, bad, tmp_path / "out"),
            says=[f"adapter_config.json ({field})", json.dumps(pattern), "more than one way"])
    assert time.monotonic() - start < 20 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$",
                                     r"model.layers.(0|1).(self_attn|mlp).(q|k|v|o|gate|up|down)_proj"])
def test_ordinary_patterns_still_import(setup, trestle, tmp_path, pattern):
    trestle.run(*import_args(setup, edited(setup, tmp_path / "ok", target_modules=pattern), tmp_path / "out"))


@pytest.mark.parametrize("field,value,says", [
    ("layer_replication", [[1, 2], [0, 1]], "layer_replication"),
    ("init_lora_weights", "pissa", "changes the base model's weights"),
    ("init_lora_weights", "pissa_niter_16", "changes the base model's weights"),
    ("init_lora_weights", "olora", "changes the base model's weights"),
    ("alora_invocation_tokens", [5, 6], "aLoRA"),
])
def test_adapters_peft_applies_otherwise_are_refused(setup, trestle, tmp_path, field, value, says):
    bad = edited(setup, tmp_path / "bad", **{field: value})
    shown = json.dumps(value, separators=(",", ":"))
    refused(trestle, *import_args(setup, bad, tmp_path / "out"), says=[f"({field}) = {shown}", says])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_initialisations_of_a_and_b_alone_import(setup, trestle, tmp_path, init):
    trestle.run(*import_args(setup, edited(setup, tmp_path / "ok", init_lora_weights=init), tmp_path / "out"))


@pytest.mark.parametrize("odd, stored", [(torch.float16, "f32"), (torch.float64, "f32")])
def test_adapters_of_mixed_dtypes_are_stored_in_one_that_says_so(setup, trestle, tmp_path, odd, stored):
    """One A in another dtype among f32 ones: f32 holds an f16 exactly; f64 is combined in fp32 (rounded), with a note."""
    tensors = load_file(setup / "peft" / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = tensors[key].to(odd)
    mixed = tmp_path / "mixed"
    shutil.copytree(setup / "peft", mixed)
    save_file(tensors, mixed / "adapter_model.safetensors")
    out = trestle.run(*import_args(setup, mixed, tmp_path / "adapter"))
    assert "note: " in out and ("mixes f16, f32" if odd == torch.float16 else "holds f64 adapters") in out, out
    manifest = json.loads((tmp_path / "adapter" / "iter_0000000" / "manifest.json").read_text())
    assert {t["dtype"] for t in manifest["tensors"].values()} == {stored}
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "back", "--quiet")
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    for name, value in tensors.items():
        assert back[name].dtype == torch.float32, name
        exact = value.dtype != torch.float64
        assert torch.equal(back[name].to(value.dtype), value) if exact else torch.allclose(back[name].double(), value)


def test_stored_adapters_the_manifest_drops_are_refused(setup, trestle, tmp_path):
    shutil.copytree(setup / "adapter", tmp_path / "adapter")
    path = tmp_path / "adapter" / "iter_0000000" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("manifest_xxh3_64", None)
    manifest["model"]["lora"]["target_modules"] = ["linear_qkv", "linear_proj", "linear_fc1"]
    path.write_text(json.dumps(manifest, indent=1))
    dropped = "decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight"
    assert dropped in manifest["tensors"]
    for to, extra in (("hf", ["--merge-lora"]), ("hf-peft", [])):
        refused(trestle, "convert", "--from", "trestle", tmp_path / "adapter", "--to", to, tmp_path / to, *extra,
                says=["the stored tensor decoder.layers.", "linear_fc2.adapter.", "model.lora describes"])
        assert not (tmp_path / to).exists()


def test_an_adapter_checkpoints_bad_configuration_names_its_manifest(setup, trestle, tmp_path):
    shutil.copytree(setup / "adapter", tmp_path / "adapter")
    path = tmp_path / "adapter" / "iter_0000000" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("manifest_xxh3_64", None)
    manifest["model"]["lora"]["alpha"] = 0
    path.write_text(json.dumps(manifest, indent=1))
    refused(trestle, "convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "out",
            says=["manifest.json (model.lora)", "the LoRA alpha must be positive"])
    assert not (tmp_path / "out").exists()


def test_outputs_inside_the_sources_are_refused(setup, trestle, tmp_path):
    shutil.copytree(setup / "base", tmp_path / "base")
    shutil.copytree(setup / "adapter", tmp_path / "adapter")
    before = {p: sorted(os.listdir(p)) for p in (tmp_path / "base" / "iter_0000000",
                                                  tmp_path / "adapter" / "iter_0000000")}
    inside_adapter = tmp_path / "adapter" / "iter_0000000" / "merged"
    inside_base = tmp_path / "base" / "iter_0000000" / "merged"
    for dst in (inside_adapter, inside_base):
        refused(trestle, "convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", dst, "--merge-lora",
                "--base", tmp_path / "base", says="lies inside the source")
    refused(trestle, "convert", "--from", "hf-peft", setup / "peft", "--base", tmp_path / "base", "--to", "trestle",
            tmp_path / "base" / "iter_0000000" / "adapters", "--quiet", says="lies inside the source")
    assert {p: sorted(os.listdir(p)) for p in before} == before


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_special_files_are_named_as_such(setup, trestle, tmp_path, kind, name):
    bad = tmp_path / "bad"
    shutil.copytree(setup / "peft", bad)
    (bad / name).unlink()
    os.mkfifo(bad / name) if kind == "fifo" else (bad / name).mkdir()
    what = "a FIFO" if kind == "fifo" else "a directory"
    refused(trestle, *import_args(setup, bad, tmp_path / "out"), says=f"{name}: not a regular file ({what})")


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_invalid_json_says_where(setup, trestle, tmp_path, value):
    bad = edited(setup, tmp_path / "bad", lora_alpha=float(value.lower().replace("infinity", "inf")))
    assert value in (bad / "adapter_config.json").read_text()  # as Python's json writes it
    message = refused(trestle, *import_args(setup, bad, tmp_path / "out"),
                      says="adapter_config.json: not valid JSON at line ")
    assert "column" in message and "not a JSON object" not in message


def test_python_save_refuses_a_negative_iteration(tmp_path):
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if not path or not os.path.isdir(path):
        pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
    sys.path.insert(0, path)
    import torch
    import trestle as trestle_py
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    with pytest.raises(ValueError, match="iteration -1"):
        trestle_py.save(state, tmp_path / "ck", iteration=-1)
    assert not (tmp_path / "ck").exists() or not os.listdir(tmp_path / "ck")
    trestle_py.save(state, tmp_path / "good", iteration=5)
    with pytest.raises(ValueError, match="iteration -1"):
        trestle_py.save(state, tmp_path / "good", iteration=-1)
    assert (tmp_path / "good" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert sorted(os.listdir(tmp_path / "good")) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
