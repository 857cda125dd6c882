#pragma once
//! \file
//! Compiler and ABI plumbing shared by every dsv4 header.
//!
//! `.hpp` headers compile with a plain C++20 host compiler (g++, clang) and never include
//! CUDA runtime headers; `.cuh` headers need nvcc. Code shared by the host reference and the CUDA
//! kernels is marked DSV4_HOST_DEVICE, so one definition of each numeric rule serves both.

#if defined(__CUDACC__)
#define DSV4_HOST_DEVICE __host__ __device__ __forceinline__
#define DSV4_DEVICE __device__ __forceinline__
#define DSV4_CUDA_COMPILER 1
#else
#define DSV4_HOST_DEVICE inline
#define DSV4_DEVICE inline
#define DSV4_CUDA_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define DSV4_DEVICE_PASS 1
#else
#define DSV4_DEVICE_PASS 0
#endif

#define DSV4_VERSION_MAJOR 0
#define DSV4_VERSION_MINOR 1
#define DSV4_VERSION_PATCH 0

// Kernels defined in headers are compiled into every translation unit that uses them. Internal
// linkage (static) lets several translation units of one program include the same header (a
// plain __global__ definition would be defined twice at link time, and CUDA ignores `inline` on
// kernels), and keeps two shared objects built against different dsv4 versions or architecture
// lists from resolving each other's kernels.
#if defined(__CUDACC__)
#define DSV4_KERNEL static __global__
#endif
