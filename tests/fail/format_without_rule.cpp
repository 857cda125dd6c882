// expect: no quantization rule for this element/scale pair
#include "dsv4/numerics/block_format.hpp"
using namespace dsv4::numerics;
using bad = block_scaled<e4m3, e4m3, 32>;
static_assert(bad::bytes_per_block == 33);
