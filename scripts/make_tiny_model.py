"""Builds a tiny random Hugging Face model from a config (no download) and saves it as sharded safetensors, with a
tokenizer's files beside it when one is given."""
import argparse
import pathlib
import shutil

import torch
import transformers

CONFIGS = {
    "llama": lambda vocab: transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-shard-size", default="200KB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--tokenizer", help="directory whose tokenizer.json and tokenizer_config.json to copy beside")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = CONFIGS[args.arch](args.vocab_size)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(pathlib.Path(args.tokenizer) / name, pathlib.Path(args.out) / name)
    print(f"made a tiny {args.arch} model in {args.out}")


if __name__ == "__main__":
    main()
