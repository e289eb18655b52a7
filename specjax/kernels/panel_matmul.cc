// y [T, P*16] = x [T, D_in] @ W, for a weight W [D_in, P*16] stored as column panels
// [P, D_in, 16]: panel p holds columns 16p .. 16p+15, one 16-float row per input feature.
//
// Why: a decoding step multiplies a few rows (1 token, or the k+1 tokens of a verify pass) by
// every weight matrix, so its speed is the speed at which the weights stream from memory. XLA:CPU
// and the BLAS libraries it calls pack the weight before a product with several rows (a second
// pass over memory), and run products of SmolLM2's sizes at 10-20 GB/s. Stored as panels, each
// weight is read once, front to back, and every value read is multiplied into all the rows.
//
// The work splits by panel pairs over the calling thread and XLA's own intra-op threads
// (run_parts, kernels.h); for each pair, rows go in chunks of up to 3, so one chunk keeps 3 x 32
// sums in the 16 AVX2 registers while later chunks of a pass over many rows (a prefill) find the
// pair in cache.
#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace ffi = xla::ffi;
using specjax::load8;
using specjax::store8;
using specjax::Vec8;

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kHalf = 8;  // columns per vector: a panel row is two
constexpr int64_t kChunk = 3;
constexpr int64_t kPartsPerThread = 2;

// Rows [0, R) of x (R <= kChunk, a template constant so the sums stay in registers) times
// `num` (1 or 2) panels starting at `panel`, written to y's columns from `col`.
template <int R, int NUM>
void chunk(const float* x, const float* panel, float* y, int64_t d_in, int64_t d_out, int64_t col) {
  constexpr int H = 2 * NUM;  // half panels of 8 columns
  Vec8 sums[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) sums[r][h] = Vec8{};
  const int64_t panel_size = d_in * kPanel;
  for (int64_t i = 0; i < d_in; ++i) {
    Vec8 w[H];
    for (int h = 0; h < H; ++h) w[h] = load8(panel + (h / 2) * panel_size + i * kPanel + (h % 2) * kHalf);
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * d_in + i];
      for (int h = 0; h < H; ++h) sums[r][h] += xi * w[h];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) store8(y + r * d_out + col + h * kHalf, sums[r][h]);
}

// All rows times `num` panels, in chunks of at most kChunk rows, of sizes as equal as can be (7 rows
// go as 3 + 2 + 2, not 3 + 3 + 1: each chunk costs about the same, whatever its size).
template <int NUM>
void rows_times_panels(const float* x, const float* panel, float* y, int64_t rows, int64_t d_in,
                       int64_t d_out, int64_t col) {
  const int64_t num_chunks = (rows + kChunk - 1) / kChunk;
  for (int64_t c = 0, r0 = 0; c < num_chunks; ++c) {
    const int64_t size = (rows - r0) / (num_chunks - c);
    const float* xr = x + r0 * d_in;
    float* yr = y + r0 * d_out;
    switch (size) {
      case 1: chunk<1, NUM>(xr, panel, yr, d_in, d_out, col); break;
      case 2: chunk<2, NUM>(xr, panel, yr, d_in, d_out, col); break;
      default: chunk<3, NUM>(xr, panel, yr, d_in, d_out, col); break;
    }
    r0 += size;
  }
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1])
    return ffi::Error::InvalidArgument("panel_matmul: expected x [T, D_in], panels [P, D_in, 16]");
  const float* xs = x.typed_data();
  const float* all_panels = panels.typed_data();
  float* ys = y->typed_data();
  const int64_t rows = xd[0], d_in = xd[1], num_panels = pd[0], d_out = num_panels * kPanel;
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About kPartsPerThread parts per thread, so that a thread that starts late still gets a share.
  const int64_t pairs_per_part = std::max<int64_t>(1, num_pairs / (threads * kPartsPerThread));
  const int64_t num_parts = (num_pairs + pairs_per_part - 1) / pairs_per_part;
  specjax::run_parts(pool, num_parts, [=](int64_t part) {
    const int64_t end = std::min(num_panels, (part + 1) * pairs_per_part * 2);
    for (int64_t p = part * pairs_per_part * 2; p < end; p += 2) {
      const float* panel = all_panels + p * d_in * kPanel;
      if (p + 1 < num_panels)
        rows_times_panels<2>(xs, panel, ys, rows, d_in, d_out, p * kPanel);
      else
        rows_times_panels<1>(xs, panel, ys, rows, d_in, d_out, p * kPanel);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
