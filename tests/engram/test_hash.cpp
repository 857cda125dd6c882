// Engram hashing (spec §10): prime layout, multipliers, blocking, history across calls.

#include <boost/test/unit_test.hpp>

#include <vector>

#include "dsv4/engram/hash.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/data.hpp"

using namespace dsv4;

BOOST_AUTO_TEST_SUITE(engram_hash)

// The first primes of each (order) of layer 1, and the sums, as the spec lists them.
BOOST_AUTO_TEST_CASE(v41_prime_layout) {
  const auto& e = models::v41_flash::dims.engram;
  const auto h = engram::hash_layout::make(2, e.engram_vocab_size, e.engram_max_ngram_size, e.engram_n_heads);
  BOOST_TEST(h.columns() == 24);
  const std::vector<std::int64_t> order2 = {16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183};
  BOOST_TEST(std::vector<std::int64_t>(h.primes.begin(), h.primes.begin() + 8) == order2, boost::test_tools::per_element());
  BOOST_TEST(h.primes[24] == 16000477);  // layer 14 order 2 head 0
  BOOST_TEST(h.primes[47] == 16000889);
  std::int64_t sum1 = 0, sum2 = 0;
  for (int i = 0; i < 24; ++i) sum1 += h.primes[i], sum2 += h.primes[24 + i];
  BOOST_TEST(sum1 == models::v41_flash::engram_num_embeddings[0]);
  BOOST_TEST(sum2 == models::v41_flash::engram_num_embeddings[1]);
  BOOST_TEST(h.offsets[0] == 0);
  BOOST_TEST(h.offsets[1] == 16000057);
  BOOST_TEST(h.offsets[24] == 0);  // offsets restart per layer
}

// The V4.1 multipliers in the dsv4 config equal the reference MANIFEST's (computed by engram.py).
BOOST_AUTO_TEST_CASE(v41_multipliers_match_the_manifest) {
  const auto j = io::parse_json_file(test::data_path("reference/MANIFEST.json"));
  const auto& m = j.object().at("engram_multipliers").object();
  for (int l = 0; l < 2; ++l) {
    const auto& arr = m.at(l == 0 ? "1" : "14").array();
    BOOST_REQUIRE(arr.size() == 4u);
    for (int k = 0; k < 4; ++k) BOOST_TEST(arr[k].integer == models::v41_flash::engram_multipliers[l][k]);
  }
}

// A small layout by hand: max_ngram 4, one head, so three tables: the primes above 9 are 11, 13, 17.
BOOST_AUTO_TEST_CASE(hashes_by_hand_with_blocking) {
  const auto h = engram::hash_layout::make(1, 10, 4, 1);
  BOOST_TEST(h.primes == (std::vector<std::int64_t>{11, 13, 17}), boost::test_tools::per_element());
  const std::vector<std::int64_t> mult = {3, 5, 7, 9};
  std::vector<std::int64_t> map(10);
  for (int i = 0; i < 10; ++i) map[std::size_t(i)] = 100 + i;  // compressed ids; pad id 2 -> 102
  std::vector<std::int64_t> history;
  const std::vector<std::int32_t> ids = {4, 5, 6};
  const auto out = engram::hash_tokens(h, 0, mult, ids, {}, map, 2, history, 0);
  auto expect = [&](std::int64_t t0, std::int64_t t1, std::int64_t t2, std::int64_t t3) {
    const std::int64_t p0 = t0 * 3, p1 = t1 * 5, p2 = t2 * 7, p3 = t3 * 9;
    std::int64_t r = p0 ^ p1;
    std::vector<std::int64_t> v = {r % 11};
    r ^= p2;
    v.push_back(r % 13 + 11);
    r ^= p3;
    v.push_back(r % 17 + 24);
    return v;
  };
  // Position 0: shifts 1..3 are before the start: padded. Position 2: shift 3 padded.
  BOOST_TEST(std::vector<std::int64_t>(out.begin(), out.begin() + 3) == expect(104, 102, 102, 102), boost::test_tools::per_element());
  BOOST_TEST(std::vector<std::int64_t>(out.begin() + 6, out.begin() + 9) == expect(106, 105, 104, 102), boost::test_tools::per_element());
  // A decode step sees the prefill's history; an image token (masked) blocks what lies behind it.
  const std::vector<std::int32_t> one = {7};
  const auto d = engram::hash_tokens(h, 0, mult, one, {}, map, 2, history, 3);
  BOOST_TEST(d == expect(107, 106, 105, 104), boost::test_tools::per_element());
  const std::vector<std::uint8_t> masked = {0};
  const auto img = engram::hash_tokens(h, 0, mult, one, masked, map, 2, history, 4);
  BOOST_TEST(img == expect(102, 102, 102, 102), boost::test_tools::per_element());  // DEAD current token: all pad
  const auto after = engram::hash_tokens(h, 0, mult, one, {}, map, 2, history, 5);
  BOOST_TEST(after == expect(107, 102, 102, 102), boost::test_tools::per_element());  // blocked behind the image
  BOOST_CHECK_THROW(engram::hash_tokens(h, 0, mult, one, {}, map, 2, history, 3), dsv4::error);  // not continuing
  const std::vector<std::int32_t> bad = {10};
  BOOST_CHECK_THROW(engram::hash_tokens(h, 0, mult, bad, {}, map, 2, history, 6), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
