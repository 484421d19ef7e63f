// GPU microbenchmark of the masked linear (bf16), in the two ways the library runs it:
//
// 1. The engine's path (backward regime, one Linear whose owned rows are contiguous runs,
//    as a rank owns runs of neurons): dense forward, dense grad_x, and the owned rows'
//    weight and bias gradient written in fp32 into a communication bucket from bf16
//    operands (masked_linear_grad_runs_: strided views into cuBLAS with fp32 out_dtype, no
//    gather). Ideal: the same three GEMMs with the owned grad_y columns already contiguous
//    (what a gather-free kernel cannot beat), measured in the same rounds.
// 2. Arbitrary kept indices (masked_linear_forward then masked_linear_backward fed with the
//    operands the forward gathered, check_indices=false as the engine calls them) against
//    index_select + cuBLAS. Ideal: the three GEMMs on contiguous compact operands plus one
//    copy of an x-sized tensor: the full-width read of x (its kept columns are spread over
//    every row) and the full-width write of grad_x (zeros included) do not shrink with the
//    keep fraction.
//
// Shape: x [8192, 8192], W [8192, 8192] (--quick: 256), kept fraction f of outputs (1) or
// of inputs and outputs (2).
//
// Exit codes (bench_util.h, bench/README.md): 0 ran, results within tolerance, targets
// met (or --quick: none judged); 1 failed (bad arguments, no GPU, exception, or a result
// over kMaxRelErr); 3 ran correctly but a speed target was missed.
#include <ATen/ATen.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "bench_cuda_util.h"
#include "bench_util.h"
#include "masked_linear_ops.h"

using at::Tensor;
using bench::backward_op;
using bench::forward_op;
using bench::grad_runs_op;

static double rel_err(const Tensor& a, const Tensor& r) {
  return ((a.to(at::kFloat) - r.to(at::kFloat)).abs().max() / r.to(at::kFloat).abs().max().clamp_min(1e-30))
      .item<double>();
}

// Largest tolerated max |ours - reference| / max |reference|: both compute in bf16 with fp32
// accumulation, so they differ by a few bf16 roundings (the fp32 bucket by none of them).
constexpr double kMaxRelErr = 1e-2;
// The speed target at f = 0.5: at least this fraction of the ideal's speed.
constexpr double kTargetOfIdeal = 0.85;

// Runs of round(f * n) rows, wrapped around the end as a rank's rolling assignment wraps:
// [n - a, n) then [0, k - a), a about a third of k. Flat [start, length, ...]. aligned:
// the wrap point on a multiple of 64 rows (units of 64 neurons, or heads of dimension 64);
// otherwise on an odd row, so that the first run's view is not 16-byte aligned.
static std::vector<int64_t> wrapped_runs(int64_t n, double f, bool aligned) {
  const int64_t k = std::max<int64_t>(2, static_cast<int64_t>(n * f + 0.5));
  int64_t a = std::max<int64_t>(1, k / 3);
  a = aligned ? std::max<int64_t>(64, a / 64 * 64) : a | 1;
  a = std::min(a, k - 1);
  return {n - a, a, 0, k - a};
}

static Tensor runs_index(const std::vector<int64_t>& runs, const at::TensorOptions& options) {
  std::vector<Tensor> parts;
  for (size_t i = 0; i < runs.size(); i += 2) parts.push_back(at::arange(runs[i], runs[i] + runs[i + 1], options));
  return at::cat(parts);
}

struct Row {
  std::string line;
  double of_ideal;
};

// Part 1: the engine's backward-regime layer with owned row runs.
static Row engine_row(int64_t B, int64_t I, int64_t O, double f, bool aligned, bool& accurate,
                      const bench::Options& opts) {
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = opt.dtype(at::kFloat);
  Tensor x = at::randn({B, I}, opt), w = at::randn({O, I}, opt) * 0.02, b = at::randn({O}, opt);
  Tensor gy = at::randn({B, O}, opt);
  const std::vector<int64_t> runs = wrapped_runs(O, f, aligned);
  const Tensor idx = runs_index(runs, opt.dtype(at::kLong));
  const int64_t kept = idx.size(0);
  const Tensor gy_kept = gy.index_select(1, idx);  // what a gather would make: the ideal's operand
  Tensor bucket = at::empty({kept, I}, f32), bias_bucket = at::empty({kept}, f32);
  Tensor ideal_w = at::empty({kept, I}, f32), ideal_b;
  Tensor y1, gx1, y2, gx2;
  auto ours_fn = [&] {
    y1 = at::addmm(b, x, w.t());
    gx1 = gy.mm(w);
    grad_runs_op().call(bucket, bias_bucket, gy, x, runs, {}, false);
  };
  auto ideal_fn = [&] {
    y2 = at::addmm(b, x, w.t());
    gx2 = gy.mm(w);
    at::mm_out(ideal_w, gy_kept.t(), x, at::kFloat);
    ideal_b = at::sum(gy_kept, {0}, false, at::kFloat);
  };
  const auto t = bench::interleaved_cuda_medians_ms({ours_fn, ideal_fn}, opts.warmup, opts.rounds);
  const double ours = t[0], ideal = t[1];
  ours_fn();
  ideal_fn();
  bench::inject_fault(opts, bucket);
  double err = std::max(rel_err(bucket, ideal_w), rel_err(bias_bucket, ideal_b));
  if (!(err <= kMaxRelErr)) {  // also catches NaN
    std::fprintf(stderr, "masked_linear_cuda_bench: engine path f=%.2f: max rel err %.3e vs ideal exceeds %.1e\n", f,
                 err, kMaxRelErr);
    accurate = false;
  }
  const double flops = 2.0 * B * I * O * 2 + 2.0 * B * I * kept;
  char line[320];
  std::snprintf(line, sizeof line, "| engine: 2 row runs (%s), grad_W fp32 | %ldx%ld->%ld | %.2f | %.3f | %.3f | - "
                "| %.1f | %.1f%% | - | %.1e |", aligned ? "aligned" : "odd start", B, I, O, f, ours, ideal,
                flops / ours / 1e9, 100.0 * ideal / ours, err);
  return {line, ideal / ours};
}

// Part 2: arbitrary kept indices of inputs and outputs, forward + backward.
static Row indexed_row(int64_t B, int64_t I, int64_t O, double f, bool& accurate, const bench::Options& opts,
                       double* speedup) {
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto idx_opt = opt.dtype(at::kLong);
  Tensor x = at::randn({B, I}, opt), w = at::randn({O, I}, opt) * 0.02, b = at::randn({O}, opt);
  Tensor out_idx = bench::kept_indices(O, f, idx_opt), in_idx = bench::kept_indices(I, f, idx_opt);
  Tensor gy = at::randn({B, out_idx.size(0)}, opt);
  // The ideal's operands: the kept blocks, contiguous, made once outside the timing.
  const Tensor xs = x.index_select(1, in_idx), ws = w.index_select(0, out_idx).index_select(1, in_idx),
               bs = b.index_select(0, out_idx);
  Tensor copy_dst = at::empty_like(x);
  Tensor y1, xk, wk, gx1, gw1, gb1, y2, gx2, gw2, gb2, ideal_y, ideal_gx, ideal_gw;
  auto ours_fn = [&] {
    std::tie(y1, xk, wk) = forward_op().call(x, w, b, out_idx, in_idx, false, -1, bench::kCheckIndices);
    std::tie(gx1, gw1, gb1) = backward_op().call(gy, x, w, out_idx, in_idx, false, false, false, {true, true, true},
                                                 xk, wk, bench::kCheckIndices);
  };
  auto composed_fn = [&] {
    std::tie(y2, gx2, gw2, gb2) = bench::composed_forward_backward(x, w, b, gy, out_idx, in_idx);
  };
  auto ideal_fn = [&] {
    ideal_y = at::addmm(bs, xs, ws.t());
    ideal_gx = gy.mm(ws);
    ideal_gw = gy.t().mm(xs);
    copy_dst.copy_(x);  // the full-width read of x and write of grad_x
  };
  const auto t = bench::interleaved_cuda_medians_ms({ours_fn, composed_fn, ideal_fn}, opts.warmup, opts.rounds);
  const double ours = t[0], composed = t[1], ideal = t[2];
  ours_fn();
  composed_fn();
  bench::inject_fault(opts, y1);
  double err = 0;
  for (auto [a, r] : {std::pair{y1, y2}, std::pair{gx1, gx2}, std::pair{gw1, gw2}, std::pair{gb1, gb2}}) {
    err = std::max(err, rel_err(a, r));
  }
  if (!(err <= kMaxRelErr)) {
    std::fprintf(stderr, "masked_linear_cuda_bench: indexed f=%.2f: max rel err %.3e vs composed exceeds %.1e\n", f,
                 err, kMaxRelErr);
    accurate = false;
  }
  const double flops = 3.0 * 2.0 * B * out_idx.size(0) * in_idx.size(0);
  *speedup = composed / ours;
  char line[320];
  std::snprintf(line, sizeof line, "| indexed: arbitrary R and S | %ldx%ld->%ld | %.2f | %.3f | %.3f | %.3f | %.1f "
                "| %.1f%% | %.2fx | %.1e |", B, I, O, f, ours, ideal, composed, flops / ours / 1e9,
                100.0 * ideal / ours, composed / ours, err);
  return {line, ideal / ours};
}

static bench::Outcome run(const bench::Options& opts) {
  bench::require_cuda("masked_linear_cuda_bench");
  at::manual_seed(0);
  const int64_t B = opts.quick ? 256 : 8192, I = B, O = B;
  std::printf("| path | shape | f | ours ms | ideal ms | composed ms | TFLOP/s | %% of ideal | speedup vs composed "
              "| max rel err |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bench::Outcome outcome;
  std::vector<std::string> verdicts;
  bool met = true;
  double engine_half = 1, indexed_half = 0;
  for (double f : {0.25, 0.5}) {
    double worst_engine = 1;
    for (bool aligned : {true, false}) {
      const Row e = engine_row(B, I, O, f, aligned, outcome.accurate, opts);
      std::printf("%s\n", e.line.c_str());
      worst_engine = std::min(worst_engine, e.of_ideal);
    }
    double speedup = 0;
    const Row a = indexed_row(B, I, O, f, outcome.accurate, opts, &speedup);
    std::printf("%s\n", a.line.c_str());
    if (f == 0.5) {
      const bool engine_ok = worst_engine >= kTargetOfIdeal, indexed_ok = a.of_ideal >= kTargetOfIdeal,
                 fast = speedup >= 1.0;
      met = engine_ok && indexed_ok && fast;
      engine_half = worst_engine, indexed_half = a.of_ideal;
      char line[320];
      std::snprintf(line, sizeof line, "- f=0.50, engine path (runs, aligned and odd): >= %.0f%% of ideal: %s "
                    "(worst %.1f%%)\n- f=0.50, arbitrary indices: >= %.0f%% of ideal: %s (%.1f%%); at least as fast "
                    "as index_select + cuBLAS: %s (%.2fx)", 100 * kTargetOfIdeal, bench::verdict(engine_ok),
                    100.0 * worst_engine, 100 * kTargetOfIdeal, bench::verdict(indexed_ok), 100.0 * a.of_ideal,
                    bench::verdict(fast), speedup);
      verdicts.emplace_back(line);
    }
  }
  outcome.targets_met = met;
  std::printf("\nTargets (GPU bf16):\n");
  for (auto& v : verdicts) std::printf("%s\n", v.c_str());
  std::printf("\n(Medians of %d interleaved rounds of CUDA-event times after %d warm-ups. TFLOP/s: the path's own "
              "GEMM FLOPs over its time.)\n", opts.rounds, opts.warmup);
  std::printf("[summary] f=0.5: engine path (worst) %.1f%% of ideal, arbitrary indices %.1f%% (target %.0f%%)\n",
              100.0 * engine_half, 100.0 * indexed_half, 100 * kTargetOfIdeal);
  return outcome;
}

int main(int argc, char** argv) {
  return bench::run_benchmark("masked_linear_cuda_bench", "GPU (bf16) masked linear: the engine's run path and "
                              "arbitrary indices, against their ideal and index_select + cuBLAS.", argc, argv, run);
}
