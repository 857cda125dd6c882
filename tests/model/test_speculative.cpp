// Generation with DSpark drafts on the host (model/speculative_reference.hpp) on tiny's random
// model: the tokens equal plain decoding's (greedy and seeded sampling, exact and CED prefill,
// prompts of one token, below and above the window); the acceptance counts follow the drafts (an
// oracle drafter that proposes plain decoding's tokens is accepted in full, one that errs at a
// fixed draft index stops there every round); misuse is an error.

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <numeric>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/speculative_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/errors.hpp"
#include "support/resume_plans.hpp"

using namespace dsv4;
using tiny = models::tiny;
using dsv4::test::throws_with;

namespace {

constexpr models::model_config c = tiny::dims;

struct fixture {
  io::checkpoint ck = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 19, io::random_init::scaled);
  model::host_model<tiny> m = model::host_model<tiny>::load(ck, [] {
    std::vector<std::int64_t> map(std::size_t(c.vocab_size));
    std::iota(map.begin(), map.end(), 0);
    return map;
  }());
  model::dspark_weights w = model::dspark_weights_of<tiny>(ck);
};
fixture& shared() {
  static fixture f;
  return f;
}

std::vector<std::int32_t> prompt_of(int n) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[std::size_t(i)] = std::int32_t((i * 37 + 11) % c.vocab_size);
  return p;
}

// Plain decoding, as `dsv4 run` does it: the token at position q drawn with counter q.
std::vector<std::int32_t> plain(const std::vector<std::int32_t>& prompt, long long n, const kernels::sampling::sampling_params& sp,
                                model::prompt_prefill mode) {
  auto& f = shared();
  model::host_sequence seq;
  auto logits = mode == model::prompt_prefill::ced ? model::forward_ced(f.m, seq, prompt) : model::forward(f.m, seq, prompt);
  std::vector<std::int32_t> out;
  for (long long i = 0; i < n; ++i) {
    const std::int32_t next = kernels::sampling::sample_reference(logits, sp, 3, std::uint64_t(seq.length));
    out.push_back(next);
    if (i + 1 < n) logits = model::forward(f.m, seq, std::span<const std::int32_t>(&next, 1));
  }
  return out;
}

std::vector<std::int32_t> drafted_run(const std::vector<std::int32_t>& prompt, long long n, const kernels::sampling::sampling_params& sp,
                                      model::prompt_prefill mode, model::speculative_stats& stats,
                                      const std::function<void(long long, std::vector<std::int32_t>&)>& edit = {}) {
  auto& f = shared();
  model::host_sequence seq;
  return model::generate_speculative(f.m, f.w, seq, prompt, n, sp, stats, mode, 3, edit);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(speculative_generation)

// "long": 37 s here, 70 s under the sanitizers, where the CI skips it (the oracle cases run the
// same loop under ASan / UBSan).
BOOST_AUTO_TEST_CASE(tokens_equal_plain_decoding, *boost::unit_test::label("long")) {
  const int window = c.attn.window_size;
  struct run_case {
    int prompt;
    long long n;
    float temperature;
    model::prompt_prefill mode;
  };
  for (const run_case& rc : {run_case{9, 14, 0.0f, model::prompt_prefill::exact}, run_case{9, 14, 0.9f, model::prompt_prefill::exact},
                             run_case{1, 6, 0.0f, model::prompt_prefill::exact}, run_case{window + 7, 8, 0.7f, model::prompt_prefill::ced},
                             run_case{5, 1, 0.0f, model::prompt_prefill::exact}}) {
    kernels::sampling::sampling_params sp{rc.temperature, rc.temperature > 0 ? 40 : 0, 1.0f, 5};
    model::speculative_stats stats;
    const auto p = prompt_of(rc.prompt);
    const auto want = plain(p, rc.n, sp, rc.mode);
    const auto got = drafted_run(p, rc.n, sp, rc.mode, stats);
    BOOST_TEST(got == want, "prompt " << rc.prompt << ", " << rc.n << " tokens, T " << rc.temperature);
    BOOST_TEST(stats.accepted <= stats.drafted);
    BOOST_TEST(stats.accepted == std::accumulate(stats.accepted_at.begin(), stats.accepted_at.end(), 0LL));
    if (rc.n > 2) BOOST_TEST(stats.rounds > 0);
    BOOST_TEST_MESSAGE("random drafter, prompt " << rc.prompt << ": " << stats.rounds << " rounds, " << stats.accepted << " of "
                                                  << stats.drafted << " drafts accepted");
  }
}

BOOST_AUTO_TEST_CASE(oracle_drafts_are_accepted_in_full) {
  const int block = shared().w.block;
  const auto p = prompt_of(7);
  const long long rounds = 3, n = 1 + rounds * (block + 1);  // the prefill's token, then full rounds
  const kernels::sampling::sampling_params sp{0.0f};
  const auto want = plain(p, n, sp, model::prompt_prefill::exact);
  model::speculative_stats stats;
  // The drafts for positions q+1 .. q+block are plain decoding's tokens there.
  const auto oracle = [&](long long first, std::vector<std::int32_t>& ids) {
    for (int i = 1; i <= block; ++i) {
      const long long k = first + i - 1 - (long long)p.size();
      if (k < (long long)want.size()) ids[std::size_t(i)] = want[std::size_t(k)];
    }
  };
  BOOST_TEST(drafted_run(p, n, sp, model::prompt_prefill::exact, stats, oracle) == want);
  BOOST_TEST(stats.rounds == rounds);
  BOOST_TEST(stats.accepted == rounds * block);
  BOOST_TEST(stats.drafted == rounds * block);
  BOOST_TEST(stats.accepted_per_round() == double(block));
  // An oracle that errs at draft 3: two accepted, the third checked and rejected, every round.
  const auto third_wrong = [&](long long first, std::vector<std::int32_t>& ids) {
    oracle(first, ids);
    ids[3] = (ids[3] + 1) % c.vocab_size;
  };
  const long long n2 = 1 + rounds * 3;  // each round adds three: two drafts, then the differing draw
  model::speculative_stats s2;
  BOOST_TEST(drafted_run(p, n2, sp, model::prompt_prefill::exact, s2, third_wrong) == plain(p, n2, sp, model::prompt_prefill::exact));
  BOOST_TEST(s2.rounds == rounds);
  BOOST_TEST(s2.accepted == 2 * rounds);
  BOOST_TEST(s2.drafted == 3 * rounds);
  BOOST_TEST(s2.accepted_at[0] == rounds);
  BOOST_TEST(s2.accepted_at[1] == rounds);
  BOOST_TEST(s2.accepted_at[2] == 0);
}

BOOST_AUTO_TEST_CASE(misuse_is_an_error) {
  auto& f = shared();
  model::speculative_stats stats;
  const auto p = prompt_of(4);
  model::host_sequence used;
  model::forward(f.m, used, p);
  BOOST_TEST(throws_with([&] { model::generate_speculative(f.m, f.w, used, p, 3, {0.0f}, stats); }, "the sequence must be fresh"));
  model::host_sequence fresh;
  BOOST_TEST(throws_with([&] { model::generate_speculative(f.m, f.w, fresh, std::span<const std::int32_t>{}, 3, {0.0f}, stats); },
                         "empty prompt"));
  BOOST_TEST(throws_with(
      [&] {
        model::generate_speculative(f.m, f.w, fresh, p, 5, {0.0f}, stats, model::prompt_prefill::exact, 0,
                                    [](long long, std::vector<std::int32_t>& ids) { ids.pop_back(); });
      },
      "block + 1 ids"));
}

// The loop a round at a time (speculative_decoder: what a server's engine steps): rounds with
// budgets 1, 2, 3, 1, 2, 3, ... give plain decoding's tokens, each round 1 .. min(budget, block + 1)
// of them; a one-token prompt's first round is a plain step (one token, no round counted); the
// counts add up; misuse is an error.
BOOST_AUTO_TEST_CASE(rounds_one_at_a_time_with_budgets) {
  auto& f = shared();
  const kernels::sampling::sampling_params sp{0.8f, 30, 1.0f, 7};
  for (const int prompt_len : {1, 6}) {
    const auto p = prompt_of(prompt_len);
    const long long n = 17;
    const auto want = plain(p, n, sp, model::prompt_prefill::exact);
    model::host_sequence seq;
    model::speculative_decoder<tiny> d(f.m, f.w, seq, sp, 3);
    std::vector<std::int32_t> got{d.start(p)};
    long long r = 0;
    while ((long long)got.size() < n) {
      const long long budget = std::min(1 + r % 3, n - (long long)got.size());
      const auto kept = d.round(budget);
      BOOST_TEST((kept.size() >= 1 && (long long)kept.size() <= std::min<long long>(budget, f.w.block + 1)),
                 "round " << r << ": " << kept.size() << " tokens for a budget of " << budget);
      if (prompt_len == 1 && r == 0) {
        BOOST_TEST(kept.size() == 1u);
        BOOST_TEST(d.stats().rounds == 0);  // the plain step
      }
      got.insert(got.end(), kept.begin(), kept.end());
      ++r;
    }
    BOOST_TEST(got == want, "prompt of " << prompt_len);
    const auto& st = d.stats();
    BOOST_TEST(st.rounds == (prompt_len == 1 ? r - 1 : r));
    BOOST_TEST(st.accepted <= st.drafted);
    BOOST_TEST(st.accepted == std::accumulate(st.accepted_at.begin(), st.accepted_at.end(), 0LL));
    // Tokens beyond the prefill's come one per round plus the accepted drafts (a round the budget
    // ends on an accepted draft gives no extra draw).
    BOOST_TEST(n - 1 <= r + st.accepted);
    BOOST_TEST(seq.length == (long long)p.size() + n - 1);  // every token but the last fed
  }
  model::host_sequence seq;
  model::speculative_decoder<tiny> d(f.m, f.w, seq, sp);
  BOOST_TEST(throws_with([&] { d.round(1); }, "round() before start()"));
  d.start(prompt_of(3));
  BOOST_TEST(throws_with([&] { d.round(0); }, "budget must be >= 1, got 0"));
  BOOST_TEST(throws_with([&] { d.start(prompt_of(3)); }, "start() was called already"));
}

// An appended turn (resume) between rounds, exact and CED: the turn's first token, its rounds'
// drafts and tokens, and the drafter's rings after the turn's first round, are a fresh start's on
// the whole conversation in the same mode (the host forward's append is its prefill bit for bit,
// and a CED append its CED prefill: the decoder's owner reads the encoder output in both). Turns
// shorter and longer than the window, two turns with no round between them, and a turn right
// after a one-token prompt's start (no round yet: its first round then drafts). The stats count
// every round since start().
BOOST_AUTO_TEST_CASE(an_appended_turn_leaves_a_fresh_starts_state) {
  auto& f = shared();
  const kernels::sampling::sampling_params sp{0.8f, 30, 1.0f, 7};
  const auto exact = model::prompt_prefill::exact;
  const int W = c.attn.window_size;
  auto same_bits = [](const std::vector<numerics::bf16>& x, const std::vector<numerics::bf16>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(numerics::bf16)) == 0;
  };
  const std::vector<test::resume_plan> plans = test::resume_plans(W);
  int id = 0;
  for (const test::resume_plan& pl : plans) {
    const model::prompt_prefill mode = pl.turns.back().mode;
    const std::string what = "plan " + std::to_string(id++);
    const auto p1 = prompt_of(pl.prompt);
    std::vector<std::vector<std::int32_t>> drafts_a, drafts_b;
    model::host_sequence sa, sb;
    model::speculative_decoder<tiny> a(f.m, f.w, sa, sp, 3, [&](long long, std::vector<std::int32_t>& ids) { drafts_a.push_back(ids); });
    std::vector<std::int32_t> conversation(p1);
    std::vector<std::int32_t> got{a.start(p1)};
    while ((long long)got.size() < pl.before) {
      const auto kept = a.round(pl.before - (long long)got.size());
      got.insert(got.end(), kept.begin(), kept.end());
    }
    const long long rounds_before = a.stats().rounds;
    conversation.insert(conversation.end(), got.begin(), got.end());
    std::int32_t first = got.back();
    for (const test::resume_turn& t : pl.turns) {
      std::vector<std::int32_t> chunk{first};  // (the last token returned, never fed)
      for (int i = 0; i < t.length - 1; ++i) chunk.push_back(std::int32_t((i * 53 + 5 + t.length) % c.vocab_size));
      conversation.insert(conversation.end(), chunk.begin() + 1, chunk.end());
      first = a.resume(chunk, t.mode, sp);
      conversation.push_back(first);  // (drawn, not fed: the next turn's chunk starts with it)
    }
    conversation.pop_back();
    drafts_a.clear();
    model::speculative_decoder<tiny> b(f.m, f.w, sb, sp, 3, [&](long long, std::vector<std::int32_t>& ids) { drafts_b.push_back(ids); });
    BOOST_TEST(first == b.start(conversation, mode), what);
    BOOST_TEST(sa.length == sb.length, what);
    for (int r = 0; r < 3; ++r) {
      BOOST_TEST(a.round(4) == b.round(4), what << ", round " << r);
      if (r == 0) {
        BOOST_TEST(a.drafter_state().length == b.drafter_state().length, what);
        for (std::size_t s = 0; s < b.drafter_state().rings.size(); ++s)
          BOOST_TEST(same_bits(a.drafter_state().rings[s], b.drafter_state().rings[s]), what << ": stage " << s << "'s ring");
      }
    }
    BOOST_TEST(!drafts_b.empty(), what);
    BOOST_TEST(drafts_a == drafts_b, what);
    BOOST_TEST(a.stats().rounds == rounds_before + b.stats().rounds, what);
  }
  model::host_sequence seq;
  model::speculative_decoder<tiny> d(f.m, f.w, seq, sp);
  const std::vector<std::int32_t> one{5};
  BOOST_TEST(throws_with([&] { d.resume(one, exact, sp); }, "resume() before start()"));
  d.start(prompt_of(3));
  BOOST_TEST(throws_with([&] { d.resume({}, exact, sp); }, "resume() with an empty chunk"));
  const kernels::sampling::sampling_params bad{-1.0f};
  BOOST_TEST(throws_with([&] { d.resume(one, exact, bad); }, "temperature"));
  BOOST_TEST(seq.length == 3);  // (refused before the forward)
}

BOOST_AUTO_TEST_SUITE_END()
