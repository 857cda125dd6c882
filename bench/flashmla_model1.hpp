#pragma once
//! \file
//! FlashMLA's SM90 sparse FP8 decode ("MODEL1", the V4 format: 448 E4M3 NoPE channels + 64 bf16
//! RoPE channels + 7 UE8M0 scales per token, 584 bytes) set up at V4.1's decode shape: 64 heads of
//! 512, one query per sequence, a window of `window` entries (its `kv`, topk = window) and
//! `selected` compressed entries out of `extra_tokens` per sequence (its `extra_kv` / extra
//! indices), with the attention sink. For bench_attention's side-by-side column (issue 3: "where a
//! public kernel does the same job on this GPU, measure it in the same run").
//!
//! Built only when CMake is given DSV4_FLASHMLA_DIR (a FlashMLA checkout) and DSV4_CUTLASS_DIR
//! (CUTLASS at the commit FlashMLA pins); FlashMLA's own sources are compiled from there, never
//! copied into this tree. Its H200 path stores FP8 only: our FP4 global entries (288 B) have no
//! counterpart, so the same rows cost it 584 B per entry against our 528 (window) / 288 (global).

#include <cuda_runtime.h>

#include <memory>

namespace dsv4::bench {

class flashmla_model1_decode {
 public:
  static constexpr int bytes_per_token = 584;
  //! Caches (a constant finite pattern), random queries and indices for `batch` sequences; the
  //! scheduling metadata is computed here, once, as FlashMLA's front end does per batch shape.
  //! FlashMLA's own launch checks exit the process instead of throwing (its utils.h).
  flashmla_model1_decode(int batch, int window, int selected, long long extra_tokens, unsigned seed);
  ~flashmla_model1_decode();
  flashmla_model1_decode(const flashmla_model1_decode&) = delete;
  flashmla_model1_decode& operator=(const flashmla_model1_decode&) = delete;
  //! One decode call: the split-KV kernel and the combine kernel.
  void run(cudaStream_t stream);

 private:
  struct state;
  std::unique_ptr<state> s_;
};

}  // namespace dsv4::bench
