// expect: Engram layer ids must be ascending, unique and below the number
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{4, swa}>, 2, at<1, 4>>;
static_assert(bad::num_layers == 4);
