// CPU microbenchmark of the masked linear: forward + backward of our ops against the best
// composition of torch ops and against the ideal (dense time x kept share of the work).
//
// Shape: x [512, 4096], W [4096, 4096] stored full (--quick: x [32, 128], W [128, 128]),
// kept fraction f of inputs and outputs. All three GEMMs of forward + backward (y,
// grad_x, grad_W) shrink by f^2 when both sides keep f, so ideal(f) = dense(forward +
// backward) * f^2.
//
// "ours" is what autograd runs: masked_linear_forward (which returns the gathered x[:, S]
// and W[R][:, S]) then masked_linear_backward fed with them, with check_indices=false as
// the engine calls them; "ours, regather" calls the backward without them, so it gathers
// both operands a second time.
//
// Exit codes (bench_util.h, bench/README.md): 0 ran, results within tolerance, targets
// met (or --quick: none judged); 1 failed (bad arguments, exception, or a result over
// kMaxRelErr); 3 ran correctly but a speed target was missed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <tuple>

#include "bench_util.h"
#include "masked_linear_ops.h"

using at::Tensor;
using bench::backward_op;
using bench::forward_op;

// Largest tolerated max |ours - composed| / max |composed| over y, grad_x, grad_W, grad_b:
// both run fp32 GEMMs on the same gathered operands, so they differ by rounding only.
constexpr double kMaxRelErr = 1e-4;

static bench::Outcome run(const bench::Options& opts) {
  at::manual_seed(0);
  const int64_t B = opts.quick ? 32 : 512, I = opts.quick ? 128 : 4096, O = I;
  Tensor x = at::randn({B, I}), w = at::randn({O, I}) * 0.02, b = at::randn({O});
  Tensor gy_full = at::randn({B, O});

  auto dense_fn = [&] { bench::dense_forward_backward(x, w, b, gy_full); };
  const double dense_flops = 3.0 * 2.0 * B * I * O;
  char shape[64];
  std::snprintf(shape, sizeof shape, "%ldx%ld->%ld", static_cast<long>(B), static_cast<long>(I), static_cast<long>(O));
  std::printf("| shape | f | ours ms | ours, regather ms | composed ms | ideal ms | GFLOP/s | %% of dense GEMM rate "
              "| speedup vs composed | %% of ideal | max rel err |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bench::Outcome outcome;
  std::vector<std::string> rows, verdicts;
  double dense_for_print = 0;
  for (double f : {0.25, 0.5, 1.0}) {
    Tensor out_idx = bench::kept_indices(O, f), in_idx = bench::kept_indices(I, f);
    Tensor gy = at::randn({B, out_idx.size(0)});
    Tensor y1, xk, wk, gx1, gw1, gb1;
    auto ours_fn = [&] {
      std::tie(y1, xk, wk) = forward_op().call(x, w, b, out_idx, in_idx, false, -1, bench::kCheckIndices);
      std::tie(gx1, gw1, gb1) = backward_op().call(gy, x, w, out_idx, in_idx, false, false, false,
                                                   {true, true, true}, xk, wk, bench::kCheckIndices);
    };
    auto regather_fn = [&] {
      std::tie(y1, xk, wk) = forward_op().call(x, w, b, out_idx, in_idx, false, -1, bench::kCheckIndices);
      xk.reset(), wk.reset();
      std::tie(gx1, gw1, gb1) = backward_op().call(gy, x, w, out_idx, in_idx, false, false, false,
                                                   {true, true, true}, std::nullopt, std::nullopt,
                                                   bench::kCheckIndices);
    };
    // Composed baselines: gather operands once (index_select), GEMMs, scatter grad_x back.
    Tensor y2, gx2, gw2, gb2;
    auto composed_a_fn = [&] {
      std::tie(y2, gx2, gw2, gb2) = bench::composed_forward_backward(x, w, b, gy, out_idx, in_idx);
    };
    auto composed_b_fn = [&] {
      Tensor xs = x.index_select(1, in_idx);
      Tensor ws = w.index_select(1, in_idx).index_select(0, out_idx);
      y2 = at::addmm(b.index_select(0, out_idx), xs, ws.t());
      gx2 = at::zeros({B, I}, x.options()).index_add_(1, in_idx, gy.mm(ws));
      gw2 = gy.t().mm(xs);
      gb2 = gy.sum(0);
    };
    // Dense is measured in the same interleaved rounds, so ideal and ours see the same machine.
    const auto t = bench::interleaved_medians_ms({dense_fn, ours_fn, regather_fn, composed_a_fn, composed_b_fn},
                                                 opts.warmup, opts.rounds);
    const double dense = t[0], ours = t[1], regather = t[2], composed = std::min(t[3], t[4]);
    dense_for_print = dense;
    ours_fn();
    composed_a_fn();
    bench::inject_fault(opts, y1);
    double ideal = dense * f * f;
    double flops = 3.0 * 2.0 * B * out_idx.size(0) * in_idx.size(0);
    double err = 0;
    for (auto [a, r] : {std::pair{y1, y2}, std::pair{gx1, gx2}, std::pair{gw1, gw2}, std::pair{gb1, gb2}}) {
      err = std::max(err, ((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item<double>());
    }
    if (!(err <= kMaxRelErr)) {  // also catches NaN
      std::fprintf(stderr, "masked_linear_bench: f=%.2f: max rel err %.3e vs composed exceeds %.1e\n", f, err,
                   kMaxRelErr);
      outcome.accurate = false;
    }
    char line[300];
    std::snprintf(line, sizeof line, "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f%% | %.2fx | %.1f%% | %.1e |",
                  shape, f, ours, regather, composed, ideal, flops / ours / 1e6,
                  100.0 * (flops / ours) / (dense_flops / dense), composed / ours, 100.0 * ideal / ours, err);
    rows.emplace_back(line);
    if (f < 1.0) {
      bool fast = ours <= composed, near = ideal / ours >= 0.8;
      outcome.targets_met = outcome.targets_met && fast && near;
      std::snprintf(line, sizeof line, "- f=%.2f: fwd+bwd no slower than the best composed baseline: %s (%.2fx); "
                    ">= 80%% of ideal: %s (%.1f%%)", f, bench::verdict(fast), composed / ours,
                    bench::verdict(near), 100.0 * ideal / ours);
      verdicts.emplace_back(line);
    }
  }
  std::printf("| %s dense | 1.00 | %.2f | - | - | - | %.1f | 100.0%% | - | - | - |\n", shape, dense_for_print,
              dense_flops / dense_for_print / 1e6);
  for (auto& r : rows) std::printf("%s\n", r.c_str());
  std::printf("\nTargets (CPU fp32):\n");
  for (auto& v : verdicts) std::printf("%s\n", v.c_str());
  std::printf("\n(Medians of %d interleaved rounds after %d warm-ups; dense, ours and the baselines are timed in the "
              "same rounds. The dense row is the last round set's.)\n", opts.rounds, opts.warmup);
  return outcome;
}

int main(int argc, char** argv) {
  return bench::run_benchmark("masked_linear_bench", "CPU masked linear forward + backward against composed torch ops.",
                              argc, argv, run);
}
