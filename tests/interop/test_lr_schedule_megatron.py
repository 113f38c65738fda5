"""Trestle's learning-rate / weight-decay schedule equals megatron-core's OptimizerParamScheduler step for step, for
every decay style and weight-decay increment style, stepping by a global batch of samples as Megatron's training loop
does, with a fractional warmup (--lr-warmup-fraction's) and with a decoupled learning rate (a parameter group of its
own max_lr / min_lr, as megatron-core's optimizer makes for --decoupled-lr); and its saved state is the scheduler's
state_dict (what common.pt's opt_param_scheduler holds), key for key."""
import json
import os
import subprocess

import pytest
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

TOOL = os.environ["TRESTLE_LR_SCHEDULE_TOOL"]


class Groups:
    def __init__(self, decoupled_max=None, decoupled_min=None):
        self.param_groups = [{}, {}]
        if decoupled_max is not None:  # megatron-core's override for is_embedding_or_output_parameter
            self.param_groups[1]["max_lr"] = decoupled_max
            if decoupled_min is not None:
                self.param_groups[1]["min_lr"] = decoupled_min


CASES = [
    # style, init, max, min, warmup, decay, wsd_steps, wsd_style, start_wd, end_wd, wd_steps, wd_style, increment, steps
    ("cosine", 0.0, 3e-4, 3e-5, 80, 800, 0, "exponential", 0.1, 0.1, 800, "constant", 8, 110),
    ("linear", 1e-6, 1e-3, 0.0, 0, 640, 0, "exponential", 0.0, 0.1, 640, "linear", 16, 45),
    ("constant", 0.0, 2e-4, 0.0, 32, 640, 0, "exponential", 0.01, 0.1, 320, "cosine", 4, 200),
    ("inverse-square-root", 0.0, 5e-4, 1e-5, 40, 1000, 0, "exponential", 0.05, 0.05, 1, "constant", 4, 300),
    ("WSD", 0.0, 1e-3, 1e-4, 20, 400, 100, "cosine", 0.1, 0.1, 1, "constant", 4, 110),
    ("WSD", 0.0, 1e-3, 1e-4, 20, 400, 100, "minus_sqrt", 0.1, 0.1, 1, "constant", 4, 110),
    ("WSD", 0.0, 1e-3, 1e-4, 0, 400, 400, "exponential", 0.1, 0.1, 1, "constant", 4, 110),
    # --lr-warmup-fraction 0.013 of 800 samples: a warmup of 10.4
    ("cosine", 0.0, 3e-4, 3e-5, 0.013 * 800, 800, 0, "exponential", 0.1, 0.1, 800, "constant", 4, 210),
    ("inverse-square-root", 0.0, 5e-4, 1e-5, 0.05 * 1000, 1000, 0, "exponential", 0.05, 0.05, 1, "constant", 3, 300),
    # decoupled learning rates: with a minimum of their own, with --min-lr's, and above --lr
    ("cosine", 1e-6, 3e-4, 3e-5, 80, 800, 0, "exponential", 0.1, 0.1, 800, "constant", 8, 110, 1e-3, 1e-4),
    ("linear", 0.0, 1e-3, 1e-4, 0.1 * 640, 640, 0, "exponential", 0.0, 0.1, 640, "linear", 16, 45, 5e-4, None),
    ("WSD", 0.0, 1e-3, 1e-4, 20, 400, 100, "cosine", 0.1, 0.1, 1, "constant", 4, 110, 2e-3, 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[7]}-{c[11]}-warmup{c[4]:g}"
                         + (f"-decoupled{c[14]:g}" if len(c) > 14 else ""))
def test_schedule_matches_megatron(case):
    (style, init, max_lr, min_lr, warmup, decay, wsd_steps, wsd_style, start_wd, end_wd, wd_steps, wd_style,
     increment, steps) = case[:14]
    decoupled = case[14:] if len(case) > 14 else (None, None)
    groups = Groups(*decoupled)
    ref = OptimizerParamScheduler(groups, init_lr=init, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                  lr_decay_steps=decay, lr_decay_style=style, start_wd=start_wd, end_wd=end_wd,
                                  wd_incr_steps=wd_steps, wd_incr_style=wd_style,
                                  wsd_decay_steps=wsd_steps or None, lr_wsd_decay_style=wsd_style)
    expected = []
    for _ in range(steps + 1):
        g = groups.param_groups
        expected.append((g[0]["lr"], g[0]["weight_decay"], g[1]["lr"]))
        ref.step(increment)
    args = [str(v) for v in case[:14]] + (["-" if v is None else str(v) for v in case[14:]])
    out = subprocess.run([TOOL] + args, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert json.loads(lines[-1]) == ref.state_dict()
    got = [tuple(json.loads(line)) for line in lines[:-1]]
    assert len(got) == len(expected)
    if decoupled[0] is not None:
        assert any(e[2] != e[0] for e in expected), "the decoupled rate is the default's: nothing tested"
    for i, ((lr, wd, dlr), (ref_lr, ref_wd, ref_dlr)) in enumerate(zip(got, expected, strict=True)):
        assert lr == pytest.approx(ref_lr, rel=1e-12, abs=1e-18), f"step {i}: lr {lr} vs megatron {ref_lr}"
        assert wd == pytest.approx(ref_wd, rel=1e-12, abs=1e-18), f"step {i}: wd {wd} vs megatron {ref_wd}"
        assert dlr == pytest.approx(ref_dlr, rel=1e-12, abs=1e-18), f"step {i}: decoupled lr {dlr} vs {ref_dlr}"
