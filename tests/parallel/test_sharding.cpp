// The tensor-parallel sharding plan (issue 7), checked on the host for the built-in models.

#include <boost/test/unit_test.hpp>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "dsv4/parallel/sharding.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using parallel::shard_kind;

namespace {

// What each model supports (the tests check the claim against the plans themselves).
static_assert(parallel::world_size_fits<models::v41_flash>(1) &&
              parallel::world_size_fits<models::v41_flash>(2) &&
              parallel::world_size_fits<models::v41_flash>(4) &&
              parallel::world_size_fits<models::v41_flash>(8));
static_assert(!parallel::world_size_fits<models::v41_flash>(3) &&
              !parallel::world_size_fits<models::v41_flash>(16));
static_assert(parallel::world_size_fits<models::tiny>(1) && parallel::world_size_fits<models::tiny>(2));
static_assert(!parallel::world_size_fits<models::tiny>(4) && !parallel::world_size_fits<models::tiny>(8));

using models_under_test = std::tuple<models::tiny, models::v41_flash>;

template <class Model>
std::vector<int> supported_worlds() {
  std::vector<int> out;
  for (int w : {1, 2, 4, 8})
    if (parallel::world_size_fits<Model>(w)) out.push_back(w);
  return out;
}

// plans[r] = rank r's plan, all in schema order.
template <class Model>
std::vector<std::vector<parallel::tensor_shard>> all_ranks(const std::vector<io::tensor_spec>& schema,
                                                           int world) {
  std::vector<std::vector<parallel::tensor_shard>> plans;
  for (int r = 0; r < world; ++r) plans.push_back(parallel::shard_plan(schema, world, r, Model::dims));
  return plans;
}

std::string weight_of_scale(const std::string& name) {
  return name.substr(0, name.size() - 6) + ".weight";
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sharding)

// The rules, spot-checked by name against model.py's modules.
BOOST_AUTO_TEST_CASE(rules_follow_the_reference_modules) {
  const auto plan = parallel::shard_plan<models::v41_flash>(8, 3);
  std::map<std::string, parallel::tensor_shard> m;
  for (const auto& s : plan) m.emplace(s.name, s);
  const std::vector<std::pair<std::string, shard_kind>> expect = {
      {"embed.weight", shard_kind::split_rows},
      {"head.weight", shard_kind::split_rows},
      {"norm.weight", shard_kind::replicated},
      {"image_start", shard_kind::replicated},
      {"layers.0.attn.wq_a.weight", shard_kind::replicated},
      {"layers.0.attn.wq_b.weight", shard_kind::split_rows},
      {"layers.0.attn.wq_b.scale", shard_kind::split_rows},
      {"layers.0.attn.wkv.weight", shard_kind::replicated},
      {"layers.0.attn.wo_a.weight", shard_kind::split_rows},
      {"layers.0.attn.wo_a.scale", shard_kind::split_rows},
      {"layers.0.attn.wo_b.weight", shard_kind::split_cols},
      {"layers.0.attn.wo_b.scale", shard_kind::split_cols},
      {"layers.0.attn.attn_sink", shard_kind::split_rows},
      {"layers.2.attn.compressor.wkv.weight", shard_kind::replicated},
      {"layers.2.attn.compressor.wgate.weight", shard_kind::replicated},
      {"layers.2.attn.indexer.wk.weight", shard_kind::replicated},
      {"layers.2.attn.indexer.k_norm.weight", shard_kind::replicated},
      {"layers.24.attn.indexer.wq_b.weight", shard_kind::split_rows},
      {"layers.24.attn.indexer.weights_proj.weight", shard_kind::split_rows},
      {"layers.5.hc_attn_fn", shard_kind::replicated},
      {"layers.5.ffn.gate.weight", shard_kind::replicated},
      {"layers.5.ffn.gate.bias", shard_kind::replicated},
      {"layers.5.ffn.experts.100.w2.scale", shard_kind::expert},
      {"layers.5.ffn.shared_experts.w1.weight", shard_kind::replicated},
      {"layers.1.engram.embed.weight", shard_kind::rows_padded},
      {"layers.1.engram.embed.scale", shard_kind::rows_padded},
      {"layers.1.engram.wkv.weight", shard_kind::replicated},
      {"layers.14.engram.q_weight", shard_kind::replicated},
      {"mtp.0.main_proj.weight", shard_kind::replicated},
      {"mtp.1.attn.wq_b.weight", shard_kind::split_rows},
      {"mtp.1.ffn.experts.127.w1.weight", shard_kind::expert},
      {"mtp.2.markov_head.embed.weight", shard_kind::split_rows},
      {"mtp.2.markov_head.head.weight", shard_kind::split_rows},
      {"mtp.2.confidence_head.proj.weight", shard_kind::replicated},
      {"vision.blocks.3.attn.wqkv.weight", shard_kind::replicated},
      {"aligner.w1.weight", shard_kind::replicated},
  };
  for (const auto& [name, kind] : expect) {
    BOOST_TEST_CONTEXT(name) {
      BOOST_REQUIRE(m.count(name) == 1u);
      BOOST_TEST(parallel::to_string(m.at(name).kind) == parallel::to_string(kind));
    }
  }
  // V4.1 at W = 8, rank 3: 8 heads of 512, one wo_a group of 1024 rows, 48 experts, 16 DSpark ones.
  BOOST_TEST((m.at("layers.0.attn.wq_b.weight").shape == std::vector<long long>{4096, 1280}));
  BOOST_TEST(m.at("layers.0.attn.wq_b.weight").offset == 3 * 4096);
  BOOST_TEST((m.at("layers.0.attn.wq_b.scale").shape == std::vector<long long>{128, 40}));
  BOOST_TEST((m.at("layers.0.attn.attn_sink").shape == std::vector<long long>{8}));
  BOOST_TEST((m.at("layers.0.attn.wo_a.weight").shape == std::vector<long long>{1024, 4096}));
  BOOST_TEST((m.at("layers.0.attn.wo_b.weight").shape == std::vector<long long>{5120, 1024}));
  BOOST_TEST((m.at("layers.0.attn.wo_b.scale").shape == std::vector<long long>{160, 32}));
  BOOST_TEST((m.at("layers.24.attn.indexer.wq_b.weight").shape == std::vector<long long>{512, 1280}));
  BOOST_TEST((m.at("layers.24.attn.indexer.weights_proj.weight").shape == std::vector<long long>{4, 5120}));
  BOOST_TEST((m.at("embed.weight").shape == std::vector<long long>{16160, 5120}));
  BOOST_TEST(m.at("layers.5.ffn.experts.100.w2.scale").held == false);
  BOOST_TEST(m.at("layers.5.ffn.experts.144.w2.scale").held == true);  // 144 / 48 = 3
  BOOST_TEST(m.at("mtp.1.ffn.experts.48.w1.weight").held == true);     // 48 / 16 = 3
}

// Every tensor of both schemas gets a rule, and one rank of one process holds the whole model.
BOOST_AUTO_TEST_CASE_TEMPLATE(world_one_keeps_every_tensor_whole, Model, models_under_test) {
  const auto schema = models::checkpoint_schema<Model>();
  const auto plan = parallel::shard_plan(schema, 1, 0, Model::dims);
  BOOST_REQUIRE(plan.size() == schema.size());
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto& s = plan[i];
    BOOST_TEST_CONTEXT(s.name) {
      BOOST_TEST(s.name == schema[i].name);
      BOOST_TEST(std::string(s.module).size() > 0u);
      BOOST_TEST(s.shape == parallel::default_full_shape(schema[i], Model::dims));
      BOOST_TEST(s.held);
      BOOST_TEST(s.pad_rows == 0);
      if (s.kind != shard_kind::expert) BOOST_TEST(s.offset == 0);
    }
  }
}

// For every supported W: split tensors tile the full tensor exactly, scale tiles never straddle
// ranks, every expert lives on exactly one rank (n / W per rank and layer, in contiguous ranges),
// Engram tables are ceil chunks padded on the last rank only.
BOOST_AUTO_TEST_CASE_TEMPLATE(ranks_tile_every_tensor, Model, models_under_test) {
  const auto schema = models::checkpoint_schema<Model>();
  for (int world : supported_worlds<Model>()) {
    BOOST_TEST_CONTEXT("world size " << world) {
      const auto plans = all_ranks<Model>(schema, world);
      std::map<std::string, int> expert_owners;                   // expert tensor -> ranks holding it
      std::map<std::string, std::set<long long>> per_rank_layer;  // "<rank>|<ffn prefix>" -> experts
      bool ok = true;
      for (std::size_t i = 0; i < schema.size() && ok; ++i) {
        const auto full = parallel::default_full_shape(schema[i], Model::dims);
        const auto& s0 = plans[0][i];
        const int d = s0.split_dim();
        long long next = 0, pad = 0;
        for (int r = 0; r < world; ++r) {
          const auto& s = plans[r][i];
          ok = ok && s.kind == s0.kind && s.name == schema[i].name;
          if (s.kind == shard_kind::replicated) {
            ok = ok && s.shape == full && s.held;
          } else if (s.kind == shard_kind::expert) {
            ok = ok && s.shape == full;
            if (s.held) {
              ++expert_owners[s.name];
              const auto ffn = s.name.substr(0, s.name.find("experts.") + 8);
              per_rank_layer[std::to_string(r) + "|" + ffn].insert(s.offset);
            } else {
              expert_owners.try_emplace(s.name, 0);
            }
          } else {
            // Slices are contiguous, in rank order, and agree with the full shape off the split dim.
            ok = ok && s.offset == next && s.shape.size() == full.size();
            for (std::size_t k = 0; k < full.size() && ok; ++k)
              if (static_cast<int>(k) != d) ok = s.shape[k] == full[k];
            next += s.shape[d];
            pad += s.pad_rows;
            if (s.kind == shard_kind::rows_padded) {
              ok = ok && s.shape[0] == (full[0] + world - 1) / world;
              ok = ok && (s.pad_rows == 0 || r == world - 1);  // padding only on the last rank
            }
          }
        }
        if (d >= 0) ok = ok && next - pad == full[d] && (s0.kind == shard_kind::rows_padded || pad == 0);
        if (!ok) BOOST_ERROR("tiling broken for " << schema[i].name);
      }
      // Scales: the rank's tile range covers exactly its weight slice (tile 32, or wo_a's).
      std::map<std::string, std::size_t> index;
      for (std::size_t i = 0; i < schema.size(); ++i) index.emplace(schema[i].name, i);
      int scale_pairs = 0;
      for (std::size_t i = 0; i < schema.size(); ++i) {
        const auto& n = schema[i].name;
        if (!n.ends_with(".scale") || plans[0][i].split_dim() < 0) continue;
        const std::size_t w = index.at(weight_of_scale(n));
        const int d = plans[0][i].split_dim();
        BOOST_REQUIRE(plans[0][w].split_dim() == d);
        const long long tile = plans[0][i].kind == shard_kind::rows_padded ? 1 : 32;  // Engram: per row
        for (int r = 0; r < world; ++r) {
          const auto &sc = plans[r][i], &wt = plans[r][w];
          if (sc.offset * tile != wt.offset || sc.shape[d] * tile != wt.shape[d] ||
              sc.pad_rows != wt.pad_rows) {
            BOOST_ERROR(n << " rank " << r << ": scale slice does not match the weight slice");
            break;
          }
        }
        ++scale_pairs;
      }
      BOOST_TEST(scale_pairs > 0);
      // Experts: exactly one owner each; each rank holds n / W of every MoE layer, contiguous from r n / W.
      for (const auto& [name, owners] : expert_owners)
        if (owners != 1) BOOST_ERROR(name << " is held by " << owners << " ranks");
      for (const auto& [key, experts] : per_rank_layer) {
        const int r = std::stoi(key.substr(0, key.find('|')));
        const long long n = key.find("mtp.") != std::string::npos ? Model::dims.dspark.dspark_n_routed_experts
                                                                  : Model::dims.moe.n_routed_experts;
        const long long per = n / world;
        if (static_cast<long long>(experts.size()) != per || *experts.begin() != r * per ||
            *experts.rbegin() != (r + 1) * per - 1)
          BOOST_ERROR(key << ": rank holds " << experts.size() << " experts, expected " << per);
      }
      BOOST_TEST(per_rank_layer.size() ==
                 static_cast<std::size_t>(world) * (models::model_traits<Model>::schedule::num_layers +
                                                    models::model_traits<Model>::schedule::drafter::stages));
    }
  }
}

// Engram ceil chunks at V4.1 size: 384006168 rows over 8 ranks = 48000771 each, the last padded.
BOOST_AUTO_TEST_CASE(engram_rows_are_ceil_chunks_padded_at_the_end) {
  const io::tensor_spec t{"layers.1.engram.embed.weight", {384006168, 256}, {}};
  const io::tensor_spec sc{"layers.1.engram.embed.scale", {384006168, 8}, {}};
  long long real = 0;
  for (int r = 0; r < 8; ++r) {
    const auto s = parallel::shard_of(t, t.shape, 8, r, models::v41_flash::dims);
    const auto ss = parallel::shard_of(sc, sc.shape, 8, r, models::v41_flash::dims);
    BOOST_TEST(s.shape[0] == 48000771);
    BOOST_TEST(s.offset == r * 48000771ll);
    BOOST_TEST(s.pad_rows == (r == 7 ? 8ll * 48000771 - 384006168 : 0));
    BOOST_TEST((ss.shape == std::vector<long long>{48000771, 8}));
    BOOST_TEST(ss.pad_rows == s.pad_rows);
    real += s.shape[0] - s.pad_rows;
  }
  BOOST_TEST(real == 384006168);
  // A table shorter than (W - 1) chunks leaves later ranks all padding: reported, not hidden.
  const io::tensor_spec small{"layers.1.engram.embed.weight", {5, 32}, {}};
  const auto last = parallel::shard_of(small, small.shape, 4, 3, models::tiny::dims);
  BOOST_TEST(last.shape[0] == 2);
  BOOST_TEST(last.pad_rows == 2);
}

// A W the model does not support: the plan names the tensor, the dimension, the field and W.
BOOST_AUTO_TEST_CASE(unsupported_world_sizes_are_named_errors) {
  using test::throws_with;
  // tiny: 2 output groups cannot split over 4 ranks (wo_a is the first tensor that splits them).
  BOOST_TEST(throws_with([] { parallel::shard_plan<models::tiny>(4, 0); },
                         "tensor 'layers.0.attn.wo_a.weight', dim 0, world size 4: it splits o_groups = 2"));
  BOOST_TEST(throws_with([] { parallel::shard_plan<models::tiny>(8, 0); }, "n_heads = 4"));
  const auto tiny_schema = models::checkpoint_schema<models::tiny>();
  const io::tensor_spec wo_a{"layers.0.attn.wo_a.weight", {128, 256}, {}};
  BOOST_TEST(
      throws_with([&] { parallel::shard_of(wo_a, wo_a.shape, 4, 1, models::tiny::dims); },
                  "o_groups = 2 over the ranks (ColumnParallelLinear (grouped wo_a)), which world size 4"));
  // V4.1: vocab 129280 is not a multiple of 3; the first tensor in the schema says so.
  BOOST_TEST(throws_with([] { parallel::shard_plan<models::v41_flash>(3, 0); },
                         "tensor 'embed.weight', dim 0, world size 3: it splits vocab_size = 129280"));
  // Experts: V4.1's 384 over 5 ranks fail even where the other splits would not be asked.
  const io::tensor_spec ex{"layers.0.ffn.experts.0.w1.weight", {2304, 2560}, {}};
  BOOST_TEST(throws_with([&] { parallel::shard_of(ex, ex.shape, 5, 0, models::v41_flash::dims); },
                         "n_routed_experts = 384"));
  // The violation lists agree with what the plans do.
  for (int w : {1, 2, 3, 4, 5, 6, 8, 16}) {
    BOOST_TEST_CONTEXT("world size " << w) {
      BOOST_TEST(parallel::world_size_violations<models::tiny>(w).empty() ==
                 parallel::world_size_fits<models::tiny>(w));
      bool tiny_plans = true;
      try {
        for (int r = 0; r < w; ++r) parallel::shard_plan(tiny_schema, w, r, models::tiny::dims);
      } catch (const dsv4::error&) {
        tiny_plans = false;
      }
      BOOST_TEST(tiny_plans == parallel::world_size_fits<models::tiny>(w));
    }
  }
  BOOST_TEST(parallel::world_size_violations<models::tiny>(4).size() == 1u);        // o_groups only
  BOOST_TEST(parallel::world_size_violations<models::v41_flash>(16).size() == 1u);  // o_groups only
  // Unknown names and bad ranks are errors too.
  const io::tensor_spec odd{"layers.0.attn.mystery.weight", {4, 4}, {}};
  BOOST_TEST(throws_with([&] { parallel::shard_of(odd, odd.shape, 2, 0, models::tiny::dims); },
                         "no tensor-parallel rule for tensor 'layers.0.attn.mystery.weight'"));
  BOOST_TEST(throws_with([&] { parallel::shard_of(wo_a, wo_a.shape, 2, 2, models::tiny::dims); },
                         "rank 2 is not in world size 2"));
}

// FP8 scales: a rank's weight rows must be whole 32-row tiles; wo_a's 128 x 128 tiles are read
// from the scale's shape.
BOOST_AUTO_TEST_CASE(scale_tiles_never_straddle_ranks) {
  using test::throws_with;
  models::model_config c = models::tiny::dims;
  c.attn.head_dim = 48;  // wq_b: 4 heads x 48 = 192 rows; 2 ranks x 96 rows = 3 tiles each, 4 ranks x 48: no
  const io::tensor_spec sc{"layers.0.attn.wq_b.scale", {6, 2}, {}};
  const auto s = parallel::shard_of(sc, sc.shape, 2, 1, c);
  BOOST_TEST((s.shape == std::vector<long long>{3, 2}));
  BOOST_TEST(s.offset == 3);
  BOOST_TEST(throws_with([&] { parallel::shard_of(sc, sc.shape, 4, 1, c); },
                         "a rank's 48 weight rows are not a whole number of 32-element scale tiles"));
  // V4.1 wo_a with 128 x 128 tiles: 8192 rows = 64 tile rows, 8 per rank at W = 8.
  const io::tensor_spec wo_a128{"layers.0.attn.wo_a.scale", {64, 32}, {}};
  const auto t = parallel::shard_of(wo_a128, wo_a128.shape, 8, 5, models::v41_flash::dims);
  BOOST_TEST((t.shape == std::vector<long long>{8, 32}));
  BOOST_TEST(t.offset == 40);
  // tiny wo_a with 128 x 128 tiles: its 128 rows are one tile, which 2 ranks cannot share.
  const io::tensor_spec tiny128{"layers.0.attn.wo_a.scale", {1, 2}, {}};
  BOOST_TEST(throws_with([&] { parallel::shard_of(tiny128, tiny128.shape, 2, 0, models::tiny::dims); },
                         "not a whole number of 128-element scale tiles"));
  // A scale whose shape is not one per tile is named as such.
  const io::tensor_spec bad{"layers.0.attn.wo_b.scale", {160, 7}, {}};
  BOOST_TEST(throws_with([&] { parallel::shard_of(bad, bad.shape, 2, 0, models::v41_flash::dims); },
                         "scale extent 7 is not one per 32-element tile"));
}

BOOST_AUTO_TEST_SUITE_END()
