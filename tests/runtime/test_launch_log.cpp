// The launch log (runtime/launch_log.hpp): what it records, that logs nest, and that the
// comparison names each kind of difference a captured graph would replay wrongly.

#include <boost/test/unit_test.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
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
    log.kernel(fn(kernel_a), 3, 2, 1, 128, 1, 1, 4096, nullptr, 0, static_cast<const float*>(buffer), 7, 9LL);
    log.blas("gemm", 1, 2048, 512, 1, nullptr, {buffer, buffer + 1, buffer + 2}, {});
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
    inner.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, 0);
  }
  BOOST_TEST(launch_log::installed() == &outer);
  BOOST_TEST(outer.records().empty());
}

BOOST_AUTO_TEST_CASE(equal_steps_compare_equal) {
  float w[2] = {};
  launch_log x, y;
  for (launch_log* l : {&x, &y}) {
    l->kernel(fn(kernel_a), 8, 1, 1, 256, 1, 1, 1024, nullptr, 0, params{w, 4, 64});
    l->blas("gemm", 4, 64, 32, 1, nullptr, {w, w + 1}, {});
  }
  BOOST_TEST(diff(x, y).empty());
}

BOOST_AUTO_TEST_CASE(each_kind_of_difference_is_named) {
  float w[2] = {};
  launch_log x, y;
  x.kernel(fn(kernel_a), 8, 1, 1, 256, 1, 1, 1024, nullptr, 0, params{w, 4, 64});
  y.kernel(fn(kernel_a), 9, 1, 1, 256, 1, 1, 2048, nullptr, 0, params{w, 4, 65});  // grid, smem, argument
  x.blas("gemm", 4, 64, 32, 1, nullptr, {w, w + 1}, {});
  y.blas("gemm", 5, 64, 32, 1, nullptr, {w, w + 1}, {});  // m
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
  x.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, 0);
  x.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, 0);
  y.kernel(fn(kernel_b), 2, 1, 1, 32, 1, 1, 0, nullptr, 0);
  const auto lines = diff(x, y);
  BOOST_TEST(mentions(lines, "launch count differs: 2 vs 1"));
  BOOST_TEST(mentions(lines, "launch 0 (a): a different function (b)"));
  BOOST_TEST(lines.size() == 2u);  // no shape line after the divergence
}

BOOST_AUTO_TEST_CASE(long_differences_are_cut_with_a_count) {
  launch_log x, y;
  for (unsigned i = 0; i < 10; ++i) {
    x.kernel(fn(kernel_a), i + 1, 1, 1, 32, 1, 1, 0, nullptr, 0);
    y.kernel(fn(kernel_a), i + 2, 1, 1, 32, 1, 1, 0, nullptr, 0);
  }
  const auto lines = diff(x, y, 3);
  BOOST_REQUIRE(lines.size() == 4u);
  BOOST_TEST(lines.back() == "... 7 more");
}

BOOST_AUTO_TEST_CASE(recording_keeps_launches_live_and_the_gemm_closure) {
  float w[2] = {};
  void* reissued_on = nullptr;
  launch_log log;
  BOOST_TEST(!log.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, launch_record::programmatic, 5));
  BOOST_TEST(!log.blas("gemm", 1, 2, 3, 1, w, {w}, [&](void* s) { reissued_on = s; }));
  BOOST_REQUIRE(log.records().size() == 2u);
  BOOST_TEST(log.records()[0].flags == launch_record::programmatic);
  BOOST_TEST(log.records()[0].param_sizes == std::vector<std::uint16_t>{sizeof(int)});
  BOOST_REQUIRE(bool(log.records()[1].reissue));
  log.records()[1].reissue(w + 1);
  BOOST_TEST(reissued_on == static_cast<void*>(w + 1));
}

namespace {
float step_buffer[2] = {};
// Three launches as a step issues them: `changed` alters the second one's argument.
void issue_step(launch_log& log, bool changed, bool skip_last = false) {
  float* w = step_buffer;
  BOOST_TEST(log.kernel(fn(kernel_a), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, 1, 2}));
  BOOST_TEST(log.kernel(fn(kernel_b), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, changed ? 3 : 1, 2}));
  if (!skip_last) BOOST_TEST(log.blas("gemm", 1, 2, 3, 1, nullptr, {w}, [](void*) {}));
}
}  // namespace

BOOST_AUTO_TEST_CASE(checking_skips_matching_launches) {
  launch_log captured;
  {
    launch_log rec;
    float* w = step_buffer;
    (void)rec.kernel(fn(kernel_a), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, 1, 2});
    (void)rec.kernel(fn(kernel_b), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, 1, 2});
    (void)rec.blas("gemm", 1, 2, 3, 1, nullptr, {w}, [](void*) {});
    const std::vector<launch_record> expected = rec.take_records();
    launch_log check(expected);
    issue_step(check, false);
    BOOST_TEST(check.finish());
    BOOST_TEST(check.matched() == 3u);
    BOOST_TEST(check.records().empty());
  }
}

BOOST_AUTO_TEST_CASE(checking_records_from_the_first_difference) {
  float* w = step_buffer;
  launch_log rec;
  (void)rec.kernel(fn(kernel_a), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, 1, 2});
  (void)rec.kernel(fn(kernel_b), 4, 1, 1, 128, 1, 1, 0, nullptr, 0, params{w, 1, 2});
  (void)rec.blas("gemm", 1, 2, 3, 1, nullptr, {w}, [](void*) {});
  const std::vector<launch_record> expected = rec.take_records();
  {
    launch_log check(expected);
    issue_step(check, true);  // every launch still skipped: the owner issues them
    BOOST_TEST(!check.finish());
    BOOST_TEST(check.matched() == 1u);
    BOOST_REQUIRE(check.records().size() == 2u);  // the changed launch and the one after it
    BOOST_TEST(check.records()[0].function == fn(kernel_b));
    BOOST_TEST(bool(check.records()[1].reissue));
  }
  {
    launch_log check(expected);
    issue_step(check, false, true);  // one launch fewer than captured
    BOOST_TEST(!check.finish());
    BOOST_TEST(check.matched() == 2u);
    BOOST_TEST(check.records().empty());
  }
}

// A structure's padding holds whatever was in its memory: two equal launches must still compare
// equal (where the compiler can clear padding, as GCC 12 here can).
BOOST_AUTO_TEST_CASE(padding_bytes_do_not_count) {
  struct padded {
    const float* p;
    int n;  // 4 bytes of padding follow on LP64
    const float* q;
  };
  static_assert(sizeof(padded) == 24);
  auto make = [](unsigned char fill) {
    padded v;
    std::memset(static_cast<void*>(&v), fill, sizeof v);
    v.p = nullptr, v.n = 3, v.q = nullptr;
    return v;
  };
  launch_log x, y;
  (void)x.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, 0, make(0xab));
  (void)y.kernel(fn(kernel_a), 1, 1, 1, 32, 1, 1, 0, nullptr, 0, make(0xcd));
  BOOST_TEST(diff(x, y).empty());
}

BOOST_AUTO_TEST_SUITE_END()
