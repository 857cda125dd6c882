// Tensor parallelism simulated on the host (parallel/tensor_parallel_reference.hpp) on tiny's
// random checkpoint: W ranks, each loaded from its own shard only, computing model.py's per-rank
// partial results, with in-memory collectives that sum in rank order.
//  - W = 1 equals the one-process host model bit for bit (a prefill past the window and the
//    top-k, then decode steps, then a chunk appended in exact mode);
//  - W = 2 (the only other W tiny allows) and W = 4 (on tiny_w4, tiny with 4 output groups)
//    agree with it to a tolerance: model.py's split rounding (wo_b's bf16 partials, the MoE's
//    fp32 partials, the indexer's bf16 partial scores) changes the first block's outputs by
//    about one bf16 ulp of a row's peak (checked per sublayer on equal inputs), and 40 layers of
//    random weights carry that on chaotically, as they do between the CUDA and host models
//    (docs/decisions.md), so the logits agree to cosine ~0.99, not to bf16;
//  - each rank's shard and model hold only its slices;
//  - a W that does not divide the model is an error naming the dimension.
// DSV4_TP_MEASURE=N runs the agreement measurement over N seeds and prints it (docs/parallel.md).

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsv4/engram/reference.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/kernels/moe/reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/parallel/tensor_parallel_reference.hpp"
#include "support/errors.hpp"
#include "support/tiny_inputs.hpp"
#include "support/random.hpp"

using namespace dsv4;
using tiny = models::tiny;

namespace {

//! tiny with o_groups = 4 (one head per group), which fits W = 4 (tiny's o_groups = 2 stops at
//! W = 2): one head, one group and one index head per rank.
struct tiny_w4 : tiny {
  static constexpr const char* name = "tiny_w4";
  static constexpr models::model_config dims = [] {
    models::model_config d = tiny::dims;
    d.attn.o_groups = 4;
    return d;
  }();
};
static_assert(parallel::world_size_fits<tiny_w4>(4) && !parallel::world_size_fits<tiny>(4));

constexpr int prompt = 40;  // past the window (16) and the ratio-2 sources' top-k (16 of 20 groups)
constexpr int steps = 4;    // decode steps after the prefill



std::size_t bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

struct agreement {
  double cosine = 1, max_abs = 0, max_logit = 0;
  bool same_argmax = true;
};

agreement compare(const std::vector<float>& got, const std::vector<float>& want) {
  double dot = 0, gg = 0, ww = 0;
  agreement a;
  for (std::size_t i = 0; i < want.size(); ++i) {
    dot += double(got[i]) * want[i], gg += double(got[i]) * got[i], ww += double(want[i]) * want[i];
    a.max_abs = std::max(a.max_abs, std::fabs(double(got[i]) - want[i]));
    a.max_logit = std::max(a.max_logit, std::fabs(double(want[i])));
  }
  a.cosine = dot / std::sqrt(gg * ww);
  a.same_argmax = std::max_element(got.begin(), got.end()) - got.begin() ==
                  std::max_element(want.begin(), want.end()) - want.begin();
  return a;
}

//! The host model's and the W-rank simulation's logits at the prefill and each decode step, both
//! decoding the host model's greedy tokens (so the inputs stay the same).
struct run_logits {
  std::vector<std::vector<float>> host, tp;
  std::map<std::pair<int, std::string>, std::vector<numerics::bf16>> host_stages,
      tp_stages;  //!< the prefill's
};

//! `append` > 0: after the decode steps, a chunk of that many tokens appended (exact mode).
template <class Model = tiny>
run_logits run_both(io::checkpoint& full, int world, std::uint64_t salt, int decode_steps = steps,
                    int prompt_length = prompt, int append = 0) {
  const auto map = test::tiny_identity_map();
  const auto host = model::host_model<Model>::load(full, map);
  const auto tp = parallel::tp_model<Model>::load(full, map, world);
  model::host_sequence hs;
  parallel::tp_sequence ts;
  const auto ids = test::tiny_random_ids(salt, prompt_length);
  run_logits r;
  auto keep = [](auto& into) {
    return model::layer_observer(
        [&into](int layer, std::string_view stage, std::span<const numerics::bf16> v) {
          into[{layer, std::string(stage)}].assign(v.begin(), v.end());
        });
  };
  const model::layer_observer host_obs = keep(r.host_stages), tp_obs = keep(r.tp_stages);
  r.host.push_back(model::forward(host, hs, ids, &host_obs));
  r.tp.push_back(parallel::forward(tp, ts, ids, &tp_obs));
  for (int i = 0; i < decode_steps; ++i) {
    const auto& last = r.host.back();
    const std::int32_t next[1] = {std::int32_t(std::max_element(last.begin(), last.end()) - last.begin())};
    r.host.push_back(model::forward(host, hs, next));
    r.tp.push_back(parallel::forward(tp, ts, next));
  }
  if (append > 0) {
    const auto chunk = test::tiny_random_ids(salt + 1000, append);
    r.host.push_back(model::forward(host, hs, chunk));
    r.tp.push_back(parallel::forward(tp, ts, chunk));
  }
  BOOST_TEST(ts.length == hs.length);
  return r;
}

//! Of two bf16 vectors: how many values differ, and the largest difference in units of the
//! larger value's bf16 ulp (2^(exponent - 7)).
struct stage_diff {
  std::size_t differ = 0, count = 0;
  double max_ulps = 0;
  double max_rel_row = 0;  //!< the largest |difference| over its row's largest |value| (rows of `dim`)
};
stage_diff diff_of(const std::vector<numerics::bf16>& a, const std::vector<numerics::bf16>& b) {
  stage_diff d;
  d.count = a.size();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float x = a[i].to_float(), y = b[i].to_float();
    if (x == y) continue;
    ++d.differ;
    const float big = std::max(std::fabs(x), std::fabs(y));
    const double ulp = std::ldexp(1.0, std::ilogb(big) - 7);
    d.max_ulps = std::max(d.max_ulps, std::fabs(double(x) - y) / ulp);
  }
  const std::size_t dim = std::size_t(tiny::dims.dim);
  for (std::size_t r = 0; r + dim <= b.size(); r += dim) {
    double peak = 0, worst = 0;
    for (std::size_t i = r; i < r + dim; ++i)
      peak = std::max(peak, std::fabs(double(b[i].to_float()))),
      worst = std::max(worst, std::fabs(double(a[i].to_float()) - b[i].to_float()));
    if (peak > 0) d.max_rel_row = std::max(d.max_rel_row, worst / peak);
  }
  return d;
}

std::size_t checkpoint_bytes(io::checkpoint& ck, const std::vector<io::tensor_spec>& schema) {
  std::size_t n = 0;
  for (const auto& t : schema)
    if (ck.contains(t.name)) n += ck.tensor(t.name).bytes.size();
  return n;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(tensor_parallel)

// "long": about 20 s each here, minutes under the sanitizers, where the CI skips them (the W = 2
// case keeps the ranks' threads and collectives under ASan / UBSan).
BOOST_AUTO_TEST_CASE(one_rank_equals_the_host_model, *boost::unit_test::label("long")) {
  io::checkpoint full =
      io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 71, io::random_init::scaled);
  const auto r = run_both(full, 1, 5, steps, prompt, 12);  // + an appended chunk (exact mode)
  for (std::size_t i = 0; i < r.host.size(); ++i) {
    BOOST_TEST_REQUIRE(r.tp[i].size() == r.host[i].size());
    BOOST_TEST(bits_differ(r.tp[i], r.host[i]) == 0u, "call " << i);
  }
}

// The bounds, from DSV4_TP_MEASURE (docs/parallel.md): at W = 2 over 6 seeds x 5 calls of tiny
// the worst cosine was 0.972 (mean 0.988), of tiny_w4 0.958 (mean 0.987), and the greedy token
// agreed in 21 and 22 of 30 calls; one seed's mean was 0.976. The tests run fixed prompts with
// these bounds: every call's cosine >= 0.94, the mean >= 0.97, the same greedy token in at least
// half the calls. Random layers amplify rounding (the file comment); the rounding itself is
// bounded tightly in sublayers_on_equal_inputs.
void check_agreement(const run_logits& r, int world) {
  int same = 0;
  double worst_cos = 1, sum_cos = 0;
  std::size_t exact = 0;
  for (std::size_t i = 0; i < r.host.size(); ++i) {
    const auto a = compare(r.tp[i], r.host[i]);
    BOOST_TEST_MESSAGE("W=" << world << " call " << i << ": cosine " << a.cosine << ", max |diff| "
                            << a.max_abs << " of max |logit| " << a.max_logit
                            << (a.same_argmax ? ", same greedy token" : ", other greedy token"));
    same += a.same_argmax;
    worst_cos = std::min(worst_cos, a.cosine), sum_cos += a.cosine;
    exact += bits_differ(r.tp[i], r.host[i]) == 0;
  }
  BOOST_TEST(worst_cos >= 0.94);
  BOOST_TEST(sum_cos / double(r.host.size()) >= 0.97);
  BOOST_TEST(2 * same >= int(r.host.size()));
  BOOST_TEST(exact < r.host.size());  // the split rounding is real (else this would not test it)
}

BOOST_AUTO_TEST_CASE(two_ranks_agree_with_one) {
  static_assert(parallel::world_size_fits<tiny>(2));
  io::checkpoint full =
      io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 72, io::random_init::scaled);
  auto r = run_both(full, 2, 6, steps, prompt, 12);  // + an appended chunk
  // The appended chunk (12 rows after 44 positions, exact mode) on its own: it comes after five
  // calls' worth of drift, so it gets a bound of its own (measured: cosine 0.944, same greedy
  // token); the five calls keep the measured bounds below.
  const auto appended = compare(r.tp.back(), r.host.back());
  BOOST_TEST_MESSAGE("W=2 appended chunk: cosine " << appended.cosine);
  BOOST_TEST(appended.cosine >= 0.90);
  BOOST_TEST(bits_differ(r.tp.back(), r.host.back()) > 0u);
  r.tp.pop_back(), r.host.pop_back();
  check_agreement(r, 2);
  // Where the first differences come from (the prefill's first blocks; see sublayers_on_equal_inputs).
  for (int l = 0; l < 2; ++l)
    for (const char* stage : {"attn_in", "attn_out", "ffn_in", "ffn_out"}) {
      const auto d = diff_of(r.tp_stages.at({l, stage}), r.host_stages.at({l, stage}));
      BOOST_TEST_MESSAGE("W=2 prefill layer " << l << " " << stage << ": " << d.differ << " of " << d.count
                                              << " values differ, at most " << d.max_rel_row
                                              << " of the row's peak");
    }
  BOOST_TEST(diff_of(r.tp_stages.at({0, "attn_in"}), r.host_stages.at({0, "attn_in"})).differ ==
             0u);  // embedding: exact
}

BOOST_AUTO_TEST_CASE(four_ranks_on_a_variant_agree_with_one, *boost::unit_test::label("long")) {
  io::checkpoint full =
      io::random_checkpoint_in_memory(models::checkpoint_schema<tiny_w4>(), 76, io::random_init::scaled);
  check_agreement(run_both<tiny_w4>(full, 4, 8, 1, 34),
                  4);  // (4 threads on the test machine's cores: kept short)
}

// Each sublayer on the same input at W = 2 against the one-process reference: the MoE and the
// Engram module bit for bit (tiny routes k = 2 experts, whose sum is one fp32 addition on either
// side; an Engram row has one nonzero term in its all-reduce), the attention output within
// wo_b's split rounding (each rank's partial rounded to bf16 before the fp32 sum).
BOOST_AUTO_TEST_CASE(sublayers_on_equal_inputs) {
  constexpr int W = 2, rows = 40;  // layer 2 (ratio 2): 20 groups, of which the top-k keeps 16
  constexpr models::model_config c = tiny::dims;
  static_assert(c.moe.n_activated_experts == 2, "the bit-for-bit MoE check needs k = 2");
  io::checkpoint full =
      io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 75, io::random_init::scaled);
  const auto map = test::tiny_identity_map();
  const auto host = model::host_model<tiny>::load(full, map);
  const auto tp = parallel::tp_model<tiny>::load(full, map, W);
  auto rng = test::make_rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<numerics::bf16> x(std::size_t(rows) * c.dim);
  for (auto& v : x) v = numerics::bf16::from_float(normal(rng));

  for (int l : {0, 7, 39}) {
    const auto& b = host.blocks[std::size_t(l)];
    const auto want =
        kernels::moe::moe_layer_reference(x, b.gate, b.experts, b.shared, b.inter, b.swiglu_limit);
    std::vector<std::vector<numerics::bf16>> got(W);
    parallel::run_ranks(W, [&](const parallel::detail::rank_context& ctx) {
      const auto& m = tp.ranks[std::size_t(ctx.rank)];
      got[std::size_t(ctx.rank)] =
          parallel::detail::moe_rank(ctx, m.blocks[std::size_t(l)], ctx.rank * m.experts_part(), x);
    });
    for (int r = 0; r < W; ++r)
      BOOST_TEST(diff_of(got[std::size_t(r)], want).differ == 0u, "MoE of layer " << l << ", rank " << r);
  }

  {
    const auto& w = host.engrams[0];
    std::vector<std::int64_t> hashes(std::size_t(rows) * w.columns);
    for (auto& h : hashes) h = std::int64_t(rng() % std::uint64_t(w.rows));
    std::vector<numerics::bf16> streams(std::size_t(rows) * 4 * c.dim);
    for (auto& v : streams) v = numerics::bf16::from_float(normal(rng));
    auto want = streams;
    for (int t = 0; t < rows; ++t)
      engram::engram_forward_reference(
          w, std::span<numerics::bf16>(want).subspan(std::size_t(t) * 4 * c.dim, std::size_t(4) * c.dim),
          std::span<const std::int64_t>(hashes).subspan(std::size_t(t) * w.columns, std::size_t(w.columns)),
          false);
    std::vector<std::vector<numerics::bf16>> got(W, streams);
    parallel::run_ranks(W, [&](const parallel::detail::rank_context& ctx) {
      parallel::detail::engram_rank(ctx, tp.ranks[std::size_t(ctx.rank)].engrams[0],
                                    got[std::size_t(ctx.rank)], hashes, rows);
    });
    for (int r = 0; r < W; ++r)
      BOOST_TEST(diff_of(got[std::size_t(r)], want).differ == 0u, "Engram, rank " << r);
  }

  for (int l : {0, 2}) {  // a window layer; the first KV owner and index source (ratio 2)
    kernels::attention::sequence_state hs;
    const auto want = kernels::attention::attention_layer_reference(
        l, host.wiring[std::size_t(l)], host.blocks[std::size_t(l)].attn, model::attention_shape<tiny>(),
        host.freqs[std::size_t(l)], x, 0, hs);
    std::vector<std::vector<numerics::bf16>> got(W);
    std::vector<kernels::attention::sequence_state> states(W);
    parallel::run_ranks(W, [&](const parallel::detail::rank_context& ctx) {
      const auto& m = tp.ranks[std::size_t(ctx.rank)];
      got[std::size_t(ctx.rank)] =
          parallel::detail::attention_rank(ctx, l, m.wiring[std::size_t(l)], m.blocks[std::size_t(l)].attn,
                                           parallel::rank_attention_shape<tiny>(W), m.freqs[std::size_t(l)],
                                           x, 0, states[std::size_t(ctx.rank)]);
    });
    BOOST_TEST(diff_of(got[1], got[0]).differ == 0u);
    const auto d = diff_of(got[0], want);
    BOOST_TEST_MESSAGE("attention of layer " << l << " at W=2: " << d.differ << " of " << d.count
                                             << " values differ, at most " << d.max_rel_row
                                             << " of the row's peak");
    // Rows whose top-k lists agree (every row of the window layer) differ by wo_b's rounding:
    // measured at most 2^-7 of the row's peak (one bf16 ulp there); a changed list (the ranks'
    // bf16 partial scores summed can break a near-tie the other way) may move a row further.
    const int width = hs.topk_width;
    int same_lists = 0;
    for (int i = 0; i < rows; ++i) {
      const bool same = l == 0 || std::equal(hs.topk.begin() + i * width, hs.topk.begin() + (i + 1) * width,
                                             states[0].topk.begin() + i * width);
      same_lists += same;
      if (!same) continue;
      const std::vector<numerics::bf16> a(got[0].begin() + i * c.dim, got[0].begin() + (i + 1) * c.dim),
          b(want.begin() + i * c.dim, want.begin() + (i + 1) * c.dim);
      BOOST_TEST(diff_of(a, b).max_rel_row <= 0x1p-6, "layer " << l << ", row " << i);
    }
    BOOST_TEST_MESSAGE("  rows with the same top-k lists: " << same_lists << " of " << rows);
    BOOST_TEST(same_lists >= rows * 3 / 4);
  }
}

BOOST_AUTO_TEST_CASE(each_rank_holds_only_its_shard) {
  const auto schema = models::checkpoint_schema<tiny>();
  io::checkpoint full = io::random_checkpoint_in_memory(schema, 73, io::random_init::scaled);
  constexpr models::model_config c = tiny::dims;
  constexpr int W = 2;
  const std::size_t full_bytes = checkpoint_bytes(full, schema);
  std::size_t replicated = 0, padding = 0;
  for (const auto& t : schema) {
    if (!full.contains(t.name)) continue;
    const auto s = parallel::shard_of(t, full.tensor(t.name).shape, W, 0, c);
    if (s.kind == parallel::shard_kind::replicated) replicated += full.tensor(t.name).bytes.size();
  }
  std::size_t sum = 0;
  for (int r = 0; r < W; ++r) {
    io::checkpoint shard = parallel::shard_checkpoint(full, schema, W, r, c);
    // Every tensor the rank holds has the plan's local shape; split tensors are smaller.
    for (const auto& t : schema) {
      if (!shard.contains(t.name)) continue;
      const auto s = parallel::shard_of(t, full.tensor(t.name).shape, W, r, c);
      BOOST_TEST((shard.tensor(t.name).shape == s.shape), t.name);
      if (s.kind == parallel::shard_kind::rows_padded)
        padding += std::size_t(s.pad_rows) * (shard.tensor(t.name).bytes.size() / std::size_t(s.shape[0]));
    }
    const std::size_t bytes = checkpoint_bytes(shard, schema);
    BOOST_TEST_MESSAGE("rank " << r << " of " << W << ": " << bytes << " bytes of " << full_bytes);
    BOOST_TEST(bytes < full_bytes);
    sum += bytes;
    const auto m = parallel::rank_model<tiny>::load(shard, test::tiny_identity_map(), W, r);
    BOOST_TEST(m.embed.size() == std::size_t(c.vocab_size / W) * c.dim);
    BOOST_TEST(m.head.size() == std::size_t(c.vocab_size / W) * c.dim);
    for (const auto& b : m.blocks) {
      BOOST_TEST(b.experts.size() == std::size_t(c.moe.n_routed_experts / W));
      BOOST_TEST(b.gate.experts == c.moe.n_routed_experts);  // the gate routes over all experts
      BOOST_TEST(b.attn.wq_b.codes.size() ==
                 std::size_t(c.attn.n_heads / W) * c.attn.head_dim * c.attn.q_lora_rank);
      BOOST_TEST(b.attn.attn_sink.size() == std::size_t(c.attn.n_heads / W));
      BOOST_TEST(b.attn.wo_b.codes.size() == std::size_t(c.dim) * (c.attn.o_groups / W) * c.attn.o_lora_rank);
    }
    for (std::size_t j = 0; j < m.engrams.size(); ++j)
      BOOST_TEST(m.engrams[j].rows == (tiny::engram_num_embeddings[j] + W - 1) / W);
  }
  // The shards add up to the checkpoint, plus W - 1 more copies of what is replicated, plus padding.
  BOOST_TEST(sum == full_bytes + (W - 1) * replicated + padding);
  // A full (unsplit) checkpoint is not a rank's shard: loading it as rank 0 of 2 names a tensor.
  BOOST_TEST(test::throws_with([&] { parallel::rank_model<tiny>::load(full, test::tiny_identity_map(), W, 0); },
                               "embed.weight"));
}

BOOST_AUTO_TEST_CASE(a_world_size_that_does_not_divide_is_rejected) {
  io::checkpoint full =
      io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 74, io::random_init::scaled);
  const auto map = test::tiny_identity_map();
  static_assert(!parallel::world_size_fits<tiny>(3) && !parallel::world_size_fits<tiny>(4));
  BOOST_TEST(test::throws_with([&] { parallel::tp_model<tiny>::load(full, map, 3); }, "vocab_size"));
  BOOST_TEST(test::throws_with([&] { parallel::tp_model<tiny>::load(full, map, 3); }, "n_heads"));
  BOOST_TEST(test::throws_with([&] { parallel::tp_model<tiny>::load(full, map, 4); }, "o_groups"));
  BOOST_TEST(test::throws_with([&] { parallel::tp_model<tiny>::load(full, map, 0); }, "world size 0"));
  BOOST_TEST(test::throws_with([&] { parallel::rank_model<tiny>::load(full, map, 2, 2); }, "rank 2"));
  // A rank that fails makes the others fail at their next collective instead of waiting.
  const auto tp = parallel::tp_model<tiny>::load(full, map, 2);
  parallel::tp_sequence seq;
  const std::int32_t bad[1] = {tiny::dims.vocab_size};
  BOOST_TEST(test::throws_with([&] { parallel::forward(tp, seq, bad); }, "outside the vocabulary"));
}

// Measurement (DSV4_TP_MEASURE=N, DSV4_TP_MEASURE_W=2 or 4): N seeds, W ranks against the host
// model (tiny at W = 2, tiny_w4 at W = 4), a prompt of 40 and 4 decode steps each.
BOOST_AUTO_TEST_CASE(measure_agreement) {
  const char* env = std::getenv("DSV4_TP_MEASURE");
  const int seeds = env ? std::atoi(env) : 0;
  if (seeds <= 0) return;
  const char* wenv = std::getenv("DSV4_TP_MEASURE_W");
  const int world = wenv ? std::atoi(wenv) : 2;
  double worst_cos = 1, worst_rel = 0, sum_cos = 0;
  int calls = 0, same = 0, exact = 0;
  for (int k = 0; k < seeds; ++k) {
    const auto r = [&] {
      if (world == 4) {
        io::checkpoint full = io::random_checkpoint_in_memory(
            models::checkpoint_schema<tiny_w4>(), 100 + std::uint64_t(k), io::random_init::scaled);
        return run_both<tiny_w4>(full, 4, 200 + std::uint64_t(k));
      }
      io::checkpoint full = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(),
                                                            100 + std::uint64_t(k), io::random_init::scaled);
      return run_both(full, world, 200 + std::uint64_t(k));
    }();
    for (std::size_t i = 0; i < r.host.size(); ++i) {
      const auto a = compare(r.tp[i], r.host[i]);
      worst_cos = std::min(worst_cos, a.cosine), sum_cos += a.cosine;
      worst_rel = std::max(worst_rel, a.max_abs / a.max_logit);
      same += a.same_argmax, exact += bits_differ(r.tp[i], r.host[i]) == 0, ++calls;
      BOOST_TEST_MESSAGE("seed " << k << " call " << i << ": cosine " << a.cosine << ", max|diff|/max|logit| "
                                 << a.max_abs / a.max_logit << (a.same_argmax ? "" : ", OTHER greedy token"));
    }
  }
  BOOST_TEST_MESSAGE("W=" << world << " over " << seeds << " seeds, " << calls << " calls: worst cosine "
                          << worst_cos << ", mean " << sum_cos / calls << ", worst max|diff|/max|logit| "
                          << worst_rel << ", same greedy token " << same << "/" << calls << ", bit-equal "
                          << exact << "/" << calls);
}

BOOST_AUTO_TEST_SUITE_END()
