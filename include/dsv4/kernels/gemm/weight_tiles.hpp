#pragma once
//! \file
//! The in-memory layout of FP8 / FP4 linear weights for the GEMM kernels ("MMA tiles"), and the
//! host repacking from the checkpoint layout (row-major [N, K] codes; spec fp8_gemm / fp4_gemm).
//!
//! Why: a decode GEMM streams every weight byte once, so the kernel must read long contiguous
//! runs. In the checkpoint layout the 16 rows of an MMA fragment are K bytes apart, and a warp's
//! load touches 16 rows x 32 bytes: short runs scattered over DRAM pages (measured 1.4 TB/s of
//! 4.2 at best, docs/perf.md). Here the bytes one warp needs for one 32-wide K block of 16 rows
//! are one contiguous run, in the order the lanes consume them, and consecutive K blocks follow
//! each other: a warp streams its rows as one sequential read.
//!
//! Layout, with row tile rt = rows [16 rt, 16 rt + 16), K block kb, lane l = 4 g + q:
//! - FP8 codes: 512 bytes per (rt, kb) at (rt * KB + kb) * 512; lane l's 16 bytes at l * 16 hold
//!   row 16 rt + g, elements 32 kb + 8 q .. + 7, then row 16 rt + g + 8, the same elements.
//! - FP4 codes: 256 bytes per (rt, kb) at (rt * KB + kb) * 256; lane l's 8 bytes at l * 8 hold
//!   a lane word (`fp4_lane_word`, 32 bits) with the 8 codes of row 16 rt + g, elements
//!   32 kb + 8 q .. + 7, then the lane word of row 16 rt + g + 8.
//! - FP8 scales keep the checkpoint layout [ceil(N/32), KB]; FP4 scales become 16 bytes per
//!   (rt, kb) at (rt * KB + kb) * 16, one per row of the tile.
//! Rows past N (up to the next multiple of 16) are zero codes with scale 2^0.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"

namespace dsv4::kernels::gemm {

//! How the weight is stored; the activations are always E4M3 with UE8M0 scales per 32.
enum class weight_format {
  fp8_tile32,  //!< E4M3 with one UE8M0 scale per 32 x 32 tile (spec fp8_gemm)
  fp4_row32,   //!< E2M1 with one UE8M0 scale per row per 32 along K (spec fp4_gemm)
};

inline constexpr int mma_tile_rows = 16;

//! Where the lane word keeps element e's code (fp4_lane_word): the three magnitude bits at
//! fp4_magnitude_bit(e) .. + 2 (in E2M1 order: mantissa, then the exponent's two bits) and the
//! sign at fp4_sign_bit(e). Elements 2j and 2j + 1 are one f16x2 of the GEMM's A fragment:
//! element 2j in the low half, 2j + 1 the same bits 16 higher.
DSV4_HOST_DEVICE constexpr int fp4_magnitude_bit(int e) {
  constexpr int base[4] = {9, 6, 3, 0};
  return base[e / 2] + 16 * (e % 2);
}
DSV4_HOST_DEVICE constexpr int fp4_sign_bit(int e) {
  constexpr int base[4] = {15, 12, 14, 13};
  return base[e / 2] + 16 * (e % 2);
}

//! The lane word of 8 E2M1 codes (code = sign << 3 | magnitude, elements e = 0..7), laid out for
//! the GEMMs' conversion to f16 (block_scaled_gemm.cuh, fp4_lane_word_to_f16x2).
//!
//! Why this layout: an E2M1 code's bits placed at f16 bits 9 (mantissa), 10-11 (exponent) and 15
//! (sign), all others zero, are the f16 of its value times 2^-14 (exponent 0 is the subnormal
//! case on both sides), exactly. A pair of elements is one f16x2 with those bits in both halves,
//! so each f16x2 wants its eight bits at {9, 10, 11, 15, 25, 26, 27, 31}. Here elements 0, 1 sit
//! there already (one mask), elements 2, 3 three bits lower (a shift and a mask), and elements
//! 4..7 in the bits left over, magnitudes and signs at two different shifts (two shifts, two
//! masks): 6 logic instructions and 5 shifts for 8 codes, where the former E4M3 route took 12
//! logic / permute / shift instructions and 4 conversions (docs/decisions.md). Four shifted (or
//! rotated) copies of that bit pattern cannot tile a 32-bit word, nor eight a 64-bit pair
//! (checked exhaustively), so two of the four pairs take their bits in two pieces.
DSV4_HOST_DEVICE constexpr std::uint32_t fp4_lane_word(const std::uint8_t (&code)[8]) {
  std::uint32_t w = 0;
  for (int e = 0; e < 8; ++e) {
    w |= std::uint32_t(code[e] & 7u) << fp4_magnitude_bit(e);
    w |= std::uint32_t(code[e] >> 3 & 1u) << fp4_sign_bit(e);
  }
  return w;
}

//! Code e (0..7) of a lane word: the inverse of fp4_lane_word.
DSV4_HOST_DEVICE constexpr std::uint8_t fp4_lane_code(std::uint32_t w, int e) {
  return std::uint8_t((w >> fp4_sign_bit(e) & 1u) << 3 | (w >> fp4_magnitude_bit(e) & 7u));
}

//! The f16x2 of elements (2j, 2j + 1) of a lane word, j = 0..3, each the element's E2M1 value
//! times 2^-14, exactly (f16 bits: see fp4_lane_word). Plain integer operations, so host tests
//! check them against the E2M1 table.
DSV4_HOST_DEVICE constexpr void fp4_lane_word_to_f16x2(std::uint32_t w, std::uint32_t (&p)[4]) {
  constexpr std::uint32_t kBits = 0x8E008E00u, kSigns = 0x80008000u, kMagnitudes = 0x0E000E00u;
  p[0] = w & kBits;
  p[1] = (w << 3) & kBits;
  p[2] = ((w << 1) & kSigns) | ((w << 6) & kMagnitudes);
  p[3] = ((w << 2) & kSigns) | ((w << 9) & kMagnitudes);
}

//! The factor fp4_lane_word_to_f16x2 leaves on every value, as a power of two: 2^-14.
inline constexpr int fp4_f16_exponent_offset = -14;
//! What takes it back: 2^14, exact in fp32.
inline constexpr float fp4_f16_rescale = float(1 << -fp4_f16_exponent_offset);

inline const char* weight_format_name(weight_format wf) { return wf == weight_format::fp8_tile32 ? "fp8" : "fp4"; }

//! Bytes of one (row tile, K block) of codes.
DSV4_HOST_DEVICE constexpr int tile_code_bytes(weight_format wf) { return wf == weight_format::fp8_tile32 ? 512 : 256; }

//! Sizes of a weight of [n, k] in the MMA-tile layout.
struct weight_tile_shape {
  int n = 0, k = 0;
  weight_format wf = weight_format::fp8_tile32;
  int row_tiles() const { return (n + mma_tile_rows - 1) / mma_tile_rows; }
  int k_blocks() const { return k / 32; }
  std::size_t code_bytes() const { return std::size_t(row_tiles()) * k_blocks() * tile_code_bytes(wf); }
  std::size_t scale_bytes() const {
    return wf == weight_format::fp8_tile32 ? std::size_t((n + 31) / 32) * k_blocks()
                                           : std::size_t(row_tiles()) * k_blocks() * mma_tile_rows;
  }
  //! Sizes of the checkpoint layout, for checking inputs.
  std::size_t checkpoint_code_bytes() const {
    return wf == weight_format::fp8_tile32 ? std::size_t(n) * k : std::size_t(n) * (k / 2);
  }
  std::size_t checkpoint_scale_bytes() const {
    return wf == weight_format::fp8_tile32 ? std::size_t((n + 31) / 32) * k_blocks() : std::size_t(n) * k_blocks();
  }
};

struct tiled_weight {
  weight_tile_shape shape;
  std::vector<std::uint8_t> codes, scales;
};

//! Repacks a checkpoint-layout weight (codes [n, k] or [n, k/2], scales as in the spec) into
//! MMA tiles. Throws dsv4::error naming the mismatch on wrong sizes.
inline tiled_weight tile_weight(weight_format wf, int n, int k, std::span<const std::uint8_t> codes,
                                std::span<const std::uint8_t> scales) {
  const weight_tile_shape s{n, k, wf};
  const std::string what = std::string("tile_weight (") + weight_format_name(wf) + " [" + std::to_string(n) + ", " +
                           std::to_string(k) + "]): ";
  if (n <= 0 || k <= 0 || k % 32 != 0) throw error(what + "need n > 0 and k a positive multiple of 32");
  if (codes.size() != s.checkpoint_code_bytes())
    throw error(what + "codes have " + std::to_string(codes.size()) + " bytes, expected " +
                std::to_string(s.checkpoint_code_bytes()));
  if (scales.size() != s.checkpoint_scale_bytes())
    throw error(what + "scales have " + std::to_string(scales.size()) + " bytes, expected " +
                std::to_string(s.checkpoint_scale_bytes()));
  tiled_weight t{s, std::vector<std::uint8_t>(s.code_bytes(), 0), {}};
  const int kb_count = s.k_blocks(), tile_bytes = tile_code_bytes(wf);
  for (int rt = 0; rt < s.row_tiles(); ++rt)
    for (int kb = 0; kb < kb_count; ++kb) {
      std::uint8_t* tile = t.codes.data() + (std::size_t(rt) * kb_count + kb) * tile_bytes;
      for (int lane = 0; lane < 32; ++lane)
        for (int half = 0; half < 2; ++half) {
          const int row = rt * mma_tile_rows + lane / 4 + 8 * half;
          if (row >= n) continue;
          if (wf == weight_format::fp8_tile32) {
            const std::uint8_t* src = codes.data() + std::size_t(row) * k + kb * 32 + (lane % 4) * 8;
            for (int i = 0; i < 8; ++i) tile[lane * 16 + half * 8 + i] = src[i];
          } else {
            const std::uint8_t* src = codes.data() + std::size_t(row) * (k / 2) + kb * 16 + (lane % 4) * 4;
            std::uint8_t element[8];  // the checkpoint packs element 2j in byte j's low nibble
            for (int e = 0; e < 8; ++e) element[e] = std::uint8_t(src[e / 2] >> (4 * (e % 2)) & 0xFu);
            const std::uint32_t w = fp4_lane_word(element);
            for (int i = 0; i < 4; ++i) tile[lane * 8 + half * 4 + i] = std::uint8_t(w >> (8 * i));
          }
        }
    }
  if (wf == weight_format::fp8_tile32) {
    t.scales.assign(scales.begin(), scales.end());
  } else {
    t.scales.assign(s.scale_bytes(), 127);
    for (int row = 0; row < n; ++row)
      for (int kb = 0; kb < kb_count; ++kb)
        t.scales[(std::size_t(row / mma_tile_rows) * kb_count + kb) * mma_tile_rows + row % mma_tile_rows] =
            scales[std::size_t(row) * kb_count + kb];
  }
  return t;
}

}  // namespace dsv4::kernels::gemm
