// runtime::prepare_ahead (runtime/prepare_ahead.hpp): every item used once, in order, with what
// its own prepare made; never more than `threads` items prepared ahead of use; an exception from
// either side reaches the caller after the workers have finished.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dsv4/runtime/prepare_ahead.hpp"

using dsv4::runtime::prepare_ahead;

BOOST_AUTO_TEST_SUITE(prepare_ahead_suite)

BOOST_AUTO_TEST_CASE(items_are_used_in_order_with_their_own_results) {
  for (int threads : {0, 1, 2, 3, 8, 40}) {
    BOOST_TEST_INFO_SCOPE("threads " << threads);
    std::vector<int> used;
    prepare_ahead(
        29, threads,
        [](int i) {  // later items finish first: the order must come from prepare_ahead
          std::this_thread::sleep_for(std::chrono::microseconds(200 * (29 - i) % 1000));
          return std::vector<int>(std::size_t(i % 5 + 1), i * i);
        },
        [&](int i, std::vector<int> v) {
          BOOST_TEST(v.size() == std::size_t(i % 5 + 1));
          for (int x : v) BOOST_TEST(x == i * i);
          used.push_back(i);
        });
    BOOST_TEST(used.size() == 29u);
    for (std::size_t i = 0; i < used.size(); ++i) BOOST_TEST(used[i] == int(i));
  }
}

BOOST_AUTO_TEST_CASE(no_more_than_threads_items_wait_or_run_ahead) {
  // Prepared but not yet used, plus preparing: at most `threads` beyond the item in use.
  for (int threads : {2, 4}) {
    BOOST_TEST_INFO_SCOPE("threads " << threads);
    std::atomic<int> started{0};
    int used = 0, most_ahead = 0;
    prepare_ahead(
        20, threads,
        [&](int i) {
          ++started;
          return i;
        },
        [&](int i, int v) {
          BOOST_TEST(v == i);
          std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the workers run ahead
          ++used;
          most_ahead = std::max(most_ahead, started.load() - used);
        });
    BOOST_TEST(used == 20);
    BOOST_TEST(most_ahead <= threads);
    BOOST_TEST(most_ahead >= 1);  // it did run ahead
  }
}

BOOST_AUTO_TEST_CASE(an_exception_from_prepare_or_use_reaches_the_caller) {
  // The counts are exact: items 0 .. i + threads - 1 were launched when item i is taken, and
  // each launched worker has run to its end by the time the exception arrives (none is left).
  for (int threads : {1, 4}) {
    BOOST_TEST_CONTEXT("threads " << threads) {
      std::vector<int> used;
      std::atomic<int> finished{0};
      auto bad_prepare = [&] {
        prepare_ahead(
            10, threads,
            [&](int i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(i == 6 ? 0 : 3));
              ++finished;
              if (i == 6) throw std::runtime_error("layer 6: bad tensor");
              return i;
            },
            [&](int i, int) { used.push_back(i); });
      };
      BOOST_CHECK_EXCEPTION(bad_prepare(), std::runtime_error, [](const std::runtime_error& e) {
        return std::string(e.what()) == "layer 6: bad tensor";
      });
      BOOST_TEST(used == (std::vector<int>{0, 1, 2, 3, 4, 5}), boost::test_tools::per_element());
      BOOST_TEST(finished.load() == (threads > 1 ? std::min(10, 6 + threads) : 7));
      finished = 0;
      auto bad_use = [&] {
        prepare_ahead(
            10, threads,
            [&](int i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(3));
              ++finished;
              return i;
            },
            [](int i, int) {
              if (i == 2) throw std::runtime_error("upload 2 failed");
            });
      };
      BOOST_CHECK_THROW(bad_use(), std::runtime_error);
      BOOST_TEST(finished.load() == (threads > 1 ? 3 + threads : 3));
    }
  }
}

BOOST_AUTO_TEST_CASE(zero_items_call_nothing) {
  int calls = 0;
  prepare_ahead(
      0, 4,
      [&](int) {
        ++calls;
        return 0;
      },
      [&](int, int) { ++calls; });
  BOOST_TEST(calls == 0);
}

BOOST_AUTO_TEST_SUITE_END()
