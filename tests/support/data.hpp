#pragma once
// Test vectors shipped with the repository (tests/data/; computed with the official kernel
// semantics, see tests/data/reference/MANIFEST.json).

#include <string>

#include "dsv4/io/safetensors.hpp"

#ifndef DSV4_TEST_DATA
#error "DSV4_TEST_DATA must point at tests/data (set by tests/CMakeLists.txt)"
#endif

namespace dsv4::test {
inline std::string data_path(const std::string& rel) { return std::string(DSV4_TEST_DATA) + "/" + rel; }
}  // namespace dsv4::test
