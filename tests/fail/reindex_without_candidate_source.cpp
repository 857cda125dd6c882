// expect: a Reindex layer needs a candidate source before it
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{2, swa}, run{1, reindex<1>}>, 3>;
static_assert(bad::num_layers == 3);
