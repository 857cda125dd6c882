// Token sampling (spec §13 sample): greedy, Gumbel-max draws that follow softmax(logits / T),
// the top-k / top-p filters, reproducibility from (seed, sequence, step), and input errors.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/kernels/sampling/reference.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using namespace dsv4::kernels::sampling;

namespace {

//! Empirical frequencies of `draws` samples (steps 0 .. draws - 1 of sequence 7).
std::vector<double> frequencies(const std::vector<float>& logits, const sampling_params& p, int draws) {
  std::vector<double> f(logits.size(), 0.0);
  for (int s = 0; s < draws; ++s)
    f[std::size_t(sample_reference(logits, p, 7, std::uint64_t(s)))] += 1.0 / draws;
  return f;
}

std::vector<double> softmax(const std::vector<float>& logits, double t) {
  std::vector<double> p(logits.size());
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp(logits[i] / t));
  for (auto& v : p) v /= sum;
  return p;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sampling)

BOOST_AUTO_TEST_CASE(greedy_takes_the_first_maximum) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f};
  sampling_params p;
  p.temperature = 0.0f;
  BOOST_TEST(sample_reference(logits, p, 0, 0) == 1);
  p.top_k = 1;
  p.top_p = 0.1f;
  BOOST_TEST(sample_reference(logits, p, 3, 9) == 1);
}

BOOST_AUTO_TEST_CASE(draws_follow_the_tempered_softmax) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 3.0f, -std::numeric_limits<float>::infinity()};
  for (const float t : {1.0f, 0.5f, 2.0f}) {
    sampling_params p;
    p.temperature = t;
    p.seed = 1234;
    const auto f = frequencies(logits, p, 40000);
    const auto want = softmax(logits, t);
    for (std::size_t i = 0; i < f.size(); ++i)
      BOOST_TEST(std::fabs(f[i] - want[i]) < 0.01,
                 "T " << t << " token " << i << ": " << f[i] << " vs " << want[i]);
    BOOST_TEST(f[4] == 0.0);  // a -inf logit is never drawn
  }
}

BOOST_AUTO_TEST_CASE(filters_keep_only_the_most_probable) {
  // p = 0.5, 0.3, 0.15, 0.05 (log-probabilities as logits)
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  sampling_params p;
  p.seed = 99;
  p.top_k = 2;
  auto f = frequencies(logits, p, 20000);
  BOOST_TEST(f[2] + f[3] == 0.0);
  BOOST_TEST(std::fabs(f[0] - 0.625) < 0.015);  // 0.5 / 0.8 after the filter
  p.top_k = 0;
  p.top_p = 0.79f;  // 0.5 + 0.3 reaches it: two tokens stay
  f = frequencies(logits, p, 20000);
  BOOST_TEST(f[2] + f[3] == 0.0);
  p.top_p = 0.81f;  // one more is needed
  f = frequencies(logits, p, 20000);
  BOOST_TEST(f[2] > 0.1);
  BOOST_TEST(f[3] == 0.0);
  p.top_p = 0.01f;  // at least one token always stays: the most probable
  f = frequencies(logits, p, 1000);
  BOOST_TEST(f[0] > 0.999999);
}

// apply_filters sorts only the ranking's head; it keeps exactly the set that sorting the whole row
// (stable, by p descending: ties by id) and walking it keeps, on peaked, flat and tied rows.
BOOST_AUTO_TEST_CASE(filters_keep_what_a_full_sort_keeps) {
  auto full_sort = [](std::vector<float> p, int top_k, float top_p) {
    std::vector<std::size_t> order(p.size());
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
    std::size_t keep = top_k > 0 ? std::min<std::size_t>(std::size_t(top_k), p.size()) : p.size();
    if (top_p < 1.0f) {
      std::uint64_t mass = 0;
      std::size_t n = 0;
      while (n < keep && mass < top_p_threshold(top_p)) mass += to_fixed62(p[order[n++]]);
      keep = std::max<std::size_t>(n, 1);
    }
    for (std::size_t r = keep; r < order.size(); ++r) p[order[r]] = 0.0f;
    return p;
  };
  std::mt19937 rng(17);
  int cases = 0;
  for (const int vocab : {1, 7, 300, 5000}) {
    for (const float spread : {0.0f, 0.5f, 3.0f, 12.0f}) {
      std::normal_distribution<float> n(0.0f, spread);
      std::vector<float> logits(static_cast<std::size_t>(vocab));
      for (auto& v : logits) v = spread == 0.0f ? 1.0f : std::round(n(rng) * 4.0f) / 4.0f;  // many ties
      const auto p = probabilities(logits, 1.0f);
      for (const int k : {0, 1, 5, 256, 1000, 100000})
        for (const float top_p : {1.0f, 0.01f, 0.5f, 0.9f, 0.999f}) {
          if (k == 0 && top_p == 1.0f) continue;
          auto got = p;
          apply_filters(got, k, top_p);
          BOOST_TEST(got == full_sort(p, k, top_p),
                     "vocab " << vocab << " spread " << spread << " k " << k << " p " << top_p);
          ++cases;
        }
    }
  }
  BOOST_TEST(cases == 4 * 4 * 29);
}

BOOST_AUTO_TEST_CASE(a_draw_depends_only_on_seed_sequence_step) {
  std::vector<float> logits(1000);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = float(i % 17) * 0.1f;
  sampling_params p;
  p.seed = 5;
  int differ_step = 0, differ_seed = 0, differ_seq = 0;
  for (std::uint64_t s = 0; s < 200; ++s) {
    const int a = sample_reference(logits, p, 0, s);
    BOOST_TEST(a == sample_reference(logits, p, 0, s));
    differ_step += a != sample_reference(logits, p, 0, s + 1000);
    differ_seq += a != sample_reference(logits, p, 1, s);
    sampling_params q = p;
    q.seed = 6;
    differ_seed += a != sample_reference(logits, q, 0, s);
  }
  BOOST_TEST(differ_step > 150);  // ~1000 near-equal candidates: other noise, other token
  BOOST_TEST(differ_seq > 150);
  BOOST_TEST(differ_seed > 150);
}

// The sampler's own exponential and logarithm (the same bits on host and device by construction):
// within an ulp of the correctly rounded values, exact at the ends.
BOOST_AUTO_TEST_CASE(own_exp_and_log_are_accurate) {
  BOOST_TEST(sampler_exp(0.0f) == 1.0f);
  BOOST_TEST(sampler_exp(-INFINITY) == 0.0f);
  BOOST_TEST(sampler_exp(-88.0f) == 0.0f);  // below FLT_MIN: no subnormals
  int off = 0, checked = 0;
  for (float x = -87.0f; x <= 0.0f; x += 0.0013f) {
    const float want = float(std::exp(double(x)));  // glibc's fp64 exp rounded: within half an ulp + tiny
    const float got = sampler_exp(x);
    BOOST_TEST(std::fabs(got - want) <= std::nextafter(want, 2.0f) - want,
               "x " << x << ": " << got << " vs " << want);
    off += got != want;
    ++checked;
  }
  BOOST_TEST(off * 1000 < checked, off << " of " << checked << " differ by an ulp");
  BOOST_TEST(sampler_log(1.0) == 0.0);
  double worst = 0;
  for (double u = 0x1p-53; u < 1.0; u *= 1.0137) {
    const double want = std::log(u);
    worst = std::max(worst, std::fabs(sampler_log(u) - want) / std::fabs(want));
  }
  BOOST_TEST(worst < 4e-16, "sampler_log's worst relative error " << worst);
}

// The fixed-point denominator and masses are sums of integers: any order gives the same bits.
BOOST_AUTO_TEST_CASE(fixed_point_sums_ignore_the_order) {
  std::vector<float> v(5000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = sampler_exp(-float(i % 997) * 0.037f);
  fixed_sum fwd, rev, pairs;
  for (const float e : v) fwd.add(to_fixed62(e));
  for (auto it = v.rbegin(); it != v.rend(); ++it) rev.add(to_fixed62(*it));
  for (std::size_t h = 0; h < v.size() / 2; ++h) {
    fixed_sum a, b;
    a.add(to_fixed62(v[h]));
    b.add(to_fixed62(v[v.size() - 1 - h]));
    a.add(b);
    pairs.add(a);
  }
  BOOST_TEST((fwd.hi == rev.hi && fwd.lo == rev.lo && fwd.hi == pairs.hi && fwd.lo == pairs.lo));
  double plain = 0;
  for (const float e : v) plain += double(e);
  BOOST_TEST(std::fabs(fwd.value() - plain) <= 1e-12 * plain);
  const auto p = probabilities(std::vector<float>{0.0f, -1.0f, 2.0f, -INFINITY}, 1.0f);
  BOOST_TEST(std::fabs(p[0] + p[1] + p[2] - 1.0) < 1e-6);
  BOOST_TEST(p[3] == 0.0f);
  BOOST_TEST(probabilities(std::vector<float>(3, -INFINITY), 1.0f).empty());
}

BOOST_AUTO_TEST_CASE(bad_inputs_are_errors) {
  sampling_params p;
  std::vector<float> logits = {1.0f, std::nanf(""), 2.0f};
  BOOST_TEST(test::throws_with([&] { sample_reference(logits, p, 0, 0); }, "logit 1 is NaN"));
  logits[1] = 0.0f;
  p.temperature = -1.0f;
  BOOST_TEST(test::throws_with([&] { sample_reference(logits, p, 0, 0); }, "temperature"));
  p.temperature = 1.0f;
  p.top_p = 0.0f;
  BOOST_TEST(test::throws_with([&] { sample_reference(logits, p, 0, 0); }, "top_p"));
  p.top_p = 1.0f;
  p.top_k = -3;
  BOOST_TEST(test::throws_with([&] { sample_reference(logits, p, 0, 0); }, "top_k"));
  BOOST_TEST(test::throws_with([&] { sample_reference(std::span<const float>(), sampling_params{}, 0, 0); },
                               "empty"));
  // Every logit -inf: nothing is drawable, the first token (as greedy would take it).
  BOOST_TEST(sample_reference(std::vector<float>(4, -INFINITY), sampling_params{}, 0, 0) == 0);
}

BOOST_AUTO_TEST_SUITE_END()
