// GPU timing for the CUDA microbenchmarks: CUDA events on the current stream, interleaved
// rounds, medians. Needs only the CUDA runtime and c10's stream (no cuBLAS headers).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace bench {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

// Median device time in milliseconds of each fn (which enqueues work on the current
// stream), measured in interleaved rounds so that clock and thermal drift hit all alike.
inline std::vector<double> interleaved_cuda_medians_ms(const std::vector<std::function<void()>>& fns,
                                                       int warmup = 3, int reps = 21) {
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
