// Options, exit codes and timing shared by every microbenchmark binary (CPU and CUDA;
// torch-free except at::Tensor).
//
// Exit codes (the same for every binary; bench/README.md):
//   0  ran: every result within its error tolerance, every speed target met (or none
//      judged: a --quick run judges none)
//   1  failed: bad arguments, no device, an exception, or a result over its error tolerance
//   3  ran and every result is within tolerance, but a speed target was missed
//
// Arguments: --quick (tiny sizes and few rounds: checks that the binary runs, prints its
// tables and computes correct results; CI runs it), --help. Test-only fault injection:
// SUBNET_EXT_BENCH_FAULT=wrong-result (corrupts one element of "ours" before the error
// check, so the binary must exit 1) or =missed-target (the binary must exit 3).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace bench {

constexpr int kExitRan = 0;
constexpr int kExitFailed = 1;
constexpr int kExitTargetMissed = 3;

struct Options {
  bool quick = false;                 // tiny sizes, few rounds, speed targets not judged
  bool inject_wrong_result = false;   // SUBNET_EXT_BENCH_FAULT=wrong-result
  bool inject_missed_target = false;  // SUBNET_EXT_BENCH_FAULT=missed-target
  int warmup = 3;                     // untimed rounds before the timed ones
  int rounds = 21;                    // timed interleaved rounds (medians over them)
};

// What a benchmark body found: whether every result was within tolerance, and whether
// every speed target it judged was met.
struct Outcome {
  bool accurate = true;
  bool targets_met = true;
};

// Adds 1 to the first element of `ours` when the wrong-result fault is injected, so that
// a test can watch the error check catch a wrong kernel.
inline void inject_fault(const Options& opts, at::Tensor& ours) {
  if (opts.inject_wrong_result) ours.view(-1).narrow(0, 0, 1).add_(1.0);
}

// Parses argv and SUBNET_EXT_BENCH_FAULT; returns false (after printing why) on bad input.
inline bool parse_options(const char* name, const char* about, int argc, char** argv, Options& opts) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      opts.quick = true;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: %s [--quick]\n%s\n--quick: tiny sizes and few rounds (checks that it runs; speed targets "
                  "not judged).\nExit: 0 ran and targets met, 1 failed, 3 ran but a speed target was missed.\n",
                  name, about);
      std::exit(kExitRan);
    } else {
      std::fprintf(stderr, "%s: unknown argument '%s'; the only option is --quick (see --help)\n", name, argv[i]);
      return false;
    }
  }
  const char* fault = std::getenv("SUBNET_EXT_BENCH_FAULT");
  if (fault != nullptr && *fault != '\0') {
    if (std::strcmp(fault, "wrong-result") == 0) {
      opts.inject_wrong_result = true;
    } else if (std::strcmp(fault, "missed-target") == 0) {
      opts.inject_missed_target = true;
    } else {
      std::fprintf(stderr, "%s: SUBNET_EXT_BENCH_FAULT='%s' is not a fault; use wrong-result or missed-target\n",
                   name, fault);
      return false;
    }
  }
  if (opts.quick) {
    opts.warmup = 1;
    opts.rounds = 3;
  }
  return true;
}

// The whole life of a benchmark binary: options, the body, exceptions, the exit code.
inline int run_benchmark(const char* name, const char* about, int argc, char** argv,
                         const std::function<Outcome(const Options&)>& body) {
  Options opts;
  if (!parse_options(name, about, argc, argv, opts)) return kExitFailed;
  Outcome outcome;
  try {
    outcome = body(opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: failed: %s\n", name, e.what());
    return kExitFailed;
  }
  if (!outcome.accurate) {
    std::fprintf(stderr, "%s: a result is over its error tolerance (exit %d)\n", name, kExitFailed);
    return kExitFailed;
  }
  if (opts.inject_missed_target) return kExitTargetMissed;
  if (opts.quick) {
    std::printf("\n(--quick run: tiny sizes, speed targets not judged.)\n");
    return kExitRan;
  }
  return outcome.targets_met ? kExitRan : kExitTargetMissed;
}

// Median wall time in milliseconds of each fn, measured in interleaved rounds (every fn
// once per round) so that a drift of the shared machine's speed hits every variant alike.
inline std::vector<double> interleaved_medians_ms(const std::vector<std::function<void()>>& fns, int warmup,
                                                  int reps) {
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
