#pragma once
// The appended-turn plans that test_speculative (host) and test_dspark_cuda (CUDA) run through
// speculative_decoder::resume / speculative_batch::resume: exact and CED turns shorter and longer
// than the window; two turns with no round between them, the second one W - 1 tokens after one of
// 3 (on CUDA it moves the rows the drafter has not seen down its buffer, the oldest dropped); a
// turn right after a one-token prompt's start, before any round.

#include <vector>

#include "dsv4/model/speculative_reference.hpp"

namespace dsv4::test {

struct resume_turn {
  int length;  // tokens appended, the last token returned first
  model::prompt_prefill mode;
};
struct resume_plan {
  int prompt;                      // the first turn's prompt
  long long before;                // tokens generated before the appended turns (1: none but start's)
  std::vector<resume_turn> turns;  // appended one after the other, no round between them
};

inline std::vector<resume_plan> resume_plans(int window) {
  const auto exact = model::prompt_prefill::exact, ced = model::prompt_prefill::ced;
  return {{4, 8, {{5, exact}}},           {5, 8, {{5, ced}}},
          {6, 8, {{window + 20, exact}}}, {3, 8, {{window + 20, ced}}},
          {4, 8, {{3, exact}, {window - 1, exact}}}, {1, 1, {{5, exact}}}};
}

}  // namespace dsv4::test
