// The fused CUDA mHC boundary step against the host composition (hc_post, hc_pre, RMSNorm,
// hc_coefficients), at the model's entry (no F), inside (F and next coefficients) and at the exit
// (no next), V4.1 and tiny widths, on fresh random streams; outputs poisoned with NaN.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dsv4/kernels/mhc/mhc_step.cuh"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::mhc;
using numerics::bf16;
using runtime::device_buffer;

namespace {

enum class boundary { entry, inside, exit };

void check_step(long long tokens, int dim, boundary kind, std::uint64_t salt) {
  auto rng = test::make_rng(salt);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const std::size_t sd = std::size_t(4) * dim;
  std::vector<bf16> x(std::size_t(tokens) * sd), f(std::size_t(tokens) * dim), w(static_cast<std::size_t>(dim));
  for (auto& v : x) v = bf16::from_float(n(rng) * 2.0f);
  for (auto& v : f) v = bf16::from_float(n(rng));
  for (auto& v : w) v = bf16::from_float(1.0f + n(rng) / 8.0f);
  std::vector<float> pre(std::size_t(tokens) * 4), post(std::size_t(tokens) * 4), comb(std::size_t(tokens) * 16);
  mix_params next;
  next.fn.resize(std::size_t(24) * sd);
  next.base.resize(24);
  next.scale = {0.7f, 1.3f, 2.0f};
  for (auto& v : next.fn) v = n(rng) / std::sqrt(float(sd));
  for (auto& v : next.base) v = n(rng) / 4.0f;
  for (long long t = 0; t < tokens; ++t) {  // realistic applied coefficients: a Sinkhorn split of random mixes
    float m[24];
    for (auto& v : m) v = n(rng);
    split_sinkhorn(m, next.scale.data(), next.base.data(), 20, 1e-6f, &pre[t * 4], &post[t * 4], &comb[t * 16]);
  }
  if (kind == boundary::entry)
    for (long long t = 0; t < tokens; ++t) identity_pre_mix(*reinterpret_cast<float(*)[4]>(&pre[t * 4]));

  device_buffer<bf16> dx{std::span<const bf16>(x)}, df{std::span<const bf16>(f)}, dw{std::span<const bf16>(w)};
  device_buffer<float> dpre{std::span<const float>(pre)}, dpost{std::span<const float>(post)}, dcomb{std::span<const float>(comb)};
  device_buffer<float> dfn{std::span<const float>(next.fn)}, dbase{std::span<const float>(next.base)},
      dscale{std::span<const float>(next.scale)};
  device_buffer<bf16> dy(x.size()), dh(f.size());
  device_buffer<float> npre(pre.size()), npost(post.size()), ncomb(comb.size());
  mhc_workspace ws(tokens, dim);
  mhc_step_args a;
  a.x = dx.data();
  a.f = kind == boundary::entry ? nullptr : df.data();
  a.post = dpost.data();
  a.comb = dcomb.data();
  a.pre = dpre.data();
  a.norm_w = dw.data();
  a.y = dy.data();
  a.h = dh.data();
  if (kind != boundary::exit) {
    a.fn = dfn.data(), a.base = dbase.data(), a.scale = dscale.data();
    a.next_pre = npre.data(), a.next_post = npost.data(), a.next_comb = ncomb.data();
  }
  a.tokens = tokens;
  a.dim = dim;
  // h's act_quant beside it (mhc_step_args::h_codes) on even salts where dim allows it, with the
  // codes' f16 copy on every other one of those: the bytes numerics::quantize makes of h.
  const bool quant = dim % 32 == 0 && salt % 2 == 0, quant_f16 = quant && salt % 4 == 0;
  device_buffer<std::uint8_t> dcodes(f.size()), dscales(f.size() / 32 + 1);
  device_buffer<std::uint16_t> df16(f.size());
  if (quant) a.h_codes = dcodes.data(), a.h_scales = dscales.data();
  if (quant_f16) a.h_codes_f16 = df16.data();
  dcodes.fill_bytes(0xFF), dscales.fill_bytes(0xFF), df16.fill_bytes(0xFF);
  std::vector<bf16> runs_h[2];
  std::vector<float> runs_c[2];
  for (int run = 0; run < 2; ++run) {  // the second run must repeat the first (counters reset)
    dy.fill_bytes(0xFF), dh.fill_bytes(0xFF), npre.fill_bytes(0xFF), npost.fill_bytes(0xFF), ncomb.fill_bytes(0xFF);
    mhc_step(a, ws);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    runs_h[run] = dh.download();
    runs_c[run] = ncomb.download();
  }
  const auto y = dy.download(), h = runs_h[1];
  const auto gp = npre.download(), gq = npost.download(), gc = runs_c[1];
  std::size_t repeat_diff = 0;
  for (std::size_t i = 0; i < h.size(); ++i) repeat_diff += runs_h[0][i].bits != runs_h[1][i].bits;
  for (std::size_t i = 0; i < gc.size(); ++i) repeat_diff += std::memcmp(&runs_c[0][i], &runs_c[1][i], 4) != 0;
  BOOST_TEST(repeat_diff == 0u);

  std::vector<float> wf(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) wf[i] = w[i].to_float();
  std::size_t y_diff = 0, h_diff = 0, nan = 0;
  double worst = 0;
  for (long long t = 0; t < tokens; ++t) {
    coefficients applied;
    for (int i = 0; i < 4; ++i) applied.pre[i] = pre[t * 4 + i], applied.post[i] = post[t * 4 + i];
    for (int i = 0; i < 16; ++i) applied.comb[i] = comb[t * 16 + i];
    float p[4];
    for (int i = 0; i < 4; ++i) p[i] = pre[t * 4 + i];
    const auto want = boundary_step_reference(std::span<const bf16>(x).subspan(t * sd, sd),
                                              kind == boundary::entry ? std::span<const bf16>()
                                                                      : std::span<const bf16>(f).subspan(t * dim, dim),
                                              dim, applied, p, wf, 1e-20f, kind == boundary::exit ? nullptr : &next);
    if (kind != boundary::entry)
      for (std::size_t i = 0; i < sd; ++i) y_diff += y[t * sd + i].bits != want.y[i].bits;
    for (int i = 0; i < dim; ++i) h_diff += h[t * dim + i].bits != want.h[std::size_t(i)].bits;
    if (kind != boundary::exit) {
      auto cmp = [&](float got, float ref) {
        nan += std::isnan(got);
        worst = std::max(worst, std::fabs(double(got) - ref) / std::max(1e-30, std::fabs(double(ref))));
      };
      for (int i = 0; i < 4; ++i) cmp(gp[t * 4 + i], want.next.pre[i]), cmp(gq[t * 4 + i], want.next.post[i]);
      for (int i = 0; i < 16; ++i) cmp(gc[t * 16 + i], want.next.comb[i]);
    }
  }
  std::size_t quant_diff = 0;
  if (quant) {
    const auto codes = dcodes.download(), scales = dscales.download();
    const auto f16 = df16.download();
    for (long long t = 0; t < tokens; ++t) {
      std::vector<std::uint8_t> want_c(static_cast<std::size_t>(dim)),
          want_s(static_cast<std::size_t>(dim / 32));
      numerics::quantize_vector<numerics::fp8_act_format>(std::span<const bf16>(h).subspan(t * dim, dim),
                                                          want_c, want_s);
      for (int i = 0; i < dim; ++i) {
        quant_diff += codes[std::size_t(t * dim + i)] != want_c[std::size_t(i)];
        if (quant_f16)
          quant_diff += f16[std::size_t(t * dim + i)] != numerics::e4m3_code_as_f16(want_c[std::size_t(i)]);
      }
      for (int i = 0; i < dim / 32; ++i)
        quant_diff += scales[std::size_t(t * (dim / 32) + i)] != want_s[std::size_t(i)];
    }
    BOOST_TEST_MESSAGE("mhc_step tokens " << tokens << " dim " << dim << ": act_quant of h (f16 copy "
                                          << quant_f16 << ") differs in " << quant_diff << " bytes");
  }
  BOOST_TEST(quant_diff == 0u);
  BOOST_TEST_MESSAGE("mhc_step tokens " << tokens << " dim " << dim << " kind " << int(kind) << ": Y differs in "
                                        << y_diff << ", h in " << h_diff << ", coefficients worst rel " << worst);
  BOOST_TEST(y_diff == 0u);
  BOOST_TEST(h_diff == 0u);
  BOOST_TEST(nan == 0u);
  BOOST_TEST(worst < 4e-6);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(mhc_step_cuda)

BOOST_AUTO_TEST_CASE(fused_step_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_step(1, 5120, boundary::inside, 1);
  check_step(37, 5120, boundary::inside, 2);
  check_step(5, 5120, boundary::entry, 3);
  check_step(4, 5120, boundary::exit, 4);
  check_step(300, 256, boundary::inside, 5);
  check_step(2, 256, boundary::entry, 6);
  // Widths that are not a multiple of the 128-position slice (the last CTA's partial slice: its
  // weight rows are copied short), in each default shape: one token a CTA (up to 16 tokens), twos
  // (up to 48), fours (up to 64) and 8-token groups.
  check_step(3, 200, boundary::inside, 7);
  check_step(16, 328, boundary::inside, 8);
  check_step(17, 328, boundary::inside, 9);
  check_step(33, 328, boundary::inside, 22);
  check_step(2, 200, boundary::exit, 10);
  check_step(8, 328, boundary::inside, 23);
  check_step(61, 328, boundary::inside, 24);
  check_step(101, 328, boundary::inside, 25);
  check_step(97, 5120, boundary::entry, 26);
}

// One token a CTA with the projection rows bulk-copied into shared memory
// (set_decode_weights_in_registers(false)) instead of loaded into registers before the programmatic
// wait (the default, which the cases above run): the same bounds, at full and partial slices,
// inside the model, at its entry and at its exit (no projection).
BOOST_AUTO_TEST_CASE(decode_weights_in_shared_memory_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  struct restore {
    ~restore() { set_decode_weights_in_registers(true); }
  } r;
  BOOST_TEST(decode_weights_in_registers());
  set_decode_weights_in_registers(false);
  BOOST_TEST(!decode_weights_in_registers());
  check_step(1, 5120, boundary::inside, 31);
  check_step(16, 5120, boundary::inside, 32);
  check_step(5, 5120, boundary::entry, 33);
  check_step(4, 5120, boundary::exit, 34);
  check_step(3, 200, boundary::inside, 35);
  check_step(7, 328, boundary::inside, 36);
  check_step(17, 328, boundary::inside, 37);  // (above 16 tokens: the small groups, unchanged)
}

// The prefill variant with 16 tokens a CTA (set_prefill_token_group): two phase-1 items a thread,
// two tokens a Sinkhorn warp, two rounds; the same bits as the 8-token groups' (Y, h) and the same bounds.
BOOST_AUTO_TEST_CASE(sixteen_token_groups_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  struct restore {
    ~restore() {
      set_prefill_token_group(8);
      set_small_token_groups(detail::default_twos_up_to, detail::default_fours_up_to);
    }
  } r;
  set_prefill_token_group(16);
  set_small_token_groups(0, 0);  // (from 17 tokens on, the groups)
  BOOST_TEST(prefill_token_group() == 16);
  check_step(37, 5120, boundary::inside, 11);
  check_step(300, 256, boundary::inside, 12);
  check_step(33, 328, boundary::inside, 13);
  check_step(40, 200, boundary::exit, 14);
  check_step(33, 5120, boundary::entry, 15);
  BOOST_TEST(test::throws_with([] { set_prefill_token_group(12); }, "8 or 16 tokens a CTA, not 12"));
}

// One token a CTA above 16 tokens (set_one_token_ctas_up_to: by default up to 16, here up to 64):
// the same bits and bounds as the 8-token groups'.
BOOST_AUTO_TEST_CASE(one_token_ctas_above_sixteen_tokens_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  struct restore {
    ~restore() {
      set_one_token_ctas_up_to(detail::default_one_token_ctas);
      set_small_token_groups(detail::default_twos_up_to, detail::default_fours_up_to);
    }
  } r;
  BOOST_TEST(one_token_ctas_up_to() == detail::default_one_token_ctas);
  set_one_token_ctas_up_to(64);
  set_small_token_groups(0, 0);
  BOOST_TEST(one_token_ctas_up_to() == 64);
  check_step(64, 5120, boundary::inside, 16);
  check_step(37, 328, boundary::inside, 17);
  check_step(33, 5120, boundary::entry, 18);
  check_step(40, 200, boundary::exit, 19);
  check_step(17, 5120, boundary::inside, 21);
  check_step(65, 256, boundary::inside, 20);  // above the limit: 8-token groups
  BOOST_TEST(test::throws_with([] { set_one_token_ctas_up_to(0); }, "1 to 4096 tokens a call, not 0"));
}

// Small token groups (set_small_token_groups: 2 or 4 tokens a CTA, the weight slice in shared
// memory, two tokens a Sinkhorn warp; a group's odd last token leaves a half warp idle): the same
// bits and bounds as the 8-token groups'. Each size alone up to 64 tokens, then both (twos up to
// 24, fours up to 48) with calls on either side of each limit.
BOOST_AUTO_TEST_CASE(small_token_groups_match_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  struct restore {
    ~restore() {
      set_one_token_ctas_up_to(detail::default_one_token_ctas);
      set_small_token_groups(detail::default_twos_up_to, detail::default_fours_up_to);
    }
  } r;
  set_one_token_ctas_up_to(8);
  for (const int group : {2, 4}) {
    set_small_token_groups(group == 2 ? 64 : 0, group == 4 ? 64 : 0);
    BOOST_TEST(twos_up_to() == (group == 2 ? 64 : 0));
    BOOST_TEST(fours_up_to() == (group == 4 ? 64 : 0));
    check_step(64, 5120, boundary::inside, 30 + group);
    check_step(37, 328, boundary::inside, 31 + group);
    check_step(33, 5120, boundary::entry, 32 + group);
    check_step(40, 200, boundary::exit, 33 + group);
    check_step(9, 5120, boundary::inside, 34 + group);
    check_step(19, 256, boundary::inside, 35 + group);
    check_step(65, 256, boundary::inside, 36 + group);  // above the limit: 8-token groups
  }
  set_small_token_groups(24, 48);
  for (const long long tokens : {8LL, 9LL, 24LL, 25LL, 47LL, 48LL, 49LL})
    check_step(tokens, 5120, boundary::inside, 40 + tokens);
  BOOST_TEST(
      test::throws_with([] { set_small_token_groups(-1, 64); }, "lies in 0 to 4096 tokens a call, not -1"));
  BOOST_TEST(test::throws_with([] { set_small_token_groups(2, 5000); },
                               "lies in 0 to 4096 tokens a call, not 5000"));
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  mhc_workspace ws(1, 256);  // allocates: needs a device
  mhc_step_args a;
  a.tokens = 1;
  a.dim = 12;
  BOOST_TEST(test::throws_with([&] { mhc_step(a, ws); }, "multiple of 8"));
  a.dim = 256;
  BOOST_TEST(test::throws_with([&] { mhc_step(a, ws); }, "null x"));
  a.tokens = 2;
  BOOST_TEST(test::throws_with([&] { mhc_step(a, ws); }, "workspace holds 1 tokens"));
  a.tokens = 1;
  alignas(16) static bf16 buf[1024] = {};
  alignas(16) static float fbuf[16] = {};
  alignas(16) static std::uint8_t codes[256] = {};
  a.x = buf, a.pre = fbuf, a.norm_w = buf, a.h = buf;
  a.h_codes = codes;
  BOOST_TEST(test::throws_with([&] { mhc_step(a, ws); }, "both codes and scales"));
  a.h_scales = codes, a.dim = 200;
  BOOST_TEST(test::throws_with([&] { mhc_step(a, ws); }, "multiple of its block of 32"));
}

BOOST_AUTO_TEST_SUITE_END()
