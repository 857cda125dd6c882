// Cutting a full checkpoint into rank checkpoints (parallel/shard_checkpoint.hpp) on tiny's random
// checkpoint: W = 1 is the checkpoint itself; at W = 2 the ranks' pieces put back together are
// the full tensors byte for byte (rows concatenated, columns interleaved, experts on one rank,
// Engram tables without their padding), and the padding is zero codes with scale 1.0.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/parallel/shard_checkpoint.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using parallel::shard_kind;
using tiny = models::tiny;

namespace {
std::vector<std::uint8_t> bytes_of(io::checkpoint& ck, const std::string& name) {
  const auto& v = ck.tensor(name);
  const auto* p = reinterpret_cast<const std::uint8_t*>(v.bytes.data());
  return {p, p + v.bytes.size()};
}
}  // namespace

BOOST_AUTO_TEST_SUITE(shard_checkpoint)

BOOST_AUTO_TEST_CASE(rank_pieces_reassemble_the_checkpoint) {
  const auto schema = models::checkpoint_schema<tiny>();
  io::checkpoint full = io::random_checkpoint_in_memory(schema, 23, io::random_init::scaled);
  io::checkpoint one = parallel::shard_checkpoint(full, schema, 1, 0, tiny::dims);
  BOOST_TEST(one.size() == full.size());
  for (const auto& t : schema)
    if (full.contains(t.name)) BOOST_TEST((bytes_of(one, t.name) == bytes_of(full, t.name)), t.name);

  constexpr int W = 2;
  std::vector<io::checkpoint> rank;
  for (int r = 0; r < W; ++r) rank.push_back(parallel::shard_checkpoint(full, schema, W, r, tiny::dims));
  int split = 0, experts = 0, padded = 0;
  for (const auto& t : schema) {
    if (!full.contains(t.name)) continue;
    const auto& v = full.tensor(t.name);
    const auto want = bytes_of(full, t.name);
    const auto plan = parallel::shard_of(t, v.shape, W, 0, tiny::dims);
    std::vector<std::uint8_t> got;
    switch (plan.kind) {
      case shard_kind::replicated:
        for (int r = 0; r < W; ++r) BOOST_TEST((bytes_of(rank[std::size_t(r)], t.name) == want), t.name);
        continue;
      case shard_kind::expert: {
        int holders = 0;
        for (int r = 0; r < W; ++r)
          if (rank[std::size_t(r)].contains(t.name)) ++holders, got = bytes_of(rank[std::size_t(r)], t.name);
        BOOST_TEST(holders == 1, t.name);
        ++experts;
        break;
      }
      case shard_kind::split_rows:
        for (int r = 0; r < W; ++r) {
          const auto part = bytes_of(rank[std::size_t(r)], t.name);
          got.insert(got.end(), part.begin(), part.end());
        }
        ++split;
        break;
      case shard_kind::split_cols: {
        const std::size_t rows = std::size_t(v.shape[0]), row_bytes = want.size() / rows;
        std::vector<std::vector<std::uint8_t>> parts;
        for (int r = 0; r < W; ++r) parts.push_back(bytes_of(rank[std::size_t(r)], t.name));
        for (std::size_t i = 0; i < rows; ++i)
          for (const auto& p : parts) {
            const std::size_t w = p.size() / rows;
            got.insert(got.end(), p.begin() + std::ptrdiff_t(i * w), p.begin() + std::ptrdiff_t((i + 1) * w));
          }
        BOOST_TEST(got.size() == rows * row_bytes);
        ++split;
        break;
      }
      case shard_kind::rows_padded: {
        const std::size_t row_bytes = want.size() / std::size_t(v.shape[0]);
        for (int r = 0; r < W; ++r) {
          const auto s = parallel::shard_of(t, v.shape, W, r, tiny::dims);
          const auto part = bytes_of(rank[std::size_t(r)], t.name);
          const std::size_t real = std::size_t(s.shape[0] - s.pad_rows) * row_bytes;
          got.insert(got.end(), part.begin(), part.begin() + std::ptrdiff_t(real));
          const std::uint8_t fill = v.dtype == io::st_dtype::F8_E8M0 ? 127 : 0;
          BOOST_TEST(std::all_of(part.begin() + std::ptrdiff_t(real), part.end(), [&](std::uint8_t b) { return b == fill; }), t.name);
          padded += s.pad_rows > 0;
        }
        break;
      }
    }
    BOOST_TEST((got == want), t.name);
  }
  BOOST_TEST(split > 0);
  BOOST_TEST(experts > 0);
  BOOST_TEST_MESSAGE("tiny at W = 2: " << split << " split tensors, " << experts << " experts, " << padded
                                       << " padded Engram slices");
}

// An Engram table whose rows W does not divide: the last rank's tail is padding.
BOOST_AUTO_TEST_CASE(engram_tail_is_padded) {
  const std::vector<io::tensor_spec> schema = {{"layers.1.engram.embed.weight", {9, 64}, {io::st_dtype::F8_E4M3}},
                                               {"layers.1.engram.embed.scale", {9, 2}, {io::st_dtype::F8_E8M0}}};
  io::checkpoint full = io::random_checkpoint_in_memory(schema, 5, io::random_init::codes);
  std::vector<std::uint8_t> table;
  for (int r = 0; r < 2; ++r) {
    io::checkpoint part = parallel::shard_checkpoint(full, schema, 2, r, tiny::dims);
    const auto w = bytes_of(part, "layers.1.engram.embed.weight"), sc = bytes_of(part, "layers.1.engram.embed.scale");
    BOOST_TEST(w.size() == 5u * 64u);  // ceil(9 / 2) rows each
    BOOST_TEST(sc.size() == 5u * 2u);
    if (r == 1) {
      BOOST_TEST(std::all_of(w.end() - 64, w.end(), [](std::uint8_t b) { return b == 0; }));
      BOOST_TEST(std::all_of(sc.end() - 2, sc.end(), [](std::uint8_t b) { return b == 127; }));
    }
    table.insert(table.end(), w.begin(), w.begin() + (r == 0 ? 5 : 4) * 64);
  }
  BOOST_TEST((table == bytes_of(full, "layers.1.engram.embed.weight")));
}

BOOST_AUTO_TEST_CASE(problems_are_named) {
  const auto schema = models::checkpoint_schema<tiny>();
  io::checkpoint partial = io::checkpoint::in_memory();
  partial.add("norm.weight", io::st_dtype::BF16, {tiny::dims.dim}, std::vector<std::uint8_t>(std::size_t(tiny::dims.dim) * 2));
  BOOST_TEST(dsv4::test::throws_with([&] { parallel::shard_checkpoint(partial, schema, 2, 0, tiny::dims); },
                                     "the checkpoint has no tensor 'embed.weight'"));
  io::checkpoint full = io::random_checkpoint_in_memory(schema, 23, io::random_init::codes);
  BOOST_TEST(dsv4::test::throws_with([&] { parallel::shard_checkpoint(full, schema, 4, 0, tiny::dims); }, "world size 4"));
}

BOOST_AUTO_TEST_SUITE_END()
