#pragma once
//! \file
//! Helpers for compile-time diagnostics.

namespace dsv4 {

//! Always false, but only once `T` is known: lets a primary template or an `if constexpr` branch
//! fail with a readable static_assert only when it is instantiated (P1830).
template <class... T>
inline constexpr bool dependent_false = false;

}  // namespace dsv4
