// Paged global caches: geometry from the schedule (890 B/token exactly), allocation, addresses.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <set>
#include <vector>

#include "dsv4/cache/paged_cache.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/random.hpp"

using namespace dsv4;
using geo = cache::page_geometry<models::v41_flash, 256>;

BOOST_AUTO_TEST_SUITE(cache_suite)

BOOST_AUTO_TEST_CASE(v41_pages_hold_exactly_890_bytes_per_token) {
  BOOST_TEST(geo::owners == 4);
  BOOST_TEST(geo::page_bytes == 256 * 890);
  BOOST_TEST(geo::regions[0].layer == 2);
  BOOST_TEST(geo::regions[0].entries_per_page == 128);  // ratio 2
  BOOST_TEST(geo::regions[3].layer == 20);
  BOOST_TEST(geo::regions[3].entries_per_page == 256);  // ratio 1
  for (const auto& r : geo::regions) {
    BOOST_TEST(r.main_offset % 16 == 0);
    BOOST_TEST(r.key_offset % 16 == 0);
  }
  // Reuse and Reindex layers map to their owner's region; local layers to none.
  BOOST_TEST(geo::region_of_layer(7) == 0);
  BOOST_TEST(geo::region_of_layer(13) == 1);
  BOOST_TEST(geo::region_of_layer(36) == 3);
  BOOST_TEST(geo::region_of_layer(0) == -1);
  using tiny_geo = cache::page_geometry<models::tiny, 64>;
  BOOST_TEST(tiny_geo::page_bytes == 64 * 265);
}

BOOST_AUTO_TEST_CASE(allocation_overhead_is_only_the_last_page_tail) {
  cache::page_allocator alloc(4096, geo::page_tokens, geo::page_bytes);
  const int a = alloc.add_sequence();
  alloc.append(a, 131072 - 100);  // 128K tokens less a partial page
  alloc.append(a, 100);
  cache::cache_usage u = alloc.usage();
  BOOST_TEST(u.bytes_per_token() == 890.0);
  const int b = alloc.add_sequence();
  alloc.append(b, 131073);  // one token into a new page
  u = alloc.usage();
  const double overhead = u.bytes_per_token() / 890.0 - 1.0;
  BOOST_TEST(overhead > 0.0);
  BOOST_TEST(overhead < 0.01);  // under 1% at 128K tokens
  alloc.release(a);
  BOOST_TEST(alloc.free_pages() == 4096 - 513);
  BOOST_CHECK_THROW(alloc.block_table(a), dsv4::error);
}

BOOST_AUTO_TEST_CASE(exhaustion_is_a_clear_error_and_takes_nothing) {
  cache::page_allocator alloc(10, 256, geo::page_bytes);
  const int a = alloc.add_sequence();
  alloc.append(a, 2000);  // 8 pages
  try {
    alloc.append(a, 1000);
    BOOST_FAIL("expected an error");
  } catch (const dsv4::error& e) {
    BOOST_TEST(std::string(e.what()).find("needs 4 more pages of 256 tokens but only 2 of 10 are free") != std::string::npos);
  }
  BOOST_TEST(alloc.free_pages() == 2);
  BOOST_TEST(alloc.tokens(a) == 2000);
}

// A rolled-back round (truncate): the pages past the kept tokens return to the pool, and the next
// append takes the same pages back in the same order; keeping more than the sequence holds fails.
BOOST_AUTO_TEST_CASE(truncate_returns_the_pages_past_the_kept_tokens) {
  cache::page_allocator alloc(10, 256, geo::page_bytes);
  const int a = alloc.add_sequence();
  alloc.append(a, 600);  // 3 pages
  const auto before = alloc.block_table(a);
  alloc.append(a, 700);  // 1300 tokens: 6 pages
  const auto grown = alloc.block_table(a);
  alloc.truncate(a, 600);
  BOOST_TEST(alloc.tokens(a) == 600);
  BOOST_TEST(alloc.block_table(a) == before);
  BOOST_TEST(alloc.free_pages() == 7);
  alloc.append(a, 700);
  BOOST_TEST(alloc.block_table(a) == grown);
  alloc.truncate(a, 512);  // exactly two pages
  BOOST_TEST(alloc.block_table(a).size() == 2u);
  alloc.truncate(a, 0);
  BOOST_TEST(alloc.free_pages() == 10);
  BOOST_CHECK_THROW(alloc.truncate(a, 1), dsv4::error);
  BOOST_CHECK_THROW(alloc.truncate(a, -1), dsv4::error);
}

// Many sequences of random lengths: every entry of every owner has its own bytes, inside the pool.
BOOST_AUTO_TEST_CASE(entries_never_overlap) {
  auto rng = test::make_rng(70);
  const int pages = 64;
  cache::page_allocator alloc(pages, geo::page_tokens, geo::page_bytes);
  std::vector<int> ids;
  for (int s = 0; s < 6; ++s) {
    ids.push_back(alloc.add_sequence());
    alloc.append(ids.back(), 1 + long(rng() % 2000));
  }
  alloc.release(ids[2]);  // a hole that the next sequence reuses
  ids[2] = alloc.add_sequence();
  alloc.append(ids[2], 777);
  std::set<long long> starts;
  const std::vector<std::uint8_t> pool(std::size_t(pages) * geo::page_bytes);
  const std::uint8_t* base = pool.data();
  std::size_t count = 0;
  for (int id : ids)
    for (const auto& r : geo::regions)
      for (int kind = 0; kind < 2; ++kind) {
        cache::paged_view v{base, alloc.block_table(id).data(), geo::page_bytes, kind ? r.key_offset : r.main_offset,
                            kind ? geo::key_bytes : geo::main_bytes, r.entries_per_page};
        const long long entries = alloc.tokens(id) / r.ratio;
        for (long long g = 0; g < entries; ++g) {
          const long long off = v.entry(g) - base;
          BOOST_REQUIRE(off >= 0);
          BOOST_REQUIRE(off + v.entry_bytes <= pages * geo::page_bytes);
          BOOST_REQUIRE(starts.insert(off).second);
          ++count;
        }
      }
  BOOST_TEST(count == starts.size());
}

BOOST_AUTO_TEST_SUITE_END()
