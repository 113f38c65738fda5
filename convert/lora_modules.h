// Where each LoRA adapter of a Megatron model sits on the Hugging Face side: for every base linear an adapter may
// adapt (lora_spec.h's modules: linear_qkv or multi-latent attention's projections, linear_proj, linear_fc1,
// linear_fc2 of each layer, each routed expert and the shared expert), the Hugging Face modules its weight is made of
// (from the converter's own plan, so every family the bridge reads is covered), which rows of the Megatron weight each
// holds, and which canonical part (adapter_q, adapter_gate, ...) those rows belong to. A PEFT adapter on a Hugging Face
// module is then rows of the Megatron adapter's B with its A: lora_modules() is the one statement of that
// correspondence for export, import and merging.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "convert/bridge/bridge_model_json.h"
#include "parallel/layout/lora_spec.h"

namespace trestle {

// One Hugging Face linear whose weight rows are rows of a Megatron base weight (whole rows, columns in order).
struct HfLoraModule {
  // e.g. model.layers.3.self_attn.q_proj: the weight's name without ".weight", as the model transformers builds names
  // the module (PEFT's keys; Gemma 3 with vision is saved under older names)
  std::string name;
  std::vector<std::int64_t> rows;  // rows[h]: the Megatron weight's row that is this module's row h
  int part = -1;                   // the canonical part all its rows belong to; -1: rows of several parts (fused)
  bool linear = true;              // false: its weight is not 2-D (fused experts [E, ...]), no linear PEFT wraps
  // A routed expert's slice of transformers 5's fused expert parameter ([E, out, in], or [E, in, out] where the model
  // stores it transposed), which PEFT adapts as one ParamWrapper over all experts (target_parameters): the
  // parameter's name as the built model names it (name is then its module's), this slice's expert and E. rows are
  // then the slice's output rows.
  std::string parameter;
  std::int64_t expert = -1, num_experts = 0;
  std::string problem;  // why no PEFT adapter can sit here (a weight split over several tensors); empty: it can
};

struct LoraModule {
  std::string module;  // Megatron, e.g. decoder.layers.3.self_attention.linear_qkv
  std::string target;  // lora_target_modules()'s: linear_qkv, linear_proj, linear_fc1, ...
  std::int64_t out = 0, in = 0;
  bool routed_expert = false;  // a routed expert's linear (mlp.experts.local_experts.<e>.*)
  // Canonical parts (adapter_q, adapter_k, adapter_v / adapter_gate, adapter_up); empty for unfused linears.
  std::vector<std::string> parts;
  std::vector<int> part_of_row;           // per Megatron row (fused linears)
  std::vector<std::int64_t> row_in_part;  // per Megatron row: its row in its part's B
  std::vector<std::int64_t> part_rows;    // each part's row count
  // The base's stored pieces (Gated DeltaNet's in_proj.weight.query, ...: name suffix and rows) whose rows, in order,
  // make the weight; empty where it is one tensor.
  std::vector<std::pair<std::string, std::int64_t>> pieces;
  std::vector<HfLoraModule> hf;  // the Hugging Face modules making the weight, in the plan's order
  std::string problem;           // why this weight has no Hugging Face modules LoRA can map to; empty: it has
};

// Every module an adapter may adapt, in lora_tensors()'s order. Per-expert modules use the per-expert Hugging Face
// layout where the architecture has one, and also their slice of the fused expert parameters transformers 5 builds.
Result<std::vector<LoraModule>> lora_modules(const BridgedModel& model);

// The Hugging Face form a PEFT adapter on `m` takes when exported: its linears (per-expert ones too), else its slice of
// a fused expert parameter; with `fused_experts`, a routed expert's slice wherever it has one (as transformers 5 builds
// the model and peft saves it).
std::vector<const HfLoraModule*> peft_form(const LoraModule& m, bool fused_experts);

// Every module of the Hugging Face model that holds a tensor of the converter's plan, at any depth ("a" and "a.b" of
// "a.b.weight"; named as HfLoraModule's): the language model's and a vision-language model's towers', which PEFT's
// target_modules could also select; and a tied model's lm_head, which transformers builds without a tensor of its own.
Result<std::vector<std::string>> hf_modules(const BridgedModel& model);

// The Hugging Face weight name's module: "a.b.weight" -> "a.b".
std::string hf_module_of_weight(const std::string& weight);

}  // namespace trestle
