// Typed handles on the pack/unpack ops (plain and prepared) and the benchmark layout,
// shared by the CPU and CUDA pack_segments microbenchmarks (they call the ops through the
// dispatcher, as Python does).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace bench {

// The typed handle of subnet_ext::<name> (looked up once by each accessor below).
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using PackSignature = void(at::TensorList, const at::Tensor&, const at::Tensor&);
using TableSignature = void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&);

// subnet_ext::pack_segments(tensors, segments, buffer): validates the table on every call.
inline const auto& pack_op() {
  static auto op = find_op<PackSignature>("subnet_ext::pack_segments");
  return op;
}

// subnet_ext::unpack_average_(tensors, segments, buffer, scales): validates on every call.
inline const auto& unpack_op() {
  static auto op = find_op<TableSignature>("subnet_ext::unpack_average_");
  return op;
}

// subnet_ext::prepare_segments: (host_table, device_table), validated once (what
// subnet_ext.ops.PreparedSegments wraps and the engine caches per layout).
inline const auto& prepare_op() {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(at::TensorList, const at::Tensor&, const at::Tensor&,
                                                              const std::optional<at::Tensor>&)>(
      "subnet_ext::prepare_segments");
  return op;
}

// subnet_ext::pack_segments_prepared(tensors, host_table, device_table, buffer).
inline const auto& pack_prepared_op() {
  static auto op = find_op<TableSignature>("subnet_ext::pack_segments_prepared");
  return op;
}

// subnet_ext::unpack_average_prepared_(tensors, host_table, device_table, buffer).
inline const auto& unpack_prepared_op() {
  static auto op = find_op<TableSignature>("subnet_ext::unpack_average_prepared_");
  return op;
}

// A prepared table: (host_table, device_table) as prepare_segments returns them.
struct PreparedTable {
  at::Tensor host, device;
};

// `count` tensors with `total` elements in all (rows cycling through `row_choices`), the
// first half of each tensor's rows owned: one rectangle per tensor, packed in order.
struct HalfOwnedLayout {
  std::vector<at::Tensor> tensors;
  at::Tensor table;   // int64 CPU [count, 6]
  std::vector<int64_t> owned_rows;  // per tensor
  int64_t owned = 0;                // buffer elements

  HalfOwnedLayout(int count, int64_t total, const std::array<int64_t, 5>& row_choices,
                  const at::TensorOptions& options) {
    table = at::empty({count, 6}, at::kLong);
    auto rows_of_table = table.accessor<int64_t, 2>();
    for (int i = 0; i < count; ++i) {
      const int64_t rows = row_choices[i % row_choices.size()], cols = (total / count) / rows;
      tensors.push_back(at::randn({rows, cols}, options));
      const int64_t entry[6] = {i, 0, rows / 2, 0, cols, owned};
      for (int j = 0; j < 6; ++j) rows_of_table[i][j] = entry[j];
      owned_rows.push_back(rows / 2);
      owned += rows / 2 * cols;
    }
  }

  // The owned rectangle of tensor i (a view).
  at::Tensor owned_view(size_t i) const { return tensors[i].narrow(0, 0, owned_rows[i]); }

  // Every owned rectangle, flattened, in buffer order (what pack must produce).
  std::vector<at::Tensor> owned_slices() const {
    std::vector<at::Tensor> s;
    for (size_t i = 0; i < tensors.size(); ++i) s.push_back(owned_view(i).reshape(-1));
    return s;
  }

  // The table prepared for these tensors, `buffer` and per-segment `scales` (float CPU [count]).
  PreparedTable prepare(const at::Tensor& buffer, const at::Tensor& scales) const {
    auto [host, device] = prepare_op().call(tensors, table, buffer, scales);
    return {host, device};
  }
};

}  // namespace bench
