#pragma once
//! \file
//! Host work of a sequence of items done ahead on worker threads, consumed in order on the
//! calling thread: the device models' load, where each layer's weights are converted on the host
//! (MMA tiles, bf16 copies, wo_a's FP8 form) and then copied to the device.
//!
//! Why: at V4.1 widths the conversions are most of a device model's build (71.5 s of one
//! single-threaded build on the H100, docs/perf.md), and layers convert independently. The
//! copies stay on the calling thread, in layer order, so no CUDA call is made from a worker
//! (no question of which device or context a worker thread has).

#include <algorithm>
#include <cstddef>
#include <deque>
#include <future>
#include <thread>
#include <type_traits>
#include <utility>

namespace dsv4::runtime {

//! Worker threads for host conversions: `requested` when positive, else the hardware's threads,
//! at most 8. Up to threads + 1 items' converted copies are held at once (the one in use and
//! those ahead; a V4.1 layer with 16 experts is ~0.5 GB).
inline int prepare_threads(int requested = 0) {
  if (requested > 0) return requested;
  return int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
}

//! Calls use(i, prepare(i)) for i = 0 .. n-1 in order, prepare running up to `threads` items
//! ahead on worker threads (threads <= 1: all on the calling thread). An exception from either
//! is rethrown here once the workers started so far have finished (a future's destructor waits),
//! so nothing outlives the call.
template <class Prepare, class Use>
void prepare_ahead(int n, int threads, Prepare&& prepare, Use&& use) {
  using prepared = std::invoke_result_t<Prepare&, int>;
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) use(i, prepare(i));
    return;
  }
  std::deque<std::future<prepared>> ahead;
  int next = 0;
  auto launch = [&] {
    for (; next < n && int(ahead.size()) < threads; ++next)
      ahead.push_back(std::async(std::launch::async, [&prepare, i = next] { return prepare(i); }));
  };
  for (int i = 0; i < n; ++i) {
    launch();
    prepared p = ahead.front().get();
    ahead.pop_front();
    launch();  // the next item starts converting while this one is used
    use(i, std::move(p));
  }
}

}  // namespace dsv4::runtime
