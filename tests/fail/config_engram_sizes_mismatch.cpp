// expect: engram_num_embeddings needs one entry per Engram layer
#include <array>
#include "dsv4/models/v41_flash.hpp"
struct bad_model : dsv4::models::v41_flash {
  static constexpr std::array<long long, 1> engram_num_embeddings = {384006168};
};
static_assert(dsv4::models::model_traits<bad_model>::main_entry_bytes > 0);
