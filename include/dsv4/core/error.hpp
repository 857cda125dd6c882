#pragma once
//! \file
//! The one exception type dsv4 throws for bad input: files, tensors, shapes, fields, options.
//! The message always names what was wrong and where, so a user can fix it without a debugger.

#include <stdexcept>
#include <string>

namespace dsv4 {

class error : public std::runtime_error {
 public:
  explicit error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace dsv4
