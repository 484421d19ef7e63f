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

inline const char* verdict(bool ok) { return ok ? "PASS" : "FAIL"; }

}  // namespace bench
