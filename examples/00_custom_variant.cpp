//! \brief Define your own model variant in a few lines, and let the compiler check it.
//! Usage: example_00_custom_variant
//!
//! A 12-layer variant: two local layers, then an encoder half with one ratio-2 owner and a
//! decoder half with a ratio-1 owner, two Reindex layers selecting in its candidate pool, and
//! V4.1 Flash widths. Break a rule (say, make layer 6 a Reuse layer: it would read the encoder's
//! cache from the decoder) and the build fails with a message that says which rule.

#include <iostream>

#include "dsv4/dsv4.hpp"

using namespace dsv4;
using namespace dsv4::schedule;

struct my_variant : models::v41_flash {  // start from V4.1 Flash and change what differs
  static constexpr const char* name = "my-variant";
  static constexpr const char* title = "12-layer CED variant";
  using schedule = model_schedule<
      layer_list<run{2, swa},                                   // layers 0-1: local only
                 run{1, full<2>}, run{3, reuse<2>},             // encoder 2-5: one ratio-2 owner
                 run{1, full<1>}, run{1, reuse<1>},             // decoder 6-7: owner + candidate source
                 run{1, reindex<1>}, run{1, reuse<1>},          // 8-9: select again within its pool
                 run{1, reindex<1>}, run{1, reuse<1>}>,         // 10-11
      6,                                                        // encoder = layers 0-5
      at<1>,                                                    // one Engram module, before layer 1
      dspark<1, at<11>>>;                                       // a one-stage drafter reading layer 11
  static constexpr std::array<long long, 1> engram_num_embeddings = {384006168};
};

int main() {
  using traits = models::model_traits<my_variant>;
  static_assert(traits::schedule::candidate_source == 6);
  models::print_info(std::cout, models::describe<my_variant>());
  std::cout << "\nglobal KV per token: " << traits::global_kv_per_token.value() << " bytes\n";
}
