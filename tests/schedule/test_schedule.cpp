// The layer schedule types (schedule/model_schedule.hpp) and the model variants built on them.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <vector>

#include "dsv4/engram/table_layout.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "dsv4/schedule/prefill_work.hpp"
#include "support/print.hpp"

using namespace dsv4;
using namespace dsv4::schedule;

namespace {
template <class A>
std::vector<int> vec(const A& a) {
  return std::vector<int>(a.begin(), a.end());
}
using v41 = models::v41_flash::schedule;
}  // namespace

BOOST_AUTO_TEST_SUITE(schedule_suite)

// The official inference/config.json (spec §1.1): kv_source_layers, index_source_layers,
// candidate_source_layer and the 40 backbone entries of compress_ratios.
BOOST_AUTO_TEST_CASE(v41_matches_the_official_config_lists) {
  BOOST_TEST(v41::num_layers == 40);
  BOOST_TEST(vec(v41::owners) == (std::vector<int>{2, 8, 14, 20}), boost::test_tools::per_element());
  BOOST_TEST(vec(v41::index_producers) == (std::vector<int>{2, 8, 14, 20, 24, 28, 32, 36}),
             boost::test_tools::per_element());
  BOOST_TEST(v41::candidate_source == 20);
  std::vector<int> ratios;
  for (int i = 0; i < 40; ++i) ratios.push_back(v41::ratio(i));
  std::vector<int> official(40, 1);
  official[0] = official[1] = 0;
  for (int i = 2; i < 20; ++i) official[std::size_t(i)] = 2;
  BOOST_TEST(ratios == official, boost::test_tools::per_element());
  BOOST_TEST(vec(v41::engram::values) == (std::vector<int>{1, 14}), boost::test_tools::per_element());
  BOOST_TEST(vec(v41::drafter::targets::values) == (std::vector<int>{37, 38, 39}), boost::test_tools::per_element());
  BOOST_TEST(v41::drafter::stages == 3);
  BOOST_TEST(v41::encoder_layers == 20);
}

// Spec §2's table: who owns the cache each layer reads, whose top-k it uses.
BOOST_AUTO_TEST_CASE(v41_wiring_follows_the_spec_table) {
  for (int i = 0; i < 40; ++i) {
    BOOST_TEST_CONTEXT("layer " << i) {
      int owner = -1, topk = -1;
      if (i >= 2 && i < 20) owner = topk = 2 + 6 * ((i - 2) / 6);
      if (i >= 20) {
        owner = 20;
        topk = i < 24 ? 20 : 24 + 4 * ((i - 24) / 4);
      }
      BOOST_TEST(v41::kv_owner[std::size_t(i)] == owner);
      BOOST_TEST(v41::topk_source[std::size_t(i)] == topk);
    }
  }
  BOOST_TEST((v41::role(24) == attn_role::reindex && v41::role(20) == attn_role::full &&
              v41::role(21) == attn_role::reuse && v41::role(0) == attn_role::local));
}

// Invariants the wiring must keep for any valid schedule (checked on both variants): a layer
// attends with selections made against the very cache it reads, of its own ratio and half.
template <class S>
void check_invariants() {
  for (int i = 0; i < S::num_layers; ++i) {
    BOOST_TEST_CONTEXT("layer " << i) {
      const int o = S::kv_owner[std::size_t(i)], t = S::topk_source[std::size_t(i)];
      if (S::role(i) == attn_role::local) {
        BOOST_TEST((o == -1 && t == -1));
        continue;
      }
      BOOST_TEST(S::role(o) == attn_role::full);
      BOOST_TEST(S::ratio(o) == S::ratio(i));
      BOOST_TEST(S::in_encoder(o) == S::in_encoder(i));
      BOOST_TEST(S::kv_owner[std::size_t(t)] == o);
      BOOST_TEST(o <= t);
      BOOST_TEST(t <= i);
      if (S::role(i) == attn_role::reindex) BOOST_TEST(o == S::candidate_source);
    }
  }
}
BOOST_AUTO_TEST_CASE(wiring_invariants_hold) {
  check_invariants<v41>();
  check_invariants<models::tiny::schedule>();
  using custom = model_schedule<layer_list<run{1, swa}, run{1, full<1>}, run{2, reuse<1>}, run{1, reindex<1>},
                                           run{1, reuse<1>}>,
                                1>;
  check_invariants<custom>();
  BOOST_TEST(custom::candidate_source == 1);
  BOOST_TEST(custom::topk_source[5] == 4);
}

BOOST_AUTO_TEST_CASE(cache_bytes_per_token) {
  using t = models::v41_flash_traits;
  BOOST_TEST(t::main_entry_bytes == 288);
  BOOST_TEST(t::index_entry_bytes == 68);
  BOOST_TEST(t::local_entry_bytes == 528);
  BOOST_TEST(t::global_main_per_token.value() == 720.0);
  BOOST_TEST(t::global_index_per_token.value() == 170.0);
  BOOST_TEST(t::global_kv_per_token.value() == 890.0);
  BOOST_TEST(t::local_window_bytes_per_layer == 528 * 128);
  BOOST_TEST(t::window_layers == 43);
  // A single ratio-2 owner stores half an entry per token: a fraction the accounting keeps exact.
  const models::bytes_per_token half = models::bytes_per_token{356, 2} + models::bytes_per_token{0, 1};
  BOOST_TEST(half.value() == 178.0);
  const models::bytes_per_token odd = models::bytes_per_token{1, 2} + models::bytes_per_token{1, 3};
  BOOST_TEST((odd.num == 5 && odd.den == 6));
}

// engram_num_embeddings of V4.1 equals the sums of the 48 smallest primes above 16,000,000 (spec §10).
BOOST_AUTO_TEST_CASE(engram_table_rows_match_the_prime_layout) {
  const auto rows = engram::table_rows<2>(16000000, 4, 8);
  BOOST_TEST(rows[0] == models::v41_flash::engram_num_embeddings[0]);
  BOOST_TEST(rows[1] == models::v41_flash::engram_num_embeddings[1]);
  BOOST_TEST(engram::next_prime_above(15999999) == 16000057);
  BOOST_TEST(models::tiny::engram_num_embeddings[0] > 0);
}

BOOST_AUTO_TEST_CASE(tiny_has_the_v41_structure_and_binding_sparse_sizes) {
  using t = models::tiny;
  BOOST_TEST(t::schedule::num_layers == 40);
  BOOST_TEST(t::dims.indexer.index_topk < 64);  // the top-k binds on prompts of a few hundred tokens
  BOOST_TEST(t::dims.indexer.pool_capacity() < 256);
  BOOST_TEST(models::tiny_traits::global_kv_per_token.value() == 265.0);
}

BOOST_AUTO_TEST_CASE(ced_prefill_work_follows_the_article) {
  using sched = dsv4::models::model_traits<dsv4::models::v41_flash>::schedule;
  using dsv4::schedule::prefill_layer_tokens;
  using dsv4::schedule::prefill_mode;
  constexpr long long n = 1000000;
  constexpr auto exact = prefill_layer_tokens<sched>(n, prefill_mode::exact, 128);
  constexpr auto ced = prefill_layer_tokens<sched>(n, prefill_mode::ced, 128);
  static_assert(exact.total() == n * 40, "exact: N L");
  static_assert(ced.total() == n * 20 + 128 * 20, "ced: N L/2 + W L/2 for the 20 + 20 split");
  BOOST_TEST(std::abs(double(ced.total()) / double(exact.total()) - 0.500064) < 1e-9);
  // A prompt shorter than the window gains nothing; an appended chunk replays the last W positions.
  BOOST_TEST(prefill_layer_tokens<sched>(100, prefill_mode::ced, 128).total() == 100 * 40);
  BOOST_TEST(prefill_layer_tokens<sched>(50, prefill_mode::ced, 128, 5000).total() == 50 * 20 + 128 * 20);
  BOOST_TEST(prefill_layer_tokens<sched>(50, prefill_mode::exact, 128, 5000).total() == 50 * 40);
  BOOST_TEST(prefill_layer_tokens<sched>(0, prefill_mode::ced, 128).total() == 0);
}

BOOST_AUTO_TEST_SUITE_END()
