// CPU microbenchmark of pack_segments + unpack_average_: 200 fp32 tensors, 64 MiB in all,
// the first half of each tensor's rows owned (one rectangle per tensor).
//
// Bytes moved: pack reads and writes the owned half (2 x 32 MiB), unpack reads the buffer
// and writes the tensors (2 x 32 MiB): 128 MiB per pack + unpack. The ceiling is torch's
// own copy_ of the same bytes (two 32 MiB copies, also 128 MiB moved).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <vector>

#include "bench_util.h"

using at::Tensor;

int main() {
  at::manual_seed(0);
  const int64_t total = 16 * 1024 * 1024;  // fp32 elements: 64 MiB
  const int n = 200;
  std::vector<Tensor> tensors;
  std::vector<int64_t> rows_list;
  const int64_t row_choices[] = {64, 128, 256, 512, 1024};
  std::vector<std::vector<int64_t>> segs;
  int64_t offset = 0;
  for (int i = 0; i < n; ++i) {
    int64_t rows = row_choices[i % 5];
    int64_t cols = (total / n) / rows;
    tensors.push_back(at::randn({rows, cols}));
    segs.push_back({i, 0, rows / 2, 0, cols, offset});
    offset += rows / 2 * cols;
  }
  Tensor table = at::empty({n, 6}, at::kLong);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < 6; ++j) table[i][j] = segs[i][j];
  Tensor buffer = at::empty({offset});
  const double bytes = 4.0 * offset * 4;  // read + write, pack + unpack

  auto pack = c10::Dispatcher::singleton().findSchemaOrThrow("subnet_ext::pack_segments", "")
                  .typed<void(at::TensorList, const Tensor&, const Tensor&)>();
  auto unpack = c10::Dispatcher::singleton().findSchemaOrThrow("subnet_ext::unpack_average_", "")
                    .typed<void(at::TensorList, const Tensor&, const Tensor&, const Tensor&)>();
  // Averaging scales as in a 2-owner group (1/2), alternated with 2 from one run to the next
  // so that the data keeps its magnitude (never timing on zeros, denormals or a decay
  // towards them); both sides multiply every element once per run.
  Tensor halves = at::full({n}, 0.5, at::kFloat), twos = at::full({n}, 2.0, at::kFloat);
  bool ours_half = true, composed_half = true;
  auto ours_fn = [&] {
    pack.call(tensors, table, buffer);
    unpack.call(tensors, table, buffer, ours_half ? halves : twos);
    ours_half = !ours_half;
  };
  Tensor src = at::randn({offset}), dst = at::empty({offset});
  auto copy_fn = [&] {
    dst.copy_(src);
    src.copy_(dst);
  };
  // Composed baselines, as strong as torch allows: cat into a preallocated buffer (no
  // allocation), then (a) per-slice copy_ back + mul_, or (b) one mul_ on the buffer and
  // per-slice copy_ back.
  auto slices = [&] {
    std::vector<Tensor> s;
    for (int i = 0; i < n; ++i) s.push_back(tensors[i].narrow(0, 0, segs[i][2]).reshape(-1));
    return s;
  };
  Tensor composed_buffer = at::empty({offset});
  auto composed_a_fn = [&] {
    at::cat_out(composed_buffer, slices());
    const double scale = composed_half ? 0.5 : 2.0;
    composed_half = !composed_half;
    int64_t o = 0;
    for (int i = 0; i < n; ++i) {
      auto view = tensors[i].narrow(0, 0, segs[i][2]);
      view.copy_(composed_buffer.narrow(0, o, view.numel()).view(view.sizes())).mul_(scale);
      o += view.numel();
    }
  };
  auto composed_b_fn = [&] {
    at::cat_out(composed_buffer, slices());
    composed_buffer.mul_(composed_half ? 0.5 : 2.0);
    composed_half = !composed_half;
    int64_t o = 0;
    for (int i = 0; i < n; ++i) {
      auto view = tensors[i].narrow(0, 0, segs[i][2]);
      view.copy_(composed_buffer.narrow(0, o, view.numel()).view(view.sizes()));
      o += view.numel();
    }
  };
  // Interleaved rounds: the shared machine's memory bandwidth drifts, and every variant
  // should see the same drift.
  const auto t = bench::interleaved_medians_ms({ours_fn, copy_fn, composed_a_fn, composed_b_fn}, 3, 31);
  const double ours = t[0], copy = t[1], composed = std::min(t[2], t[3]);

  // Correctness: pack equals cat of the slices; unpack(pack) * 1/c restores x * scale.
  pack.call(tensors, table, buffer);
  double err = (buffer - at::cat(slices())).abs().max().item<double>();

  std::printf("| tensors | MiB total | MiB owned | ours ms | GB/s | copy_ ms | copy_ GB/s | %% of copy_ | composed ms | speedup vs composed | max abs err |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %d | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f | %.1f%% | %.2f | %.2fx | %.1e |\n", n,
              4.0 * total / (1 << 20), 4.0 * offset / (1 << 20), ours, bytes / ours / 1e6, copy, bytes / copy / 1e6,
              100.0 * copy / ours, composed, composed / ours, err);
  bool bw = copy / ours >= 0.70, fast = composed / ours >= 1.3;
  std::printf("\nTargets (CPU fp32):\n- >= 70%% of copy_ bandwidth: %s (%.1f%%)\n- >= 1.3x the best composed baseline: "
              "%s (%.2fx)\n", bench::verdict(bw), 100.0 * copy / ours, bench::verdict(fast), composed / ours);
  std::printf("\n(Medians of 31 interleaved rounds after 3 warm-ups; scales 1/2 and 2 in turn on both sides.)\n");
  return bw && fast ? 0 : 1;
}
