// The layout description: rank order (tp-cp-ep-dp-pp), vocab padding, pipeline stages (even, interleaved, explicit
// first/last), expert placement and each split kind's TP boxes, including gated fc1 as [gate_r; up_r].
#include "parallel/layout/parallel_layout.h"

#include <gtest/gtest.h>

#include <numeric>

#include "parallel/layout/model_spec.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

TEST(ParallelLayoutTest, VocabPadding) {
  EXPECT_EQ(padded_vocab_size(1000, 128, 1), 1024);
  EXPECT_EQ(padded_vocab_size(1024, 128, 1), 1024);
  EXPECT_EQ(padded_vocab_size(1025, 128, 1), 1152);
  EXPECT_EQ(padded_vocab_size(1000, 128, 4), 1024);
  EXPECT_EQ(padded_vocab_size(517, 128, 3), 768);
  EXPECT_EQ(padded_vocab_size(32000, 128, 8), 32768);
  EXPECT_EQ(padded_vocab_size(128256, 128, 1), 128256);  // Llama 3: already a multiple of 128
  EXPECT_EQ(padded_vocab_size(128256, 128, 8), 129024);  // but not of 128 × 8
}

// The padding multiple stays within 2^30 wherever it is read, so multiple x tp cannot wrap (2^62 x 4 wrapped to 0 and
// the padding divided by it).
TEST(ParallelLayoutTest, TheVocabPaddingMultipleIsBounded) {
  EXPECT_TRUE(check_vocab_size_divisible_by(1, "m").ok());
  EXPECT_TRUE(check_vocab_size_divisible_by(std::int64_t{1} << 30, "m").ok());
  for (const std::int64_t bad :
       {std::int64_t{0}, std::int64_t{-128}, (std::int64_t{1} << 30) + 1, std::int64_t{1} << 62})
    EXPECT_TRUE(fails_with(check_vocab_size_divisible_by(bad, "--flag"),
                           "--flag must be an integer from 1 to 1073741824, not " + std::to_string(bad)));
  ParallelLayout layout;
  layout.tp = 4;
  layout.make_vocab_size_divisible_by = std::int64_t{1} << 62;
  EXPECT_TRUE(fails_with(check_layout(layout, 2, 4, 0), "make_vocab_size_divisible_by must be an integer from 1"));
  EXPECT_TRUE(fails_with(layout_from_json(nlohmann::json{{"make_vocab_size_divisible_by", 0}}, "m.json"),
                         "m.json: layout 'make_vocab_size_divisible_by'"));
}

TEST(ParallelLayoutTest, VocabBoxesLeaveOutPadding) {
  // 130 rows padded to 512 over tp 4: rank 0 all real rows, rank 1 two, ranks 2-3 only padding.
  const Shape shape{130, 8};
  const auto r0 = tp_boxes(TpSplit::kVocab, shape, 4, 0, 512);
  const auto r1 = tp_boxes(TpSplit::kVocab, shape, 4, 1, 512);
  const auto r2 = tp_boxes(TpSplit::kVocab, shape, 4, 2, 512);
  ASSERT_TRUE(r0.ok() && r1.ok() && r2.ok());
  EXPECT_EQ(*r0, (std::vector<Box>{{{0, 0}, {128, 8}}}));
  EXPECT_EQ(*r1, (std::vector<Box>{{{128, 0}, {2, 8}}}));
  EXPECT_TRUE(r2->empty());
}

TEST(ParallelLayoutTest, GatedColumnIsGateRowsThenUpRowsOfTheRank) {
  // Canonical fc1 [gate; up] with I = 6 rows each; tp 3: rank r holds gate rows [2r, 2r+2) and up rows [6+2r, 6+2r+2).
  const std::int64_t inter = 6, hidden = 2;
  std::vector<int> canonical(static_cast<std::size_t>(2 * inter * hidden));
  std::iota(canonical.begin(), canonical.end(), 0);
  for (int r = 0; r < 3; ++r) {
    const auto boxes = tp_boxes(TpSplit::kGatedColumn, {2 * inter, hidden}, 3, r);
    ASSERT_TRUE(boxes.ok());
    ASSERT_EQ(boxes->size(), 2u);
    std::vector<int> local;
    for (const auto& b : *boxes)
      for (std::int64_t row = b.offset[0]; row < b.offset[0] + b.shape[0]; ++row)
        for (std::int64_t c = 0; c < hidden; ++c)
          local.push_back(canonical[static_cast<std::size_t>(row * hidden + c)]);
    std::vector<int> expected;  // [gate_r; up_r]
    for (std::int64_t row : {std::int64_t{2} * r, std::int64_t{2} * r + 1, inter + 2 * r, inter + 2 * r + 1})
      for (std::int64_t c = 0; c < hidden; ++c) expected.push_back(static_cast<int>(row * hidden + c));
    EXPECT_EQ(local, expected) << "tp rank " << r;
  }
  EXPECT_TRUE(fails_with(tp_boxes(TpSplit::kGatedColumn, {10, 2}, 3, 0), "gate rows (5) is not divisible by 3"))
      << "5 gate rows do not split over tp 3";
}

TEST(ParallelLayoutTest, ColumnRowAndReplicatedBoxes) {
  EXPECT_EQ(*tp_boxes(TpSplit::kColumn, {8, 4}, 2, 1), (std::vector<Box>{{{4, 0}, {4, 4}}}));
  EXPECT_EQ(*tp_boxes(TpSplit::kColumn, {8}, 4, 3), (std::vector<Box>{{{6}, {2}}}));
  EXPECT_EQ(*tp_boxes(TpSplit::kRow, {8, 4}, 2, 1), (std::vector<Box>{{{0, 2}, {8, 2}}}));
  EXPECT_EQ(*tp_boxes(TpSplit::kReplicated, {8}, 4, 2), (std::vector<Box>{{{0}, {8}}}));
  EXPECT_TRUE(fails_with(tp_boxes(TpSplit::kRow, {8, 5}, 2, 0), "dimension 1 (5) is not divisible by 2"));
}

TEST(ParallelLayoutTest, EvenAndInterleavedStages) {
  ParallelLayout l;
  l.pp = 2;
  auto even = pipeline_layers(l, 6);
  ASSERT_TRUE(even.ok());
  EXPECT_EQ((*even)[0][0].begin, 0);
  EXPECT_EQ((*even)[0][0].end, 3);
  EXPECT_EQ((*even)[1][0].begin, 3);
  l.vpp = 2;  // 8 layers in 4 chunks of 2: stage 0 holds [0,2) and [4,6), stage 1 [2,4) and [6,8)
  auto inter = pipeline_layers(l, 8);
  ASSERT_TRUE(inter.ok());
  EXPECT_EQ((*inter)[0][1].begin, 4);
  EXPECT_EQ((*inter)[1][0].begin, 2);
  EXPECT_EQ((*inter)[1][1].begin, 6);
  EXPECT_EQ(stage_of_layer(*inter, 5), 0);
  EXPECT_EQ(stage_of_layer(*inter, 7), 1);
  EXPECT_TRUE(fails_with(pipeline_layers(l, 6),
                         "number of layers (6) is not divisible by the pipeline x virtual pipeline size 2 x 2 (4)"))
      << "6 layers do not split into 4 chunks";
  EXPECT_TRUE(fails_with(pipeline_layers(l, 6), "give the first or last stage's layers: --first-stage-layers"));
}

TEST(ParallelLayoutTest, ExplicitFirstAndLastStages) {
  ParallelLayout l;
  l.pp = 4;
  l.first_stage_layers = 1;
  l.last_stage_layers = 3;
  auto stages = pipeline_layers(l, 10);  // 1 | 3 | 3 | 3
  ASSERT_TRUE(stages.ok()) << stages.status().message();
  EXPECT_EQ((*stages)[0][0].end, 1);
  EXPECT_EQ((*stages)[1][0].end, 4);
  EXPECT_EQ((*stages)[3][0].begin, 7);
  EXPECT_TRUE(fails_with(pipeline_layers(l, 9), "layers left for the middle pipeline stages (5) is not divisible by 2"))
      << "5 middle layers over 2 stages";
  EXPECT_TRUE(fails_with(pipeline_layers(l, 4), "take all 4 layers, leaving none for 2 other pipeline stages"))
      << "empty middle stages";
  l.vpp = 2;
  EXPECT_TRUE(fails_with(pipeline_layers(l, 10),
                         "pipeline stage 0's 1 layers are not divisible by the virtual pipeline size 2"));
  // 2 | 4 | 4 | 4 layers in chunks of 1 | 2 | 2 | 2: chunk 1 of every stage follows chunk 0 of all (megatron-core's
  // get_transformer_layer_offset: stage 2's second chunk starts at 1·7 + 1 + 1·2 = 10).
  l.first_stage_layers = 2;
  l.last_stage_layers = 4;
  auto interleaved = pipeline_layers(l, 14);
  ASSERT_TRUE(interleaved.ok()) << interleaved.status().message();
  const std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> expected = {
      {{0, 1}, {7, 8}}, {{1, 3}, {8, 10}}, {{3, 5}, {10, 12}}, {{5, 7}, {12, 14}}};
  for (std::size_t s = 0; s < expected.size(); ++s)
    for (std::size_t v = 0; v < 2; ++v) {
      EXPECT_EQ((*interleaved)[s][v].begin, expected[s][v].first) << "stage " << s << " chunk " << v;
      EXPECT_EQ((*interleaved)[s][v].end, expected[s][v].second) << "stage " << s << " chunk " << v;
    }
}

TEST(ParallelLayoutTest, RankOrderAndExperts) {
  ParallelLayout l;
  l.tp = 2;
  l.pp = 3;
  l.ep = 4;
  EXPECT_EQ(l.world_size(), 24);
  for (int rank = 0; rank < l.world_size(); ++rank) {
    const auto c = rank_coordinates(l, rank);
    EXPECT_EQ(global_rank(l, c), rank);
    EXPECT_EQ(c.ep_rank, c.dp_rank);
  }
  EXPECT_EQ(rank_coordinates(l, 9).tp_rank, 1);
  EXPECT_EQ(rank_coordinates(l, 9).dp_rank, 0);
  EXPECT_EQ(rank_coordinates(l, 9).pp_rank, 1);
  EXPECT_EQ(experts_of_rank(l, 8, 3).begin, 6);
  EXPECT_EQ(experts_of_rank(l, 8, 3).end, 8);
  EXPECT_TRUE(check_layout(l, 6, 4, 8).ok());
  EXPECT_TRUE(fails_with(check_layout(l, 6, 3, 8),
                         "number of query groups (KV heads) (3) is not divisible by the tensor-parallel size (2)"))
      << "3 KV groups over tp 2";
  EXPECT_TRUE(
      fails_with(check_layout(l, 6, 4, 6), "number of experts (6) is not divisible by the expert-parallel size (4)"))
      << "6 experts over ep 4";
  EXPECT_TRUE(fails_with(check_layout(l, 6, 4, 0), "expert parallel (ep 4) needs an MoE model"))
      << "ep without experts";
  // Megatron folds the context-parallel ranks into the expert groups: cp 2 x dp 1 holds ep 2, the cp rank picking
  // the experts, and the expert optimizer shards span cp x dp / ep ranks.
  ParallelLayout folded;
  folded.cp = 2;
  folded.ep = 2;
  folded.data_parallel = 2;
  EXPECT_TRUE(check_layout(folded, 2, 2, 4).ok());
  for (int rank = 0; rank < folded.world_size(); ++rank) {
    const auto c = rank_coordinates(folded, rank);
    EXPECT_EQ(c.ep_rank, c.cp_rank) << rank;
    EXPECT_EQ(optimizer_shard(folded, c, true).count, 2);
    EXPECT_EQ(optimizer_shard(folded, c, true).index, c.dp_rank) << rank;
  }
  folded.data_parallel = 1;
  EXPECT_TRUE(check_layout(folded, 2, 2, 4).ok());
  folded.ep = 4;
  EXPECT_TRUE(fails_with(check_layout(folded, 2, 2, 4), "cp x dp 2 x 1 must be a multiple of ep 4"));
}

TEST(ParallelLayoutTest, ExpertTensorParallelCutsEachStageAsEtpEpExpertDp) {
  // Megatron's expert generator: a stage's tp·cp·dp ranks q = etp_rank + etp·(ep_rank + ep·expert_dp_rank).
  ParallelLayout l;
  l.tp = 2;
  l.ep = 2;
  l.etp = 1;
  l.data_parallel = 2;
  l.pp = 2;
  EXPECT_EQ(l.expert_tp(), 1);
  EXPECT_EQ(l.expert_dp(), 2);
  EXPECT_TRUE(l.experts_apart());
  EXPECT_TRUE(check_layout(l, 2, 2, 4).ok());
  for (int rank = 0; rank < l.world_size(); ++rank) {
    const auto c = rank_coordinates(l, rank);
    const int in_stage = rank % 4;
    EXPECT_EQ(c.etp_rank, 0) << rank;
    EXPECT_EQ(c.ep_rank, in_stage % 2) << rank;  // the tp ranks hold different experts
    EXPECT_EQ(c.expert_dp_rank, in_stage / 2) << rank;
    EXPECT_EQ(optimizer_shard(l, c, true).count, 2);
    EXPECT_EQ(optimizer_shard(l, c, true).index, c.expert_dp_rank) << rank;
    EXPECT_EQ(optimizer_shard(l, c, false).index, c.dp_rank) << rank;
  }
  // etp larger than tp: the experts split over data-parallel ranks.
  ParallelLayout wide;
  wide.etp = 2;
  wide.data_parallel = 4;
  EXPECT_EQ(wide.expert_dp(), 2);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(rank_coordinates(wide, rank).etp_rank, rank % 2);
    EXPECT_EQ(rank_coordinates(wide, rank).expert_dp_rank, rank / 2);
  }
  // etp = tp is the default, whether given or not.
  ParallelLayout same;
  same.tp = 2;
  same.data_parallel = 2;
  EXPECT_FALSE(same.experts_apart());
  EXPECT_EQ(rank_coordinates(same, 3).etp_rank, 1);
  // With etp < tp the expert-parallel ranks may be tensor-parallel ones: tp 2, dp 1 holds ep 2 at etp 1.
  ParallelLayout over_tp;
  over_tp.tp = 2;
  over_tp.ep = 2;
  over_tp.etp = 1;
  over_tp.data_parallel = 1;
  EXPECT_TRUE(check_layout(over_tp, 2, 2, 4).ok());
  EXPECT_EQ(rank_coordinates(over_tp, 1).ep_rank, 1);
  EXPECT_TRUE(layout_from_json(layout_to_json(over_tp), "m.json").ok());
  over_tp.etp = 0;
  EXPECT_TRUE(fails_with(check_layout(over_tp, 2, 2, 4), "dp 1 must be a multiple of ep 2"));
  l.etp = 4;
  EXPECT_TRUE(
      fails_with(check_layout(l, 2, 2, 4), "the expert-tensor-parallel size 4 times ep 2 must divide tp x cp x dp 4"));
}

TEST(ParallelLayoutTest, NormNamingAndJson) {
  EXPECT_EQ(input_norm_name(NormNaming::kTransformerEngine), "self_attention.linear_qkv.layer_norm_weight");
  EXPECT_EQ(pre_mlp_norm_name(NormNaming::kTransformerEngine, false), "mlp.linear_fc1.layer_norm_weight");
  EXPECT_EQ(pre_mlp_norm_name(NormNaming::kTransformerEngine, true), "pre_mlp_layernorm.weight");
  EXPECT_EQ(input_norm_name(NormNaming::kLocal), "input_layernorm.weight");
  EXPECT_EQ(detect_norm_naming({"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"}),
            NormNaming::kTransformerEngine);
  EXPECT_EQ(detect_norm_naming({"decoder.layers.0.input_layernorm.weight"}), NormNaming::kLocal);
  // A hybrid without attention layers: its Mamba mixers' and MLPs' fused norms tell Transformer Engine's names.
  EXPECT_EQ(detect_norm_naming({"decoder.layers.0.mixer.in_proj.layer_norm_weight"}), NormNaming::kTransformerEngine);
  EXPECT_EQ(detect_norm_naming({"decoder.layers.1.mlp.linear_fc1.layer_norm_weight"}), NormNaming::kTransformerEngine);
  EXPECT_EQ(detect_norm_naming({"decoder.layers.0.norm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"}),
            NormNaming::kLocal);
}

TEST(ParallelLayoutTest, JsonRoundTripAndValidation) {
  ParallelLayout l;
  l.tp = 2;
  l.pp = 4;
  l.vpp = 2;
  l.cp = 2;
  l.ep = 2;
  l.data_parallel = 4;
  l.make_vocab_size_divisible_by = 64;
  auto back = layout_from_json(layout_to_json(l), "m.json");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(*back, l);
  // The manifest records the sizes alone, in this form.
  EXPECT_EQ(layout_sizes_to_json(l),
            (nlohmann::json{{"tp", 2}, {"pp", 4}, {"vpp", 2}, {"dp", 4}, {"ep", 2}, {"cp", 2}}));
  back = layout_from_json(layout_sizes_to_json(l), "manifest.json");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->dp(), 4);
  EXPECT_EQ(back->make_vocab_size_divisible_by, 128);
  // The experts' own tensor parallelism is recorded only where it is not tp.
  l.etp = 1;
  EXPECT_EQ(layout_sizes_to_json(l)["etp"], 1);
  back = layout_from_json(layout_to_json(l), "m.json");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(*back, l);
  back = layout_from_json({{"tp", 2}, {"etp", 2}}, "m.json");  // given equal to tp: the default
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->etp, 0);
  EXPECT_TRUE(fails_with(layout_from_json({{"tp", 2}, {"ep", 2}, {"dp", 2}, {"etp", 4}}, "m.json"),
                         "m.json: layout: tp x cp x dp 4 is not a multiple of etp x ep 8"));
  // What older manifests record (no cp, no dp) reads with the defaults: cp 1, dp = ep.
  back = layout_from_json({{"tp", 2}, {"pp", 1}, {"ep", 2}}, "old.json");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->cp, 1);
  EXPECT_EQ(back->dp(), 2);
  for (const auto& bad :
       {nlohmann::json{{"tp", 0}}, nlohmann::json{{"tp", -1}}, nlohmann::json{{"pp", "2"}},
        nlohmann::json{{"dp", 3}, {"ep", 2}}, nlohmann::json{{"tp", 1ll << 40}}, nlohmann::json::array()}) {
    const auto r = layout_from_json(bad, "bad.json");
    ASSERT_FALSE(r.ok()) << bad.dump();
    EXPECT_NE(r.status().message().find("bad.json"), std::string::npos) << r.status().message();
  }
}

TEST(ParallelLayoutTest, RankOrderWithContextParallel) {
  // tp-cp-ep-dp-pp: tp fastest, then cp, then dp, then pp.
  ParallelLayout l;
  l.tp = 2;
  l.cp = 2;
  l.data_parallel = 2;
  l.pp = 2;
  EXPECT_EQ(l.world_size(), 16);
  EXPECT_EQ(global_rank(l, {.tp_rank = 1}), 1);
  EXPECT_EQ(global_rank(l, {.cp_rank = 1}), 2);
  EXPECT_EQ(global_rank(l, {.dp_rank = 1}), 4);
  EXPECT_EQ(global_rank(l, {.pp_rank = 1}), 8);
  for (int rank = 0; rank < l.world_size(); ++rank) EXPECT_EQ(global_rank(l, rank_coordinates(l, rank)), rank);
  const auto c = rank_coordinates(l, 13);  // 13 = 1 + 2·(0 + 2·(1 + 2·1))
  EXPECT_EQ(c.tp_rank, 1);
  EXPECT_EQ(c.cp_rank, 0);
  EXPECT_EQ(c.dp_rank, 1);
  EXPECT_EQ(c.pp_rank, 1);
}

}  // namespace
}  // namespace trestle
