"""Trestle's learning-rate / weight-decay schedule equals megatron-core's OptimizerParamScheduler step for step, for
every decay style and weight-decay increment style, stepping by a global batch of samples as Megatron's training loop
does; and its saved state is the scheduler's state_dict (what common.pt's opt_param_scheduler holds), key for key."""
import json
import os
import subprocess

import pytest
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

TOOL = os.environ["TRESTLE_LR_SCHEDULE_TOOL"]


class Groups:
    def __init__(self):
        self.param_groups = [{}]


CASES = [
    # style, init, max, min, warmup, decay, wsd_steps, wsd_style, start_wd, end_wd, wd_steps, wd_style, increment, steps
    ("cosine", 0.0, 3e-4, 3e-5, 80, 800, 0, "exponential", 0.1, 0.1, 800, "constant", 8, 110),
    ("linear", 1e-6, 1e-3, 0.0, 0, 640, 0, "exponential", 0.0, 0.1, 640, "linear", 16, 45),
    ("constant", 0.0, 2e-4, 0.0, 32, 640, 0, "exponential", 0.01, 0.1, 320, "cosine", 4, 200),
    ("inverse-square-root", 0.0, 5e-4, 1e-5, 40, 1000, 0, "exponential", 0.05, 0.05, 1, "constant", 4, 300),
    ("WSD", 0.0, 1e-3, 1e-4, 20, 400, 100, "cosine", 0.1, 0.1, 1, "constant", 4, 110),
    ("WSD", 0.0, 1e-3, 1e-4, 20, 400, 100, "minus_sqrt", 0.1, 0.1, 1, "constant", 4, 110),
    ("WSD", 0.0, 1e-3, 1e-4, 0, 400, 400, "exponential", 0.1, 0.1, 1, "constant", 4, 110),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[7]}-{c[11]}")
def test_schedule_matches_megatron(case):
    (style, init, max_lr, min_lr, warmup, decay, wsd_steps, wsd_style, start_wd, end_wd, wd_steps, wd_style,
     increment, steps) = case
    groups = Groups()
    ref = OptimizerParamScheduler(groups, init_lr=init, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                  lr_decay_steps=decay, lr_decay_style=style, start_wd=start_wd, end_wd=end_wd,
                                  wd_incr_steps=wd_steps, wd_incr_style=wd_style,
                                  wsd_decay_steps=wsd_steps or None, lr_wsd_decay_style=wsd_style)
    expected = []
    for _ in range(steps + 1):
        expected.append((groups.param_groups[0]["lr"], groups.param_groups[0]["weight_decay"]))
        ref.step(increment)
    out = subprocess.run([TOOL] + [str(v) for v in case], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert json.loads(lines[-1]) == ref.state_dict()
    got = [tuple(json.loads(line)) for line in lines[:-1]]
    assert len(got) == len(expected)
    for i, ((lr, wd), (ref_lr, ref_wd)) in enumerate(zip(got, expected, strict=True)):
        assert lr == pytest.approx(ref_lr, rel=1e-12, abs=1e-18), f"step {i}: lr {lr} vs megatron {ref_lr}"
        assert wd == pytest.approx(ref_wd, rel=1e-12, abs=1e-18), f"step {i}: wd {wd} vs megatron {ref_wd}"
