#pragma once
// A random checkpoint in a temporary folder for the duration of a test (removed on destruction,
// also when the test fails), named after the test and the seed so parallel runs do not collide.

#include <filesystem>
#include <string>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "support/random.hpp"

namespace dsv4::test {

struct temp_checkpoint {
  std::string dir;
  temp_checkpoint(const std::string& name, const std::vector<io::tensor_spec>& schema, std::uint64_t seed)
      : dir((std::filesystem::temp_directory_path() / ("dsv4_test_" + name + "_" + std::to_string(test_seed()))).string()) {
    std::filesystem::remove_all(dir);
    io::write_random_checkpoint(schema, dir, 64u << 20, seed);
  }
  ~temp_checkpoint() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  temp_checkpoint(const temp_checkpoint&) = delete;
  temp_checkpoint& operator=(const temp_checkpoint&) = delete;
};

}  // namespace dsv4::test
