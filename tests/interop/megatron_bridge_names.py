"""Megatron-Bridge's name mappings for Hugging Face models, as JSON: what test_megatron_bridge_names.py checks Trestle's
Megatron tensor names against.

    python megatron_bridge_names.py [--wheels DIR] BRIDGE=MODEL_DIR ...

For each MODEL_DIR (a Hugging Face directory) this does what Megatron-Bridge's conversions do: it opens the model with
AutoBridge.from_hf_pretrained(MODEL_DIR) (lazily: the weights are not read), checks that the model bridge AutoBridge
dispatches to is the class BRIDGE, gives that bridge the model as build_conversion_tasks does and prints its
mapping_registry(): each mapping's Megatron name pattern, its Hugging Face name(s) (a string, or a dict such as
{"q": ..., "k": ..., "v": ...}) and its class. So the registry is the one this model gets: layer counts and
multi-token-prediction layer indexes come from its config.json, and bridges that look at the checkpoint's tensor
names (fused or per-expert experts) see its own.

Run by the venv's python: Megatron-Bridge 0.6.2 wants Python 3.12 and is not installed in the venv (which keeps its own
megatron-core for the other tests). scripts/setup unzips its wheels (scripts/requirements-megatron-bridge.txt) into
DIR (default $TRESTLE_MEGATRON_BRIDGE, else ~/.cache/trestle/megatron-bridge), one folder each, put here ahead of
site-packages. Three shims make it import under Python 3.11 with no Transformer Engine; none touches a mapping:
1. typing.override (Python 3.12, PEP 698) is typing_extensions.override: a decorator that returns the method it is
   given, with __override__ = True set on it; megatron-core 0.19's training/models/{gpt,hybrid}.py import it.
2. megatron/bridge/peft/lora_layers.py does `import transformer_engine.pytorch as te` unconditionally, for LoRA
   layers' runtime and one return annotation. A dummy transformer_engine is in sys.modules while that one module is
   imported (its own imports done before) and removed right after, so every other `try: import transformer_engine`
   finds none (HAVE_TE False), as on a machine without it; mapping_registry() uses no LoRA layer.
3. For (2) to come first, megatron/bridge/__init__.py runs after lora_layers rather than before it: the package is
   created empty, lora_layers and its own imports are imported, then the package's real __init__.py runs in it. It
   imports what it always imports (every model bridge, registering each with AutoBridge's dispatch, and the
   diffusion bridges), only later.
"""
import argparse
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import types
import typing
import warnings


class _Dummy(types.ModuleType):
    """Any attribute is a dummy: a submodule for a lower-case name, an empty class otherwise."""

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        value = _Dummy(f"{self.__name__}.{item}") if item[:1].islower() else type(item, (), {})
        setattr(self, item, value)
        return value


def import_megatron_bridge(wheels):
    """Imports Megatron-Bridge from the unzipped wheels in `wheels` with the shims of the docstring; returns it."""
    sys.path[0:0] = [os.path.join(wheels, folder) for folder in ("megatron_bridge", "megatron_core", "omegaconf")]
    import typing_extensions
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # shim 1

    import megatron  # a namespace package: the wheels' megatron/ folders, then the venv's
    package = os.path.join(wheels, "megatron_bridge", "megatron", "bridge")
    spec = importlib.machinery.ModuleSpec("megatron.bridge", None, is_package=True)
    spec.submodule_search_locations = [package]
    bridge = importlib.util.module_from_spec(spec)
    bridge.__file__ = os.path.join(package, "__init__.py")
    sys.modules["megatron.bridge"] = megatron.bridge = bridge  # shim 3: the package, its __init__ not yet run

    # lora_layers' own imports first, so that none of them sees the dummy
    import megatron.bridge.peft.adapter_wrapper  # noqa: F401
    import megatron.bridge.peft.lora_merge  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    te = _Dummy("transformer_engine")
    te.pytorch = _Dummy("transformer_engine.pytorch")
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})  # shim 2
    try:
        import megatron.bridge.peft.lora_layers  # noqa: F401
    finally:
        del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]

    with open(bridge.__file__) as f:  # shim 3: the package's own __init__, now
        exec(compile(f.read(), bridge.__file__, "exec"), bridge.__dict__)
    return bridge


def mappings(auto_bridge_class, bridge_name, model_dir):
    """[{"megatron", "hf", "class"[, "permute_dims"]}]: the registry of the model bridge for the model in model_dir."""
    auto = auto_bridge_class.from_hf_pretrained(model_dir)
    model_bridge = auto._model_bridge
    # as build_conversion_tasks sets them before it asks for the registry: some bridges pick mappings by the
    # checkpoint's tensor names (its experts fused or one by one)
    model_bridge.hf_pretrained, model_bridge.hf_config = auto.hf_pretrained, auto.hf_pretrained.config
    if type(model_bridge).__name__ != bridge_name:
        raise SystemExit(f"{model_dir}: AutoBridge dispatches to {type(model_bridge).__name__}, not {bridge_name}")
    rows = []
    for m in model_bridge.mapping_registry().mappings:
        row = {"megatron": m.megatron_param, "hf": m.hf_param, "class": type(m).__name__}
        if getattr(m, "permute_dims", None) is not None:
            row["permute_dims"] = list(m.permute_dims)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", default=os.environ.get("TRESTLE_MEGATRON_BRIDGE") or os.path.expanduser(
        "~/.cache/trestle/megatron-bridge"))
    parser.add_argument("models", nargs="+", metavar="BRIDGE=MODEL_DIR")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.wheels, "megatron_bridge", "megatron", "bridge")):
        raise SystemExit(f"no unzipped Megatron-Bridge wheel in {args.wheels}: run scripts/setup")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    stdout, sys.stdout = sys.stdout, sys.stderr  # what the imports print is not the JSON
    bridge = import_megatron_bridge(args.wheels)
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    out = {"megatron_bridge": bridge.__version__, "models": []}
    for model in args.models:
        name, model_dir = model.split("=", 1)
        out["models"].append({"bridge": name, "model": model_dir, "mappings": mappings(AutoBridge, name, model_dir)})
    json.dump(out, stdout)


if __name__ == "__main__":
    main()
