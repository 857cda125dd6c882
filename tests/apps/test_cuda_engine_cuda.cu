// `dsv4 serve --backend cuda`'s engine (apps/dsv4/cuda_backend.cu): with decode graphs (the
// default) and without, three sequences joining and leaving a batch step by step (so that each
// batch size captures its own graphs and a later step replays them) draw the same tokens; a
// session's turn appended after a graphed step continues the same way in both.

#include <boost/test/unit_test.hpp>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../../apps/dsv4/cuda_backend.hpp"
#include "dsv4/cli.hpp"
#include "support/builtin_tiny.hpp"
#include "support/gpu.hpp"

using namespace dsv4;
namespace utf = boost::unit_test;

namespace {

//! Every token an engine gives three sequences: they start one after another, step in changing
//! subsets (all three, the first two, the last alone, ...) for 20 steps, then the second takes a
//! session turn of four tokens and all three step four more times.
std::vector<std::vector<std::int32_t>> drive(cli::sequence_engine& e) {
  std::vector<std::vector<std::int32_t>> tokens(3);
  std::vector<int> handle(3);
  std::vector<kernels::sampling::sampling_params> sp(3);
  for (int i = 0; i < 3; ++i) sp[std::size_t(i)] = {0.8f, 40, 0.95f, std::uint64_t(11 + i)};
  const std::vector<std::vector<std::int32_t>> prompts = {
      {5, 9, 17, 3, 44, 2, 8}, {100, 7, 7, 61}, {12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}};
  for (int i = 0; i < 3; ++i) {
    const auto s = e.start(prompts[std::size_t(i)], false, sp[std::size_t(i)]);
    handle[std::size_t(i)] = s.handle, tokens[std::size_t(i)].push_back(s.token);
  }
  auto step = [&](const std::vector<int>& who) {
    std::vector<int> h;
    std::vector<std::int32_t> ids;
    std::vector<kernels::sampling::sampling_params> p;
    std::vector<long long> budget;
    for (const int i : who)
      h.push_back(handle[std::size_t(i)]), ids.push_back(tokens[std::size_t(i)].back()),
          p.push_back(sp[std::size_t(i)]), budget.push_back(1);
    const auto next = e.step(h, ids, p, budget);
    BOOST_REQUIRE_EQUAL(next.size(), who.size());
    for (std::size_t j = 0; j < who.size(); ++j) {
      BOOST_REQUIRE_EQUAL(next[j].size(), 1u);
      tokens[std::size_t(who[j])].push_back(next[j][0]);
    }
  };
  const std::vector<std::vector<int>> subsets = {{0, 1, 2}, {0, 1}, {2}, {0, 1, 2}, {1, 2}};
  for (int s = 0; s < 20; ++s) step(subsets[std::size_t(s) % subsets.size()]);
  const std::vector<std::int32_t> turn = {31, 32, 33, 34};
  tokens[1].push_back(e.resume(handle[1], turn, false, sp[1]));
  for (int s = 0; s < 4; ++s) step({0, 1, 2});
  for (const int h : handle) e.release(h);
  return tokens;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(cuda_engine)

BOOST_AUTO_TEST_CASE(decode_graphs_draw_the_plain_steps_tokens,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  cli::engine_limits el{4, 64, 64, 0, false};
  const auto plain = apps::cuda_engine(test::builtin_tiny(), el);
  el.decode_graphs = true;
  const auto graphed = apps::cuda_engine(test::builtin_tiny(), el);
  BOOST_TEST(plain->device().find("decode graphs") == std::string::npos, plain->device());
  BOOST_TEST(graphed->device().find(", decode graphs") != std::string::npos, graphed->device());
  const auto a = drive(*plain);
  const auto b = drive(*graphed);
  for (std::size_t i = 0; i < a.size(); ++i) {
    BOOST_TEST_CONTEXT("sequence " << i) {
      // the start, the 12 / 16 / 16 of the 20 steps it was in, the turn's token, the last four
      BOOST_TEST(a[i].size() == (i == 0 ? 17u : i == 1 ? 22u : 21u));
      BOOST_TEST(a[i] == b[i], boost::test_tools::per_element());
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
