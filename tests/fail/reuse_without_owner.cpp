// expect: a Reuse layer needs an earlier Full layer
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{1, swa}, run{1, reuse<2>}>, 2>;
static_assert(bad::num_layers == 2);
