#pragma once
// True when `f` throws a dsv4::error whose message contains `needle` (the message is logged
// otherwise, so a failing check shows what was said instead).

#include <boost/test/unit_test.hpp>

#include <string>

#include "dsv4/core/error.hpp"

namespace dsv4::test {

template <class F>
bool throws_with(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const dsv4::error& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return true;
    BOOST_TEST_MESSAGE("message was: " << e.what());
  }
  return false;
}

}  // namespace dsv4::test
