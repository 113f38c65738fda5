"""Checkpoints altered after they were written, each refused naming what is wrong rather than read as something else:
a torch_dist chunk moved onto its neighbour (the element count unchanged), an item file, .metadata, common.pt,
metadata.json, trestle_model.json, iteration directory or tracker that is a link; a Trestle
iteration directory or manifest that is a link, a zstd block claiming more than any Zstandard frame holds, a carried
tokenizer file edited with the same size (reshard and convert would copy it into their outputs), a weight stored as
integers, a missing weight (verify), a manifest of another iteration; an output inside its own source. A tensor cut
into 40,000 chunks is checked in well under the time a pairwise check took (minutes).
"""
import dataclasses
import json
import os
import pickle
import shutil
import time

import pytest

from models import assert_link_is_not_followed, save_tiny_model
from test_hostile_manifests import LLAMA, edit_manifest, manifest_path


@pytest.fixture
def hf(tmp_path):
    directory = tmp_path / "hf"
    save_tiny_model(directory, "LlamaConfig", LLAMA, seed=0, tokenizer_config={"model_max_length": 64})
    return directory


@pytest.fixture
def ckpt(tmp_path, trestle, hf):
    out = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", out, "--tp", "2", "--quiet")
    return out


@pytest.fixture
def dist(tmp_path, trestle, hf):
    out = tmp_path / "dist"
    trestle.run("convert", "--from", "hf", hf, "--to", "megatron-dist", out, "--tp", "2", "--quiet")
    return out / "iter_0000000"


def refused(trestle, expected, *args):
    result = trestle.run_raw(*args)
    assert result.returncode == 1, (args, result.returncode, result.stdout, result.stderr)
    assert expected in result.stderr, (args, result.stderr)


def test_torch_dist_chunk_moved_onto_its_neighbour_is_refused(trestle, dist, tmp_path):
    # The embedding's two tp chunks (rows [0, 49) and [49, 97)): the second moved up by 10 rows overlaps the first and
    # leaves the last 10 rows stored nowhere, with the element count unchanged. Read as it was, the tensor came out
    # shifted, and verify said ok.
    metadata_path = dist / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())  # written by Trestle, read back with PyTorch's classes
    name = "embedding.word_embeddings.weight"
    tensor = metadata.state_dict_metadata[name]
    moved = tensor.chunks[1]
    offsets = type(moved.offsets)([moved.offsets[0] - 10, 0])
    tensor.chunks[1] = type(moved)(offsets=offsets, sizes=moved.sizes)
    key = next(k for k in metadata.storage_data if k.fqn == name and k.offset == moved.offsets)
    metadata.storage_data[dataclasses.replace(key, offset=offsets)] = metadata.storage_data.pop(key)
    metadata_path.write_bytes(pickle.dumps(metadata))
    for args in (["verify", dist.parent], ["convert", "--from", "megatron-dist", dist.parent, "--to", "hf",
                                            tmp_path / "out_hf"],
                 ["reshard", dist.parent, tmp_path / "out", "--tp", "1"]):
        refused(trestle, "embedding.word_embeddings.weight': chunks", *args)
    assert not (tmp_path / "out_hf").exists()


def test_torch_dist_item_file_that_is_a_link_is_refused(trestle, dist, tmp_path):
    item = sorted(dist.glob("*.distcp"))[0]
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(item, outside)
    os.symlink(outside, item)
    refused(trestle, "a symbolic link", "convert", "--from", "megatron-dist", dist.parent, "--to", "hf",
            tmp_path / "out_hf")


@pytest.mark.parametrize("linked", [".metadata", "common.pt", "metadata.json", "trestle_model.json", "iteration",
                                    "tracker"])
def test_torch_dist_entries_replaced_by_links_are_not_followed(trestle, dist, tmp_path, linked):
    """(each was followed out of the checkpoint before; the item files already were not)"""
    entry = {"iteration": dist, "tracker": dist.parent / "latest_checkpointed_iteration.txt"}.get(linked, dist / linked)
    assert entry.exists(), entry
    commands = [["verify", dist.parent], ["convert", "--from", "megatron-dist", dist.parent, "--to", "hf",
                                          tmp_path / "out_hf"]]
    assert_link_is_not_followed(trestle.run_raw, entry, tmp_path / "elsewhere", commands, tmp_path / "out_hf")


@pytest.mark.parametrize("which", ["iteration", "manifest"])
def test_trestle_iteration_or_manifest_that_is_a_link_is_refused(trestle, ckpt, tmp_path, which):
    target = manifest_path(ckpt).parent if which == "iteration" else manifest_path(ckpt)
    outside = tmp_path / ("outside_" + target.name)
    shutil.move(target, outside)
    os.symlink(outside, target)
    for args in (["verify", ckpt], ["reshard", ckpt, tmp_path / "out", "--tp", "1"]):
        refused(trestle, "a symbolic link", *args)


def test_zstd_block_claiming_more_than_a_frame_holds_is_refused(trestle, tmp_path, hf):
    ckpt = tmp_path / "zstd"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "--codec", "zstd", "--quiet")
    name = "decoder.final_layernorm.weight"

    def claim(m):
        # One block of 2^34 raw bytes in the chunk's few stored bytes: refused before 16 GiB is allocated for it.
        chunk = m["tensors"][name]["chunks"][0]
        m["tensors"][name]["global_shape"] = [1 << 32]
        chunk["shape"] = [1 << 32]
        chunk["block_bytes"] = 1 << 34
        chunk["xxh3_64"] = chunk["xxh3_64"][:1]
        chunk["block_stored_bytes"] = [chunk["stored_bytes"]]
    edit_manifest(ckpt, claim)
    refused(trestle, "which no Zstandard frame decompresses to its 17179869184 raw bytes", "verify", ckpt)


def test_edited_carried_file_is_not_copied_into_outputs(trestle, ckpt, tmp_path):
    side = manifest_path(ckpt).parent / "hf_files" / "tokenizer_config.json"
    side.write_text('{"model_max_length": 65}')  # the same size, other contents
    for args in (["reshard", ckpt, tmp_path / "out", "--tp", "1"],
                 ["convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "out_hf"],
                 ["convert", "--from", "trestle", ckpt, "--to", "megatron-dist", tmp_path / "out_dist"]):
        refused(trestle, "tokenizer_config.json: contents differ from the manifest's record", *args)
    assert not any((tmp_path / name).exists() for name in ("out", "out_hf", "out_dist"))


def test_integer_weights_are_refused(trestle, ckpt, tmp_path, hf):
    name = "decoder.final_layernorm.weight"
    edit_manifest(ckpt, lambda m: m["tensors"][name].update(dtype="i32"))  # same width: the bytes still fit
    refused(trestle, f"tensor '{name}' is stored as i32; a model weight must be floating point", "convert", "--from",
            "trestle", ckpt, "--to", "hf", tmp_path / "out_hf")

    from safetensors.torch import load_file, save_file
    weights = load_file(hf / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(__import__("torch").int32)
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    refused(trestle, "'model.norm.weight' is stored as", "convert", "--from", "hf", hf, "--to", "trestle",
            tmp_path / "out_trestle")


def test_output_inside_the_source_is_refused(trestle, ckpt, hf):
    refused(trestle, "lies inside the source", "reshard", ckpt, ckpt / "iter_0000001", "--tp", "1")
    refused(trestle, "is the source", "reshard", ckpt, ckpt, "--tp", "1")
    refused(trestle, "lies inside the source", "convert", "--from", "hf", hf, "--to", "trestle", hf / "out")
    assert not (ckpt / "iter_0000001").exists() and not (hf / "out").exists()


def test_many_chunks_are_checked_quickly(trestle, ckpt):
    # The final norm (32 elements) becomes one tensor of 40,000 single-element chunks: a valid manifest. The
    # coverage check compared every pair (0.8 billion for 40,000); it now sweeps.
    count = 40_000
    name = "decoder.final_layernorm.weight"
    directory = manifest_path(ckpt).parent
    import numpy
    import xxhash
    data = numpy.arange(count, dtype=numpy.float32).tobytes()
    (directory / "rank_00099.bin").write_bytes(data)

    def split(m):
        m["tensors"][name]["global_shape"] = [count]
        m["tensors"][name]["dtype"] = "f32"
        m["tensors"][name]["chunks"] = [
            dict(offset=[i], shape=[1], file="rank_00099.bin", byte_offset=4 * i, stored_bytes=4, codec="raw",
                 block_bytes=4, xxh3_64=[xxhash.xxh3_64_hexdigest(data[4 * i:4 * i + 4])]) for i in range(count)]
    edit_manifest(ckpt, split)
    start = time.monotonic()
    trestle.run("inspect", ckpt)
    assert time.monotonic() - start < 60


def test_verify_accounts_for_every_weight(trestle, ckpt):
    # verify checked blocks only: a manifest without one of the model's weights, or with a tensor the model does not
    # have, passed (reshard and convert refused them).
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    edit_manifest(ckpt, lambda m: m["tensors"].pop(name))
    refused(trestle, name, "verify", ckpt)


def test_manifest_of_another_iteration_is_refused(trestle, ckpt, tmp_path):
    edit_manifest(ckpt, lambda m: m.update(iteration=7))
    refused(trestle, "records iteration 7, but it is in iter_0000000", "verify", ckpt)


def test_verify_refuses_a_model_directory_describing_other_heads(trestle, ckpt, dist, hf, tmp_path):
    # The same tensors under 8 heads of 4 and 4 KV heads (the shapes unchanged: 8 x 4 = 4 x 8, 4 x 4 = 2 x 8) are
    # another model: its fused QKV splits differently. verify compared the tensors only and said ok.
    other = tmp_path / "other_heads"
    shutil.copytree(hf, other)
    config = json.loads((other / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=4)
    (other / "config.json").write_text(json.dumps(config))
    for checkpoint in (ckpt, dist.parent):
        assert "ok:" in trestle.run("verify", checkpoint, "--against", hf)
        refused(trestle, "config.json: num_attention_heads is 8, but", "verify", checkpoint, "--against", other)


@pytest.mark.parametrize("change, words", [
    (dict(num_hidden_layers=3), "describes a model with decoder.layers.2."),
    (dict(hidden_size=48), "describes decoder.final_layernorm.weight as [48]"),
    (dict(vocab_size=2**34), "describes embedding.word_embeddings.weight as [17179869184,"),
    (dict(tie_word_embeddings=True), "describes a model without output_layer.weight"),
    (dict(rope_theta=12345.0), "rope_theta is 12345"),
], ids=["layers", "hidden", "vocab", "tied", "rope_theta"])
def test_verify_refuses_a_model_directory_whose_config_describes_another_model(trestle, ckpt, dist, hf, tmp_path,
                                                                              change, words):
    """The directory's tensors are the checkpoint's, but its config.json (what transformers builds) says otherwise:
    verify --against named no difference (its tensors matched the checkpoint's own model)."""
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    config = json.loads((other / "config.json").read_text())
    config.update(change)
    (other / "config.json").write_text(json.dumps(config))
    for checkpoint in (ckpt, dist.parent):
        refused(trestle, words, "verify", checkpoint, "--against", other)


def test_config_errors_name_the_file_and_layout_errors_the_parallel_size(trestle, hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_key_value_heads"] = 0
    (bad / "config.json").write_text(json.dumps(config))
    refused(trestle, f"{bad / 'config.json'}: LlamaForCausalLM: config's num_key_value_heads is 0",
            "convert", "--from", "hf", bad, "--to", "trestle", tmp_path / "out")
    refused(trestle, "number of query groups (KV heads) (2) is not divisible by the tensor-parallel size (4)",
            "convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "out", "--tp", "4")
    refused(trestle, "number of layers (2) is not divisible by the pipeline x virtual pipeline size 2 x 2 (4)",
            "convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "out", "--pp", "2", "--vpp", "2")
    weights = hf / "model.safetensors"
    refused(trestle, f"{weights}: not a directory; a Hugging Face model is read from its directory",
            "convert", "--from", "hf", weights, "--to", "trestle", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _SystemCall:
    """Pickles as a call of os.system, as a hostile common.pt would hold it (never unpickled here)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_args_that_are_not_a_namespace_are_named(trestle, dist, tmp_path):
    # A torch_dist checkpoint without Trestle's kept model whose common.pt 'args' is a call of os.system: it was read
    # as a Namespace and reported as "args describe an MLP without swiglu".
    import torch
    common = dist / "common.pt"
    state = torch.load(common, weights_only=False)
    marker = tmp_path / "ran"
    state["args"] = _SystemCall(f"touch {marker}")
    torch.save(state, common)
    (dist / "trestle_model.json").unlink()
    for args in (["verify", dist.parent], ["convert", "--from", "megatron-dist", dist.parent, "--to", "hf",
                                            tmp_path / "out_hf"]):
        refused(trestle, "'args' is posix.system(", *args)
        refused(trestle, "not an argparse.Namespace, so nothing describes the model; give the model's config.json "
                "with --hf-config", *args)
    assert not marker.exists() and not (tmp_path / "out_hf").exists()


def test_manifest_layout_out_of_range_is_refused(trestle, ckpt, tmp_path):
    # Inspect refused a recorded layout of tp 0; verify, reshard and convert read past it.
    edit_manifest(ckpt, lambda m: m["layout"].update(tp=0))
    for args in (["verify", ckpt], ["reshard", ckpt, tmp_path / "out", "--tp", "1"],
                 ["convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "out_hf"]):
        refused(trestle, "manifest.json: layout 'tp' must be an integer from 1, not 0", *args)


def test_torch_dist_root_without_its_tracker_is_named_as_such(trestle, dist, tmp_path):
    """(inspect told of safetensors files it did not find, verify that nothing was recognised)"""
    (dist.parent / "latest_checkpointed_iteration.txt").unlink()
    for args in (["inspect", dist.parent], ["verify", dist.parent]):
        refused(trestle, "neither a torch_dist directory (.metadata) nor a root with latest_checkpointed_iteration.txt",
                *args)
