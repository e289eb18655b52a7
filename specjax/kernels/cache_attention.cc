// Attention of a few query rows to the committed slots of a KV cache: for each cache entry n (one
// row's kv head), the queries q[n] [R, E] (already scaled) attend to keys k[n] [E, S] and values
// v[n] [S, E] at slots 0 .. lengths[n] - 1. Returns the attention output [R, E] and each query's
// log-sum-exp of scores [R], so that the caller can merge in the fresh tokens' keys (a verify
// pass's own tokens, under a chain's or a tree's mask) with one more softmax term.
//
// Sliding windows (Mistral, Gemma 3's local layers): CacheAttentionWindow takes starts [N, R] too,
// and query r of entry n sees only slots max(starts[n, r], 0) .. lengths[n] - 1 (none where its
// start is at or past the length: log-sum-exp -inf, output 0). The blocks then cover the entry's
// slots from its rows' lowest start, so slots below every row's window are never read, and only a
// block that begins below some row's start masks that row's earlier slots. CacheAttention (no
// starts) runs the same code with no mask and pays nothing for it.
//
// Paged caches (models/cache.py, KVCache.pages): PagedCacheAttention and its window twin take the
// rows' page tables [B, W] too, k and v being pools of pages ([M, E, P] and [M, P, E], page p's kv
// head h at entry p * K + h), and read each page's visible slots in place, a block per page (or
// per kMaxBlock slots of a longer page), so nothing is gathered into rows first.
//
// Why: XLA:CPU computes decoding attention over every slot of the static cache, visible or not,
// and runs its small batched products at a fraction of the machine's bandwidth (SmolLM2's 30
// layers over 896 slots: 4-5 ms for one token, 12 ms for 8, 16 ms for 9, measured here). This
// reads each entry's committed slots once, in blocks of at most kMaxBlock slots handed out to the
// calling thread and XLA's intra-op threads (run_parts, kernels.h), and merges the blocks' partial
// softmaxes at the end (split-K, as flash-decoding does on GPUs).
//
// For one block and at most kMaxRows query rows at a time: the scores (8 slots per vector, keys
// stored [E, S] so a slot vector is contiguous), their exponentials with the block's maximum
// subtracted, then the weighted sum of the values, 16 head dims at a time (sums in registers:
// attend_block says how they fit AVX2's 16). The scores
// take kKeyRows key rows at a time, each read along the whole block, and keep their sums in a
// small array (L1): reading all E rows for 32 slots, then the next 32, made E short strided
// streams that the hardware prefetcher followed poorly (16-18 GB/s over 900 slots here, against
// 21-24 GB/s this way; docs/benchmarks.md, "Attention: key rows read along the block").
//
// A decoding step reads the cache cold (the step's weights have passed through the caches since the
// layer's last read), so each block asks for its key rows kKeyRows ahead of the pass over them, and
// for its values' lines spread over those passes. Measured in Q8_0 plain decoding of the built-in
// model (2 cores of an AMD EPYC, Zen 5, 2026-11-29, settings alternated in one process), microseconds
// per block of one entry (3 query rows): about 100 slots 6.2 -> 5.0, about 900 slots 20.1 -> 15.0;
// with the weights' prefetches also non-temporal (quant_matmul.cc) 4.0 and 13.3.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

namespace ffi = xla::ffi;
using specjax::load8;
using specjax::store8;
using specjax::Vec8;

namespace {

typedef int32_t Int8 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 16;      // blocks are a multiple of this many slots
constexpr int64_t kVector = 8;      // floats per vector (Vec8: one AVX2 register)
constexpr int64_t kMaxBlock = 512;  // slots per part of the work, at most
constexpr int64_t kKeyRows = 8;     // key rows (head dims) per pass over a block's slots
constexpr int kMaxRows = 6;         // query rows per chunk (see attend_block)
constexpr int64_t kLine = 16;       // floats per cache line

inline Vec8 splat(float x) { return Vec8{} + x; }

// e^x for 8 floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' expf polynomial
// (relative error about 1e-7), 2^n from the exponent bits. x below -87 (where e^x leaves the
// normal floats) gives 0.
inline Vec8 exp8(Vec8 x) {
  const Vec8 lowest = splat(-87.0f);
  const Vec8 clamped = x < lowest ? lowest : x;
  const Vec8 t = clamped * 1.44269504088896341f + 0.5f;
  Int8 n = __builtin_convertvector(t, Int8);  // rounds toward zero, so up where t < 0:
  n += __builtin_convertvector(n, Vec8) > t ? Int8{} - 1 : Int8{};  // step down to floor(t)
  const Vec8 nf = __builtin_convertvector(n, Vec8);
  const Vec8 r = clamped - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec8 e_r = p * r * r + r + 1.0f;
  const Int8 bits = (n + 127) << 23;
  Vec8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < lowest ? Vec8{} : e_r * scale;
}

// Rows [0, R) of q (R <= kMaxRows, a template constant so the sums stay in registers) against
// slots s0 .. s0 + count - 1 (count <= kMaxBlock) of one entry, which k and v hold from slot
// index `at` on (keys [E, num_slots] and values [num_slots, E] from their pointers; a dense row's
// `at` is s0, a page's the slot's offset in the page): the block's maximum score per row,
// the sum of exp(score - maximum) and the values weighted by those exponentials, unnormalized.
// `first` [R] (null where every row sees the whole block): row r's first visible slot; the slots
// below it get no weight, and a row that sees none of the block gets maximum -inf, sum 0 and
// output 0.
//
// Sized for the 16 AVX2 registers (the vectors are 8 floats; GCC splits wider ones into halves
// and, once their sums outgrow the registers, spills them: with 16-float vectors and up to 8 rows a
// chunk, sized for AVX-512's 32 registers, this took 0.37 ms per layer for 8 rows of SmolLM2 at
// 150 slots, 11 ms of a 46 ms step). The scores keep R sums of 8 slots, one key vector and the
// broadcast query value (R + 2 registers); the values go 16 head dims at a time: R x 2 sums, the
// slot's 2 value vectors and its broadcast weight (2R + 3 registers, 15 at 6 rows).
template <int R, int64_t E>
void attend_block(const float* q, const float* k, const float* v, const int32_t* first, int64_t num_slots,
                  int64_t s0, int64_t at, int64_t count, bool ask, float* max_out, float* sum_out, float* out) {
  static_assert(E % (2 * kVector) == 0 && E % kKeyRows == 0 && R <= kMaxRows);
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float scores[R][kMaxBlock];
  const int64_t vectors = count / kVector;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < vectors; ++j) store8(&scores[r][j * kVector], Vec8{});
  // Prefetches (where `ask`: the first chunk of rows over a block; later ones find it in cache).
  // Key row e of the block is `count` floats; the values are count x E floats, which the weighted
  // sum below reads E floats apart, 16 at a time: each pass over kKeyRows key rows asks for the
  // next kKeyRows rows and for its share of the values' cache lines.
  const int64_t value_lines = count * E / kLine, share = (value_lines * kKeyRows + E - 1) / E;
  const auto ask_rows = [&](int64_t e0) {
    for (int64_t e = e0; e < std::min<int64_t>(e0 + kKeyRows, E); ++e)
      for (int64_t s = 0; s < count + kLine - 1; s += kLine)
        __builtin_prefetch(k + e * num_slots + at + std::min(s, count - 1));
  };
  if (ask) ask_rows(0);
  for (int64_t e0 = 0; e0 < E; e0 += kKeyRows) {
    if (ask) {
      ask_rows(e0 + kKeyRows);
      const int64_t line0 = e0 / kKeyRows * share;
      for (int64_t l = line0; l < std::min(value_lines, line0 + share); ++l)
        __builtin_prefetch(v + at * E + l * kLine);
    }
    for (int64_t j = 0; j < vectors; ++j) {
      Vec8 sums[R];
      for (int r = 0; r < R; ++r) sums[r] = load8(&scores[r][j * kVector]);
      for (int64_t e = e0; e < e0 + kKeyRows; ++e) {
        const Vec8 keys = load8(k + e * num_slots + at + j * kVector);
        for (int r = 0; r < R; ++r) sums[r] += q[r * E + e] * keys;
      }
      for (int r = 0; r < R; ++r) store8(&scores[r][j * kVector], sums[r]);
    }
  }
  for (int64_t s = vectors * kVector; s < count; ++s)  // the last slots, one at a time
    for (int r = 0; r < R; ++r) {
      float dot = 0.0f;
      for (int64_t e = 0; e < E; ++e) dot += q[r * E + e] * k[e * num_slots + at + s];
      scores[r][s] = dot;
    }
  if (first != nullptr)
    for (int r = 0; r < R; ++r) {
      const int64_t hidden = std::clamp<int64_t>(first[r] - s0, 0, count);  // slots before row r's window
      std::fill(scores[r], scores[r] + hidden, kNone);
    }

  for (int r = 0; r < R; ++r) {
    float top = scores[r][0];
    for (int64_t s = 1; s < count; ++s) top = std::max(top, scores[r][s]);
    // A row that sees nothing here (top -inf) subtracts 0: every exponential is then e^-inf = 0,
    // where -inf - -inf would be NaN.
    const float shift = top == kNone ? 0.0f : top;
    Vec8 sums = Vec8{};
    for (int64_t s = 0; s < vectors * kVector; s += kVector) {
      const Vec8 p = exp8(load8(&scores[r][s]) - shift);
      store8(&scores[r][s], p);
      sums += p;
    }
    float sum = 0.0f;
    for (int i = 0; i < kVector; ++i) sum += sums[i];
    for (int64_t s = vectors * kVector; s < count; ++s) {
      scores[r][s] = std::exp(scores[r][s] - shift);
      sum += scores[r][s];
    }
    max_out[r] = top;
    sum_out[r] = sum;
  }

  for (int64_t d = 0; d < E; d += 2 * kVector) {  // 16 head dims at a time
    Vec8 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec8{};
    for (int64_t s = 0; s < count; ++s) {
      const float* value = v + (at + s) * E + d;
      const Vec8 low = load8(value), high = load8(value + kVector);
      for (int r = 0; r < R; ++r) {
        const float p = scores[r][s];
        acc[r][0] += p * low;
        acc[r][1] += p * high;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(out + r * E + d, acc[r][0]);
      store8(out + r * E + d + kVector, acc[r][1]);
    }
  }
}

// All `rows` of one entry against one block, in chunks of at most kMaxRows rows. `first` [rows]
// (null without starts): each row's first visible slot; a chunk whose rows all start at or before
// s0 (every block of full attention, most of a window's) masks nothing.
template <int64_t E>
void attend_rows(const float* q, const float* k, const float* v, const int32_t* first, int64_t rows,
                 int64_t num_slots, int64_t s0, int64_t at, int64_t count, float* max_out, float* sum_out,
                 float* out) {
  const int64_t num_chunks = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t c = 0, r0 = 0; c < num_chunks; ++c) {  // chunk sizes as equal as can be
    const int64_t size = (rows - r0) / (num_chunks - c);
    const float* qr = q + r0 * E;
    const int32_t* f = nullptr;
    if (first != nullptr && std::any_of(first + r0, first + r0 + size, [=](int32_t x) { return x > s0; }))
      f = first + r0;
    float *m = max_out + r0, *l = sum_out + r0, *o = out + r0 * E;
#define SPECJAX_ROWS(n) \
  case n: attend_block<n, E>(qr, k, v, f, num_slots, s0, at, count, c == 0, m, l, o); break;
    switch (size) {
      SPECJAX_ROWS(1)
      SPECJAX_ROWS(2)
      SPECJAX_ROWS(3)
      SPECJAX_ROWS(4)
      SPECJAX_ROWS(5)
      SPECJAX_ROWS(6)
    }
#undef SPECJAX_ROWS
    r0 += size;
  }
}

// Where entry n's slots are: a dense cache's in its own keys [E, S] and values [S, E]; a paged
// cache's (pages: the rows' tables [B, W], k and v pools of M entries, page p's kv head h at entry
// p * heads + h, each [E, P] and [P, E]) slot s of row b = n / heads in page table[b][s / P].
struct Layout {
  int64_t num_slots;  // slots of an entry's keys and values: S dense, P paged
  const int32_t* pages = nullptr;
  int64_t width = 0, heads = 0, pool_pages = 0;  // paged: W, kv heads per row, M / heads
};

// All handlers: `starts` [N, R] as in the header, or null (every row from slot 0).
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Buffer<ffi::S32> lengths, const int32_t* starts, const Layout& layout,
                  ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const bool paged = layout.pages != nullptr;
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || (!paged && (kd[0] != qd[0] || vd[0] != qd[0])) ||
      vd[0] != kd[0] || kd[1] != qd[2] || vd[2] != qd[2] || vd[1] != kd[2] ||
      static_cast<int64_t>(lengths.element_count()) != qd[0])
    return ffi::Error::InvalidArgument(
        "cache_attention: expected q [N, R, E], k [N, E, S], v [N, S, E], lengths [N] (paged: k [M, E, P], "
        "v [M, P, E])");
  const int64_t E = qd[2];
  if (E != 16 && E != 32 && E != 64 && E != 128 && E != 256)
    return ffi::Error::InvalidArgument("cache_attention: head_dim must be 16, 32, 64, 128 or 256");
  const int64_t entries = qd[0], rows = qd[1], num_slots = kd[2];
  const int64_t capacity = paged ? layout.width * num_slots : num_slots;  // slots per entry's row

  // Block b of entry n is part first_part[n] + b; its partial results go to the block arrays. The
  // slots some row of an entry sees, from its rows' lowest start to its length, split into blocks of
  // equal size (a multiple of 16 slots, at most kMaxBlock), so that no thread is left with a short
  // last block while another reads a long one; paged, each page's slots in blocks of their own.
  // A part's keys and values start at k_at and v_at floats into k and v, its slot s0 at index at.
  const int32_t* length_of = lengths.typed_data();
  std::vector<int64_t> first_part(entries + 1, 0), part_entry, part_start, part_count, part_k, part_at;
  for (int64_t n = 0; n < entries; ++n) {
    first_part[n] = part_entry.size();
    const int64_t length = std::clamp<int64_t>(length_of[n], 0, capacity);
    int64_t lowest = 0;
    if (starts != nullptr) {
      lowest = length;
      for (int64_t r = 0; r < rows; ++r) lowest = std::min<int64_t>(lowest, starts[n * rows + r]);
      lowest = std::max<int64_t>(lowest, 0);
    }
    const auto add = [&](int64_t s0, int64_t count, int64_t entry_at, int64_t at) {
      part_entry.push_back(n);
      part_start.push_back(s0);
      part_count.push_back(count);
      part_k.push_back(entry_at);
      part_at.push_back(at);
    };
    if (!paged) {
      const int64_t seen = length - lowest;
      const int64_t num_blocks = (seen + kMaxBlock - 1) / kMaxBlock;
      if (num_blocks == 0) continue;
      const int64_t block = ((seen + num_blocks - 1) / num_blocks + kLanes - 1) / kLanes * kLanes;
      for (int64_t s0 = lowest; s0 < length; s0 += block) add(s0, std::min(block, length - s0), n, s0);
      continue;
    }
    const int32_t* table = layout.pages + (n / layout.heads) * layout.width;
    for (int64_t s0 = lowest; s0 < length;) {
      const int64_t w = s0 / num_slots, end = std::min(length, (w + 1) * num_slots);
      const int64_t page = table[w];
      if (page < 0 || page >= layout.pool_pages)
        return ffi::Error::InvalidArgument("cache_attention: a page table entry is outside the pool");
      const int64_t count = std::min(end - s0, kMaxBlock);
      add(s0, count, page * layout.heads + n % layout.heads, s0 - w * num_slots);
      s0 += count;
    }
  }
  const int64_t num_parts = part_entry.size();
  first_part[entries] = num_parts;
  std::vector<float> block_max(num_parts * rows), block_sum(num_parts * rows), block_out(num_parts * rows * E);

  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const int64_t *entry_of = part_entry.data(), *start_of = part_start.data(), *count_of = part_count.data();
  const int64_t *k_entry_of = part_k.data(), *at_of = part_at.data();
  float *maxima = block_max.data(), *sums = block_sum.data(), *outs = block_out.data();
  specjax::run_parts(pool, num_parts, [=](int64_t part) {
    const int64_t n = entry_of[part], s0 = start_of[part], count = count_of[part], at = at_of[part];
    const float* qn = qs + n * rows * E;
    const float* kn = ks + k_entry_of[part] * E * num_slots;
    const float* vn = vs + k_entry_of[part] * num_slots * E;
    const int32_t* first = starts == nullptr ? nullptr : starts + n * rows;
    float *m = maxima + part * rows, *l = sums + part * rows, *o = outs + part * rows * E;
    switch (E) {
      case 16: attend_rows<16>(qn, kn, vn, first, rows, num_slots, s0, at, count, m, l, o); break;
      case 32: attend_rows<32>(qn, kn, vn, first, rows, num_slots, s0, at, count, m, l, o); break;
      case 64: attend_rows<64>(qn, kn, vn, first, rows, num_slots, s0, at, count, m, l, o); break;
      case 128: attend_rows<128>(qn, kn, vn, first, rows, num_slots, s0, at, count, m, l, o); break;
      default: attend_rows<256>(qn, kn, vn, first, rows, num_slots, s0, at, count, m, l, o); break;
    }
  });

  // Merge each entry's blocks: rescale every block's sums to the largest maximum. A block where the
  // row saw nothing (maximum -inf, sum 0, output 0) gets scale e^-inf = 0; a row that saw nothing
  // in any block (none committed, or none inside its window) keeps output 0 and log-sum-exp -inf.
  float* o = out->typed_data();
  float* logsumexp = lse->typed_data();
  for (int64_t n = 0; n < entries; ++n)
    for (int64_t r = 0; r < rows; ++r) {
      float* o_row = o + (n * rows + r) * E;
      std::fill(o_row, o_row + E, 0.0f);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = first_part[n]; p < first_part[n + 1]; ++p) top = std::max(top, block_max[p * rows + r]);
      if (top == -std::numeric_limits<float>::infinity()) {  // no weight at all
        logsumexp[n * rows + r] = top;
        continue;
      }
      float total = 0.0f;
      for (int64_t p = first_part[n]; p < first_part[n + 1]; ++p) {
        const float scale = std::exp(block_max[p * rows + r] - top);
        total += scale * block_sum[p * rows + r];
        const float* block = block_out.data() + (p * rows + r) * E;
        for (int64_t e = 0; e < E; ++e) o_row[e] += scale * block[e];
      }
      for (int64_t e = 0; e < E; ++e) o_row[e] /= total;
      logsumexp[n * rows + r] = top + std::log(total);
    }
  return ffi::Error::Success();
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths,
                              ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  return Attend(pool, q, k, v, lengths, nullptr, Layout{k.dimensions().back()}, out, lse);
}

ffi::Error CheckStarts(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> starts) {
  const auto qd = q.dimensions(), sd = starts.dimensions();
  if (qd.size() != 3 || sd.size() != 2 || sd[0] != qd[0] || sd[1] != qd[1])
    return ffi::Error::InvalidArgument("cache_attention: expected q [N, R, E] and starts [N, R]");
  return ffi::Error::Success();
}

ffi::Error CacheAttentionWindowImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths,
                                    ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out,
                                    ffi::ResultBuffer<ffi::F32> lse) {
  if (auto error = CheckStarts(q, starts); error.failure()) return error;
  return Attend(pool, q, k, v, lengths, starts.typed_data(), Layout{k.dimensions().back()}, out, lse);
}

// A paged cache: pages [B, W], the entries N = B * heads of q and lengths row-major by row.
bool PagedLayout(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::S32> pages, Layout* layout) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 2 || pd[0] == 0 || qd[0] % pd[0] != 0) return false;
  layout->num_slots = kd[2];
  layout->pages = pages.typed_data();
  layout->width = pd[1];
  layout->heads = qd[0] / pd[0];
  if (kd[0] % layout->heads != 0) return false;
  layout->pool_pages = kd[0] / layout->heads;
  return true;
}

ffi::Error PagedCacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths,
                                   ffi::Buffer<ffi::S32> pages, ffi::ResultBuffer<ffi::F32> out,
                                   ffi::ResultBuffer<ffi::F32> lse) {
  Layout layout;
  if (!PagedLayout(q, k, pages, &layout))
    return ffi::Error::InvalidArgument("cache_attention: expected pages [B, W] with q [B * K, R, E], k [M * K, E, P]");
  return Attend(pool, q, k, v, lengths, nullptr, layout, out, lse);
}

ffi::Error PagedCacheAttentionWindowImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths,
                                         ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> starts,
                                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Layout layout;
  if (!PagedLayout(q, k, pages, &layout))
    return ffi::Error::InvalidArgument("cache_attention: expected pages [B, W] with q [B * K, R, E], k [M * K, E, P]");
  if (auto error = CheckStarts(q, starts); error.failure()) return error;
  return Attend(pool, q, k, v, lengths, starts.typed_data(), layout, out, lse);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheAttentionWindow, CacheAttentionWindowImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedCacheAttention, PagedCacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedCacheAttentionWindow, PagedCacheAttentionWindowImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
