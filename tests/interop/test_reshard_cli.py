"""`trestle reshard` and `trestle diff` on checkpoints converted from `transformers` models: a checkpoint resharded
through several layouts is bit-equal to its source in canonical space (diff exit 0), converts back to a Hugging Face
directory whose tensors equal the original's and whose `transformers` logits are identical, and diff reports real
differences (exit 1) and errors (exit 2).
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    assert bad.returncode == 1 and "not divisible by the tensor-parallel size (3)" in bad.stderr, bad.stderr
    assert not os.path.exists(tmp_path / "never")


def with_rank_state(root, states):
    """The checkpoint's manifest with `states` as its per-rank training state (the manifest's checksum dropped: a
    manifest without one is read unchecked)."""
    path = os.path.join(root, "iter_0000000", "manifest.json")
    record = json.load(open(path))
    record.pop("manifest_xxh3_64", None)
    record["training"]["ranks"] = states
    json.dump(record, open(path, "w"))


def test_reshard_keeps_rank_state_on_its_layout_and_names_the_dp_it_chooses(trestle_convert, tmp_path):
    """Per-rank state (the trainer's RNG) stays where the layout is unchanged and goes where the ranks change; an --ep
    the source's dp cannot take raises dp to the smallest multiple of it that can, with a note; an output inside the
    checkpoint directory of the iteration read is refused."""
    trestle = trestle_convert
    hf = build(tmp_path / "hf", "MixtralConfig", 3, MIXTRAL)
    source = str(tmp_path / "source")
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", source, "-q", "--ep", "2")
    assert manifest(source)["layout"]["dp"] == 2
    states = [{"cpu_rng_state": "00"}, {"cpu_rng_state": "01"}]
    with_rank_state(source, states)

    same = str(tmp_path / "same")
    assert "note:" not in trestle.run("reshard", source, same, "-q", "--ep", "2")
    assert manifest(same)["training"]["ranks"] == states

    moved = str(tmp_path / "moved")
    printed = trestle.run("reshard", source, moved, "-q", "--ep", "4")
    assert "note: dp 2 -> 4: ep 4 needs cp x dp to be a multiple of it" in printed, printed
    assert manifest(moved)["layout"]["dp"] == 4
    assert not any(manifest(moved)["training"].get("ranks", []))
    # dp 3 -> 6 for ep 2: the smallest multiple of the source's dp that ep divides.
    three = str(tmp_path / "three")
    trestle.run("reshard", source, three, "-q", "--ep", "1", "--dp", "3")
    six = str(tmp_path / "six")
    assert "note: dp 3 -> 6" in trestle.run("reshard", three, six, "-q", "--ep", "2")
    assert manifest(six)["layout"]["dp"] == 6

    inside = os.path.join(source, "iter_0000009")
    refused = trestle.run_raw("reshard", os.path.join(source, "iter_0000000"), inside, "--tp", "1")
    assert refused.returncode == 1 and "inside the checkpoint directory" in refused.stderr, refused.stderr
    assert not os.path.exists(inside)


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
    # Loose enough tolerances accept the difference; the exit code and each line say so (a differing tensor within the
    # tolerance was printed DIFFERENT and counted as "not").
    tolerated = trestle.run_raw("diff", ca, cb, "-q", "--atol", "100")
    assert tolerated.returncode == 0 and "DIFFERENT" not in tolerated.stdout, tolerated.stdout
    assert f"{len(different)} different within the tolerance, 0 not" in tolerated.stdout, tolerated.stdout
    assert "different, within the tolerance: " in tolerated.stdout
    strict = trestle.run_raw("diff", ca, cb, "-q")
    assert strict.returncode == 1 and "DIFFERENT: " in strict.stdout and f"{len(different)} not" in strict.stdout
    missing = trestle.run_raw("diff", ca, str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "nowhere" in missing.stderr


def with_element(hf, directory, bits):
    """A copy of the float32 Hugging Face model `hf` whose model.layers.1.mlp.down_proj.weight[5, 7] holds `bits`;
    converted to a Trestle checkpoint at `directory`/ckpt, whose path is returned."""
    shutil.copytree(hf, directory / "hf")
    path = str(directory / "hf" / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"].view(torch.int32)[5, 7] = bits
    save_file(tensors, path, metadata={"format": "pt"})
    return str(directory / "ckpt")


def test_diff_compares_values_and_says_which_differ_only_in_bits(trestle_convert, tmp_path):
    """+0 / -0 and two NaN payloads are equal in value (exit 0) but not "bit-equal"; an infinity against a finite value
    or the other infinity is never within a tolerance (it once passed --atol 1e300 and --rtol 10, with max rel 0)."""
    trestle = trestle_convert
    hf = str(tmp_path / "hf")
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=9)
    ckpt = {}
    for name, bits in (("pz", 0), ("nz", -2**31), ("nan1", 0x7fc00000), ("nan2", 0x7fc00001), ("inf", 0x7f800000),
                       ("ninf", -0x800000)):
        ckpt[name] = with_element(hf, tmp_path / name, bits)
        trestle.run("convert", "--from", "hf", tmp_path / name / "hf", "--to", "trestle", ckpt[name], "-q")
    fc2 = "decoder.layers.1.mlp.linear_fc2.weight"

    def line(result, start):
        return next(l for l in result.stdout.splitlines() if l.startswith(start))

    for a, b in (("pz", "nz"), ("nan1", "nan2")):
        result = trestle.run_raw("diff", ckpt[a], ckpt[b], "-q")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "equal in value, 1 of 3072 elements differ in bits" in line(result, fc2), result.stdout
        assert "1 equal in value with bits differing, 0 not" in result.stdout
        report = json.loads(trestle.run_raw("diff", ckpt[a], ckpt[b], "--json").stdout)
        assert report["identical"] and not report["bit_identical"], report
        entry = next(t for t in report["tensors"] if t["name"] == fc2)
        assert (entry["result"], entry["bit_equal"], entry["differing"], entry["bits_differing"]) == (
            "equal", False, 0, 1)
    same = trestle.run_raw("diff", ckpt["nan1"], ckpt["nan1"], "-q", "--all")
    assert same.returncode == 0 and "bit-equal (3072 elements)" in line(same, fc2), same.stdout
    for a, b in (("pz", "inf"), ("inf", "pz"), ("inf", "ninf")):
        for tolerance in ([], ["--atol", "1e300"], ["--rtol", "10"], ["--atol", "1e300", "--rtol", "1e300"]):
            result = trestle.run_raw("diff", ckpt[a], ckpt[b], "-q", *tolerance)
            assert result.returncode == 1, (a, b, tolerance, result.stdout)
            assert "max abs inf, max rel inf (1 NaN or infinite against another value)" in line(result, fc2)


def test_inspect_checksums_reads_a_trestle_checkpoint(trestle_convert, tmp_path):
    """--checksums on a Trestle checkpoint digests every tensor as it does a Hugging Face directory's (it once printed
    nothing and read nothing), and a corrupt block is an error naming the tensor and the file."""
    trestle = trestle_convert
    hf = build(tmp_path / "hf", "LlamaConfig", 11, LLAMA)
    ckpt = str(tmp_path / "ckpt")
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "-q", "--tp", "2", "--pp", "2")
    digests = {t["name"]: t["xxh3_64"] for t in trestle.inspect(ckpt)["tensors"]}
    hf_digests = {t["name"]: t["xxh3_64"] for t in trestle.inspect(hf)["tensors"]}
    assert digests["decoder.final_layernorm.weight"] == hf_digests["model.norm.weight"]
    assert digests["embedding.word_embeddings.weight"] == hf_digests["model.embed_tokens.weight"]
    assert all(len(d) == 16 for d in digests.values()), digests
    table = trestle.run("inspect", ckpt, "--checksums")
    assert next(l for l in table.splitlines() if l.startswith("name ")).split()[-1] == "xxh3_64", table
    assert digests["decoder.final_layernorm.weight"] in table
    rank_file = os.path.join(ckpt, "iter_0000000", "rank_00001.bin")
    with open(rank_file, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x55]))
    assert trestle.run_raw("inspect", ckpt).returncode == 0  # without --checksums no tensor data is read
    result = trestle.run_raw("inspect", ckpt, "--checksums")
    assert result.returncode == 1, result.stdout
    assert "rank_00001.bin" in result.stderr and "checksum mismatch" in result.stderr, result.stderr
    assert any(f"tensor '{name}'" in result.stderr for name in digests), result.stderr
