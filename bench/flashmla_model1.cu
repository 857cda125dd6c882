//! \file
//! bench/flashmla_model1.hpp: the calls into FlashMLA's SM90 sparse decode, with its parameter
//! structs filled as its PyTorch front end (csrc/api/sparse_decode.h) fills them. Compiled with
//! FlashMLA's include paths and flags (bench/CMakeLists.txt), apart from dsv4's warning set.

#include "flashmla_model1.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "params.h"  // FlashMLA
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace dsv4::bench {

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("flashmla_model1: ") + what + ": " + cudaGetErrorString(e));
}

template <class T>
struct buffer {
  T* p = nullptr;
  explicit buffer(std::size_t n) { check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc"); }
  explicit buffer(const std::vector<T>& v) : buffer(v.size()) {
    check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~buffer() { cudaFree(p); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
};

// MODEL1 per page block: every token's 448 E4M3 NoPE codes and 64 bf16 RoPE values (576 B), then
// every token's 8 scale bytes (7 UE8M0 + 1 pad): 584 B a token.
constexpr int heads = 64, dim = 512, page = 64;

}  // namespace

struct flashmla_model1_decode::state {
  buffer<std::uint16_t> q, out;
  buffer<std::uint8_t> kv, extra_kv;
  buffer<int> indices, extra_indices, num_splits;
  buffer<float> sink, lse, lse_accum, o_accum;
  buffer<int> sched;  // num_sm_parts x DecodingSchedMeta
  SparseAttnDecodeParams p{};
  CombineParams c{};

  state(int b, int sm_parts, const std::vector<std::uint16_t>& hq, std::size_t kv_bytes, std::size_t extra_bytes,
        const std::vector<int>& hidx, const std::vector<int>& hextra_idx)
      : q(hq), out(hq.size()), kv(kv_bytes), extra_kv(extra_bytes), indices(hidx), extra_indices(hextra_idx),
        num_splits(std::size_t(b) + 1), sink(std::vector<float>(heads, 0.0f)), lse(std::size_t(b) * heads),
        lse_accum(std::size_t(b + sm_parts) * heads), o_accum(std::size_t(b + sm_parts) * heads * dim),
        sched(std::size_t(sm_parts) * sizeof(DecodingSchedMeta) / 4) {
    // Every cache byte 0x38: E4M3 codes 1.0, RoPE bf16 pairs 0x3838 (~4e-5), UE8M0 scales 2^-71:
    // finite everywhere. The kernel has no value-dependent branch, so values do not move its time,
    // and a 4.9 GB cache (batch 64 at 128K) is not generated on the host.
    check(cudaMemset(kv.p, 0x38, kv_bytes), "cudaMemset"), check(cudaMemset(extra_kv.p, 0x38, extra_bytes), "cudaMemset");
  }
};

flashmla_model1_decode::flashmla_model1_decode(int batch, int window, int selected, long long extra_tokens, unsigned seed) {
  if (batch <= 0 || window <= 0 || window % page || selected <= 0 || extra_tokens < selected || extra_tokens % page)
    throw std::runtime_error("flashmla_model1: need batch > 0, window a multiple of 64, 0 < selected <= extra tokens, "
                             "extra tokens a multiple of 64");
  std::mt19937 rng(seed);
  std::vector<std::uint16_t> hq(std::size_t(batch) * heads * dim);
  for (auto& x : hq) x = std::uint16_t((rng() & 1u) << 15 | 0x3F00 | (rng() & 0x7F));  // bf16, |x| in [0.5, 1)
  const long long window_blocks = window / page, extra_blocks = extra_tokens / page;
  const std::size_t block_bytes = std::size_t(page) * bytes_per_token;
  std::vector<int> hidx(std::size_t(batch) * window), hextra_idx(std::size_t(batch) * selected);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < window; ++i) hidx[std::size_t(b) * window + i] = int(b * window_blocks * page + i);
    for (int i = 0; i < selected; ++i)
      hextra_idx[std::size_t(b) * selected + i] = int(b * extra_blocks * page + rng() % std::uint32_t(extra_tokens));
  }
  int sms = 0, device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const int sm_parts = std::max(sms / 1 / (heads / 64), 1);  // Decode_Sm90_Impl::get_meta at s_q = 1
  s_ = std::make_unique<state>(batch, sm_parts, hq, std::size_t(batch * window_blocks) * block_bytes,
                               std::size_t(batch * extra_blocks) * block_bytes, hidx, hextra_idx);
  auto& p = s_->p;
  const float scale = 1.0f / std::sqrt(float(dim));
  p.b = batch, p.s_q = 1, p.h_q = heads, p.h_kv = 1, p.d_qk = dim, p.d_v = dim;
  p.sm_scale = scale, p.sm_scale_div_log2 = scale * 1.4426950408889634f;
  p.num_blocks = int(batch * window_blocks), p.page_block_size = page, p.topk = window;
  p.model_type = ModelType::MODEL1;
  p.q = reinterpret_cast<cutlass::bfloat16_t*>(s_->q.p);
  p.kv = reinterpret_cast<cutlass::bfloat16_t*>(s_->kv.p);
  p.indices = s_->indices.p, p.topk_length = nullptr, p.attn_sink = s_->sink.p;
  p.lse = s_->lse.p, p.out = reinterpret_cast<cutlass::bfloat16_t*>(s_->out.p);
  p.extra_num_blocks = int(batch * extra_blocks), p.extra_page_block_size = page, p.extra_topk = selected;
  p.extra_kv = reinterpret_cast<cutlass::bfloat16_t*>(s_->extra_kv.p);
  p.extra_indices = s_->extra_indices.p, p.extra_topk_length = nullptr;
  p.stride_q_b = heads * dim, p.stride_q_s_q = heads * dim, p.stride_q_h_q = dim;
  p.stride_kv_block = page * bytes_per_token, p.stride_kv_row = bytes_per_token;
  p.stride_indices_b = window, p.stride_indices_s_q = window;
  p.stride_lse_b = heads, p.stride_lse_s_q = heads;
  p.stride_o_b = heads * dim, p.stride_o_s_q = heads * dim, p.stride_o_h_q = dim;
  p.stride_extra_kv_block = page * bytes_per_token, p.stride_extra_kv_row = bytes_per_token;
  p.stride_extra_indices_b = selected, p.stride_extra_indices_s_q = selected;
  p.stream = nullptr;
  p.lse_accum = s_->lse_accum.p, p.o_accum = s_->o_accum.p;
  p.stride_lse_accum_split = heads, p.stride_lse_accum_s_q = heads;
  p.stride_o_accum_split = heads * dim, p.stride_o_accum_s_q = heads * dim, p.stride_o_accum_h_q = dim;
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(s_->sched.p);
  p.num_splits_ptr = s_->num_splits.p;
  p.num_sm_parts = sm_parts;
  // The schedule, once (Decode_Sm90_Impl::get_meta: topk blocks of 64, 5 blocks of fixed overhead).
  GetDecodeSchedMetaParams m{};
  m.b = batch, m.s_q = 1, m.block_size_n = 64, m.fixed_overhead_num_blocks = 5, m.topk = window, m.extra_topk = selected;
  m.topk_length = nullptr, m.extra_topk_length = nullptr, m.seqlens_k_ptr = nullptr;
  m.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr, m.num_splits_ptr = p.num_splits_ptr;
  m.num_sm_parts = sm_parts, m.stream = nullptr;
  smxx::decode::run_get_decoding_sched_meta_kernel(m);
  check(cudaDeviceSynchronize(), "the scheduling metadata");
  auto& c = s_->c;
  c.b = batch, c.s_q = 1, c.h_q = heads, c.d_v = dim;
  c.lse = p.lse, c.out = p.out, c.stride_lse_b = p.stride_lse_b, c.stride_lse_s_q = p.stride_lse_s_q;
  c.stride_o_b = p.stride_o_b, c.stride_o_s_q = p.stride_o_s_q, c.stride_o_h_q = p.stride_o_h_q;
  c.lse_accum = p.lse_accum, c.o_accum = p.o_accum;
  c.stride_lse_accum_split = p.stride_lse_accum_split, c.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
  c.stride_o_accum_split = p.stride_o_accum_split, c.stride_o_accum_s_q = p.stride_o_accum_s_q;
  c.stride_o_accum_h_q = p.stride_o_accum_h_q;
  c.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr, c.num_splits_ptr = p.num_splits_ptr;
  c.num_sm_parts = sm_parts, c.attn_sink = p.attn_sink, c.stream = nullptr;
}

flashmla_model1_decode::~flashmla_model1_decode() = default;

void flashmla_model1_decode::run(cudaStream_t stream) {
  s_->p.stream = stream, s_->c.stream = stream;
  sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(s_->p);
  smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(s_->c);
  check(cudaGetLastError(), "launch");
}

}  // namespace dsv4::bench
