#pragma once
//! \file
//! Tensor-core building blocks shared by the kernels that run bf16 MMAs out of shared memory
//! (sparse attention, the indexer scan): fragment loads with ldmatrix and the m16n8k16 MMA.
//!
//! Fragment shapes (PTX ISA, mma.m16n8k16 with .bf16): A is 16 x 16 row-major, B 16 x 8
//! column-major, C / D 16 x 8 fp32 where lane 4 g + q holds rows g and g + 8, columns 2 q and
//! 2 q + 1. A 16 x 16 A tile stored row-major in shared memory, or two 8-column B tiles stored
//! one row per column of B (a key or cache entry per row), load with one ldmatrix_x4 each; rows
//! padded by 16 bytes keep the eight row addresses of a matrix in different banks.

#include <cstdint>

#include "dsv4/config.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::kernels::tensor_core {

//! Four 8 x 8 bf16 matrices from shared memory (`row` is this lane's row address), as MMA fragments;
//! `Trans` transposes each matrix (a value operand stored entry-major).
template <bool Trans>
DSV4_DEVICE void ldmatrix_x4(std::uint32_t (&r)[4], const numerics::bf16* row) {
#if DSV4_DEVICE_PASS
  const auto addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#endif
}

//! d = a b + d on the tensor cores: bf16 16 x 16 times 16 x 8, fp32 accumulation.
DSV4_DEVICE void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if DSV4_DEVICE_PASS
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

}  // namespace dsv4::kernels::tensor_core
