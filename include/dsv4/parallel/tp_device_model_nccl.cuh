#pragma once
//! \file
//! The tensor-parallel device model over NCCL: rank r of tp_model `m` on devices[r] (one GPU per
//! rank), the communicators created here (nccl_world) and kept alive by the model. Link with
//! NCCL (CMake: dsv4::nccl).

#include <memory>
#include <utility>
#include <vector>

#include "dsv4/parallel/nccl.cuh"
#include "dsv4/parallel/tp_device_model.cuh"

namespace dsv4::parallel {

template <class Model>
tp_device_model<Model> make_nccl_tp_device_model(const tp_model<Model>& m,
                                                 const typename tp_device_model<Model>::limits& lim,
                                                 std::vector<int> devices) {
  if (devices.size() != std::size_t(m.world()))
    throw error("make_nccl_tp_device_model: " + std::to_string(m.world()) + " ranks need as many devices, " +
                std::to_string(devices.size()) + " given");
  auto world = std::make_shared<nccl_world>(devices);
  std::vector<std::unique_ptr<device_collectives>> comms;
  for (int r = 0; r < world->size(); ++r) comms.push_back(std::make_unique<nccl_collectives>(*world, r));
  return tp_device_model<Model>(m, lim, std::move(comms), std::move(devices),
                                std::shared_ptr<const void>(world));
}

}  // namespace dsv4::parallel
