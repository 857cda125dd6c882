#pragma once
//! \file
//! Packed, paged global KV caches with ownership (spec §15; issue 3 item 1).
//!
//! Only Full layers (the schedule's owners) hold global memory. A page covers `PageTokens`
//! consecutive tokens of one sequence and holds, for every owner o with ratio r_o, the
//! PageTokens / r_o main-KV entries and the same number of index-key entries of those tokens, each
//! kind in its own contiguous region:
//!
//!   [owner 2 main: 128 x 288 B][owner 2 keys: 128 x 68 B][owner 8 main]...[owner 20 keys: 256 x 68 B]
//!
//! so a page of V4.1 Flash is 256 x 890 = 227,840 bytes: exactly 890 bytes per token, with no
//! padding (every region is a multiple of 16 bytes). Sequences of different lengths share one
//! pool of pages through per-sequence block tables; growing a sequence never copies. The only
//! overhead is the unused tail of each sequence's last page (reported by `usage()`).
//!
//! Reuse and Reindex layers read their owner's regions; they have none of their own. The local
//! window rings (per layer) and compressor decode states live elsewhere (per sequence, fixed size).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"
#include "dsv4/models/model_traits.hpp"

namespace dsv4::cache {

//! Where owner `o`'s entries live inside a page: main entries at main_offset, index keys at
//! key_offset, entries_per_page of each.
struct owner_region {
  int layer = 0;
  int ratio = 1;
  long long main_offset = 0, key_offset = 0;
  int entries_per_page = 0;
};

//! Page geometry of a model, derived from its schedule and formats.
template <class Model, int PageTokens = 256>
struct page_geometry {
  using traits = models::model_traits<Model>;
  using schedule = typename traits::schedule;
  static constexpr int page_tokens = PageTokens;
  static constexpr int owners = int(schedule::owners.size());
  static constexpr int main_bytes = traits::main_entry_bytes;
  static constexpr int key_bytes = traits::index_entry_bytes;

  static constexpr bool divisible() {
    for (int o : schedule::owners)
      if (PageTokens % schedule::ratio(o) != 0) return false;
    return true;
  }
  static_assert(PageTokens > 0 && divisible(),
                "page_geometry<Model,PageTokens>: PageTokens must be a positive multiple of every owner's "
                "compression ratio, so that each page holds whole entries");

  static constexpr std::array<owner_region, std::size_t(owners)> make_regions() {
    std::array<owner_region, std::size_t(owners)> r{};
    long long offset = 0;
    for (std::size_t i = 0; i < r.size(); ++i) {
      const int layer = schedule::owners[i];
      r[i].layer = layer;
      r[i].ratio = schedule::ratio(layer);
      r[i].entries_per_page = PageTokens / r[i].ratio;
      r[i].main_offset = offset;
      offset += 1ll * r[i].entries_per_page * main_bytes;
      r[i].key_offset = offset;
      offset += 1ll * r[i].entries_per_page * key_bytes;
    }
    return r;
  }
  static constexpr std::array<owner_region, std::size_t(owners)> regions = make_regions();
  static constexpr long long page_bytes = owners == 0 ? 0
                                                      : regions[std::size_t(owners) - 1].key_offset +
                                                            1ll * regions[std::size_t(owners) - 1].entries_per_page * key_bytes;
  static_assert(owners == 0 || page_bytes * traits::global_kv_per_token.den ==
                                   traits::global_kv_per_token.num * PageTokens,
                "page_geometry: a page must hold exactly global_kv_per_token bytes per token (no padding)");

  //! Region of the owner that layer `layer` reads (its kv_owner), or -1 if it has none.
  static constexpr int region_of_layer(int layer) {
    const int owner = schedule::kv_owner[std::size_t(layer)];
    for (int i = 0; i < owners; ++i)
      if (regions[std::size_t(i)].layer == owner) return i;
    return -1;
  }
};

//! Address arithmetic shared by the host and the kernels: entry g of one owner of a sequence.
struct paged_view {
  const std::uint8_t* pool = nullptr;     //!< base of the page pool
  const std::int32_t* block_table = nullptr;  //!< this sequence's pages, in token order
  long long page_bytes = 0;
  long long region_offset = 0;            //!< main_offset or key_offset of the owner
  int entry_bytes = 0;
  int entries_per_page = 0;

  DSV4_HOST_DEVICE const std::uint8_t* entry(long long g) const {
    const long long page = block_table[g / entries_per_page];
    return pool + page * page_bytes + region_offset + (g % entries_per_page) * entry_bytes;
  }
};

//! Memory use of the pool, for reports and tests.
struct cache_usage {
  long long pages_total = 0, pages_used = 0;
  long long tokens_stored = 0;   //!< sum of sequence lengths
  long long bytes_allocated = 0; //!< pages_used x page_bytes
  double bytes_per_token() const { return tokens_stored ? double(bytes_allocated) / double(tokens_stored) : 0.0; }
};

//! Block tables and free list of a pool of `pages` pages (the storage itself belongs to the
//! backend: a host vector or a device allocation of pages x page_bytes).
class page_allocator {
 public:
  page_allocator(long long pages, int page_tokens, long long page_bytes)
      : page_tokens_(page_tokens), page_bytes_(page_bytes) {
    if (pages < 0 || pages > 0x7fffffffll || page_tokens <= 0)
      throw error("page_allocator: need 0 <= pages < 2^31 and page_tokens > 0");
    free_.reserve(std::size_t(pages));
    for (long long p = pages - 1; p >= 0; --p) free_.push_back(std::int32_t(p));
    total_ = pages;
  }

  //! A new, empty sequence; returns its id.
  int add_sequence() {
    for (std::size_t i = 0; i < seqs_.size(); ++i)
      if (!seqs_[i].live) {
        seqs_[i] = sequence{true, 0, {}};
        return int(i);
      }
    seqs_.push_back(sequence{true, 0, {}});
    return int(seqs_.size() - 1);
  }

  //! Make room for `tokens` more tokens of sequence `id`. Either all pages are taken or, when
  //! the pool is too small, none are, and the error says how many were needed.
  void append(int id, long long tokens) {
    sequence& s = live(id);
    if (tokens < 0) throw error("page_allocator::append: negative token count");
    const long long need_pages = pages_for(s.tokens + tokens) - static_cast<long long>(s.pages.size());
    if (need_pages > static_cast<long long>(free_.size()))
      throw error("page cache exhausted: sequence " + std::to_string(id) + " needs " + std::to_string(need_pages) +
                  " more pages of " + std::to_string(page_tokens_) + " tokens but only " + std::to_string(free_.size()) +
                  " of " + std::to_string(total_) + " are free; release sequences or allocate a larger pool");
    for (long long i = 0; i < need_pages; ++i) {
      s.pages.push_back(free_.back());
      free_.pop_back();
    }
    s.tokens += tokens;
  }

  //! Shortens sequence `id` to its first `tokens` tokens (a rolled-back speculative round): the
  //! pages past them return to the pool, last first, so that a later append takes them back in the
  //! same order.
  void truncate(int id, long long tokens) {
    sequence& s = live(id);
    if (tokens < 0 || tokens > s.tokens)
      throw error("page_allocator::truncate: sequence " + std::to_string(id) + " holds " + std::to_string(s.tokens) +
                  " tokens, cannot keep " + std::to_string(tokens));
    while (static_cast<long long>(s.pages.size()) > pages_for(tokens)) {
      free_.push_back(s.pages.back());
      s.pages.pop_back();
    }
    s.tokens = tokens;
  }

  //! Return a sequence's pages to the pool.
  void release(int id) {
    sequence& s = live(id);
    for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) free_.push_back(*it);
    s = sequence{};
  }

  const std::vector<std::int32_t>& block_table(int id) const { return live(id).pages; }
  long long tokens(int id) const { return live(id).tokens; }
  long long free_pages() const { return static_cast<long long>(free_.size()); }

  cache_usage usage() const {
    cache_usage u;
    u.pages_total = total_;
    u.pages_used = total_ - free_pages();
    for (const auto& s : seqs_)
      if (s.live) u.tokens_stored += s.tokens;
    u.bytes_allocated = u.pages_used * page_bytes_;
    return u;
  }

 private:
  struct sequence {
    bool live = false;
    long long tokens = 0;
    std::vector<std::int32_t> pages;
  };
  int page_tokens_;
  long long page_bytes_;
  long long total_ = 0;
  std::vector<std::int32_t> free_;
  std::vector<sequence> seqs_;

  long long pages_for(long long tokens) const { return (tokens + page_tokens_ - 1) / page_tokens_; }
  sequence& live(int id) {
    if (id < 0 || id >= int(seqs_.size()) || !seqs_[std::size_t(id)].live)
      throw error("page_allocator: no live sequence " + std::to_string(id));
    return seqs_[std::size_t(id)];
  }
  const sequence& live(int id) const { return const_cast<page_allocator*>(this)->live(id); }
};

}  // namespace dsv4::cache
