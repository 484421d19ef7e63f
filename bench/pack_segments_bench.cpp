// CPU microbenchmark of pack_segments + unpack_average_: 200 fp32 tensors, 64 MiB in all
// (--quick: 20 tensors, 256 KiB), the first half of each tensor's rows owned (one
// rectangle per tensor).
//
// "ours" is the path the engine runs: tables prepared once per layout (prepare_segments,
// what subnet_ext.ops.PreparedSegments wraps and comm/prepared.py caches), then
// pack_segments_prepared + unpack_average_prepared_, which skip validation. "unprepared"
// is the plain pack_segments + unpack_average_, which validate the table on every call.
//
// Bytes moved: pack reads and writes the owned half (2 x 32 MiB), unpack reads the buffer
// and writes the tensors (2 x 32 MiB): 128 MiB per pack + unpack. The ceiling is torch's
// own copy_ of the same bytes (two 32 MiB copies, also 128 MiB moved).
//
// Exit codes (bench_util.h, bench/README.md): 0 ran, results exact, targets met (or
// --quick: none judged); 1 failed (bad arguments, exception, or a packed/unpacked element
// that differs); 3 ran correctly but a speed target was missed.
#include <ATen/ATen.h>

#include <cstdio>
#include <vector>

#include "bench_util.h"
#include "pack_segments_ops.h"

using at::Tensor;

static bench::Outcome run(const bench::Options& opts) {
  at::manual_seed(0);
  const int64_t total = opts.quick ? 64 * 1024 : 16 * 1024 * 1024;  // fp32 elements: 64 MiB
  const int n = opts.quick ? 20 : 200;
  const bench::HalfOwnedLayout layout(n, total, opts.quick ? std::array<int64_t, 5>{4, 8, 16, 32, 64}
                                                           : std::array<int64_t, 5>{64, 128, 256, 512, 1024},
                                      at::kFloat);
  const std::vector<Tensor>& tensors = layout.tensors;
  const int64_t owned = layout.owned;
  Tensor buffer = at::empty({owned});
  const double bytes = 4.0 * owned * 4;  // read + write, pack + unpack

  // Averaging scales as in a 2-owner group (1/2), alternated with 2 from one run to the next
  // so that the data keeps its magnitude (never timing on zeros, denormals or a decay
  // towards them); every variant multiplies every element once per run.
  Tensor halves = at::full({n}, 0.5, at::kFloat), twos = at::full({n}, 2.0, at::kFloat);
  const bench::PreparedTable halving = layout.prepare(buffer, halves), doubling = layout.prepare(buffer, twos);
  bool ours_half = true, unprepared_half = true, composed_half = true;
  auto ours_fn = [&] {
    const bench::PreparedTable& unpack_table = ours_half ? halving : doubling;
    bench::pack_prepared_op().call(tensors, halving.host, halving.device, buffer);
    bench::unpack_prepared_op().call(tensors, unpack_table.host, unpack_table.device, buffer);
    ours_half = !ours_half;
  };
  auto unprepared_fn = [&] {
    bench::pack_op().call(tensors, layout.table, buffer);
    bench::unpack_op().call(tensors, layout.table, buffer, unprepared_half ? halves : twos);
    unprepared_half = !unprepared_half;
  };
  Tensor src = at::randn({owned}), dst = at::empty({owned});
  auto copy_fn = [&] {
    dst.copy_(src);
    src.copy_(dst);
  };
  // Composed baselines, as strong as torch allows: cat into a preallocated buffer (no
  // allocation), then (a) per-slice copy_ back + mul_, or (b) one mul_ on the buffer and
  // per-slice copy_ back.
  Tensor composed_buffer = at::empty({owned});
  auto copy_back = [&](bool scale_each, double scale) {
    int64_t o = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      Tensor view = layout.owned_view(i);
      view.copy_(composed_buffer.narrow(0, o, view.numel()).view(view.sizes()));
      if (scale_each) view.mul_(scale);
      o += view.numel();
    }
  };
  auto composed_a_fn = [&] {
    at::cat_out(composed_buffer, layout.owned_slices());
    copy_back(true, composed_half ? 0.5 : 2.0);
    composed_half = !composed_half;
  };
  auto composed_b_fn = [&] {
    at::cat_out(composed_buffer, layout.owned_slices());
    composed_buffer.mul_(composed_half ? 0.5 : 2.0);
    composed_half = !composed_half;
    copy_back(false, 1.0);
  };
  // Interleaved rounds: the shared machine's memory bandwidth drifts, and every variant
  // should see the same drift.
  const int rounds = opts.quick ? opts.rounds : 31;
  const auto t = bench::interleaved_medians_ms({ours_fn, unprepared_fn, copy_fn, composed_a_fn, composed_b_fn},
                                               opts.warmup, rounds);
  const double ours = t[0], unprepared = t[1], copy = t[2], composed = std::min(t[3], t[4]);

  // Correctness of the timed (prepared) path, exact: pack equals cat of the slices, and
  // unpack with scale 1/2 writes buffer / 2 (a power of two: no rounding).
  bench::pack_prepared_op().call(tensors, halving.host, halving.device, buffer);
  bench::inject_fault(opts, buffer);
  double err = (buffer - at::cat(layout.owned_slices())).abs().max().item<double>();
  bench::unpack_prepared_op().call(tensors, halving.host, halving.device, buffer);
  err = std::max(err, (at::cat(layout.owned_slices()) - buffer * 0.5).abs().max().item<double>());
  bench::Outcome outcome;
  if (!(err == 0.0)) {  // also catches NaN
    std::fprintf(stderr, "pack_segments_bench: prepared pack/unpack differ from the slices by %.3e (must be 0)\n",
                 err);
    outcome.accurate = false;
  }

  std::printf("| tensors | MiB total | MiB owned | ours ms | GB/s | unprepared ms | copy_ ms | copy_ GB/s | %% of copy_ "
              "| composed ms | speedup vs composed | max abs err |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f%% | %.2f | %.2fx | %.1e |\n", n,
              4.0 * total / (1 << 20), 4.0 * owned / (1 << 20), ours, bytes / ours / 1e6, unprepared, copy,
              bytes / copy / 1e6, 100.0 * copy / ours, composed, composed / ours, err);
  const bool bw = copy / ours >= 0.70, fast = composed / ours >= 1.3;
  outcome.targets_met = bw && fast;
  std::printf("\nTargets (CPU fp32, prepared path):\n- >= 70%% of copy_ bandwidth: %s (%.1f%%)\n- >= 1.3x the best "
              "composed baseline: %s (%.2fx)\n", bench::verdict(bw), 100.0 * copy / ours, bench::verdict(fast),
              composed / ours);
  std::printf("\n(Medians of %d interleaved rounds after %d warm-ups; scales 1/2 and 2 in turn on every side. \"ours\": "
              "tables prepared once, as the engine runs; \"unprepared\": the table validated on every call.)\n",
              rounds, opts.warmup);
  return outcome;
}

int main(int argc, char** argv) {
  return bench::run_benchmark("pack_segments_bench", "CPU pack_segments + unpack_average_ against copy_ and torch.cat.",
                              argc, argv, run);
}
