// Storage type of an element: kernels that only move bits are instantiated per element
// size (half and bfloat16 share one instantiation) and access memory as plain integers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace subnet_ext {

template <size_t Bytes>
struct StorageOf;
template <>
struct StorageOf<2> { using type = uint16_t; };
template <>
struct StorageOf<4> { using type = uint32_t; };
template <>
struct StorageOf<8> { using type = uint64_t; };
template <typename T>
using storage_t = typename StorageOf<sizeof(T)>::type;

}  // namespace subnet_ext
