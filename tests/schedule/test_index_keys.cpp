// The reference's index-key quirk (spec §7) as a named policy; the default follows ownership.

#include <boost/test/unit_test.hpp>

#include "dsv4/models/v41_flash.hpp"
#include "dsv4/schedule/index_keys.hpp"

using namespace dsv4::schedule;
using v41 = dsv4::models::v41_flash::schedule;

BOOST_AUTO_TEST_SUITE(index_keys)

BOOST_AUTO_TEST_CASE(ownership_is_the_default_everywhere) {
  for (int layer : v41::index_producers)
    for (long long pos : {1000ll, 1001ll, 5000ll, 5001ll}) {
      const auto k = decode_index_keys<v41>(layer, pos, index_key_policy::follow_ownership);
      BOOST_TEST(k.owner == v41::kv_owner[std::size_t(layer)]);
      BOOST_TEST(k.rows == (pos + 1) / v41::ratio(layer));
    }
}

// Spec §7: at even decode positions the ratio-2 sources (2, 8, 14) read layer 20's keys,
// truncated to p / 2 rows; odd positions, and layers 20-39, are unaffected.
BOOST_AUTO_TEST_CASE(upstream_quirk_reproduces_the_reference) {
  for (int layer : {2, 8, 14}) {
    const auto even = decode_index_keys<v41>(layer, 5000, index_key_policy::upstream_quirk);
    BOOST_TEST(even.owner == 20);
    BOOST_TEST(even.rows == 2500);
    const auto odd = decode_index_keys<v41>(layer, 5001, index_key_policy::upstream_quirk);
    BOOST_TEST(odd.owner == layer);
    BOOST_TEST(odd.rows == 2501);
  }
  for (int layer : {20, 24, 28, 32, 36})
    for (long long pos : {5000ll, 5001ll}) {
      const auto k = decode_index_keys<v41>(layer, pos, index_key_policy::upstream_quirk);
      BOOST_TEST(k.owner == 20);
      BOOST_TEST(k.rows == pos + 1);
    }
}

// Another schedule: the slot holds whatever source refreshed it last in execution order.
BOOST_AUTO_TEST_CASE(quirk_follows_execution_order_in_other_schedules) {
  using s = model_schedule<layer_list<run{1, full<2>}, run{1, reuse<2>}, run{1, full<1>}, run{1, full<2>}>, 0>;
  // At pos 10, layer 0 (ratio 2) emits no latent; the last refresh was in the previous forward
  // (pos 9), where layer 3 (ratio 2, (9 + 1) % 2 == 0) ran after layer 2.
  const auto k = decode_index_keys<s>(0, 10, index_key_policy::upstream_quirk);
  BOOST_TEST(k.owner == 3);
  BOOST_TEST(k.rows == 5);
  const auto k3 = decode_index_keys<s>(3, 10, index_key_policy::upstream_quirk);
  BOOST_TEST(k3.owner == 2);  // layer 2 (ratio 1) refreshed earlier in this very step
}

BOOST_AUTO_TEST_SUITE_END()
