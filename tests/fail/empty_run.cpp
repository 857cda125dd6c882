// expect: every run needs a positive count
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = layer_list<run{2, swa}, run{0, full<1>}>;
static_assert(bad::size == 2);
