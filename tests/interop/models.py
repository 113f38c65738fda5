"""Shared helpers of the interop tests: tiny random `transformers` models saved with save_pretrained, reading a Hugging
Face directory's tensors and logits back, bit-exact comparison of tensors, the layout of Megatron-style roots, and a
checkpoint entry replaced by a link that readers must refuse."""
import json
import os

import safetensors.torch
import torch
import transformers


def save_tiny_model(directory, config_class, config, *, seed, dtype=None, randomise_vectors=True, tokenizer_config=None,
                    **save_kwargs):
    """Builds a random `transformers.<config_class>(**config)` causal LM seeded with `seed`, cast to `dtype` (when given),
    and saves it to `directory` with save_pretrained(**save_kwargs); returns the model.

    randomise_vectors: norms start at exactly 1 and biases at 0 (GPT-OSS's per-expert *_bias tensors too), so they are
    perturbed (randn * 0.1) to make a misplaced one show. tokenizer_config: a dict written as tokenizer_config.json
    beside the weights."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**config))
    if dtype is not None:
        model = model.to(dtype)
    model = model.eval()
    if randomise_vectors:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("_bias"):
                    p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, **save_kwargs)
    if tokenizer_config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)
    return model


def load_hf_tensors(directory):
    """Every tensor of every *.safetensors file in `directory`, by name."""
    tensors = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            tensors.update(safetensors.torch.load_file(os.path.join(directory, f)))
    return tensors


def check_state_against_mapping(hf_dir, state, expected):
    """Asserts every tensor of a megatron-core model's `state` (extra states aside) equals expected(hf_tensors, config,
    name), what the family's mapping makes of the Hugging Face checkpoint in `hf_dir`; returns how many were compared."""
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    checked = 0
    for name, value in state.items():
        if name.endswith("_extra_state"):
            continue
        want = expected(hf, config, name)
        assert value.shape == want.shape and torch.equal(value, want.to(value.dtype)), name
        checked += 1
    return checked


def hf_logits(directory, tokens):
    """The logits transformers computes for `tokens` with the model saved in `directory`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(tokens).logits


def assert_bit_exact(expected, got):
    """The same names, and for each the same dtype, shape and bytes."""
    assert set(expected) == set(got), (sorted(expected), sorted(got))
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8),
                           tensor.contiguous().reshape(-1).view(torch.uint8)), name


def iteration_dir(root):
    """The iteration directory that `root`'s latest_checkpointed_iteration.txt names (iter_0000007)."""
    latest = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    return os.path.join(root, f"iter_{int(latest):07d}")


def assert_link_is_not_followed(run_raw, entry, elsewhere, commands, out):
    """Moves checkpoint entry `entry` (a file or directory) into the directory `elsewhere` and puts a link to it in its
    place; then each command (run by `run_raw`) must exit 1 naming the link, and `out` must not exist."""
    elsewhere.mkdir(exist_ok=True)
    moved = elsewhere / entry.name
    entry.rename(moved)
    entry.symlink_to(moved)
    for args in commands:
        result = run_raw(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert f"{entry}: a symbolic link" in result.stderr, (args, result.stderr)
    assert not out.exists()
