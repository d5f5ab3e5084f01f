// zeroth: fused exact perturbation replay on CPU, as an XLA FFI custom call.
//
// Applies K updates (leaf key, scale) to one leaf (ZerothPerturb), or to every leaf of a replay in
// one launch (ZerothPerturbTree, which derives the leaf keys from the sample keys and leaf ids;
// ZerothPerturbFlat, the same over the segments of one flat buffer),
// in canonical order with the exact rule of zeroth's determinism contract:
//
//   p32 = flush(float32(x))
//   for u in 0..K-1:  p32 = flush(p32 + scale[u] * k_u[i])      (scale * k exact)
//   out = flush_cast(p32, dtype(x))
//
// where k_u[i] is the integer noise of element i (its GLOBAL flat index, offset + position):
//   binomial:   threefry call i >> 2, word x0 if (i & 2) == 0 else x1, 16-bit half i & 1,
//               k = popcount(half) - 8
//   rademacher: threefry call i >> 6, word x0 if (i & 32) == 0 else x1, bit i & 31,
//               k = +1 if set else -1
// on the leaf key (k0, k1), counter (0, call). Everything before the add is integer
// arithmetic and the product is exact, so every ISA (and every compiler flag short of
// -ffast-math) gives the same bits; zeroth's tests compare this file against the NumPy
// reference bit for bit.
//
// Work is done per cache-resident tile of kTile elements, aligned to global multiples of kTile:
// a tile is read once, receives all K updates, and is written once. With AVX-512 (F, BW, DQ;
// BITALG used when present) threefry runs 16 calls per register and the noise never leaves
// registers: vpopcntw, a vpermt2w to put halves in element order and a vpermt2ps table lookup of
// scale * (c - 8) for binomial, each group of 64 elements held in registers through all K
// updates, whose threefry chains run four at a time, interleaved (four updates of a group, or
// with K < 4 one update of four groups); the 16-bit halves of the words used directly as blend
// masks for Rademacher; vfpclassps for the flush. With AVX2 alone, binomial threefry runs 8 calls
// per register, four chains interleaved (rotations by 16 and 24 as byte shuffles), popcounts by a
// nibble table (vpshufb), put in element order by unpacks that also make each the float32
// 2^23 + c, and added to the tile in L1; Rademacher moves each bit to a sign bit (vpsllvd) that
// selects +scale or -scale (vblendvps); a whole float32 tile is read from the input and flushed
// on load (where the first update's scale is so small that a subnormal could change a sum: Update)
// and on store in registers, the store's flush and NaN canonicalization from one magnitude.
// Elsewhere plain loops that the compiler vectorizes for its target (the word stream of a tile
// into a small buffer, then an elementwise pass).
//
// A launch's host cost does not grow with its leaves: the leaf keys of all leaves and the K
// scales' lookup tables are built once per launch into a few arrays (no allocation per leaf).
// Small work runs on the calling thread; above kParallelWork element-updates the tiles are cut
// into chunks of about equal work (many small leaves share one) that XLA's CPU thread pool and
// the calling thread claim in order, and the launch completes when its last chunk does.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(ZEROTH_GRADUAL_UNDERFLOW) && (defined(__x86_64__) || defined(__i386__))
#include <xmmintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 4096;          // elements per tile (multiple of 1024)
constexpr int64_t kBinomialGroup = 64;   // elements per 16 threefry calls
constexpr int64_t kRademacherGroup = 1024;
constexpr int kGroupChains = 4;  // binomial groups whose threefry chains run interleaved when K < 4
constexpr int64_t kParallelWork = int64_t{1} << 18;  // element-updates before using threads
constexpr uint32_t kParity = 0x1BD11BDAu;
constexpr uint32_t kCanonicalNan = 0x7FC00000u;

enum Distribution : int32_t { kBinomial = 0, kRademacher = 1 };

// XLA's CPU runtime runs every op, this kernel included, with the x86 flush-to-zero and
// denormals-are-zero modes on, which would hide a missing flush: the kernel's results must come
// from its own flushes (the contract's, written in integer arithmetic), whatever the caller's
// floating-point mode. A test build (-DZEROTH_GRADUAL_UNDERFLOW, x86) runs the kernel's work with
// both modes off, so that its flushes alone must give the specification's bits.
#if defined(ZEROTH_GRADUAL_UNDERFLOW) && (defined(__x86_64__) || defined(__i386__))
struct FloatMode {
  const unsigned saved = _mm_getcsr();
  FloatMode() { _mm_setcsr(saved & ~0x8040u); }  // FTZ (bit 15) and DAZ (bit 6) off
  ~FloatMode() { _mm_setcsr(saved); }
};
constexpr int kGradualUnderflow = 1;
#else
struct FloatMode {};
constexpr int kGradualUnderflow = 0;
#endif

struct LeafKey {
  uint32_t k0, k1, k2;
};

inline LeafKey MakeKey(uint32_t k0, uint32_t k1) { return LeafKey{k0, k1, k0 ^ k1 ^ kParity}; }

// One update's scale, shared by every leaf of a launch, with its binomial lookup table
// table[c] = scale * (c - 8) for c in 0..31 (exact for the popcounts 0..16; built once per launch).
// `wide`: scale is 0 or at least 2^-100 in magnitude, so that every nonzero scale * k is at least
// 2^-100 and a subnormal x (below 2^-126, under a quarter of the spacing of the floats around
// scale * k) gives x + scale * k == scale * k: the same sum as flush(x) + scale * k, and a zero
// scale * k leaves a subnormal that the flush of the sum takes to +0. Where the first update is
// wide the fused AVX2 path adds to the loaded value without flushing it first (on an AMD EPYC with
// AVX-512, binomial K = 1 on 2^24 float32 in place: AVX2 build 4.62-4.80 -> 4.31-4.55 ms; the same
// in the AVX-512 path measured no faster, on 2^18 to 2^24 elements, and is left as it was).
struct alignas(64) Update {
  float table[32];
  float scale;
  bool wide;
};

inline Update MakeUpdate(float scale) {
  Update up;
  for (int c = 0; c < 32; ++c) up.table[c] = scale * static_cast<float>(c - 8);
  up.scale = scale;
  const float magnitude = scale < 0 ? -scale : scale;
  up.wide = scale == 0 || magnitude >= 0x1p-100f;
  return up;
}

// ---------------------------------------------------------------- threefry-2x32, 20 rounds

#define ZR(x0, x1, r)                  \
  do {                                 \
    x0 += x1;                          \
    x1 = (x1 << r) | (x1 >> (32 - r)); \
    x1 ^= x0;                          \
  } while (0)

#define ZBLOCK(x0, x1, ra, rb, rc, rd, ka, kb, inj) \
  do {                                             \
    ZR(x0, x1, ra);                                \
    ZR(x0, x1, rb);                                \
    ZR(x0, x1, rc);                                \
    ZR(x0, x1, rd);                                \
    x0 += ka;                                      \
    x1 += kb + (inj);                              \
  } while (0)

// Works for uint32_t and v16u alike (scalar key words broadcast).
template <typename T>
inline void Threefry(const LeafKey& k, T c1, T& out0, T& out1) {
  T x0 = T{} + k.k0;
  T x1 = c1 + k.k1;
  ZBLOCK(x0, x1, 13, 15, 26, 6, k.k1, k.k2, 1u);
  ZBLOCK(x0, x1, 17, 29, 16, 24, k.k2, k.k0, 2u);
  ZBLOCK(x0, x1, 13, 15, 26, 6, k.k0, k.k1, 3u);
  ZBLOCK(x0, x1, 17, 29, 16, 24, k.k1, k.k2, 4u);
  ZBLOCK(x0, x1, 13, 15, 26, 6, k.k2, k.k0, 5u);
  out0 = x0;
  out1 = x1;
}

#undef ZBLOCK
#undef ZR

// ---------------------------------------------------------------- exact float helpers

inline uint32_t AsBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float AsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The contract's flush: subnormals and -0 -> +0, NaN -> canonical quiet NaN; infinities kept.
inline float FlushScalar(float x) {
  uint32_t u = AsBits(x);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a < 0x00800000u) u = 0;
  if (a > 0x7F800000u) u = kCanonicalNan;
  return AsFloat(u);
}

// Inside the update loop only subnormals and -0 need flushing: after the flush on load a NaN is
// canonical, and NaN + finite stays a NaN, which the flush on store canonicalizes again (an
// update's product is finite, so no new NaN can appear).
inline float FlushSubnormal(float x) {
  uint32_t u = AsBits(x);
  return AsFloat((u & 0x7FFFFFFFu) < 0x00800000u ? 0u : u);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define ZEROTH_AVX512 1
#else
#define ZEROTH_AVX512 0
#endif

#if !ZEROTH_AVX512 && defined(__AVX2__)
#define ZEROTH_AVX2 1
#else
#define ZEROTH_AVX2 0
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the word stream is viewed as 16-bit halves");

// Rotation of every 32-bit lane by R (GCC emits vprold with AVX-512). With AVX2 alone a rotation
// is two shifts and an or, the shifts on two ports only; by 16 and 24 it is a byte shuffle instead.
template <int R, typename V>
__attribute__((always_inline)) inline V Rotl(V x) {
  return (x << R) | (x >> (32 - R));
}

#if ZEROTH_AVX2
typedef uint32_t v8u __attribute__((vector_size(32)));

template <int R>
__attribute__((always_inline)) inline v8u RotlBytes(v8u x) {
  static_assert(R == 16 || R == 24, "byte rotations only");
  const __m256i order = R == 16 ? _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                                   2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
                                : _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12,
                                                   1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
  const __m256i y = _mm256_shuffle_epi8(reinterpret_cast<__m256i&>(x), order);
  return reinterpret_cast<const v8u&>(y);
}
template <>
__attribute__((always_inline)) inline v8u Rotl<16, v8u>(v8u x) {
  return RotlBytes<16>(x);
}
template <>
__attribute__((always_inline)) inline v8u Rotl<24, v8u>(v8u x) {
  return RotlBytes<24>(x);
}
#endif

// N independent threefry-2x32 chains (calls[i] under key k[i]: N updates of one group, or one
// update of N groups), round by round, so that the out-of-order core always has other chains'
// work while one waits on the latency of its own rounds. Always inlined: the chains must stay in
// registers. V is a GCC vector of uint32_t (16 lanes with AVX-512, 8 with AVX2).
template <int N, typename V>
__attribute__((always_inline)) inline void ThreefryN(const LeafKey (&k)[N], const V (&calls)[N], V (&x0)[N],
                                                     V (&x1)[N]) {
  for (int i = 0; i < N; ++i) {
    x0[i] = V{} + k[i].k0;
    x1[i] = calls[i] + k[i].k1;
  }
#define ZRN(r)                                                              \
  do {                                                                      \
    for (int i = 0; i < N; ++i) x0[i] += x1[i];                             \
    for (int i = 0; i < N; ++i) x1[i] = Rotl<r>(x1[i]);                     \
    for (int i = 0; i < N; ++i) x1[i] ^= x0[i];                             \
  } while (0)
#define ZBLOCKN(ra, rb, rc, rd, w0, w1, inj) \
  do {                                       \
    ZRN(ra);                                 \
    ZRN(rb);                                 \
    ZRN(rc);                                 \
    ZRN(rd);                                 \
    for (int i = 0; i < N; ++i) {            \
      x0[i] += k[i].w0;                      \
      x1[i] += k[i].w1 + (inj);              \
    }                                        \
  } while (0)
  ZBLOCKN(13, 15, 26, 6, k1, k2, 1u);
  ZBLOCKN(17, 29, 16, 24, k2, k0, 2u);
  ZBLOCKN(13, 15, 26, 6, k0, k1, 3u);
  ZBLOCKN(17, 29, 16, 24, k1, k2, 4u);
  ZBLOCKN(13, 15, 26, 6, k2, k0, 5u);
#undef ZBLOCKN
#undef ZRN
}

// ---------------------------------------------------------------- one update on a range of groups
//
// buf[0..kTile) holds the tile in float32; `first_call` is the threefry call of buf[0] (tiles
// start at global multiples of kTile, so buf[0] starts a call). Each function applies
// p = flush(p + s * k) to groups [g0, g1): 64 elements (binomial) or 1024 (Rademacher), i.e.
// 16 threefry calls per group.

#if ZEROTH_AVX512

typedef uint32_t v16u __attribute__((vector_size(64)));

inline __m512i AsM512i(v16u x) { return reinterpret_cast<__m512i&>(x); }

// Popcount of every 16-bit lane.
inline __m512i Popcount16(__m512i x) {
#if defined(__AVX512BITALG__)
  return _mm512_popcnt_epi16(x);
#else
  const __m512i m1 = _mm512_set1_epi16(0x5555), m2 = _mm512_set1_epi16(0x3333), m4 = _mm512_set1_epi16(0x0F0F);
  x = _mm512_sub_epi16(x, _mm512_and_si512(_mm512_srli_epi16(x, 1), m1));
  x = _mm512_add_epi16(_mm512_and_si512(x, m2), _mm512_and_si512(_mm512_srli_epi16(x, 2), m2));
  x = _mm512_and_si512(_mm512_add_epi16(x, _mm512_srli_epi16(x, 4)), m4);
  return _mm512_and_si512(_mm512_add_epi16(x, _mm512_srli_epi16(x, 8)), _mm512_set1_epi16(0x001F));
#endif
}

// Element e of output vector m (16 elements, calls 4m..4m+3) is half (e & 1) of word x0 or x1
// ((e >> 1) & 1) of call 4m + e/4: the 16-bit lane of concat(popcount(x0), popcount(x1)).
struct alignas(64) BinomialIndex {
  uint16_t v[4][32];
};

constexpr BinomialIndex MakeBinomialIndex() {
  BinomialIndex index{};
  for (int m = 0; m < 4; ++m) {
    for (int e = 0; e < 16; ++e) {
      const int call = 4 * m + e / 4;
      const uint16_t lane16 = static_cast<uint16_t>(((e >> 1) & 1) * 32 + 2 * call + (e & 1));
      index.v[m][2 * e] = lane16;
      index.v[m][2 * e + 1] = lane16;
    }
  }
  return index;
}

constexpr BinomialIndex kBinomialIndex = MakeBinomialIndex();

// Adds the update and flushes subnormals / -0 (vfpclassps: denormal 0x20 | negative zero 0x04).
__attribute__((always_inline)) inline __m512 AddFlush(__m512 p, __m512 delta) {
  const __m512 y = _mm512_add_ps(p, delta);
  return _mm512_mask_mov_ps(y, _mm512_fpclass_ps_mask(y, 0x24), _mm512_setzero_ps());
}

struct BinomialLookup {
  __m512i i0, i1, i2, i3;  // kBinomialIndex
};


// The popcounts of one group's 16 calls added to its 64 elements in element order. This and the
// helpers below are always inlined: outlined (as GCC did once BinomialGroupsAll had two
// instantiations), a group's registers went through memory at every update and K = 16 and 64 took 9-13%
// longer.
__attribute__((always_inline)) inline void BinomialApply(v16u x0, v16u x1, __m512 t_lo, __m512 t_hi,
                                                         const BinomialLookup& ix, __m512 (&p)[4]) {
  const __m512i c0 = Popcount16(AsM512i(x0)), c1 = Popcount16(AsM512i(x1));
  p[0] = AddFlush(p[0], _mm512_permutex2var_ps(t_lo, _mm512_permutex2var_epi16(c0, ix.i0, c1), t_hi));
  p[1] = AddFlush(p[1], _mm512_permutex2var_ps(t_lo, _mm512_permutex2var_epi16(c0, ix.i1, c1), t_hi));
  p[2] = AddFlush(p[2], _mm512_permutex2var_ps(t_lo, _mm512_permutex2var_epi16(c0, ix.i2, c1), t_hi));
  p[3] = AddFlush(p[3], _mm512_permutex2var_ps(t_lo, _mm512_permutex2var_epi16(c0, ix.i3, c1), t_hi));
}

// Updates u..u+N-1 of one group held in p[0..3], in order: p = flush(p + scale * (popcount - 8)),
// element order. Their noise is N independent threefry chains, computed interleaved.
template <int N>
__attribute__((always_inline)) inline void BinomialUpdates(const Update* ups, const uint32_t* k0, const uint32_t* k1,
                                                           int64_t stride, int64_t u, v16u calls,
                                                           const BinomialLookup& ix, __m512 (&p)[4]) {
  LeafKey keys[N];
  v16u same[N], x0[N], x1[N];
  for (int i = 0; i < N; ++i) {
    keys[i] = MakeKey(k0[(u + i) * stride], k1[(u + i) * stride]);
    same[i] = calls;
  }
  ThreefryN<N>(keys, same, x0, x1);
  for (int i = 0; i < N; ++i) {
    BinomialApply(x0[i], x1[i], _mm512_load_ps(ups[u + i].table), _mm512_load_ps(ups[u + i].table + 16), ix, p);
  }
}

// Update u of groups g..g+N-1 (N groups of 64 elements held in p[N][4]): their noise is N
// independent threefry chains (consecutive calls under one key), computed interleaved.
template <int N>
__attribute__((always_inline)) inline void BinomialGroupsUpdate(const LeafKey& key, const Update& up, v16u calls,
                                                                const BinomialLookup& ix, __m512 (&p)[N][4]) {
  LeafKey keys[N];
  v16u c[N], x0[N], x1[N];
  for (int i = 0; i < N; ++i) {
    keys[i] = key;
    c[i] = calls + static_cast<uint32_t>(16 * i);
  }
  ThreefryN<N>(keys, c, x0, x1);
  const __m512 t_lo = _mm512_load_ps(up.table), t_hi = _mm512_load_ps(up.table + 16);
  for (int i = 0; i < N; ++i) BinomialApply(x0[i], x1[i], t_lo, t_hi, ix, p[i]);
}

// The contract's flush of 16 float32 (FlushScalar in a register): subnormals and -0 to +0
// (vfpclassps: denormal 0x20 | negative zero 0x04), NaN to the canonical quiet NaN.
__attribute__((always_inline)) inline __m512 Flush16(__m512 x) {
  x = _mm512_mask_mov_ps(x, _mm512_fpclass_ps_mask(x, 0x24), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                            _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kCanonicalNan))));
}

// Loads 16 elements of src (flushed when kFlushIo: the float32 tile read straight from the input,
// the contract's flush on load done in registers instead of a pass of its own).
template <bool kFlushIo>
__attribute__((always_inline)) inline __m512 LoadGroup(const float* src) {
  const __m512 x = _mm512_loadu_ps(src);
  return kFlushIo ? Flush16(x) : x;
}

// Stores 16 elements (flushed when kFlushIo: the contract's flush on store, in registers).
template <bool kFlushIo>
__attribute__((always_inline)) inline void StoreGroup(float* dst, __m512 x) {
  _mm512_storeu_ps(dst, kFlushIo ? Flush16(x) : x);
}

// All K binomial updates on groups [g0, g1): a group's 64 elements stay in four registers through
// its K updates (one load and one store per group, not per update, and no call per update: a small
// leaf costs its arithmetic), whose noise is computed four updates at a time: four independent
// threefry chains, interleaved, keep the vector units busy where one chain would wait on the
// latency of its own rounds (then two, then one for the K mod 4 left). With fewer than four
// updates the chains run over four groups at a time instead (one update of 256 elements).
// up.table[c] = scale * (c - 8) for a popcount c in 0..16 (exact) is looked up by vpermt2ps,
// which reads the low 5 bits of each 32-bit index. Key u is (k0[u * stride], k1[u * stride]).
// Groups are read from src and written to buf (the same array but for a float32 tile updated
// from the input into the output); with kFlushIo the flushes on load and store happen here.
template <bool kFlushIo>
void BinomialGroupsAll(const float* src, float* buf, const Update* ups, const uint32_t* k0, const uint32_t* k1,
                       int64_t stride, int64_t n_updates, uint32_t first_call, int64_t g0, int64_t g1) {
  const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const BinomialLookup ix = {_mm512_load_si512(kBinomialIndex.v[0]), _mm512_load_si512(kBinomialIndex.v[1]),
                             _mm512_load_si512(kBinomialIndex.v[2]), _mm512_load_si512(kBinomialIndex.v[3])};
  if (n_updates == 0) return;
  int64_t g = g0;
  if (n_updates < 4) {  // few updates: the chains run over groups instead, kGroupChains at a time
    for (; g + kGroupChains <= g1; g += kGroupChains) {
      const float* r = src + 64 * g;
      float* q = buf + 64 * g;
      __m512 p[kGroupChains][4];
      for (int i = 0; i < kGroupChains; ++i) {
        for (int j = 0; j < 4; ++j) p[i][j] = LoadGroup<kFlushIo>(r + 64 * i + 16 * j);
      }
      const v16u calls = lane + (first_call + static_cast<uint32_t>(16 * g));
      for (int64_t u = 0; u < n_updates; ++u) {
        BinomialGroupsUpdate<kGroupChains>(MakeKey(k0[u * stride], k1[u * stride]), ups[u], calls, ix, p);
      }
      for (int i = 0; i < kGroupChains; ++i) {
        for (int j = 0; j < 4; ++j) StoreGroup<kFlushIo>(q + 64 * i + 16 * j, p[i][j]);
      }
    }
  }
  for (; g < g1; ++g) {
    const float* r = src + 64 * g;
    float* q = buf + 64 * g;
    __m512 p[4] = {LoadGroup<kFlushIo>(r), LoadGroup<kFlushIo>(r + 16), LoadGroup<kFlushIo>(r + 32),
                   LoadGroup<kFlushIo>(r + 48)};
    const v16u calls = lane + (first_call + static_cast<uint32_t>(16 * g));
    int64_t u = 0;
    for (; u + 4 <= n_updates; u += 4) BinomialUpdates<4>(ups, k0, k1, stride, u, calls, ix, p);
    if (u + 2 <= n_updates) {
      BinomialUpdates<2>(ups, k0, k1, stride, u, calls, ix, p);
      u += 2;
    }
    if (u < n_updates) BinomialUpdates<1>(ups, k0, k1, stride, u, calls, ix, p);
    StoreGroup<kFlushIo>(q, p[0]);
    StoreGroup<kFlushIo>(q + 16, p[1]);
    StoreGroup<kFlushIo>(q + 32, p[2]);
    StoreGroup<kFlushIo>(q + 48, p[3]);
  }
}

// One Rademacher update on groups [g0, g1) of 1024 elements, read from src and written to buf
// (the same array but for a float32 tile updated from the input into the output; with kFlushIo
// the flushes on load and store happen here, as for BinomialGroupsAll).
template <bool kFlushIo>
void RademacherGroups(const float* src, float* buf, const LeafKey& key, const Update& up, uint32_t first_call,
                      int64_t g0, int64_t g1) {
  const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512 plus = _mm512_set1_ps(up.scale), minus = _mm512_set1_ps(-up.scale);
  alignas(64) uint16_t halves[64];  // the 32 words of 16 calls as 16-bit masks, stream order
  for (int64_t g = g0; g < g1; ++g) {
    v16u calls = lane + (first_call + static_cast<uint32_t>(16 * g));
    v16u x0, x1;
    Threefry(key, calls, x0, x1);
    v16u a = __builtin_shufflevector(x0, x1, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    v16u b = __builtin_shufflevector(x0, x1, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(halves, &a, 64);
    std::memcpy(halves + 32, &b, 64);
    const float* r = src + 1024 * g;
    float* p = buf + 1024 * g;
    for (int h = 0; h < 64; ++h) {
      const __m512 delta = _mm512_mask_blend_ps(static_cast<__mmask16>(halves[h]), minus, plus);
      StoreGroup<kFlushIo>(p + 16 * h, AddFlush(LoadGroup<kFlushIo>(r + 16 * h), delta));
    }
  }
}

#else  // portable: plain loops the compiler vectorizes for the target (SSE, AVX2, NEON, ...)

#if ZEROTH_AVX2

// AVX2 without AVX-512 (x86-64-v3: AMD EPYC before Zen 4, most Intel client CPUs): the noise in
// registers. The plain loops below, which write a tile's word stream to memory and then make a
// pass over it, measured on a 2-core AMD EPYC with the kernel built for -march=x86-64-v3 (in
// place, 2^22 float32): binomial K = 1 2.00 ms, K = 16 24.8 ms, Rademacher 0.66 and 4.19; this
// path 1.02 and 14.9, 0.37 and 3.5 (AVX-512 on the same CPU: 0.48 and 4.9, 0.32 and 2.2). The
// trainer's SmolLM2-135M ZO step (8 x 40 tokens, XLA held to AVX2 too) took 1.46-1.54 two forwards
// with the plain loops, 1.26-1.29 with this path.

inline __m256i AsM256i(v8u x) { return reinterpret_cast<__m256i&>(x); }

// Threefry calls first_call + 16 g + [0, 8 N) under `key` (group g's 16 calls and on): chain i
// holds calls 8 i .. 8 i + 7, the N chains computed interleaved.
template <int N>
__attribute__((always_inline)) inline void CallWords(const LeafKey& key, uint32_t first_call, int64_t g, v8u (&x0)[N],
                                                     v8u (&x1)[N]) {
  const v8u base = v8u{0, 1, 2, 3, 4, 5, 6, 7} + (first_call + static_cast<uint32_t>(16 * g));
  LeafKey keys[N];
  v8u calls[N];
  for (int i = 0; i < N; ++i) {
    keys[i] = key;
    calls[i] = base + static_cast<uint32_t>(8 * i);
  }
  ThreefryN<N>(keys, calls, x0, x1);
}

// Popcount of every 16-bit lane: a nibble table (vpshufb) per byte, the two bytes added by vpmaddubsw.
__attribute__((always_inline)) inline __m256i Popcount16x16(__m256i x) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                                         0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(x, nibble));
  const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble));
  return _mm256_maddubs_epi16(_mm256_add_epi8(lo, hi), _mm256_set1_epi8(1));
}

// Subnormals and -0 of 8 float32 to +0, by an integer compare of the magnitude's bits.
__attribute__((always_inline)) inline __m256 FlushSubnormal8(__m256 x) {
  const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), magnitude)), x);
}

// FlushSubnormal8, and every NaN to the canonical quiet NaN (a magnitude above infinity's): the
// contract's flush on store, one magnitude for both.
__attribute__((always_inline)) inline __m256 FlushCanonical8(__m256 x) {
  const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
  x = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), magnitude)), x);
  return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kCanonicalNan))),
                          _mm256_castsi256_ps(nan));
}

// dst = flush(src + delta) for 8 elements (subnormals and -0 to +0: FlushSubnormal8). kLoad /
// kStore: the contract's flushes on load and store, done here in registers, each with only what
// the update leaves to it. On load, subnormals and -0 to +0 (a NaN
// keeps its payload until the store: it reaches no other element); on store, NaN to the canonical
// quiet NaN (the sum's subnormals and -0 are flushed already, and an update's delta is finite, so
// no NaN appears that was not loaded).
template <bool kLoad, bool kStore>
__attribute__((always_inline)) inline void Add8(const float* src, float* dst, __m256 delta) {
  __m256 p = _mm256_loadu_ps(src);
  if (kLoad) p = FlushSubnormal8(p);
  const __m256 z = _mm256_add_ps(p, delta);
  _mm256_storeu_ps(dst, kStore ? FlushCanonical8(z) : FlushSubnormal8(z));
}

// Add8 of scale * (c - 8) for 8 elements whose popcounts c come as the float32 2^23 + c (the
// product of the lookup table, exact: (2^23 + c) - (2^23 + 8) = c - 8 is exact).
template <bool kLoad, bool kStore>
__attribute__((always_inline)) inline void AddCounts(const float* src, float* dst, __m256 counts, __m256 scale) {
  const __m256 k = _mm256_sub_ps(counts, _mm256_set1_ps(8388616.0f));
  Add8<kLoad, kStore>(src, dst, _mm256_mul_ps(scale, k));
}

// The noise of 8 consecutive calls (x0, x1) added to their 32 elements in element order (read from
// src, written to dst): element 4j + h is 16-bit half h & 1 of word x0 (h < 2) or x1 of call j.
// Call j's four popcounts (64 bits) are the 32-bit lanes j of the two popcount vectors, interleaved;
// the calls are then arranged as [0, 2 | 1, 3] and [4, 6 | 5, 7] (64-bit units), so that each
// 128-bit half's popcounts, unpacked as the low 16 bits of a float32 whose high bits make it
// 2^23 + c, give elements 0..7, 8..15, 16..23 and 24..31 in order.
template <bool kLoad, bool kStore>
__attribute__((always_inline)) inline void BinomialApply8(v8u x0, v8u x1, __m256 scale, const float* src, float* dst) {
  const __m256i c0 = Popcount16x16(AsM256i(x0)), c1 = Popcount16x16(AsM256i(x1));
  const __m256i lo = _mm256_unpacklo_epi32(c0, c1), hi = _mm256_unpackhi_epi32(c0, c1);  // [0, 1 | 4, 5], [2, 3 | 6, 7]
  const __m256i even = _mm256_unpacklo_epi64(lo, hi), odd = _mm256_unpackhi_epi64(lo, hi);  // [0, 2 | 4, 6], [1, 3 | 5, 7]
  const __m256i first = _mm256_permute2x128_si256(even, odd, 0x20);   // [0, 2 | 1, 3]
  const __m256i second = _mm256_permute2x128_si256(even, odd, 0x31);  // [4, 6 | 5, 7]
  const __m256i magic = _mm256_set1_epi16(0x4B00);
  AddCounts<kLoad, kStore>(src, dst, _mm256_castsi256_ps(_mm256_unpacklo_epi16(first, magic)), scale);
  AddCounts<kLoad, kStore>(src + 8, dst + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(first, magic)), scale);
  AddCounts<kLoad, kStore>(src + 16, dst + 16, _mm256_castsi256_ps(_mm256_unpacklo_epi16(second, magic)), scale);
  AddCounts<kLoad, kStore>(src + 24, dst + 24, _mm256_castsi256_ps(_mm256_unpackhi_epi16(second, magic)), scale);
}

// One update on groups [g0, g1) (64 elements, 16 calls each), read from src and written to dst
// (the same array but for the first update of a float32 tile read from the input; kLoad / kStore:
// the flushes on load and store, see Add8): two groups at a time as four interleaved chains of
// 8 calls, then a last group as two.
template <bool kLoad, bool kStore>
void BinomialGroups(const float* src, float* dst, const LeafKey& key, const Update& up, uint32_t first_call,
                    int64_t g0, int64_t g1) {
  const __m256 scale = _mm256_set1_ps(up.scale);
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) {
    v8u x0[4], x1[4];
    CallWords<4>(key, first_call, g, x0, x1);
    for (int i = 0; i < 4; ++i) {
      BinomialApply8<kLoad, kStore>(x0[i], x1[i], scale, src + 64 * g + 32 * i, dst + 64 * g + 32 * i);
    }
  }
  if (g < g1) {
    v8u x0[2], x1[2];
    CallWords<2>(key, first_call, g, x0, x1);
    for (int i = 0; i < 2; ++i) {
      BinomialApply8<kLoad, kStore>(x0[i], x1[i], scale, src + 64 * g + 32 * i, dst + 64 * g + 32 * i);
    }
  }
}

// One update on groups [g0, g1) of buf, in place (the flushes on load and store done by their passes).
inline void BinomialGroups(float* buf, const LeafKey& key, const Update& up, uint32_t first_call, int64_t g0,
                           int64_t g1) {
  BinomialGroups<false, false>(buf, buf, key, up, first_call, g0, g1);
}

// Add8 of +scale where bit b of `word` is set, else -scale, for the 32 elements b = 0..31: each
// bit moved to the sign bit (vpsllvd) selects one of the two (vblendvps).
template <bool kLoad, bool kStore>
__attribute__((always_inline)) inline void AddSigns(const float* src, float* dst, __m256i word, __m256 plus,
                                                    __m256 minus) {
  const __m256i top = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
  for (int q = 0; q < 4; ++q) {
    const __m256i bits = _mm256_sllv_epi32(word, _mm256_sub_epi32(top, _mm256_set1_epi32(8 * q)));
    Add8<kLoad, kStore>(src + 8 * q, dst + 8 * q, _mm256_blendv_ps(minus, plus, _mm256_castsi256_ps(bits)));
  }
}

// One Rademacher update on groups [g0, g1) of 1024 elements (16 calls: call j's x0 gives elements
// 64j + b, its x1 64j + 32 + b, b = bit), read from src and written to dst, as BinomialGroups.
template <bool kLoad, bool kStore>
void RademacherGroups(const float* src, float* dst, const LeafKey& key, const Update& up, uint32_t first_call,
                      int64_t g0, int64_t g1) {
  const __m256 plus = _mm256_set1_ps(up.scale), minus = _mm256_set1_ps(-up.scale);
  for (int64_t g = g0; g < g1; ++g) {
    v8u x0[2], x1[2];
    CallWords<2>(key, first_call, g, x0, x1);
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 8; ++c) {
        const int64_t e = 1024 * g + 64 * (8 * h + c);
        const __m256i which = _mm256_set1_epi32(c);
        AddSigns<kLoad, kStore>(src + e, dst + e, _mm256_permutevar8x32_epi32(AsM256i(x0[h]), which), plus, minus);
        AddSigns<kLoad, kStore>(src + e + 32, dst + e + 32, _mm256_permutevar8x32_epi32(AsM256i(x1[h]), which), plus,
                                minus);
      }
    }
  }
}

// One Rademacher update on groups [g0, g1) of buf, in place.
inline void RademacherGroups(float* buf, const LeafKey& key, const Update& up, uint32_t first_call, int64_t g0,
                             int64_t g1) {
  RademacherGroups<false, false>(buf, buf, key, up, first_call, g0, g1);
}

#else

// The word stream of calls [first, first + n_calls): words[2j] = x0, words[2j + 1] = x1.
inline void StreamWords(const LeafKey& key, uint32_t first, int64_t n_calls, uint32_t* words) {
  for (int64_t j = 0; j < n_calls; ++j) {
    uint32_t x0, x1;
    Threefry(key, first + static_cast<uint32_t>(j), x0, x1);
    words[2 * j] = x0;
    words[2 * j + 1] = x1;
  }
}

inline uint32_t Popcount16(uint32_t h) {
  h = h - ((h >> 1) & 0x5555u);
  h = (h & 0x3333u) + ((h >> 2) & 0x3333u);
  h = (h + (h >> 4)) & 0x0F0Fu;
  return (h + (h >> 8)) & 0x1Fu;
}

void BinomialGroups(float* buf, const LeafKey& key, const Update& up, uint32_t first_call, int64_t g0, int64_t g1) {
  const float scale = up.scale;
  alignas(64) uint32_t words[2 * kTile / 4];
  const int64_t n_calls = 16 * (g1 - g0);
  StreamWords(key, first_call + static_cast<uint32_t>(16 * g0), n_calls, words);
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(words);  // element e <-> half e
  float* p = buf + 64 * g0;
  for (int64_t e = 0; e < 4 * n_calls; ++e) {
    const int32_t k = static_cast<int32_t>(Popcount16(halves[e])) - 8;
    p[e] = FlushSubnormal(p[e] + scale * static_cast<float>(k));
  }
}

void RademacherGroups(float* buf, const LeafKey& key, const Update& up, uint32_t first_call, int64_t g0, int64_t g1) {
  const float scale = up.scale;
  alignas(64) uint32_t words[2 * kTile / 64];
  const int64_t n_calls = 16 * (g1 - g0);
  StreamWords(key, first_call + static_cast<uint32_t>(16 * g0), n_calls, words);
  const uint32_t s_bits = AsBits(scale);
  float* p = buf + 1024 * g0;
  for (int64_t w = 0; w < 2 * n_calls; ++w) {
    const uint32_t word = words[w];
    float* q = p + 32 * w;
    for (int b = 0; b < 32; ++b) {
      // bit set -> +scale, clear -> -scale: flip the sign bit of scale.
      const uint32_t flip = (~(word >> b) & 1u) << 31;
      q[b] = FlushSubnormal(q[b] + AsFloat(s_bits ^ flip));
    }
  }
}

#endif

#endif

// ---------------------------------------------------------------- dtype conversion

template <typename T>
struct Io;

template <>
struct Io<float> {
  static void Load(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FlushScalar(src[i]);
  }
  // flush_cast to float32: subnormals are already flushed; canonicalize NaN.
  static void Store(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FlushScalar(src[i]);
  }
};

struct Bf16 {
  uint16_t bits;
};

template <>
struct Io<Bf16> {
  static void Load(const Bf16* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(src[i].bits) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      dst[i] = FlushScalar(f);
    }
  }
  // Round to nearest even; NaN (canonical after flush) -> 0x7FC0; then flush bf16 subnormals/-0.
  static void Store(const float* src, Bf16* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &src[i], 4);
      uint32_t a = u & 0x7FFFFFFFu;
      uint16_t h;
      if (a > 0x7F800000u) {
        h = 0x7FC0u;  // canonical quiet NaN
      } else {
        h = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      }
      if ((h & 0x7FFFu) < 0x0080u) h = 0;
      dst[i].bits = h;
    }
  }
};

template <>
struct Io<_Float16> {
  static void Load(const _Float16* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FlushScalar(static_cast<float>(src[i]));
  }
  // IEEE round to nearest even, then flush float16 subnormals and -0 to +0.
  static void Store(const float* src, _Float16* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      _Float16 h = static_cast<_Float16>(src[i]);
      uint16_t b;
      std::memcpy(&b, &h, 2);
      if ((b & 0x7FFFu) < 0x0400u) b = 0;
      if ((b & 0x7FFFu) > 0x7C00u) b = 0x7E00u;
      std::memcpy(&dst[i], &b, 2);
    }
  }
};

// ---------------------------------------------------------------- the tiled driver

struct Work;
struct Job;
using TileFn = void (*)(const Work&, const Job&, int64_t, int64_t);

// One leaf (or segment, or slice) of a launch. Its K leaf keys live in the launch's Work (no
// allocation per leaf): key u of job j is (work.k0[u * J + j], work.k1[u * J + j]).
struct Job {
  const void* in;
  void* out;
  int64_t n;        // elements
  uint64_t offset;  // global flat index of element 0
  int64_t index;    // j, this job's column in the key arrays
  TileFn fn;        // RunTiles for its dtype
};

inline int64_t TileBegin(const Job& job) { return static_cast<int64_t>(job.offset / kTile); }
inline int64_t TileEnd(const Job& job) { return static_cast<int64_t>((job.offset + job.n + kTile - 1) / kTile); }

// Everything a launch needs, built once per call: the jobs, the K updates (scale and lookup
// table, shared by all jobs), and every job's K leaf keys in two u32 arrays (update-major, so the
// derivation of all leaf keys of one update is one vectorizable loop). Built in the calling
// thread's scratch Work (Scratch), whose arrays keep their capacity from call to call: a launch
// that runs on the calling thread allocates nothing.
struct Work {
  int32_t distribution = kBinomial;
  std::vector<Update> updates;   // K
  std::vector<uint32_t> k0, k1;  // K * J leaf key words, [u * J + j]
  std::vector<Job> jobs;         // J

  LeafKey Key(const Job& job, int64_t u) const {
    const size_t i = static_cast<size_t>(u) * jobs.size() + static_cast<size_t>(job.index);
    return MakeKey(k0[i], k1[i]);
  }
};

// The calling thread's Work, emptied.
Work& Scratch() {
  thread_local Work work;
  work.updates.clear();
  work.k0.clear();
  work.k1.clear();
  work.jobs.clear();
  return work;
}

// A launch split across threads (it owns its Work: a pool thread may still hold it after the call).
// A chunk is a run of consecutive items (a job's tiles [t0, t1)) holding about the same number of
// elements: many small leaves make one chunk, a large leaf several.
struct Shared {
  Work work;
  struct Item {
    int64_t job, t0, t1;
  };
  std::vector<Item> items;
  std::vector<int64_t> chunk_end;  // chunk c is items [chunk_end[c - 1] (0 for c = 0), chunk_end[c])
  std::atomic<int64_t> next{0};
  ffi::CountDownPromise done;  // counts finished chunks

  // Claim chunks until none is left; whoever finishes the last chunk completes the launch, so a
  // thread that starts after all chunks were claimed is not waited for.
  void Loop() {
    const FloatMode mode;
    const int64_t n = static_cast<int64_t>(chunk_end.size());
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n) return;
      for (int64_t i = c == 0 ? 0 : chunk_end[c - 1]; i < chunk_end[c]; ++i) {
        const Item& it = items[i];
        const Job& job = work.jobs[it.job];
        job.fn(work, job, it.t0, it.t1);
      }
      done.CountDown();
    }
  }
};

#if !ZEROTH_AVX512
// The K updates of a job's tile held in `tile`, one pass over it per update.
inline void UpdateInPlace(float* tile, const Work& work, const Job& job, uint32_t first_call, int64_t g0, int64_t g1) {
  for (size_t u = 0; u < work.updates.size(); ++u) {
    if (work.distribution == kBinomial) {
      BinomialGroups(tile, work.Key(job, static_cast<int64_t>(u)), work.updates[u], first_call, g0, g1);
    } else {
      RademacherGroups(tile, work.Key(job, static_cast<int64_t>(u)), work.updates[u], first_call, g0, g1);
    }
  }
}
#endif

#if ZEROTH_AVX2
struct BinomialOps {
  template <bool kLoad, bool kStore>
  static void Groups(const float* src, float* dst, const LeafKey& key, const Update& up, uint32_t first_call,
                     int64_t g0, int64_t g1) {
    BinomialGroups<kLoad, kStore>(src, dst, key, up, first_call, g0, g1);
  }
};

struct RademacherOps {
  template <bool kLoad, bool kStore>
  static void Groups(const float* src, float* dst, const LeafKey& key, const Update& up, uint32_t first_call,
                     int64_t g0, int64_t g1) {
    RademacherGroups<kLoad, kStore>(src, dst, key, up, first_call, g0, g1);
  }
};

// The first update of a whole float32 tile, from src (the input) into tile: it flushes what it
// loads unless it is wide (Update); kStore: it is also the last.
template <typename Ops, bool kStore>
void FirstUpdate(const float* src, float* tile, const Work& work, const Job& job, uint32_t first_call, int64_t g0,
                 int64_t g1) {
  const Update& first = work.updates[0];
  if (first.wide) {
    Ops::template Groups<false, kStore>(src, tile, work.Key(job, 0), first, first_call, g0, g1);
  } else {
    Ops::template Groups<true, kStore>(src, tile, work.Key(job, 0), first, first_call, g0, g1);
  }
}

// The K >= 1 updates of a whole float32 tile, from src (the input) into tile (the output): the first
// update flushes what it loads (FirstUpdate), the last what it stores (no pass of their own over
// the tile).
template <typename Ops>
void FusedUpdates(const float* src, float* tile, const Work& work, const Job& job, uint32_t first_call, int64_t g0,
                  int64_t g1) {
  const int64_t last = static_cast<int64_t>(work.updates.size()) - 1;
  if (last == 0) {
    FirstUpdate<Ops, true>(src, tile, work, job, first_call, g0, g1);
    return;
  }
  FirstUpdate<Ops, false>(src, tile, work, job, first_call, g0, g1);
  for (int64_t u = 1; u < last; ++u) {
    Ops::template Groups<false, false>(tile, tile, work.Key(job, u), work.updates[u], first_call, g0, g1);
  }
  Ops::template Groups<false, true>(tile, tile, work.Key(job, last), work.updates[last], first_call, g0, g1);
}
#endif

// Process tiles [t0, t1) of a job (tile t covers global [kTile*t, kTile*(t+1)) clipped to the job).
template <typename T>
void RunTiles(const Work& work, const Job& job, int64_t t0, int64_t t1) {
  alignas(64) float buf[kTile];
  const T* in = static_cast<const T*>(job.in);
  T* out = static_cast<T*>(job.out);
  const uint64_t lo_all = job.offset;
  const uint64_t hi_all = job.offset + static_cast<uint64_t>(job.n);
  const int64_t group = work.distribution == kBinomial ? kBinomialGroup : kRademacherGroup;
  const int64_t per_call = work.distribution == kBinomial ? 4 : 64;
  const int64_t n_updates = static_cast<int64_t>(work.updates.size());
  for (int64_t t = t0; t < t1; ++t) {
    const uint64_t tile_start = static_cast<uint64_t>(t) * kTile;
    const uint64_t lo = std::max(lo_all, tile_start);
    const uint64_t hi = std::min(hi_all, tile_start + kTile);
    const int64_t b0 = static_cast<int64_t>(lo - tile_start);
    const int64_t b1 = static_cast<int64_t>(hi - tile_start);
    const int64_t g0 = b0 / group;
    const int64_t g1 = (b1 + group - 1) / group;
    const uint32_t first_call = static_cast<uint32_t>(tile_start / per_call);
    // A whole float32 tile is updated where it lies in the output (no copy, and no 4K-aliasing
    // between a stack buffer and the array); other tiles go through `buf`, whose elements outside
    // [b0, b1) but inside the groups computed are zeroed (they are never stored; zero keeps
    // garbage subnormals or NaNs out of the arithmetic). Only those few are written: a small
    // leaf costs its own elements, not a whole tile.
    const bool direct = std::is_same_v<T, float> && b0 == 0 && b1 == kTile;
    // A whole float32 tile of fewer than four binomial updates (or one Rademacher update) is read
    // from the input, flushed, updated and flushed again in registers, a few groups at a time: no
    // pass of its own for either flush (K = 1 on 2^24 elements, 2-core AMD EPYC: binomial 3.3-3.4 ms
    // instead of 4.5-4.7, Rademacher 2.4-2.6 instead of 3.4-5.1). With more updates a group's
    // arithmetic dominates and reading it straight from memory measured no better (binomial K = 16:
    // 37.9-42.9 ms against 38.4-38.8), so those tiles keep the flushing passes.
    // With AVX2 alone every whole float32 tile is fused so (an update's noise goes through the tile
    // in L1 anyway; the flush passes cost binomial K = 1 on 2^22 elements in place 1.39 ms of 1.00,
    // same machine, -march=x86-64-v3).
    const bool fused = direct && n_updates > 0 &&
                       ((ZEROTH_AVX512 && (work.distribution == kBinomial ? n_updates < kGroupChains : n_updates == 1)) ||
                        ZEROTH_AVX2);
    float* tile = buf;
    [[maybe_unused]] const float* source = buf;
    if (direct) {
      tile = reinterpret_cast<float*>(out + (lo - lo_all));
      source = tile;
      if (fused) {
        source = reinterpret_cast<const float*>(in + (lo - lo_all));
      } else {
        Io<float>::Load(reinterpret_cast<const float*>(in + (lo - lo_all)), tile, kTile);
      }
    } else {
      const int64_t pad0 = g0 * group, pad1 = std::min<int64_t>(g1 * group, kTile);
      if (b0 > pad0) std::memset(buf + pad0, 0, sizeof(float) * (b0 - pad0));
      if (pad1 > b1) std::memset(buf + b1, 0, sizeof(float) * (pad1 - b1));
      Io<T>::Load(in + (lo - lo_all), buf + b0, b1 - b0);
    }
#if ZEROTH_AVX512
    if (work.distribution == kBinomial) {
      const size_t j = static_cast<size_t>(job.index);
      const int64_t stride = static_cast<int64_t>(work.jobs.size());
      if (fused) {
        BinomialGroupsAll<true>(source, tile, work.updates.data(), work.k0.data() + j, work.k1.data() + j, stride,
                                n_updates, first_call, g0, g1);
      } else {
        BinomialGroupsAll<false>(source, tile, work.updates.data(), work.k0.data() + j, work.k1.data() + j, stride,
                                 n_updates, first_call, g0, g1);
      }
    } else if (fused) {
      RademacherGroups<true>(source, tile, work.Key(job, 0), work.updates[0], first_call, g0, g1);
    } else {
      for (int64_t u = 0; u < n_updates; ++u) {
        RademacherGroups<false>(tile, tile, work.Key(job, u), work.updates[u], first_call, g0, g1);
      }
    }
#elif ZEROTH_AVX2
    if (fused) {
      // the first update reads the input with the flush on load, the last stores with the flush on store
      if (work.distribution == kBinomial) {
        FusedUpdates<BinomialOps>(source, tile, work, job, first_call, g0, g1);
      } else {
        FusedUpdates<RademacherOps>(source, tile, work, job, first_call, g0, g1);
      }
    } else {
      UpdateInPlace(tile, work, job, first_call, g0, g1);
    }
#else
    UpdateInPlace(tile, work, job, first_call, g0, g1);
#endif
    if (fused) {
      // flushed on store above
    } else if (direct) {
      Io<float>::Store(tile, tile, kTile);
    } else {
      Io<T>::Store(buf + b0, out + (lo - lo_all), b1 - b0);
    }
  }
}

TileFn TileFnFor(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::F32: return &RunTiles<float>;
    case ffi::BF16: return &RunTiles<Bf16>;
    case ffi::F16: return &RunTiles<_Float16>;
    default: return nullptr;
  }
}

ffi::Future Failed(const char* msg) {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetError(ffi::Error::InvalidArgument(msg));
  return f;
}

ffi::Future Done() {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetAvailable();
  return f;
}

// The K updates of a launch: keys u32[K, 2] (sample keys, or leaf keys for a single job), scales f32[K].
void SetUpdates(Work& work, int32_t distribution, const float* s, int64_t n_updates) {
  work.distribution = distribution;
  work.updates.resize(n_updates);
  for (int64_t u = 0; u < n_updates; ++u) work.updates[u] = MakeUpdate(s[u]);
}

// Leaf keys given (one job): k = keys u32[K, 2].
void SetLeafKeys(Work& work, const uint32_t* k, int64_t n_updates) {
  work.k0.resize(n_updates);
  work.k1.resize(n_updates);
  for (int64_t u = 0; u < n_updates; ++u) {
    work.k0[u] = k[2 * u];
    work.k1[u] = k[2 * u + 1];
  }
}

// Leaf keys derived for J jobs: key u of job j is fold_in(sample key u, leaf_ids[j]) =
// threefry(sample key u, (0, leaf_ids[j])); a loop over the jobs per update (vectorized).
void DeriveLeafKeys(Work& work, const uint32_t* k, int64_t n_updates, const int64_t* leaf_ids, int64_t n_jobs) {
  work.k0.resize(static_cast<size_t>(n_updates * n_jobs));
  work.k1.resize(static_cast<size_t>(n_updates * n_jobs));
  for (int64_t u = 0; u < n_updates; ++u) {
    const LeafKey sample = MakeKey(k[2 * u], k[2 * u + 1]);
    uint32_t* o0 = work.k0.data() + u * n_jobs;
    uint32_t* o1 = work.k1.data() + u * n_jobs;
    for (int64_t j = 0; j < n_jobs; ++j) {
      uint32_t l0, l1;
      Threefry(sample, static_cast<uint32_t>(leaf_ids[j]), l0, l1);
      o0[j] = l0;
      o1[j] = l1;
    }
  }
}

// One launch for every job: serial on the calling thread when the work is small (no scheduling
// cost at all), else split across XLA's CPU thread pool in chunks claimed in order, so a thread
// that starts late (a busy pool) takes less work, or none, instead of delaying the whole call.
ffi::Future Launch(ffi::ThreadPool pool, Work& work) {
  int64_t total = 0;
  for (const Job& job : work.jobs) total += job.n;
  const int64_t n_updates = std::max<int64_t>(1, static_cast<int64_t>(work.updates.size()));
  int64_t n_parts = 1;
  if (total * n_updates >= kParallelWork) {
    n_parts = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), (total + kTile - 1) / kTile);
  }
  if (n_parts <= 1) {
    const FloatMode mode;
    for (const Job& job : work.jobs) {
      if (job.n > 0) job.fn(work, job, TileBegin(job), TileEnd(job));
    }
    return Done();
  }
  auto shared = std::make_shared<Shared>();
  shared->work = std::move(work);
  // Chunks of about total / (8 * n_parts) elements (at least a tile), cut at tile boundaries.
  const int64_t target = std::max<int64_t>(kTile, total / (8 * n_parts));
  const int64_t piece = std::max<int64_t>(1, target / kTile);
  int64_t held = 0;
  const std::vector<Job>& jobs = shared->work.jobs;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    if (job.n == 0) continue;
    const uint64_t lo = job.offset, hi = job.offset + static_cast<uint64_t>(job.n);
    for (int64_t t = TileBegin(job), end = TileEnd(job); t < end; t += piece) {
      const int64_t t1 = std::min(t + piece, end);
      shared->items.push_back({static_cast<int64_t>(j), t, t1});
      held += static_cast<int64_t>(std::min<uint64_t>(hi, static_cast<uint64_t>(t1) * kTile) -
                                   std::max<uint64_t>(lo, static_cast<uint64_t>(t) * kTile));
      if (held >= target) {
        shared->chunk_end.push_back(static_cast<int64_t>(shared->items.size()));
        held = 0;
      }
    }
  }
  if (held > 0) shared->chunk_end.push_back(static_cast<int64_t>(shared->items.size()));
  shared->done = ffi::CountDownPromise(static_cast<int64_t>(shared->chunk_end.size()));
  ffi::Future future(shared->done);
  for (int64_t part = 1; part < n_parts; ++part) {
    pool.Schedule([shared]() { shared->Loop(); });
  }
  shared->Loop();
  return future;
}

bool CheckedJob(Job& job, const ffi::AnyBuffer& x, ffi::AnyBuffer& out, int64_t offset) {
  if (x.element_type() != out.element_type() || x.element_count() != out.element_count()) return false;
  if (offset < 0 || static_cast<uint64_t>(offset) + x.element_count() > 0xFFFFFFFFull) return false;
  job.in = x.untyped_data();
  job.out = out.untyped_data();
  job.n = static_cast<int64_t>(x.element_count());
  job.offset = static_cast<uint64_t>(offset);
  job.index = 0;
  job.fn = TileFnFor(x.element_type());
  return true;
}

// One leaf, leaf keys given: the op of zeroth.kernels.perturb.perturb_native.
ffi::Future Perturb(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys,
                    ffi::Buffer<ffi::F32> scales, ffi::Result<ffi::AnyBuffer> out, int32_t distribution,
                    int64_t offset) {
  if (distribution != kBinomial && distribution != kRademacher) return Failed("zeroth_perturb: bad distribution");
  const int64_t n_updates = static_cast<int64_t>(scales.element_count());
  if (static_cast<int64_t>(keys.element_count()) != 2 * n_updates)
    return Failed("zeroth_perturb: keys must be u32[K, 2] and scales f32[K]");
  Work& work = Scratch();
  work.jobs.emplace_back();
  Job& job = work.jobs.back();
  if (!CheckedJob(job, x, *out, offset))
    return Failed("zeroth_perturb: the output must have the input's dtype and size, global indices 32 bits");
  if (job.fn == nullptr) return Failed("zeroth_perturb: dtype must be float32, bfloat16 or float16");
  SetUpdates(work, distribution, scales.typed_data(), n_updates);
  SetLeafKeys(work, keys.typed_data(), n_updates);
  return Launch(pool, work);
}

// Every leaf of a replay in one launch: sample keys, scales, then the leaves; leaf i's keys are
// fold_in(sample_key[u], leaf_ids[i]) = threefry(sample_key[u], (0, leaf_ids[i])), derived here.
ffi::Future PerturbTree(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> scales,
                        ffi::RemainingArgs leaves, ffi::RemainingRets outs, ffi::Span<const int64_t> leaf_ids,
                        int32_t distribution) {
  if (distribution != kBinomial && distribution != kRademacher) return Failed("zeroth_perturb_tree: bad distribution");
  const int64_t n_updates = static_cast<int64_t>(scales.element_count());
  if (static_cast<int64_t>(keys.element_count()) != 2 * n_updates)
    return Failed("zeroth_perturb_tree: keys must be u32[K, 2] and scales f32[K]");
  if (leaves.size() != outs.size() || leaves.size() != leaf_ids.size())
    return Failed("zeroth_perturb_tree: one output and one leaf id per leaf");
  Work& work = Scratch();
  work.jobs.resize(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto x = leaves.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!x.has_value() || !out.has_value()) return Failed("zeroth_perturb_tree: a leaf is not a buffer");
    Job& job = work.jobs[i];
    if (!CheckedJob(job, *x, **out, 0))
      return Failed("zeroth_perturb_tree: each output must have its leaf's dtype and size (< 2**32 elements)");
    if (job.fn == nullptr) return Failed("zeroth_perturb_tree: dtype must be float32, bfloat16 or float16");
    job.index = static_cast<int64_t>(i);
  }
  SetUpdates(work, distribution, scales.typed_data(), n_updates);
  DeriveLeafKeys(work, keys.typed_data(), n_updates, leaf_ids.begin(), static_cast<int64_t>(leaf_ids.size()));
  return Launch(pool, work);
}

// Every leaf of a flat parameter buffer (one dtype) in one launch: sample keys, scales, then the
// buffer; segment i covers elements [offsets[i], offsets[i] + sizes[i]) and is a whole leaf with
// id leaf_ids[i]: its noise counters start at 0 at offsets[i] (the leaf's own flat index), and its
// keys are fold_in(sample_key[u], leaf_ids[i]), derived here. Elements outside every segment are
// left as they are (the output aliases the input, or holds the input's bits when not aliased).
ffi::Future PerturbFlat(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> scales,
                        ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> offsets,
                        ffi::Span<const int64_t> sizes, ffi::Span<const int64_t> leaf_ids, int32_t distribution) {
  if (distribution != kBinomial && distribution != kRademacher) return Failed("zeroth_perturb_flat: bad distribution");
  const int64_t n_updates = static_cast<int64_t>(scales.element_count());
  if (static_cast<int64_t>(keys.element_count()) != 2 * n_updates)
    return Failed("zeroth_perturb_flat: keys must be u32[K, 2] and scales f32[K]");
  if (offsets.size() != sizes.size() || offsets.size() != leaf_ids.size())
    return Failed("zeroth_perturb_flat: one offset, size and leaf id per segment");
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count())
    return Failed("zeroth_perturb_flat: the output must have the buffer's dtype and size");
  const TileFn fn = TileFnFor(x.element_type());
  if (fn == nullptr) return Failed("zeroth_perturb_flat: dtype must be float32, bfloat16 or float16");
  const int64_t itemsize = x.element_type() == ffi::F32 ? 4 : 2;
  const int64_t total = static_cast<int64_t>(x.element_count());
  for (size_t i = 0; i < offsets.size(); ++i) {
    const int64_t o = offsets[i], n = sizes[i];
    if (o < 0 || n < 0 || o > total || n > total - o || n > int64_t{0xFFFFFFFF})
      return Failed("zeroth_perturb_flat: a segment lies outside the buffer or has 2**32 elements or more");
  }
  const char* in = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  if (in != dst && total > 0) std::memcpy(dst, in, static_cast<size_t>(total * itemsize));  // gaps keep their bits
  Work& work = Scratch();
  work.jobs.resize(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    Job& job = work.jobs[i];
    job.in = dst + offsets[i] * itemsize;  // updated in place in the output (which holds the input's bits)
    job.out = dst + offsets[i] * itemsize;
    job.n = sizes[i];
    job.offset = 0;
    job.index = static_cast<int64_t>(i);
    job.fn = fn;
  }
  SetUpdates(work, distribution, scales.typed_data(), n_updates);
  DeriveLeafKeys(work, keys.typed_data(), n_updates, leaf_ids.begin(), static_cast<int64_t>(leaf_ids.size()));
  return Launch(pool, work);
}

// One slice of a leaf, its start given at run time (ZerothPerturbSlice): out = elements
// [start, start + m) of x, perturbed with the noise of their global indices offset + start + j,
// so slice i of a stacked [L, ...] leaf gets exactly the bits of the whole leaf's update at those
// positions. `start` is a u32 scalar buffer (a scan's layer index times the layer size), m the
// output's size; leaf keys given, as in Perturb. x may be a flat buffer holding the leaf in its
// elements [b, end): start then counts from the buffer's first element and offset is -b, so that
// the noise is that of the leaf's own indices (every one of them must be >= 0), and the slice
// must end at or before `end` (x's size for a whole leaf), not in the data that follows the leaf.
ffi::Future PerturbSlice(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys,
                         ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::U32> start, ffi::Result<ffi::AnyBuffer> out,
                         int32_t distribution, int64_t offset, int64_t end) {
  if (distribution != kBinomial && distribution != kRademacher) return Failed("zeroth_perturb_slice: bad distribution");
  const int64_t n_updates = static_cast<int64_t>(scales.element_count());
  if (static_cast<int64_t>(keys.element_count()) != 2 * n_updates)
    return Failed("zeroth_perturb_slice: keys must be u32[K, 2] and scales f32[K]");
  if (start.element_count() != 1) return Failed("zeroth_perturb_slice: start must be one u32");
  if (x.element_type() != out->element_type()) return Failed("zeroth_perturb_slice: the output must have the input's dtype");
  const uint64_t first = *start.typed_data();
  const uint64_t m = out->element_count();
  if (end < 0 || static_cast<uint64_t>(end) > x.element_count())
    return Failed("zeroth_perturb_slice: the leaf's end lies outside x");
  if (first + m > static_cast<uint64_t>(end))
    return Failed("zeroth_perturb_slice: the slice [start, start + size) leaves the leaf");
  const int64_t global = offset + static_cast<int64_t>(first);  // the noise index of the slice's first element
  if (global < 0) return Failed("zeroth_perturb_slice: the slice starts before the leaf");
  if (static_cast<uint64_t>(global) + m > 0xFFFFFFFFull)
    return Failed("zeroth_perturb_slice: global indices must fit in 32 bits");
  Work& work = Scratch();
  work.jobs.emplace_back();
  Job& job = work.jobs.back();
  const size_t item = x.element_type() == ffi::F32 ? 4 : 2;
  job.in = static_cast<const char*>(x.untyped_data()) + item * first;
  job.out = out->untyped_data();
  job.n = static_cast<int64_t>(m);
  job.offset = static_cast<uint64_t>(global);
  job.index = 0;
  job.fn = TileFnFor(x.element_type());
  if (job.fn == nullptr) return Failed("zeroth_perturb_slice: dtype must be float32, bfloat16 or float16");
  SetUpdates(work, distribution, scales.typed_data(), n_updates);
  SetLeafKeys(work, keys.typed_data(), n_updates);
  return Launch(pool, work);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerothPerturb, Perturb,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("distribution")
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerothPerturbTree, PerturbTree,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("leaf_ids")
                                  .Attr<int32_t>("distribution"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerothPerturbFlat, PerturbFlat,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .Attr<ffi::Span<const int64_t>>("leaf_ids")
                                  .Attr<int32_t>("distribution"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerothPerturbSlice, PerturbSlice,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("distribution")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("end"));

// Which of the kernel's paths this library was compiled with: "avx512", "avx2" or "portable".
extern "C" const char* ZerothPerturbPath() { return ZEROTH_AVX512 ? "avx512" : ZEROTH_AVX2 ? "avx2" : "portable"; }

// 1 in a test build whose work runs with flush-to-zero and denormals-are-zero off (FloatMode).
extern "C" int ZerothPerturbGradualUnderflow() { return kGradualUnderflow; }
