// expect: C must be a positive multiple of the format's block size
#include "dsv4/numerics/formats.hpp"
using namespace dsv4::numerics;
static_assert(packed_vector<main_kv_format, 100>::bytes > 0);
