// CUDA mHC split + Sinkhorn against the host (same function; expf vs the host's exp differ by ulps).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/mhc/sinkhorn.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using runtime::device_buffer;

BOOST_AUTO_TEST_SUITE(sinkhorn_cuda)

BOOST_AUTO_TEST_CASE(device_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(90);
  std::normal_distribution<float> n(0.0f, 3.0f);
  const long long tokens = 10000;
  std::vector<float> mixes(std::size_t(tokens) * 24), scale = {0.5f, 1.5f, 2.0f}, base(24);
  for (auto& v : mixes) v = n(rng);
  for (auto& v : base) v = n(rng) / 3.0f;
  device_buffer<float> dm{std::span<const float>(mixes)}, ds{std::span<const float>(scale)}, db{std::span<const float>(base)};
  device_buffer<float> dpre(std::size_t(tokens) * 4), dpost(std::size_t(tokens) * 4), dcomb(std::size_t(tokens) * 16);
  dpre.fill_bytes(0xFF);
  dpost.fill_bytes(0xFF);
  dcomb.fill_bytes(0xFF);
  kernels::mhc::split_sinkhorn({dm.data(), ds.data(), db.data(), dpre.data(), dpost.data(), dcomb.data(), tokens, 20, 1e-6f});
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto pre = dpre.download(), post = dpost.download(), comb = dcomb.download();
  double worst = 0;
  std::size_t nan = 0;
  for (long long t = 0; t < tokens; ++t) {
    float p[4], q[4], c[16];
    kernels::mhc::split_sinkhorn(&mixes[std::size_t(t) * 24], scale.data(), base.data(), 20, 1e-6f, p, q, c);
    auto cmp = [&](float got, float want) {
      if (std::isnan(got)) ++nan;
      worst = std::max(worst, std::fabs(double(got) - want) / std::max(1e-30, std::fabs(double(want))));
    };
    for (int i = 0; i < 4; ++i) cmp(pre[std::size_t(t) * 4 + i], p[i]), cmp(post[std::size_t(t) * 4 + i], q[i]);
    for (int i = 0; i < 16; ++i) cmp(comb[std::size_t(t) * 16 + i], c[i]);
  }
  BOOST_TEST_MESSAGE("sinkhorn device vs host: worst relative error " << worst);
  BOOST_TEST(nan == 0u);
  BOOST_TEST(worst < 4e-6);
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors) {
  BOOST_CHECK_THROW(kernels::mhc::split_sinkhorn({nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 5, 20, 1e-6f}),
                    dsv4::error);
  BOOST_CHECK_THROW(kernels::mhc::split_sinkhorn({nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 5, 0, 1e-6f}),
                    dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
