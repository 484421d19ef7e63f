// GPU microbenchmark of the masked linear (bf16): forward + backward of our ops against
// dense cuBLAS (the ideal: dense time x f^2) and against index_select + cuBLAS.
//
// Shape: x [8192, 8192], W [8192, 8192] stored full (--quick: 256), kept fraction f of
// inputs and outputs. "ours" is what autograd runs: masked_linear_forward (returns the
// gathered x[:, S] and W[R][:, S]) then masked_linear_backward fed with them, with
// check_indices=false as the engine calls them.
//
// Exit codes (bench_util.h, bench/README.md): 0 ran, results within tolerance, targets
// met (or --quick: none judged); 1 failed (bad arguments, no GPU, exception, or a result
// over kMaxRelErr); 3 ran correctly but a speed target was missed.
#include <ATen/ATen.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "bench_cuda_util.h"
#include "bench_util.h"
#include "masked_linear_ops.h"

using at::Tensor;
using bench::backward_op;
using bench::forward_op;

static double rel_err(const Tensor& a, const Tensor& r) {
  return ((a.to(at::kFloat) - r.to(at::kFloat)).abs().max() / r.to(at::kFloat).abs().max().clamp_min(1e-30))
      .item<double>();
}

// Largest tolerated max |ours - composed| / max |composed| over y, grad_x, grad_W, grad_b:
// both compute in bf16 with fp32 accumulation, so they differ by a few bf16 roundings.
constexpr double kMaxRelErr = 1e-2;

static bench::Outcome run(const bench::Options& opts) {
  bench::require_cuda("masked_linear_cuda_bench");
  at::manual_seed(0);
  const int64_t B = opts.quick ? 256 : 8192, I = B, O = B;
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto idx_opt = at::TensorOptions().device(at::kCUDA).dtype(at::kLong);
  Tensor x = at::randn({B, I}, opt), w = at::randn({O, I}, opt) * 0.02, b = at::randn({O}, opt);
  Tensor gy_full = at::randn({B, O}, opt);
  auto dense_fn = [&] { bench::dense_forward_backward(x, w, b, gy_full); };
  const double dense_flops = 3.0 * 2.0 * B * I * O;
  std::printf("| shape | dtype | f | ours ms | composed ms | ideal ms | TFLOP/s | %% of dense GEMM rate "
              "| speedup vs composed | %% of ideal | max rel err vs composed |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::vector<std::string> verdicts;
  bench::Outcome outcome;
  for (double f : {0.25, 0.5}) {
    Tensor out_idx = bench::kept_indices(O, f, idx_opt), in_idx = bench::kept_indices(I, f, idx_opt);
    Tensor gy = at::randn({B, out_idx.size(0)}, opt);
    Tensor y1, xk, wk, gx1, gw1, gb1, y2, gx2, gw2, gb2;
    auto ours_fn = [&] {
      std::tie(y1, xk, wk) = forward_op().call(x, w, b, out_idx, in_idx, false, -1, bench::kCheckIndices);
      std::tie(gx1, gw1, gb1) =
          backward_op().call(gy, x, w, out_idx, in_idx, false, false, false, {true, true, true}, xk, wk, bench::kCheckIndices);
    };
    auto composed_fn = [&] {
      std::tie(y2, gx2, gw2, gb2) = bench::composed_forward_backward(x, w, b, gy, out_idx, in_idx);
    };
    const auto t = bench::interleaved_cuda_medians_ms({dense_fn, ours_fn, composed_fn}, opts.warmup, opts.rounds);
    const double dense = t[0], ours = t[1], composed = t[2], ideal = dense * f * f;
    ours_fn();
    composed_fn();
    bench::inject_fault(opts, y1);
    double err = 0;
    for (auto [a, r] : {std::pair{y1, y2}, std::pair{gx1, gx2}, std::pair{gw1, gw2}, std::pair{gb1, gb2}}) {
      err = std::max(err, rel_err(a, r));
    }
    if (!(err <= kMaxRelErr)) {  // also catches NaN
      std::fprintf(stderr, "masked_linear_cuda_bench: f=%.2f: max rel err %.3e vs composed exceeds %.1e\n", f, err,
                   kMaxRelErr);
      outcome.accurate = false;
    }
    const double flops = 3.0 * 2.0 * B * out_idx.size(0) * in_idx.size(0);
    if (f == 0.25) {
      std::printf("| %ldx%ld->%ld dense | bf16 | 1.00 | %.3f | - | - | %.1f | 100.0%% | - | - | - |\n", B, I, O, dense,
                  dense_flops / dense / 1e9);
    }
    std::printf("| %ldx%ld->%ld | bf16 | %.2f | %.3f | %.3f | %.3f | %.1f | %.1f%% | %.2fx | %.1f%% | %.1e |\n", B, I,
                O, f, ours, composed, ideal, flops / ours / 1e9, 100.0 * (flops / ours) / (dense_flops / dense),
                composed / ours, 100.0 * ideal / ours, err);
    if (f == 0.5) {
      const bool near = ideal / ours >= 0.8, fast = ours <= composed;
      outcome.targets_met = near && fast;
      char line[240];
      std::snprintf(line, sizeof line, "- f=0.50: >= 80%% of ideal: %s (%.1f%%); at least as fast as index_select + "
                    "cuBLAS: %s (%.2fx)", bench::verdict(near), 100.0 * ideal / ours, bench::verdict(fast),
                    composed / ours);
      verdicts.emplace_back(line);
    }
  }
  std::printf("\nTargets (GPU bf16):\n");
  for (auto& v : verdicts) std::printf("%s\n", v.c_str());
  std::printf("\n(Medians of %d interleaved rounds of CUDA-event times after %d warm-ups.)\n", opts.rounds,
              opts.warmup);
  return outcome;
}

int main(int argc, char** argv) {
  return bench::run_benchmark("masked_linear_cuda_bench", "GPU (bf16) masked linear forward + backward against "
                              "dense cuBLAS and index_select + cuBLAS.", argc, argv, run);
}
