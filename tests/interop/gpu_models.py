"""The tiny models of the GPU training checks (test_train_gpu.py): each family of test_train_families with a vocabulary
of 512, random, saved by transformers with its weights rounded to bf16 (half the bytes to carry; every run of a family
starts from the same weights all the same). `python gpu_models.py DIR` writes them for a GPU machine whose transformers is
older (scripts/gpu-check --prebuild)."""
import pathlib
import sys

import safetensors.torch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def gpu_families():
    """{family: (config class, config)} of test_train_families, with a vocabulary of 512 (the models travel small)."""
    import test_train_families as families
    small = {}
    for family, (config_class, config) in families.FAMILIES.items():
        config = dict(config, vocab_size=512)
        if config.get("vocab_size_per_layer_input"):
            config["vocab_size_per_layer_input"] = 512
        small[family] = (config_class, config)
    return small


def save_models(root):
    """Each family's random transformers model under root/<family>, as test_train_families makes them, its weights
    rounded to bf16."""
    import test_train_families as families
    root = pathlib.Path(root)
    for seed, (family, (config_class, config)) in enumerate(gpu_families().items(), start=11):
        families.save_family_model(root / family, family, config_class, config, seed)
        for path in (root / family).glob("*.safetensors"):
            tensors = safetensors.torch.load_file(path)
            safetensors.torch.save_file({name: t.to(torch.bfloat16) if t.is_floating_point() else t
                                         for name, t in tensors.items()}, path, metadata={"format": "pt"})


if __name__ == "__main__":
    save_models(sys.argv[1])
