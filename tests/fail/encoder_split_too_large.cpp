// expect: the encoder size E must be in \[0, number of layers\]
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{4, swa}>, 5>;
static_assert(bad::num_layers == 4);
