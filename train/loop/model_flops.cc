#include "train/loop/model_flops.h"

namespace trestle::train {
namespace {

// Each function gives one part's forward FLOPs per token: 2 per GEMM weight the token meets, plus what else it
// computes. Training is 3 forwards' worth (the backward's data and weight gradients), as Megatron counts it.

// Causal attention's two products per token, each over half the sequence on average: the scores over the queries'
// width and the weighted values over the values' width.
double causal_attention(std::int64_t seq_length, double query_width, double value_width) {
  return 2.0 * (static_cast<double>(seq_length) / 2.0) * (query_width + value_width);
}

// Standard attention (grouped keys and values, the output gate's rows, Gemma 4's per-layer sizes, keys that are the
// values, layers that reuse an earlier layer's keys and values).
double standard_attention(const GptModelSpec& s, std::int64_t layer, std::int64_t seq_length) {
  const double h = static_cast<double>(s.hidden_size), d = static_cast<double>(s.layer_kv_channels_of(layer));
  const double q = static_cast<double>(s.num_attention_heads) * d;
  const double kv = static_cast<double>(s.layer_query_groups_of(layer)) * d;
  double projected = s.attention_output_gate ? 2.0 * q : q;
  if (!s.layer_kv_shared(layer)) projected += s.layer_k_eq_v(layer) ? kv : 2.0 * kv;
  return 2.0 * (h * projected + q * h) + causal_attention(seq_length, q, q);
}

// Multi-latent attention; the + 1s are the low-rank norms, as Megatron's formula counts them.
double latent_attention(const GptModelSpec& s, std::int64_t seq_length) {
  const double h = static_cast<double>(s.hidden_size), heads = static_cast<double>(s.num_attention_heads);
  const double qk = static_cast<double>(s.qk_head_dim + s.qk_pos_emb_head_dim), v = static_cast<double>(s.v_head_dim);
  const double q_lora = static_cast<double>(s.q_lora_rank), kv_lora = static_cast<double>(s.kv_lora_rank);
  const double queries = s.q_lora_rank > 0 ? q_lora * (h + heads * qk + 1.0) : h * heads * qk;
  const double weights = queries + kv_lora * (h + heads * static_cast<double>(s.qk_head_dim + s.v_head_dim) + 1.0) +
                         h * static_cast<double>(s.qk_pos_emb_head_dim) + heads * v * h;
  return 2.0 * weights + causal_attention(seq_length, heads * qk, heads * v);
}

// Gated DeltaNet: in_proj [q; k; v; z; beta; alpha], the convolution over [q; k; v], the delta rule's four products
// per value head (KKᵀ, VKᵀ, the state's update and its product with the query) and out_proj.
double gated_delta_net(const GptModelSpec& s) {
  const double h = static_cast<double>(s.hidden_size);
  const double qk = static_cast<double>(s.linear_key_head_dim * s.linear_num_key_heads);
  const double v = static_cast<double>(s.linear_value_head_dim * s.linear_num_value_heads);
  const double value_heads = static_cast<double>(s.linear_num_value_heads);
  const double value_dim = static_cast<double>(s.linear_value_head_dim);
  return 2.0 * (h * (2.0 * qk + 2.0 * v + 2.0 * value_heads) +
                static_cast<double>(s.linear_conv_kernel_dim) * (2.0 * qk + v) +
                value_heads * value_dim * value_dim * 4.0 + h * v);
}

// A Mamba-2 mixer: in_proj [z; x; B; C; dt], the scan (7 FLOPs per inner channel and state, Megatron's estimate) and
// out_proj.
double mamba_mixer(const GptModelSpec& s) {
  const double h = static_cast<double>(s.hidden_size);
  const double inner = static_cast<double>(s.mamba_num_heads * s.mamba_head_dim);
  const double groups = static_cast<double>(s.mamba_num_groups * s.mamba_state_dim);
  return 2.0 * h * (2.0 * inner + 2.0 * groups + static_cast<double>(s.mamba_num_heads)) +
         7.0 * inner * static_cast<double>(s.mamba_state_dim) + 2.0 * inner * h;
}

// fc1 and fc2 of an MLP `ffn` wide: gated (fc1 2 · ffn wide) in GPT models, not in hybrid ones (squared ReLU).
double mlp_of(const GptModelSpec& s, double width, double ffn) { return 2.0 * (s.hybrid() ? 2.0 : 3.0) * width * ffn; }

double dense_mlp(const GptModelSpec& s, std::int64_t layer) {
  const double wide = s.double_wide_mlp && s.layer_kv_shared(layer) ? 2.0 : 1.0;
  const std::int64_t ffn = s.is_moe() ? s.dense_ffn_hidden_size : s.ffn_hidden_size;
  return mlp_of(s, static_cast<double>(s.hidden_size), wide * static_cast<double>(ffn));
}

// The top-k routed experts (in the latent space, entered and left by two projections, where there is one) and the
// shared expert.
double mixture_of_experts(const GptModelSpec& s, std::int64_t layer) {
  const double h = static_cast<double>(s.hidden_size), latent = static_cast<double>(s.moe_latent_size);
  const double routed = static_cast<double>(s.ffn_hidden_size * s.moe_router_topk);
  const double wide = s.double_wide_mlp && s.layer_kv_shared(layer) ? 2.0 : 1.0;
  const double experts =
      s.moe_latent_size > 0 ? mlp_of(s, latent, routed) + 2.0 * 2.0 * h * latent : mlp_of(s, h, routed);
  return experts + mlp_of(s, h, wide * static_cast<double>(s.shared_expert_ffn_hidden_size));
}

double hybrid_layer(const GptModelSpec& s, std::int64_t layer, std::int64_t seq_length) {
  switch (s.hybrid_layer(layer)) {
    case 'M':
      return mamba_mixer(s);
    case '*':
      return standard_attention(s, layer, seq_length);
    case '-':
      return dense_mlp(s, layer);
    default:
      return mixture_of_experts(s, layer);
  }
}

double decoder_layer(const GptModelSpec& s, std::int64_t layer, std::int64_t seq_length) {
  const double attention = s.layer_is_linear_attention(layer) ? gated_delta_net(s)
                           : s.multi_latent_attention()       ? latent_attention(s, seq_length)
                                                              : standard_attention(s, layer, seq_length);
  const double mlp = s.layer_is_moe(layer) ? mixture_of_experts(s, layer) : dense_mlp(s, layer);
  // Gemma 4's per-layer input: its gate and projection.
  const double per_layer_input =
      2.0 * 2.0 * static_cast<double>(s.hidden_size) * static_cast<double>(s.per_layer_input_size);
  return attention + mlp + per_layer_input;
}

}  // namespace

double model_flops_per_token(const GptModelSpec& s, std::int64_t seq_length, std::int64_t padded_vocab_size) {
  const double h = static_cast<double>(s.hidden_size);
  double forward = 0.0;
  for (std::int64_t layer = 0; layer < s.num_layers; ++layer)
    forward += s.hybrid() ? hybrid_layer(s, layer, seq_length) : decoder_layer(s, layer, seq_length);
  // Each multi-token-prediction depth: a decoder layer (standard or latent attention, the last layer's kind of MLP),
  // its eh_proj [h, 2h] and its norms (3h, as Megatron counts them), and one more pass through the output layer.
  const std::int64_t last = s.num_layers - 1;
  for (std::int64_t k = 0; k < s.mtp_num_layers; ++k) {
    forward += s.multi_latent_attention() ? latent_attention(s, seq_length)
                                          : standard_attention(s, /*layer=*/-1, seq_length);  // the model-wide sizes
    forward += s.layer_is_moe(last) ? mixture_of_experts(s, last) : dense_mlp(s, last);
    forward += 2.0 * (3.0 * h + 2.0 * h * h);
  }
  // Gemma 4's per-layer inputs projected from the embedding output: per_layer_model_proj [layers · width, h].
  forward += 2.0 * h * static_cast<double>(s.num_layers * s.per_layer_input_size);
  forward += 2.0 * h * static_cast<double>(padded_vocab_size) * static_cast<double>(1 + s.mtp_num_layers);
  return 3.0 * forward;
}

}  // namespace trestle::train
