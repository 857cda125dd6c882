#pragma once
//! \file
//! Generation with DSpark drafts on the host: the speculative-decoding loop the official
//! reference leaves out (spec §13: "nothing calls forward_spec"), written down once so that every
//! backend's loop has a reference for what must come out and how drafts are counted.
//!
//! The rule: a token at position q is always `sample_reference(logits_q, sampling, sequence, q)`,
//! drawn from the backbone's logits for q, exactly as plain decoding draws it (`dsv4 run`). A
//! draft d for q is accepted when that draw equals d; the first draw that differs ends the round
//! and becomes the next round's input token. So the generated tokens equal plain decoding's for
//! any sampling parameters, by construction; the drafts decide only how many positions one round
//! verifies (on a GPU: how many rows one batched verify call carries, and where it rolls back).
//!
//! Here the verify runs position by position (one backbone decode call per verified token), so it
//! never feeds a rejected draft and needs no rollback: on the host the loop is a semantic
//! reference and an acceptance-rate meter, not a speedup.
//!
//! The drafter's bookkeeping (spec §14): after the prefill the DSpark rings are seeded with every
//! prompt position but the last; a round at backbone length q gives the drafter the main_hidden
//! rows it has not seen (positions st.length .. q - 1; the prompt's last row in the first round)
//! and the token t_q, and drafts d_1 .. d_block for q + 1 .. q + block. Holding the prompt's last
//! row back lets the first round draft right after the prefill; the rings end up as the
//! reference's step-by-step calls leave them (each slot holds the backbone's main_kv of its
//! position, dspark_decode writes a chunk's rows as row-by-row steps would).

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/model/model_reference.hpp"

namespace dsv4::model {

//! How the drafts fared over a generation.
struct speculative_stats {
  long long rounds = 0;    //!< draft blocks made
  long long drafted = 0;   //!< drafts that were checked (a round cut short by the token budget checks fewer)
  long long accepted = 0;  //!< drafts equal to the backbone's token
  std::vector<long long> accepted_at;  //!< [block]: rounds whose draft i was accepted
  double accepted_per_round() const { return rounds ? double(accepted) / double(rounds) : 0.0; }
};

//! Prefill mode of the generation's prompt.
enum class prompt_prefill { exact, ced };

//! Generates `n_new` tokens after `prompt` on a fresh sequence `seq`, drafting with `w`. Returns
//! the tokens (equal to plain decoding's, see the file comment) and fills `stats`. `edit_drafts`,
//! if set, may replace a round's drafts before they are checked (tests: an oracle drafter);
//! it receives the position of d_1 and the ids [t_q, d_1 .. d_block].
template <class Model>
std::vector<std::int32_t> generate_speculative(
    const host_model<Model>& m, const dspark_weights& w, host_sequence& seq, std::span<const std::int32_t> prompt, long long n_new,
    const kernels::sampling::sampling_params& sampling, speculative_stats& stats,
    prompt_prefill mode = prompt_prefill::exact, std::uint64_t sequence = 0,
    const std::function<void(long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  constexpr std::size_t row = std::size_t(Model::dims.dim) * std::size_t(models::model_traits<Model>::schedule::drafter::targets::size);
  if (seq.length != 0) throw error("generate_speculative: the sequence must be fresh (it holds " + std::to_string(seq.length) + " tokens)");
  if (prompt.empty()) throw error("generate_speculative: empty prompt");
  if (n_new < 0) throw error("generate_speculative: negative token count");
  if (w.block <= 0) throw error("generate_speculative: the drafter has no draft block");
  stats = speculative_stats{};
  stats.accepted_at.assign(std::size_t(w.block), 0);
  std::vector<std::int32_t> out;
  if (n_new == 0) return out;

  std::vector<bf16> mh;  // main_hidden of the last backbone call
  auto logits = mode == prompt_prefill::ced ? forward_ced(m, seq, prompt, nullptr, &mh) : forward(m, seq, prompt, nullptr, &mh);
  auto draw = [&](const std::vector<float>& l) { return kernels::sampling::sample_reference(l, sampling, sequence, std::uint64_t(seq.length)); };
  auto step = [&](std::int32_t id, std::vector<bf16>& hidden) {
    const auto l = forward(m, seq, std::span<const std::int32_t>(&id, 1), nullptr, &mh);
    hidden.insert(hidden.end(), mh.begin(), mh.end());
    return l;
  };
  // The rows main_hidden covers: all of an exact prefill, the replayed tail of a CED one.
  const long long rows = (long long)(mh.size() / row), first = seq.length - rows;
  dspark_state st;
  std::vector<bf16> pending;  // main_hidden rows the drafter has not seen
  std::int32_t t = draw(logits);
  out.push_back(t);
  if (rows >= 2) {
    dspark_prefill<Model>(w, st, std::span<const bf16>(mh).first(std::size_t(rows - 1) * row), first);
    pending.assign(mh.end() - std::ptrdiff_t(row), mh.end());
  } else {  // a one-row prompt: seed with it, then one plain step gives the first pending row
    dspark_prefill<Model>(w, st, mh, first);
    if ((long long)out.size() == n_new) return out;
    logits = step(t, pending);
    t = draw(logits);
    out.push_back(t);
  }
  while ((long long)out.size() < n_new) {
    // Invariant: the backbone holds positions < q = seq.length, t is the token for q (in `out`,
    // not yet fed), the drafter has seen positions < q - rows(pending).
    const long long q = seq.length;
    dspark_draft d = dspark_decode<Model>(m, w, st, t, pending, sampling, sequence);
    pending.clear();
    if (edit_drafts) edit_drafts(q + 1, d.ids);
    if (d.ids.size() != std::size_t(w.block) + 1 || d.ids[0] != t)
      throw error("generate_speculative: a draft block must be block + 1 ids starting with the input token");
    ++stats.rounds;
    logits = step(t, pending);  // t at q: the logits for q + 1
    std::int32_t next = draw(logits);
    for (int i = 1; i <= w.block && (long long)out.size() < n_new; ++i) {
      ++stats.drafted;
      if (next != d.ids[std::size_t(i)]) break;
      ++stats.accepted, ++stats.accepted_at[std::size_t(i - 1)];
      out.push_back(next);
      if ((long long)out.size() == n_new) return out;
      logits = step(next, pending);
      next = draw(logits);
    }
    if ((long long)out.size() < n_new) out.push_back(next);
    t = next;
  }
  return out;
}

}  // namespace dsv4::model
