"""The peer of `trestle train` in the family parity tests: a `transformers` model trained on Megatron's recipe with
torch's own AdamW and megatron-core's learning-rate scheduler, on the global batches Megatron's GPTDataset gives.

Megatron's recipe, as `trestle train` runs it: each global batch is cut into micro-batches, each micro-batch's loss is
the mean over its tokens (loss mask applied) and its gradient is divided by the number of micro-batches; gradients are
clipped by their global norm; AdamW decays 2-D weights only (biases and norm weights are in a group with no decay);
the learning rate follows megatron-core's OptimizerParamScheduler (warmup, then cosine, counted in samples), stepped by
the global batch after each optimizer step. Megatron's embedding has no padding row, so transformers' padding_idx
(which keeps one row's gradient at zero) is cleared. A vision-language model trains on text alone: its vision tower
and projector are frozen (trestle train carries them unchanged)."""
import math

import torch
import transformers


def is_vision_language(hf_dir):
    return hasattr(transformers.AutoConfig.from_pretrained(hf_dir), "vision_config")


def auto_model(hf_dir):
    """The transformers Auto class that loads the model in `hf_dir`: a vision-language model's (which also runs on
    text alone) or a causal LM's."""
    return transformers.AutoModelForImageTextToText if is_vision_language(hf_dir) else transformers.AutoModelForCausalLM


def train_transformers(hf_dir, samples, *, iters, global_batch, micro_batch, lr, min_lr, warmup_iters, weight_decay,
                       clip_grad, beta1=0.9, beta2=0.999, eps=1e-8, attn_implementation="eager",
                       expert_bias_update_rate=0.0, peft_adapter=None, context_parallel=1, per_token_loss=False,
                       warmup_steps=None, decay_steps=None, wd_incr_steps=None, decoupled_lr=None,
                       decoupled_min_lr=None, decayed_norms=(), skipped_iterations=(), batch_sizes=None):
    """Trains the model saved in `hf_dir` (fp32) on `samples` (Megatron's GPTDataset samples: tokens, labels,
    loss_mask; iteration i reads samples [(i-1)·global_batch, i·global_batch)) and returns {iteration: lm loss}, the
    loss being the mean over the global batch's counted tokens, as Megatron logs it. skipped_iterations: read nothing
    from their batches and take no step, the scheduler's neither (Megatron's --iterations-to-skip); they log no loss.
    batch_sizes: each iteration's global batch (Megatron's --rampup-batch-size), read after the previous ones' samples,
    the scheduler stepping by it; global_batch otherwise.

    context_parallel: the gradient megatron-core trains on under that many context-parallel ranks. Each rank holds two
    of the sequence's 2 x cp chunks (r and 2 x cp - 1 - r; get_batch_on_this_cp_rank) and its micro-batch loss is the
    mean over its own counted tokens; the gradients are averaged over the ranks, so a micro-batch trains on the mean
    of the ranks' means (which, with every token counted, is the mean over the tokens).

    per_token_loss: Megatron's --calculate-per-token-loss: the gradient is the mean over the global batch's counted
    tokens (whatever the ranks), not the mean of the micro-batches' means.

    warmup_steps, decay_steps, wd_incr_steps: the schedule's lengths in samples (Megatron's sample-based training, or a
    warmup fraction); by default warmup_iters, iters and iters global batches.

    decoupled_lr, decoupled_min_lr: Megatron's --decoupled-lr / --decoupled-min-lr: the word embeddings and the output
    layer in parameter groups of their own with these max_lr / min_lr (megatron-core's override for its
    is_embedding_or_output_parameter), which OptimizerParamScheduler schedules between.

    decayed_norms: parts of parameter names whose norm weights are decayed too (Megatron's
    --apply-wd-to-qk-layernorm: (".q_norm.", ".k_norm.") for transformers' query and key norms).

    expert_bias_update_rate: Megatron's aux-loss-free balancing, which transformers does not train: after each global
    batch every router's e_score_correction_bias (DeepSeek-V3's) moves by rate · sign(mean load - load), the loads
    being the tokens routed to each expert over the global batch (megatron-core's get_updated_expert_bias).

    peft_adapter: a PEFT LoRA adapter directory loaded onto the model with `peft` (trainable): only its lora_A / lora_B
    train (decayed, as 2-D weights), the base frozen.

    Samples that carry Megatron's "attention_mask" ([1, seq, seq] bool, True = hidden; GPTDataset's with
    reset_attention_mask) run with it as the model's 4-D attention mask; a model with sliding-window layers gets it
    for both kinds of layer, the window applied on top of it (model_attention_mask). Samples that also carry
    "cu_seqlens" (megatron-core's GPTDataset with inter_document_masking) run with their "position_ids" too."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    assert len(samples) >= (sum(batch_sizes) if batch_sizes is not None else iters * global_batch), \
        (len(samples), iters, global_batch)
    vision = is_vision_language(hf_dir)
    model = auto_model(hf_dir).from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    model.train()
    if vision:  # a vision-language model trains its text, the tower (and projector) frozen, as trestle train does
        for name, p in model.named_parameters():
            if "language_model." not in name and not name.startswith("lm_head."):
                p.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.padding_idx = None
    if peft_adapter is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, str(peft_adapter), is_trainable=True)
        model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # Megatron decays a weight of 2 or more dimensions that is not a bias; transformers' fused experts keep every
    # expert's bias in one 2-D tensor (GPT-OSS's gate_up_proj_bias), a bias all the same.
    def decays(name, p):
        return (p.dim() >= 2 and not name.endswith("bias")) or any(part in name for part in decayed_norms)
    decoupled = set()
    if decoupled_lr is not None:
        decoupled = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    decayed = [p for n, p in model.named_parameters() if p.requires_grad and decays(n, p) and id(p) not in decoupled]
    kept = [p for n, p in model.named_parameters() if p.requires_grad and not decays(n, p)]
    groups = [{"params": decayed, "wd_mult": 1.0}, {"params": kept, "wd_mult": 0.0}]
    if decoupled:
        group = {"params": [p for p in params if id(p) in decoupled], "wd_mult": 1.0, "max_lr": decoupled_lr}
        if decoupled_min_lr is not None:
            group["min_lr"] = decoupled_min_lr
        groups.append(group)
    assert sum(len(g["params"]) for g in groups) == len(params)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                                  foreach=False)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr,
        lr_warmup_steps=warmup_iters * global_batch if warmup_steps is None else warmup_steps,
        lr_decay_steps=iters * global_batch if decay_steps is None else decay_steps, lr_decay_style="cosine",
        start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=iters * global_batch if wd_incr_steps is None else wd_incr_steps, wd_incr_style="constant")
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")] if expert_bias_update_rate else []
    loads = {id(r): torch.zeros_like(r.e_score_correction_bias) for r in routers}

    def count(router, _inputs, outputs):  # outputs: (logits, top-k weights, top-k indices)
        loads[id(router)] += torch.bincount(outputs[2].flatten(), minlength=loads[id(router)].numel()).float()
    for r in routers:
        r.register_forward_hook(count)
    sizes = list(batch_sizes) if batch_sizes is not None else [global_batch] * iters
    assert len(sizes) == iters, (len(sizes), iters)
    losses = {}
    for iteration in range(1, iters + 1):
        if iteration in skipped_iterations:
            continue
        first, global_batch = sum(sizes[:iteration - 1]), sizes[iteration - 1]
        micro_batches = global_batch // micro_batch
        batch = samples[first: first + global_batch]
        optimizer.zero_grad(set_to_none=True)
        total, counted = 0.0, 0.0
        batch_tokens = float(sum(torch.as_tensor(s["loss_mask"]).sum() for s in batch))
        for m in range(micro_batches):
            part = batch[m * micro_batch: (m + 1) * micro_batch]
            tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in part]).long()
            labels = torch.stack([torch.as_tensor(s["labels"]) for s in part]).long()
            mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in part]).float()
            if "attention_mask" in part[0]:
                hidden = torch.stack([torch.as_tensor(s["attention_mask"]) for s in part]).bool()
                # megatron-core's inter-document samples (with cu_seqlens): positions restart at each document
                positions = (torch.stack([torch.as_tensor(s["position_ids"]) for s in part]).long()
                             if "cu_seqlens" in part[0] else None)
                logits = model(tokens, attention_mask=model_attention_mask(model, hidden),
                               position_ids=positions).logits.float()
            else:
                logits = model(tokens).logits.float()
            per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            masked = (per_token * mask.flatten()).view_as(mask)
            chunks, means = 2 * context_parallel, []
            for r in range(context_parallel):
                held = torch.cat([c for i, c in enumerate(torch.arange(mask.shape[1]).chunk(chunks))
                                  if i in (r, chunks - 1 - r)])
                means.append(masked[:, held].sum() / mask[:, held].sum().clamp(min=1))
            if per_token_loss:
                (masked.sum() / max(batch_tokens, 1.0)).backward()
            else:
                (torch.stack(means).mean() / micro_batches).backward()
            total += float(masked.detach().sum())
            counted += float(mask.sum())
        with torch.no_grad():
            for r in routers:
                load = loads[id(r)]
                r.e_score_correction_bias += torch.sign(load.mean() - load) * expert_bias_update_rate
                load.zero_()
        # Megatron's clipping by the global norm, summed in fp64 as Trestle sums it.
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        coefficient = min(1.0, clip_grad / (float(norm) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
        optimizer.step()
        scheduler.step(increment=global_batch)
        losses[iteration] = total / max(counted, 1.0)
        assert math.isfinite(losses[iteration]), (iteration, losses[iteration])
    return losses


def model_attention_mask(model, hidden):
    """Megatron's attention masks of a micro-batch ([b, 1, s, s] bool, True = hidden) as the additive 4-D mask
    transformers' eager attention takes; for a model with sliding-window layers a mapping from each kind of layer
    ("full_attention", "sliding_attention") to its mask, the window (config.sliding_window) hiding the keys that many
    positions or more before the query as well."""
    config = model.config.get_text_config()
    minimum = torch.finfo(torch.float32).min
    def additive(h):
        return torch.zeros(h.shape, dtype=torch.float32).masked_fill(h, minimum)
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return additive(hidden)
    seq = hidden.shape[-1]
    i = torch.arange(seq)
    outside = (i.view(-1, 1) - i.view(1, -1)) >= config.sliding_window
    return {"full_attention": additive(hidden), "sliding_attention": additive(hidden | outside)}
