// CED prefill and appended input against exact mode (issue 6: "ced-mode and appended-input
// differences from exact mode are measured and reported (they are approximations by design), not
// hidden"; docs/parity.md, "CED prefill and appended input against exact mode"). The host model
// on tiny, scaled random checkpoints of fixed seeds and fixed ids, so the numbers printed with
// --log_level=message are the ones docs/parity.md reports (DSV4_CED_FULL=1 for its whole grid):
//   1. the CED prefill of N tokens against the exact prefill of the same tokens: last-position
//      logits, then decode steps fed the exact run's greedy tokens (teacher forcing: both runs see
//      the same ids);
//   2. a chunk of C tokens appended after an N-token prefill (an exact append; a CED append after
//      an exact or after a CED prefill) against the one-shot prefill of the N + C tokens.
// Asserted is only what holds by construction:
//   - the CED prefill of a prompt that fits the window is the exact prefill bit for bit (the
//     decoder's replay is the whole prompt), and so is every decode step after it;
//   - an exact append is the one-shot exact prefill bit for bit (a chunk runs row by row as decode
//     steps, and a decode step computes what the prefill computes for its row);
//   - a CED append gives the CED one-shot prefill of the whole sequence bit for bit, after a CED
//     prefill and after an exact one (the encoder and the decoder's KV owner compute the same in
//     both modes, and the append's replay reads only the kept encoder tail and the owner's cache);
//   - every logit is finite.
// The differences beyond the window are reported, not bounded: the weights are random, not
// trained for CED, so their size says nothing about a trained model.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"

namespace {
using namespace dsv4;
using tiny = models::tiny;
using host_model = model::host_model<tiny>;
using logits = std::vector<float>;

constexpr int window = tiny::dims.attn.window_size;  // 16

// The host model on a scaled random checkpoint of `seed`, made in memory.
host_model model_of(std::uint64_t seed) {
  io::checkpoint ck = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), seed, io::random_init::scaled);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);  // tiny: compressed vocabulary = vocabulary
  return host_model::load(ck, token_map);
}

// Fixed ids per seed (not the suite's random test seed: the numbers are the documented ones).
std::vector<std::int32_t> ids_of(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 rng(0xCED0000ull + seed);
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));
  return ids;
}

std::vector<std::size_t> top(const logits& v, std::size_t k) {
  std::vector<std::size_t> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(k), order.end(),
                    [&](std::size_t a, std::size_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  order.resize(k);
  return order;
}

// One row against the exact row: max |difference| over max |exact logit|, cosine similarity,
// argmax agreement, top-5 overlap, bit equality.
struct row_cmp {
  double max_rel = 0, cosine = 0, gap = 0;  //!< gap: the exact row's top two apart, over its max |logit|
  bool argmax_same = false, same_bits = false;
  int top5 = 0;
};

row_cmp compare(const logits& exact, const logits& other) {
  BOOST_REQUIRE_EQUAL(exact.size(), other.size());
  const auto nonfinite =
      std::count_if(exact.begin(), exact.end(), [](float v) { return !std::isfinite(v); }) +
      std::count_if(other.begin(), other.end(), [](float v) { return !std::isfinite(v); });
  BOOST_REQUIRE_EQUAL(nonfinite, 0);
  row_cmp r;
  double peak = 0, worst = 0, dot = 0, ee = 0, oo = 0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    const double e = exact[i], o = other[i];
    peak = std::max(peak, std::fabs(e)), worst = std::max(worst, std::fabs(e - o));
    dot += e * o, ee += e * e, oo += o * o;
  }
  r.max_rel = worst / peak;
  r.cosine = dot / std::sqrt(ee * oo);
  const auto te = top(exact, 5), to = top(other, 5);
  r.argmax_same = te[0] == to[0];
  r.gap = (double(exact[te[0]]) - double(exact[te[1]])) / peak;
  for (auto i : te) r.top5 += int(std::count(to.begin(), to.end(), i));
  r.same_bits = std::memcmp(exact.data(), other.data(), exact.size() * sizeof(float)) == 0;
  return r;
}

std::string fmt(const row_cmp& r) {
  std::ostringstream s;
  s << std::setprecision(4) << "max_rel " << std::setw(9) << r.max_rel << "  cos " << std::fixed
    << std::setprecision(5) << r.cosine << "  argmax " << (r.argmax_same ? "same" : "DIFF") << "  top5 "
    << r.top5 << "/5" << (r.same_bits ? "  bit-equal" : "");
  if (!r.argmax_same)
    s << "  (the exact row's top two are " << std::setprecision(4) << r.gap << " of its max apart)";
  return s.str();
}

std::size_t argmax(const logits& v) {
  return std::size_t(std::max_element(v.begin(), v.end()) - v.begin());
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What to run. The CTest grid (about 40 s in the release build: the host model takes a quarter of a
// second per token through the 40 layers) covers every assertion: a prompt of exactly the window,
// and an append that crosses it. DSV4_CED_FULL=1 runs the grid docs/parity.md reports (about 13
// minutes): three checkpoints, prompts below, at, above and well above the window, 8 decode steps.
struct grid {
  bool full = false;
  std::vector<std::uint64_t> seeds;
  std::vector<std::pair<int, int>> cases;  //!< prompt length N, appended chunk C (0: none)
  int decode_steps = 0;
};

grid grid_of_environment() {
  const char* full = std::getenv("DSV4_CED_FULL");
  if (full && std::string(full) == "1")
    return {true, {1, 2, 7}, {{12, 8}, {window, 0}, {40, 8}, {200, 16}}, 8};
  return {false, {7}, {{12, 8}, {window, 0}}, 4};
}
}  // namespace

BOOST_AUTO_TEST_SUITE(ced_vs_exact)

BOOST_AUTO_TEST_CASE(ced_prefill_and_appends_against_exact_mode) {
  const grid g = grid_of_environment();
  BOOST_TEST_MESSAGE("CED vs exact (window "
                     << window << ", top-k " << tiny::dims.indexer.index_topk << "; "
                     << (g.full ? "full grid" : "CTest grid; DSV4_CED_FULL=1 runs the documented one")
                     << "); metrics against the exact row: max |diff| / max |exact logit|, cosine, "
                        "argmax agreement, top-5 overlap");
  for (const std::uint64_t seed : g.seeds) {
    const auto m = model_of(seed);
    const auto ids = ids_of(seed, 256);
    for (const auto& [n, c] : g.cases) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::string at = "seed " + std::to_string(seed) + " N " + std::to_string(n);
      // 1. The CED prefill against the exact prefill, then teacher-forced decode steps.
      const auto prompt = std::span<const std::int32_t>(ids).first(std::size_t(n));
      model::host_sequence exact, ced;
      auto want = model::forward(m, exact, prompt);
      auto got = model::forward_ced(m, ced, prompt);
      const model::host_sequence exact_at_n = exact, ced_at_n = ced;  // for the appends below
      const auto p = compare(want, got);
      BOOST_TEST_MESSAGE(at << " CED prefill        " << fmt(p));
      // Fits the window: the decoder's replay is the whole prompt, every state the exact one's.
      if (n <= window) BOOST_TEST(p.same_bits, at << ": the CED prefill of a prompt that fits the window");
      double worst = 0, sum = 0, cos_min = 1;
      int argmax_same = 0, top5 = 0;
      for (int step = 1; step <= g.decode_steps; ++step) {
        const std::int32_t next[1] = {
            std::int32_t(argmax(want))};  // the exact run's greedy token, fed to both
        want = model::forward(m, exact, next);
        got = model::forward(m, ced, next);
        const auto d = compare(want, got);
        BOOST_TEST_MESSAGE(at << "   decode step " << step << "    " << fmt(d));
        if (n <= window)
          BOOST_TEST(d.same_bits,
                     at << " decode step " << step << " after a CED prefill that fits the window");
        worst = std::max(worst, d.max_rel), sum += d.max_rel, cos_min = std::min(cos_min, d.cosine);
        argmax_same += d.argmax_same, top5 += d.top5;
      }
      if (g.decode_steps > 0)
        BOOST_TEST_MESSAGE(at << "   decode steps 1-" << g.decode_steps << ": worst max_rel " << worst
                              << " (mean " << sum / g.decode_steps << "), min cos " << cos_min
                              << ", argmax same " << argmax_same << "/" << g.decode_steps
                              << ", top-5 overlap " << top5 << "/" << 5 * g.decode_steps);
      // 2. A chunk of c tokens appended to the n-token prefill against the one-shot prefill.
      if (c > 0) {
        const auto all = std::span<const std::int32_t>(ids).first(std::size_t(n + c));
        const auto chunk = all.subspan(std::size_t(n));
        const std::string atc = at + " + C " + std::to_string(c);
        model::host_sequence one_shot, one_shot_ced, exact_append = exact_at_n, exact_ced_append = exact_at_n,
                                                     ced_append = ced_at_n;
        const auto whole = model::forward(m, one_shot, all);
        const auto whole_ced = model::forward_ced(m, one_shot_ced, all);
        const auto ea = compare(whole, model::forward(m, exact_append, chunk));
        const auto after_exact_ced = model::forward_ced(m, exact_ced_append, chunk);
        const auto eca = compare(whole, after_exact_ced);
        const auto after_ced = model::forward_ced(m, ced_append, chunk);
        const auto cca = compare(whole, after_ced);
        const auto co = compare(whole, whole_ced);
        const auto cc = compare(whole_ced, after_ced);
        const auto ec = compare(whole_ced, after_exact_ced);
        BOOST_TEST_MESSAGE(atc << " exact append                   vs exact one-shot " << fmt(ea));
        BOOST_TEST_MESSAGE(atc << " exact prefill + CED append     vs exact one-shot " << fmt(eca));
        BOOST_TEST_MESSAGE(atc << " CED prefill + CED append       vs exact one-shot " << fmt(cca));
        BOOST_TEST_MESSAGE(atc << " CED one-shot                   vs exact one-shot " << fmt(co));
        BOOST_TEST_MESSAGE(atc << " CED prefill + CED append       vs CED one-shot   " << fmt(cc));
        BOOST_TEST_MESSAGE(atc << " exact prefill + CED append     vs CED one-shot   " << fmt(ec));
        // An exact append runs row by row as decode steps, and a decode step computes what the
        // prefill computes for its row.
        BOOST_TEST(ea.same_bits, atc << ": the exact append is not the one-shot exact prefill");
        // Same encoder output (the encoder runs the chunk in exact mode), same owner cache, same
        // replayed positions (the last `window` of the whole sequence, from the kept encoder tail).
        // The prefill's mode does not matter: the encoder and the owner compute the same either way,
        // and the append's replay reads only the encoder tail and the owner's cache.
        BOOST_TEST(cc.same_bits, atc << ": CED prefill + CED append is not the CED prefill of the whole");
        BOOST_TEST(ec.same_bits, atc << ": exact prefill + CED append is not the CED prefill of the whole");
        BOOST_TEST(exact_append.length == n + c);
        BOOST_TEST(ced_append.length == n + c);
      }
      BOOST_TEST_MESSAGE(at << " (" << seconds_since(t0) << " s)");
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
