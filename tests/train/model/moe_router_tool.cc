// Test-only: the MoE router's outputs for the comparison with megatron-core
// (tests/interop/test_moe_router_megatron.py).
//   trestle_moe_router_tool LOGITS.f32 TOKENS EXPERTS TOPK SCORE PRE_SOFTMAX NUM_GROUPS GROUP_TOPK SCALING BIAS OUT
// reads float32 logits [TOKENS, EXPERTS] (and, unless BIAS is "-", a float32 expert bias [EXPERTS]); SCALING 0 means
// none. Writes to OUT/: probs.f32, map.u8 (topk_routing), aux_scores.f32, aux_map.u8 (routing_scores_for_aux_loss),
// aux_loss.f32 (coefficient 0.01, tokens per expert from aux_map), z_loss.f32 (coefficient 0.001), and for tokens
// [TOKENS, 8] = arange / 10 permuted by the routing: permuted.f32, sorted.i64, per_expert.i64, and restored.f32
// (the permuted rows times 2 as the "expert", weighted and summed back).
#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "train/model/moe_router.h"

namespace {

at::Tensor read_f32(const std::string& path, at::IntArrayRef shape) {
  at::Tensor t = at::empty(shape, at::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!in) throw std::runtime_error(path + ": short read");
  return t;
}

void write(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12) {
    std::cerr << "usage: see the header of moe_router_tool.cc\n";
    return 2;
  }
  try {
    const std::int64_t tokens = std::stoll(argv[2]), experts = std::stoll(argv[3]);
    const at::Tensor logits = read_f32(argv[1], {tokens, experts});
    trestle::train::RouterOptions o;
    o.topk = std::stoi(argv[4]);
    o.score_function = argv[5];
    o.pre_softmax = std::string(argv[6]) == "1";
    o.num_groups = std::stoi(argv[7]);
    o.group_topk = std::stoi(argv[8]);
    if (const double s = std::stod(argv[9]); s != 0) o.scaling_factor = s;
    if (std::string(argv[10]) != "-") o.expert_bias = read_f32(argv[10], {experts});
    const std::string out = argv[11];
    const auto routing = trestle::train::topk_routing(logits, o);
    write(out + "/probs.f32", routing.probs);
    write(out + "/map.u8", routing.map.to(at::kByte));
    const auto aux = trestle::train::routing_scores_for_aux_loss(logits, o.topk, o.score_function);
    write(out + "/aux_scores.f32", aux.probs);
    write(out + "/aux_map.u8", aux.map.to(at::kByte));
    const at::Tensor per_expert = aux.map.sum(0);
    write(out + "/aux_loss.f32", trestle::train::load_balancing_loss(aux.probs, per_expert, tokens, o.topk, 0.01));
    write(out + "/z_loss.f32", trestle::train::z_loss(logits, 0.001));
    const at::Tensor tokens_in = at::arange(tokens * 8, at::kFloat).reshape({tokens, 8}) / 10;
    const auto permuted = trestle::train::permute_tokens(tokens_in, routing);
    write(out + "/permuted.f32", permuted.tokens);
    write(out + "/sorted.i64", permuted.sorted_indices);
    write(out + "/per_expert.i64", permuted.tokens_per_expert);
    write(out + "/restored.f32", trestle::train::unpermute_tokens(permuted.tokens * 2, permuted, tokens));
    // Token dropping (--moe-expert-capacity-factor): each factor with each policy, unpadded and padded, in order.
    int variant = 0;
    for (const double factor : {0.5, 1.0, 1.25, 8.0})
      for (const bool by_position : {false, true})
        for (const bool pad : {false, true}) {
          const auto dropped = trestle::train::drop_over_capacity(routing, o.topk, {factor, by_position, pad});
          const std::string name = out + "/drop" + std::to_string(variant++);
          write(name + "_probs.f32", dropped.probs);
          write(name + "_map.u8", dropped.map.to(at::kByte));
        }
  } catch (const std::exception& e) {
    std::cerr << "moe_router_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
