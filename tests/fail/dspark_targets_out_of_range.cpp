// expect: DSpark target layer ids must be ascending, unique and below the
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{4, swa}>, 2, at<>, dspark<3, at<3, 2>>>;
static_assert(bad::num_layers == 4);
