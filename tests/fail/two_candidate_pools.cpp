// expect: all Reindex layers select inside one candidate pool
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{1, full<1>}, run{1, reindex<1>}, run{1, full<1>}, run{1, reindex<1>}>, 0>;
static_assert(bad::num_layers == 4);
