// expect: a Full, Reuse or Reindex layer a supported compression ratio \(1 or 2\)
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{1, full<4>}, run{1, reuse<4>}>, 2>;
static_assert(bad::num_layers == 2);
