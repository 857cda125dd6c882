// expect: must hold at least index_topk entries
#include "dsv4/models/v41_flash.hpp"
struct bad_model : dsv4::models::v41_flash {
  static constexpr dsv4::models::model_config dims = [] {
    auto d = dsv4::models::v41_flash::dims;
    d.indexer.candidate_topk_blocks = 32;  // 32 x 8 = 256 < 512
    return d;
  }();
};
static_assert(dsv4::models::model_traits<bad_model>::main_entry_bytes > 0);
