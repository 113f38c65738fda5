#!/usr/bin/env python3
"""The Python side of `trestle bench convert`: a straightforward Hugging Face <-> Megatron (TP/PP) conversion of a
Llama checkpoint with safetensors + torch, as a script would write it.

  to-megatron SRC DST --tp T --pp P   reads SRC's safetensors lazily (safe_open), builds each pipeline stage's TP-rank
                                      state dicts (per-group QKV, [gate_r; up_r], padded vocab, row/column splits) and
                                      saves DST/mp_rank_{tp:02d}_{pp:03d}/model.safetensors, stage-local layer numbers
  to-hf SRC DST                        reassembles the full Hugging Face state dict from those rank files and saves it

Every written file is fsynced. Prints one JSON line: {"seconds": S, "bytes_written": B, "peak_rss_bytes": R}, where S
excludes the interpreter's start-up and imports.
"""
import argparse
import json
import os
import resource
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(tensors, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata={"format": "pt"})
    fsync_file(path)
    return os.path.getsize(path)


class Source:
    """Every tensor of a (possibly sharded) safetensors directory, opened lazily."""

    def __init__(self, directory):
        self.handles = {}
        for f in sorted(os.listdir(directory)):
            if f.endswith(".safetensors"):
                handle = safe_open(os.path.join(directory, f), "pt")
                for k in handle.keys():
                    self.handles[k] = handle

    def __getitem__(self, name):
        return self.handles[name].get_tensor(name)


def to_megatron(src, dst, tp, pp):
    config = json.load(open(os.path.join(src, "config.json")))
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads", heads)
    vocab = config["vocab_size"]
    padded = -(-vocab // (128 * tp)) * 128 * tp
    hf = Source(src)
    written = 0
    per_stage = layers // pp

    def vocab_split(w):
        return torch.nn.functional.pad(w, (0, 0, 0, padded - vocab)).chunk(tp)

    for stage in range(pp):
        ranks = [{} for _ in range(tp)]
        if stage == 0:
            for r, part in enumerate(vocab_split(hf["model.embed_tokens.weight"])):
                ranks[r]["embedding.word_embeddings.weight"] = part.clone()
        for local in range(per_stage):
            i = stage * per_stage + local
            p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            q, k, v = hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]
            hidden = q.shape[1]
            qkv = torch.cat([q.view(groups, -1, hidden), k.view(groups, -1, hidden), v.view(groups, -1, hidden)], 1)
            qkv = qkv.reshape(-1, hidden).chunk(tp)
            gate, up = hf[p + "mlp.gate_proj.weight"].chunk(tp), hf[p + "mlp.up_proj.weight"].chunk(tp)
            proj = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)
            down = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)
            norm1, norm2 = hf[p + "input_layernorm.weight"], hf[p + "post_attention_layernorm.weight"]
            for r in range(tp):
                ranks[r][m + "self_attention.linear_qkv.weight"] = qkv[r].clone()
                ranks[r][m + "self_attention.linear_qkv.layer_norm_weight"] = norm1
                ranks[r][m + "self_attention.linear_proj.weight"] = proj[r].clone()
                ranks[r][m + "mlp.linear_fc1.weight"] = torch.cat([gate[r], up[r]])
                ranks[r][m + "mlp.linear_fc1.layer_norm_weight"] = norm2
                ranks[r][m + "mlp.linear_fc2.weight"] = down[r].clone()
        if stage == pp - 1:
            for r in range(tp):
                ranks[r]["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
            for r, part in enumerate(vocab_split(hf["lm_head.weight"])):
                ranks[r]["output_layer.weight"] = part.clone()
        for r in range(tp):
            written += save(ranks[r], os.path.join(dst, f"mp_rank_{r:02d}_{stage:03d}", "model.safetensors"))
        del ranks
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(config, megatron={"tp": tp, "pp": pp}), f)
    return written


def to_hf(src, dst):
    config = json.load(open(os.path.join(src, "config.json")))
    tp, pp = config["megatron"]["tp"], config["megatron"]["pp"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    vocab = config["vocab_size"]
    per_stage = layers // pp
    out = {}
    for stage in range(pp):
        ranks = [Source(os.path.join(src, f"mp_rank_{r:02d}_{stage:03d}")) for r in range(tp)]
        if stage == 0:
            out["model.embed_tokens.weight"] = torch.cat([s["embedding.word_embeddings.weight"] for s in ranks])[:vocab]
        for local in range(per_stage):
            i = stage * per_stage + local
            p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            qkv = torch.cat([s[m + "self_attention.linear_qkv.weight"] for s in ranks])
            hidden = qkv.shape[1]
            qkv = qkv.view(groups, -1, hidden)
            per_group = heads // groups * head_dim
            out[p + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, hidden).clone()
            out[p + "self_attn.k_proj.weight"] = qkv[:, per_group:per_group + head_dim].reshape(-1, hidden).clone()
            out[p + "self_attn.v_proj.weight"] = qkv[:, per_group + head_dim:].reshape(-1, hidden).clone()
            out[p + "self_attn.o_proj.weight"] = torch.cat([s[m + "self_attention.linear_proj.weight"] for s in ranks], 1)
            fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in ranks]
            out[p + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
            out[p + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
            out[p + "mlp.down_proj.weight"] = torch.cat([s[m + "mlp.linear_fc2.weight"] for s in ranks], 1)
            out[p + "input_layernorm.weight"] = ranks[0][m + "self_attention.linear_qkv.layer_norm_weight"]
            out[p + "post_attention_layernorm.weight"] = ranks[0][m + "mlp.linear_fc1.layer_norm_weight"]
        if stage == pp - 1:
            out["model.norm.weight"] = ranks[0]["decoder.final_layernorm.weight"]
            out["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in ranks])[:vocab]
    written = save(out, os.path.join(dst, "model.safetensors"))
    config.pop("megatron")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-megatron", "to-hf"])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.direction == "to-megatron":
        written = to_megatron(args.src, args.dst, args.tp, args.pp)
    else:
        written = to_hf(args.src, args.dst)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "bytes_written": written, "peak_rss_bytes": peak}))


if __name__ == "__main__":
    main()
