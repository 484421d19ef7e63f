// Qualifiers that let one index helper compile for the host (g++) and the device (nvcc).
// Nothing in csrc/kernels/ includes torch: the standalone benchmarks include it too.
#pragma once

#if defined(__CUDACC__)
#define SUBNET_HD __host__ __device__ __forceinline__
#else
#define SUBNET_HD inline
#endif
