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
// (run_parts, kernels.h). Up to 4 rows (a decoding step, a short verify pass) go in chunks of up
// to 3 over both panels of a pair at once, so one chunk keeps 3 x 32 sums in the 16 AVX2
// registers while the first chunk streams the pair from memory. More rows (a longer verify pass,
// a batch, a prefill) go in chunks of 6 over one panel at a time: 6 x 16 sums, the panel's two
// vectors and the broadcast input fill 15 registers and every weight loaded feeds 12 products,
// where 3 rows over two panels left too few registers for the weights and loaded each of them once
// per row (measured on 2 cores of an AMD EPYC: 2 products a cycle against 1). Those passes go over
// the inputs in blocks that stay in the L1 cache while every chunk of rows runs over them, the sums
// kept between blocks, and the first chunk of a block asks for the weights well ahead, so that
// memory streams while the later chunks compute. Measured on SmolLM2's layers: products of 8 rows
// 15-20% faster, of 64 and 128 rows (a prefill) a third faster; the built-in model's decoding step
// at 8 rows 12% faster, its 500-token prefill 16-19% (docs/benchmarks.md).
//
// Where the compiler targets AVX-512 (-march=native on such a CPU), products of 2 rows or more
// take 16-float vectors instead, one per panel row, in chunks of up to 12 rows over a panel pair
// (below, many_rows_times_panels16): on a Zen 5 EPYC, whose FMA units are 512 bits wide, the
// 8-float loops left half of each unit idle.
#include <algorithm>
#include <cstdint>
#include <vector>

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
constexpr int64_t kFewRows = 4;    // up to this many rows: chunks of up to kChunk over both panels
constexpr int64_t kWideChunk = 6;  // more rows: chunks of 6 over one panel
constexpr int64_t kBlock = 64;     // inputs per block: 64 x 64 bytes of each panel
constexpr int64_t kAhead = 128;    // inputs ahead that a block's first chunk prefetches
constexpr int64_t kGroup = 48;     // rows whose sums a blocked pass keeps (6 KB on the stack)

// Rows [0, R) of x times inputs [i0, i1) of `num` (NUM) panels from `panel`, added to the sums
// `acc` in vectors V (row r's at acc[2 kParts r ...], kParts vectors per panel row: two 8-float
// halves, or one 16-float row with AVX-512). With AHEAD > 0 it also asks for the rows kAhead
// inputs on (up to d_in) of the AHEAD panels from `ahead`, which later blocks will read.
template <int R, int NUM, int AHEAD = 0, typename V = Vec8>
void block(const float* x, const float* panel, V* acc, int64_t d_in, int64_t i0, int64_t i1,
           const float* ahead = nullptr) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  constexpr int kParts = kPanel / kLanes;
  constexpr int H = kParts * NUM;
  const int64_t panel_size = d_in * kPanel;
  V sums[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) sums[r][h] = acc[2 * kParts * r + h];
  for (int64_t i = i0; i < i1; ++i) {
    if (AHEAD > 0 && i + kAhead < d_in)
      for (int p = 0; p < AHEAD; ++p) __builtin_prefetch(ahead + p * panel_size + (i + kAhead) * kPanel, 0, 3);
    V w[H];
    for (int h = 0; h < H; ++h)
      w[h] = specjax::load_vec<V>(panel + (h / kParts) * panel_size + i * kPanel + (h % kParts) * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * d_in + i];
      for (int h = 0; h < H; ++h) sums[r][h] += xi * w[h];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[2 * kParts * r + h] = sums[r][h];
}

// Rows [0, R) of x (R <= kChunk) times all inputs of `num` (NUM) panels from `panel`, written to
// y's columns from `col`: one block as long as the inputs.
template <int R, int NUM>
void chunk(const float* x, const float* panel, float* y, int64_t d_in, int64_t d_out, int64_t col) {
  Vec8 acc[4 * R] = {};
  block<R, NUM>(x, panel, acc, d_in, 0, d_in);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * NUM; ++h) store8(y + r * d_out + col + h * kHalf, acc[4 * r + h]);
}

// Rows (at most kFewRows, or the last rows of a group) times `num` panels, in chunks of at most
// kChunk rows, of sizes as equal as can be (4 rows go as 2 + 2, not 3 + 1: each chunk costs about
// the same, whatever its size).
template <int NUM>
void few_rows_times_panels(const float* x, const float* panel, float* y, int64_t rows, int64_t d_in,
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

// Rows [0, rows) (rows <= kGroup) times `num` (NUM) panels, blocked over the inputs: per block,
// chunks of 6 (or 5) rows over each panel alone, then the last rows (at most 4) over all NUM
// panels at once; the first chunk of a block prefetches the weights ahead.
template <int NUM>
void many_rows_times_panels(const float* x, const float* panel, float* y, int64_t rows, int64_t d_in,
                            int64_t d_out, int64_t col) {
  Vec8 acc[kGroup * 4];
  for (int64_t k = 0; k < rows * 4; ++k) acc[k] = Vec8{};
  const int64_t panel_size = d_in * kPanel;
  for (int64_t i0 = 0; i0 < d_in; i0 += kBlock) {
    const int64_t i1 = std::min(d_in, i0 + kBlock);
    int64_t r0 = 0;
    for (; rows - r0 >= 5; r0 += std::min<int64_t>(kWideChunk, rows - r0)) {
      const float* xr = x + r0 * d_in;
      for (int p = 0; p < NUM; ++p) {
        Vec8* a = acc + 4 * r0 + 2 * p;
        const float* one = panel + p * panel_size;
        const bool first = r0 == 0 && p == 0;  // the block's first chunk prefetches for all
        if (rows - r0 == 5)
          first ? block<5, 1, NUM>(xr, one, a, d_in, i0, i1, panel) : block<5, 1>(xr, one, a, d_in, i0, i1);
        else
          first ? block<6, 1, NUM>(xr, one, a, d_in, i0, i1, panel) : block<6, 1>(xr, one, a, d_in, i0, i1);
      }
    }
    const float* xr = x + r0 * d_in;
    switch (rows - r0) {
      case 1: block<1, NUM>(xr, panel, acc + 4 * r0, d_in, i0, i1); break;
      case 2: block<2, NUM>(xr, panel, acc + 4 * r0, d_in, i0, i1); break;
      case 3: block<3, NUM>(xr, panel, acc + 4 * r0, d_in, i0, i1); break;
      case 4:
        block<2, NUM>(xr, panel, acc + 4 * r0, d_in, i0, i1);
        block<2, NUM>(xr + 2 * d_in, panel, acc + 4 * (r0 + 2), d_in, i0, i1);
        break;
      default: break;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2 * NUM; ++h) store8(y + r * d_out + col + h * kHalf, acc[4 * r + h]);
}

#if defined(__AVX512F__)
// With AVX-512 a panel row is one 16-float vector and there are 32 registers: a chunk of up to 12
// rows goes over both panels of a pair at once (24 sums, the pair's two vectors, the broadcast
// input), so every weight loaded feeds 12 products and the pair streams from memory once for up to
// 12 rows, where the 8-float loops above go over it in chunks of 6 and 2 and leave the second
// half of each FMA unit idle. Measured on 2 cores of an AMD EPYC (Zen 5), microseconds per
// product against the 8-float loops (2026-11-29, docs/benchmarks.md, "AVX-512"): SmolLM2's
// [576, 3072] 237 -> 191 at 8 rows, 351 -> 227 at 16, 1071 -> 564 at 64; its [576, 49152] head
// 3862 -> 3079, 5723 -> 3778, 17216 -> 8996; 4 and 6 rows 1.15-1.2x faster, 2 and 3 the same.
// Chunks of 8 or 10 rows, or blocks of 64 or 256 inputs, ran within a few percent of these.
using specjax::store16;
using specjax::Vec16;

constexpr int64_t kChunk16 = 12;  // rows per chunk
constexpr int64_t kBlock16 = 128;  // inputs per block when a group takes several chunks: 16 KB of a pair

// `block` in 16-float vectors for a chunk of `rows` (1 .. kChunk16) rows; the first chunk of a
// block prefetches.
template <int NUM, int R = kChunk16>
void chunk16(int64_t rows, bool first, const float* x, const float* panel, Vec16* acc, int64_t d_in, int64_t i0,
             int64_t i1) {
  if constexpr (R > 1) {
    if (rows < R) return chunk16<NUM, R - 1>(rows, first, x, panel, acc, d_in, i0, i1);
  }
  first ? block<R, NUM, NUM>(x, panel, acc, d_in, i0, i1, panel) : block<R, NUM, 0>(x, panel, acc, d_in, i0, i1);
}

// Rows [0, rows) (rows <= kGroup) times `num` (NUM) panels: chunks of at most kChunk16 rows, of
// sizes as equal as can be, over both panels at once. One chunk runs over all the inputs in one
// pass; several go over them in blocks that stay in the L1 cache while every chunk runs over them
// (the first chunk of a block prefetches the weights ahead), the sums kept between blocks.
template <int NUM>
void many_rows_times_panels16(const float* x, const float* panel, float* y, int64_t rows, int64_t d_in,
                              int64_t d_out, int64_t col) {
  Vec16 acc[kGroup * 2];
  for (int64_t k = 0; k < rows * 2; ++k) acc[k] = Vec16{};
  const int64_t num_chunks = (rows + kChunk16 - 1) / kChunk16;
  const int64_t block = num_chunks == 1 ? d_in : kBlock16;
  for (int64_t i0 = 0; i0 < d_in; i0 += block) {
    const int64_t i1 = std::min(d_in, i0 + block);
    for (int64_t c = 0, r0 = 0; c < num_chunks; ++c) {
      const int64_t size = (rows - r0) / (num_chunks - c);
      chunk16<NUM>(size, c == 0, x + r0 * d_in, panel, acc + 2 * r0, d_in, i0, i1);
      r0 += size;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < NUM; ++p) store16(y + r * d_out + col + p * kPanel, acc[2 * r + p]);
}
#endif

// All rows times `num` panels: a few in chunks over both panels, more blocked, kGroup at a time.
// With AVX-512 every product of 2 rows or more takes the 16-float chunks (4 and 6 rows 1.15-1.2x
// faster than the 8-float loops, 2 and 3 the same); one row streams the weights at the memory's
// pace either way and keeps the 8-float loop.
template <int NUM>
void rows_times_panels(const float* x, const float* panel, float* y, int64_t rows, int64_t d_in, int64_t d_out,
                int64_t col) {
#if defined(__AVX512F__)
  if (rows == 1) return few_rows_times_panels<NUM>(x, panel, y, rows, d_in, d_out, col);
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup)
    many_rows_times_panels16<NUM>(x + r0 * d_in, panel, y + r0 * d_out, std::min(kGroup, rows - r0), d_in, d_out, col);
#else
  if (rows <= kFewRows) return few_rows_times_panels<NUM>(x, panel, y, rows, d_in, d_out, col);
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup)
    many_rows_times_panels<NUM>(x + r0 * d_in, panel, y + r0 * d_out, std::min(kGroup, rows - r0), d_in, d_out, col);
#endif
}

// y = x @ panels, with x's rows normed first and a residual added after where those operands are
// not empty (specjax::Around).
ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual,
                           ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1])
    return ffi::Error::InvalidArgument("panel_matmul: expected x [T, D_in], panels [P, D_in, 16]");
  const int64_t rows = xd[0], d_in = xd[1], num_panels = pd[0], d_out = num_panels * kPanel;
  specjax::Around around;
  if (auto error = specjax::read_around(norm, residual, eps, rows, d_in, d_out, around); error.failure())
    return error;
  std::vector<float> normed;  // the normed rows (a prefill's too: not kept after the call)
  const float* xs = around.input(x.typed_data(), rows, d_in, normed);
  const float* all_panels = panels.typed_data();
  float* ys = y->typed_data();
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
  around.finish(ys, rows, d_out);
  return ffi::Error::Success();
}

}  // namespace

void specjax::float_panel_rows(const float* x, const float* panels, float* y, int64_t rows, int64_t d_in,
                               int64_t d_out, int64_t col, bool two) {
  if (two)
    rows_times_panels<2>(x, panels, y, rows, d_in, d_out, col);
  else
    rows_times_panels<1>(x, panels, y, rows, d_in, d_out, col);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
