// expect: head_dim must be a multiple of the main-KV and local-KV block sizes
#include "dsv4/models/v41_flash.hpp"
struct bad_model : dsv4::models::v41_flash {
  static constexpr dsv4::models::model_config dims = [] {
    auto d = dsv4::models::v41_flash::dims;
    d.attn.head_dim = 520;  // 520 % 16 = 8
    return d;
  }();
};
static_assert(dsv4::models::model_traits<bad_model>::main_entry_bytes > 0);
