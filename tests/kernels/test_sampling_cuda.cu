// The device sampler against sample_reference: the same token for every row, step and parameter
// set (greedy, temperature, top-k, top-p, both, top-k beyond the vocabulary), at V4.1's vocabulary
// and a small one, with ties, -inf logits, peaked rows, a row too flat for the shared-memory
// candidates (drawn on the host), NaN logits and bad parameters; and the numbers a draw rests on
// (exponential, logarithm, probability, noise) bit for bit against the host's.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dsv4/kernels/sampling/sampling.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::sampling;

namespace {
//! Rows of logits in several shapes: normal with growing spread, all equal (ties everywhere),
//! mostly -inf, a few large outliers, and peaked (a trained model's rows: most of the vocabulary
//! far below a few strong tokens, so most probabilities share the last bin).
std::vector<float> make_logits(std::mt19937_64& rng, int rows, long long vocab) {
  std::vector<float> x(std::size_t(rows) * std::size_t(vocab));
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + std::size_t(r) * std::size_t(vocab);
    const int shape = r % 7;
    std::normal_distribution<float> n(0.0f, shape == 0 ? 1.0f : shape == 1 ? 3.0f : 8.0f);
    for (long long i = 0; i < vocab; ++i) row[i] = n(rng);
    if (shape == 3)
      for (long long i = 0; i < vocab; ++i) row[i] = 0.5f;  // ties: the lower id first
    if (shape == 4)
      for (long long i = 0; i < vocab; ++i)
        if (i % 7 != 0) row[i] = -INFINITY;
    if (shape == 5)
      for (int k = 0; k < 5; ++k) row[rng() % std::uint64_t(vocab)] = 30.0f + float(k);
    if (shape == 6) {
      std::normal_distribution<float> low(0.0f, 2.0f);
      for (long long i = 0; i < vocab; ++i) row[i] = low(rng);
      for (int k = 0; k < 8; ++k) row[rng() % std::uint64_t(vocab)] = 12.0f + float(k);
    }
  }
  return x;
}

const sampling_params kParams[] = {
    {0.0f, 0, 1.0f, 1},       {0.7f, 0, 1.0f, 2},
    {1.0f, 50, 1.0f, 3},      {0.8f, 0, 0.9f, 4},
    {1.2f, 40, 0.95f, 5},     {1.0f, 1, 1.0f, 6},
    {1.0f, 0, 0.01f, 7},      {0.6f, 2000, 1.0f, 8},
    {1.0f, 0, 0.5f, 9},       {2.0f, 10, 1.0f, 10},
    {1.0f, 200000, 1.0f, 12}, {0.9f, 200000, 0.9f, 13},  // top_k beyond the vocabulary: off
};

void check_vocab(long long vocab, int rows, std::uint64_t salt, int steps) {
  auto rng = test::make_rng(salt);
  const auto x = make_logits(rng, rows, vocab);
  runtime::device_buffer<float> dx{std::span<const float>(x)};
  device_sampler sampler(rows);
  std::size_t draws = 0, same = 0;
  for (const sampling_params& p : kParams)
    for (int step = 0; step < steps; ++step) {
      std::vector<row_request> req(static_cast<std::size_t>(rows));
      for (int r = 0; r < rows; ++r)
        req[std::size_t(r)] = {p, std::uint64_t(r) * 7 + 1, std::uint64_t(step) + 100};
      const auto got = sampler.sample(dx.data(), vocab, req);
      for (int r = 0; r < rows; ++r) {
        const std::span<const float> row(x.data() + std::size_t(r) * std::size_t(vocab), std::size_t(vocab));
        const int want = sample_reference(row, p, req[std::size_t(r)].sequence, req[std::size_t(r)].step);
        ++draws;
        same += got[std::size_t(r)] == want;
        BOOST_TEST(got[std::size_t(r)] == want, "vocab " << vocab << " row " << r << " (shape " << r % 7
                                                         << ") step " << step << " T " << p.temperature
                                                         << " top_k " << p.top_k << " top_p " << p.top_p);
      }
    }
  BOOST_TEST_MESSAGE("device sampler, vocab "
                     << vocab << ": " << same << " of " << draws
                     << " draws equal to the host's; rows drawn on the host: " << sampler.fallback_rows());
}
DSV4_KERNEL void sampler_numbers(const float* x, const double* u, float* exps, double* logs, float* probs,
                                 double* noise, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  exps[i] = sampler_exp(x[i]);
  logs[i] = sampler_log(u[i]);
  probs[i] = probability(exps[i], 1.0 / (1.0 + double(i)));
  noise[i] = exponential_noise(7, std::uint64_t(i), 3, std::uint64_t(i) * 31);
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(sampling_cuda)

// The device evaluates the sampler's own exponential, logarithm, probability and noise to the
// host's bits: the premise of equal draws (no libm or CUDA math function is involved).
BOOST_AUTO_TEST_CASE(device_numbers_are_the_host_bits,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const int n = 1 << 20;
  auto rng = test::make_rng(4);
  std::uniform_real_distribution<float> ux(-90.0f, 0.0f);
  std::uniform_int_distribution<std::uint64_t> uk(0, (std::uint64_t(1) << 53) - 1);
  std::vector<float> x(n);
  std::vector<double> u(n);
  for (int i = 0; i < n; ++i) x[std::size_t(i)] = ux(rng), u[std::size_t(i)] = double(uk(rng) + 1) * 0x1p-53;
  x[0] = 0.0f, x[1] = -INFINITY, x[2] = -87.4f, u[0] = 1.0, u[1] = 0x1p-53;
  runtime::device_buffer<float> dx{std::span<const float>(x)}, de(static_cast<std::size_t>(n)),
      dp(static_cast<std::size_t>(n));
  runtime::device_buffer<double> du{std::span<const double>(u)}, dl(static_cast<std::size_t>(n)),
      dn(static_cast<std::size_t>(n));
  sampler_numbers<<<n / 256, 256>>>(dx.data(), du.data(), de.data(), dl.data(), dp.data(), dn.data(), n);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto e = de.download(), p = dp.download();
  const auto l = dl.download(), z = dn.download();
  int bad = 0;
  for (int i = 0; i < n && bad < 10; ++i) {
    const std::size_t k = std::size_t(i);
    const float he = sampler_exp(x[k]);
    const bool ok = same_bits(e[k], he) && same_bits(l[k], sampler_log(u[k])) &&
                    same_bits(p[k], probability(he, 1.0 / (1.0 + double(i)))) &&
                    same_bits(z[k], exponential_noise(7, k, 3, k * 31));
    if (!ok) {
      ++bad;
      BOOST_TEST(ok, "input " << i << ": x " << x[k] << " exp " << e[k] << " vs " << he << ", u " << u[k]
                              << " log " << l[k] << " vs " << sampler_log(u[k]));
    }
  }
  BOOST_TEST(bad == 0);
}

BOOST_AUTO_TEST_CASE(device_draws_the_host_tokens,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_vocab(129280, 14, 1, 3);  // V4.1's vocabulary, each shape twice
  check_vocab(1000, 21, 2, 4);
}

// A flat row with top-p near 1 keeps more candidates than shared memory holds: drawn on the host
// from a copy of the row, the same token.
BOOST_AUTO_TEST_CASE(flat_rows_fall_back_to_the_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const long long vocab = 20000;
  std::vector<float> x(static_cast<std::size_t>(vocab));
  auto rng = test::make_rng(3);
  std::uniform_real_distribution<float> u(0.0f, 0.01f);
  for (auto& v : x) v = u(rng);
  runtime::device_buffer<float> dx{std::span<const float>(x)};
  device_sampler sampler(4);
  const sampling_params p{1.0f, 0, 0.99f, 11};
  const std::vector<row_request> req = {{p, 3, 9}};
  const auto got = sampler.sample(dx.data(), vocab, req);
  BOOST_TEST(got[0] == sample_reference(x, p, 3, 9));
  BOOST_TEST(sampler.fallback_rows() == 1);
  // A row of spread logits with the same top-p stays on the device.
  std::normal_distribution<float> n(0.0f, 4.0f);
  for (auto& v : x) v = n(rng);
  runtime::device_buffer<float> dspread{std::span<const float>(x)};
  BOOST_TEST(sampler.sample(dspread.data(), vocab, req)[0] == sample_reference(x, p, 3, 9));
  BOOST_TEST(sampler.fallback_rows() == 1);
}

BOOST_AUTO_TEST_CASE(nan_logits_and_bad_parameters_are_errors,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const long long vocab = 500;
  std::vector<float> x(std::size_t(3 * vocab), 0.25f);
  x[std::size_t(2 * vocab + 17)] = NAN;
  runtime::device_buffer<float> dx{std::span<const float>(x)};
  device_sampler sampler(3);
  std::vector<row_request> req(3);
  BOOST_TEST(test::throws_with([&] { sampler.sample(dx.data(), vocab, req); }, "row 2: logit 17 is NaN"));
  req.resize(2);
  req[1].params.top_p = 0.0f;
  BOOST_TEST(
      test::throws_with([&] { sampler.sample(dx.data(), vocab, req); }, "row 1: top_p must be in (0, 1]"));
  req[1].params = {-1.0f, 0, 1.0f, 0};
  BOOST_TEST(test::throws_with([&] { sampler.sample(dx.data(), vocab, req); }, "row 1: temperature"));
  req.resize(4);
  BOOST_TEST(test::throws_with([&] { sampler.sample(dx.data(), vocab, req); }, "4 rows, at most 3"));
  req.resize(1);
  req[0].params = {};
  BOOST_TEST(test::throws_with([&] { sampler.sample(nullptr, vocab, req); }, "null logits"));
}

BOOST_AUTO_TEST_SUITE_END()
