"""bench train's peer: the same model trained by PyTorch eager in Python — transformers' model of the config's family
(fp32, or bf16 with --bf16; SDPA attention where transformers has it for the family, else its eager attention; AdamW
fused on a GPU) built from the same
config.json, the same micro/global batches of consecutive sequence_length + 1 token
windows of the same indexed dataset, the mean token cross-entropy, gradient accumulation, clipping by global norm 1.0
and torch.optim.AdamW (no weight decay on biases and norms), on --threads threads or, with --device cuda, on the GPU.
Prints one JSON line: the seconds of every iteration, the losses, the parameter count and the peak memory (the CUDA
allocator's peak allocation on a GPU, else the peak RSS)."""
import argparse
import json
import resource
import time

import numpy
import torch
import transformers


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--data-prefix", required=True)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    config = transformers.AutoConfig.from_pretrained(args.config)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).train()
    # Biases (GPT-OSS's fused experts keep theirs in 2-D *_bias tensors) and norms are not decayed.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("bias"))]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.999), eps=1e-8, fused=args.device == "cuda")
    # The indexed dataset's token stream (its .idx says the dtype; the corpus's tokenizer gives uint16).
    with open(args.data_prefix + ".idx", "rb") as f:
        header = f.read(18)
    dtype = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 6: numpy.float64,
             7: numpy.float32, 8: numpy.uint16}[header[17]]
    stream = numpy.memmap(args.data_prefix + ".bin", dtype=dtype, mode="r")
    window = args.seq_length + 1
    micro_batches = args.global_batch_size // args.micro_batch_size
    seconds, losses, position = [], [], 0
    for _ in range(args.iters):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        total = torch.zeros((), device=args.device)  # read once per iteration: no host synchronisation per micro-batch
        for _ in range(micro_batches):
            rows = []
            for _ in range(args.micro_batch_size):
                if position + window > len(stream):
                    position = 0
                rows.append(torch.from_numpy(stream[position:position + window].astype(numpy.int64)))
                position += window
            batch = torch.stack(rows).to(args.device)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                     batch[:, 1:].reshape(-1))
            (loss / micro_batches).backward()
            total += loss.detach() / micro_batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()  # the step is queued, not done, when step() returns
        seconds.append(time.perf_counter() - start)
        losses.append(float(total))
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps({"seconds": seconds, "losses": losses,
                      "parameters": sum(p.numel() for p in model.parameters()), "peak_memory_bytes": peak,
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
