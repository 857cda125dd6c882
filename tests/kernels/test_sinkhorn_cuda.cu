// CUDA mHC split + Sinkhorn against the host (same function; expf vs the host's exp differ by ulps),
// and the fused step's warp version against the sequential function, both on the device, bit for bit.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dsv4/kernels/mhc/sinkhorn.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using runtime::device_buffer;

namespace {

using kernels::mhc::hc;
using kernels::mhc::mix_count;

//! Per-token inputs of the split: every token has its own scale, base, iteration count and eps.
struct split_inputs {
  std::vector<float> mixes, scale, base, eps;
  std::vector<int> iters;
  std::vector<int> group;  //!< which input family the token belongs to (for the report)
};

//! One thread per token: the sequential `split_sinkhorn` (the function the host reference runs).
__global__ void sequential_split_kernel(const float* mixes, const float* scale, const float* base, const int* iters,
                                        const float* eps, long long tokens, float* pre, float* post, float* comb) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  float m[mix_count], p[hc], q[hc], c[hc * hc];
  for (int i = 0; i < mix_count; ++i) m[i] = mixes[t * mix_count + i];
  kernels::mhc::split_sinkhorn(m, scale + t * 3, base + t * mix_count, iters[t], eps[t], p, q, c);
  for (int i = 0; i < hc; ++i) pre[t * hc + i] = p[i], post[t * hc + i] = q[i];
  for (int i = 0; i < hc * hc; ++i) comb[t * hc * hc + i] = c[i];
}

//! `split_sinkhorn_warp`, called as the fused mHC step calls it: one token a warp (both halves
//! given it, the first writing) or two (a token a half; the halves may differ in `iters`). A half
//! without a token splits the warp's first token with `writes` false and its outputs pointed at
//! `guard`, which must stay as it was.
template <int PerWarp>
__global__ void warp_split_kernel(const float* mixes, const float* scale, const float* base, const int* iters,
                                  const float* eps, long long tokens, float* pre, float* post, float* comb,
                                  float* guard) {
  const int lane = int(threadIdx.x % 32);
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long first = w * PerWarp;
  if (first >= tokens) return;  // whole warps leave together
  const bool idle = PerWarp == 2 && first + lane / 16 >= tokens;
  const long long t = PerWarp == 1 || idle ? first : first + lane / 16;
  const bool writes = PerWarp == 1 ? lane < 16 : !idle;
  float m[mix_count];
#pragma unroll
  for (int i = 0; i < mix_count; ++i) m[i] = mixes[t * mix_count + i];
  kernels::mhc::split_sinkhorn_warp(m, scale + t * 3, base + t * mix_count, iters[t], eps[t],
                                    idle ? guard : pre + t * hc, idle ? guard + hc : post + t * hc,
                                    idle ? guard + 2 * hc : comb + t * hc * hc, writes);
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

//! Families of inputs, `per_group` tokens each: realistic, random magnitudes (also negative
//! scales, eps 0 and 1 to 50 iterations), large logits (exp underflows, products overflow to inf),
//! all-equal logits, exact ties, tiny and subnormal values, raw random bit patterns (NaN, inf,
//! subnormals anywhere), and scattered inf / NaN among ordinary values.
split_inputs make_split_inputs(std::mt19937_64& rng, int per_group) {
  constexpr int groups = 8;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const float epss[] = {1e-6f, 0.0f, 1e-30f, 1e-3f, 0.5f};
  const int iterss[] = {1, 2, 3, 7, 20, 50};
  auto pick_eps = [&] { return epss[rng() % 5]; };
  auto pick_iters = [&] { return iterss[rng() % 6]; };
  auto signed_pow10 = [&](float lo, float hi) {
    return (rng() & 1 ? -1.0f : 1.0f) * std::pow(10.0f, lo + (hi - lo) * u(rng));
  };
  split_inputs in;
  for (int g = 0; g < groups; ++g)
    for (int i = 0; i < per_group; ++i) {
      float m[mix_count], sc[3], b[mix_count];
      float eps = 1e-6f;
      int iters = 20;
      switch (g) {
        case 0:  // the model's regime
          for (auto& v : m) v = 3.0f * n(rng);
          sc[0] = 0.5f, sc[1] = 1.5f, sc[2] = 2.0f;
          for (auto& v : b) v = n(rng);
          break;
        case 1: {  // random magnitudes and settings
          const float sm = std::pow(10.0f, -3.0f + 6.0f * u(rng)), sb = std::pow(10.0f, -3.0f + 4.0f * u(rng));
          for (auto& v : m) v = sm * n(rng);
          for (auto& v : sc) v = signed_pow10(-2.0f, 1.0f);
          for (auto& v : b) v = sb * n(rng);
          eps = pick_eps(), iters = pick_iters();
          break;
        }
        case 2:  // large logits: one entry dominates each row; some products overflow to +-inf
          for (auto& v : m) v = signed_pow10(2.0f, 38.0f);
          for (auto& v : sc) v = std::pow(10.0f, -1.0f + 3.0f * u(rng));
          for (auto& v : b) v = signed_pow10(0.0f, 30.0f);
          eps = pick_eps(), iters = pick_iters();
          break;
        case 3: {  // all logits equal (uniform softmax, exact column sums)
          const float v0 = rng() % 4 ? 3.0f * n(rng) : 0.0f, b0 = rng() % 2 ? n(rng) : 0.0f;
          for (auto& v : m) v = v0;
          for (auto& v : sc) v = rng() % 2 ? 1.0f : u(rng);
          for (auto& v : b) v = b0;
          eps = pick_eps(), iters = pick_iters();
          break;
        }
        case 4: {  // exact ties: values from a small set
          const float set[] = {-2.0f, -1.0f, 0.0f, -0.0f, 1.0f, 2.0f};
          for (auto& v : m) v = set[rng() % 6];
          for (auto& v : sc) v = set[rng() % 6];
          for (auto& v : b) v = set[rng() % 6];
          eps = pick_eps(), iters = pick_iters();
          break;
        }
        case 5:  // tiny and subnormal values
          for (auto& v : m) v = rng() % 8 ? signed_pow10(-45.0f, -30.0f) : 0.0f;
          for (auto& v : sc) v = signed_pow10(-40.0f, 0.0f);
          for (auto& v : b) v = rng() % 2 ? signed_pow10(-45.0f, -36.0f) : -0.0f;
          eps = rng() % 2 ? 1e-45f : pick_eps(), iters = pick_iters();
          break;
        case 6:  // raw bit patterns
          for (auto& v : m) v = from_bits(std::uint32_t(rng()));
          for (auto& v : sc) v = from_bits(std::uint32_t(rng()));
          for (auto& v : b) v = from_bits(std::uint32_t(rng()));
          eps = pick_eps(), iters = pick_iters();
          break;
        default: {  // ordinary values with scattered inf and NaN
          const float specials[] = {INFINITY, -INFINITY, NAN, 3e38f, -3e38f};
          for (auto& v : m) v = rng() % 6 ? 3.0f * n(rng) : specials[rng() % 5];
          sc[0] = 0.5f, sc[1] = 1.5f, sc[2] = 2.0f;
          for (auto& v : b) v = rng() % 12 ? n(rng) : specials[rng() % 5];
          iters = pick_iters();
          break;
        }
      }
      in.mixes.insert(in.mixes.end(), m, m + mix_count);
      in.scale.insert(in.scale.end(), sc, sc + 3);
      in.base.insert(in.base.end(), b, b + mix_count);
      in.eps.push_back(eps);
      in.iters.push_back(iters);
      in.group.push_back(g);
    }
  return in;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sinkhorn_cuda)

// mhc_step.cuh computes the split with split_sinkhorn_warp (a token a warp or a half warp, sums
// gathered by shuffles in the sequential order); it must equal the sequential split_sinkhorn, which the host
// reference runs, bit for bit: both run here on the device (the same expf), on every input family.
BOOST_AUTO_TEST_CASE(warp_split_equals_sequential_split_bitwise,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(91);
  const int per_group = 4096;
  const auto in = make_split_inputs(rng, per_group);
  const long long tokens = (long long)in.eps.size();
  device_buffer<float> dm{std::span<const float>(in.mixes)}, ds{std::span<const float>(in.scale)},
      db{std::span<const float>(in.base)}, de{std::span<const float>(in.eps)};
  device_buffer<int> di{std::span<const int>(in.iters)};
  const std::size_t outs = std::size_t(tokens) * (2 * hc + hc * hc);
  device_buffer<float> seq(outs), warp(outs), pairs(outs), guard(2 * hc + hc * hc);
  seq.fill_bytes(0xFF);   // a value either side leaves unwritten shows as a difference
  warp.fill_bytes(0x7F);
  pairs.fill_bytes(0x7F);
  guard.fill_bytes(0x7F);
  auto pre = [&](device_buffer<float>& o) { return o.data(); };
  auto post = [&](device_buffer<float>& o) { return o.data() + tokens * hc; };
  auto comb = [&](device_buffer<float>& o) { return o.data() + 2 * tokens * hc; };
  sequential_split_kernel<<<unsigned((tokens + 127) / 128), 128>>>(dm.data(), ds.data(), db.data(), di.data(), de.data(),
                                                                  tokens, pre(seq), post(seq), comb(seq));
  DSV4_CUDA_CHECK_LAUNCH();
  warp_split_kernel<1><<<unsigned((tokens * 32 + 255) / 256), 256>>>(dm.data(), ds.data(), db.data(),
                                                                     di.data(), de.data(), tokens, pre(warp),
                                                                     post(warp), comb(warp), guard.data());
  DSV4_CUDA_CHECK_LAUNCH();
  // Two tokens a warp, over all but the last token (an odd count: the last warp's second half has
  // none and must write nothing), then the last token in a launch of its own.
  warp_split_kernel<2><<<unsigned((tokens / 2 * 32 + 255) / 256), 256>>>(  // ceil((tokens - 1) / 2) warps
      dm.data(), ds.data(), db.data(), di.data(), de.data(), tokens - 1, pre(pairs), post(pairs), comb(pairs),
      guard.data());
  DSV4_CUDA_CHECK_LAUNCH();
  warp_split_kernel<2><<<1, 32>>>(dm.data() + (tokens - 1) * mix_count, ds.data() + (tokens - 1) * 3,
                                  db.data() + (tokens - 1) * mix_count, di.data() + (tokens - 1),
                                  de.data() + (tokens - 1), 1, pre(pairs) + (tokens - 1) * hc,
                                  post(pairs) + (tokens - 1) * hc, comb(pairs) + (tokens - 1) * hc * hc,
                                  guard.data());
  DSV4_CUDA_CHECK_LAUNCH();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto a = seq.download(), b = warp.download(), b2 = pairs.download(), guarded = guard.download();
  std::size_t guard_written = 0;
  for (float v : guarded) guard_written += to_bits(v) != 0x7F7F7F7Fu;
  BOOST_TEST(guard_written == 0u, "a half without a token wrote " << guard_written << " outputs");
  const int groups = int(tokens / per_group);
  std::vector<std::size_t> differ(std::size_t(groups), 0), differ2(std::size_t(groups), 0),
      nan(std::size_t(groups), 0), inf(std::size_t(groups), 0);
  // Output i of token t, in the buffer's [pre | post | comb] layout.
  auto token_of = [&](std::size_t i) {
    const std::size_t pp = std::size_t(tokens) * hc;
    return i < 2 * pp ? (i % pp) / hc : (i - 2 * pp) / (hc * hc);
  };
  for (std::size_t i = 0; i < outs; ++i) {
    const std::size_t g = std::size_t(in.group[token_of(i)]);
    differ[g] += to_bits(a[i]) != to_bits(b[i]);
    differ2[g] += to_bits(a[i]) != to_bits(b2[i]);
    nan[g] += std::isnan(a[i]);
    inf[g] += std::isinf(a[i]);
  }
  for (int g = 0; g < groups; ++g) {
    BOOST_TEST_MESSAGE("split_sinkhorn_warp vs split_sinkhorn, input family "
                       << g << ": " << differ[std::size_t(g)] << " of " << per_group * (2 * hc + hc * hc)
                       << " outputs differ in bits, two tokens a warp " << differ2[std::size_t(g)] << " ("
                       << nan[std::size_t(g)] << " NaN, " << inf[std::size_t(g)] << " inf)");
    BOOST_TEST(differ[std::size_t(g)] == 0u, "input family " << g << ": the warp split differs from the sequential split");
    BOOST_TEST(differ2[std::size_t(g)] == 0u,
               "input family " << g << ": two tokens a warp differ from the sequential split");
  }
}


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
