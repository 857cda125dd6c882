#pragma once
//! \file
//! The order in which the top-k selections rank values: torch.topk's on CUDA, the reference's.
//! One unsigned key per value whose integer order is that order: -inf lowest, -0 just below +0,
//! +inf below every NaN, and all NaNs equal whatever their sign and payload.
//! Measured with PyTorch 2.11 on the H200 (2026-11-30, docs/decisions.md): -0 ranks below +0 at
//! every size tried (n = 2 .. 131072, fp32 and bf16), as ATen's radix key orders them. NaNs: the
//! small-n path ranks both signs above +inf; the radix path (n = 4096, k = 512) ranked a negative
//! NaN below the zeros. We rank every NaN first (the MoE's n = 384 and the reference's small
//! cases); scores from index_scan are never NaN, so the indexer path never meets the difference. Equal keys tie; every
//! caller breaks ties toward the lower index (spec §7, §18). One definition for the host
//! references and the CUDA kernels: the MoE route (`kernels/moe`) and the indexer's top-k and
//! candidate-pool block maxima (`kernels/indexer`).

#include <cstdint>

#include "dsv4/config.hpp"
#include "dsv4/numerics/bits.hpp"

namespace dsv4::numerics {

//! fp32 key. Every float's key is at least 0x007fffff (-inf's), so 0 is free as a marker below
//! all values (the MoE route kernel marks chosen experts with it).
DSV4_HOST_DEVICE std::uint32_t topk_order_key(float v) {
  const std::uint32_t u = float_to_bits(v);
  if (is_nan_bits(u)) return 0xffffffffu;     // every NaN: above +inf, all tied
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

//! bf16 key (16 bits, from the value's bits): the high half of the fp32 key of the same value
//! (bf16 -> fp32 is exact and the fp32 key's low half is 0 or 0xffff for a bf16 value), so both
//! keys order bf16 values alike. -inf's key is 0x007f; 0 is below every value.
DSV4_HOST_DEVICE std::uint32_t topk_order_key_bf16(std::uint16_t bits) {
  return topk_order_key(bits_to_float(std::uint32_t(bits) << 16)) >> 16;
}

}  // namespace dsv4::numerics
