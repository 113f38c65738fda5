"""Trestle's AdamW (fp32 master weights, decoupled weight decay on >= 2-D parameters only, Megatron's clipping by
global norm) against torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ on the same parameters and gradients: the
updated fp32 weights agree within 1e-6 (fp32 parameters) and the masters of bf16 parameters follow the fp32 update of
the bf16 gradients."""
import json
import os
import subprocess

import pytest
import torch

TOOL = os.environ["TRESTLE_ADAMW_TOOL"]
SHAPES = [(4, 5), (7,), (3, 2, 2)]


def reference(seed, steps, dtype, lr, wd, clip):
    torch.manual_seed(seed)
    params = [torch.randn(s).to(dtype) for s in SHAPES]
    masters = [p.float().clone().requires_grad_(True) for p in params]
    decay = [m for m, s in zip(masters, SHAPES, strict=True) if len(s) > 1]
    no_decay = [m for m, s in zip(masters, SHAPES, strict=True) if len(s) <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    norms = []
    for s in range(steps):
        for m, p in zip(masters, params, strict=True):
            m.grad = torch.randn(p.shape).to(dtype).float()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip)))
        else:
            norms.append(float(torch.sqrt(sum((m.grad.double() ** 2).sum() for m in masters))))
        for group in opt.param_groups:
            group["lr"] = lr * (s + 1) / steps
        opt.step()
    return norms, [m.detach() for m in masters]


@pytest.mark.parametrize("dtype,clip", [("f32", 0.0), ("f32", 1.0), ("bf16", 0.5)])
def test_adamw_matches_torch(dtype, clip):
    seed, steps, lr, wd = 1234, 6, 1e-2, 0.1
    out = subprocess.run([TOOL, str(seed), str(steps), dtype, str(lr), str(wd), str(clip)],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    norms, masters = reference(seed, steps, torch.bfloat16 if dtype == "bf16" else torch.float32, lr, wd, clip)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    for mine, theirs in zip(got["params"], masters, strict=True):
        diff = (torch.tensor(mine) - theirs.flatten()).abs().max().item()
        assert diff <= 1e-6, f"max abs diff {diff}"
