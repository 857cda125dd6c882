// Sparse attention with sink: the host reference against the reference vectors (official kernel
// semantics) and against the closed form on small random problems.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/io/safetensors.hpp"
#include "dsv4/kernels/attention/reference.hpp"
#include "support/data.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels::attention;
using numerics::bf16;

namespace {
// bf16 ulp distance between two finite values.
int ulp_distance(bf16 a, bf16 b) {
  auto key = [](bf16 x) { return (x.bits & 0x8000) ? -int(x.bits & 0x7fff) : int(x.bits); };
  return std::abs(key(a) - key(b));
}
}  // namespace

BOOST_AUTO_TEST_SUITE(attention)

BOOST_AUTO_TEST_CASE(reference_matches_the_official_vectors) {
  io::safetensors_file f(test::data_path("reference/sparse_attn.safetensors"));
  const auto& qt = f.tensor("q", io::st_dtype::BF16, {2, 3, 8, 512});
  const auto& kvt = f.tensor("kv", io::st_dtype::BF16, {2, 700, 512});
  const auto& it = f.tensor("topk_idxs", io::st_dtype::I32, {2, 3, 328});
  const auto q = io::copy_as<bf16>(qt), kv = io::copy_as<bf16>(kvt);
  const auto idx = io::copy_as<std::int32_t>(it);
  const auto sink = io::copy_as<float>(f.tensor("attn_sink", io::st_dtype::F32, {8}));
  const float scale = io::copy_as<float>(f.tensor("softmax_scale"))[0];
  const auto want = io::copy_as<bf16>(f.tensor("out", io::st_dtype::BF16, {2, 3, 8, 512}));
  BOOST_TEST(scale == 1.0f / std::sqrt(512.0f));
  std::vector<bf16> got(want.size());
  const sparse_attention_problem p{3, 8, 512, 700, 328, scale};
  for (int b = 0; b < 2; ++b)
    sparse_attention_reference(p, std::span(q).subspan(b * 3 * 8 * 512, 3 * 8 * 512),
                               std::span(kv).subspan(b * 700 * 512, 700 * 512), sink,
                               std::span(idx).subspan(b * 3 * 328, 3 * 328),
                               std::span(got).subspan(b * 3 * 8 * 512, 3 * 8 * 512));
  int worst = 0;
  std::size_t off_by_one = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    BOOST_REQUIRE(!std::isnan(got[i].to_float()));
    const int d = ulp_distance(got[i], want[i]);
    worst = std::max(worst, d);
    off_by_one += d == 1;
  }
  BOOST_TEST_MESSAGE("sparse attention vs reference: worst " << worst << " bf16 ulp, " << off_by_one << " of "
                                                             << got.size() << " values off by one");
  BOOST_TEST(worst <= 1);  // MANIFEST: "within ~1 bf16 ulp" (exp and fp32 summation order)
  // Row [1, 2] has no valid index: zeros.
  for (int i = 0; i < 8 * 512; ++i) BOOST_TEST(got[(5 * 8) * 512 + i].bits == 0);
}

// The closed form o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}), in double, bounds the
// recurrence's bf16 rounding of probabilities.
BOOST_AUTO_TEST_CASE(reference_agrees_with_the_closed_form) {
  auto rng = test::make_rng(30);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const sparse_attention_problem p{5, 4, 64, 300, 200, 0.125f};
  std::vector<bf16> q(5 * 4 * 64), kv(300 * 64), out(q.size());
  for (auto& x : q) x = bf16::from_float(n(rng));
  for (auto& x : kv) x = bf16::from_float(n(rng));
  std::vector<float> sink = {0.5f, -1.0f, 2.0f, 0.0f};
  std::vector<std::int32_t> idx(5 * 200);
  for (auto& j : idx) j = (rng() % 7 == 0) ? -1 : std::int32_t(rng() % 300);
  sparse_attention_reference(p, q, kv, sink, idx, out);
  for (int r = 0; r < 5; ++r)
    for (int h = 0; h < 4; ++h) {
      std::vector<double> num(64, 0.0);
      double den = std::exp(double(sink[h]));
      for (int k = 0; k < 200; ++k) {
        const int e = idx[r * 200 + k];
        if (e < 0) continue;
        double s = 0;
        for (int d = 0; d < 64; ++d) s += double(q[(r * 4 + h) * 64 + d].to_float()) * kv[e * 64 + d].to_float();
        const double w = std::exp(s * 0.125);
        den += w;
        for (int d = 0; d < 64; ++d) num[d] += w * kv[e * 64 + d].to_float();
      }
      for (int d = 0; d < 64; ++d) {
        const double want = num[d] / den, got = out[(r * 4 + h) * 64 + d].to_float();
        BOOST_TEST(std::fabs(got - want) <= 0.01 * std::fabs(want) + 2e-3, "row " << r << " head " << h << " ch " << d);
      }
    }
}

BOOST_AUTO_TEST_CASE(reference_rejects_bad_indices) {
  const sparse_attention_problem p{1, 1, 8, 4, 2, 1.0f};
  std::vector<bf16> q(8), kv(32), out(8);
  std::vector<float> sink(1);
  std::vector<std::int32_t> idx = {0, 4};
  BOOST_CHECK_THROW(sparse_attention_reference(p, q, kv, sink, idx, out), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
