"""The loss of a Hugging Face model (transformers, fp32) on the validation samples of the final evaluation of a
`trestle train` (or Megatron-LM) run: eval_iters x global_batch_size samples of the validation split, after those of
the train_iters // eval_interval periodic evaluations before it (Megatron reads the split through one iterator), as
megatron-core's GPTDataset builds them for the same data, split, seed, sequence length and sample counts. Prints
{"loss": ..., "samples": ..., "first_sample": ..., "tokens": ...} as JSON."""
import argparse
import collections
import json
import logging
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import transformers

# megatron-core announces at import that Transformer Engine and Apex are missing, torch that CUDA is; neither matters.
warnings.filterwarnings("ignore")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402


class _Tokenizer:
    """What GPTDatasetConfig needs of a tokenizer (the samples do not depend on it)."""

    def __init__(self, vocab_size):
        self.unique_identifiers = collections.OrderedDict([("class", "hf_eval_loss")])
        self.vocab_size = vocab_size
        self.eod = 0


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="Hugging Face model directory")
    parser.add_argument("--data-path", required=True, help="indexed dataset prefix")
    parser.add_argument("--split", default="969, 30, 1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--eval-interval", type=int, default=1000)
    parser.add_argument("--eval-iters", type=int, default=100)
    args = parser.parse_args()

    # The experts as a loop: transformers' default grouped GEMM refuses expert sizes whose strides are not multiples of
    # 16 bytes on the CPU.
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    with tempfile.TemporaryDirectory() as scratch:
        if not dist.is_initialized():  # megatron-core's builder asks torch.distributed for the rank
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(scratch, 'store')}", rank=0,
                                    world_size=1)
        config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                                  blend=([args.data_path], None), split=args.split,
                                  tokenizer=_Tokenizer(model.config.vocab_size), reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False,
                                  path_to_cache=os.path.join(scratch, "cache"))
        gbs = args.global_batch_size
        counts = [args.train_iters * gbs, (args.train_iters // args.eval_interval + 1) * args.eval_iters * gbs,
                  args.eval_iters * gbs]
        _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, counts, lambda: True, config).build()
        first = args.train_iters // args.eval_interval * args.eval_iters * gbs
        total, tokens = 0.0, 0.0
        with torch.no_grad():
            for i in range(first, first + args.eval_iters * gbs):
                sample = valid[i]
                logits = model(sample["tokens"].unsqueeze(0).long()).logits[0].float()
                losses = torch.nn.functional.cross_entropy(logits, sample["labels"].long(), reduction="none")
                total += float((losses * sample["loss_mask"]).sum())
                tokens += float(sample["loss_mask"].sum())
    print(json.dumps({"loss": total / tokens, "samples": args.eval_iters * gbs, "first_sample": first,
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
