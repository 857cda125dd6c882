// CUDA block-scaled GEMMs (FP8 and FP4 weights) and RMSNorm against their host references, on
// fresh random codes and scales; outputs are poisoned with NaN before every launch.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/gemm/streamed_gemm.cuh"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/kernels/norm/rmsnorm.cuh"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/blas.hpp"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"
#include "support/wgmma.cuh"

namespace utf = boost::unit_test;
using namespace dsv4;
using kernels::gemm::gemm_shape;
using kernels::gemm::weight_format;
using numerics::bf16;
using runtime::device_buffer;

namespace {

//! Random operands in the real formats: E4M3 codes (never NaN), UE8M0 scales near 2^0.
struct gemm_operands {
  gemm_shape s;
  weight_format wf;
  std::vector<std::uint8_t> a, a_s, w, w_s;

  gemm_operands(gemm_shape shape, weight_format f, std::mt19937_64& rng) : s(shape), wf(f) {
    std::uniform_int_distribution<int> byte(0, 255), act_scale(118, 132), w_scale(112, 128);
    auto e4m3 = [&] {
      int c;
      do c = byte(rng);
      while ((c & 0x7F) == 0x7F);
      return std::uint8_t(c);
    };
    a.resize(std::size_t(s.m) * s.k);
    for (auto& v : a) v = e4m3();
    a_s.resize(std::size_t(s.m) * (s.k / 32));
    for (auto& v : a_s) v = std::uint8_t(act_scale(rng));
    if (wf == weight_format::fp8_tile32) {
      w.resize(std::size_t(s.n) * s.k);
      for (auto& v : w) v = e4m3();
      w_s.resize(std::size_t((s.n + 31) / 32) * (s.k / 32));
    } else {
      w.resize(std::size_t(s.n) * (s.k / 2));
      for (auto& v : w) v = std::uint8_t(byte(rng));
      w_s.resize(std::size_t(s.n) * (s.k / 32));
    }
    for (auto& v : w_s) v = std::uint8_t(w_scale(rng));
  }

  std::vector<bf16> reference(bool magnitudes = false) const {
    auto aa = a, ww = w;
    if (magnitudes) {  // the same products without signs: the scale of the sum, for the tolerance
      for (auto& v : aa) v &= 0x7F;
      for (auto& v : ww) v &= wf == weight_format::fp8_tile32 ? 0x7F : 0x77;
    }
    return wf == weight_format::fp8_tile32 ? kernels::gemm::fp8_gemm_reference(s, aa, a_s, ww, w_s)
                                           : kernels::gemm::fp4_gemm_reference(s, aa, a_s, ww, w_s);
  }

  //! The operands on the device (the weight in MMA tiles) and C [M, N] poisoned with NaN.
  struct on_device {
    device_buffer<std::uint8_t> a, a_s, w, w_s;
    device_buffer<bf16> c;
    kernels::gemm::block_scaled_gemm_args args() { return {shape, a.data(), a_s.data(), w.data(), w_s.data(), c.data()}; }
    std::vector<bf16> c_after_sync() {
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      return c.download();
    }
    gemm_shape shape;
  };
  on_device upload() const {
    const auto tiled = kernels::gemm::tile_weight(wf, s.n, s.k, w, w_s);
    on_device d{device_buffer<std::uint8_t>{std::span<const std::uint8_t>(a)},
                device_buffer<std::uint8_t>{std::span<const std::uint8_t>(a_s)},
                device_buffer<std::uint8_t>{std::span<const std::uint8_t>(tiled.codes)},
                device_buffer<std::uint8_t>{std::span<const std::uint8_t>(tiled.scales)},
                device_buffer<bf16>(std::size_t(s.m) * s.n), s};
    d.c.fill_bytes(0xFF);  // NaN everywhere: every output must be written
    return d;
  }

  //! `gemm` (one launch on the operands' args) twice; C of the second run, which must repeat the
  //! first bit for bit (a split's counters are reset by the GEMM).
  template <class Gemm>
  std::vector<bf16> twice(const char* what, Gemm gemm) const {
    auto d = upload();
    std::vector<bf16> runs[2];
    for (auto& run : runs) {
      d.c.fill_bytes(0xFF);
      gemm(d.args());
      run = d.c_after_sync();
    }
    std::size_t differ = 0;
    for (std::size_t i = 0; i < runs[0].size(); ++i) differ += runs[0][i].bits != runs[1][i].bits;
    BOOST_TEST(differ == 0u, "a second run of the same " << what << " changed " << differ << " outputs");
    return runs[1];
  }

  //! The mma.sync GEMM, split-K with a workspace, else unsplit.
  std::vector<bf16> device(bool with_workspace) const {
    std::unique_ptr<kernels::gemm::gemm_workspace> work;
    if (with_workspace)
      work = std::make_unique<kernels::gemm::gemm_workspace>(std::max<std::size_t>(1, kernels::gemm::gemm_partial_floats(s)));
    return twice("GEMM", [&](const auto& g) { kernels::gemm::block_scaled_gemm(g, wf, work.get()); });
  }

  //! The wgmma kernel (wgmma_gemm.cuh), split-K with a workspace, else unsplit.
  std::vector<bf16> device_wgmma(bool with_workspace) const {
    kernels::gemm::gemm_workspace work(std::size_t(std::max(1, s.k / 256)) * s.m * s.n);
    const unsigned long long calls = kernels::gemm::wgmma_gemm_calls();
    auto c = twice("wgmma GEMM", [&](const auto& g) { kernels::gemm::wgmma_gemm(g, wf, with_workspace ? &work : nullptr); });
    BOOST_TEST(kernels::gemm::wgmma_gemm_calls() == calls + 2);
    return c;
  }

  //! The folded kernel (folded_gemm.cuh, FP8 only), split-K with room for the partials, else
  //! unsplit (room for one float).
  std::vector<bf16> device_folded(bool split) const {
    kernels::gemm::gemm_workspace work(split ? std::max<std::size_t>(1, kernels::gemm::folded_partial_floats(s)) : 1, 0,
                                       kernels::gemm::folded_scratch_bytes(s));
    const unsigned long long calls = kernels::gemm::folded_gemm_calls();
    auto c = twice("folded GEMM", [&](const auto& g) { kernels::gemm::folded_gemm(g, work); });
    BOOST_TEST(kernels::gemm::folded_gemm_calls() == calls + 2);
    return c;
  }

  //! The folded kernel under forced plan options (bench_gemm --folded-plans times these plans).
  std::vector<bf16> device_folded_plan(int tokens, int slices) const {
    auto d = upload();
    kernels::gemm::gemm_workspace work(std::size_t(std::max(1, s.k / 32)) * s.m * s.n, 0,
                                       kernels::gemm::folded_scratch_bytes(s));
    const auto plan = kernels::gemm::detail::make_folded_plan(s, kernels::gemm::detail::sm_count(),
                                                              work.partial_floats(), {tokens, slices});
    BOOST_TEST(plan.tokens == tokens);
    BOOST_TEST(plan.slices == std::min(slices, s.k / 32));
    kernels::gemm::detail::launch_folded(d.args(), plan, work, nullptr);
    return d.c_after_sync();
  }

  //! The MMA kernel under a chosen plan (tokens per CTA 8 x token_tiles, split-K as make_plan
  //! decides for it): every instantiation make_plan can pick, whatever M picks by default.
  std::vector<bf16> device_plan(const kernels::gemm::detail::plan_options& o) const {
    auto d = upload();
    kernels::gemm::gemm_workspace work(std::size_t(std::max(1, s.k / 128)) * s.m * s.n);
    const auto plan =
        kernels::gemm::detail::make_plan(s, kernels::gemm::detail::sm_count(), work.partial_floats(), o);
    BOOST_TEST(plan.unroll == (o.unroll ? o.unroll : 4));
    kernels::gemm::detail::launch(wf, d.args(), plan, &work, nullptr);
    DSV4_CUDA_CHECK_LAUNCH();
    return d.c_after_sync();
  }

  //! The prefill path: dequantize both operands to bf16, cuBLAS GEMMs (one unless the workspace
  //! holds fewer than dequant_elems elements: passes).
  std::vector<bf16> device_dequant(std::size_t workspace_elems = 0) const {
    auto d = upload();
    kernels::gemm::gemm_workspace work(1, workspace_elems ? workspace_elems : kernels::gemm::dequant_elems(s));
    test::blas_handle blas;
    kernels::gemm::dequant_gemm(d.args(), wf, work, blas.h);
    return d.c_after_sync();
  }
};

//! Device vs host: the fp32 sums differ in order (inside a block: the tensor core's, as in the
//! official kernel; across blocks: split-K or cuBLAS), so allow one bf16 ulp of the result (a
//! rounding boundary crossed) plus 2^-16 of the sum of magnitudes (cancellation). The worst
//! error over the tolerance is printed.
//! `mag_tol` and `min_exact` are wider for wgmma (see its test case).
void expect_close(const std::vector<bf16>& got, const std::vector<bf16>& want, const std::vector<bf16>& mag,
                  const char* what, double mag_tol = 0x1p-16, double min_exact = 0.9) {
  BOOST_REQUIRE_EQUAL(got.size(), want.size());
  std::size_t nan = 0, bad = 0, exact = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i].to_float(), w = want[i].to_float(), m = mag[i].to_float();
    if (std::isnan(g)) {
      ++nan;
      continue;
    }
    const double err = std::fabs(g - w), tol = std::fabs(w) * 0x1p-7 + m * mag_tol;
    worst = std::max(worst, err / std::max(tol, 1e-30));
    bad += err > tol;
    exact += g == w;
  }
  BOOST_TEST_MESSAGE(what << ": " << exact << " of " << got.size() << " bit-equal, worst error / tolerance " << worst);
  BOOST_TEST(nan == 0u, what << ": " << nan << " NaN outputs");
  BOOST_TEST(bad == 0u, what << ": " << bad << " outputs out of tolerance");
  BOOST_TEST(double(exact) >= min_exact * double(got.size()),
             what << ": fewer than " << 100 * min_exact << "% of the outputs are bit-equal to the host");
}

//! The few-token GEMMs on wgmma for a scope, mma.sync again after it (also on an exception).
struct use_wgmma {
  use_wgmma() { kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::wgmma); }
  ~use_wgmma() { kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::mma_sync); }
};

void check_shape(gemm_shape s, weight_format wf, std::uint64_t salt) {
  auto rng = test::make_rng(salt);
  const gemm_operands op(s, wf, rng);
  const auto want = op.reference(), mag = op.reference(true);
  const std::string name = std::string(wf == weight_format::fp8_tile32 ? "fp8" : "fp4") + " M" +
                           std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k);
  expect_close(op.device(true), want, mag, (name + " split-K").c_str());
  expect_close(op.device(false), want, mag, (name + " one slice").c_str());
  expect_close(op.device_dequant(), want, mag, (name + " dequantize + cuBLAS").c_str());
}

}  // namespace

BOOST_AUTO_TEST_SUITE(gemm_cuda)

// make_plan picks 8 tokens per CTA up to 128 tokens (bench_gemm --plans); the other tile heights
// stay selectable (plan_options) and each must compute the same GEMM. So must the stages of 6 and 8 K
// blocks (one token tile) and other split targets (bench_gemm --decode-plans), at a decode shape
// (one token, several slices with a partial last stage) and at 37 tokens.
BOOST_AUTO_TEST_CASE(every_plan_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  using kernels::gemm::detail::plan_options;
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32}) {
    const char* fmt = wf == weight_format::fp8_tile32 ? "fp8" : "fp4";
    auto rng = test::make_rng(wf == weight_format::fp8_tile32 ? 21 : 22);
    const gemm_operands op({37, 272, 1024}, wf, rng);
    const auto want = op.reference(), mag = op.reference(true);
    for (int tt : {1, 2, 4, 8})
      expect_close(
          op.device_plan({tt}), want, mag,
          (fmt + std::string(" M37 N272 K1024, ") + std::to_string(8 * tt) + " tokens per CTA").c_str());
    expect_close(op.device_plan({1, 64, 8}), want, mag,
                 (fmt + std::string(" M37 N272 K1024, 8 K blocks a stage")).c_str());
    const gemm_operands one({1, 1040, 2336}, wf, rng);  // 73 K blocks: slices end in partial stages
    const auto want1 = one.reference(), mag1 = one.reference(true);
    for (int unroll : {4, 6, 8})
      for (int ctas : {1, 3, 6})
        expect_close(one.device_plan({1, 64, unroll, ctas}), want1, mag1,
                     (fmt + std::string(" M1 N1040 K2336, ") + std::to_string(unroll) +
                      " K blocks a stage, split for " + std::to_string(ctas) + " CTAs an SM")
                         .c_str());
  }
  BOOST_CHECK_THROW(kernels::gemm::detail::make_plan({16, 64, 64}, 132, 0, {2, 64, 8}), dsv4::error);
  BOOST_CHECK_THROW(kernels::gemm::detail::make_plan({1, 64, 64}, 132, 0, {1, 64, 5}), dsv4::error);
  BOOST_CHECK_THROW(kernels::gemm::detail::make_plan({1, 64, 64}, 132, 0, {1, 64, 4, 17}), dsv4::error);
}

// Decode plans (up to 8 tokens) follow bench_gemm --decode-plans: K split for two CTAs an SM, 6-block
// stages, 8 where K is not split; from 9 tokens the old plans (three an SM, 4-block stages). The
// caller's options win. (Host only: the plan is arithmetic on the shape and the SM count.)
BOOST_AUTO_TEST_CASE(decode_plans_follow_the_sweep) {
  using kernels::gemm::detail::make_plan;
  constexpr int sms = 132;
  constexpr std::size_t room = std::size_t(1) << 30;
  const auto wo_b = make_plan({1, 5120, 8192}, sms, room);  // 80 row groups
  BOOST_TEST(wo_b.unroll == 6);
  BOOST_TEST(wo_b.slices == 4);  // 320 CTAs for 264 places, one wave (three an SM: 400 for 396)
  const auto wq_b = make_plan({1, 32768, 1280}, sms, room);  // 512 row groups: never split
  BOOST_TEST(wq_b.slices == 1);
  BOOST_TEST(wq_b.unroll == 8);
  const auto wq_a = make_plan({8, 1280, 5120}, sms, room);  // 20 row groups
  BOOST_TEST(wq_a.unroll == 6);
  BOOST_TEST(wq_a.slices == 14);
  BOOST_TEST(wq_a.row_groups * wq_a.slices <= 2u * sms + wq_a.row_groups);
  const auto nine = make_plan({9, 5120, 8192}, sms, room);  // two token groups: 160 tiles, three an SM
  BOOST_TEST(nine.unroll == 4);
  BOOST_TEST(nine.slices == 3);
  BOOST_TEST(make_plan({200, 5120, 8192}, sms, room).unroll == 4);
  const auto forced = make_plan({1, 5120, 8192}, sms, room, {1, 64, 4, 3});
  BOOST_TEST(forced.unroll == 4);
  BOOST_TEST(forced.slices == 5);  // the old plan
  BOOST_TEST(make_plan({1, 5120, 8192}, sms, 0).unroll == 8);  // no workspace: unsplit
}

BOOST_AUTO_TEST_CASE(fp8_weights_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  // Decode shapes (1..64 tokens, each token-tile variant), ragged N and M, and a prefill-like M
  // that takes the 32-row x 64-token tiles.
  check_shape({1, 512, 5120}, weight_format::fp8_tile32, 1);
  check_shape({3, 100, 96}, weight_format::fp8_tile32, 2);
  check_shape({13, 1280, 1024}, weight_format::fp8_tile32, 3);
  check_shape({29, 272, 2048}, weight_format::fp8_tile32, 4);
  check_shape({64, 520, 1280}, weight_format::fp8_tile32, 5);
  check_shape({197, 300, 512}, weight_format::fp8_tile32, 6);
}

BOOST_AUTO_TEST_CASE(fp4_weights_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_shape({1, 2304, 5120}, weight_format::fp4_row32, 11);
  check_shape({5, 72, 160}, weight_format::fp4_row32, 12);
  check_shape({16, 1040, 2304}, weight_format::fp4_row32, 13);
  check_shape({40, 256, 1024}, weight_format::fp4_row32, 14);
  check_shape({150, 330, 768}, weight_format::fp4_row32, 15);
}

// Two GEMMs of one input in one launch (block_scaled_gemm_pair: the shared expert's w1 and w3;
// the attention's wq_a and wkv, N2 other than N): each matches the host, split K (the two GEMMs'
// partials and counters apart) and unsplit, and a second run repeats the first bit for bit (the
// counters reset). (Not bit-equal to each GEMM run alone: the pair's plan splits K for both
// weights' rows.)
void check_pair(gemm_shape s, weight_format wf, std::size_t partial_floats, std::uint64_t salt, int n2 = 0) {
  auto rng = test::make_rng(salt);
  const gemm_operands op1(s, wf, rng);
  gemm_operands op2({s.m, n2 ? n2 : s.n, s.k}, wf, rng);  // other weights (and N) ...
  op2.a = op1.a, op2.a_s = op1.a_s;                         // ... on the same activations
  const auto want1 = op1.reference(), mag1 = op1.reference(true), want2 = op2.reference(), mag2 = op2.reference(true);
  auto d1 = op1.upload(), d2 = op2.upload();
  auto g2 = d2.args();
  g2.a = d1.a.data(), g2.a_s = d1.a_s.data();  // one input, as the pair requires
  kernels::gemm::gemm_workspace work(partial_floats);
  std::vector<bf16> first[2], second[2];
  for (int run = 0; run < 2; ++run) {
    d1.c.fill_bytes(0xFF), d2.c.fill_bytes(0xFF);
    kernels::gemm::block_scaled_gemm_pair(d1.args(), g2, wf, &work);
    first[run] = d1.c_after_sync(), second[run] = d2.c_after_sync();
  }
  const std::string name = std::string(wf == weight_format::fp8_tile32 ? "fp8" : "fp4") + " pair M" +
                           std::to_string(s.m) + " N" + std::to_string(s.n) + " / " + std::to_string(op2.s.n) +
                           " K" + std::to_string(s.k) + " partials " + std::to_string(partial_floats);
  expect_close(first[1], want1, mag1, (name + ", first").c_str());
  expect_close(second[1], want2, mag2, (name + ", second").c_str());
  std::size_t differ = 0;  // (the two outputs' sizes differ where N does)
  for (std::size_t i = 0; i < first[0].size(); ++i) differ += first[0][i].bits != first[1][i].bits;
  for (std::size_t i = 0; i < second[0].size(); ++i) differ += second[0][i].bits != second[1][i].bits;
  BOOST_TEST(differ == 0u, name << ": a second run changed " << differ << " outputs");
}

BOOST_AUTO_TEST_CASE(gemm_pairs_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const std::size_t roomy = std::size_t(1) << 20;
  check_pair({1, 2304, 5120}, weight_format::fp8_tile32, roomy, 31);  // the shared expert at one token
  check_pair({7, 272, 1024}, weight_format::fp8_tile32, roomy, 32);   // ragged N (not a multiple of 64)
  check_pair({40, 520, 2048}, weight_format::fp4_row32, roomy, 33);
  check_pair({3, 300, 768}, weight_format::fp8_tile32, 1, 34);         // no room for partials: unsplit
  check_pair({70, 128, 512}, weight_format::fp4_row32, roomy, 35);     // 8-token groups side by side
  // Two widths (the attention's wq_a and wkv at V4.1 width: 1280 and 512 of 5120), split and not.
  check_pair({1, 1280, 5120}, weight_format::fp8_tile32, roomy, 36, 512);
  check_pair({24, 1280, 5120}, weight_format::fp8_tile32, roomy, 37, 512);
  check_pair({5, 72, 1024}, weight_format::fp8_tile32, roomy, 38, 200);  // ragged both
  check_pair({9, 200, 768}, weight_format::fp8_tile32, 1, 39, 72);       // unsplit
  check_pair({3, 64, 512}, weight_format::fp4_row32, roomy, 40, 528);     // the second wider
}

BOOST_AUTO_TEST_CASE(exact_products_are_exact, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  // Activations +-0.5 / +-1 times E2M1 weights: every partial sum is a multiple of 0.25 below
  // 2^15, so nothing rounds before the bf16 output (not even in the tensor core's reduced-precision
  // FP8 accumulation): the device must equal the host bit for bit, whatever the summation order.
  auto rng = test::make_rng(21);
  gemm_operands op({33, 96, 4096}, weight_format::fp4_row32, rng);
  for (auto& v : op.a) v = std::uint8_t((v & 0x88) | 0x30);  // +-0.5 and +-1: block sums need 10 bits
  for (auto& v : op.a_s) v = 127;
  for (auto& v : op.w_s) v = 127;
  const auto want = op.reference(), got = op.device(true);
  std::size_t diff = 0;
  const auto got_dq = op.device_dequant(), got_wgmma = op.device_wgmma(true);
  for (std::size_t i = 0; i < got.size(); ++i)
    diff += (got[i].bits != want[i].bits) + (got_dq[i].bits != want[i].bits) + (got_wgmma[i].bits != want[i].bits);
  BOOST_TEST(diff == 0u);
}

// The wgmma kernel at every width (8, 16, 32, 64 tokens per CTA, two token groups of 64), FP8
// and FP4, split and unsplit. Its FP8 products accumulate inside the tensor core at reduced
// precision (DeepSeek-V3's report: about 14 bits on Hopper; the 32 products of one block only,
// each block promoted to fp32 as the reference does): 32 products each cut at ~2^-14 of the
// block's largest can move a block's sum by up to 2^-9 of its magnitudes, so that is the bound on
// cancellation instead of 2^-16 (a wrong layout errs by O(1)), and half the outputs (not 90%)
// must be bit-equal.
// Calibrate both from the printed worst / exact counts on the first device run.
BOOST_AUTO_TEST_CASE(wgmma_matches_host, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const gemm_shape shapes[] = {{1, 512, 5120}, {5, 72, 160}, {13, 1280, 1024}, {29, 272, 2048}, {37, 300, 512},
                               {64, 520, 1280}, {100, 136, 768}};
  std::uint64_t salt = 60;
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    for (const auto& s : shapes) {
      auto rng = test::make_rng(salt++);
      const gemm_operands op(s, wf, rng);
      const auto want = op.reference(), mag = op.reference(true);
      const std::string name = std::string(wf == weight_format::fp8_tile32 ? "wgmma fp8" : "wgmma fp4") + " M" +
                               std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k);
      expect_close(op.device_wgmma(true), want, mag, (name + " split-K").c_str(), 0x1p-9, 0.5);
      expect_close(op.device_wgmma(false), want, mag, (name + " one slice").c_str(), 0x1p-9, 0.5);
    }
}

// The folded kernel (FP8 weights, block scales folded into bf16 operands) at each width (16, 32,
// 64, 128 tokens per CTA, several token groups), ragged N, M and K (odd block counts: a last batch
// half past the slice), split and unsplit. Its products are exact and its sums fp32 in the tensor
// core's order: the dequantize + cuBLAS path's tolerance.
BOOST_AUTO_TEST_CASE(folded_matches_host, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const gemm_shape shapes[] = {{16, 512, 5120}, {17, 72, 160}, {32, 1280, 1024}, {45, 272, 2048}, {64, 520, 1280},
                               {100, 136, 800}, {128, 256, 96}, {200, 300, 512}, {256, 128, 1024}, {300, 96, 352}};
  std::uint64_t salt = 80;
  for (const auto& s : shapes) {
    auto rng = test::make_rng(salt++);
    const gemm_operands op(s, weight_format::fp8_tile32, rng);
    const auto want = op.reference(), mag = op.reference(true);
    const std::string name =
        "folded M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k);
    expect_close(op.device_folded(true), want, mag, (name + " split-K").c_str());
    expect_close(op.device_folded(false), want, mag, (name + " one slice").c_str());
  }
}

// The folded kernel under forced plans (the plans bench_gemm --folded-plans times): every width up
// to the one M takes, one slice to a slice per K block (slices that end past K, a last CTA adding
// up to 40 partials).
BOOST_AUTO_TEST_CASE(folded_forced_plans_match_host, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const gemm_shape shapes[] = {{40, 200, 1280}, {128, 136, 416}};
  std::uint64_t salt = 120;
  for (const auto& s : shapes) {
    auto rng = test::make_rng(salt++);
    const gemm_operands op(s, weight_format::fp8_tile32, rng);
    const auto want = op.reference(), mag = op.reference(true);
    for (const int tokens : {16, 32, 64, 128}) {
      if (tokens > kernels::gemm::detail::folded_first_tokens(s.m)) continue;
      for (const int slices : {1, 3, 7, 40}) {
        const std::string name = "folded M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" +
                                 std::to_string(s.k) + ", " + std::to_string(tokens) + " tokens a CTA, " +
                                 std::to_string(slices) + " slices";
        expect_close(op.device_folded_plan(tokens, slices), want, mag, name.c_str());
      }
    }
  }
}

// Scale codes above 134 (whose bf16 multiplier 2^(s - 7) would overflow: two multiplies) and far
// below 127, on both operands, and E4M3 subnormals and zeros of both signs: still exact products.
BOOST_AUTO_TEST_CASE(folded_exact_at_extreme_scales, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  for (const bool big_weights : {false, true}) {
    auto rng = test::make_rng(big_weights ? 91 : 90);
    gemm_operands op({40, 200, 640}, weight_format::fp8_tile32, rng);
    std::uniform_int_distribution<int> hi(135, 170), lo(60, 100), tiny(0, 15);
    for (auto& v : op.a_s) v = std::uint8_t(big_weights ? lo(rng) : hi(rng));
    for (auto& v : op.w_s) v = std::uint8_t(big_weights ? hi(rng) : lo(rng));
    for (std::size_t i = 0; i < op.a.size(); i += 7) op.a[i] = std::uint8_t((op.a[i] & 0x80) | tiny(rng) % 8);
    for (std::size_t i = 0; i < op.w.size(); i += 5) op.w[i] = std::uint8_t((op.w[i] & 0x80) | tiny(rng) % 8);
    const auto want = op.reference(), mag = op.reference(true);
    expect_close(op.device_folded(true), want, mag, big_weights ? "folded, weight scales 2^8 .. 2^43" : "folded, activation scales 2^8 .. 2^43");
  }
}

// The decoded activations a plan writes (its token groups x tokens per CTA) fit
// folded_scratch_bytes whatever the plan depends on: the SMs and the workspace's partials (a split
// lets the plan keep more tokens per CTA). Host only: the plan is host code. (Until this case
// the scratch was sized by the plan without partials, which could take fewer tokens per CTA than
// the launch: M 40, N 2304, K 5120 was sized for 48 rows where the launch wrote 64.)
BOOST_AUTO_TEST_CASE(folded_scratch_covers_every_plan) {
  namespace g = kernels::gemm;
  long long checked = 0;
  for (const int sms : {78, 114, 132})
    for (const int n : {72, 512, 1280, 2304, 5120, 32768})
      for (const int k : {96, 1280, 5120, 8192})
        for (int m = 1; m <= 300; m += (m < 70 ? 1 : 7))
          for (const std::size_t partials : {std::size_t(0), std::size_t(1) << 20, ~std::size_t(0) / 8}) {
            const g::gemm_shape s{m, n, k};
            const auto p = g::detail::make_folded_plan(s, sms, partials);
            const std::size_t rows = std::size_t(p.token_groups) * std::size_t(p.tokens);
            if (rows * std::size_t(k) * 2 > g::folded_scratch_bytes(s) || rows < std::size_t(m)) {
              BOOST_ERROR("M " << m << " N " << n << " K " << k << " SMs " << sms << " partials " << partials
                               << ": a plan of " << p.token_groups << " x " << p.tokens << " tokens against "
                               << g::folded_scratch_bytes(s) << " bytes");
              return;
            }
            ++checked;
          }
  BOOST_TEST(checked > 20000);
}

// make_folded_plan's options (bench_gemm's sweep): the tokens and slices asked for, slices capped at
// one per K block and by the workspace's partials; widths past the tokens' first width refused.
BOOST_AUTO_TEST_CASE(folded_plan_options_are_honoured) {
  namespace g = kernels::gemm;
  const g::gemm_shape s{64, 32768, 1280};
  const auto p = g::detail::make_folded_plan(s, 132, ~std::size_t(0) / 8, {32, 3});
  BOOST_TEST(p.tokens == 32);
  BOOST_TEST(p.token_groups == 2u);
  BOOST_TEST(p.slices == 3);
  BOOST_TEST(p.kbps == 14);
  BOOST_TEST(g::detail::make_folded_plan(s, 132, ~std::size_t(0) / 8, {64, 100}).slices == 40);
  BOOST_TEST(g::detail::make_folded_plan(s, 132, std::size_t(2) * 64 * 32768, {64, 6}).slices == 2);
  BOOST_TEST(g::detail::make_folded_plan(s, 132, ~std::size_t(0) / 8, {64, 1}).slices == 1);
  BOOST_CHECK_THROW(g::detail::make_folded_plan(s, 132, 0, {128, 0}), dsv4::error);
  BOOST_CHECK_THROW(g::detail::make_folded_plan(s, 132, 0, {48, 0}), dsv4::error);
  BOOST_CHECK_THROW(g::detail::make_folded_plan(s, 132, 0, {0, -1}), dsv4::error);
}

// make_folded_plan's defaults on the V4.1 shapes it folds are the sweep's fastest plans
// (bench_gemm --folded-plans on an H100, 132 SMs, thirty-seventh session): wq_b unsplit at its
// first width, wo_b 32 x 4, 64 x 4 and 64 x 2 (tokens x slices) at 32, 64 and 128 tokens.
BOOST_AUTO_TEST_CASE(folded_plans_follow_the_sweep) {
  namespace g = kernels::gemm;
  const std::size_t roomy = ~std::size_t(0) / 8;
  auto plan = [&](int m, int n, int k) { return g::detail::make_folded_plan({m, n, k}, 132, roomy); };
  for (const int m : {16, 32, 64, 128}) {
    const auto p = plan(m, 32768, 1280);
    BOOST_TEST(p.tokens == m, "wq_b at " << m);
    BOOST_TEST(p.slices == 1, "wq_b at " << m);
  }
  const int want[][3] = {{32, 32, 4}, {64, 64, 4}, {128, 64, 2}};
  for (const auto& [m, tokens, slices] : want) {
    const auto p = plan(m, 5120, 8192);
    BOOST_TEST(p.tokens == tokens, "wo_b at " << m);
    BOOST_TEST(p.slices == slices, "wo_b at " << m);
  }
}

// The shapes block_scaled_linear folds (host: the rule only): folded_min_tokens ..
// folded_max_tokens tokens for folded_min_rows outputs and more, up to folded_large_max_tokens for
// weights of folded_min_elements; V4.1's wq_b and wo_b in, its other FP8 linears out.
BOOST_AUTO_TEST_CASE(folded_shapes_follow_the_measured_range) {
  namespace g = kernels::gemm;
  const auto folds = [](int m, int n, int k) { return g::folded_shape({m, n, k}); };
  for (const int m : {1, 8, 15, 257, 4096}) BOOST_TEST(!folds(m, 32768, 1280), "wq_b at " << m);
  for (const int m : {16, 32, 64, 100, 128, 256}) BOOST_TEST(folds(m, 32768, 1280), "wq_b at " << m);
  for (const int m : {1, 15, 129, 256}) BOOST_TEST(!folds(m, 5120, 8192), "wo_b at " << m);
  for (const int m : {16, 32, 48, 64, 128}) BOOST_TEST(folds(m, 5120, 8192), "wo_b at " << m);
  for (const auto& [n, k] : std::initializer_list<std::pair<int, int>>{
           {1280, 5120}, {512, 5120}, {4096, 1280}, {2304, 5120}, {5120, 2304}})
    for (const int m : {16, 32, 64, 128}) BOOST_TEST(!folds(m, n, k), "N " << n << " K " << k << " at " << m);
  BOOST_TEST(folds(64, 4096, 8192));   // exactly folded_min_elements
  BOOST_TEST(!folds(64, 4096, 8160));  // one K block short
}

// block_scaled_linear gives FP8 GEMMs of the shapes folded_shape takes to the folded kernel (also
// with a cuBLAS handle and dequantize scratch at hand), not fewer or more tokens, narrower or
// smaller weights, FP4 weights, or with set_folded_linears(false).
BOOST_AUTO_TEST_CASE(folded_path_routes_the_linear_layer, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  namespace g = kernels::gemm;
  test::blas_handle blas;
  std::uint64_t salt = 95;
  struct scope_off {
    scope_off() { g::set_folded_linears(false); }
    ~scope_off() { g::set_folded_linears(true); }
  };
  auto check = [&](int m, int n, weight_format wf, bool off, int k = 256) {
    auto rng = test::make_rng(salt++);
    const gemm_operands op({m, n, k}, wf, rng);
    auto d = op.upload();
    g::gemm_workspace work(std::size_t(1) << 22, g::dequant_elems(op.s), g::folded_bytes_for(m, k));
    const unsigned long long before = g::folded_gemm_calls();
    {
      std::optional<scope_off> scope;
      if (off) scope.emplace();
      g::block_scaled_linear(d.args(), wf, &work, blas.h);
    }
    const bool folded = !off && wf == weight_format::fp8_tile32 && g::folded_shape(op.s);
    const std::string name = std::string(wf == weight_format::fp8_tile32 ? "fp8" : "fp4") + " linear M" +
                             std::to_string(m) + " N" + std::to_string(n) + (off ? ", folding off" : "");
    BOOST_TEST(g::folded_gemm_calls() == before + (folded ? 1u : 0u), name);
    expect_close(d.c_after_sync(), op.reference(), op.reference(true), name.c_str());
  };
  for (const int m :
       {g::folded_min_tokens - 1, g::folded_min_tokens, 100, g::folded_max_tokens, g::folded_max_tokens + 1})
    check(m, g::folded_min_rows, weight_format::fp8_tile32, false);
  check(64, g::folded_min_rows - 64, weight_format::fp8_tile32, false);  // too narrow
  check(64, g::folded_min_rows, weight_format::fp4_row32, false);
  check(64, g::folded_min_rows, weight_format::fp8_tile32, true);
  check(40, 4096, weight_format::fp8_tile32, false, 8192);  // a large weight (folded_min_elements), K split
  check(g::folded_large_max_tokens, 4096, weight_format::fp8_tile32, false, 8192);
  check(g::folded_large_max_tokens + 1, 4096, weight_format::fp8_tile32, false, 8192);  // past its range
  // Without room for the folded activations the linear layer takes another path; folded_gemm
  // itself refuses, naming the sizes.
  auto rng = test::make_rng(99);
  const gemm_operands op({40, g::folded_min_rows, 256}, weight_format::fp8_tile32, rng);
  auto d = op.upload();
  g::gemm_workspace small(std::size_t(1) << 20, 0, g::folded_scratch_bytes(op.s) - 1);
  const unsigned long long before = g::folded_gemm_calls();
  g::block_scaled_linear(d.args(), op.wf, &small, blas.h);
  BOOST_TEST(g::folded_gemm_calls() == before);
  expect_close(d.c_after_sync(), op.reference(), op.reference(true), "fp8 linear M40, no room to fold");
  BOOST_TEST(test::throws_with([&] { g::folded_gemm(d.args(), small); }, "bytes of folded activations"));
}

// The grouped form (the MoE's experts) directly, on its three kernels (per-tile mma.sync, streamed,
// wgmma): a tile list over `groups_n` groups' weights with ragged tiles, C rows reading A rows
// through a_row_index, a pair (a second weight set and output in the same launch) and more
// CTAs than tiles (max_tiles > the tile count), each run twice (the same bits again).
struct grouped_tile {
  int group, row0, rows;
};
//! `device_count` (default: the tiles' count) is the tile count the kernels read; above max_tiles
//! they must clamp it.
void check_grouped(weight_format wf, int K, int N, int groups_n, int a_rows,
                   const std::vector<grouped_tile>& tiles, int max_tiles, std::uint64_t salt,
                   int device_count = -1) {
  const bool fp8 = wf == weight_format::fp8_tile32;
  int M = 0;
  for (const auto& t : tiles) M = std::max(M, t.row0 + t.rows);
  auto rng = test::make_rng(salt);
  const gemm_operands acts({a_rows, 32, K}, wf, rng);  // its a / a_s: the rows of activations
  std::vector<int> a_row_index(std::size_t(M), 0);
  for (auto& r : a_row_index) r = int(rng() % a_rows);
  // weights[pair][group]
  std::vector<std::vector<gemm_operands>> weights(2);
  std::vector<std::uint8_t> codes[2], scales[2];
  std::size_t code_stride = 0, scale_stride = 0;
  for (int pair = 0; pair < 2; ++pair)
    for (int gi = 0; gi < groups_n; ++gi) {
      weights[pair].emplace_back(gemm_shape{1, N, K}, wf, rng);
      const auto& w = weights[pair].back();
      const auto t = kernels::gemm::tile_weight(wf, N, K, w.w, w.w_s);
      code_stride = t.codes.size(), scale_stride = t.scales.size();
      codes[pair].insert(codes[pair].end(), t.codes.begin(), t.codes.end());
      scales[pair].insert(scales[pair].end(), t.scales.begin(), t.scales.end());
    }
  // Host: each C row of a tile is one row of A times its tile's group weight; rows in no tile are
  // never written (they stay NaN on both sides and are not compared).
  std::vector<bf16> want[2], mag[2];
  std::vector<std::size_t> covered;  // C elements the tiles write
  for (const auto& t : tiles)
    for (int r = t.row0; r < t.row0 + t.rows; ++r)
      for (int n = 0; n < N; ++n) covered.push_back(std::size_t(r) * N + n);
  for (int pair = 0; pair < 2; ++pair)
    for (const auto& t : tiles)
      for (int r = t.row0; r < t.row0 + t.rows; ++r) {
        gemm_operands row = weights[pair][std::size_t(t.group)];
        row.s = {1, N, K};
        const std::size_t ar = std::size_t(a_row_index[std::size_t(r)]);
        row.a.assign(acts.a.begin() + ar * K, acts.a.begin() + (ar + 1) * K);
        row.a_s.assign(acts.a_s.begin() + ar * (K / 32), acts.a_s.begin() + (ar + 1) * (K / 32));
        const auto v = row.reference(), m = row.reference(true);
        want[pair].insert(want[pair].end(), v.begin(), v.end());
        mag[pair].insert(mag[pair].end(), m.begin(), m.end());
      }
  std::vector<int> tile_group, tile_row0, tile_rows;
  for (const auto& t : tiles)
    tile_group.push_back(t.group), tile_row0.push_back(t.row0), tile_rows.push_back(t.rows);
  for (std::size_t pad = tiles.size(); pad < std::size_t(max_tiles); ++pad)  // past tile_count
    tile_group.push_back(-1), tile_row0.push_back(-1), tile_rows.push_back(-1);
  const int count = device_count >= 0 ? device_count : int(tiles.size());
  int largest = 0;
  for (const auto& t : tiles) largest = std::max(largest, t.rows);
  const int token_tiles = largest > 16 ? 4 : largest > 8 ? 2 : 1;
  device_buffer<int> d_group{std::span<const int>(tile_group)}, d_row0{std::span<const int>(tile_row0)},
      d_rows{std::span<const int>(tile_rows)}, d_count{std::span<const int>(&count, 1)},
      d_index{std::span<const int>(a_row_index)};
  device_buffer<std::uint8_t> da{std::span<const std::uint8_t>(acts.a)},
      das{std::span<const std::uint8_t>(acts.a_s)}, dw0{std::span<const std::uint8_t>(codes[0])},
      dws0{std::span<const std::uint8_t>(scales[0])}, dw1{std::span<const std::uint8_t>(codes[1])},
      dws1{std::span<const std::uint8_t>(scales[1])};
  device_buffer<bf16> dc0(std::size_t(M) * N), dc1(std::size_t(M) * N);
  const kernels::gemm::gemm_groups groups{d_group.data(),         d_row0.data(),  d_rows.data(),
                                          d_count.data(),         d_index.data(), (long long)code_stride,
                                          (long long)scale_stride};
  const kernels::gemm::block_scaled_gemm_args g0{{M, N, K},  da.data(),   das.data(),
                                                 dw0.data(), dws0.data(), dc0.data()},
      g1{{M, N, K}, da.data(), das.data(), dw1.data(), dws1.data(), dc1.data()};
  // A's codes as f16 (block_scaled_gemm_args::a_f16): the streamed FP4 kernel's second run reads
  // them instead of the codes, and must give the same bits.
  std::vector<std::uint16_t> a16(acts.a.size());
  for (std::size_t i = 0; i < a16.size(); ++i) a16[i] = numerics::e4m3_code_as_f16(acts.a[i]);
  device_buffer<std::uint16_t> da16{std::span<const std::uint16_t>(a16)};
  kernels::gemm::block_scaled_gemm_args g0_16 = g0, g1_16 = g1;
  g0_16.a_f16 = g1_16.a_f16 = da16.data();
  const std::string shape =
      " K" + std::to_string(K) + " N" + std::to_string(N) + " " + std::to_string(count) + " tiles";
  for (const char* kernel : {"per-tile mma.sync", "streamed", "wgmma"}) {
    const std::string k = kernel;
    if (k == "streamed" &&
        !kernels::gemm::streamed_grouped_gemm_unfit(g0, groups, wf, token_tiles, &g1).empty()) {
      BOOST_TEST_MESSAGE("streamed grouped GEMM skipped: " << kernels::gemm::streamed_grouped_gemm_unfit(
                             g0, groups, wf, token_tiles, &g1));
      continue;
    }
    std::vector<bf16> runs[2][2];
    const bool with_f16 = k == "streamed" && !fp8;
    for (int r = 0; r < 2; ++r) {
      auto& run = runs[r];
      dc0.fill_bytes(0xFF), dc1.fill_bytes(0xFF);  // NaN: every covered output must be written
      if (k == "wgmma")
        kernels::gemm::grouped_wgmma_gemm(g0, groups, wf, max_tiles, token_tiles, nullptr, &g1);
      else if (k == "streamed" && with_f16 && r == 1)
        kernels::gemm::streamed_grouped_gemm(g0_16, groups, wf, max_tiles, token_tiles, nullptr, &g1_16);
      else if (k == "streamed")
        kernels::gemm::streamed_grouped_gemm(g0, groups, wf, max_tiles, token_tiles, nullptr, &g1);
      else
        kernels::gemm::grouped_block_scaled_gemm(g0, groups, wf, max_tiles, token_tiles, nullptr, &g1);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const auto c0 = dc0.download(), c1 = dc1.download();
      for (const std::size_t at : covered) run[0].push_back(c0[at]), run[1].push_back(c1[at]);
    }
    std::size_t differ = 0;
    for (int pair = 0; pair < 2; ++pair)
      for (std::size_t i = 0; i < runs[0][pair].size(); ++i)
        differ += runs[0][pair][i].bits != runs[1][pair][i].bits;
    BOOST_TEST(differ == 0u, k << ": a second run " << (with_f16 ? "(on the f16 activations) " : "") << "changed "
                                << differ << " outputs");
    const std::string name = "grouped " + k + (fp8 ? " fp8" : " fp4") + shape;
    // wgmma: reduced-precision FP8 accumulation (wgmma_matches_host); the streamed kernel adds the
    // blocks in the host's order, so all but outputs of inexact block sums must be bit-equal.
    const double mag_tol = k == "wgmma" ? 0x1p-9 : 0x1p-16;
    const double min_exact = k == "wgmma" ? 0.5 : k == "streamed" ? 0.99 : 0.9;
    expect_close(runs[1][0], want[0], mag[0], (name + ", first of the pair").c_str(), mag_tol, min_exact);
    expect_close(runs[1][1], want[1], mag[1], (name + ", second of the pair").c_str(), mag_tol, min_exact);
  }
}

// Ragged tiles (5, 16, 3 and 1 rows), N = 200 (a ragged last row tile and row group), max_tiles
// 6 for 4 tiles.
BOOST_AUTO_TEST_CASE(grouped_gemms_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    check_grouped(wf, 512, 200, 3, 30, {{0, 0, 5}, {2, 5, 16}, {1, 21, 3}, {2, 24, 1}}, 6,
                  wf == weight_format::fp8_tile32 ? 81 : 82);
}

// More units than the streamed kernel has warps (2 GEMMs x 12 tiles x 144 row tiles = 3,456 >
// 132 SMs x 2 CTAs x 8 warps), so warps take several units and refill their rings across unit
// boundaries; K = 1056 (33 blocks: a last stage of one FP4 block, of one of four FP8 blocks);
// one-row tiles (the decode case), a tile list with two tiles of one group and an empty group.
BOOST_AUTO_TEST_CASE(grouped_gemms_with_many_units_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  std::vector<grouped_tile> tiles;
  int row = 0;
  for (int t = 0; t < 12; ++t) {
    const int rows = t % 4 == 0 ? 1 : t % 4 == 1 ? 7 : t % 4 == 2 ? 1 : 3;
    tiles.push_back({t % 7 == 3 ? 0 : t % 7, row, rows});  // group 3 empty, group 0 twice
    row += rows;
  }
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    check_grouped(wf, 1056, 2304, 7, 40, tiles, 14, wf == weight_format::fp8_tile32 ? 83 : 84);
}

// 16-row tiles (token tiles 2; 16, 9, 12 and 1 rows) with many units, K = 96 (three blocks: the
// only stage is a partial one, FP4 and FP8), and a device tile count above max_tiles (20 for a
// list of 12: the kernels must clamp it).
BOOST_AUTO_TEST_CASE(grouped_gemms_with_16_row_tiles_and_one_partial_stage_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  std::vector<grouped_tile> tiles;
  int row = 0;
  for (int t = 0; t < 12; ++t) {
    const int rows = t % 4 == 0 ? 16 : t % 4 == 1 ? 9 : t % 4 == 2 ? 12 : 1;
    tiles.push_back({t % 5, row, rows});
    row += rows;
  }
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    check_grouped(wf, 96, 2304, 5, 50, tiles, 12, wf == weight_format::fp8_tile32 ? 85 : 86, 20);
}

// 32-row tiles (token tiles 4; 32, 17, 24, 1 and 9 rows), K = 1056 (a last stage of one FP4
// block), more units than warps: the MoE's tiles where experts average 16 rows or more.
BOOST_AUTO_TEST_CASE(grouped_gemms_with_32_row_tiles_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  std::vector<grouped_tile> tiles;
  int row = 0;
  for (int t = 0; t < 10; ++t) {
    const int rows = t % 5 == 0 ? 32 : t % 5 == 1 ? 17 : t % 5 == 2 ? 24 : t % 5 == 3 ? 1 : 9;
    tiles.push_back({t % 4, row, rows});
    row += rows;
  }
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    check_grouped(wf, 1056, 2304, 4, 60, tiles, 11, wf == weight_format::fp8_tile32 ? 87 : 88);
}

// 8-row tiles at K = 96 (one partial stage) and K = 512 (two FP4 stages, four FP8), on every
// kernel: the streamed kernel checks an FP4 stage's weight scales as a whole.
BOOST_AUTO_TEST_CASE(grouped_gemms_with_one_or_two_stages_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const std::vector<grouped_tile> tiles = {{0, 0, 1}, {1, 1, 8}, {2, 9, 3}, {1, 12, 1}};
  for (const int K : {96, 512})
    for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
      check_grouped(wf, K, 272, 3, 20, tiles, 5, std::uint64_t(K) + (wf == weight_format::fp8_tile32 ? 1 : 2));
}

// An empty tile list (tile count 0 on the device): nothing is written, on either mma.sync kernel.
BOOST_AUTO_TEST_CASE(grouped_gemm_with_no_tiles_writes_nothing,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const int K = 256, N = 64, M = 4;
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32}) {
    auto rng = test::make_rng(87);
    const gemm_operands op({M, N, K}, wf, rng);
    auto d = op.upload();  // C poisoned with 0xFF bytes
    const std::vector<int> minus(3, -1);
    const int zero = 0;
    device_buffer<int> d_group{std::span<const int>(minus)}, d_row0{std::span<const int>(minus)},
        d_rows{std::span<const int>(minus)}, d_count{std::span<const int>(&zero, 1)};
    const kernels::gemm::gemm_groups groups{
        d_group.data(), d_row0.data(), d_rows.data(), d_count.data(), nullptr, 0, 0};
    for (const bool streamed : {false, true}) {
      if (streamed)
        kernels::gemm::streamed_grouped_gemm(d.args(), groups, wf, 3, 1);
      else
        kernels::gemm::grouped_block_scaled_gemm(d.args(), groups, wf, 3, 1);
      const auto c = d.c_after_sync();
      std::size_t written = 0;
      for (const auto& v : c) written += v.bits != 0xFFFFu;
      BOOST_TEST(written == 0u, (streamed ? "streamed: " : "per-tile: ") << written << " outputs written");
    }
  }
}

// The streamed kernel's scale products come from the codes' exponent sum, with a redo of the
// stage on exactly decoded scales wherever that is not the product (codes of 255, products that
// leave the normal range). Here: activation scale code 0 beside large weight codes (normal
// products, but d * 2^-127 is not: the exact redo, as for any code below 19), products that
// underflow, one that overflows, and a NaN weight scale, in a full stage (K block 2) and in the last, partial
// one (K block 32 of 33), for one-token (lean) and three-token tiles, FP4 and FP8. Every output must equal
// the host's class (NaN, infinity) and be within tolerance elsewhere.
BOOST_AUTO_TEST_CASE(streamed_grouped_gemm_exact_at_extreme_scales,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const int K = 1056, N = 64, KB = K / 32;
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32})
    for (const int M : {1, 3}) {
      auto rng = test::make_rng(wf == weight_format::fp8_tile32 ? 91 + M : 95 + M);
      gemm_operands op({M, N, K}, wf, rng);
      const bool fp8 = wf == weight_format::fp8_tile32;
      auto w_scale = [&](int row, int kb) -> std::uint8_t& {
        return fp8 ? op.w_s[std::size_t(row / 32) * KB + kb] : op.w_s[std::size_t(row) * KB + kb];
      };
      for (int i = 0; i < M; ++i) {
        op.a_s[std::size_t(i) * KB + 2] = 0;  // 2^-127 ...
        op.a_s[std::size_t(i) * KB + 32] = 0;
      }
      for (int row = 0; row < N; row += fp8 ? 32 : 1) {
        w_scale(row, 2) = 200;                                 // ... times 2^73: a normal product (fast path)
        w_scale(row, 32) = std::uint8_t(row < 32 ? 20 : 210);  // 2^-234: underflow (redo) / normal
      }
      // Alone in their stages (the stage's other codes stay ordinary): an activation code of 0
      // (block 10, token 0) and one weight code of 60 for row 7 (block 12; the fourth byte of its
      // lane's scale word in an FP4 stage), each of which the fast path must leave to the exact one.
      op.a_s[10] = 0;
      w_scale(7, 12) = 60;
      op.a_s[3] = 250;       // token 0, block 3: 2^123 ...
      w_scale(0, 3) = 250;   // ... times 2^123 for rows 0..31 (FP8) / row 0 (FP4): overflow (redo)
      w_scale(40, 5) = 255;  // NaN: row 40 (FP4), rows 32..63 (FP8) are NaN for every token
      const auto want = op.reference(), mag = op.reference(true);
      auto d = op.upload();
      const int zero = 0, one = 1;
      device_buffer<int> d_group{std::span<const int>(&zero, 1)}, d_row0{std::span<const int>(&zero, 1)},
          d_rows{std::span<const int>(&M, 1)}, d_count{std::span<const int>(&one, 1)};
      const kernels::gemm::gemm_groups groups{
          d_group.data(), d_row0.data(), d_rows.data(), d_count.data(), nullptr, 0, 0};
      kernels::gemm::streamed_grouped_gemm(d.args(), groups, wf, 1, 1);
      const auto got = d.c_after_sync();
      std::vector<bf16> got_f, want_f, mag_f;
      std::size_t class_mismatch = 0, specials = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const float g = got[i].to_float(), w = want[i].to_float();
        if (std::isnan(w) || std::isinf(w)) {
          ++specials;
          class_mismatch += !(std::isnan(w) ? std::isnan(g) : g == w);
        } else {
          got_f.push_back(got[i]), want_f.push_back(want[i]), mag_f.push_back(mag[i]);
        }
      }
      const std::string name =
          std::string("streamed ") + (fp8 ? "fp8" : "fp4") + " M" + std::to_string(M) + " extreme scales";
      BOOST_TEST_MESSAGE(name << ": " << specials << " NaN / infinite outputs on the host");
      BOOST_TEST(specials > 0u, name << ": the case must produce the host's NaN and infinity");
      BOOST_TEST(class_mismatch == 0u,
                 name << ": " << class_mismatch << " NaN / infinite outputs differ from the host");
      expect_close(got_f, want_f, mag_f, name.c_str(), 0x1p-16, 0.99);
    }
}

// The switch routes block_scaled_linear's few-token GEMMs to wgmma, and back.
BOOST_AUTO_TEST_CASE(decode_gemm_switch_routes_the_linear_layer, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  auto rng = test::make_rng(70);
  const gemm_operands op({3, 256, 1024}, weight_format::fp8_tile32, rng);
  auto d = op.upload();
  kernels::gemm::gemm_workspace work(std::size_t(1) << 20);
  test::blas_handle blas;
  const kernels::gemm::block_scaled_gemm_args g = d.args();
  const unsigned long long before = kernels::gemm::wgmma_gemm_calls();
  {
    const use_wgmma scope;
    kernels::gemm::block_scaled_linear(g, op.wf, &work, blas.h);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  BOOST_TEST(kernels::gemm::wgmma_gemm_calls() == before + 1);
  expect_close(d.c.download(), op.reference(), op.reference(true), "block_scaled_linear through wgmma", 0x1p-9, 0.5);
  kernels::gemm::block_scaled_linear(g, op.wf, &work, blas.h);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  BOOST_TEST(kernels::gemm::wgmma_gemm_calls() == before + 1);  // mma_sync again: no wgmma launch

  // 100 tokens: the dequantize + cuBLAS path, unless wgmma is chosen up to 128 tokens.
  auto rng2 = test::make_rng(71);
  const gemm_operands mid({100, 256, 1024}, weight_format::fp8_tile32, rng2);
  auto md = mid.upload();
  kernels::gemm::gemm_workspace mid_work(std::size_t(1) << 20, kernels::gemm::dequant_elems(mid.s));
  const kernels::gemm::block_scaled_gemm_args mg = md.args();
  const auto mid_want = mid.reference(), mid_mag = mid.reference(true);
  for (const int max_tokens : {kernels::gemm::wgmma_default_max_tokens, 128}) {
    const unsigned long long at = kernels::gemm::wgmma_gemm_calls();
    {
      const use_wgmma scope;
      struct max_tokens_scope {
        explicit max_tokens_scope(int n) { kernels::gemm::set_wgmma_max_tokens(n); }
        ~max_tokens_scope() { kernels::gemm::set_wgmma_max_tokens(kernels::gemm::wgmma_default_max_tokens); }
      } limit(max_tokens);
      md.c.fill_bytes(0xFF);
      kernels::gemm::block_scaled_linear(mg, mid.wf, &mid_work, blas.h);
    }
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    BOOST_TEST(kernels::gemm::wgmma_gemm_calls() == at + (max_tokens >= 100 ? 1u : 0u), "wgmma up to " << max_tokens);
    expect_close(md.c.download(), mid_want, mid_mag, ("100 tokens, wgmma up to " + std::to_string(max_tokens)).c_str(), 0x1p-9,
                 0.5);
  }
  BOOST_TEST(test::throws_with([] { kernels::gemm::set_wgmma_max_tokens(0); }, "at least 1 token"));
}

// A workspace smaller than both whole operands: passes of rows (the weight whole), then passes of
// rows and of columns (FP8 scale tiles whole, a ragged last column block), each output still one
// cuBLAS dot product over the whole K.
BOOST_AUTO_TEST_CASE(dequant_passes_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32}) {
    auto rng = test::make_rng(wf == weight_format::fp8_tile32 ? 41 : 42);
    const gemm_shape s{700, 1000, 512};
    const gemm_operands op(s, wf, rng);
    const auto want = op.reference(), mag = op.reference(true);
    const std::string name = wf == weight_format::fp8_tile32 ? "fp8 M700 N1000 K512" : "fp4 M700 N1000 K512";
    const std::size_t rows_only = (std::size_t(s.n) + 300) * std::size_t(s.k);  // the weight + 300 rows
    const std::size_t both = std::size_t(600) * std::size_t(s.k);               // 300 rows + 288 columns
    BOOST_TEST(kernels::gemm::plan_dequant_passes(s, rows_only).rows == 300);
    BOOST_TEST(kernels::gemm::plan_dequant_passes(s, rows_only).cols == 1000);
    BOOST_TEST(kernels::gemm::plan_dequant_passes(s, both).rows == 300);
    BOOST_TEST(kernels::gemm::plan_dequant_passes(s, both).cols == 288);
    expect_close(op.device_dequant(rows_only), want, mag, (name + ", passes of 300 rows").c_str());
    expect_close(op.device_dequant(both), want, mag, (name + ", passes of 300 rows x 288 columns").c_str());
    // 200 rows a pass: below dequant_min_pass, refused with the sizes named.
    BOOST_TEST(test::throws_with([&] { op.device_dequant(std::size_t(400) * std::size_t(s.k)); }, "too few for passes of 256 rows"));
  }
}

// How the dequantize path cuts a GEMM (host arithmetic; the passes themselves: above).
BOOST_AUTO_TEST_CASE(dequant_pass_plans) {
  using kernels::gemm::plan_dequant_passes;
  const gemm_shape s{8192, 32768, 1280};  // V4.1's wq_b at an 8K prefill
  const auto whole = plan_dequant_passes(s, kernels::gemm::dequant_elems(s));
  BOOST_TEST((whole.rows == 8192 && whole.cols == 32768));
  const auto capped = plan_dequant_passes(s, std::size_t(1) << 25);  // 32M elements: 64 MB
  BOOST_TEST((capped.rows == 8192 && capped.cols == 18016));            // columns in 2 passes, multiple of 32
  BOOST_TEST(plan_dequant_passes({100, 50, 64}, (100 + 50) * 64).rows == 100);
  // Below passes of 256 rows x 256 columns (or the whole GEMM when smaller): refused.
  BOOST_TEST(plan_dequant_passes(s, std::size_t(400) * 1280).rows == 0);
  BOOST_TEST(plan_dequant_passes({64, 100, 64}, (64 + 100) * 64 - 1).rows == 0);
  BOOST_TEST(kernels::gemm::dequant_elems_for(63, {{1024, 512}}) == 0u);  // below dequant_min_tokens: the MMA kernel
  BOOST_TEST(kernels::gemm::dequant_elems_for(64, {{1024, 512}, {10, 4096}}) == std::size_t(1088) * 512);
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors) {
  std::uint8_t dummy[64] = {};
  bf16 out[4];
  kernels::gemm::block_scaled_gemm_args g{{1, 1, 48}, dummy, dummy, dummy, dummy, out};
  BOOST_TEST(test::throws_with([&] { kernels::gemm::block_scaled_gemm(g, weight_format::fp8_tile32); }, "multiple of 32"));
  g.shape = {1, 1, 32};
  g.w = nullptr;
  BOOST_TEST(test::throws_with([&] { kernels::gemm::block_scaled_gemm(g, weight_format::fp4_row32); }, "null pointer"));
  g.shape = {-1, 1, 32};
  BOOST_TEST(test::throws_with([&] { kernels::gemm::block_scaled_gemm(g, weight_format::fp4_row32); }, "negative"));
  // A grouped pair whose f16 activation copies differ (the kernel reads only the first's): an
  // error, not a silent fallback to the codes (checked on the host, before any launch).
  alignas(16) static std::uint8_t codes[64] = {};
  alignas(16) static std::uint16_t f16[64] = {};
  int tiles[4] = {};
  const kernels::gemm::gemm_groups groups{tiles, tiles, tiles, tiles};
  kernels::gemm::block_scaled_gemm_args g1{{1, 16, 32}, codes, codes, codes, codes, out}, g2 = g1;
  g2.a_f16 = f16;
  BOOST_TEST(test::throws_with(
      [&] { kernels::gemm::streamed_grouped_gemm(g1, groups, weight_format::fp4_row32, 1, 1, nullptr, &g2); },
      "f16 copy"));
}

BOOST_AUTO_TEST_CASE(rmsnorm_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(31);
  for (const int dim : {5120, 1024, 256, 8}) {
    const long long rows = dim == 8 ? 3 : 97;
    std::normal_distribution<float> n(0.0f, 4.0f);
    std::vector<bf16> x(std::size_t(rows) * dim), w(static_cast<std::size_t>(dim));
    for (auto& v : x) v = bf16::from_float(n(rng));
    for (auto& v : w) v = bf16::from_float(1.0f + n(rng) / 16);
    x[5] = bf16::from_float(0.0f);
    device_buffer<bf16> dx{std::span<const bf16>(x)}, dw{std::span<const bf16>(w)}, dy(x.size());
    dy.fill_bytes(0xFF);
    kernels::norm::rmsnorm<bf16>({dx.data(), dim, dw.data(), dy.data(), dim, rows, dim, 1e-20f});
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = dy.download();
    std::vector<float> wf(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) wf[i] = w[i].to_float();
    std::size_t diff = 0;
    for (long long r = 0; r < rows; ++r) {
      std::vector<float> xf(static_cast<std::size_t>(dim));
      for (int i = 0; i < dim; ++i) xf[std::size_t(i)] = x[std::size_t(r) * dim + i].to_float();
      std::vector<bf16> want(static_cast<std::size_t>(dim));
      kernels::norm::rmsnorm_reference(xf, wf, 1e-20f, want);
      for (int i = 0; i < dim; ++i) diff += y[std::size_t(r) * dim + i].bits != want[std::size_t(i)].bits;
    }
    BOOST_TEST_MESSAGE("rmsnorm dim " << dim << ": " << diff << " outputs differ from the host");
    BOOST_TEST(diff == 0u);
  }
  // An all-zero row: eps keeps the rsqrt finite (1e-20 -> 1e10) and the output is zeros.
  std::vector<bf16> z(256, bf16::from_float(0.0f)), w(256, bf16::from_float(1.0f));
  device_buffer<bf16> dz{std::span<const bf16>(z)}, dw{std::span<const bf16>(w)}, dy(256);
  dy.fill_bytes(0xFF);
  kernels::norm::rmsnorm<bf16>({dz.data(), 256, dw.data(), dy.data(), 256, 1, 256, 1e-20f});
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  for (const auto v : dy.download()) BOOST_TEST(v.bits == 0u);
}

// The act_quant beside the norm (rmsnorm_args::codes): y as the plain launch writes it, and codes
// and scales byte for byte those of the host quantizer on that y (what numerics::quantize makes
// of the stored rows), on shapes of the decode chain (q_lora 1280, dim 5120) and odd row counts.
BOOST_AUTO_TEST_CASE(rmsnorm_with_act_quant_matches_the_quantizer,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  using act = numerics::fp8_act_format;
  auto rng = test::make_rng(37);
  for (const int dim : {5120, 1280, 512, 32}) {
    for (const long long rows : {1LL, 3LL, 67LL}) {
      std::normal_distribution<float> n(0.0f, 3.0f);
      std::vector<bf16> x(std::size_t(rows) * dim), w(static_cast<std::size_t>(dim));
      for (auto& v : x) v = bf16::from_float(n(rng) * std::exp2(float(int(rng() % 24)) - 12.0f));
      for (auto& v : w) v = bf16::from_float(1.0f + n(rng) / 16);
      if (rows > 1)
        std::fill(x.begin() + dim, x.begin() + dim + 32, bf16::from_float(0.0f));  // an all-zero block
      device_buffer<bf16> dx{std::span<const bf16>(x)}, dw{std::span<const bf16>(w)}, dy(x.size()),
          dplain(x.size());
      device_buffer<std::uint8_t> dc(x.size()), ds(x.size() / 32);
      dy.fill_bytes(0xFF), dplain.fill_bytes(0xFF), dc.fill_bytes(0xFF), ds.fill_bytes(0xFF);
      kernels::norm::rmsnorm_args<bf16> a{dx.data(), dim, dw.data(), dy.data(), dim, rows, dim, 1e-20f};
      a.codes = dc.data(), a.codes_stride = dim, a.scales = ds.data(), a.scales_stride = dim / 32;
      kernels::norm::rmsnorm<bf16>(a);
      kernels::norm::rmsnorm<bf16>({dx.data(), dim, dw.data(), dplain.data(), dim, rows, dim, 1e-20f});
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const auto y = dy.download(), plain = dplain.download();
      const auto codes = dc.download(), scales = ds.download();
      std::size_t y_diff = 0, code_diff = 0, scale_diff = 0;
      for (std::size_t i = 0; i < y.size(); ++i) y_diff += y[i].bits != plain[i].bits;
      for (long long r = 0; r < rows; ++r) {
        std::vector<std::uint8_t> want_c(static_cast<std::size_t>(dim)),
            want_s(static_cast<std::size_t>(dim / 32));
        numerics::quantize_vector<act>(std::span<const bf16>(y.data() + r * dim, std::size_t(dim)), want_c,
                                       want_s);
        for (int i = 0; i < dim; ++i) code_diff += codes[std::size_t(r * dim + i)] != want_c[std::size_t(i)];
        for (int i = 0; i < dim / 32; ++i)
          scale_diff += scales[std::size_t(r * (dim / 32) + i)] != want_s[std::size_t(i)];
      }
      BOOST_TEST_MESSAGE("rmsnorm + act_quant dim " << dim << " rows " << rows << ": y " << y_diff
                                                    << ", codes " << code_diff << ", scales " << scale_diff
                                                    << " differ");
      BOOST_TEST(y_diff == 0u);
      BOOST_TEST(code_diff == 0u);
      BOOST_TEST(scale_diff == 0u);
    }
  }
}

// The act_quant's argument checks run on the host, before any launch.
BOOST_AUTO_TEST_CASE(rmsnorm_act_quant_bad_arguments_are_errors) {
  alignas(16) static bf16 buf[64] = {};
  alignas(16) static std::uint8_t codes[64] = {}, scales[4] = {};
  kernels::norm::rmsnorm_args<bf16> a{buf, 64, buf, buf, 64, 1, 64, 1e-20f};
  a.codes = codes, a.codes_stride = 64;
  BOOST_TEST(test::throws_with([&] { kernels::norm::rmsnorm<bf16>(a); }, "both codes and scales"));
  a.scales = scales, a.scales_stride = 2;
  a.dim = 48, a.x_stride = a.y_stride = 48;
  BOOST_TEST(test::throws_with([&] { kernels::norm::rmsnorm<bf16>(a); }, "multiple of its block of 32"));
  a.dim = 64, a.x_stride = a.y_stride = 64, a.codes_stride = 32;
  BOOST_TEST(test::throws_with([&] { kernels::norm::rmsnorm<bf16>(a); }, "row stride of at least dim"));
}

BOOST_AUTO_TEST_SUITE_END()
