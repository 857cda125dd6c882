#pragma once
//! \file
//! What a thread launches on the GPU, counted always and recorded on request.
//!
//! Counts: every kernel launch (runtime::launch_ex and launch_plain, pdl.cuh) and cuBLAS call
//! (gemm::detail::blas_call) adds one to the thread's `launch_counts`; bench_model reads the
//! difference over a decode step (what a step costs the host in launches).
//!
//! Records: while a `launch_log` is installed on the thread (a scope), every launch also appends
//! its shape and argument bytes: for a kernel the function, grid, block, dynamic shared memory
//! and each parameter's bytes by value; for a cuBLAS GEMM its entry point, m / n / k and operand
//! pointers. A captured CUDA graph replays exactly these values, so two eager decode steps of one
//! batch size whose logs differ name every launch a graph could not replay unchanged
//! (docs/decode-graph.md, validation step 1). `compare_launch_logs` lists those differences.
//!
//! Parameters are recorded as their object bytes: a structure parameter with padding may differ
//! in its padding bytes between two otherwise equal launches. The comparison reports byte
//! offsets, so such a false difference is easy to tell (and to remove, by value-initializing the
//! structure) where it appears.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace dsv4::runtime {

//! Launches issued by this thread so far.
struct launch_counts {
  unsigned long long kernels = 0, blas_calls = 0;
};
inline launch_counts& thread_launch_counts() {
  thread_local launch_counts counts;
  return counts;
}

//! One recorded launch. `function` is the kernel's address, or for a cuBLAS call the name of
//! its entry point (a string literal's address). `shape` holds grid x, y, z, block x, y, z and
//! the dynamic shared memory for a kernel; m, n, k (and the batch count, or 1) for cuBLAS.
struct launch_record {
  enum class kind : std::uint8_t { kernel, blas };
  kind what = kind::kernel;
  const void* function = nullptr;
  std::uint64_t shape[7] = {};
  std::vector<unsigned char> arguments;  // parameters (kernel) or operand pointers (cuBLAS), packed
};

//! Records this thread's launches while alive; restores the log installed before it (if any).
class launch_log {
 public:
  launch_log() : previous_(current()) { current() = this; }
  ~launch_log() { current() = previous_; }
  launch_log(const launch_log&) = delete;
  launch_log& operator=(const launch_log&) = delete;

  const std::vector<launch_record>& records() const { return records_; }

  //! The log installed on this thread, or null.
  static launch_log* installed() { return current(); }

  template <class... Params>
  void add_kernel(const void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                  unsigned bz, std::size_t smem, const Params&... params) {
    launch_record& r = records_.emplace_back();
    r.what = launch_record::kind::kernel;
    r.function = function;
    const std::uint64_t shape[7] = {gx, gy, gz, bx, by, bz, smem};
    std::memcpy(r.shape, shape, sizeof shape);
    (append(r.arguments, params), ...);
  }

  template <class... Pointers>
  void add_blas(const char* entry, long long m, long long n, long long k, long long batch,
                const Pointers*... operands) {
    launch_record& r = records_.emplace_back();
    r.what = launch_record::kind::blas;
    r.function = entry;
    r.shape[0] = std::uint64_t(m), r.shape[1] = std::uint64_t(n), r.shape[2] = std::uint64_t(k);
    r.shape[3] = std::uint64_t(batch);
    (append(r.arguments, static_cast<const void*>(operands)), ...);
  }

 private:
  template <class T>
  static void append(std::vector<unsigned char>& out, const T& value) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "a kernel parameter must be trivially copyable to be recorded");
    const auto* bytes = reinterpret_cast<const unsigned char*>(&value);
    out.insert(out.end(), bytes, bytes + sizeof(T));
  }
  static launch_log*& current() {
    thread_local launch_log* log = nullptr;
    return log;
  }

  std::vector<launch_record> records_;
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
      {"m", "n", "k", "batch", "-", "-", "-"}};
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
