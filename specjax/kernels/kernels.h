// What the CPU kernels share: 8-float vectors, and handing one call's work out to threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// GCC's vector types, so the same source builds for AVX-512, AVX2 or NEON. Eight floats: one AVX2
// register. The kernels keep their sums in these, as many as the 16 AVX2 registers hold: without
// AVX-512, GCC 12 compiled a 16-float vector times a scalar through stores and reloads on the
// stack (a panel product of 6 rows ran 20x slower than XLA's, and attention sized for 16-float
// vectors 3-6x slower than this way).
typedef float Vec8 __attribute__((vector_size(32)));

// A vector of floats from memory and back, at any alignment.
template <typename V>
inline V load_vec(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline void store_vec(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

inline Vec8 load8(const float* p) { return load_vec<Vec8>(p); }
inline void store8(float* p, Vec8 v) { store_vec(p, v); }

#if defined(__AVX512F__)
// Sixteen floats: one AVX-512 register, a whole row of a panel. Only where the compiler targets
// AVX-512 (-march=native on such a CPU): elsewhere GCC splits these and spills them (above).
typedef float Vec16 __attribute__((vector_size(64)));

inline Vec16 load16(const float* p) { return load_vec<Vec16>(p); }
inline void store16(float* p, Vec16 v) { store_vec(p, v); }
#endif

// Runs part(0) .. part(num_parts - 1), each part handed to whichever thread asks next: the calling
// thread and the tasks it schedules on XLA's intra-op pool. The caller works too and waits only
// for parts already taken, so a pool with no idle thread delays nothing; a task that starts after
// the last part is gone returns at once, without calling `part` (the shared state outlives the
// call for it). A separate OpenMP team, woken for every call beside XLA's threads, ran at half
// the speed. The float32 panels (panel_matmul.cc) and the cache attention share their work this way;
// the quantized products from both ends (run_from_both_ends, below). Both ends for all three, tried
// on 2 cores of an AMD EPYC (Zen 5, 2026-11-29, processes alternated three times): float32 plain
// decoding 79.7-83.2 tokens/s against 83.6-85.6 (likely: a float32 thread walking down starts each pair's
// stream afresh, where the hardware prefetcher carried it on from pair to pair going up), an 840-token
// float32 prefill 577-600 ms against 598-633, Q8_0 decoding after that prompt 92.5-102.7 tokens/s
// against 95.1-99.3: no gain, so each keeps the scheduler it was measured with.
template <class Part>
void run_parts(xla::ffi::ThreadPool& pool, int64_t num_parts, Part part) {
  struct Shared {
    Part part;
    int64_t num_parts;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    Shared(Part p, int64_t n) : part(std::move(p)), num_parts(n) {}

    void work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_parts;) {
        part(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(part), num_parts);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, num_parts); ++t) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->done.load(std::memory_order_acquire) < num_parts) std::this_thread::yield();
}

// Runs unit(i, direction) for every i in [0, num_units) on the calling thread and the tasks it
// schedules on XLA's intra-op pool, each thread walking one contiguous run of units: the units
// split into one segment per two threads; one thread of a segment takes its units from the front
// in increasing order (direction +1), the other from the back in decreasing order (direction -1),
// one unit at a time, until they meet; a thread whose segment is done goes on to the next ones
// from the same end. So each thread reads its operands as one stream that its prefetches can run
// ahead of (`direction` says which way), and a thread that starts late, or never, leaves its units
// to the others: the caller waits only for units already taken. (run_parts hands out parts in
// order to whichever thread asks, so two threads alternate and each one's next part starts where
// its prefetches did not reach: quant_matmul.cc says what that cost.)
// (Pool: xla::ffi::ThreadPool, or anything with num_threads() and Schedule(task), as the
// scheduling test's pool, tests/test_kernel_threads.py.)
template <class Pool, class Unit>
void run_from_both_ends(Pool& pool, int64_t num_units, Unit unit) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), num_units);
  if (threads < 2) {
    for (int64_t i = 0; i < num_units; ++i) unit(i, +1);
    return;
  }
  struct Shared {
    Unit unit;
    int64_t num_segments;
    // Per segment, the units [front, back) still to take, as front | back << 32, so that one
    // compare-and-swap takes a unit from either end.
    std::unique_ptr<std::atomic<uint64_t>[]> ends;
    std::atomic<int64_t> done{0};

    Shared(Unit u, int64_t num_units, int64_t segments)
        : unit(std::move(u)), num_segments(segments), ends(new std::atomic<uint64_t>[segments]) {
      for (int64_t s = 0; s < segments; ++s) {
        const uint64_t front = num_units * s / segments, back = num_units * (s + 1) / segments;
        ends[s].store(front | back << 32, std::memory_order_relaxed);
      }
    }

    // The next unit of segment s from its front or its back, into i; false where none is left.
    bool take(int64_t s, bool front, int64_t& i) {
      uint64_t both = ends[s].load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t first = both & 0xffffffffu, end = both >> 32;
        if (first >= end) return false;
        const uint64_t next = front ? (first + 1) | end << 32 : first | (end - 1) << 32;
        if (ends[s].compare_exchange_weak(both, next, std::memory_order_relaxed)) {
          i = static_cast<int64_t>(front ? first : end - 1);
          return true;
        }
      }
    }

    void work(int64_t worker) {  // worker 0: the caller
      const bool front = worker % 2 == 0;
      for (int64_t k = 0; k < num_segments; ++k)
        for (int64_t i, s = (worker / 2 + k) % num_segments; take(s, front, i);) {
          unit(i, front ? +1 : -1);
          done.fetch_add(1, std::memory_order_release);
        }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(unit), num_units, (threads + 1) / 2);
  for (int64_t w = 1; w < threads; ++w) pool.Schedule([shared, w] { shared->work(w); });
  shared->work(0);
  while (shared->done.load(std::memory_order_acquire) < num_units) std::this_thread::yield();
}

// What a product may do around itself, so that XLA runs no op of its own there: a one-row
// decoding step of SmolLM2 ran 24 small XLA ops a layer between the kernels' calls (a norm took
// four, a residual add one), about 1 us each. `Around` reads the two optional operands, empty
// where not asked for:
// - norm [d_in]: the rows are RMS-normed first, Llama's way (x times 1/sqrt(mean(x^2) + eps),
//   times norm, in float32), on the calling thread before the work is shared out;
// - residual [rows, cols]: added to y's first cols columns of each row at the end (y's rows are
//   the padded panels' width, cols the weight's true width).
struct Around {
  const float* norm = nullptr;
  float eps = 0.0f;
  const float* residual = nullptr;
  int64_t residual_cols = 0;

  // The rows the product reads: x itself, or its normed rows in `normed`.
  const float* input(const float* x, int64_t rows, int64_t d_in, std::vector<float>& normed) const {
    if (!norm) return x;
    normed.resize(rows * d_in);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * d_in;
      Vec8 lanes{};  // the sum of squares eight lanes at a time: one chain of d_in would be slow
      int64_t i = 0;
      for (; i + 8 <= d_in; i += 8) {
        const Vec8 v = load8(row + i);
        lanes += v * v;
      }
      float squares = 0.0f;
      for (int j = 0; j < 8; ++j) squares += lanes[j];
      for (; i < d_in; ++i) squares += row[i] * row[i];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(d_in) + eps);
      float* out = normed.data() + r * d_in;
      for (i = 0; i < d_in; ++i) out[i] = norm[i] * (row[i] * scale);
    }
    return normed.data();
  }

  void finish(float* y, int64_t rows, int64_t d_out) const {
    if (!residual) return;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < residual_cols; ++c) y[r * d_out + c] += residual[r * residual_cols + c];
  }
};

// `Around` from the FFI operands norm ([d_in] or empty), residual ([rows, cols] or empty) and the
// attribute eps; an error names what does not fit.
inline xla::ffi::Error read_around(const xla::ffi::Buffer<xla::ffi::F32>& norm,
                                   const xla::ffi::Buffer<xla::ffi::F32>& residual, float eps, int64_t rows,
                                   int64_t d_in, int64_t d_out, Around& around) {
  if (norm.element_count() > 0) {
    if (norm.dimensions().size() != 1 || norm.dimensions()[0] != d_in)
      return xla::ffi::Error::InvalidArgument("norm: expected [D_in] float32 or an empty array");
    around.norm = norm.typed_data();
    around.eps = eps;
  }
  if (residual.element_count() > 0) {
    const auto rd = residual.dimensions();
    if (rd.size() != 2 || rd[0] != rows || rd[1] > d_out)
      return xla::ffi::Error::InvalidArgument("residual: expected [T, D_out] float32 or an empty array");
    around.residual = residual.typed_data();
    around.residual_cols = rd[1];
  }
  return xla::ffi::Error::Success();
}

// Rows [0, rows) of x [rows, d_in] times one float32 panel [d_in, 16] (two consecutive ones where
// `two`), written to y's columns from `col` (y [rows, d_out]): panel_matmul.cc's loops, which
// quant_matmul.cc runs a many-row product through once it has dequantized the panels.
void float_panel_rows(const float* x, const float* panels, float* y, int64_t rows, int64_t d_in, int64_t d_out,
                      int64_t col, bool two);

}  // namespace specjax
