// expect: N must be 16 \(E4M3-scaled FP4\) or 32 \(MX formats\)
#include "dsv4/numerics/block_format.hpp"
using namespace dsv4::numerics;
using bad = block_scaled<e2m1, ue8m0, 24>;
static_assert(bad::bytes_per_block > 0);
