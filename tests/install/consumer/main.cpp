// A user's project: find_package(dsv4) from an installed tree, include a header, use a model type.
#include <dsv4/models/v41_flash.hpp>

#include <cstdio>

int main() {
  std::printf("global KV: %g bytes per token\n", dsv4::models::v41_flash_traits::global_kv_per_token.value());
}
