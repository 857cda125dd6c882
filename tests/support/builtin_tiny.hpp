#pragma once
// The CLI's built-in tiny model (random weights from seed 42, as `dsv4 run` without --checkpoint
// loads it), loaded once per test binary.

#include <sstream>

#include "dsv4/cli.hpp"

namespace dsv4::test {

inline const model::host_model<models::tiny>& builtin_tiny() {
  static const auto m = [] {
    std::ostringstream quiet;
    io::checkpoint ck = cli::detail::open_tiny_checkpoint("", quiet);
    return model::host_model<models::tiny>::load(ck, cli::detail::tiny_token_map());
  }();
  return m;
}

}  // namespace dsv4::test
