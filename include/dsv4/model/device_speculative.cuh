#pragma once
//! \file
//! Generation with DSpark drafts on CUDA: speculative_reference.hpp's loop with the device
//! backbone and drafter, where a round is verified in one backbone call and rolled back.
//!
//! The rule is the host loop's: the token at position q is sample_reference(logits_q, sampling,
//! sequence, q); a draft is accepted when that draw equals it; the first differing draw ends the
//! round. A round at backbone length q with input token t:
//!   drafts  d_1 .. d_B = device_dspark::decode(t, the main_hidden rows the drafter has not seen);
//!   verify  save_sequence, then append_all_on_device([t, d_1 .. d_f]) with f = min(B, budget - 1)
//!           (the round's budget: the tokens the sequence still wants): row i holds the logits of
//!           q + 1 + i, and every row is drawn on the device at once (the device sampler: the host
//!           sampler's draws); the draw of q + 1 (row 0) is taken, and while a draw equals d_{i+1}
//!           it is accepted and the next row's draw taken, until the budget is reached;
//!   keep    with k = min(a, f) fed drafts accepted and k < f: restore_sequence and append
//!           [t, d_1 .. d_k] again (the same positions and history: the state plain decoding
//!           leaves); with k == f the verification already is that state. The last call's capture
//!           holds the main_hidden rows of the kept positions, which the next round's drafter takes.
//! So a round costs one drafter step and one or two backbone calls of up to B + 1 rows, and emits
//! a + 1 tokens (at most the budget); the sequence ends as plain decoding leaves it (the last token
//! drawn, not fed).
//! A batch of sequences runs its rounds together: every sequence's drafts in one drafter pass
//! (device_dspark::decode over several slots), its verification in one backbone call
//! (append_all_on_device over several slots), every rejected sequence's re-append in a second.
//! `speculative_batch` runs this a round at a time over sequences that join and leave (a
//! server's batch); generate_speculative_batch runs whole generations with it.
//! The rule is the host loop's, but the logits are not plain decoding's bits: the verification's
//! rows, and a one-token prompt's first plain step, come from multi-row appends of several
//! sequences (other GEMM splits, the appended-chunk operand; docs/decisions.md: not
//! batch-invariant), so where plain decoding's top two logits are close a draw may differ from
//! plain decoding's, and the generations part there.

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/speculative_reference.hpp"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::model {

//! The loop one round at a time over sequences that come and go (a server's batch): start() runs
//! a sequence's prefill and draws its first token; round() runs one round of every sequence it is
//! given together (drafts in one drafter pass, verification in one backbone call, rollbacks'
//! re-appends in a second) and returns each one's kept tokens: 1 .. block + 1, at most its budget;
//! resume() appends a turn between rounds (a server session). A round with no main_hidden row the
//! drafter has not seen (a one-token prompt's first, unless a turn was appended first) is a plain
//! step (a one-row append, no drafts) and counts as no round. The drafter and the
//! backbone share sequence slots; a slot's state here lives from start() to forget(). Turns dm's
//! main_hidden capture on.
template <class Model>
class speculative_batch {
  static constexpr models::model_config c = Model::dims;
  static constexpr int W = c.attn.window_size, block = c.dspark.dspark_block_size;
  static_assert(
      block + 1 <= W,
      "speculative_batch (CUDA): a round of block + 1 rows must fit the window (the drafter takes at "
      "most window main_hidden rows a step, and appends of several sequences at most a window each)");
  static constexpr std::size_t row =
      std::size_t(c.dim) * std::size_t(models::model_traits<Model>::schedule::drafter::targets::size);

 public:
  //! (tests: an oracle drafter) may replace the drafts of the sequence in `slot`: it receives the
  //! slot, the position of d_1 and [t_q, d_1 .. d_block].
  using edit_fn = std::function<void(int, long long, std::vector<std::int32_t>&)>;
  //! One sequence of a round: its slot, and the most tokens it may return (>= 1).
  struct request {
    int slot = -1;
    long long budget = 1;
  };

  speculative_batch(device_model<Model>& dm, device_dspark<Model>& dd, edit_fn edit = {})
      : dm_(dm), dd_(dd), edit_(std::move(edit)), slots_(std::size_t(std::min(dm.max_seqs(), dd.max_seqs()))),
        pending_(slots_.size() * std::size_t(W) * row) {
    dm_.capture_main_hidden(true);
  }

  //! Sequence slots 0 .. slots() - 1 (the backbone's and the drafter's both).
  int slots() const { return int(slots_.size()); }

  //! The prefill of `prompt` (exact or CED) in the empty live sequence `slot` of the backbone, the
  //! drafter's rings seeded, and the first token (drawn with `sampling` at stream `sequence`).
  std::int32_t start(int slot, std::span<const std::int32_t> prompt, prompt_prefill mode,
                     const kernels::sampling::sampling_params& sampling, std::uint64_t sequence = 0) {
    const std::string who = "speculative_batch::start: slot " + std::to_string(slot) + ": ";
    if (slot < 0 || slot >= slots())
      throw error(who + "no such slot (the backbone has " + std::to_string(dm_.max_seqs()) + ", the drafter " +
                  std::to_string(dd_.max_seqs()) + ")");
    if (slots_[std::size_t(slot)].started) throw error(who + "already started (forget it first)");
    if (dm_.length(slot) < 0) throw error(who + "no live sequence in the slot (add_sequence first)");
    if (dm_.length(slot) != 0)
      throw error(who + "the slot must be empty (it holds " + std::to_string(dm_.length(slot)) + " tokens)");
    if (prompt.empty()) throw error(who + "empty prompt");
    if (static_cast<long long>(prompt.size()) > dm_.max_rows())
      throw error(who + "a prompt of " + std::to_string(prompt.size()) + " tokens exceeds limits::max_rows (" +
                  std::to_string(dm_.max_rows()) + "), the prefill's call");
    mode == prompt_prefill::ced ? dm_.prefill_ced(slot, prompt) : dm_.prefill(slot, prompt);
    state& s = slots_[std::size_t(slot)];
    s = state{};
    s.sampling = sampling, s.sequence = sequence;
    s.stats.accepted_at.assign(std::size_t(block), 0);
    const kernels::sampling::row_request draw{sampling, sequence, std::uint64_t(dm_.length(slot))};
    s.t = dm_.sample(std::span(&draw, 1))[0];
    seed_from_capture(slot);
    s.started = true;
    return s.t;
  }

  //! An appended turn of the started sequence in `slot` (a server session's next turn, between
  //! rounds): `chunk` (a session's: the last token returned first) fed exact (device_model::append)
  //! or CED (append_ced: needs limits::ced_appends), and the turn's first token, drawn with
  //! `sampling`, which the sequence's later rounds use. Exact: the chunk's captured rows join the
  //! rows the drafter has not seen (the last `window` of them are kept: all its rings hold), and
  //! the next round's drafter step takes them. CED: the drafter's rings are seeded again from the
  //! replayed rows, as after a CED prefill. A failure forgets the slot (its state is part-way).
  std::int32_t resume(int slot, std::span<const std::int32_t> chunk, prompt_prefill mode,
                      const kernels::sampling::sampling_params& sampling) {
    const std::string who = "speculative_batch::resume: slot " + std::to_string(slot) + ": ";
    if (slot < 0 || slot >= slots() || !slots_[std::size_t(slot)].started) throw error(who + "not started");
    if (chunk.empty()) throw error(who + "empty chunk");
    kernels::sampling::check_sampling_params(sampling, who);
    const long long n = static_cast<long long>(chunk.size());
    // (the backbone would refuse these too, but the slot would be forgotten for nothing)
    if (n > dm_.max_rows())
      throw error(who + "a chunk of " + std::to_string(n) + " tokens exceeds limits::max_rows (" + std::to_string(dm_.max_rows()) +
                  "), the append's call");
    if (dm_.length(slot) + n > dm_.max_tokens())
      throw error(who + "the sequence holds " + std::to_string(dm_.length(slot)) + " tokens; " + std::to_string(n) +
                  " more exceed limits::max_tokens (" + std::to_string(dm_.max_tokens()) + ")");
    try {
      mode == prompt_prefill::ced ? dm_.append_ced(slot, chunk) : dm_.append(slot, chunk);
      const long long rows = dm_.main_hidden_rows();  // exact: the chunk's last min(n, window); CED: the replay's
      if (rows != std::min<long long>(mode == prompt_prefill::ced ? dm_.length(slot) : n, W))
        throw error(who + "the backbone captured " + std::to_string(rows) + " main_hidden rows of the turn (is its capture on?)");
      state& s = slots_[std::size_t(slot)];
      s.sampling = sampling;
      const kernels::sampling::row_request draw{sampling, s.sequence, std::uint64_t(dm_.length(slot))};
      s.t = dm_.sample(std::span(&draw, 1))[0];
      if (mode == prompt_prefill::ced) {
        seed_from_capture(slot);
      } else {
        const long long kept = std::min<long long>(s.pending_rows, W - rows);  // the newest of the old rows
        if (kept < s.pending_rows)  // moved down row by row (ascending: no row overwrites one still to move)
          for (long long r = 0; r < kept; ++r)
            DSV4_CUDA_CHECK(cudaMemcpyAsync(pending_row(slot) + std::size_t(r) * row,
                                            pending_row(slot) + std::size_t(s.pending_rows - kept + r) * row, row * sizeof(bf16),
                                            cudaMemcpyDeviceToDevice, dm_.stream()));
        DSV4_CUDA_CHECK(cudaMemcpyAsync(pending_row(slot) + std::size_t(kept) * row, dm_.main_hidden(),
                                        std::size_t(rows) * row * sizeof(bf16), cudaMemcpyDeviceToDevice, dm_.stream()));
        s.pending_rows = kept + rows, s.pending_positions += n;
      }
      return s.t;
    } catch (...) {
      forget(slot);
      throw;
    }
  }

  //! One round of every sequence in `batch` (each started, each once): their kept tokens, in order.
  //! Every request is checked before any work. The backbone's call holds the round's rows (at most
  //! batch.size() x (block + 1)), which must fit its limits::max_rows and logit_rows. A round that
  //! fails after its checks (a CUDA error, an edit_fn's bad block) leaves its sequences' backbone
  //! and drafter state part-way, so it forgets them (their later rounds are refused as not
  //! started) before the error goes on: release them.
  std::vector<std::vector<std::int32_t>> round(std::span<const request> batch) {
    check(batch);
    try {
      return run(batch);
    } catch (...) {
      for (const request& r : batch) forget(r.slot);
      throw;
    }
  }
  //! How the drafts of the sequence in `slot` fared since its start().
  const speculative_stats& stats(int slot) const {
    if (slot < 0 || slot >= slots() || !slots_[std::size_t(slot)].started)
      throw error("speculative_batch::stats: slot " + std::to_string(slot) + " is not started");
    return slots_[std::size_t(slot)].stats;
  }
  //! The slot's state is dropped (its backbone sequence is the caller's to release).
  void forget(int slot) {
    if (slot >= 0 && slot < slots()) slots_[std::size_t(slot)] = state{};
  }

 private:
  struct state {
    bool started = false;
    std::int32_t t = 0;            //!< the last token returned, not fed
    long long pending_rows = 0;    //!< main_hidden rows the drafter has not seen (in pending_)
    long long pending_positions = 0;  //!< the positions they stand for (more than the rows after a long turn)
    kernels::sampling::sampling_params sampling{};
    std::uint64_t sequence = 0;
    speculative_stats stats;
    typename device_model<Model>::sequence_snapshot snapshot;  //!< before the round's verification
  };
  device_model<Model>& dm_;
  device_dspark<Model>& dd_;
  edit_fn edit_;
  std::vector<state> slots_;
  // Per slot, the main_hidden rows the drafter has not seen yet, kept apart from the capture
  // (which the next call overwrites): a round's block + 1, the prompt's last row, or after an
  // appended turn the last `window` of the positions not seen.
  runtime::device_buffer<bf16> pending_;

  //! round()'s checks: every request, and the call's rows.
  void check(std::span<const request> batch) const {
    long long rows = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const request& r = batch[i];
      const std::string who = "speculative_batch::round: sequence " + std::to_string(i) + " (slot " + std::to_string(r.slot) + "): ";
      if (r.slot < 0 || r.slot >= slots() || !slots_[std::size_t(r.slot)].started) throw error(who + "not started");
      for (std::size_t e = 0; e < i; ++e)
        if (batch[e].slot == r.slot) throw error(who + "the slot appears twice in the round");
      if (r.budget < 1) throw error(who + "a round's budget must be >= 1, got " + std::to_string(r.budget));
      const long long fed = feeds(r);
      if (dm_.length(r.slot) + fed + 1 > dm_.max_tokens())
        throw error(who + "its round would grow it to " + std::to_string(dm_.length(r.slot) + fed + 1) +
                    " tokens, beyond limits::max_tokens (" + std::to_string(dm_.max_tokens()) + ")");
      rows += fed + 1;
    }
    if (rows > dm_.max_rows() || rows > dm_.logit_rows())
      throw error("speculative_batch::round: the round's " + std::to_string(rows) + " rows exceed the backbone's limits::max_rows (" +
                  std::to_string(dm_.max_rows()) + ") or logit_rows (" + std::to_string(dm_.logit_rows()) + ")");
  }

  //! round() after its checks.
  std::vector<std::vector<std::int32_t>> run(std::span<const request> batch) {
    std::vector<std::vector<std::int32_t>> out(batch.size());
    if (batch.empty()) return out;

    // Drafts: every sequence that has main_hidden rows to give, in one drafter pass.
    std::vector<typename device_dspark<Model>::step> steps;
    for (const request& r : batch) {
      const state& s = slots_[std::size_t(r.slot)];
      if (s.pending_rows > 0)
        steps.push_back({r.slot, s.t, pending_row(r.slot), s.pending_rows, s.pending_positions, s.sampling, s.sequence});
    }
    std::vector<dspark_draft> drafted;
    if (!steps.empty()) drafted = dd_.decode(steps, false);  // (the loop needs the ids only)
    // Verification: t and the first `fed` drafts of each (a plain step: t alone), in one call.
    std::vector<int> slots;
    std::vector<std::vector<std::int32_t>> chunks;
    std::vector<int> fed(batch.size(), 0);
    std::vector<std::vector<std::int32_t>> ids(batch.size());
    for (std::size_t i = 0, d = 0; i < batch.size(); ++i) {
      const int slot = batch[i].slot;
      state& s = slots_[std::size_t(slot)];
      if (s.pending_rows > 0) {
        ids[i] = std::move(drafted[d++].ids);
        if (edit_) edit_(slot, dm_.length(slot) + 1, ids[i]);
        if (ids[i].size() != std::size_t(block) + 1 || ids[i][0] != s.t)
          throw error("speculative_batch::round: a draft block must be block + 1 ids starting with the input token");
        ++s.stats.rounds;
        // Feed t and the first `fed` drafts: their rows give every draw this round can make.
        fed[i] = int(feeds(batch[i]));
        if (fed[i] > 0) dm_.save_sequence(slot, s.snapshot);
      } else {
        ids[i] = {s.t};
      }
      slots.push_back(slot);
      chunks.emplace_back(ids[i].begin(), ids[i].begin() + fed[i] + 1);  // positions q + 1 .. q + fed + 1
    }
    dm_.append_all_on_device(slots, chunks);
    // Every row's draw at once (a draw depends only on its row and position): the checks below
    // take them in order and stop at the first that differs from its draft.
    std::vector<kernels::sampling::row_request> draws;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const state& s = slots_[std::size_t(batch[i].slot)];
      for (int j = 0; j <= fed[i]; ++j)
        draws.push_back({s.sampling, s.sequence, std::uint64_t(dm_.length(batch[i].slot) - fed[i] + j)});
    }
    const std::vector<std::int32_t> drawn = dm_.sample(draws);
    std::size_t offset = 0;
    std::vector<int> redo_slots;
    std::vector<std::vector<std::int32_t>> redo_chunks;
    std::vector<int> redo_kept;
    for (std::size_t i = 0; i < batch.size(); ++i) {  // the host loop's checks and counts
      const int slot = batch[i].slot;
      const long long budget = batch[i].budget;
      state& s = slots_[std::size_t(slot)];
      auto& o = out[i];
      std::int32_t next = drawn[offset];
      int kept = 0;
      if (s.pending_rows > 0) {
        int accepted = 0;
        for (int k = 1; k <= block && (long long)o.size() < budget; ++k) {
          ++s.stats.drafted;
          if (next != ids[i][std::size_t(k)]) break;
          ++s.stats.accepted, ++s.stats.accepted_at[std::size_t(k - 1)], ++accepted;
          o.push_back(next);
          if ((long long)o.size() == budget) break;
          next = drawn[offset + std::size_t(k)];  // (k <= fed here)
        }
        kept = std::min(accepted, fed[i]);  // fed drafts that stay
      }
      if ((long long)o.size() < budget) o.push_back(next);
      s.t = next;
      if (kept == fed[i]) {
        keep_pending(slot, (long long)offset, kept + 1);  // the capture of the kept positions q .. q + kept
      } else {  // a fed draft was rejected: back to q, then the kept tokens again
        redo_slots.push_back(slot), redo_kept.push_back(kept);
        redo_chunks.emplace_back(ids[i].begin(), ids[i].begin() + kept + 1);
      }
      offset += std::size_t(fed[i]) + 1;
    }
    if (!redo_slots.empty()) {
      for (const int slot : redo_slots) dm_.restore_sequence(slot, slots_[std::size_t(slot)].snapshot);
      dm_.append_all_on_device(redo_slots, redo_chunks);
      long long first = 0;
      for (std::size_t k = 0; k < redo_slots.size(); ++k)
        keep_pending(redo_slots[k], first, redo_kept[k] + 1), first += redo_kept[k] + 1;
    }
    return out;
  }

  //! Drafts fed with t in a round of `r` (a plain step feeds none): every draw the round can
  //! still make (budget - 1 after t's), so the sequence never runs past the tokens kept.
  long long feeds(const request& r) const {
    return slots_[std::size_t(r.slot)].pending_rows > 0 ? std::min<long long>(block, r.budget - 1) : 0;
  }
  bf16* pending_row(int slot) { return pending_.data() + std::size_t(slot) * std::size_t(W) * row; }
  void keep_pending(int slot, long long first, long long rows) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(pending_row(slot), dm_.main_hidden() + std::size_t(first) * row,
                                    std::size_t(rows) * row * sizeof(bf16), cudaMemcpyDeviceToDevice, dm_.stream()));
    slots_[std::size_t(slot)].pending_rows = rows, slots_[std::size_t(slot)].pending_positions = rows;
  }
  //! After a prefill or a CED append of `slot`: the captured rows (all of an exact prefill, the
  //! replayed tail of a CED call) seed the drafter's rings from zero, every one but the last,
  //! which the next round takes (one row: the rings take it, and the next round is a plain step).
  void seed_from_capture(int slot) {
    const long long rows = dm_.main_hidden_rows(), first = dm_.length(slot) - rows;
    if (rows >= 2) {
      dd_.prefill(slot, dm_.main_hidden(), rows - 1, first);
      keep_pending(slot, rows - 1, 1);
    } else {
      dd_.prefill(slot, dm_.main_hidden(), rows, first);
      slots_[std::size_t(slot)].pending_rows = 0, slots_[std::size_t(slot)].pending_positions = 0;
    }
  }
};

//! One sequence of a speculative batch: an empty sequence slot of the backbone (and of the
//! drafter), its prompt, how many tokens to generate, and how they are drawn (`sequence`: the
//! sampler's stream id, kernels/sampling).
struct speculative_request {
  int slot = -1;
  std::span<const std::int32_t> prompt;
  long long n_new = 0;
  kernels::sampling::sampling_params sampling{};
  std::uint64_t sequence = 0;
};

//! Generates batch[b].n_new tokens after each prompt (see the file comment), drafting with `dd`;
//! returns them per sequence and fills stats[b] as generate_speculative (speculative_reference.hpp)
//! does: speculative_batch's start() of each, then rounds of the sequences that want more. `dm`
//! needs limits::max_rows and logit_rows >= batch.size() x (block + 1) (one round of every
//! sequence in one call). `edit_drafts` (tests: an oracle drafter) may replace sequence b's drafts:
//! it receives b, the position of d_1 and [t_q, d_1 .. d_block]. Turns dm's main_hidden capture on.
template <class Model>
std::vector<std::vector<std::int32_t>> generate_speculative_batch(
    device_model<Model>& dm, device_dspark<Model>& dd, std::span<const speculative_request> batch,
    std::vector<speculative_stats>& stats, prompt_prefill mode = prompt_prefill::exact,
    const std::function<void(std::size_t, long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  constexpr int block = Model::dims.dspark.dspark_block_size;
  const std::size_t N = batch.size();
  const std::string where = "generate_speculative (CUDA): ";
  // Every request is checked before the first prefill (the prefills run one sequence at a time;
  // after a failure part-way the batch's slots hold partial state: release them).
  for (std::size_t b = 0; b < N; ++b) {
    const speculative_request& r = batch[b];
    const std::string who = "sequence " + std::to_string(b) + " (slot " + std::to_string(r.slot) + "): ";
    if (r.slot < 0 || r.slot >= dm.max_seqs() || r.slot >= dd.max_seqs())
      throw error(where + who + "no such slot (the backbone has " + std::to_string(dm.max_seqs()) + ", the drafter " +
                  std::to_string(dd.max_seqs()) + ")");
    for (std::size_t e = 0; e < b; ++e)
      if (batch[e].slot == r.slot) throw error(where + who + "the slot appears twice in the batch");
    if (dm.length(r.slot) < 0) throw error(where + who + "no live sequence in the slot (add_sequence first)");
    if (dm.length(r.slot) != 0)
      throw error(where + who + "the slot must be empty (it holds " + std::to_string(dm.length(r.slot)) + " tokens)");
    if (r.prompt.empty()) throw error(where + who + "empty prompt");
    if (r.n_new < 0) throw error(where + who + "negative token count");
    const long long P = static_cast<long long>(r.prompt.size());
    if (P > dm.max_rows())
      throw error(where + who + "a prompt of " + std::to_string(P) + " tokens exceeds limits::max_rows (" +
                  std::to_string(dm.max_rows()) + "), the prefill's call");
    // The sequence's longest state: the prompt and every token but the last drawn (never fed).
    if (P + std::max(r.n_new - 1, 0LL) > dm.max_tokens())
      throw error(where + who + std::to_string(P) + " prompt tokens and " + std::to_string(r.n_new) +
                  " to generate exceed limits::max_tokens (" + std::to_string(dm.max_tokens()) + ")");
  }
  const long long round_rows = static_cast<long long>(N) * (block + 1);
  if (dm.max_rows() < round_rows || dm.logit_rows() < round_rows)
    throw error(where + "the backbone's limits::max_rows (" + std::to_string(dm.max_rows()) + ") and logit_rows (" +
                std::to_string(dm.logit_rows()) + ") must hold a round of every sequence: " + std::to_string(N) +
                " x (block + 1) = " + std::to_string(round_rows) + " tokens");
  stats.assign(N, speculative_stats{});
  for (auto& st : stats) st.accepted_at.assign(std::size_t(block), 0);
  std::vector<std::vector<std::int32_t>> out(N);
  auto active = [&](std::size_t b) { return static_cast<long long>(out[b].size()) < batch[b].n_new; };
  bool any = false;
  for (std::size_t b = 0; b < N; ++b) any |= active(b);
  if (!any) return out;

  std::vector<std::size_t> index_of(std::size_t(dm.max_seqs()), 0);  // slot -> b, for edit_drafts
  for (std::size_t b = 0; b < N; ++b) index_of[std::size_t(batch[b].slot)] = b;
  typename speculative_batch<Model>::edit_fn edit;
  if (edit_drafts)
    edit = [&](int slot, long long first, std::vector<std::int32_t>& ids) { edit_drafts(index_of[std::size_t(slot)], first, ids); };
  speculative_batch<Model> sb(dm, dd, edit);
  for (std::size_t b = 0; b < N; ++b)  // (a prefill call holds one sequence)
    if (active(b)) out[b].push_back(sb.start(batch[b].slot, batch[b].prompt, mode, batch[b].sampling, batch[b].sequence));
  for (;;) {
    std::vector<typename speculative_batch<Model>::request> round;
    std::vector<std::size_t> members;
    for (std::size_t b = 0; b < N; ++b)
      if (active(b)) round.push_back({batch[b].slot, batch[b].n_new - (long long)out[b].size()}), members.push_back(b);
    if (round.empty()) break;
    const auto kept = sb.round(round);
    for (std::size_t i = 0; i < members.size(); ++i) out[members[i]].insert(out[members[i]].end(), kept[i].begin(), kept[i].end());
  }
  for (std::size_t b = 0; b < N; ++b)
    if (batch[b].n_new > 0) stats[b] = sb.stats(batch[b].slot);
  return out;
}

//! Generates `n_new` tokens after `prompt` on the empty sequence `slot` of `dm` (built with
//! limits::logit_rows >= block + 1 and max_rows >= block + 1), drafting with `dd` (the same slot):
//! generate_speculative_batch of one sequence. Returns the tokens and fills `stats` as
//! generate_speculative (speculative_reference.hpp) does; `edit_drafts` likewise (tests: an
//! oracle drafter). Turns dm's main_hidden capture on.
template <class Model>
std::vector<std::int32_t> generate_speculative(
    device_model<Model>& dm, device_dspark<Model>& dd, int slot, std::span<const std::int32_t> prompt,
    long long n_new, const kernels::sampling::sampling_params& sampling, speculative_stats& stats,
    prompt_prefill mode = prompt_prefill::exact, std::uint64_t sequence = 0,
    const std::function<void(long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  const speculative_request one{slot, prompt, n_new, sampling, sequence};
  std::vector<speculative_stats> st;
  std::function<void(std::size_t, long long, std::vector<std::int32_t>&)> edit;
  if (edit_drafts) edit = [&](std::size_t, long long first, std::vector<std::int32_t>& ids) { edit_drafts(first, ids); };
  auto out = generate_speculative_batch(dm, dd, std::span<const speculative_request>(&one, 1), st, mode, edit);
  stats = std::move(st[0]);
  return std::move(out[0]);
}

}  // namespace dsv4::model
