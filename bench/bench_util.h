// Timing and table helpers shared by the CPU microbenchmarks (torch-free except at::Tensor).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace bench {

// Median wall time in milliseconds of fn over `reps` runs after `warmup` runs.
inline double median_ms(const std::function<void()>& fn, int warmup = 3, int reps = 11) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    fn();
    auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Median wall time in milliseconds of each fn, measured in interleaved rounds (every fn
// once per round) so that a drift of the shared machine's speed hits every variant alike.
inline std::vector<double> interleaved_medians_ms(const std::vector<std::function<void()>>& fns, int warmup = 3,
                                                  int reps = 21) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> t(fns.size());
  for (int i = 0; i < reps; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      auto a = std::chrono::steady_clock::now();
      fns[f]();
      auto b = std::chrono::steady_clock::now();
      t[f].push_back(std::chrono::duration<double, std::milli>(b - a).count());
    }
  }
  std::vector<double> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

inline const char* verdict(bool ok) { return ok ? "PASS" : "FAIL"; }

}  // namespace bench
