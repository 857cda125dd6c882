// expect: must have the same compression ratio as the Full layer that owns the cache
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{1, full<2>}, run{1, reuse<1>}>, 2>;
static_assert(bad::num_layers == 2);
