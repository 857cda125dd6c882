// CUDA RoPE against the host reference, at V4.1 widths and positions up to 2^20.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/rope/rope.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::rope;
using numerics::bf16;

BOOST_AUTO_TEST_SUITE(rope_cuda)

BOOST_AUTO_TEST_CASE(device_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(41);
  std::normal_distribution<float> n(0.0f, 2.0f);
  for (bool yarn : {true, false})
    for (bool inverse : {false, true}) {
      const rope_params p = yarn ? rope_params{64, 160000.0f, 65536, 16.0f, 32.0f, 1.0f} : rope_params{64, 10000.0f, 0, 1, 32, 1};
      const auto f = frequencies(p);
      const int npos = 257, heads = 64, dim = 512;
      std::vector<std::int64_t> pos(npos);
      for (auto& t : pos) t = std::int64_t(rng() % (1u << 20));
      pos[0] = 0;
      std::vector<bf16> x(std::size_t(npos) * heads * dim);
      for (auto& v : x) v = bf16::from_float(n(rng));
      std::vector<bf16> want = x;
      apply_rope_reference(want, dim, heads, pos, f, inverse);
      runtime::device_buffer<bf16> dx{std::span<const bf16>(x)};
      runtime::device_buffer<std::int64_t> dpos{std::span<const std::int64_t>(pos)};
      runtime::device_buffer<float> df{std::span<const float>(f)};
      apply_rope({dx.data(), dpos.data(), df.data(), npos, heads, dim, 32, inverse});
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = dx.download();
      std::size_t differ = 0, far = 0;
      for (std::size_t i = 0; i < got.size(); i += 2) {
        // sincosf and the host's cos/sin may differ by an fp32 ulp. A rotated coordinate is a
        // difference of products, so its error is relative to the pair's norm, not to itself
        // (near-cancelling coordinates can even change sign): allow one bf16 ulp at the norm's
        // scale, which is up to norm / 128 (bf16 keeps 8 significant bits).
        const float norm = std::hypot(want[i].to_float(), want[i + 1].to_float());
        for (std::size_t j : {i, i + 1}) {
          if (got[j].bits == want[j].bits) continue;
          ++differ;
          if (std::fabs(got[j].to_float() - want[j].to_float()) > norm / 128) ++far;
        }
      }
      BOOST_TEST_MESSAGE("rope yarn=" << yarn << " inverse=" << inverse << ": " << differ << " of " << got.size()
                                      << " values differ by one bf16 ulp");
      BOOST_TEST(far == 0u);
      BOOST_TEST(differ <= got.size() / 1000);
    }
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors) {
  BOOST_CHECK_THROW(apply_rope({nullptr, nullptr, nullptr, 1, 1, 16, 32, false}), dsv4::error);  // dim < 2 pairs
  BOOST_CHECK_THROW(apply_rope({nullptr, nullptr, nullptr, 1, 1, 64, 32, false}), dsv4::error);  // null pointers
}

BOOST_AUTO_TEST_SUITE_END()
