#pragma once
//! \file
//! Captured stretches of a repeated step: the host's launches replayed as CUDA graphs.
//!
//! A decode step issues ~1,400 launches, most of which are the same from one step to the next at
//! a given batch size (same kernels, grids, pointers and scalars; only the buffers' contents
//! change), while a few depend on the sequences' lengths (docs/decode-graph.md). The caller marks
//! the stretches of its step that should repeat (`begin_segment` / `end_segment`) and keys each
//! step (the batch size). Per key:
//! - the first step runs as usual (it warms up cuBLAS's heuristics, the kernels' attributes and
//!   lazily loaded modules, none of which a capture may do);
//! - the next step captures each segment into a graph (stream capture of the caller's stream,
//!   with a recording launch_log beside it), instantiates it and launches it;
//! - later steps run the segment's host code with a checking launch_log installed: every launch
//!   is skipped and compared with the captured ones (runtime/launch_log.hpp). If all match, one
//!   cudaGraphLaunch issues them; if any differs (a scalar, grid or pointer that changed), the
//!   step issues the segment's launches itself, from the records, in the host's order, on the
//!   caller's stream, and the segment is captured again next step (after two such divergences
//!   with no replay between them it stays uncaptured for that key). A graph therefore never
//!   replays a launch the host did not make this step: the check is exact (argument bytes), and
//!   the fallback is the eager launches.
//!
//! What a segment may hold: kernel launches through runtime::launch_ex / launch_plain and cuBLAS
//! GEMMs through gemm::detail::issue_blas (the log sees them), event fork / join with side streams
//! (captured as graph edges; executed but harmless while checking), no host synchronization, no
//! other stream operation (memcpy / memset / CUB calls would run live while the launches around
//! them wait for the graph: they stay outside segments).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/launch_log.hpp"

namespace dsv4::runtime {

//! Issues a recorded launch again on `stream` (a kernel from its recorded parameter bytes and
//! attributes; a cuBLAS GEMM through its closure).
inline void reissue_launch(const launch_record& r, cudaStream_t stream) {
  if (r.what == launch_record::kind::blas) {
    r.reissue(static_cast<void*>(stream));
    return;
  }
  // Each parameter copied to its own 16-byte-aligned slot (the runtime reads args[i] with the
  // parameter's size and alignment).
  constexpr std::size_t slot_align = 16;
  std::size_t total = 0;
  for (std::uint16_t size : r.param_sizes) total += (size + slot_align - 1) / slot_align * slot_align;
  std::vector<std::uint64_t> storage((total + 7) / 8 + 2);
  auto* base = reinterpret_cast<unsigned char*>(storage.data());
  base += (slot_align - reinterpret_cast<std::uintptr_t>(base) % slot_align) % slot_align;
  std::vector<void*> args(r.param_sizes.size());
  std::size_t from = 0, at = 0;
  for (std::size_t i = 0; i < r.param_sizes.size(); ++i) {
    std::memcpy(base + at, r.arguments.data() + from, r.param_sizes[i]);
    args[i] = base + at;
    from += r.param_sizes[i];
    at += (r.param_sizes[i] + slot_align - 1) / slot_align * slot_align;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(r.shape[0]), unsigned(r.shape[1]), unsigned(r.shape[2]));
  config.blockDim = dim3(unsigned(r.shape[3]), unsigned(r.shape[4]), unsigned(r.shape[5]));
  config.dynamicSmemBytes = std::size_t(r.shape[6]);
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned count = 0;
  if (r.flags & launch_record::programmatic) {
    attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (r.flags & launch_record::cooperative) {
    attribute[count].id = cudaLaunchAttributeCooperative;
    attribute[count++].val.cooperative = 1;
  }
  config.attrs = attribute;
  config.numAttrs = count;
  DSV4_CUDA_CHECK(cudaLaunchKernelExC(&config, r.function, args.data()));
}

//! The captured segments of a repeated step, per key (see the file comment). One per stream;
//! used from one thread at a time.
class segment_graphs {
 public:
  struct counts {
    long long replayed = 0;  //!< segments issued by one graph launch
    long long captured = 0;  //!< segments captured (and launched)
    long long diverged = 0;  //!< segments whose launches differed from their graph's (issued from records)
    long long eager = 0;     //!< segments run as plain launches (warm-up, or uncapturable)
  };

  explicit segment_graphs(cudaStream_t stream) : stream_(stream) {}
  ~segment_graphs() {
    if (mode_ == mode::capture) abandon();
    cudaStreamSynchronize(stream_);  // a launched graph may still run
    destroy_all();
  }
  segment_graphs(const segment_graphs&) = delete;
  segment_graphs& operator=(const segment_graphs&) = delete;

  //! A step of key `key` begins (before its first segment).
  void begin_step(long long key) {
    keyed_ = &keys_[key];
    next_ = 0;
  }
  //! The current step's next segment begins: from here its launches are captured, checked or
  //! plain, until end_segment.
  void begin_segment() {
    if (!keyed_ || mode_ != mode::none) return;  // outside a step, or nested: no segment
    if (keyed_->segments.size() <= next_) keyed_->segments.resize(next_ + 1);
    segment& s = keyed_->segments[next_];
    if (keyed_->steps == 0 || s.divergences >= max_divergences) {
      mode_ = mode::plain;
    } else if (s.exec) {
      mode_ = mode::check;
      log_.emplace(s.log);
    } else {
      mode_ = mode::capture;
      DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
      log_.emplace();
    }
  }
  //! The segment ends: its launches are issued (a graph launch, or from the records).
  void end_segment() {
    if (!keyed_ || mode_ == mode::none) return;
    segment& s = keyed_->segments[next_++];
    const mode m = mode_;
    mode_ = mode::none;
    if (m == mode::plain) {
      ++counts_.eager;
      return;
    }
    if (m == mode::check) {
      const bool same = log_->finish();
      std::vector<launch_record> rest = same ? std::vector<launch_record>{} : log_->take_records();
      const std::size_t matched = log_->matched();
      log_.reset();
      if (same) {
        DSV4_CUDA_CHECK(cudaGraphLaunch(s.exec, stream_));
        ++counts_.replayed;
        s.divergences = 0;  // (only divergences in a row give a segment up)
        return;
      }
      // The host's launches differ from the graph's: issue them (the matched part from the
      // graph's records), and capture the segment again next step.
      for (std::size_t i = 0; i < matched; ++i) reissue_launch(s.log[i], stream_);
      for (const launch_record& r : rest) reissue_launch(r, stream_);
      // (An earlier step's launch of the graph may still run: a rare wait, then the graph goes.)
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
      DSV4_CUDA_CHECK(cudaGraphExecDestroy(s.exec));
      s.exec = nullptr, s.log.clear();
      ++s.divergences, ++counts_.diverged;
      return;
    }
    // Capture: the segment's launches are in the graph (none ran yet).
    std::vector<launch_record> records = log_->take_records();
    log_.reset();
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {  // not capturable here: issue the launches as recorded, plain from now on
      (void)cudaGetLastError();
      for (const launch_record& r : records) reissue_launch(r, stream_);
      s.divergences = max_divergences, ++counts_.eager;
      return;
    }
    s.exec = exec, s.log = std::move(records);  // (kept before the launch, which may throw)
    ++counts_.captured;
    DSV4_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  }
  //! The step ends (after its last segment).
  void end_step() {
    if (!keyed_) return;
    if (mode_ != mode::none) end_segment();
    ++keyed_->steps;
    keyed_ = nullptr;
  }
  //! The step failed: a capture in progress is ended and dropped, a check abandoned (its
  //! launches were skipped: the step's results are void, as for any failed call), and the key's
  //! graphs are kept.
  void abandon() {
    if (mode_ == mode::capture) {
      cudaGraph_t graph = nullptr;
      if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
    }
    log_.reset();
    mode_ = mode::none;
    keyed_ = nullptr;
  }
  //! Drops every graph (the launches they hold would no longer be what the host issues: weights
  //! or buffers moved, a process switch flipped; the check would catch it too, at a cost).
  void clear() {
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));  // a launched graph may still run
    destroy_all();
  }
  const counts& stats() const { return counts_; }
  cudaStream_t stream() const { return stream_; }

 private:
  static constexpr int max_divergences = 2;
  enum class mode { none, plain, capture, check };
  struct segment {
    cudaGraphExec_t exec = nullptr;
    std::vector<launch_record> log;  //!< the launches `exec` holds
    int divergences = 0;
  };
  struct keyed {
    std::vector<segment> segments;
    long long steps = 0;
  };

  void destroy_all() {
    for (auto& [key, k] : keys_)
      for (auto& s : k.segments)
        if (s.exec) cudaGraphExecDestroy(s.exec);
    keys_.clear();
    keyed_ = nullptr;
  }

  cudaStream_t stream_;
  std::map<long long, keyed> keys_;
  keyed* keyed_ = nullptr;  //!< the step in progress
  std::size_t next_ = 0;    //!< its next segment
  mode mode_ = mode::none;
  std::optional<launch_log> log_;
  counts counts_;
};

}  // namespace dsv4::runtime
