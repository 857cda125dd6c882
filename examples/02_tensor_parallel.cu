//! \brief Run a model on several GPUs of one host (tensor parallelism, as model.py shards it).
//! Usage: example_02_tensor_parallel [W]        (default W = 2)
//!
//! The tiny model's random checkpoint is cut into W shards (parallel::tp_model: each rank reads
//! only its own slices), each rank gets a device_model on its own GPU, and the ranks talk through
//! NCCL; one thread per rank runs every call. The same prompt then runs on one GPU, and the two
//! sets of logits are compared: they agree to model.py's split rounding, not bit for bit (the
//! ranks' partial sums round before they are added). With fewer than W GPUs, or a build without
//! NCCL, the W ranks share GPU 0 and their collectives go through the host (slower, the same
//! results as NCCL at W = 2). For your own checkpoint, open an io::checkpoint on its folder and
//! use your model type instead of models::tiny.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/device_model.cuh"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/parallel/tp_device_model.cuh"
#ifdef DSV4_EXAMPLE_NCCL
#include "dsv4/parallel/tp_device_model_nccl.cuh"
#endif

using namespace dsv4;
using tiny = models::tiny;

int main(int argc, char** argv) {
  try {
    const int W = argc > 1 ? std::atoi(argv[1]) : 2;
    parallel::check_world_size<tiny>(W);  // names the dimension W does not divide
    const int gpus = runtime::cuda_device_count();
    if (gpus == 0) {
      std::printf("no CUDA device visible: nothing to run\n");
      return 1;
    }
    // The checkpoint (here random weights in memory) and the token map (tiny: the identity).
    io::checkpoint ck =
        io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), 7, io::random_init::scaled);
    std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
    std::iota(token_map.begin(), token_map.end(), 0);

    model::device_model<tiny>::limits lim;
    lim.max_seqs = 1, lim.max_rows = 64, lim.max_tokens = 128, lim.page_tokens = 16;
    const auto shards = parallel::tp_model<tiny>::load(ck, token_map, W);
    std::optional<parallel::tp_device_model<tiny>> tp;
#ifdef DSV4_EXAMPLE_NCCL
    if (gpus >= W) {
      std::vector<int> devices(static_cast<std::size_t>(W));
      std::iota(devices.begin(), devices.end(), 0);
      tp.emplace(parallel::make_nccl_tp_device_model(shards, lim, devices));
      std::printf("%d ranks on GPUs 0..%d, NCCL\n", W, W - 1);
    }
#endif
    if (!tp) {
      tp.emplace(parallel::tp_device_model<tiny>::staged(shards, lim, 0));
      std::printf("%d ranks sharing GPU 0, collectives through the host\n", W);
    }
    model::device_model<tiny> one(model::host_model<tiny>::load(ck, token_map), lim);

    // A prompt, then greedy decoding of the W-GPU model's choices, fed to both (so that the two
    // stay on the same tokens and their logits remain comparable).
    const std::vector<std::int32_t> prompt = {5, 17, 99, 3, 42, 8, 61, 27, 14, 70};
    const int a = tp->add_sequence(), b = one.add_sequence();
    std::vector<float> lw = tp->prefill(a, prompt), l1 = one.prefill(b, prompt);
    for (int step = 0; step < 8; ++step) {
      double dot = 0, ww = 0, oo = 0;
      for (std::size_t i = 0; i < lw.size(); ++i)
        dot += double(lw[i]) * l1[i], ww += double(lw[i]) * lw[i], oo += double(l1[i]) * l1[i];
      const auto argmax = [](const std::vector<float>& v) {
        return std::int32_t(std::max_element(v.begin(), v.end()) - v.begin());
      };
      const std::int32_t tw = argmax(lw), t1 = argmax(l1);
      std::printf("step %d: %d GPUs pick %5d, one GPU picks %5d, logits cosine %.5f\n", step, W, tw, t1,
                  dot / std::sqrt(ww * oo));
      lw = tp->decode({a}, std::span<const std::int32_t>(&tw, 1));
      l1 = one.decode({b}, std::span<const std::int32_t>(&tw, 1));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_02_tensor_parallel: %s\n", e.what());
    return 1;
  }
}
