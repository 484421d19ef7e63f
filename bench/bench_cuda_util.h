// GPU timing for the CUDA microbenchmarks: CUDA events on the current stream, interleaved
// rounds, medians. Needs only the CUDA runtime and c10's stream (no cuBLAS headers).
#pragma once

#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

// Throws (run_benchmark turns it into exit 1) when a CUDA runtime call failed.
inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Throws unless a GPU is visible: a CUDA benchmark without one measured nothing (exit 1).
inline void require_cuda(const char* name) {
  if (!at::hasCUDA()) throw std::runtime_error(std::string(name) + " needs a GPU: no CUDA device visible");
}

// Median device time in milliseconds of each fn (which enqueues work on the current
// stream), measured in interleaved rounds so that clock and thermal drift hit all alike.
inline std::vector<double> interleaved_cuda_medians_ms(const std::vector<std::function<void()>>& fns,
                                                       int warmup, int reps) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn();
  cuda_check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<std::vector<double>> t(fns.size());
  for (int i = 0; i < reps; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
      fns[f]();
      cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      t[f].push_back(ms);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<double> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

}  // namespace bench
