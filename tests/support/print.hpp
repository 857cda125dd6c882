#pragma once
// Printers so Boost.Test can show dsv4 values in failure messages.

#include <ostream>

#include "dsv4/schedule/layer.hpp"

namespace dsv4::schedule {
inline std::ostream& operator<<(std::ostream& os, attn_role r) { return os << role_name(r); }
}  // namespace dsv4::schedule
