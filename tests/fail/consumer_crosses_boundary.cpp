// expect: would read a KV owner from the other half of the encoder/decoder split
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
// Layer 2 is the first decoder layer but is Reuse: it would read the encoder's owner (layer 0).
using bad = model_schedule<layer_list<run{1, full<1>}, run{2, reuse<1>}>, 2>;
static_assert(bad::num_layers == 3);
