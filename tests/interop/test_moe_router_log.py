"""The router losses of an MoE model in `trestle train`'s log (console line, --log-json, TensorBoard), as Megatron-LM's
training_log reports them through megatron-core's aux-loss tracker (track_moe_metrics): z_loss, load_balancing_loss,
seq_load_balancing_loss and global_load_balancing_loss, each without its coefficient, the mean over the MoE layers of
the iteration's mean over its micro-batches; the load-balancing losses summed over the tensor-parallel ranks' tokens and
averaged over the data-parallel ranks, global_aux_loss's summed over all of them, and the z-loss the reporting (last)
rank's own.

The reference is megatron-core's own TopKRouter (its weights the Hugging Face gate's) fed each layer's MoE input from
transformers' Mixtral on megatron-core's samples, its tracker read by track_moe_metrics; global_aux_loss (whose router
buffers need CUDA) is computed from megatron-core's routing scores and loss function. At --lr 0 every iteration's
values follow from the initial model."""
import json
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
import test_train_loop as loop  # noqa: E402

SEQ, ITERS, GBS = 32, 3, 2
MIXTRAL = dict(vocab_size=4096, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
               max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
TYPES, COEFFS, Z_COEFF = ["aux_loss", "seq_aux_loss", "global_aux_loss"], [0.1, 0.2, 0.3], 0.01
NAMES = ["z_loss", "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("moe_log")
    save_tiny_model(root / "hf", "MixtralConfig", MIXTRAL, seed=7)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "ckpt", "--quiet")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", loop.CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    return root


def train(trestle, setup, out, *extra, world=1):
    """A run at --lr 0 logging every iteration; returns its JSON records and its console output."""
    out.mkdir()
    console = trestle.run(
        "train", "--nproc-per-node", world, "--load", setup / "ckpt", "--data-path",
        setup / "data" / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size", 1, "--global-batch-size",
        GBS, "--seq-length", SEQ, "--train-iters", ITERS, "--lr", 0, "--log-interval", 1, "--eval-iters", 0,
        "--moe-router-load-balancing-type", *TYPES, "--moe-aux-loss-coeff", *COEFFS, "--moe-z-loss-coeff", Z_COEFF,
        "--log-json", out / "log.jsonl", "--tensorboard-dir", out / "tb", *extra, timeout=300)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in records if "iteration" in r and "validation" not in r], console


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """Per iteration, per micro-batch m (sample m of the iteration's global batch) and layer: the MoE layer's input
    [seq, 1, hidden] in transformers' Mixtral."""
    import transformers
    tmp = tmp_path_factory.mktemp("moe_log_ref")
    samples = loop.megatron_samples(setup, 0, ITERS * GBS, tmp, seq=SEQ, sizes=[ITERS * GBS, 0, 0])
    model = transformers.MixtralForCausalLM.from_pretrained(setup / "hf", dtype=torch.float32).eval()
    captured = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args: captured.append(args[0].detach().clone()))
             for layer in model.model.layers]
    inputs = []
    with torch.no_grad():
        for s in samples:
            captured.clear()
            model(s["tokens"].unsqueeze(0).long())
            inputs.append([h.transpose(0, 1).contiguous() for h in captured])  # [seq, batch, hidden], Megatron's
    for h in hooks:
        h.remove()
    gates = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    return [inputs[i * GBS:(i + 1) * GBS] for i in range(ITERS)], gates


def megatron_router_log(reference, tokens=slice(None), micro_batches=None):
    """Each iteration's {name: value} from megatron-core 0.16's routers and tracker, over the micro-batches given (all)
    and, for the z-loss, those tokens of each micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{loop.free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    iterations, gates = reference
    layers, experts, topk = MIXTRAL["num_hidden_layers"], MIXTRAL["num_local_experts"], MIXTRAL["num_experts_per_tok"]
    config = TransformerConfig(num_layers=layers, hidden_size=MIXTRAL["hidden_size"], num_attention_heads=4,
                               num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=48,
                               moe_router_load_balancing_type=TYPES[:2], moe_aux_loss_coeff=COEFFS[:2],
                               moe_z_loss_coeff=Z_COEFF, add_bias_linear=False)
    routers = []
    for i, gate in enumerate(gates):
        router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).train()
        router.set_layer_number(i + 1)
        router.weight.data.copy_(gate)
        routers.append(router)
    out = []
    for iteration, batches in enumerate(iterations, start=1):
        batches = batches if micro_batches is None else [batches[m] for m in micro_batches]
        z_only = [[h[tokens] for h in per_layer] for per_layer in batches]
        with torch.enable_grad():
            for per_layer, z_per_layer in zip(batches, z_only, strict=True):
                for router, gate, h, hz in zip(routers, gates, per_layer, z_per_layer, strict=True):
                    # (TopKRouter.gating moves its weights to a GPU: the logits come from the same weights here)
                    router.routing(torch.nn.functional.linear(h, gate))  # its losses into the tracker
                    # The z-loss over `tokens` only: the tracker's full-sequence one replaced.
                    tracker = moe_utils.get_moe_layer_wise_logging_tracker()["z_loss"]["values"]
                    full = moe_utils.z_loss_func(torch.nn.functional.linear(h, gate).view(-1, 4), Z_COEFF) / Z_COEFF
                    part = moe_utils.z_loss_func(torch.nn.functional.linear(hz, gate).view(-1, 4), Z_COEFF) / Z_COEFF
                    tracker[router.layer_number - 1] += (part - full).detach()
        totals = {}
        moe_utils.track_moe_metrics(loss_scale=1 / len(batches), iteration=iteration, total_loss_dict=totals,
                                    track_names=NAMES[:3], num_layers=layers, moe_layer_freq=1)
        record = {name: float(value) for name, value in totals.items()}
        # global_aux_loss: the expert counts summed over the iteration's micro-batches so far, averaged over them.
        total = 0.0
        for layer in range(layers):
            running = torch.zeros(experts)
            for m, per_layer in enumerate(batches, start=1):
                logits = per_layer[layer].view(-1, MIXTRAL["hidden_size"]) @ gates[layer].t()
                routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, "softmax")
                running += routing_map.sum(0).float()
                total += float(moe_utils.switch_load_balancing_loss_func(
                    scores, running / m, logits.size(0), topk, experts, 1.0)) / len(batches)
        record["global_load_balancing_loss"] = total / layers
        out.append(record)
    return out


def test_router_losses_are_logged_as_megatron_core_tracks_them(setup, trestle, reference, tmp_path):
    records, console = train(trestle, setup, tmp_path / "tp1", "--moe-per-layer-logging")
    expected = megatron_router_log(reference)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for record, want in zip(records, expected, strict=True):
        for name in NAMES:
            assert record[name] == pytest.approx(want[name], rel=1e-5), (record["iteration"], name, record, want)
    assert len({r["load_balancing_loss"] for r in records}) == ITERS  # each iteration its own batches
    # The console line names them in the order megatron-core's tracker holds them: the router computes its z-loss first.
    line = [x for x in console.splitlines() if "iteration        2/" in x][0]
    fields = [f.split(":")[0].strip() for f in line.split("|")]
    assert fields.index("lm loss") < fields.index("z_loss") < fields.index("load_balancing_loss") < fields.index(
        "seq_load_balancing_loss") < fields.index("global_load_balancing_loss"), line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tp1" / "tb"))
    events.Reload()
    for name in NAMES:
        assert [e.step for e in events.Scalars(name)] == list(range(1, ITERS + 1))
        per_layer = [{e.step: e.value for e in events.Scalars(f"moe/{name}_layer_{i}")} for i in range(2)]
        for record in records:
            it = record["iteration"]
            assert (per_layer[0][it] + per_layer[1][it]) / 2 == pytest.approx(record[name], rel=1e-5)


def test_router_losses_reduce_over_tensor_and_data_parallel_ranks_as_megatron(setup, trestle, reference, tmp_path):
    """tp 2 with sequence parallelism x dp 2: the load-balancing losses sum the tp ranks' halves of each sequence and
    average the dp ranks (the run-alone values, each dp rank one of the two samples); global_aux_loss counts the
    experts over both samples; the z-loss is the last rank's: dp rank 1's sample, its second half of the sequence."""
    records, _ = train(trestle, setup, tmp_path / "tp2dp2", "--tensor-model-parallel-size", 2, "--sequence-parallel",
                       world=4)
    alone = megatron_router_log(reference)
    last_rank = megatron_router_log(reference, tokens=slice(SEQ // 2, None), micro_batches=[1])
    for record, want, last in zip(records, alone, last_rank, strict=True):
        for name in ("load_balancing_loss", "seq_load_balancing_loss"):
            assert record[name] == pytest.approx(want[name], rel=1e-5), (name, record, want)
        assert record["z_loss"] == pytest.approx(last["z_loss"], rel=1e-5), (record, last)
        assert record["z_loss"] != pytest.approx(want["z_loss"], rel=1e-3)
    # Both samples' experts counted at once (one micro-batch per rank): the loss over the iteration's tokens.
    iterations, gates = reference
    from megatron.core.transformer.moe import moe_utils
    for record, batches in zip(records, iterations, strict=True):
        total = 0.0
        for layer, gate in enumerate(gates):
            logits = torch.cat([b[layer].view(-1, MIXTRAL["hidden_size"]) for b in batches]) @ gate.t()
            routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
            total += float(moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0).float(),
                                                                     logits.size(0), 2, 4, 1.0))
        assert record["global_load_balancing_loss"] == pytest.approx(total / len(gates), rel=1e-5), record
