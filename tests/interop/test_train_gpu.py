"""Every family trains on a GPU as it trains on the CPU. Each family of test_train_families (its tiny config, with a
vocabulary of 512), a random transformers model converted by `trestle convert`, trains 20 iterations at tp 1 on the
bytes of the bundled KJV corpus three times: on the CPU in fp32, on the GPU in fp32 and on the GPU in bf16 (fp32 master
weights). The GPU's fp32 losses equal the CPU's (1e-6 relative at every iteration; the CPU's are the ones
test_train_families checks against transformers), and its bf16 losses stay within 2% of them and fall.

The whole file is skipped without a GPU. On a GPU machine without the network, scripts/gpu-check runs it with the models
made beforehand (TRESTLE_GPU_MODELS, written by gpu_models.py through `scripts/gpu-check --prebuild`): that machine's
transformers may predate some families."""
import concurrent.futures
import json
import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no GPU on this machine: the GPU training checks need one", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import test_train_loop as loop  # noqa: E402
from gpu_models import gpu_families, save_models  # noqa: E402

ITERS, SEQ, MBS, GBS = 20, 32, 2, 8
# Measured on an H200 (torch 2.11): fp32 within 1.1e-7 of the CPU, bf16 within 5.4e-3 (DeepSeek-V3).
FP32_REL, BF16_REL = 1e-6, 2e-2
RUNS = {"cpu-fp32": ["--device", "cpu"], "cuda-fp32": ["--device", "cuda"], "cuda-bf16": ["--device", "cuda", "--bf16"]}


@pytest.fixture(scope="module")
def runs(trestle, tmp_path_factory):
    """{family: {run: {iteration: lm loss}}} of every family's three runs, eight processes at a time."""
    root = tmp_path_factory.mktemp("gpu")
    models = pathlib.Path(os.environ["TRESTLE_GPU_MODELS"]) if os.environ.get("TRESTLE_GPU_MODELS") else root / "hf"
    if not os.environ.get("TRESTLE_GPU_MODELS"):
        save_models(models)
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "kjv",
                "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    for family in gpu_families():
        trestle.run("convert", "--from", "hf", models / family, "--to", "trestle", root / family / "ckpt", "--quiet")

    def train(family, run):
        out = root / family / run
        out.mkdir(parents=True)
        trestle.run("train", "--data-path", root / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size",
                    MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", ITERS, "--lr", 3e-3,
                    "--min-lr", 3e-4, "--lr-warmup-iters", 3, "--lr-decay-style", "cosine", "--weight-decay", 0.1,
                    "--clip-grad", 1.0, "--adam-beta2", 0.95, "--log-interval", 1, "--eval-iters", 0, "--log-json",
                    out / "log.jsonl", "--load", root / family / "ckpt", *RUNS[run], timeout=600)
        return loop.read_losses(out / "log.jsonl")[0]

    jobs = [(family, run) for family in gpu_families() for run in RUNS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {job: pool.submit(train, *job) for job in jobs}
    results = {}
    for (family, run), future in futures.items():
        try:
            results.setdefault(family, {})[run] = future.result()
        except Exception as error:  # reported by the family's own test
            results.setdefault(family, {})[run] = error
    summary = {family: {run: (losses if isinstance(losses, dict) else repr(losses)) for run, losses in by_run.items()}
               for family, by_run in results.items()}
    if os.environ.get("TRESTLE_GPU_REPORT"):
        pathlib.Path(os.environ["TRESTLE_GPU_REPORT"]).write_text(json.dumps(summary, indent=1))
    return results


def largest_gap(losses, reference):
    return max(abs(losses[i] - reference[i]) / abs(reference[i]) for i in reference)


@pytest.mark.parametrize("family", list(gpu_families()))
def test_family_trains_on_the_gpu_as_on_the_cpu(runs, family):
    by_run = runs[family]
    for run, losses in by_run.items():
        if isinstance(losses, Exception):
            raise AssertionError(f"{family}: the {run} run failed") from losses
        assert sorted(losses) == list(range(1, ITERS + 1)), (family, run, sorted(losses))
    cpu, fp32, bf16 = by_run["cpu-fp32"], by_run["cuda-fp32"], by_run["cuda-bf16"]
    print(f"{family}: fp32 GPU vs CPU largest relative gap {largest_gap(fp32, cpu):.2e}, bf16 {largest_gap(bf16, cpu):.2e}"
          f"; CPU losses {cpu[1]:.4f} -> {cpu[ITERS]:.4f}")
    assert cpu[ITERS] < cpu[1] - 0.3, f"{family}: the loss does not fall: {cpu}"
    assert largest_gap(fp32, cpu) <= FP32_REL, f"{family}: fp32 GPU losses {fp32} differ from the CPU's {cpu}"
    assert largest_gap(bf16, cpu) <= BF16_REL, f"{family}: bf16 GPU losses {bf16} differ from fp32 CPU's {cpu}"
    assert bf16[ITERS] < bf16[1] - 0.3, f"{family}: the bf16 loss does not fall: {bf16}"
