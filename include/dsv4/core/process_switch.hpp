#pragma once
//! \file
//! A process-wide on / off switch for a kernel path that has an older equivalent kept for
//! comparison (bench_model's A/B rows, tests that pin one path). One atomic flag per `Tag`,
//! read when a call is launched, so a switch flipped between calls takes effect at the next one.

#include <atomic>

namespace dsv4 {

template <class Tag, bool Default = true>
class process_switch {
 public:
  static void set(bool on) { flag().store(on); }
  static bool on() { return flag().load(); }

 private:
  static std::atomic<bool>& flag() {
    static std::atomic<bool> on{Default};
    return on;
  }
};

}  // namespace dsv4
