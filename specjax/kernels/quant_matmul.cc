// y [T, P*16] = x [T, D_in] @ W for a quantized weight W [D_in, P*16] stored as column panels:
// W[i, o] = q[i, o] * scales[i / group, o] + offsets[i / group, o] (specjax/models/quantized.py),
// where panel p holds columns 16p .. 16p+15 of q, of the scales and of the offsets:
//
//   int8:  values int8  [P, D_in, 16]      one 16-byte row of q per input row
//   4-bit: values uint8 [P, D_in / 2, 16]  one 16-byte row per input pair: row 2i in the low
//                                          nibble, row 2i+1 in the high one (q 0..15)
//   scales, offsets: float32 or float16 [P, D_in / group, 16]
//
// (float16 where every scale and offset is one exactly, as GGUF's Q8_0, Q4_0 and Q4_1 store
// theirs: a Q4_1 weight is then 20 bytes per 32 values rather than 24, a Q8_0 one 34 rather
// than 36, as in the file; quantized.py, `pack_quantized`.)
//
// Why: decoding streams every weight once per step, so a weight read as 1 byte (or half of one)
// instead of 4 is read up to 4 (or 8) times faster. Each value is read once and multiplied into
// every row: per group and row, acc = sum_i x_i q_io in float32, then y += scale * acc, plus
// offset * (sum_i x_i) (those row sums computed once per call). The 16 bytes of a panel row widen
// to 16 int32 lanes (one vpmovsxbd / vpmovzxbd per 8 on AVX2) and convert to float; x stays float.
//
// What bounds it (measured on this project's 2-core AMD EPYC, Zen 3, AVX2, 2026-11-28, a busy
// machine; single thread, a standalone harness calling these loops): a 4-bit byte row gives its
// two input rows with a mask and a shift of the same lanes, and on Zen 3 the shift (like the
// widening) competes with the FMAs for their pipes (8 FMAs beside 8 shifts: 5.9 cycles, beside 8
// conversions or 8 masks: 4.0). So 4-bit converts the low nibble and the whole byte (lo + 16 hi)
// instead, with x combined to match (combine_pairs): 64 weights of one row in 7.0 cycles rather
// than 8.8 (in L1). From memory, the values and the scales and offsets of two panels are six
// short streams (a 4-bit panel of SmolLM2 is 9 KB), which the hardware prefetcher follows badly:
// a [576, 1536] 4-bit product read 7-8.6 GB/s on one thread, 10.6-13 GB/s with the next panels'
// lines prefetched as the current ones are read and the nibble change; int8 12.6-14 -> 16.5-19.4
// GB/s (a plain read of memory: 18-19 GB/s at the time). On the Zen 5 with AVX-512 (2026-11-29),
// prefetching a one-row product's panels two pairs ahead rather than one: the 30 layers' one-row
// products of the built-in model, chained as in a step (2 threads, builds alternated 3 times,
// medians of 7 x 300 chains, the machine drifting by a third meanwhile), Q8_0 3.99 / 4.08 / 4.26
// -> 3.91 / 4.01 / 3.69 ms, Q4_1 3.26 / 3.37 / 2.59 -> 3.18 / 2.95 / 2.39 ms; three or four pairs
// ahead were no better, nor an L2 hint (prefetcht2) at one pair.
//
// The work splits over pairs of panels (run_from_both_ends, below). For one row, two panels at a
// time with even and odd input rows in separate sums (8 independent sums of 8 floats: an FMA's latency would
// otherwise bound the loop); for more rows, one panel at a time, in chunks of rows (a prefill's
// later chunks find the panel in cache): int8 in chunks of at most 3 rows with one sum per row,
// 4-bit in chunks of at most 2 with even/odd sums. With one sum per row each sum takes two
// dependent FMAs per input pair; 4-bit, whose widening is cheap beside its conversions, ran faster
// widening twice as often with twice the independent sums (in cache, GB/s at 3 / 4 / 6 rows:
// 5.1 / 4.6 / 2.6 in chunks of up to 4, 6.6 / 5.4 / 3.6 in chunks of 2); int8 at 4 rows 5.2 GB/s
// in one chunk, 8.6 as 2 + 2. Chunks of 6 rows (12 sums beside the widened values and the
// broadcast inputs) kept sums on the stack.
#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "kernels.h"

namespace ffi = xla::ffi;
using specjax::load8;
using specjax::store8;
using specjax::store_vec;
using specjax::Vec8;

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kHalf = 8;  // columns per vector: a panel row is two halves
constexpr int64_t kChunk8 = 3;  // rows per chunk at most (see above)
constexpr int64_t kChunk4 = 2;
// The threads share a product by panel pairs, each walking one contiguous run of them
// (run_from_both_ends, kernels.h: the caller from the first pair up, XLA's other thread from the last
// pair down, until they meet), its prefetches running ahead in its own direction. Handed out instead
// in parts of a few pairs to whichever thread asks next (run_parts), the two threads alternate parts,
// and each part's first pairs are ones no prefetch has asked for: the 30 layers' one-row products
// of the built-in model chained as in a step (2 cores of an AMD EPYC, Zen 5, 2026-11-29, settings
// alternated in one process, medians of 25 x 100 chains) took Q8_0 3.35-4.00 ms in parts of a few
// pairs, 2.95-3.63 from both ends, Q4_1 2.78 -> 2.10 (in two halves, one per thread). The helper
// thread joined 0.8 us after the call began on average and took 47% of the pairs. A simple read of
// memory on both threads reaches 41-48 GB/s here; the [576, 3072] products now read about 44.
// From this many rows (a prefill, a wide batch's verify pass) each panel is dequantized once into
// a float32 scratch that stays in cache, and panel_matmul.cc's loops multiply every row by it: the
// loops below widen and convert the values again for every chunk of 2 or 3 rows, which bounds a
// long product by its conversions. Measured on SmolLM2's [576, 1536] and [1536, 576] weights
// (Q4_1- and Q8_0-like, 2 threads, this project's 2-core AMD EPYC, 2026-11-29), microseconds per
// product with the chunks / dequantized first: 8 rows 73-76 / 93-100 (the dequantization, a
// float32 write of each panel, is then a third of the product), 16 rows 140-146 / 157-161, 24 rows
// 209-216 / 191-196, 64 rows 546-575 / 467-491, 1024 rows 8940-9100 / 6760-7160 (float32 panels:
// 7010-7680, so a long product no longer costs more quantized than in float32).
//
// With AVX-512 the loops below run in 16-float vectors (`Wide`) and panel_matmul.cc's float32
// loops in 16-float chunks of up to 12 rows; measured again there (2 cores of an AMD EPYC, Zen 5,
// 2026-11-29, microseconds with the chunks / dequantized first), Q8_0-like int8 with float16
// scales: [576, 3072] 16 rows 213 / 248, 20 rows 259 / 286, the [576, 49152] head 16 rows 3077 /
// 3695, 20 rows 3813 / 4278; Q4_1-like 4-bit: [576, 3072] 12 rows 161 / 177, 16 rows 214 / 215,
// the head 12 rows 2208 / 2489, 16 rows 2972 / 2968.
template <int BITS>
constexpr int64_t kDequantizeRows =
#if defined(__AVX512F__)
    BITS == 8 ? 24 : 16;
#else
    24;
#endif

typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef int8_t I8x8 __attribute__((vector_size(8)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));

// Eight int8 values as floats.
inline Vec8 widen_int8(const uint8_t* p) {
#ifdef __AVX2__
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  I8x8 bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(__builtin_convertvector(bytes, I32x8), Vec8);
#endif
}

// Eight bytes of two 4-bit values each as floats: the low nibbles, and the whole bytes (low + 16 *
// high), not the high nibbles: x is combined to match (`combine_pairs`), and the shift that would
// isolate the high nibbles, which competes with the FMAs on Zen 3, is saved.
inline void widen_int4(const uint8_t* p, Vec8& low, Vec8& whole) {
#ifdef __AVX2__
  const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(15)));
  whole = _mm256_cvtepi32_ps(lanes);
#else
  U8x8 bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  const I32x8 lanes = __builtin_convertvector(bytes, I32x8);
  low = __builtin_convertvector(lanes & 15, Vec8);
  whole = __builtin_convertvector(lanes, Vec8);
#endif
}

#if defined(__AVX512F__)
using specjax::load16;
using specjax::Vec16;

// Sixteen int8 values (a whole panel row) as floats.
inline Vec16 widen_int8(const uint8_t* p, Vec16) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Sixteen bytes of two 4-bit values each: the low nibbles and the whole bytes, as widen_int4.
inline void widen_int4(const uint8_t* p, Vec16& low, Vec16& whole) {
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(15)));
  whole = _mm512_cvtepi32_ps(lanes);
}
#endif

inline Vec8 widen_int8(const uint8_t* p, Vec8) { return widen_int8(p); }

// x as the 4-bit kernel multiplies it: each pair (x_2k, x_2k+1) as (x_2k - x_2k+1 / 16,
// x_2k+1 / 16), so that with a byte's low nibble lo and whole value b = lo + 16 hi,
// x_2k lo + x_2k+1 hi = (x_2k - x_2k+1 / 16) lo + (x_2k+1 / 16) b. Dividing by 16 is exact; the
// difference rounds once.
void combine_pairs(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    const float odd = x[i + 1] * 0.0625f;
    out[i] = x[i] - odd;
    out[i + 1] = odd;
  }
}

// A float16 as its 16 bits (the scales and offsets of a QuantizedPanelWeight stored as float16).
struct Half {
  uint16_t bits;
};

// Eight scales (or offsets) as floats.
inline Vec8 load_meta(const float* p) { return load8(p); }

inline Vec8 load_meta(const Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Vec8 out;
  for (int j = 0; j < kHalf; ++j) {  // IEEE binary16 -> binary32, exactly
    const uint32_t h = p[j].bits, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float magnitude;
    if (exponent == 0) {
      magnitude = mantissa * (1.0f / 16777216.0f);  // subnormal: mantissa * 2^-24
    } else {
      const uint32_t bits = exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13);
      __builtin_memcpy(&magnitude, &bits, sizeof(bits));
    }
    uint32_t bits;
    __builtin_memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
    __builtin_memcpy(&out[j], &bits, sizeof(bits));
  }
  return out;
#endif
}

#if defined(__AVX512F__)
// Sixteen scales (or offsets) as floats.
inline Vec16 load_meta16(const float* p) { return load16(p); }

inline Vec16 load_meta16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// The loops below run in vectors V: 8 floats (two per panel row) or, with AVX-512, 16 (one per
// panel row: `Wide`), with these to load, widen and store a part of a panel row. The 16-float loops
// widen and convert 16 values an instruction where the 8-float ones took two, which bound 4-bit
// products (Zen 5, 2026-11-29, microseconds, 8-float / 16-float loops: the [576, 49152] head at
// one row 468 / 300, [576, 3072] 50 / 41; int8 at one row, memory-bound, the same); at 2-6 rows
// both widths gain (6 rows, int8 [576, 3072] 128 / 89, the head 1807 / 1134; 4-bit 127 / 90 and
// 1741 / 1148), and dequantizing a panel 7-9% (16 rows). The sums add in the same order either
// way, so the results are bit for bit the same.
template <typename V>
constexpr int kLanes = sizeof(V) / sizeof(float);

#if defined(__AVX512F__)
using Wide = Vec16;
#else
using Wide = Vec8;
#endif

template <typename V, typename Meta>
inline V load_meta_as(const Meta* p) {
#if defined(__AVX512F__)
  if constexpr (kLanes<V> == 16) return load_meta16(p);
#endif
  if constexpr (kLanes<V> == 8) return load_meta(p);
}

// What one call multiplies: rows of x, one quantized weight in panels, y's columns. Meta: the
// scales' and offsets' type, float or Half.
template <typename Meta>
struct Operands {
  const float* x;         // [T, D_in] (4-bit: pairs combined, combine_pairs)
  const float* row_sums;  // [T, G]: sum of x over each group (offsets only)
  const uint8_t* values;  // [P, D_in or D_in / 2, 16]
  const Meta* scales;     // [P, G, 16]
  const Meta* offsets;    // [P, G, 16] or null
  float* y;               // [T, P*16]
  int64_t d_in, group, num_groups, d_out;
};

// Input rows 2k and 2k+1 of part h of a panel row (columns h L .. h L + L - 1 for vectors V of L
// floats: a half with Vec8, the whole row with Vec16) of the panel whose values start at `v`
// (4-bit: the low nibbles and the whole bytes, see widen_int4).
template <int BITS, typename V>
inline void pair(const uint8_t* v, int64_t k, int h, V& even, V& odd) {
  if constexpr (BITS == 8) {
    even = widen_int8(v + 2 * k * kPanel + h * kLanes<V>, V{});
    odd = widen_int8(v + (2 * k + 1) * kPanel + h * kLanes<V>, V{});
  } else {
    widen_int4(v + k * kPanel + h * kLanes<V>, even, odd);
  }
}

// Input row 2k + S of part h of a panel row of the panel whose values start at `v`: a pair's values
// widened again for each of its rows, which leaves more registers for the sums of several rows.
template <int BITS, int S, typename V>
inline V row(const uint8_t* v, int64_t k, int h) {
  if constexpr (BITS == 8) {
    return widen_int8(v + (2 * k + S) * kPanel + h * kLanes<V>, V{});
  } else {
    V even, odd;
    widen_int4(v + k * kPanel + h * kLanes<V>, even, odd);  // (the compiler keeps the one used)
    return S ? odd : even;
  }
}

// Whether the weights' prefetches are non-temporal (prefetchnta): on AMD CPUs. A decoding step
// streams every weight once, 140 MB for the built-in model at Q8_0, through an L3 of 32 MB here;
// asked for as non-temporal, they pass without evicting what the step reads again (the KV cache, the
// activations, XLA's buffers), and the products themselves ran no slower (the 30 layers' chained
// one-row products, 2 cores of an AMD EPYC, Zen 5, 2026-11-29, in one process, medians of 15 x 100
// chains: Q8_0 2.99 -> 2.90 ms, Q4_1 2.30 -> 2.25). Q8_0 plain decoding of 128 tokens ran 196 ->
// 208 tokens/s, the cache's attention reading its slots faster (4.5 us a block of about 100 slots,
// 5.3 before). Elsewhere (not measured) the ordinary hint: on Intel CPUs a non-temporal line may
// leave L1 before the loop reaches it, with this prefetch distance (up to 98 KB ahead).
const bool kNonTemporal = [] {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
#else
  return false;
#endif
}();

// Asks for the cache line at `bytes` past `base`, which may lie past the array (a prefetch never
// faults; the address is computed as an integer, as pointer arithmetic past an array is undefined).
inline void prefetch(const void* base, int64_t bytes) {
  const auto* at = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + bytes);
  if (kNonTemporal)
    __builtin_prefetch(at, 0, 0);
  else
    __builtin_prefetch(at);
}

// Rows [r0, r0 + R) of x times NUM panels from `panel`, with CHAINS (1 or 2) sums per row and
// part of a panel row (2: even and odd input rows apart), in vectors V, written to y's columns of
// those panels. `ahead`: the direction in which this thread walks the panels (+1 up, -1 down), whose
// next ones the first chunk over a panel prefetches; 0 for later chunks, which find it in cache.
template <int BITS, bool OFFSETS, int R, int NUM, int CHAINS, typename V, typename Meta>
void chunk(const Operands<Meta>& a, int64_t panel, int64_t r0, int ahead) {
  constexpr int kParts = kPanel / kLanes<V>;  // vectors per panel row
  constexpr int H = kParts * NUM;
  constexpr int64_t kStep = 2 * kPanel * BITS / 8;  // bytes of a panel per pair of input rows
  constexpr int kAhead = R == 1 ? 2 : 1;  // chunks of NUM panels ahead to prefetch (below)
  // The first of the NUM panels whose values, and whose scales, to prefetch: kAhead chunks of NUM
  // panels on, and the next chunk's, in the direction `ahead` (up from the first of this chunk's
  // panels, or down: the chunks come one below the other).
  const int values_ahead = ahead >= 0 ? kAhead * NUM : -kAhead * NUM;
  const int scales_ahead = ahead >= 0 ? NUM : -NUM;
  const int64_t bytes = a.d_in * kPanel * BITS / 8;  // one panel's values
  const uint8_t* values = a.values + panel * bytes;
  const float* x = a.x + r0 * a.d_in;
  V total[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) total[r][h] = V{};
  for (int64_t g = 0; g < a.num_groups; ++g) {
    // Prefetches: the lines of the panels kAhead * NUM on in the thread's direction (one row: the
    // pair after next; more: the next panel) that match the values read now, so that memory serves
    // one product's panels that far ahead (for one row, the next pair was slower: see the top of
    // the file; for 6 rows two panels ahead was not faster, the Q8_0 layers' chain 7.92 / 7.96 /
    // 6.56 ms against 7.61 / 7.55 / 6.69); past the last panel (or before the first) they point
    // outside the arrays, which a prefetch may. The scales, a sixteenth of the values, NUM panels
    // ahead.
    if (ahead)  // this group's scales (and offsets)
      for (int n = scales_ahead; n < scales_ahead + NUM; ++n) {
        const int64_t at = ((panel + n) * a.num_groups + g) * kPanel * int64_t{sizeof(Meta)};
        prefetch(a.scales, at);
        if (OFFSETS) prefetch(a.offsets, at);
      }
    V acc[R][H][CHAINS];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < CHAINS; ++c) acc[r][h][c] = V{};
    const int64_t first = g * a.group;
    for (int64_t k = first / 2; k < (first + a.group) / 2; ++k) {
      if (ahead && (k * kStep) % 64 == 0)  // a line of values
        for (int n = values_ahead; n < values_ahead + NUM; ++n) prefetch(values, n * bytes + k * kStep);
      if constexpr (CHAINS == 2) {  // one or two rows: by pairs of input rows
        for (int h = 0; h < H; ++h) {
          V even, odd;
          pair<BITS, V>(values + (h / kParts) * bytes, k, h % kParts, even, odd);
          for (int r = 0; r < R; ++r) {
            acc[r][h][0] += x[r * a.d_in + 2 * k] * even;
            acc[r][h][1] += x[r * a.d_in + 2 * k + 1] * odd;
          }
        }
      } else {  // more rows: one input row at a time
        for (int h = 0; h < H; ++h) {
          const V w = row<BITS, 0, V>(values + (h / kParts) * bytes, k, h % kParts);
          for (int r = 0; r < R; ++r) acc[r][h][0] += x[r * a.d_in + 2 * k] * w;
        }
        for (int h = 0; h < H; ++h) {
          const V w = row<BITS, 1, V>(values + (h / kParts) * bytes, k, h % kParts);
          for (int r = 0; r < R; ++r) acc[r][h][0] += x[r * a.d_in + 2 * k + 1] * w;
        }
      }
    }
    if (BITS == 8 && a.group % 2) {  // the one group of an odd D_in: its last row
      const int64_t i = first + a.group - 1;
      for (int h = 0; h < H; ++h) {
        const V w = widen_int8(values + (h / kParts) * bytes + i * kPanel + (h % kParts) * kLanes<V>, V{});
        for (int r = 0; r < R; ++r) acc[r][h][0] += x[r * a.d_in + i] * w;
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t at = ((panel + h / kParts) * a.num_groups + g) * kPanel + (h % kParts) * kLanes<V>;
      const V scale = load_meta_as<V>(a.scales + at);
      for (int r = 0; r < R; ++r) {
        V sum = acc[r][h][0];
        if (CHAINS == 2) sum += acc[r][h][CHAINS - 1];
        total[r][h] += scale * sum;
      }
      if constexpr (OFFSETS) {
        const V offset = load_meta_as<V>(a.offsets + at);
        for (int r = 0; r < R; ++r) total[r][h] += a.row_sums[(r0 + r) * a.num_groups + g] * offset;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) store_vec(a.y + (r0 + r) * a.d_out + panel * kPanel + h * kLanes<V>, total[r][h]);
}

// Panel `panel` as float32 [D_in, 16] into `out`: W = q * scale (+ offset), the weight the format
// defines, computed once for all the rows of a long product.
template <int BITS, bool OFFSETS, typename V, typename Meta>
void dequantize_panel(const Operands<Meta>& a, int64_t panel, float* out) {
  const int64_t bytes = a.d_in * kPanel * BITS / 8;
  const uint8_t* values = a.values + panel * bytes;
  for (int64_t g = 0; g < a.num_groups; ++g)
    for (int h = 0; h < kPanel / kLanes<V>; ++h) {
      const int64_t at = (panel * a.num_groups + g) * kPanel + h * kLanes<V>;
      const V scale = load_meta_as<V>(a.scales + at);
      const V offset = OFFSETS ? load_meta_as<V>(a.offsets + at) : V{};
      for (int64_t i = g * a.group; i < (g + 1) * a.group; i += 8 / BITS) {
        if constexpr (BITS == 8) {
          store_vec(out + i * kPanel + h * kLanes<V>, widen_int8(values + i * kPanel + h * kLanes<V>, V{}) * scale + offset);
        } else {  // one byte row: input rows i (the low nibbles) and i + 1 (the high ones)
          V low, whole;
          widen_int4(values + (i / 2) * kPanel + h * kLanes<V>, low, whole);
          const V high = (whole - low) * 0.0625f;  // exact: small integers
          store_vec(out + i * kPanel + h * kLanes<V>, low * scale + offset);
          store_vec(out + (i + 1) * kPanel + h * kLanes<V>, high * scale + offset);
        }
      }
    }
}

// All rows times one panel (two where `two`), one row with both panels at once, more rows panel
// by panel in chunks of at most kChunk8 or kChunk4 rows of sizes as equal as can be (7 rows of
// int8 go as 2 + 2 + 3), in the thread's `direction` (+1: the lower panel first; -1: the higher).
template <int BITS, bool OFFSETS, typename Meta>
void rows_times_panels(const Operands<Meta>& a, int64_t rows, int64_t panel, bool two, int direction) {
  using V = Wide;
  if (rows == 1) {
    if (two)
      chunk<BITS, OFFSETS, 1, 2, 2, V>(a, panel, 0, direction);
    else
      chunk<BITS, OFFSETS, 1, 1, 2, V>(a, panel, 0, direction);
    return;
  }
  constexpr int64_t kMost = BITS == 8 ? kChunk8 : kChunk4;
  const int64_t last = panel + (two ? 1 : 0);
  for (int64_t p = direction > 0 ? panel : last; panel <= p && p <= last; p += direction) {
    const int64_t num_chunks = (rows + kMost - 1) / kMost;
    for (int64_t c = 0, r0 = 0; c < num_chunks; ++c) {
      const int64_t size = (rows - r0) / (num_chunks - c);
      switch (size) {
        case 1: chunk<BITS, OFFSETS, 1, 1, 2, V>(a, p, r0, c == 0 ? direction : 0); break;
        case 2: chunk<BITS, OFFSETS, 2, 1, 2, V>(a, p, r0, c == 0 ? direction : 0); break;
        default: chunk<BITS, OFFSETS, 3, 1, 1, V>(a, p, r0, c == 0 ? direction : 0); break;
      }
      r0 += size;
    }
  }
}

// The sum of x[0 .. n), eight lanes at a time (one float chain of 576 additions alone took about
// 0.5 us, a tenth of a short product).
inline float sum_of(const float* x, int64_t n) {
  Vec8 lanes{};
  int64_t i = 0;
  for (; i + kHalf <= n; i += kHalf) lanes += load8(x + i);
  float sum = 0.0f;
  for (int j = 0; j < kHalf; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += x[i];
  return sum;
}

// x as the kernel reads it (4-bit: pairs combined) and its sums over each group (offsets only),
// into `buffer`; the Operands that use them.
template <int BITS, bool OFFSETS, typename Meta>
Operands<Meta> prepare(const float* x, const uint8_t* values, const Meta* scales, const Meta* offsets, float* y,
                       int64_t rows, int64_t d_in, int64_t num_groups, int64_t d_out, std::vector<float>& buffer) {
  const int64_t group = d_in / num_groups;
  buffer.assign((BITS == 4 ? rows * d_in : 0) + (OFFSETS ? rows * num_groups : 0), 0.0f);
  float* combined = buffer.data();
  float* row_sums = buffer.data() + (BITS == 4 ? rows * d_in : 0);
  if (BITS == 4) combine_pairs(x, combined, rows * d_in);
  if (OFFSETS)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < num_groups; ++g) row_sums[r * num_groups + g] = sum_of(x + r * d_in + g * group, group);
  return Operands<Meta>{BITS == 4 ? combined : x, row_sums, values, scales, offsets, y, d_in, group, num_groups, d_out};
}

// Checks the operands' shapes and types and runs the product on the calling thread and XLA's
// intra-op pool. `offsets`: null without offsets.
template <int BITS, bool OFFSETS>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& values, ffi::AnyBuffer& scales,
               ffi::AnyBuffer* offsets, ffi::Buffer<ffi::F32>& norm, ffi::Buffer<ffi::F32>& residual,
               float eps, ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions();
  const auto vd = values.dimensions();
  const auto sd = scales.dimensions();
  const auto type = BITS == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  const auto meta = scales.element_type();
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 3 || values.element_type() != type ||
      (meta != ffi::DataType::F32 && meta != ffi::DataType::F16) || vd[2] != kPanel || sd[2] != kPanel ||
      vd[1] * (8 / BITS) != xd[1] || sd[0] != vd[0] || sd[1] < 1 || xd[1] % sd[1] ||
      (BITS == 4 && (xd[1] / sd[1]) % 2))
    return ffi::Error::InvalidArgument(
        "quantized_panel_matmul: expected x [T, D_in] float32, values [P, D_in, 16] int8 or "
        "[P, D_in / 2, 16] uint8, scales (and offsets) [P, G, 16] float32 or float16 with G groups "
        "dividing D_in (of an even size for 4-bit)");
  if (offsets) {
    const auto od = offsets->dimensions();
    if (od.size() != 3 || od[0] != sd[0] || od[1] != sd[1] || od[2] != sd[2] || offsets->element_type() != meta)
      return ffi::Error::InvalidArgument("quantized_panel_matmul: offsets and scales differ in shape or type");
  }
  const int64_t rows = xd[0], d_in = xd[1], num_panels = vd[0], num_groups = sd[1];
  specjax::Around around;
  if (auto error = specjax::read_around(norm, residual, eps, rows, d_in, num_panels * kPanel, around);
      error.failure())
    return error;
  std::vector<float> normed;  // the normed rows (a prefill's too: not kept after the call)
  const float* xs = around.input(x.typed_data(), rows, d_in, normed);
  const auto* v = static_cast<const uint8_t*>(values.untyped_data());
  auto product = [&](auto meta_type) {
    using Meta = decltype(meta_type);
    const auto* s = static_cast<const Meta*>(scales.untyped_data());
    const auto* o = offsets ? static_cast<const Meta*>(offsets->untyped_data()) : nullptr;
    const int64_t num_pairs = (num_panels + 1) / 2;  // the units of work (run_from_both_ends)
    const int64_t d_out = num_panels * kPanel;
    if (rows >= kDequantizeRows<BITS>) {  // each pair of panels dequantized, then the float32 loops
      const Operands<Meta> a{xs, nullptr, v, s, o, y->typed_data(), d_in, d_in / num_groups, num_groups, d_out};
      specjax::run_from_both_ends(pool, num_pairs, [=](int64_t pair, int) {
        // Each thread's scratch (two panels' floats), kept between calls rather than allocated
        // and zeroed for every pair.
        thread_local std::vector<float> scratch;
        if (scratch.size() < size_t(2 * d_in * kPanel)) scratch.resize(2 * d_in * kPanel);
        const int64_t p = 2 * pair;
        const bool two = p + 1 < num_panels;
        dequantize_panel<BITS, OFFSETS, Wide>(a, p, scratch.data());
        if (two) dequantize_panel<BITS, OFFSETS, Wide>(a, p + 1, scratch.data() + d_in * kPanel);
        specjax::float_panel_rows(a.x, scratch.data(), a.y, rows, d_in, d_out, p * kPanel, two);
      });
      return;
    }
    std::vector<float> buffer;
    const auto a = prepare<BITS, OFFSETS>(xs, v, s, o, y->typed_data(), rows, d_in, num_groups, d_out, buffer);
    specjax::run_from_both_ends(pool, num_pairs, [=](int64_t pair, int direction) {
      rows_times_panels<BITS, OFFSETS>(a, rows, 2 * pair, 2 * pair + 1 < num_panels, direction);
    });
  };
  if (meta == ffi::DataType::F16)
    product(Half{});
  else
    product(float{});
  around.finish(y->typed_data(), rows, num_panels * kPanel);
  return ffi::Error::Success();
}

// The handlers: x, the weight's arrays, then norm and residual (specjax::Around; empty where not
// asked for), and the norm's eps.
template <int BITS>
ffi::Error Plain(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                 ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y,
                 float eps) {
  return Run<BITS, false>(pool, x, values, scales, nullptr, norm, residual, eps, y);
}

template <int BITS>
ffi::Error WithOffsets(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                       ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::Buffer<ffi::F32> norm,
                       ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y, float eps) {
  return Run<BITS, true>(pool, x, values, scales, &offsets, norm, residual, eps, y);
}

}  // namespace

#define SPECJAX_PLAIN(name, bits)                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Plain<bits>,               \
                                ffi::Ffi::Bind()                 \
                                    .Ctx<ffi::ThreadPool>()      \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<float>("eps"));
#define SPECJAX_WITH_OFFSETS(name, bits)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, WithOffsets<bits>,         \
                                ffi::Ffi::Bind()                 \
                                    .Ctx<ffi::ThreadPool>()      \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<float>("eps"));

SPECJAX_PLAIN(QuantMatmulInt8, 8)
SPECJAX_WITH_OFFSETS(QuantMatmulInt8Offsets, 8)
SPECJAX_PLAIN(QuantMatmulInt4, 4)
SPECJAX_WITH_OFFSETS(QuantMatmulInt4Offsets, 4)
