// Engram forward (spec §10) on a small configuration: masking, gating, the shared value.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dsv4/engram/host_table.hpp"
#include "dsv4/engram/reference.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "support/random.hpp"

using namespace dsv4;
using numerics::bf16;

namespace {
engram::engram_weights make_weights(std::mt19937_64& rng) {
  engram::engram_weights w;
  w.dim = 64;
  w.head_dim = 32;
  w.columns = 6;  // (4 - 1) orders x 2 heads
  w.rows = 50;
  const int k = w.columns * w.head_dim, n = w.dim * (w.hc + 1);
  auto code = [&] { return std::uint8_t(rng() % 0x7E) | std::uint8_t(rng() % 2 ? 0x80 : 0); };  // finite E4M3
  w.embed.resize(std::size_t(w.rows) * w.head_dim);
  for (auto& c : w.embed) c = code();
  w.embed_scale.assign(std::size_t(w.rows), 127 - 6);
  w.wkv.resize(std::size_t(n) * k);
  for (auto& c : w.wkv) c = code();
  w.wkv_scale.assign(std::size_t((n + 31) / 32) * (k / 32), 127 - 8);
  std::normal_distribution<float> d(0.0f, 1.0f);
  w.q_weight.resize(std::size_t(w.hc) * w.dim);
  w.k_weight.resize(w.q_weight.size());
  for (auto& v : w.q_weight) v = numerics::round_to_bf16(d(rng));
  for (auto& v : w.k_weight) v = numerics::round_to_bf16(d(rng));
  return w;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(engram_forward)

// Steps 4-5 recomputed independently in double from the module's own value and key (the kv split:
// key = kv[:4 * dim] copy-major) for one token; the gates agree to fp32 precision.
// The host half of host-memory tables: a call's rows packed in order, each (token, column) given
// its row's place in the pack, ids outside the table -1 with zero rows; the same pack on one
// thread and split over several.
BOOST_AUTO_TEST_CASE(host_table_rows_are_packed_in_order) {
  auto rng = dsv4::test::make_rng(21);
  const int head_dim = 64;
  const long long rows = 1000;
  std::vector<std::uint8_t> embed(std::size_t(rows) * head_dim), scale(std::size_t(rows) * head_dim / 32);
  for (auto& b : embed) b = std::uint8_t(rng());
  for (auto& b : scale) b = std::uint8_t(rng());
  const dsv4::engram::host_table t{embed.data(), scale.data(), rows, head_dim};
  std::vector<std::int64_t> ids(10000);
  for (auto& id : ids) id = std::int64_t(rng() % 1100) - 50;  // some below 0, some past the table
  for (unsigned threads : {1u, 3u}) {
    std::vector<std::uint8_t> codes(ids.size() * head_dim, 0xAA), scales(ids.size() * head_dim / 32, 0xAA);
    std::vector<std::int64_t> packed(ids.size(), 77);
    dsv4::engram::gather_rows(t, ids, codes.data(), scales.data(), packed.data(), threads);
    std::size_t outside = 0, bad = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const bool in = ids[i] >= 0 && ids[i] < rows;
      outside += !in;
      bad += packed[i] != (in ? std::int64_t(i) : -1);
      for (int d = 0; d < head_dim; ++d)
        bad += codes[i * head_dim + std::size_t(d)] != (in ? embed[std::size_t(ids[i]) * head_dim + std::size_t(d)] : 0);
      for (int d = 0; d < head_dim / 32; ++d)
        bad += scales[i * (head_dim / 32) + std::size_t(d)] != (in ? scale[std::size_t(ids[i]) * (head_dim / 32) + std::size_t(d)] : 0);
    }
    BOOST_TEST(outside > 0u);
    BOOST_TEST(bad == 0u, "threads " << threads);
  }
  BOOST_CHECK_THROW(dsv4::engram::gather_rows({embed.data(), scale.data(), rows, 48}, ids, nullptr, nullptr, nullptr), dsv4::error);
}

BOOST_AUTO_TEST_CASE(gates_follow_the_per_stream_formula) {
  auto rng = test::make_rng(112);
  const auto w = make_weights(rng);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(w.hc) * w.dim);
  for (auto& v : x) v = bf16::from_float(d(rng));
  const std::vector<std::int64_t> hashes = {3, 9, 27, 30, 41, 0};
  const auto mix = engram::engram_gates_reference(w, x, hashes, false);
  // Rebuild kv exactly as step 1-2 do, through the public pieces.
  const int k = w.columns * w.head_dim, n = w.dim * (w.hc + 1);
  std::vector<bf16> e(static_cast<std::size_t>(k));
  for (int c = 0; c < w.columns; ++c)
    for (int j = 0; j < w.head_dim; ++j)
      e[std::size_t(c) * w.head_dim + j] = bf16::from_float(
          numerics::decode<numerics::e4m3>(w.embed[std::size_t(hashes[c]) * w.head_dim + j]) *
          numerics::decode<numerics::ue8m0>(w.embed_scale[std::size_t(hashes[c]) * (w.head_dim / 32) + j / 32]));
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(k)), scales(static_cast<std::size_t>(k / 32));
  numerics::quantize_vector<numerics::fp8_act_format>(e, codes, scales);
  const auto kv = kernels::gemm::fp8_gemm_reference({1, n, k}, codes, scales, w.wkv, w.wkv_scale);
  for (int d2 = 0; d2 < w.dim; ++d2) BOOST_TEST(mix.value[d2].bits == kv[std::size_t(w.hc) * w.dim + d2].bits);
  for (int c = 0; c < w.hc; ++c) {
    double hh = 0, kk = 0, dot = 0;
    for (int j = 0; j < w.dim; ++j) {
      const double h = x[std::size_t(c) * w.dim + j].to_float(), key = kv[std::size_t(c) * w.dim + j].to_float();
      const double wq = double(w.q_weight[std::size_t(c) * w.dim + j]) * w.k_weight[std::size_t(c) * w.dim + j];
      hh += h * h;
      kk += key * key;
      dot += h * wq * key;
    }
    const double dc = dot / std::sqrt(hh / w.dim) / std::sqrt(kk / w.dim) / std::sqrt(double(w.dim));
    const double want = 1.0 / (1.0 + std::exp(-std::copysign(std::sqrt(std::max(std::fabs(dc), 1e-6)), dc)));
    BOOST_TEST(std::fabs(mix.gates[std::size_t(c)] - want) < 2e-6, "stream " << c);
  }
}

BOOST_AUTO_TEST_CASE(image_tokens_pass_through_and_text_tokens_are_gated) {
  auto rng = test::make_rng(110);
  const auto w = make_weights(rng);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(w.hc) * w.dim);
  for (auto& v : x) v = bf16::from_float(d(rng));
  const std::vector<std::int64_t> hashes = {0, 7, 13, 21, 34, 49};
  std::vector<bf16> img = x;
  engram::engram_forward_reference(w, img, hashes, true);
  for (std::size_t i = 0; i < x.size(); ++i) BOOST_TEST(img[i].bits == x[i].bits);  // gate 0: unchanged
  std::vector<bf16> txt = x;
  engram::engram_forward_reference(w, txt, hashes, false);
  // Every stream moves along the same value vector, scaled by its own gate in (0, 1).
  std::vector<double> gate(std::size_t(w.hc));
  int changed = 0;
  for (int c = 0; c < w.hc; ++c) {
    double num = 0, den = 0;
    for (int dd = 0; dd < w.dim; ++dd) {
      const double delta = double(txt[c * w.dim + dd].to_float()) - x[c * w.dim + dd].to_float();
      const double ref = double(txt[0 * w.dim + dd].to_float()) - x[0 * w.dim + dd].to_float();
      num += delta * ref;
      den += ref * ref;
      changed += txt[c * w.dim + dd].bits != x[c * w.dim + dd].bits;
    }
    gate[std::size_t(c)] = num / den;  // gate_c / gate_0 (least squares)
  }
  BOOST_TEST(changed > 0);
  for (int c = 1; c < w.hc; ++c) BOOST_TEST((gate[std::size_t(c)] > 0.0 && gate[std::size_t(c)] < 1e3));
  const std::vector<std::int64_t> bad = {0, 7, 13, 21, 34, 50};
  BOOST_CHECK_THROW(engram::engram_forward_reference(w, txt, bad, false), dsv4::error);  // row outside the table
}

// A zero key weight makes dot = 0: every gate is sigmoid(+0.001), the signed square root's floor,
// and the update is bf16(x + gate * value) for every stream.
BOOST_AUTO_TEST_CASE(zero_dot_gives_the_floor_gate) {
  auto rng = test::make_rng(111);
  auto w = make_weights(rng);
  std::fill(w.k_weight.begin(), w.k_weight.end(), 0.0f);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(w.hc) * w.dim);
  for (auto& v : x) v = bf16::from_float(d(rng));
  const std::vector<std::int64_t> hashes = {1, 2, 3, 4, 5, 6};
  const auto mix = engram::engram_gates_reference(w, x, hashes, false);
  const float floor_gate = 1.0f / (1.0f + std::exp(-std::sqrt(1e-6f)));
  for (float g : mix.gates) BOOST_TEST(g == floor_gate);
  std::vector<bf16> y = x;
  engram::engram_forward_reference(w, y, hashes, false);
  for (int c = 0; c < w.hc; ++c)
    for (int dd = 0; dd < w.dim; ++dd)
      BOOST_TEST(y[c * w.dim + dd].bits ==
                 bf16::from_float(x[c * w.dim + dd].to_float() + floor_gate * mix.value[dd].to_float()).bits);
  BOOST_TEST(engram::engram_gates_reference(w, x, hashes, true).gates == std::vector<float>(4, 0.0f),
             boost::test_tools::per_element());
}

BOOST_AUTO_TEST_SUITE_END()
