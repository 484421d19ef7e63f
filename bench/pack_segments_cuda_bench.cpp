// GPU microbenchmark of pack_segments + unpack_average_: 200 tensors, 1 GiB of fp32 (or
// 512 MiB of bf16) in all -- far above the L2 cache -- the first half of each tensor's
// rows owned (one rectangle per tensor). Bytes moved per pack + unpack: 4 x the owned
// bytes (each side reads and writes them once). The ceiling is the device's own copy_ of
// the same bytes (two copies of the owned bytes), measured in the same rounds.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <vector>

#include "bench_cuda_util.h"
#include "bench_util.h"

using at::Tensor;

// Pack copies bits: the packed buffer must equal the slices exactly.
constexpr double kMaxAbsErr = 0.0;

// Returns whether the performance target is met; clears `accurate` on a wrong result.
static bool run(at::ScalarType dtype, const char* name, bool& accurate) {
  const int64_t total_bytes = int64_t(1) << 30;
  const int64_t elem = c10::elementSize(dtype);
  const int64_t total = total_bytes / 4;  // elements: 1 GiB of fp32, 512 MiB of bf16
  const int n = 200;
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  std::vector<Tensor> tensors;
  std::vector<std::vector<int64_t>> segs;
  const int64_t row_choices[] = {64, 128, 256, 512, 1024};
  int64_t offset = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t rows = row_choices[i % 5], cols = (total / n) / rows;
    tensors.push_back(at::randn({rows, cols}, opt));
    segs.push_back({i, 0, rows / 2, 0, cols, offset});
    offset += rows / 2 * cols;
  }
  Tensor table = at::empty({n, 6}, at::kLong);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < 6; ++j) table[i][j] = segs[i][j];
  // Scale 1: the kernel still multiplies every element, and repeated runs keep the data.
  Tensor scales = at::ones({n}, at::kFloat);
  Tensor buffer = at::empty({offset}, opt);
  auto pack = c10::Dispatcher::singleton().findSchemaOrThrow("subnet_ext::pack_segments", "")
                  .typed<void(at::TensorList, const Tensor&, const Tensor&)>();
  auto unpack = c10::Dispatcher::singleton().findSchemaOrThrow("subnet_ext::unpack_average_", "")
                    .typed<void(at::TensorList, const Tensor&, const Tensor&, const Tensor&)>();
  Tensor src = at::randn({offset}, opt), dst = at::empty({offset}, opt);
  auto slices = [&] {
    std::vector<Tensor> s;
    for (int i = 0; i < n; ++i) s.push_back(tensors[i].narrow(0, 0, segs[i][2]).reshape(-1));
    return s;
  };
  auto ours_fn = [&] {
    pack.call(tensors, table, buffer);
    unpack.call(tensors, table, buffer, scales);
  };
  auto copy_fn = [&] {
    dst.copy_(src);
    src.copy_(dst);
  };
  auto composed_fn = [&] {
    Tensor buf = at::cat(slices());
    int64_t o = 0;
    for (int i = 0; i < n; ++i) {
      auto view = tensors[i].narrow(0, 0, segs[i][2]);
      view.copy_(buf.narrow(0, o, view.numel()).view(view.sizes()));
      o += view.numel();
    }
  };
  const auto t = bench::interleaved_cuda_medians_ms({ours_fn, copy_fn, composed_fn});
  const double ours = t[0], copy = t[1], composed = t[2];
  pack.call(tensors, table, buffer);
  const double err = (buffer - at::cat(slices())).abs().max().item<double>();
  if (!(err <= kMaxAbsErr)) {  // also catches NaN
    std::fprintf(stderr, "pack_segments_cuda_bench: %s: max abs err %.3e exceeds %.1e\n", name, err, kMaxAbsErr);
    accurate = false;
  }
  const double bytes = 4.0 * offset * elem;
  std::printf("| %s | %d | %.0f | %.0f | %.3f | %.1f | %.3f | %.1f | %.1f%% | %.3f | %.2fx | %.1e |\n", name, n,
              double(total * elem) / (1 << 20), double(offset * elem) / (1 << 20), ours, bytes / ours / 1e6, copy,
              bytes / copy / 1e6, 100.0 * copy / ours, composed, composed / ours, err);
  return copy / ours >= 0.75;
}

int main() {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "pack_segments_cuda_bench: no CUDA device visible\n");
    return 2;
  }
  at::manual_seed(0);
  std::printf("| dtype | tensors | MiB total | MiB owned | ours ms | GB/s | copy_ ms | copy_ GB/s | %% of copy_ "
              "| composed ms | speedup vs composed | max abs err |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bool accurate = true;
  const bool fp32 = run(at::kFloat, "fp32", accurate);
  const bool bf16 = run(at::kBFloat16, "bf16", accurate);
  std::printf("\nTargets (GPU):\n- fp32 pack + unpack >= 75%% of copy_ bandwidth: %s\n- bf16: %s\n",
              bench::verdict(fp32), bench::verdict(bf16));
  std::printf("\n(Medians of 21 interleaved rounds of CUDA-event times after 3 warm-ups.)\n");
  // 3: wrong results (whatever the timings); 1: a performance target missed.
  if (!accurate) return 3;
  return fp32 && bf16 ? 0 : 1;
}
