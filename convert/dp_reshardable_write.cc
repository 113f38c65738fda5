#include "convert/dp_reshardable_write.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "ckpt/dtype_cast.h"
#include "convert/bridge/megatron_dist_names.h"
#include "convert/bridge/megatron_grad_scaler.h"
#include "convert/formats/torch/torch_save.h"
#include "parallel/layout/grad_buffer_layout.h"

namespace trestle {
namespace {

// Megatron's state names and the Trestle tensors holding them ("" for the fp32 master: see master_of).
constexpr const char* kStates[] = {"param", "exp_avg", "exp_avg_sq"};

std::string bucket_key(const MegatronOptimizerBuffer& b, const std::string& dtypes, std::size_t bucket,
                       const char* state) {
  return dp_reshardable_bucket_key(b.chain, b.group, b.owner.chunk, dtypes, static_cast<std::int64_t>(bucket)) + "." +
         state;
}

std::string object_key(int chain, int group, const char* name) {
  return dp_reshardable_group_prefix(chain, group) + name + "/shard_0_1";
}

// The Trestle tensor holding state `state` of weight `t` in `source`.
Result<std::string> state_tensor(const CanonicalSource& source, const CanonicalTensor& t, std::string_view state) {
  if (state == "param") {
    const std::string master = trestle_optimizer_name("fp32_param", t.name);
    if (source.find(master)) return master;
    const LayoutTensor* weight = source.find(t.name);
    if (weight && weight->dtype == DType::kF32) return t.name;  // an fp32 model's master is the weight itself
    return Status::Error(source.description() + ": " + t.name + " has no fp32 master weight (" + master +
                         ") and is not fp32 itself; Megatron-Core's distributed optimizer keeps fp32 masters");
  }
  const std::string name = trestle_optimizer_name(std::string(state), t.name);
  if (!source.find(name))
    return Status::Error(source.description() + ": no " + name +
                         " (the distributed optimizer's state needs Adam's moments of every weight; pass "
                         "--model-only to write the weights alone)");
  return name;
}

// Megatron-Core's bucket size for a buffer: buckets only with --overlap-grad-reduce, and only on the first pipeline
// stage's first model chunk (the others overlap their reduction with compute anyway).
std::optional<std::int64_t> bucket_size_of(const MegatronOptimizerBuffer& b, int dense_dp,
                                           const DpReshardableWriteOptions& o) {
  if (!o.overlap_grad_reduce || b.owner.pp_rank > 0 || b.owner.chunk > 0) return std::nullopt;
  return o.bucket_size.value_or(std::max<std::int64_t>(40'000'000, std::int64_t{1'000'000} * dense_dp));
}

PickleValue* torch_dtype(PickleDocument& doc, DType d) {
  const std::string_view name = torch_name(d);  // "torch.float32"
  return doc.global("torch", std::string(name.substr(name.find('.') + 1)));
}

PickleValue* optimizer_object(PickleDocument& doc, bool experts, std::int64_t step,
                              const DpReshardableWriteOptions& o) {
  return doc.dict({{doc.string("param_groups"), doc.list(megatron_param_groups(doc, experts, step, o))}});
}

}  // namespace

std::vector<PickleValue*> megatron_param_groups(PickleDocument& doc, bool experts, std::int64_t step,
                                                const DpReshardableWriteOptions& o) {
  std::vector<PickleValue*> groups;
  for (const double wd_mult : {1.0, 0.0}) {
    auto s = [&](const char* key) { return doc.string(key); };
    groups.push_back(doc.dict({{s("is_expert_parallel"), doc.boolean(experts)},
                               {s("default_config"), doc.boolean(true)},
                               {s("wd_mult"), doc.real(wd_mult)},
                               {s("lr_mult"), doc.real(1.0)},
                               {s("is_decoupled_lr"), doc.boolean(false)},
                               {s("max_lr"), doc.real(*o.lr)},
                               {s("min_lr"), doc.real(o.min_lr)},
                               {s("lr"), doc.real(*o.lr)},
                               {s("betas"), doc.tuple({doc.real(o.adam_beta1), doc.real(o.adam_beta2)})},
                               {s("eps"), doc.real(o.adam_eps)},
                               {s("weight_decay"), doc.real(o.weight_decay * wd_mult)},
                               {s("bias_correction"), doc.boolean(true)},
                               {s("amsgrad"), doc.boolean(false)},
                               {s("maximize"), doc.boolean(false)},
                               {s("foreach"), doc.none()},
                               {s("capturable"), doc.boolean(false)},
                               {s("differentiable"), doc.boolean(false)},
                               {s("fused"), doc.none()},
                               {s("decoupled_weight_decay"), doc.boolean(true)},
                               {s("step"), doc.integer(step)}}));
  }
  return groups;
}

Status check_dp_reshardable_options(const DpReshardableWriteOptions& o) {
  if (!o.lr) return Status::Error("the dp_reshardable optimizer format needs --lr (the param groups' max_lr)");
  if (o.dp < 0) return Status::Error("--dp must be at least 1, not " + std::to_string(o.dp));
  if (o.bucket_size && *o.bucket_size < 1) return Status::Error("--ddp-bucket-size must be at least 1");
  if (o.bucket_size && !o.overlap_grad_reduce)
    return Status::Error("--ddp-bucket-size needs --overlap-grad-reduce (without it Megatron-Core keeps one bucket)");
  const std::pair<const char*, double> values[] = {{"lr", *o.lr},
                                                   {"min-lr", o.min_lr},
                                                   {"weight-decay", o.weight_decay},
                                                   {"adam-beta1", o.adam_beta1},
                                                   {"adam-beta2", o.adam_beta2},
                                                   {"adam-eps", o.adam_eps}};
  for (const auto& [name, value] : values)
    if (!std::isfinite(value) || value < 0)
      return Status::Error(std::string("--") + name + " must be a finite number of at least 0");
  if (o.min_lr > *o.lr) return Status::Error("--min-lr must be at most --lr");
  if (o.adam_beta1 >= 1 || o.adam_beta2 >= 1) return Status::Error("--adam-beta1 and --adam-beta2 must be below 1");
  return OkStatus();
}

Result<DpReshardablePlan> plan_dp_reshardable(const CanonicalSource& source,
                                              const std::vector<const CanonicalTensor*>& tensors,
                                              const ParallelLayout& layout, std::int64_t padded_vocab, NormNaming norms,
                                              std::int64_t step, const DpReshardableWriteOptions& options) {
  TRESTLE_RETURN_IF_ERROR(check_dp_reshardable_options(options));
  const BridgedModel& model = source.model();
  const auto& c = model.model.hf;
  const std::int64_t experts = model.model.is_moe() ? c.num_experts : 0;
  if (layout.expert_tp() != layout.tp)
    return Status::Error(
        "the dp_reshardable optimizer format is written with the experts split as the dense tensors "
        "(expert tensor-parallel size " +
        std::to_string(layout.tp) + "), not " + std::to_string(layout.expert_tp()));
  ParallelLayout run = layout;  // the loading run: its data-parallel size shards the buckets
  if (options.dp > 0) run.data_parallel = options.dp;
  if (Status s = check_layout(run, c.num_layers, c.num_kv_heads, experts); !s.ok())
    return Status::Error("--dp " + std::to_string(run.dp()) + ": " + s.message());

  std::optional<DType> param_dtype;
  for (const CanonicalTensor* t : tensors) {
    const LayoutTensor* weight = source.find(t->name);
    if (!weight) return Status::Error(source.description() + ": no tensor '" + t->name + "'");
    if (param_dtype && *param_dtype != weight->dtype)
      return Status::Error(source.description() + ": weights of several dtypes (" + t->name + " is " +
                           std::string(dtype_name(weight->dtype)) + ", others " +
                           std::string(dtype_name(*param_dtype)) +
                           "); Megatron-Core's buffers would be laid out per dtype, which is not written");
    param_dtype = weight->dtype;
  }
  if (!param_dtype) return Status::Error(source.description() + ": no weights");
  // A distributed optimizer with a loss scaler saves it too (each group's 'grad_scaler'), which its load asks for: a
  // constant scale's {}, or an fp16 model's dynamic scaler, the source's (a trainer's "loss_scaler"; without one the
  // state is refused).
  std::optional<nlohmann::json> grad_scaler;
  if (options.constant_loss_scale) {
    grad_scaler = nlohmann::json::object();
  } else if (*param_dtype == DType::kF16) {
    const auto state = source.training().find("loss_scaler");
    if (state == source.training().end() || !is_megatron_grad_scaler_state(*state))
      return Status::Error(source.description() +
                           ": an fp16 model's distributed optimizer also saves its loss scaler, and this checkpoint "
                           "keeps none (a Trestle training's \"loss_scaler\": scale, growth_tracker, "
                           "hysteresis_tracker); convert the weights to bf16 or fp32 first, or pass --model-only");
    grad_scaler = *state;
  }
  if (*param_dtype != DType::kF32 && *param_dtype != DType::kBF16 && *param_dtype != DType::kF16)
    return Status::Error(source.description() + ": weights of dtype " + std::string(dtype_name(*param_dtype)) +
                         " have no Megatron-Core distributed optimizer layout");
  const DType grad_dtype = *param_dtype == DType::kBF16 && options.grad_reduce_in_bf16 ? DType::kBF16 : DType::kF32;

  DpReshardablePlan plan;
  plan.dtypes = "(" + std::string(torch_name(*param_dtype)) + ", " + std::string(torch_name(grad_dtype)) + ")";
  TRESTLE_ASSIGN_OR_RETURN(plan.buffers, megatron_optimizer_buffers(tensors, run, c.num_layers, experts,
                                                                    model.model.tied(), padded_vocab, norms));
  plan.ranks.resize(static_cast<std::size_t>(layout.world_size()));
  plan.objects.resize(plan.ranks.size());
  const int dense_dp = run.dp() * run.cp;

  // Per data-parallel group: the buckets of each of its buffers, for the per_bucket_numel objects.
  struct GroupBuckets {
    int chain, group;
    std::size_t rank;
    bool experts;
    std::vector<std::vector<std::int64_t>> padded, unpadded;  // per buffer (gbuf_idx)
  };
  std::vector<GroupBuckets> groups;
  for (const MegatronOptimizerBuffer& b : plan.buffers) {
    plan.chained |= b.chain >= 0;
    const bool expert_buffer = b.kind == BufferKind::kExperts;
    const std::size_t rank = static_cast<std::size_t>(global_rank(
        layout,
        {.tp_rank = b.owner.tp_rank, .dp_rank = expert_buffer ? b.owner.ep_rank : 0, .pp_rank = b.owner.pp_rank}));
    if (groups.empty() || groups.back().chain != b.chain || groups.back().group != b.group)
      groups.push_back({b.chain, b.group, rank, expert_buffer, {}, {}});
    std::vector<std::int64_t> numels;
    std::vector<bool> shared;
    for (const auto& p : b.params) {
      numels.push_back(p.numel);
      shared.push_back(p.shared_embedding);
    }
    GradBufferOptions laying;
    laying.dp = b.dp;
    laying.distributed_optimizer = true;
    laying.bucket_size = bucket_size_of(b, dense_dp, options);
    const GradBufferLayout laid = grad_buffer_layout(numels, shared, laying);
    groups.back().padded.emplace_back();
    groups.back().unpadded.push_back(laid.bucket_numel_unpadded);
    // The state tensors of each parameter.
    std::vector<std::array<std::string, 3>> sources(b.params.size());
    for (std::size_t i = 0; i < b.params.size(); ++i)
      for (std::size_t s = 0; s < 3; ++s) {
        TRESTLE_ASSIGN_OR_RETURN(sources[i][s], state_tensor(source, *b.params[i].tensor, kStates[s]));
      }
    for (std::size_t k = 0; k < laid.buckets.size(); ++k) {
      const std::int64_t begin = laid.buckets[k].first, end = laid.buckets[k].second;
      const std::int64_t unpadded = laid.bucket_numel_unpadded[k];
      const std::int64_t shard = (end - begin) / b.dp;
      groups.back().padded.back().push_back(end - begin);
      ++plan.buckets;
      // The bucket's parameters in buffer order and the padding between them (and after the last, up to the bucket's
      // unpadded end), cut at every shard edge.
      std::vector<std::size_t> in_bucket;
      for (std::size_t i = 0; i < laid.params.size(); ++i)
        if (laid.params[i].bucket == static_cast<int>(k)) in_bucket.push_back(i);
      std::sort(in_bucket.begin(), in_bucket.end(),
                [&](std::size_t x, std::size_t y) { return laid.params[x].start < laid.params[y].start; });
      std::vector<bool> shard_holds_parameter(static_cast<std::size_t>(b.dp), false);
      auto emit = [&](std::int64_t from, std::int64_t to, const std::size_t* param) {
        while (from < to) {
          const std::int64_t cut = std::min(to, (from / shard + 1) * shard);
          if (param) shard_holds_parameter[static_cast<std::size_t>(from / shard)] = true;
          for (std::size_t s = 0; s < 3; ++s) {
            FlatChunk chunk{bucket_key(b, plan.dtypes, k, kStates[s]), unpadded, from, cut - from, {}, {}, 0};
            if (param) {
              chunk.source_tensor = sources[*param][s];
              chunk.boxes = b.params[*param].boxes;
              chunk.param_offset = from - (laid.params[*param].start - begin);
            }
            plan.bytes += static_cast<std::uint64_t>(cut - from) * sizeof(float);
            plan.ranks[rank].push_back(std::move(chunk));
          }
          from = cut;
        }
      };
      std::int64_t at = 0;
      for (const std::size_t& i : in_bucket) {
        const std::int64_t start = laid.params[i].start - begin, stop = laid.params[i].end - begin;
        emit(at, start, nullptr);
        emit(start, stop, &i);
        at = stop;
      }
      emit(at, unpadded, nullptr);  // a bucket closed before a shared embedding keeps that parameter's alignment
      for (int r = 0; r < b.dp; ++r)
        if (!shard_holds_parameter[static_cast<std::size_t>(r)])
          return Status::Error(
              "bucket " + std::to_string(k) + " of " + bucket_key(b, plan.dtypes, k, "*") + " (" +
              std::to_string(unpadded) + " elements, " + std::to_string(shard) + " per data-parallel rank at dp " +
              std::to_string(b.dp) + "): data-parallel rank " + std::to_string(r) +
              "'s shard holds no parameter, which Megatron-Core cannot save or load in this format; use a smaller "
              "--dp or larger buckets");
    }
  }
  std::optional<std::string> scaler_bytes;  // the same object in every group
  if (grad_scaler) {
    PickleDocument doc;
    std::vector<std::string> storages;
    PickleValue* object =
        doc.list({grad_scaler->empty() ? doc.dict() : megatron_grad_scaler_object(doc, *grad_scaler, storages)});
    TRESTLE_ASSIGN_OR_RETURN(scaler_bytes, torch_save_object_bytes(object, "archive", storages));
  }
  for (const GroupBuckets& g : groups) {
    PickleDocument doc;
    auto sizes = [&](const std::vector<std::vector<std::int64_t>>& per_buffer) {
      std::vector<PickleValue*> buffers;
      for (const auto& buckets : per_buffer) {
        std::vector<PickleValue*> numbers;
        for (const std::int64_t n : buckets) numbers.push_back(doc.integer(n));
        buffers.push_back(doc.dict({{doc.tuple({torch_dtype(doc, *param_dtype), torch_dtype(doc, grad_dtype)}),
                                     doc.list(std::move(numbers))}}));
      }
      return doc.list({doc.list(std::move(buffers))});  // what DCP stores: torch.save([value])
    };
    auto& objects = plan.objects[g.rank];
    TRESTLE_ASSIGN_OR_RETURN(std::string optimizer,
                             torch_save_object_bytes(doc.list({optimizer_object(doc, g.experts, step, options)})));
    objects.push_back({object_key(g.chain, g.group, "optimizer"), std::move(optimizer)});
    TRESTLE_ASSIGN_OR_RETURN(std::string padded, torch_save_object_bytes(sizes(g.padded)));
    objects.push_back({object_key(g.chain, g.group, "per_bucket_numel"), std::move(padded)});
    TRESTLE_ASSIGN_OR_RETURN(std::string unpadded, torch_save_object_bytes(sizes(g.unpadded)));
    objects.push_back({object_key(g.chain, g.group, "per_bucket_numel_unpadded"), std::move(unpadded)});
    if (scaler_bytes) objects.push_back({object_key(g.chain, g.group, "grad_scaler"), *scaler_bytes});
  }
  return plan;
}

Status read_flat_chunk(const CanonicalSource& source, const FlatChunk& chunk, std::span<float> out) {
  if (out.size() != static_cast<std::size_t>(chunk.size))
    return Status::Error("internal: a flat chunk's buffer does not fit it");
  std::fill(out.begin(), out.end(), 0.0f);
  if (chunk.source_tensor.empty()) return OkStatus();  // padding
  const LayoutTensor* stored = source.find(chunk.source_tensor);
  if (!stored) return Status::Error(source.description() + ": no tensor '" + chunk.source_tensor + "'");
  const std::size_t es = dtype_size(stored->dtype);
  std::vector<std::byte> rows;
  const std::int64_t want_begin = chunk.param_offset, want_end = chunk.param_offset + chunk.size;
  std::int64_t box_begin = 0;  // the box's first element in the parameter's flat values
  for (const Box& box : chunk.boxes) {
    const std::int64_t n = box.numel(), box_end = box_begin + n;
    const std::int64_t lo = std::max(want_begin, box_begin) - box_begin, hi = std::min(want_end, box_end) - box_begin;
    if (lo < hi) {
      // Whole rows (along the first axis) covering [lo, hi) of the box's row-major elements.
      const std::int64_t row = box.shape.empty() || box.shape[0] == 0 ? std::max<std::int64_t>(n, 1) : n / box.shape[0];
      Box part = box;
      const std::int64_t first = lo / row, last = (hi + row - 1) / row;
      if (!part.shape.empty()) {
        part.offset[0] += first;
        part.shape[0] = last - first;
      }
      rows.resize(static_cast<std::size_t>(part.numel()) * es);
      TRESTLE_RETURN_IF_ERROR(source.read(chunk.source_tensor, Piece{part, std::nullopt}, rows));
      const std::int64_t skip = lo - (part.shape.empty() ? 0 : first * row);
      const auto from = std::span<const std::byte>(rows).subspan(static_cast<std::size_t>(skip) * es,
                                                                 static_cast<std::size_t>(hi - lo) * es);
      auto to = std::as_writable_bytes(
          out.subspan(static_cast<std::size_t>(box_begin + lo - want_begin), static_cast<std::size_t>(hi - lo)));
      TRESTLE_RETURN_IF_ERROR(cast_elements(stored->dtype, from, DType::kF32, to)
                                  .with_context(chunk.source_tensor + " into '" + chunk.key + "'"));
    }
    box_begin = box_end;
  }
  return OkStatus();  // elements past the boxes: vocabulary padding rows, zero
}

void add_dp_reshardable_common(PickleDocument& doc, PickleValue* common, PickleValue* args, bool chained,
                               const DpReshardableWriteOptions& o) {
  auto sharding = [&] { return doc.dict({{doc.string("param_state_sharding_type"), doc.string("dp_reshardable")}}); };
  common->entries.push_back(
      {doc.string("optimizer"),
       chained ? doc.dict({{doc.integer(0), sharding()}, {doc.integer(1), sharding()}}) : sharding()});
  common->entries.push_back({doc.string("content_metadata"),
                             doc.dict({{doc.string("distrib_optim_sharding_type"), doc.string("dp_reshardable")},
                                       {doc.string("singleton_local_shards"), doc.boolean(false)},
                                       {doc.string("chained_optim_avoid_prefix"), doc.boolean(true)}})});
  auto& fields = args->state->entries;
  auto put = [&](const char* key, PickleValue* v) { fields.emplace_back(doc.string(key), v); };
  put("use_distributed_optimizer", doc.boolean(true));
  put("data_parallel_size", doc.integer(o.dp));
  put("overlap_grad_reduce", doc.boolean(o.overlap_grad_reduce));
  put("ddp_bucket_size", o.bucket_size ? doc.integer(*o.bucket_size) : doc.none());
  put("accumulate_allreduce_grads_in_fp32", doc.boolean(!o.grad_reduce_in_bf16));
  put("grad_reduce_in_bf16", doc.boolean(o.grad_reduce_in_bf16));
  put("lr", doc.real(*o.lr));
  put("min_lr", doc.real(o.min_lr));
  put("weight_decay", doc.real(o.weight_decay));
  put("adam_beta1", doc.real(o.adam_beta1));
  put("adam_beta2", doc.real(o.adam_beta2));
  put("adam_eps", doc.real(o.adam_eps));
  put("optimizer", doc.string("adam"));
}

}  // namespace trestle
