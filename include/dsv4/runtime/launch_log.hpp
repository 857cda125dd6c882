#pragma once
//! \file
//! What a thread launches on the GPU: counted always, recorded or checked on request.
//!
//! Counts: every kernel launch (runtime::launch_ex and launch_plain, pdl.cuh) and cuBLAS GEMM
//! (gemm::detail::issue_blas) adds one to the thread's `launch_counts`; bench_model reads the
//! difference over a decode step (what a step costs the host in launches).
//!
//! A `launch_log` installed on the thread (a scope) works in one of two modes:
//! - **recording**: every launch appends its shape and argument bytes (a kernel's function, grid,
//!   block, dynamic shared memory, stream, launch attributes and each parameter's bytes by value;
//!   a cuBLAS GEMM's entry point, m / n / k / batch, operand pointers and a closure that issues
//!   it again) and is issued as usual. A captured CUDA graph replays exactly these values, so two
//!   eager decode steps whose logs differ name every launch a graph could not replay unchanged
//!   (`compare_launch_logs`, docs/decode-graph.md); and a record holds enough to issue its launch
//!   again (runtime/segment_graph.cuh).
//! - **checking** against an expected log (the launches a graph was captured from): every launch
//!   is *skipped* (the caller does not issue it) and compared with the next expected record;
//!   from the first difference on, the launches are recorded instead. At the end, `finish` says
//!   whether all matched (then the graph issues them); otherwise the owner issues the matched
//!   expected records and then the recorded ones, in the order the host made them.

//! Parameters are recorded as their object bytes with any padding cleared (where the compiler
//! has __builtin_clear_padding: GCC 11+, Clang 16+; elsewhere a structure's padding may hold what
//! the stack held, and two equal launches may then differ: the comparison's byte offsets show
//! where, and a graph loses its replay, never its correctness).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dsv4::runtime {

//! Launches issued by this thread so far (kernels, and cuBLAS GEMMs).
struct launch_counts {
  unsigned long long kernels = 0, blas_calls = 0;
};
inline launch_counts& thread_launch_counts() {
  thread_local launch_counts counts;
  return counts;
}

//! One recorded launch. `function` is the kernel's address, or for a cuBLAS call the name of
//! its entry point (a string literal's address). `shape` holds grid x, y, z, block x, y, z and
//! the dynamic shared memory for a kernel; m, n, k and the batch count (or the output's leading
//! dimension, where the call has no batch) for cuBLAS.
struct launch_record {
  enum class kind : std::uint8_t { kernel, blas };
  //! Launch attributes of a kernel (pdl.cuh's launch_ex).
  enum flag : std::uint8_t { programmatic = 1, cooperative = 2 };
  kind what = kind::kernel;
  std::uint8_t flags = 0;
  const void* function = nullptr;
  const void* stream = nullptr;  //!< the cudaStream_t it went to
  std::uint64_t shape[7] = {};
  std::vector<unsigned char> arguments;    //!< parameters (kernel) or operand pointers (cuBLAS), packed
  std::vector<std::uint16_t> param_sizes;  //!< kernel: each parameter's bytes, in order
  std::function<void(void*)> reissue;      //!< cuBLAS: issues the call again on a cudaStream_t

  //! Equal launches: the same function, shape, stream, attributes and argument bytes.
  bool same_launch(const launch_record& o) const {
    return what == o.what && flags == o.flags && function == o.function && stream == o.stream &&
           std::memcmp(shape, o.shape, sizeof shape) == 0 && arguments == o.arguments;
  }
};

//! Records or checks this thread's launches while alive; restores the log installed before it.
class launch_log {
 public:
  //! Recording.
  launch_log() : previous_(current()) { current() = this; }
  //! Checking against `expected`, which must outlive the log.
  explicit launch_log(const std::vector<launch_record>& expected)
      : expected_(&expected), previous_(current()) {
    current() = this;
  }
  ~launch_log() { current() = previous_; }
  launch_log(const launch_log&) = delete;
  launch_log& operator=(const launch_log&) = delete;

  //! Recording: every launch; checking: the launches from the first difference on.
  const std::vector<launch_record>& records() const { return records_; }
  std::vector<launch_record> take_records() { return std::move(records_); }
  //! Checking: the expected launches that matched before the first difference (all of them if
  //! there was none).
  std::size_t matched() const { return matched_; }

  //! The log installed on this thread, or null.
  static launch_log* installed() { return current(); }

  //! A kernel launch. Returns true when the caller must skip it (checking).
  template <class... Params>
  bool kernel(const void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
              unsigned bz, std::size_t smem, const void* stream, std::uint8_t flags,
              const Params&... params) {
    launch_record& r = scratch_;
    r.what = launch_record::kind::kernel, r.flags = flags, r.function = function, r.stream = stream;
    const std::uint64_t shape[7] = {gx, gy, gz, bx, by, bz, smem};
    std::memcpy(r.shape, shape, sizeof shape);
    r.arguments.clear(), r.param_sizes.clear();
    (append(r, params), ...);
    return take({});
  }

  //! A cuBLAS GEMM; `reissue(stream)` issues it on a stream (kept in the record). Returns true
  //! when the caller must skip it (checking).
  bool blas(const char* entry, long long m, long long n, long long k, long long batch, const void* stream,
            std::initializer_list<const void*> operands, std::function<void(void*)> reissue) {
    launch_record& r = scratch_;
    r.what = launch_record::kind::blas, r.flags = 0, r.function = entry, r.stream = stream;
    const std::uint64_t shape[7] = {
        std::uint64_t(m), std::uint64_t(n), std::uint64_t(k), std::uint64_t(batch), 0, 0, 0};
    std::memcpy(r.shape, shape, sizeof shape);
    r.arguments.clear(), r.param_sizes.clear();
    for (const void* p : operands) append(r, p);
    return take(std::move(reissue));
  }

  //! Checking: whether every expected launch was matched, in order, and nothing else launched.
  bool finish() const { return expected_ && !diverged_ && matched_ == expected_->size(); }

 private:
  template <class T>
  static void append(launch_record& r, const T& value) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "a kernel parameter must be trivially copyable to be recorded");
    static_assert(sizeof(T) <= 0xffff, "a kernel parameter of more than 64 KiB");
    T copy = value;
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
    __builtin_clear_padding(&copy);  // a structure's padding holds whatever the stack held
#endif
#endif
    const auto* bytes = reinterpret_cast<const unsigned char*>(&copy);
    r.arguments.insert(r.arguments.end(), bytes, bytes + sizeof(T));
    r.param_sizes.push_back(std::uint16_t(sizeof(T)));
  }
  bool take(std::function<void(void*)> reissue) {
    if (expected_ && !diverged_) {
      if (matched_ < expected_->size() && scratch_.same_launch((*expected_)[matched_])) {
        ++matched_;
        return true;
      }
      diverged_ = true;
    }
    launch_record& r = records_.emplace_back(scratch_);
    r.reissue = std::move(reissue);
    return expected_ != nullptr;
  }
  static launch_log*& current() {
    thread_local launch_log* log = nullptr;
    return log;
  }

  std::vector<launch_record> records_;
  launch_record scratch_;
  const std::vector<launch_record>* expected_ = nullptr;
  std::size_t matched_ = 0;
  bool diverged_ = false;
  launch_log* previous_;
};

//! Where two logs differ, one line each (at most `max_lines`, then a count): a different number
//! of launches, or launch i's function, shape or argument bytes (with the first differing byte
//! offset). `name` turns a record into a readable name (a kernel's symbol); empty means equal.
template <class Namer>
std::vector<std::string> compare_launch_logs(const std::vector<launch_record>& a,
                                             const std::vector<launch_record>& b, Namer&& name,
                                             std::size_t max_lines = 64) {
  std::vector<std::string> lines;
  std::size_t differing = 0;
  auto note = [&](std::string line) {
    if (++differing <= max_lines) lines.push_back(std::move(line));
  };
  if (a.size() != b.size())
    note("launch count differs: " + std::to_string(a.size()) + " vs " + std::to_string(b.size()));
  static constexpr const char* shape_field[2][7] = {
      {"grid.x", "grid.y", "grid.z", "block.x", "block.y", "block.z", "smem"},
      {"m", "n", "k", "batch or ldc", "-", "-", "-"}};
  const std::size_t n = a.size() < b.size() ? a.size() : b.size();
  for (std::size_t i = 0; i < n; ++i) {
    const launch_record& x = a[i];
    const launch_record& y = b[i];
    const std::string where = "launch " + std::to_string(i) + " (" + name(x) + ")";
    if (x.what != y.what || x.function != y.function) {
      note(where + ": a different function (" + name(y) + "); the logs diverge here");
      break;  // the rest would be misaligned
    }
    for (int f = 0; f < 7; ++f)
      if (x.shape[f] != y.shape[f])
        note(where + ": " + shape_field[int(x.what)][f] + " " + std::to_string(x.shape[f]) + " vs " +
             std::to_string(y.shape[f]));
    if (x.stream != y.stream || x.flags != y.flags) note(where + ": a different stream or launch attributes");
    if (x.arguments != y.arguments) {
      std::size_t at = 0;
      while (at < x.arguments.size() && at < y.arguments.size() && x.arguments[at] == y.arguments[at]) ++at;
      note(where + ": argument bytes differ from byte " + std::to_string(at) + " of " +
           std::to_string(x.arguments.size()));
    }
  }
  if (differing > max_lines) lines.push_back("... " + std::to_string(differing - max_lines) + " more");
  return lines;
}

}  // namespace dsv4::runtime
