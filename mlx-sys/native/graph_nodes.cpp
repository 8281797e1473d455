// Counts the operations an evaluation of some outputs would run: every
// array reachable through inputs that has a primitive (not yet computed),
// the outputs of one multi-output primitive counted once. Probes print it
// per step shape (`engines/runtime/examples/step_probe.rs`): on a GPU the
// host's time per node sets a small model's step.
#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "mlx/c/array.h"
#include "mlx/c/private/array.h"
#include "mlx/array.h"
#include "mlx/primitives.h"

using namespace mlx::core;

extern "C" {

// Nodes reachable from `outs[0..n)`; `histogram` (when not null) gets
// "Name count\n" lines, most frequent first, cut to `len` bytes.
size_t mlx_sys_graph_nodes(const mlx_array* outs, size_t n, char* histogram, size_t len) {
  std::unordered_set<std::uintptr_t> seen;
  std::map<std::string, size_t> by_name;
  std::vector<array> stack;
  for (size_t i = 0; i < n; ++i) stack.push_back(mlx_array_get_(outs[i]));
  size_t nodes = 0;
  while (!stack.empty()) {
    array a = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(a.id()).second || !a.has_primitive()) continue;
    for (auto& s : a.siblings()) seen.insert(s.id());
    ++nodes;
    ++by_name[a.primitive().name()];
    for (auto& in : a.inputs()) stack.push_back(in);
  }
  if (histogram && len) {
    std::vector<std::pair<std::string, size_t>> rows(by_name.begin(), by_name.end());
    std::stable_sort(rows.begin(), rows.end(),
                     [](auto& x, auto& y) { return x.second > y.second; });
    std::string text;
    for (auto& [name, count] : rows) text += name + " " + std::to_string(count) + "\n";
    std::strncpy(histogram, text.c_str(), len - 1);
    histogram[len - 1] = '\0';
  }
  return nodes;
}
}
