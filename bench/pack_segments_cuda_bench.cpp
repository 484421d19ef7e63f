// GPU microbenchmark of pack_segments + unpack_average_: 200 tensors, 1 GiB of fp32 (or
// 512 MiB of bf16) in all -- far above the L2 cache -- (--quick: 20 tensors, 1 MiB of
// fp32), the first half of each tensor's rows owned (one rectangle per tensor). Bytes
// moved per pack + unpack: 4 x the owned bytes (each side reads and writes them once).
// The ceiling is the device's own copy_ of the same bytes (two copies of the owned
// bytes), measured in the same rounds.
//
// "ours" is the path the engine runs: tables prepared once per layout (prepare_segments
// validates and uploads the device table once; subnet_ext.ops.PreparedSegments wraps it
// and comm/prepared.py caches it), then pack_segments_prepared + unpack_average_prepared_
// (no validation, no host-to-device copy). "unprepared" is the plain pack_segments +
// unpack_average_: validation and table upload inside every call.
//
// Exit codes (bench_util.h, bench/README.md): 0 ran, results exact, targets met (or
// --quick: none judged); 1 failed (bad arguments, no GPU, exception, or a packed element
// that differs); 3 ran correctly but a speed target was missed.
#include <ATen/ATen.h>

#include <cstdio>
#include <vector>

#include "bench_cuda_util.h"
#include "bench_util.h"
#include "pack_segments_ops.h"

using at::Tensor;

// Pack copies bits: the packed buffer must equal the slices exactly.
constexpr double kMaxAbsErr = 0.0;
// Speed target: pack + unpack at least this fraction of copy_'s bandwidth on the same bytes.
constexpr double kTargetOfCopy = 0.85;

// Times one dtype and prints its row; returns its speed as a fraction of copy_'s and
// clears `accurate` on a wrong result.
static double run_dtype(const bench::Options& opts, at::ScalarType dtype, const char* name, bool& accurate) {
  const int64_t total_bytes = opts.quick ? int64_t(1) << 20 : int64_t(1) << 30;
  const int64_t elem = c10::elementSize(dtype);
  const int64_t total = total_bytes / 4;  // elements: 1 GiB of fp32, 512 MiB of bf16
  const int n = opts.quick ? 20 : 200;
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  const bench::HalfOwnedLayout layout(n, total, opts.quick ? std::array<int64_t, 5>{4, 8, 16, 32, 64}
                                                           : std::array<int64_t, 5>{64, 128, 256, 512, 1024},
                                      opt);
  const std::vector<Tensor>& tensors = layout.tensors;
  const int64_t owned = layout.owned;
  // Scale 1: the kernel still multiplies every element, and repeated runs keep the data.
  Tensor scales = at::ones({n}, at::kFloat);
  Tensor buffer = at::empty({owned}, opt);
  const bench::PreparedTable prepared = layout.prepare(buffer, scales);
  Tensor src = at::randn({owned}, opt), dst = at::empty({owned}, opt);
  auto ours_fn = [&] {
    bench::pack_prepared_op().call(tensors, prepared.host, prepared.device, buffer);
    bench::unpack_prepared_op().call(tensors, prepared.host, prepared.device, buffer);
  };
  auto unprepared_fn = [&] {
    bench::pack_op().call(tensors, layout.table, buffer);
    bench::unpack_op().call(tensors, layout.table, buffer, scales);
  };
  auto copy_fn = [&] {
    dst.copy_(src);
    src.copy_(dst);
  };
  auto composed_fn = [&] {
    Tensor buf = at::cat(layout.owned_slices());
    int64_t o = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      Tensor view = layout.owned_view(i);
      view.copy_(buf.narrow(0, o, view.numel()).view(view.sizes()));
      o += view.numel();
    }
  };
  const auto t = bench::interleaved_cuda_medians_ms({ours_fn, unprepared_fn, copy_fn, composed_fn}, opts.warmup,
                                                    opts.rounds);
  const double ours = t[0], unprepared = t[1], copy = t[2], composed = t[3];
  bench::pack_prepared_op().call(tensors, prepared.host, prepared.device, buffer);
  bench::inject_fault(opts, buffer);
  const double err = (buffer - at::cat(layout.owned_slices())).abs().max().item<double>();
  if (!(err <= kMaxAbsErr)) {  // also catches NaN
    std::fprintf(stderr, "pack_segments_cuda_bench: %s: max abs err %.3e exceeds %.1e\n", name, err, kMaxAbsErr);
    accurate = false;
  }
  const double bytes = 4.0 * owned * elem;
  std::printf("| %s | %d | %.1f | %.1f | %.3f | %.1f | %.3f | %.3f | %.1f | %.1f%% | %.3f | %.2fx | %.1e |\n", name, n,
              double(total * elem) / (1 << 20), double(owned * elem) / (1 << 20), ours, bytes / ours / 1e6,
              unprepared, copy, bytes / copy / 1e6, 100.0 * copy / ours, composed, composed / ours, err);
  return copy / ours;
}

static bench::Outcome run(const bench::Options& opts) {
  bench::require_cuda("pack_segments_cuda_bench");
  at::manual_seed(0);
  std::printf("| dtype | tensors | MiB total | MiB owned | ours ms | GB/s | unprepared ms | copy_ ms | copy_ GB/s "
              "| %% of copy_ | composed ms | speedup vs composed | max abs err |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bench::Outcome outcome;
  const double fp32 = run_dtype(opts, at::kFloat, "fp32", outcome.accurate);
  const double bf16 = run_dtype(opts, at::kBFloat16, "bf16", outcome.accurate);
  outcome.targets_met = fp32 >= kTargetOfCopy && bf16 >= kTargetOfCopy;
  std::printf("\nTargets (GPU, prepared path):\n- fp32 pack + unpack >= %.0f%% of copy_ bandwidth: %s (%.1f%%)\n"
              "- bf16: %s (%.1f%%)\n", 100 * kTargetOfCopy, bench::verdict(fp32 >= kTargetOfCopy), 100 * fp32,
              bench::verdict(bf16 >= kTargetOfCopy), 100 * bf16);
  std::printf("\n(Medians of %d interleaved rounds of CUDA-event times after %d warm-ups. \"ours\": tables prepared "
              "once, as the engine runs; \"unprepared\": validation and table upload in every call.)\n", opts.rounds,
              opts.warmup);
  std::printf("[summary] pack + unpack: fp32 %.1f%%, bf16 %.1f%% of copy_ (target %.0f%%)\n", 100 * fp32,
              100 * bf16, 100 * kTargetOfCopy);
  return outcome;
}

int main(int argc, char** argv) {
  return bench::run_benchmark("pack_segments_cuda_bench", "GPU pack_segments + unpack_average_ against copy_ and "
                              "torch.cat.", argc, argv, run);
}
