// The parity tooling's I/O: .npy float32 matrices (logits files) and the `scaled` random
// checkpoint (the parity tests' weights: trained-model statistics, reproducible from the seed).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using dsv4::test::throws_with;
namespace fs = std::filesystem;

namespace {
std::string scratch(const std::string& name) {
  const auto p = fs::temp_directory_path() / "dsv4_test_parity_io" / name;
  fs::remove_all(p);
  fs::create_directories(p.parent_path());
  return p.string();
}
}  // namespace

BOOST_AUTO_TEST_SUITE(parity_io)

BOOST_AUTO_TEST_CASE(npy_round_trip_and_errors) {
  io::npy_matrix m{.rows = 3, .cols = 5, .data = {}};
  for (int i = 0; i < 15; ++i) m.data.push_back(float(i) * 0.25f - 1.0f);
  m.data[7] = -0.0f;
  const std::string path = scratch("m.npy");
  io::write_npy_f32(path, m);
  // NumPy's layout: magic, version 1.0, header padded so the data starts at a multiple of 64.
  BOOST_TEST(fs::file_size(path) == 128u + 15u * 4u);
  const auto r = io::read_npy_f32(path);
  BOOST_TEST((r.rows == 3 && r.cols == 5));
  BOOST_TEST(std::memcmp(r.data.data(), m.data.data(), 15 * 4) == 0);  // bit for bit, -0 included
  BOOST_TEST(r.row(2)[4] == 2.5f);
  BOOST_TEST(throws_with([&] { io::write_npy_f32(path, {.rows = 2, .cols = 2, .data = {1.0f}}); }, "1 values for a 2 x 2 array"));
  BOOST_TEST(throws_with([&] { io::read_npy_f32(scratch("missing.npy")); }, "cannot open"));
  const std::string bad = scratch("bad.npy");
  std::ofstream(bad) << "not numpy";
  BOOST_TEST(throws_with([&] { io::read_npy_f32(bad); }, "not a .npy file"));
  // A float64 array is refused with what it holds.
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  {
    std::ofstream f(bad, std::ios::binary);
    f.write("\x93NUMPY\x01\x00", 8);
    const char len[2] = {char(header.size()), 0};
    f.write(len, 2);
    f << header;
    f.write("0123456789abcdef", 16);
  }
  BOOST_TEST(throws_with([&] { io::read_npy_f32(bad); }, "expected little-endian float32"));
}

// `scaled` weights: reproducible, quantized consistently with their scales, with the intended
// statistics: a linear's dequantized weights have std ~ gain / sqrt(K), norm weights sit at their
// means, vectors are 0.5 N(0, 1).
BOOST_AUTO_TEST_CASE(scaled_random_checkpoint) {
  const auto schema = models::checkpoint_schema<models::tiny>();
  const std::string dir = scratch("scaled"), dir2 = scratch("scaled2");
  io::write_random_checkpoint(schema, dir, 64u << 20, 5, io::random_init::scaled);
  io::write_random_checkpoint(schema, dir2, 64u << 20, 5, io::random_init::scaled);
  io::checkpoint ck(dir), ck2(dir2);
  BOOST_CHECK_NO_THROW(ck.validate(schema));
  for (const char* name : {"layers.3.attn.wq_b.weight", "layers.3.attn.wq_b.scale", "layers.7.ffn.experts.1.w2.weight",
                           "layers.1.engram.embed.scale", "head.weight"}) {
    const auto& a = ck.tensor(name);
    const auto& b = ck2.tensor(name);
    BOOST_TEST(std::equal(a.bytes.begin(), a.bytes.end(), b.bytes.begin(), b.bytes.end()), name);
  }
  // wq_b [4 x 128, 64]: FP8 codes times their 32 x 32 tile's power-of-two scale.
  const auto& w = ck.tensor("layers.3.attn.wq_b.weight");
  const auto& s = ck.tensor("layers.3.attn.wq_b.scale");
  const long long n = w.shape[0], k = w.shape[1];
  double sum_sq = 0, amax = 0;
  bool tile_uses_range = true;
  for (long long br = 0; br < n / 32; ++br)
    for (long long bc = 0; bc < k / 32; ++bc) {
      const float scale = std::ldexp(1.0f, int(std::to_integer<int>(s.bytes[std::size_t(br * (k / 32) + bc)])) - 127);
      double tile_max = 0;
      for (long long r = br * 32; r < br * 32 + 32; ++r)
        for (long long c = bc * 32; c < bc * 32 + 32; ++c) {
          const double v = numerics::decode<numerics::e4m3>(std::to_integer<std::uint8_t>(w.bytes[std::size_t(r * k + c)])) * scale;
          sum_sq += v * v;
          tile_max = std::max(tile_max, std::fabs(v));
        }
      tile_uses_range &= tile_max >= 224 * scale && tile_max <= 448 * scale;  // the scale is the smallest that fits
      amax = std::max(amax, tile_max);
    }
  const double stdev = std::sqrt(sum_sq / double(n * k)), want = 0.95 / std::sqrt(double(k));
  BOOST_TEST(std::fabs(stdev / want - 1) < 0.05, "wq_b std " << stdev << ", want " << want);
  BOOST_TEST(tile_uses_range);
  // Norm weights: mean x (1 + 0.1 N(0, 1)); attn_norm's mean is 0.025.
  auto bf16_mean = [&](const std::string& name) {
    const auto& t = ck.tensor(name);
    double sum = 0;
    for (std::size_t i = 0; i < t.bytes.size(); i += 2) {
      std::uint16_t bits;
      std::memcpy(&bits, &t.bytes[i], 2);
      sum += numerics::bf16::from_bits(bits).to_float();
    }
    return sum / double(t.bytes.size() / 2);
  };
  BOOST_TEST(std::fabs(bf16_mean("layers.5.attn_norm.weight") / 0.025 - 1) < 0.03);
  BOOST_TEST(std::fabs(bf16_mean("layers.5.ffn_norm.weight") / 0.2 - 1) < 0.03);
  BOOST_TEST(std::fabs(bf16_mean("norm.weight") - 1) < 0.03);
  // FP4 expert scales: near gain / (3.2 sqrt(K)) = 1.5 / (3.2 x 16), i.e. 2^-5, give or take one binade.
  const auto& es = ck.tensor("layers.4.ffn.experts.0.w1.scale");
  for (std::byte b : es.bytes) BOOST_TEST((std::to_integer<int>(b) >= 127 - 6 && std::to_integer<int>(b) <= 127 - 4));
  BOOST_TEST(throws_with([] { io::parse_random_init("gaussian"); }, "unknown random initialisation 'gaussian'"));
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

// Large tensors (V4.1's projections, experts, embeddings) are drawn in chunks on every core: the
// bytes are still a function of the seed alone, the chunks are not copies of one another, and the
// statistics are those of the small tensors' single stream.
BOOST_AUTO_TEST_CASE(scaled_large_tensors_drawn_in_parallel) {
  using io::st_dtype;
  const long long n = 2048, k = 2048;  // 4 Mi values: the parallel path
  static_assert(std::size_t(n * k) >= io::detail::parallel_elements);
  const std::vector<io::tensor_spec> schema = {
      {"layers.0.attn.wq_b.weight", {n, k}, {st_dtype::F8_E4M3}},
      {"layers.0.attn.wq_b.scale", {n / 32, k / 32}, {st_dtype::F8_E8M0}},
      {"layers.0.ffn.experts.0.w1.weight", {n, k}, {st_dtype::I8}},
      {"layers.0.ffn.experts.0.w1.scale", {n, 2 * k / 32}, {st_dtype::F8_E8M0}},
      {"embed.weight", {n, k}, {st_dtype::BF16}},
  };
  const std::string dir = scratch("large"), dir2 = scratch("large2");
  io::write_random_checkpoint(schema, dir, 64u << 20, 9, io::random_init::scaled);
  io::write_random_checkpoint(schema, dir2, 64u << 20, 9, io::random_init::scaled);
  io::checkpoint ck(dir), ck2(dir2);
  for (const auto& t : schema) {
    const auto& a = ck.tensor(t.name);
    const auto& b = ck2.tensor(t.name);
    BOOST_TEST(std::equal(a.bytes.begin(), a.bytes.end(), b.bytes.begin(), b.bytes.end()), t.name);
    // Chunk 0 and chunk 1 (2^20 values each) come from different generators.
    const std::size_t chunk_bytes = io::detail::chunk_elements * std::size_t(io::dtype_bytes(t.dtypes.front()));
    if (a.bytes.size() >= 2 * chunk_bytes)
      BOOST_TEST(!std::equal(a.bytes.begin(), a.bytes.begin() + std::ptrdiff_t(chunk_bytes), a.bytes.begin() + std::ptrdiff_t(chunk_bytes)),
                 t.name);
  }
  const auto& w = ck.tensor("layers.0.attn.wq_b.weight");
  const auto& s = ck.tensor("layers.0.attn.wq_b.scale");
  double sum_sq = 0;
  for (long long r = 0; r < n; ++r)
    for (long long c = 0; c < k; ++c) {
      const float scale = std::ldexp(1.0f, int(std::to_integer<int>(s.bytes[std::size_t((r / 32) * (k / 32) + c / 32)])) - 127);
      const double v = numerics::decode<numerics::e4m3>(std::to_integer<std::uint8_t>(w.bytes[std::size_t(r * k + c)])) * scale;
      sum_sq += v * v;
    }
  const double want = 0.95 / std::sqrt(double(k));
  BOOST_TEST(std::fabs(std::sqrt(sum_sq / double(n * k)) / want - 1) < 0.02);
  const auto& e = ck.tensor("embed.weight");
  double esum = 0, esq = 0;
  for (std::size_t i = 0; i < e.bytes.size(); i += 2) {
    std::uint16_t bits;
    std::memcpy(&bits, &e.bytes[i], 2);
    const double v = numerics::bf16::from_bits(bits).to_float();
    esum += v, esq += v * v;
  }
  const double count = double(e.bytes.size() / 2);
  BOOST_TEST(std::fabs(esum / count) < 1e-3);
  BOOST_TEST(std::fabs(std::sqrt(esq / count) / 0.12 - 1) < 0.02);
}

BOOST_AUTO_TEST_SUITE_END()
