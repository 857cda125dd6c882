// expect: a local \(SWA\) layer must have ratio 0
#include "dsv4/schedule/model_schedule.hpp"
using namespace dsv4::schedule;
using bad = model_schedule<layer_list<run{1, layer{attn_role::local, 2}}>, 1>;
static_assert(bad::num_layers == 1);
