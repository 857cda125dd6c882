// The DSpark drafter on the host (spec §13-14) with tiny's random checkpoint: the stages' weights
// follow the config (expert counts, RoPE of a ratio-0 layer, shapes); main_hidden is the residual
// entering the target layers, and a decode step's row equals the prefill's row of its position;
// the prefill only seeds the rings, with FP8QDQ(RoPE(kv_norm(wkv(main_x)))) at slot = position
// mod window; after decode steps the rings hold exactly what a prefill over the same rows leaves
// (rejected drafts leave no state); drafts have the configured shapes and are deterministic; an
// appended chunk equals row-by-row steps.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <vector>

#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/checkpoints.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

using namespace dsv4;
using tiny = models::tiny;
using numerics::bf16;

namespace {
constexpr models::model_config c = tiny::dims;
constexpr int W = c.attn.window_size, D = c.dim;
using sched = models::model_traits<tiny>::schedule;
constexpr int T = sched::drafter::targets::size;

std::vector<std::int64_t> identity_map() {
  std::vector<std::int64_t> m(std::size_t(c.vocab_size));
  std::iota(m.begin(), m.end(), 0);
  return m;
}

std::vector<std::int32_t> random_ids(int n, std::uint64_t seed) {
  auto rng = test::make_rng(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(c.vocab_size));
  return ids;
}

bool same_bits(std::span<const bf16> a, std::span<const bf16> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}
bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One checkpoint for the suite (writing and loading it is most of a case's time).
struct fixture {
  test::temp_checkpoint tmp{"dspark", models::checkpoint_schema<tiny>(), 61};
  io::checkpoint ck{tmp.dir};
  model::host_model<tiny> m = model::host_model<tiny>::load(ck, identity_map());
  model::dspark_weights w = model::dspark_weights_of<tiny>(ck);
};
fixture& shared() {
  static fixture f;
  return f;
}

// The backbone's prefill of `prompt`, then decode steps of `steps` greedy tokens, with a DSpark
// step after every call; returns the drafts and the captured main_hidden rows of every position.
struct run_result {
  std::vector<model::dspark_draft> drafts;
  std::vector<bf16> hidden;  // [positions, T * D]
  model::dspark_state state;
};
run_result run(const std::vector<std::int32_t>& prompt, int steps, const kernels::sampling::sampling_params& sp) {
  auto& f = shared();
  run_result r;
  model::host_sequence seq;
  std::vector<bf16> mh;
  auto logits = model::forward(f.m, seq, prompt, nullptr, &mh);
  r.hidden = mh;
  BOOST_REQUIRE(!model::forward_spec(f.m, f.w, r.state, 0, mh, 0).has_value());  // prefill: no drafts
  for (int i = 0; i < steps; ++i) {
    const std::int32_t next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const long long p = seq.length;
    logits = model::forward(f.m, seq, std::span<const std::int32_t>(&next, 1), nullptr, &mh);
    r.hidden.insert(r.hidden.end(), mh.begin(), mh.end());
    // The token after p: the backbone's greedy choice from this step's logits.
    const std::int32_t after = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    auto d = model::forward_spec(f.m, f.w, r.state, after, mh, p, sp, 7);
    BOOST_REQUIRE(d.has_value());
    r.drafts.push_back(std::move(*d));
  }
  return r;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(dspark)

BOOST_AUTO_TEST_CASE(stage_weights_follow_the_config) {
  auto& f = shared();
  BOOST_TEST(f.w.stages.size() == std::size_t(sched::drafter::stages));
  for (const auto& s : f.w.stages) {
    BOOST_TEST(s.gate.experts == c.dspark.dspark_n_routed_experts);  // 4 (V4.1: 128), not the backbone's 8
    BOOST_TEST(s.gate.k == c.dspark.dspark_n_activated_experts);     // 2 (V4.1: 3)
    BOOST_TEST(s.experts.size() == std::size_t(c.dspark.dspark_n_routed_experts));
    BOOST_TEST(s.attn.compressor.wkv.empty());  // SWA only: no compressor, no indexer
    BOOST_TEST(s.attn.idx_wq_b.codes.empty());
  }
  BOOST_TEST(f.w.main_proj.n == D);
  BOOST_TEST(f.w.main_proj.k == T * D);
  BOOST_TEST(f.w.markov_embed.size() == std::size_t(c.vocab_size) * std::size_t(c.dspark.dspark_markov_rank));
  BOOST_TEST(f.w.confidence.size() == std::size_t(D + c.dspark.dspark_markov_rank));
  // RoPE theta 10000 with no YaRN: the frequencies of a backbone ratio-0 layer (layer 0).
  static_assert(sched::ratio(0) == 0);
  BOOST_TEST(same_bits(f.w.freqs, model::attention_rope_frequencies<tiny>(0)));
  BOOST_TEST(!same_bits(f.w.freqs, model::attention_rope_frequencies<tiny>(2)));

  // A checkpoint without a DSpark tensor: the error names it.
  auto schema = models::checkpoint_schema<tiny>();
  std::erase_if(schema, [](const io::tensor_spec& t) { return t.name == "mtp.2.confidence_head.proj.weight"; });
  const test::temp_checkpoint partial("dspark_partial", schema, 3);
  io::checkpoint pk(partial.dir);
  BOOST_TEST(test::throws_with([&] { model::dspark_weights_of<tiny>(pk); }, "mtp.2.confidence_head.proj.weight"));
}

BOOST_AUTO_TEST_CASE(main_hidden_is_the_residual_entering_the_targets) {
  auto& f = shared();
  const auto ids = random_ids(W + 3, 5);
  model::host_sequence seq;
  std::vector<bf16> mh;
  model::forward(f.m, seq, ids, nullptr, &mh);
  BOOST_REQUIRE(mh.size() == ids.size() * std::size_t(T * D));

  // The same residuals from the blocks run by hand, layer by layer.
  model::host_sequence manual;
  auto st = model::detail::start_forward(f.m, manual, ids);
  constexpr auto shape = model::attention_shape<tiny>();
  std::size_t mismatched = 0;
  for (int l = 0; l < sched::num_layers; ++l) {
    model::detail::engram_before(f.m, l, st.x, st, 0);
    for (int j = 0; j < T; ++j)
      if (sched::drafter::targets::values[std::size_t(j)] == l)
        for (std::size_t t = 0; t < ids.size(); ++t)
          for (int d = 0; d < D; ++d) {
            float sum = 0;
            for (int r = 0; r < 4; ++r) sum += st.x[(t * 4 + std::size_t(r)) * D + std::size_t(d)].to_float();
            const bf16 want = bf16::from_float(sum / 4.0f);
            mismatched += want.bits != mh[t * std::size_t(T * D) + std::size_t(j * D + d)].bits;
          }
    st.x = model::block_forward_chunk(l, f.m.wiring[std::size_t(l)], f.m.blocks[std::size_t(l)], shape, f.m.freqs[std::size_t(l)],
                                      st.x, st.pre, 0, manual.attention);
  }
  BOOST_TEST(mismatched == 0u);

  // A decode step's main_hidden is the prefill's row of that position (past the window).
  model::host_sequence inc;
  std::vector<bf16> step;
  model::forward(f.m, inc, std::span<const std::int32_t>(ids).first(ids.size() - 1));
  model::forward(f.m, inc, std::span<const std::int32_t>(ids).last(1), nullptr, &step);
  BOOST_TEST(same_bits(step, std::span<const bf16>(mh).last(std::size_t(T * D))));

  // CED: the replayed rows only; equal to the exact capture while the prompt fits the window.
  model::host_sequence ced, ced_short, exact_short;
  std::vector<bf16> mc, mcs, mes;
  model::forward_ced(f.m, ced, ids, nullptr, &mc);
  BOOST_TEST(mc.size() == std::size_t(W * T * D));
  const auto short_ids = std::span<const std::int32_t>(ids).first(W - 2);
  model::forward_ced(f.m, ced_short, short_ids, nullptr, &mcs);
  model::forward(f.m, exact_short, short_ids, nullptr, &mes);
  BOOST_TEST(same_bits(mcs, mes));
}

BOOST_AUTO_TEST_CASE(prefill_seeds_only_the_rings) {
  auto& f = shared();
  constexpr auto sh = model::attention_shape<tiny>();
  for (int s : {W - 5, W + 7}) {
    const auto ids = random_ids(s, 11 + std::uint64_t(s));
    model::host_sequence seq;
    std::vector<bf16> mh;
    model::forward(f.m, seq, ids, nullptr, &mh);
    model::dspark_state st;
    BOOST_TEST(!model::forward_spec(f.m, f.w, st, 0, mh, 0).has_value());
    BOOST_TEST(st.length == s);
    BOOST_REQUIRE(st.rings.size() == f.w.stages.size());
    std::size_t wrong = 0, unwritten_nonzero = 0;
    for (std::size_t k = 0; k < f.w.stages.size(); ++k) {
      const auto& a = f.w.stages[k].attn;
      for (int slot = 0; slot < W; ++slot) {
        const auto got = std::span<const bf16>(st.rings[k]).subspan(std::size_t(slot) * sh.head_dim, std::size_t(sh.head_dim));
        // The position this slot holds: the last p < s with p mod W == slot.
        const int p = s - 1 - ((s - 1 - slot) % W + W) % W;
        if (p < 0) {
          for (bf16 v : got) unwritten_nonzero += v.bits != 0;
          continue;
        }
        // main_x = main_norm(main_proj(main_hidden[p])); kv = FP8QDQ(RoPE_p(kv_norm(wkv(main_x)))).
        const auto row = std::span<const bf16>(mh).subspan(std::size_t(p) * T * D, std::size_t(T * D));
        const auto main_x = kernels::norm::rmsnorm_bf16_reference(f.w.main_proj(row), f.w.main_norm, c.norm_eps);
        auto kv = kernels::norm::rmsnorm_bf16_reference(a.wkv(main_x), a.kv_norm, c.norm_eps);
        const std::int64_t pos[1] = {p};
        kernels::rope::apply_rope_reference(kv, sh.head_dim, 1, pos, f.w.freqs, false);
        numerics::qdq_vector<numerics::fp8_act_format>(kv);
        wrong += !same_bits(got, kv);
      }
    }
    BOOST_TEST(wrong == 0u);
    BOOST_TEST(unwritten_nonzero == 0u);
    // Each stage has its own wkv, hence its own ring.
    BOOST_TEST(!same_bits(st.rings[0], st.rings[1]));
  }
}

// Labelled long: the sanitizer build skips it (53 s there; the other drafting cases run under it).
BOOST_AUTO_TEST_CASE(drafts_after_decode_steps, *boost::unit_test::label("long")) {
  auto& f = shared();
  const auto prompt = random_ids(W + 2, 23);
  const int steps = 2;
  const kernels::sampling::sampling_params greedy{0.0f};
  const auto a = run(prompt, steps, greedy);
  const auto b = run(prompt, steps, greedy);
  const int block = c.dspark.dspark_block_size;
  BOOST_REQUIRE(a.drafts.size() == std::size_t(steps));
  for (int i = 0; i < steps; ++i) {
    const auto& d = a.drafts[std::size_t(i)];
    BOOST_TEST(d.ids.size() == std::size_t(block + 1));
    BOOST_TEST(d.logits.size() == std::size_t(block) * std::size_t(c.vocab_size));
    BOOST_TEST(d.confidence.size() == std::size_t(block));
    std::size_t nonfinite = 0, not_argmax = 0;
    for (float v : d.logits) nonfinite += !std::isfinite(v);
    for (float v : d.confidence) nonfinite += !std::isfinite(v);
    for (int j = 0; j < block; ++j) {
      const auto row = std::span<const float>(d.logits).subspan(std::size_t(j) * c.vocab_size, std::size_t(c.vocab_size));
      not_argmax += d.ids[std::size_t(j + 1)] != std::int32_t(std::max_element(row.begin(), row.end()) - row.begin());
    }
    BOOST_TEST(nonfinite == 0u);
    BOOST_TEST(not_argmax == 0u);  // temperature 0: each draft is its row's argmax (Markov bias included)
    // Deterministic: a second run gives the same bits.
    const auto& e = b.drafts[std::size_t(i)];
    BOOST_TEST(d.ids == e.ids);
    BOOST_TEST(same_bits(d.logits, e.logits));
    BOOST_TEST(same_bits(d.confidence, e.confidence));
  }
  // Rows differ: the Markov bias and the draft positions make each row its own distribution.
  BOOST_TEST(!same_bits(std::span<const float>(a.drafts[0].logits).first(std::size_t(c.vocab_size)),
                        std::span<const float>(a.drafts[0].logits).subspan(std::size_t(c.vocab_size), std::size_t(c.vocab_size))));

  // After the steps the rings hold what a prefill over every position's main_hidden leaves:
  // only the backbone's main_kv, never a draft's.
  model::dspark_state fresh;
  model::dspark_prefill<tiny>(f.w, fresh, a.hidden);
  BOOST_TEST(fresh.length == a.state.length);
  for (std::size_t k = 0; k < fresh.rings.size(); ++k) BOOST_TEST(same_bits(fresh.rings[k], a.state.rings[k]));

  // Sampling at temperature 1: deterministic for a seed (counter-based noise).
  const kernels::sampling::sampling_params t1{1.0f, 0, 1.0f, 99};
  const auto s1 = run(prompt, 1, t1), s2 = run(prompt, 1, t1);
  BOOST_TEST(s1.drafts[0].ids == s2.drafts[0].ids);
  // Row 0's logits do not depend on the sampler; row i > 0 carries the Markov bias of draft i, so
  // it moves with the draws.
  BOOST_TEST(same_bits(std::span<const float>(s1.drafts[0].logits).first(std::size_t(c.vocab_size)),
                       std::span<const float>(a.drafts[0].logits).first(std::size_t(c.vocab_size))));
}

BOOST_AUTO_TEST_CASE(appended_chunk_equals_steps_and_errors) {
  auto& f = shared();
  const auto prompt = random_ids(W + 1, 31);
  const auto r = run(prompt, 2, {0.0f});
  const std::size_t row = std::size_t(T * D), n = prompt.size();
  // Prefill, then the two decode rows as one chunk: same rings, same last draft.
  model::dspark_state st;
  model::dspark_prefill<tiny>(f.w, st, std::span<const bf16>(r.hidden).first(n * row));
  const auto d = model::dspark_decode<tiny>(f.m, f.w, st, r.drafts[1].ids[0], std::span<const bf16>(r.hidden).subspan(n * row, 2 * row));
  BOOST_TEST(d.ids == r.drafts[1].ids);
  BOOST_TEST(same_bits(d.logits, r.drafts[1].logits));
  BOOST_TEST(same_bits(d.confidence, r.drafts[1].confidence));
  for (std::size_t k = 0; k < st.rings.size(); ++k) BOOST_TEST(same_bits(st.rings[k], r.state.rings[k]));

  // Forced drafts (teacher forcing for parity runs): the drawn ids given back change nothing.
  model::dspark_state forced_state;
  model::dspark_prefill<tiny>(f.w, forced_state, std::span<const bf16>(r.hidden).first(n * row));
  const auto forced = model::dspark_decode<tiny>(f.m, f.w, forced_state, r.drafts[1].ids[0],
                                                 std::span<const bf16>(r.hidden).subspan(n * row, 2 * row), {0.0f}, 0, d.ids);
  BOOST_TEST(same_bits(forced.logits, d.logits));
  BOOST_TEST(test::throws_with([&] { model::dspark_decode<tiny>(f.m, f.w, st, (d.ids[0] + 1) % c.vocab_size, std::span<const bf16>(r.hidden).first(row), {0.0f}, 0, d.ids); },
                               "forced ids must start"));

  model::dspark_state none;
  const auto one = std::span<const bf16>(r.hidden).first(row);
  BOOST_TEST(test::throws_with([&] { model::dspark_decode<tiny>(f.m, f.w, none, 1, one); }, "no DSpark prefill"));
  BOOST_TEST(test::throws_with([&] { model::forward_spec(f.m, f.w, st, 1, one, st.length + 1); }, "start position"));
  BOOST_TEST(test::throws_with([&] { model::forward_spec(f.m, f.w, st, c.vocab_size, one, st.length); }, "outside the vocabulary"));
  BOOST_TEST(test::throws_with([&] { model::dspark_prefill<tiny>(f.w, st, one.first(row - 1)); }, "main_hidden must be"));
}

// The rings are the drafter's only state, and a slot reaches the drafts exactly until a decode step
// overwrites it: one value of one slot moved by an FP8 code step leaves every draft from that
// step on bit-identical. How far the drafts move before that is reported: on tiny's random
// weights one code of one ring value moved the draft logits by 5-20% of a row's largest logit and
// the confidences by up to 60% (docs/decisions.md, "DSpark device test"), which is why
// test_dspark_cuda gives the host drafter the device's rings after every call.
BOOST_AUTO_TEST_CASE(a_ring_slot_reaches_the_drafts_until_it_is_overwritten,
                     *boost::unit_test::label("long")) {
  auto& f = shared();
  const auto prompt = random_ids(W + 8, 41);  // prefill: positions 8 .. W + 7, every slot written
  const int steps = 6;
  model::host_sequence seq;
  std::vector<bf16> mh;
  auto logits = model::forward(f.m, seq, prompt, nullptr, &mh);
  model::dspark_state start;
  model::dspark_prefill<tiny>(f.w, start, mh);
  std::vector<std::vector<bf16>> rows;  // each step's main_hidden row
  std::vector<std::int32_t> inputs;
  for (int i = 0; i < steps; ++i) {
    const std::int32_t next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits = model::forward(f.m, seq, std::span<const std::int32_t>(&next, 1), nullptr, &mh);
    rows.push_back(mh);
    inputs.push_back(std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  }
  auto drafts = [&](model::dspark_state st, const std::vector<model::dspark_draft>* forced) {
    std::vector<model::dspark_draft> out;
    for (int i = 0; i < steps; ++i)
      out.push_back(
          model::dspark_decode<tiny>(f.m, f.w, st, inputs[std::size_t(i)], rows[std::size_t(i)], {0.0f}, 0,
                                     forced ? std::span<const std::int32_t>((*forced)[std::size_t(i)].ids)
                                            : std::span<const std::int32_t>{}));
    return out;
  };
  const auto base = drafts(start, nullptr);
  const int hd = c.attn.head_dim, stages = int(start.rings.size());
  const long long first = (long long)prompt.size();  // step i writes position first + i
  auto rng = test::make_rng(43);
  int moved = 0;
  double largest = 0;
  for (int slot = 0; slot < W; ++slot) {
    model::dspark_state st = start;
    auto& ring = st.rings[std::size_t(slot % stages)];
    std::size_t at = std::size_t(slot) * std::size_t(hd) + std::size_t(rng() % std::uint64_t(hd));
    while (ring[at].to_float() == 0.0f) at = std::size_t(slot) * std::size_t(hd) + (at + 1) % std::size_t(hd);
    const float v = ring[at].to_float();
    ring[at] =
        bf16::from_float(v + std::exp2(std::floor(std::log2(std::fabs(v))) - 3.0f));  // one E4M3 code up
    const auto got = drafts(st, &base);
    int overwritten = steps;  // the step that writes this slot's next position
    for (int i = 0; i < steps; ++i)
      if ((first + i) % W == slot) overwritten = std::min(overwritten, i);
    bool any = false;
    for (int i = 0; i < steps; ++i) {
      const auto& g = got[std::size_t(i)];
      const auto& b = base[std::size_t(i)];
      const bool same = same_bits(g.logits, b.logits) && same_bits(g.confidence, b.confidence);
      if (i >= overwritten)
        BOOST_TEST(same,
                   "slot " << slot << " overwritten at step " << overwritten << " still moves step " << i);
      if (i < overwritten && !same) {
        any = true;
        for (std::size_t r = 0; r < g.logits.size() / std::size_t(c.vocab_size); ++r) {
          float d = 0, peak = 0;
          for (int k = 0; k < c.vocab_size; ++k) {
            const std::size_t j = r * std::size_t(c.vocab_size) + std::size_t(k);
            d = std::max(d, std::fabs(g.logits[j] - b.logits[j])),
            peak = std::max(peak, std::fabs(b.logits[j]));
          }
          largest = std::max(largest, double(d / peak));
        }
      }
    }
    moved += any;
  }
  BOOST_TEST_MESSAGE("one FP8 code step in one ring slot: "
                     << moved << " of " << W << " slots moved the drafts before their overwrite, by up to "
                     << largest << " of a row's largest logit");
  BOOST_TEST(moved > 0);  // the rings are read at all
}

BOOST_AUTO_TEST_SUITE_END()
