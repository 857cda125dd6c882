// Compressor (spec §6), global entries, indexer scores, top-k and candidate pool (spec §7).

#include <boost/test/unit_test.hpp>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "dsv4/kernels/compressor/reference.hpp"
#include "dsv4/kernels/indexer/reference.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels;
using numerics::bf16;

namespace {

compressor::compressor_weights make_weights(std::mt19937_64& rng, int dim, int head_dim, int ratio) {
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(float(dim)));
  compressor::compressor_weights w;
  w.dim = dim;
  w.head_dim = head_dim;
  w.ratio = ratio;
  w.wkv.resize(std::size_t(dim) * head_dim);
  for (auto& v : w.wkv) v = ratio == 1 ? numerics::round_to_bf16(n(rng)) : n(rng);
  if (ratio > 1) {
    w.wgate.resize(w.wkv.size());
    for (auto& v : w.wgate) v = 4.0f * n(rng);
  }
  w.norm.resize(std::size_t(head_dim));
  for (auto& v : w.norm) v = numerics::round_to_bf16(1.0f + 0.1f * n(rng));
  return w;
}

std::vector<bf16> random_x(std::mt19937_64& rng, int tokens, int dim) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens) * dim);
  for (auto& v : x) v = bf16::from_float(n(rng));
  return x;
}

bool same_bits(std::span<const bf16> a, std::span<const bf16> b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].bits != b[i].bits) return false;
  return true;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(compressor_suite)

// Prefill of any length, then decode, produces exactly the latents of a longer prefill: the decode
// state carries the partial group (spec §6: an odd prefill then decode pools {s-1, s}).
BOOST_AUTO_TEST_CASE(prefill_then_decode_equals_longer_prefill) {
  auto rng = test::make_rng(50);
  for (int ratio : {1, 2}) {
    const auto w = make_weights(rng, 64, 32, ratio);
    const int total = 11;
    const auto x = random_x(rng, total, 64);
    compressor::compressor_state full_state(w);
    const auto full = compressor::compress_prefill(w, x, total, full_state);
    BOOST_TEST(full.size() == std::size_t(total / ratio) * 32);
    for (int s : {0, 1, 2, 5, 6}) {
      BOOST_TEST_CONTEXT("ratio " << ratio << " prefill " << s) {
        compressor::compressor_state st(w);
        auto lat = compressor::compress_prefill(w, std::span(x).subspan(0, std::size_t(s) * 64), s, st);
        BOOST_TEST(lat.size() == std::size_t(s / ratio) * 32);
        for (int p = s; p < total; ++p) {
          const auto got = compressor::compress_decode(w, std::span(x).subspan(std::size_t(p) * 64, 64), p, st);
          BOOST_TEST(got.has_value() == ((p + 1) % ratio == 0));
          if (got) lat.insert(lat.end(), got->begin(), got->end());
        }
        BOOST_TEST(same_bits(lat, std::span(full).subspan(0, lat.size())));
        BOOST_TEST(lat.size() == full.size());
      }
    }
  }
}

// With equal gate scores the softmax is uniform: the latent is RMSNorm(bf16((k0 + k1) / 2)).
BOOST_AUTO_TEST_CASE(ratio2_pools_with_a_per_channel_softmax) {
  auto rng = test::make_rng(51);
  auto w = make_weights(rng, 32, 32, 2);
  std::fill(w.wgate.begin(), w.wgate.end(), 0.0f);
  const auto x = random_x(rng, 2, 32);
  compressor::compressor_state st(w);
  const auto lat = compressor::compress_prefill(w, x, 2, st);
  const auto k0 = linear::linear_fp32_reference(linear::widen(std::span(x).subspan(0, 32)), w.wkv, 32);
  const auto k1 = linear::linear_fp32_reference(linear::widen(std::span(x).subspan(32, 32)), w.wkv, 32);
  std::vector<float> mean(32);
  for (int c = 0; c < 32; ++c) mean[c] = numerics::round_to_bf16(0.5f * k0[c] + 0.5f * k1[c]);
  std::vector<bf16> want(32);
  norm::rmsnorm_reference(mean, w.norm, w.eps, want);
  BOOST_TEST(same_bits(lat, want));
  // The softmax is per channel: even channels' gates follow +x[0], odd channels' follow -x[0], so
  // with x[0] = 1 in token 0 and 0 in token 1, even channels take token 0's k and odd ones token 1's.
  std::fill(w.wgate.begin(), w.wgate.end(), 0.0f);
  for (int c = 0; c < 32; ++c) w.wgate[std::size_t(c) * 32] = (c % 2 == 0) ? 1000.0f : -1000.0f;
  std::vector<bf16> y(x.begin(), x.end());
  y[0] = bf16::from_float(1.0f);
  y[32] = bf16::from_float(0.0f);
  compressor::compressor_state st2(w);
  const auto picked = compressor::compress_prefill(w, y, 2, st2);
  const auto ky0 = linear::linear_fp32_reference(linear::widen(std::span(y).subspan(0, 32)), w.wkv, 32);
  const auto ky1 = linear::linear_fp32_reference(linear::widen(std::span(y).subspan(32, 32)), w.wkv, 32);
  std::vector<float> r(32);
  for (int c = 0; c < 32; ++c) r[c] = numerics::round_to_bf16(c % 2 == 0 ? ky0[c] : ky1[c]);
  std::vector<bf16> want2(32);
  norm::rmsnorm_reference(r, w.norm, w.eps, want2);
  BOOST_TEST(same_bits(picked, want2));
}

BOOST_AUTO_TEST_CASE(entries_rotate_the_main_kv_and_key_the_pre_rope_latent) {
  auto rng = test::make_rng(52);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> latent(128);
  for (auto& v : latent) v = bf16::from_float(n(rng));
  compressor::index_key_weights ik;
  ik.index_dim = 64;
  ik.wk.resize(64 * 128);
  for (auto& v : ik.wk) v = numerics::round_to_bf16(n(rng) / 11.0f);
  ik.norm.assign(64, 1.0f);
  const auto freqs = rope::frequencies({32, 160000.0f, 65536, 16.0f, 32.0f, 1.0f});
  using entry = compressor::global_entry<128, 64>;
  const entry at0 = compressor::make_entries<128, 64>(latent, ik, freqs, 0);
  const entry at9 = compressor::make_entries<128, 64>(latent, ik, freqs, 9);
  // Position 0: no rotation, so the main entry is the quantized latent itself.
  std::uint8_t want[entry::main_layout::bytes];
  numerics::quantize_vector<numerics::main_kv_format>(latent, {want, entry::main_layout::code_bytes},
                                                      {want + entry::main_layout::scale_offset, entry::main_layout::scale_bytes});
  BOOST_TEST(std::equal(want, want + sizeof want, at0.main));
  // The no-RoPE part of the index key does not depend on the position; the RoPE part does.
  std::vector<bf16> k0(64), k9(64);
  numerics::dequantize_vector<numerics::index_key_format>({at0.index, 32}, {at0.index + 32, 2}, k0);
  numerics::dequantize_vector<numerics::index_key_format>({at9.index, 32}, {at9.index + 32, 2}, k9);
  BOOST_TEST(same_bits(std::span(k0).subspan(0, 32), std::span(k9).subspan(0, 32)));  // from the pre-RoPE latent
  BOOST_TEST(!same_bits(std::span(k0).subspan(32), std::span(k9).subspan(32)));
  // Main entry at position 9 dequantizes to RoPE(latent) within FP4 error: the largest E2M1 step
  // (4 -> 6) is 2 s, so the error is at most s, and s = e4m3(amax / 6) is at most (amax / 6)(1 + 2^-4).
  std::vector<bf16> rotated = latent, back(128);
  const std::int64_t pos9[1] = {9};
  rope::apply_rope_reference(rotated, 128, 1, pos9, freqs, false);
  numerics::dequantize_vector<numerics::main_kv_format>({at9.main, 64}, {at9.main + 64, 8}, back);
  for (int b = 0; b < 8; ++b) {
    float amax = 0;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(rotated[b * 16 + i].to_float()));
    for (int i = 0; i < 16; ++i)
      BOOST_TEST(std::fabs(back[b * 16 + i].to_float() - rotated[b * 16 + i].to_float()) <= amax / 6.0f * 1.0625f);
  }
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(indexer_suite)

BOOST_AUTO_TEST_CASE(topk_breaks_ties_toward_the_lowest_index) {
  std::vector<float> s(20, 1.0f);
  s[7] = 2.0f;
  s[15] = 2.0f;
  const auto idx = indexer::topk_lowest_index_ties(s, 5);
  BOOST_TEST(idx == (std::vector<std::int32_t>{0, 1, 2, 7, 15}), boost::test_tools::per_element());
  std::vector<float> all_masked(10, -INFINITY);
  BOOST_TEST(indexer::topk_lowest_index_ties(all_masked, 3) == (std::vector<std::int32_t>{0, 1, 2}),
             boost::test_tools::per_element());
}

// torch.topk's order on CUDA (numerics::topk_order_key, measured on the H200): -0 below +0, every
// NaN ranks above +inf whatever its sign, NaNs tie; ties go to the lowest index. Before, the
// host's float comparison gave std::stable_sort no strict weak order with NaN.
BOOST_AUTO_TEST_CASE(topk_follows_torch_order_for_signed_zeros_and_nan) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  const float neg_nan = -nan;
  BOOST_REQUIRE(std::signbit(neg_nan) && std::isnan(neg_nan));
  using v = std::vector<std::int32_t>;
  auto top = [](std::vector<float> s, int k, v want) {
    BOOST_TEST(indexer::topk_lowest_index_ties(s, k) == want, boost::test_tools::per_element());
  };
  // -0 ranks below +0, whatever the indices; equal zeros go to the lower index.
  top({-1.0f, -0.0f, 0.0f, -2.0f}, 1, {2});
  top({-1.0f, 0.0f, -0.0f, -2.0f}, 1, {1});
  top({-0.0f, -inf, 0.0f, -0.0f, 0.0f}, 3, {0, 2, 4});
  // NaN beats +inf (and every number), positive or negative NaN alike.
  top({inf, 1.0f, nan, -inf}, 1, {2});
  top({inf, 1.0f, neg_nan, -inf}, 1, {2});
  top({-inf, 5.0f, neg_nan, inf, 0.0f}, 2, {2, 3});
  // NaNs tie with each other (sign and payload ignored): the lowest indices first.
  const float nan_payload = std::bit_cast<float>(0x7fc00123u), neg_nan_payload = std::bit_cast<float>(0xffc00456u);
  top({1.0f, nan_payload, inf, neg_nan, nan, neg_nan_payload}, 2, {1, 3});
  top({1.0f, neg_nan_payload, inf, nan, neg_nan, nan_payload}, 3, {1, 3, 4});
  // Through the selection: NaN first, -1 tails at the end, offset added.
  BOOST_TEST(indexer::select_reference(std::vector<float>{-0.0f, neg_nan, 0.0f, -inf, -inf}, 3, 3, 10) == (v{10, 11, 12}),
             boost::test_tools::per_element());
  BOOST_TEST(indexer::select_reference(std::vector<float>{-inf, neg_nan, 2.0f, -inf}, 2, 2, 10) == (v{11, -1}),
             boost::test_tools::per_element());
  // The bf16 key orders bf16 values as the fp32 key does (the CUDA kernel ranks bf16 scores).
  const std::uint16_t bits[] = {0xFF80, 0xC000, 0x8001, 0x8000, 0x0000, 0x0001, 0x3F80, 0x7F80, 0x7FC0, 0xFFC1, 0x7F81};
  for (std::uint16_t a : bits)
    for (std::uint16_t b : bits) {
      const std::uint32_t ka = numerics::topk_order_key_bf16(a), kb = numerics::topk_order_key_bf16(b);
      const std::uint32_t fa = numerics::topk_order_key(bf16::from_bits(a).to_float());
      const std::uint32_t fb = numerics::topk_order_key(bf16::from_bits(b).to_float());
      BOOST_TEST(((ka < kb) == (fa < fb) && (ka == kb) == (fa == fb)), std::hex << a << " vs " << b);
      BOOST_TEST(ka <= 0xFFFFu);
      BOOST_TEST(ka > 0u);
    }
  BOOST_TEST(numerics::topk_order_key_bf16(0x8000) < numerics::topk_order_key_bf16(0x0000));  // -0 below +0
  BOOST_TEST(numerics::topk_order_key_bf16(0xFFC1) == numerics::topk_order_key_bf16(0x7F81));
  BOOST_TEST(numerics::topk_order_key_bf16(0xFFC1) > numerics::topk_order_key_bf16(0x7F80));
  // Candidate pool: a block holding a NaN has a NaN maximum (torch's max propagates it; the CUDA
  // block maxima use the same key), which outranks even the forced newest block.
  const std::vector<float> c = {1, 2, 3, 4, 5, 6, 7, 8, 0, neg_nan, 0, 0, 9, 9, 9, 9};
  const auto m = indexer::candidate_mask_reference(c, 16, 2, 4);
  for (int t = 0; t < 16; ++t) BOOST_TEST(m[std::size_t(t)] == (t >= 8 ? 1 : 0), "position " << t);
}

// Spec §7: k = min(topk, columns); ascending; indices >= visible become -1 and sit at the end; the
// rest are shifted by the window operand's length.
BOOST_AUTO_TEST_CASE(selection_pads_invisible_slots_with_minus_one) {
  std::vector<float> s = {0.5f, 3.0f, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  const auto idx = indexer::select_reference(s, 4, 2, 128);
  BOOST_TEST(idx == (std::vector<std::int32_t>{128, 129, -1, -1}), boost::test_tools::per_element());
  std::vector<float> t(1000);
  auto rng = test::make_rng(53);
  for (auto& v : t) v = float(rng() % 50);  // many ties
  const auto sel = indexer::select_reference(t, 512, 1000, 0);
  BOOST_TEST(sel.size() == 512u);
  BOOST_TEST(std::is_sorted(sel.begin(), sel.end()));
  float kth = INFINITY;
  for (auto i : sel) kth = std::min(kth, t[std::size_t(i)]);
  int above = 0;
  for (float v : t) above += v > kth;
  BOOST_TEST(above < 512);  // every strictly larger score is selected
  for (std::size_t i = 0; i < t.size(); ++i)  // and ties at the threshold went to the lowest indices
    if (t[i] == kth && !std::binary_search(sel.begin(), sel.end(), std::int32_t(i)))
      for (auto j : sel) BOOST_TEST(!(t[std::size_t(j)] == kth && std::size_t(j) > i));
}

BOOST_AUTO_TEST_CASE(scores_sum_relu_heads_weighted_with_bf16_rounding) {
  // Two heads, four channels; exact small numbers.
  const std::vector<bf16> q = {bf16::from_float(1), bf16::from_float(0), bf16::from_float(0), bf16::from_float(0),
                               bf16::from_float(0), bf16::from_float(1), bf16::from_float(0), bf16::from_float(0)};
  const std::vector<bf16> w = {bf16::from_float(0.5f), bf16::from_float(2.0f)};
  const std::vector<bf16> keys = {bf16::from_float(3), bf16::from_float(-1), bf16::from_float(0), bf16::from_float(0),
                                  bf16::from_float(-2), bf16::from_float(4), bf16::from_float(0), bf16::from_float(0),
                                  bf16::from_float(1), bf16::from_float(1), bf16::from_float(0), bf16::from_float(0)};
  const auto s = indexer::index_scores_reference(q, w, keys, 2, 4, 2);
  BOOST_TEST(s[0] == 1.5f);        // relu(3) * .5 + relu(-1) * 2
  BOOST_TEST(s[1] == 8.0f);        // relu(-2) * .5 + relu(4) * 2
  BOOST_TEST(std::isinf(s[2]));    // not visible yet
  BOOST_TEST(s[2] < 0);
}


// The dot product sums each 32-channel block on its own and then adds the blocks (as the CUDA
// scans do): a tiny block beside a block whose large products cancel keeps its sum. A plain
// channel-by-channel double sum gives 0 here (2^-120 + 2^20 - 2^20); seen on an H100 with key
// block scales 2^-122 and 2^-1.
BOOST_AUTO_TEST_CASE(scores_add_the_blocks_sums_not_the_channels) {
  constexpr int dim = 64;
  std::vector<bf16> q(dim, bf16::from_float(0)), keys(dim, bf16::from_float(0));
  q[0] = q[32] = q[33] = bf16::from_float(1);
  keys[0] = bf16::from_float(0x1p-120f);
  keys[32] = bf16::from_float(0x1p20f), keys[33] = bf16::from_float(-0x1p20f);
  const std::vector<bf16> w = {bf16::from_float(1)};
  const auto s = indexer::index_scores_reference(q, w, keys, 1, dim, 1);
  BOOST_TEST(s[0] == 0x1p-120f);
}
// Spec §7 candidate pool: short contexts keep every visible block; long ones keep topk_blocks blocks,
// always including the newest visible one; Reindex selections stay inside the pool.
BOOST_AUTO_TEST_CASE(candidate_pool_rules) {
  auto rng = test::make_rng(54);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  {
    std::vector<float> s(32);
    for (auto& v : s) v = u(rng);
    for (int t = 30; t < 32; ++t) s[std::size_t(t)] = -INFINITY;  // visible = 30
    const auto m = indexer::candidate_mask_reference(s, 30, 8, 4);
    for (int t = 0; t < 32; ++t) BOOST_TEST(m[std::size_t(t)] == 1);  // 8 blocks of 4 cover all 30 (block 7 partly invisible)
  }
  std::vector<float> s(400);
  for (auto& v : s) v = numerics::round_to_bf16(u(rng));
  const long long visible = 397;
  for (long long t = visible; t < 400; ++t) s[std::size_t(t)] = -INFINITY;
  s[4] = 10.0f;  // block 1 has the largest score
  const auto m = indexer::candidate_mask_reference(s, visible, 8, 4);
  int kept = 0;
  for (int b = 0; b < 100; ++b) kept += m[std::size_t(b * 4)];
  BOOST_TEST(kept == 8);
  BOOST_TEST(m[4] == 1);                        // the best block
  BOOST_TEST(m[std::size_t((visible - 1))] == 1);  // the newest visible block
  std::vector<float> reindex(400);
  for (auto& v : reindex) v = u(rng);
  for (long long t = visible; t < 400; ++t) reindex[std::size_t(t)] = -INFINITY;
  indexer::apply_candidate_mask(reindex, m);
  for (auto i : indexer::select_reference(reindex, 16, visible, 0)) {
    BOOST_TEST(i >= 0);
    BOOST_TEST(m[std::size_t(i)] == 1);
  }
}

BOOST_AUTO_TEST_SUITE_END()
