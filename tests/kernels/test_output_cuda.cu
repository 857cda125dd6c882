// Unquantized linear layers through cuBLAS (bf16, grouped bf16, true fp32) and the CUDA
// attention output path (inverse RoPE, grouped wo_a, act_quant, FP8 wo_b) against the host
// references, V4.1 and tiny widths, decode and prefill token counts; outputs poisoned with NaN.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/output/output.cuh"
#include "dsv4/kernels/output/reference.hpp"
#include "dsv4/kernels/output/wo_a_fp8.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/blas.hpp"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels;
using numerics::bf16;
using runtime::device_buffer;

namespace {

using test::blas_handle;

std::vector<bf16> random_bf16(std::size_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16::from_float(d(rng));
  return v;
}

std::vector<float> widen(const std::vector<bf16>& v) { return linear::widen(v); }

//! |got - want| <= one bf16 ulp of want + 2^-16 of the row's sum of magnitudes; NaN never passes.
std::size_t count_bad(const std::vector<bf16>& got, const std::vector<bf16>& want, double magnitude) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i].to_float(), w = want[i].to_float();
    if (std::isnan(g) || std::fabs(g - w) > std::fabs(w) * 0x1p-7 + magnitude * 0x1p-16) ++bad;
  }
  return bad;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(output_cuda)

BOOST_AUTO_TEST_CASE(dense_layers_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(61);
  blas_handle blas;
  for (const auto& [m, n, k] : {std::tuple{1, 512, 5120}, std::tuple{37, 384, 1024}, std::tuple{300, 64, 256}}) {
    const auto x = random_bf16(std::size_t(m) * k, 1.0f, rng), w = random_bf16(std::size_t(n) * k, 0.05f, rng);
    device_buffer<bf16> dx{std::span<const bf16>(x)}, dw{std::span<const bf16>(w)}, dy(std::size_t(m) * n);
    dy.fill_bytes(0xFF);
    gemm::linear_bf16(blas.h, dx.data(), dw.data(), dy.data(), m, n, k);
    const auto xf = widen(x), wf = widen(w);
    device_buffer<float> fx{std::span<const float>(xf)}, fw{std::span<const float>(wf)}, fy(std::size_t(m) * n), hy(fy.size());
    fy.fill_bytes(0xFF);
    hy.fill_bytes(0xFF);
    gemm::linear_fp32(blas.h, fx.data(), fw.data(), fy.data(), m, n, k);
    gemm::linear_bf16_f32out(blas.h, dx.data(), dw.data(), hy.data(), m, n, k);  // the head's form of the same GEMM
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = dy.download();
    const auto yf = fy.download(), yh = hy.download();
    std::size_t bad16 = 0, bad32 = 0, bad_h = 0;
    for (int r = 0; r < m; ++r) {
      const auto xr = std::span<const float>(xf).subspan(std::size_t(r) * k, std::size_t(k));
      const auto want32 = linear::linear_fp32_reference(xr, wf, n);
      std::vector<bf16> got(y.begin() + std::ptrdiff_t(r) * n, y.begin() + std::ptrdiff_t(r + 1) * n);
      std::vector<bf16> want16(want32.size());
      for (std::size_t i = 0; i < want32.size(); ++i) want16[i] = bf16::from_float(want32[i]);
      bad16 += count_bad(got, want16, 0.05 * k);
      for (int c = 0; c < n; ++c) {
        const double g = yf[std::size_t(r) * n + c], w = want32[std::size_t(c)];
        // fp32 sums in a different order: a few ulp of the sum of magnitudes (about 0.05 k here)
        if (std::isnan(g) || std::fabs(g - w) > 1e-5 * 0.05 * k) ++bad32;
        const double h = yh[std::size_t(r) * n + c];
        if (std::isnan(h) || std::fabs(h - w) > 1e-5 * 0.05 * k) ++bad_h;
      }
    }
    BOOST_TEST(bad16 == 0u, "linear_bf16 M" << m << " N" << n << " K" << k);
    BOOST_TEST(bad32 == 0u, "linear_fp32 M" << m << " N" << n << " K" << k);
    BOOST_TEST(bad_h == 0u, "linear_bf16_f32out M" << m << " N" << n << " K" << k);
  }
  BOOST_TEST(test::throws_with([&] { gemm::linear_bf16_f32out(blas.h, nullptr, nullptr, nullptr, 1, 1, 1); }, "null pointer"));
  BOOST_TEST(test::throws_with([&] { gemm::linear_bf16(blas.h, nullptr, nullptr, nullptr, 1, 1, 1); }, "null pointer"));
  BOOST_TEST(test::throws_with([&] { gemm::linear_fp32(blas.h, nullptr, nullptr, nullptr, 1, 1, 0); }, "bad shape"));
}

// wo_a is the bf16 product of FP8 codes and 32 x 32 tile scales, as a checkpoint's is, so that it
// has an FP8 form (wo_a_fp8.hpp): each case runs the bf16 (cuBLAS) path and, given that form, the
// FP8 kernel at decode sizes (wo_a_fp8_max_tokens; above it the call keeps cuBLAS). The FP8
// kernel's wo_a output is also checked on its own against a double-precision sum.
BOOST_AUTO_TEST_CASE(attention_output_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(62);
  blas_handle blas;
  struct shape_case {
    output::output_shape s;
    int rope_dim;
    long long tokens;
  };
  for (const auto& c : {shape_case{{64, 512, 8, 1024, 5120}, 64, 2}, shape_case{{64, 512, 8, 1024, 5120}, 64, 13},
                        shape_case{{4, 128, 2, 64, 256}, 32, 70}, shape_case{{4, 128, 2, 64, 256}, 32, 3},
                        shape_case{{4, 128, 2, 64, 256}, 32, 16}}) {
    const auto& s = c.s;
    const rope::rope_params rp{c.rope_dim, 10000.0f};
    const auto freqs = rope::frequencies(rp);
    const std::size_t o_width = std::size_t(s.heads) * s.head_dim, k = std::size_t(s.groups) * s.o_lora;
    const int kg = s.group_width();
    const auto o = random_bf16(std::size_t(c.tokens) * o_width, 1.0f, rng);
    std::vector<bf16> wo_a(k * std::size_t(kg));
    {
      std::vector<std::uint8_t> a_scale((k / 32) * std::size_t(kg / 32));
      for (auto& v : a_scale) v = std::uint8_t(118 + rng() % 4);
      for (std::size_t r = 0; r < k; ++r)
        for (int j = 0; j < kg; ++j) {
          const auto code = std::uint8_t(rng() % 0x7E) | std::uint8_t(rng() % 2 ? 0x80 : 0);
          const float sc = numerics::decode<numerics::ue8m0>(a_scale[(r / 32) * std::size_t(kg / 32) + std::size_t(j / 32)]);
          wo_a[r * std::size_t(kg) + std::size_t(j)] = bf16::from_float(numerics::mul_rn(numerics::decode<numerics::e4m3>(code), sc));
        }
    }
    const auto wo_a_f = widen(wo_a);
    const auto f8 = output::exact_fp8_tiles(wo_a_f, int(k), kg);
    BOOST_TEST_REQUIRE(f8.has_value());
    std::vector<std::uint8_t> wo_b(std::size_t(s.dim) * k), wo_b_scale(std::size_t((s.dim + 31) / 32) * (k / 32));
    for (auto& v : wo_b) v = std::uint8_t(rng() % 0x7E) | std::uint8_t(rng() % 2 ? 0x80 : 0);
    for (auto& v : wo_b_scale) v = std::uint8_t(118 + rng() % 6);
    std::vector<std::int64_t> positions(std::size_t(c.tokens));
    for (auto& p : positions) p = std::int64_t(rng() % 100000);

    const auto tiles = gemm::tile_weight(gemm::weight_format::fp8_tile32, s.dim, int(k), wo_b, wo_b_scale);
    device_buffer<bf16> d_o(o.size()), d_wo_a{std::span<const bf16>(wo_a)}, d_out(std::size_t(c.tokens) * s.dim);
    device_buffer<std::uint8_t> d_wo_b{std::span<const std::uint8_t>(tiles.codes)}, d_wo_bs{std::span<const std::uint8_t>(tiles.scales)};
    device_buffer<std::uint8_t> d_a_codes{std::span<const std::uint8_t>(f8->codes)}, d_a_scales{std::span<const std::uint8_t>(f8->scales)};
    device_buffer<std::int64_t> d_pos{std::span<const std::int64_t>(positions)};
    device_buffer<float> d_freqs{std::span<const float>(freqs)};
    output::output_workspace ws(s, c.tokens);
    // bf16, then FP8 with batches of 6 (the default), 4 and 8 steps (output::set_wo_a_fp8_batch).
    for (const int mode : {0, 6, 4, 8}) {
      const bool fp8 = mode > 0;
      output::set_wo_a_fp8_batch(fp8 ? mode : 6);
      const bool takes_fp8 = fp8 && c.tokens <= output::wo_a_fp8_max_tokens;
      DSV4_CUDA_CHECK(cudaMemcpy(d_o.data(), o.data(), o.size() * sizeof(bf16), cudaMemcpyHostToDevice));  // un-rotated in place
      // cuBLAS writes wo_a's output with Hopper bulk (TMA) stores, which compute-sanitizer initcheck
      // does not see; clear the buffer so initcheck judges our kernels' reads, not that blind spot.
      // (The FP8 kernel's output is poisoned instead.)
      ws.mid.fill_bytes(takes_fp8 ? 0xFF : 0);
      d_out.fill_bytes(0xFF);
      const output::wo_a_fp8_weight f8w = fp8 ? output::wo_a_fp8_weight{d_a_codes.data(), d_a_scales.data()} : output::wo_a_fp8_weight{};
      output::attention_output(d_o.data(), d_pos.data(), c.tokens, d_freqs.data(), c.rope_dim, d_wo_a.data(), d_wo_b.data(),
                               d_wo_bs.data(), d_out.data(), ws, blas.h, nullptr, f8w);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = d_out.download();
      const auto rotated = d_o.download();  // the un-rotated o the projection read

      std::size_t bad = 0, exact = 0;
      for (long long t = 0; t < c.tokens; ++t) {
        const auto ot = std::span<const bf16>(o).subspan(std::size_t(t) * o_width, o_width);
        const auto want = output::attention_output_reference(s, ot, positions[std::size_t(t)], freqs, wo_a_f, wo_b, wo_b_scale);
        std::vector<bf16> g(got.begin() + std::ptrdiff_t(t) * s.dim, got.begin() + std::ptrdiff_t(t + 1) * s.dim);
        // A one-ulp difference in a bf16 intermediate (an fp32 sum order of wo_a's GEMM, cuBLAS's or
        // ours) can move one FP8 code of wo_b's input by one step (1/8 of that input), which shifts
        // every output of the token by up to 1/8 of one of its k terms; with k = 128 that is about
        // 2^-6.5 of the token's largest output (2^-8 failed 2 of 2 fresh seeds on 2026-11-30, old
        // and new code alike): allow 2^-5 of it on top of one ulp, and ask 3/4 of the outputs to
        // be bit-equal (a bug in our kernels makes nearly none bit-equal). One such flip changes
        // most of a token's outputs, so with two tokens the share moves in large steps with the
        // card's cuBLAS algorithm: H200 runs kept 90%; an H100 gave 8,677 / 10,234 / 9,724 of
        // 10,240 with three seeds (thirty-second session), every one within the tolerance.
        double mag = 0;
        for (const auto v : want) mag = std::max(mag, double(std::fabs(v.to_float())));
        bad += count_bad(g, want, mag * 2048);
        for (int i = 0; i < s.dim; ++i) exact += g[std::size_t(i)].bits == want[std::size_t(i)].bits;
      }
      BOOST_TEST_MESSAGE("attention output heads " << s.heads << " tokens " << c.tokens << (takes_fp8 ? " (FP8 wo_a)" : "")
                                                   << ": " << exact << " of " << got.size() << " bit-equal");
      BOOST_TEST(bad == 0u);
      BOOST_TEST(exact * 4 >= got.size() * 3, "fewer than 75% of the outputs are bit-equal to the host");
      if (!takes_fp8) continue;
      // wo_a's output on its own: within one bf16 ulp of the double-precision sum (plus 2^-20 of the
      // sum of magnitudes, for cancellation); NaN never passes.
      const auto mid = ws.mid.download();
      std::size_t mid_bad = 0, mid_exact = 0;
      for (long long t = 0; t < c.tokens; ++t)
        for (std::size_t r = 0; r < k; ++r) {
          const std::size_t grp = r / std::size_t(s.o_lora);
          double sum = 0, mag = 0;
          for (int j = 0; j < kg; ++j) {
            const double term = double(wo_a_f[r * std::size_t(kg) + std::size_t(j)]) *
                                rotated[std::size_t(t) * o_width + grp * std::size_t(kg) + std::size_t(j)].to_float();
            sum += term, mag += std::fabs(term);
          }
          const double want = bf16::from_float(float(sum)).to_float(), got_v = mid[std::size_t(t) * k + r].to_float();
          mid_exact += got_v == want;
          if (std::isnan(got_v) || std::fabs(got_v - want) > std::fabs(want) * 0x1p-7 + mag * 0x1p-20) ++mid_bad;
        }
      BOOST_TEST_MESSAGE("  FP8 wo_a output (batches of " << mode << " steps): " << mid_exact << " of "
                                                          << mid.size()
                                                          << " equal to the rounded double sum");
      BOOST_TEST(mid_bad == 0u);
    }
  }
  output::set_wo_a_fp8_batch(6);
  BOOST_TEST(test::throws_with([] { output::set_wo_a_fp8_batch(5); }, "4, 6 or 8 steps, not 5"));
}

// The FP8 wo_a kernel refuses what it cannot take (the caller keeps the bf16 path there).
BOOST_AUTO_TEST_CASE(wo_a_fp8_bad_arguments_are_errors) {
  alignas(16) static std::uint8_t codes[64] = {};
  alignas(16) static bf16 x[64] = {};
  output::wo_a_fp8_args a{x, codes, codes, x, 17, 1, 32, 64};
  BOOST_TEST(test::throws_with([&] { output::wo_a_fp8(a); }, "must lie in 0 .. 16"));
  a.tokens = 1, a.k = 96;
  BOOST_TEST(test::throws_with([&] { output::wo_a_fp8(a); }, "k of 64"));
  a.k = 64, a.codes = nullptr;
  BOOST_TEST(test::throws_with([&] { output::wo_a_fp8(a); }, "null pointer"));
}

BOOST_AUTO_TEST_SUITE_END()
