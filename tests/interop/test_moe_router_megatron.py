"""The MoE router's arithmetic (train/model/moe_router.h) against megatron-core's own functions on CPU, fp32:
top-k routing with softmax after and before the top-k, sigmoid with and without the expert-score correction bias,
group-limited top-k, scaling; the scores and map the aux loss uses; the load-balancing (aux) loss and the z-loss;
the permutation of tokens by expert (permute) and its weighted inverse (unpermute); token dropping over the experts'
capacity (apply_router_token_dropping) at four capacity factors, by probability and by position, padded or not.
Routing maps must be identical and every value within 1e-6. (megatron-core keeps an expert's tied candidates in
torch.topk's order, which is not defined: where the policy's key ties (by position always, by probability where the
top-1 weights are all 1, and the weight-0 tokens padding fills up with) Trestle keeps the earliest tokens, and what is
compared is how many each expert keeps.)"""
import math
import os
import subprocess

import numpy as np
import pytest
import torch

from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    permute,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    unpermute,
    z_loss_func,
)

CASES = [
    # tokens, experts, topk, score, pre_softmax, groups, group_topk, scaling, bias
    (37, 8, 2, "softmax", False, 0, 0, 0.0, False),     # Mixtral
    (37, 8, 2, "softmax", True, 0, 0, 0.0, False),      # Qwen3-MoE style pre-softmax
    (64, 16, 1, "softmax", False, 0, 0, 0.0, False),
    (50, 16, 4, "sigmoid", False, 0, 0, 2.5, True),     # DeepSeek-V3: sigmoid, bias, scaling
    (50, 16, 4, "sigmoid", False, 4, 2, 2.5, True),     # ... with group-limited top-k
    (29, 12, 3, "softmax", True, 3, 1, 0.0, False),
    (40, 6, 1, "sigmoid", False, 0, 0, 0.0, False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[3]}-k{c[2]}-g{c[5]}{'-pre' if c[4] else ''}" for c in CASES])
def test_router_matches_megatron_core(tmp_path, case):
    tool = os.environ.get("TRESTLE_MOE_ROUTER_TOOL")
    if not tool:
        pytest.fail("set TRESTLE_MOE_ROUTER_TOOL (ctest does this)")
    tokens, experts, topk, score, pre, groups, group_topk, scaling, with_bias = case
    g = torch.Generator().manual_seed(tokens * experts + topk)
    logits = torch.randn(tokens, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.1 if with_bias else None
    logits.numpy().tofile(tmp_path / "logits.f32")
    if bias is not None:
        bias.numpy().tofile(tmp_path / "bias.f32")
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([tool, tmp_path / "logits.f32", str(tokens), str(experts), str(topk), score,
                             "1" if pre else "0", str(groups), str(group_topk), str(scaling),
                             tmp_path / "bias.f32" if bias is not None else "-", out],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

    def read(name, dtype, shape):
        return torch.from_numpy(np.fromfile(out / name, dtype=dtype).reshape(shape))

    probs, routing_map = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre, num_groups=groups or None, group_topk=group_topk or None,
        scaling_factor=scaling or None, score_function=score, expert_bias=bias)
    assert torch.equal(read("map.u8", np.uint8, (tokens, experts)).bool(), routing_map)
    torch.testing.assert_close(read("probs.f32", np.float32, (tokens, experts)), probs, atol=1e-6, rtol=0)

    aux_map, aux_scores = compute_routing_scores_for_aux_loss(logits, topk, score)
    assert torch.equal(read("aux_map.u8", np.uint8, (tokens, experts)).bool(), aux_map)
    torch.testing.assert_close(read("aux_scores.f32", np.float32, (tokens, experts)), aux_scores, atol=1e-6, rtol=0)
    aux_loss = switch_load_balancing_loss_func(aux_scores, aux_map.sum(dim=0), tokens, topk, experts, 0.01)
    torch.testing.assert_close(read("aux_loss.f32", np.float32, ()), aux_loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(read("z_loss.f32", np.float32, ()), z_loss_func(logits, 0.001), atol=1e-7, rtol=1e-6)

    # token dispatch: grouped by expert, and back with the routing weights
    tokens_in = torch.arange(tokens * 8, dtype=torch.float32).reshape(tokens, 8) / 10
    permuted, _, sorted_indices = permute(tokens_in, routing_map)
    routed = int(routing_map.sum())
    assert torch.equal(read("sorted.i64", np.int64, (routed,)), sorted_indices)
    assert torch.equal(read("permuted.f32", np.float32, (routed, 8)), permuted)
    assert torch.equal(read("per_expert.i64", np.int64, (experts,)), routing_map.sum(dim=0))
    restored = unpermute(permuted * 2, sorted_indices, tokens_in.shape, probs=probs, routing_map=routing_map)
    torch.testing.assert_close(read("restored.f32", np.float32, (tokens, 8)), restored, atol=1e-6, rtol=0)

    variant = 0
    dropped_any = False
    for factor in (0.5, 1.0, 1.25, 8.0):
        for policy in ("probs", "position"):
            for pad in (False, True):
                kept_probs, kept_map = apply_router_token_dropping(probs, routing_map, topk, factor, policy, pad)
                got_probs = read(f"drop{variant}_probs.f32", np.float32, (tokens, experts))
                got_map = read(f"drop{variant}_map.u8", np.uint8, (tokens, experts)).bool()
                variant += 1
                what = (factor, policy, pad)
                assert torch.equal(got_map.sum(0), kept_map.sum(0)), what
                dropped_any |= bool(kept_map.sum() < routing_map.sum()) and not pad
                ties = policy == "position" or probs[routing_map].unique().numel() < int(routing_map.sum())
                if not ties:  # the routed tokens kept (padding takes other tokens, tied at weight 0, to fill up)
                    assert torch.equal(got_map & routing_map, kept_map & routing_map), what
                    torch.testing.assert_close(got_probs, kept_probs, atol=1e-6, rtol=0)
                    continue
                # The earliest candidates kept: every routed token an expert keeps comes before every one it drops.
                capacity = math.ceil(tokens * topk / experts * factor)
                for e in range(experts):
                    routed = torch.nonzero(routing_map[:, e]).flatten()
                    kept = torch.nonzero(got_map[:, e] & routing_map[:, e]).flatten()
                    assert torch.equal(kept, routed[:min(capacity, routed.numel())]), (what, e)
                torch.testing.assert_close(got_probs, probs * got_map, atol=0, rtol=0)
    assert dropped_any, "no factor dropped a token: nothing tested"


def test_bad_router_options_are_refused(tmp_path):
    tool = os.environ["TRESTLE_MOE_ROUTER_TOOL"]
    torch.zeros(4, 6).numpy().tofile(tmp_path / "logits.f32")
    for args, says in ((["7", "softmax", "0", "0", "0"], "topk 7"),
                       (["2", "tanh", "0", "0", "0"], "score function 'tanh'"),
                       (["2", "softmax", "0", "4", "2"], "group-limited routing")):
        result = subprocess.run([tool, tmp_path / "logits.f32", "4", "6", *args, "0", "-", tmp_path],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and says in result.stderr, (args, result.stderr)
