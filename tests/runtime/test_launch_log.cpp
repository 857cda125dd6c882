// The launch log (runtime/launch_log.hpp): what it records, that logs nest, and that the
// comparison names each kind of difference a captured graph would replay wrongly.

#include <boost/test/unit_test.hpp>

#include <cstddef>
#include <string>
#include <vector>

#include "dsv4/runtime/launch_log.hpp"

using namespace dsv4::runtime;

namespace {
void kernel_a() {}
void kernel_b() {}
const void* fn(void (*f)()) {
  return reinterpret_cast<const void*>(f);
}

struct params {
  const float* in;
  int rows;
  int cols;
};

std::string name_of(const launch_record& r) {
  if (r.what == launch_record::kind::blas) return static_cast<const char*>(r.function);
  return r.function == fn(kernel_a) ? "a" : r.function == fn(kernel_b) ? "b" : "?";
}

std::vector<std::string> diff(const launch_log& x, const launch_log& y, std::size_t max_lines = 64) {
  return compare_launch_logs(x.records(), y.records(), name_of, max_lines);
}

bool mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const auto& l : lines)
    if (l.find(what) != std::string::npos) return true;
  return false;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(launch_log_suite)

BOOST_AUTO_TEST_CASE(records_shape_and_argument_bytes_while_installed) {
  BOOST_TEST(launch_log::installed() == nullptr);
  float buffer[4] = {};
  {
    launch_log log;
    BOOST_TEST(launch_log::installed() == &log);
    log.add_kernel(fn(kernel_a), 3, 2, 1, 128, 1, 1, 4096, static_cast<const float*>(buffer), 7, 9LL);
    log.add_blas("gemm", 1, 2048, 512, 1, buffer, buffer + 1, buffer + 2);
    BOOST_REQUIRE(log.records().size() == 2u);
    const launch_record& k = log.records()[0];
    BOOST_TEST(k.shape[0] == 3u);
    BOOST_TEST(k.shape[1] == 2u);
    BOOST_TEST(k.shape[3] == 128u);
    BOOST_TEST(k.shape[6] == 4096u);
    BOOST_TEST(k.arguments.size() == sizeof(const float*) + sizeof(int) + sizeof(long long));
    const launch_record& b = log.records()[1];
    BOOST_TEST((b.what == launch_record::kind::blas));
    BOOST_TEST(b.shape[1] == 2048u);
    BOOST_TEST(b.arguments.size() == 3 * sizeof(void*));
  }
  BOOST_TEST(launch_log::installed() == nullptr);
}

BOOST_AUTO_TEST_CASE(logs_nest_and_the_inner_one_records) {
  launch_log outer;
  {
    launch_log inner;
    BOOST_TEST(launch_log::installed() == &inner);
    inner.add_kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0);
  }
  BOOST_TEST(launch_log::installed() == &outer);
  BOOST_TEST(outer.records().empty());
}

BOOST_AUTO_TEST_CASE(equal_steps_compare_equal) {
  float w[2] = {};
  launch_log x, y;
  for (launch_log* l : {&x, &y}) {
    l->add_kernel(fn(kernel_a), 8, 1, 1, 256, 1, 1, 1024, params{w, 4, 64});
    l->add_blas("gemm", 4, 64, 32, 1, w, w + 1);
  }
  BOOST_TEST(diff(x, y).empty());
}

BOOST_AUTO_TEST_CASE(each_kind_of_difference_is_named) {
  float w[2] = {};
  launch_log x, y;
  x.add_kernel(fn(kernel_a), 8, 1, 1, 256, 1, 1, 1024, params{w, 4, 64});
  y.add_kernel(fn(kernel_a), 9, 1, 1, 256, 1, 1, 2048, params{w, 4, 65});  // grid, smem, argument
  x.add_blas("gemm", 4, 64, 32, 1, w, w + 1);
  y.add_blas("gemm", 5, 64, 32, 1, w, w + 1);  // m
  const auto lines = diff(x, y);
  BOOST_TEST(mentions(lines, "launch 0 (a): grid.x 8 vs 9"));
  BOOST_TEST(mentions(lines, "launch 0 (a): smem 1024 vs 2048"));
  // The changed int is the structure's third field: the first differing byte is its offset.
  BOOST_TEST(mentions(
      lines, "launch 0 (a): argument bytes differ from byte " + std::to_string(offsetof(params, cols))));
  BOOST_TEST(mentions(lines, "launch 1 (gemm): m 4 vs 5"));
  BOOST_TEST(lines.size() == 4u);
}

BOOST_AUTO_TEST_CASE(a_different_launch_sequence_stops_the_comparison) {
  launch_log x, y;
  x.add_kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0);
  x.add_kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0);
  y.add_kernel(fn(kernel_b), 2, 1, 1, 32, 1, 1, 0);
  const auto lines = diff(x, y);
  BOOST_TEST(mentions(lines, "launch count differs: 2 vs 1"));
  BOOST_TEST(mentions(lines, "launch 0 (a): a different function (b)"));
  BOOST_TEST(lines.size() == 2u);  // no shape line after the divergence
}

BOOST_AUTO_TEST_CASE(long_differences_are_cut_with_a_count) {
  launch_log x, y;
  for (unsigned i = 0; i < 10; ++i) {
    x.add_kernel(fn(kernel_a), i + 1, 1, 1, 32, 1, 1, 0);
    y.add_kernel(fn(kernel_a), i + 2, 1, 1, 32, 1, 1, 0);
  }
  const auto lines = diff(x, y, 3);
  BOOST_REQUIRE(lines.size() == 4u);
  BOOST_TEST(lines.back() == "... 7 more");
}

BOOST_AUTO_TEST_SUITE_END()
