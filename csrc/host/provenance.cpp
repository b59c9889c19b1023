// The kernel counters behind host/provenance.h and the ops that expose them
// (rl_engine_ext/schemas.def, RL_ALIGN_RUNTIME_SCHEMA): counts are cumulative for the life of the
// process and grow only while a recorder is active; rl_engine_ext.record_kernels reports the
// difference between its start and its end, so recorders nest and overlap.
#include "provenance.h"

#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace rl_align {
namespace provenance {

std::atomic<int> active_recorders{0};

namespace {

std::mutex counts_mutex;

std::map<std::pair<std::string, std::string>, int64_t>& counts() {
  static std::map<std::pair<std::string, std::string>, int64_t> table;
  return table;
}

void record_start() { active_recorders.fetch_add(1, std::memory_order_relaxed); }

void record_stop() {
  int active = active_recorders.load(std::memory_order_relaxed);
  do {
    TORCH_CHECK(active > 0, "rl_align::kernel_record_stop: no recorder is active");
  } while (!active_recorders.compare_exchange_weak(active, active - 1, std::memory_order_relaxed));
}

// (kernels, paths, counts): the cumulative counts, one entry per (kernel, path) seen.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>> record_counts() {
  std::vector<std::string> kernels, paths;
  std::vector<int64_t> values;
  const std::lock_guard<std::mutex> lock(counts_mutex);
  for (const auto& [key, value] : counts()) {
    kernels.push_back(key.first);
    paths.push_back(key.second);
    values.push_back(value);
  }
  return {kernels, paths, values};
}

}  // namespace

void count(const char* kernel, const char* device, const char* path) {
  std::pair<std::string, std::string> key{kernel, path == nullptr ? std::string(device)
                                                                  : std::string(device) + "/" + path};
  const std::lock_guard<std::mutex> lock(counts_mutex);
  ++counts()[std::move(key)];
}

}  // namespace provenance

// No tensor arguments: registered as composite kernels (what m.def(schema, fn) registers), which
// serve a call with no dispatch key.
TORCH_LIBRARY_IMPL(rl_align, CompositeImplicitAutograd, m) {
  m.impl("kernel_record_start", &provenance::record_start);
  m.impl("kernel_record_stop", &provenance::record_stop);
  m.impl("kernel_record_counts", &provenance::record_counts);
}

}  // namespace rl_align
