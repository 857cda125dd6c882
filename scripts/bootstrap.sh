#!/usr/bin/env bash
# Installs what dsv4 needs on a fresh Debian 12 machine: g++ (C++20), CMake >= 3.25, Ninja and the
# Boost headers (Boost.Test, used header-only). Installs nothing that is already there.
#
# CUDA 13 (nvcc, CCCL, cuBLAS) is not a Debian package; install NVIDIA's toolkit for the CUDA
# backend. Without nvcc, the host backend builds and passes the whole test suite on its own.
set -euo pipefail

need=()
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
[ -f /usr/include/boost/test/included/unit_test.hpp ] || need+=(libboost-test-dev)

if [ "${#need[@]}" -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "bootstrap: missing packages: ${need[*]}; run as root or install them with apt-get" >&2
      exit 1
    fi
  fi
  echo "bootstrap: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cmake_version=$(cmake --version | head -1 | awk '{print $3}')
if [ "$(printf '%s\n3.25\n' "$cmake_version" | sort -V | head -1)" != "3.25" ]; then
  echo "bootstrap: CMake $cmake_version is too old; dsv4 needs 3.25 or newer" >&2
  exit 1
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "bootstrap: ready (CUDA found: host and CUDA backends)"
else
  echo "bootstrap: ready (no nvcc: host backend only)"
fi
