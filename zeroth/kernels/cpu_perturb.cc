// zeroth: fused exact perturbation replay on CPU, as an XLA FFI custom call.
//
// Applies K updates (leaf key, scale) to one leaf in canonical order with the exact rule of
// zeroth's determinism contract:
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
// a tile is read once, receives all K updates, and is written once. Threefry runs 16 calls at a
// time in SIMD registers (GCC/Clang vector extensions; AVX-512 where compiled for it), giving 64
// binomial or 1024 Rademacher elements per 16 calls. Tiles are split across XLA's CPU thread
// pool when the work is large enough.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BITALG__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZEROTH_HAVE_BITALG 1
#else
#define ZEROTH_HAVE_BITALG 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 4096;          // elements per tile (multiple of 1024)
constexpr int64_t kBinomialGroup = 64;   // elements per 16 threefry calls
constexpr int64_t kRademacherGroup = 1024;
constexpr int64_t kParallelWork = int64_t{1} << 18;  // element-updates before using threads
constexpr uint32_t kParity = 0x1BD11BDAu;
constexpr uint32_t kCanonicalNan = 0x7FC00000u;

typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v32h __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

enum Distribution : int32_t { kBinomial = 0, kRademacher = 1 };

struct LeafKey {
  uint32_t k0, k1, k2;
};

inline LeafKey MakeKey(uint32_t k0, uint32_t k1) { return LeafKey{k0, k1, k0 ^ k1 ^ kParity}; }

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

inline v16u Bits(v16f x) { return reinterpret_cast<v16u&>(x); }
inline v16f Floats(v16u x) { return reinterpret_cast<v16f&>(x); }

// Subnormals and -0 -> +0, NaN -> canonical quiet NaN; infinities unchanged.
inline v16f Flush(v16f x) {
  v16u u = Bits(x);
  v16u a = u & 0x7FFFFFFFu;
  u = (a < 0x00800000u) ? v16u{} : u;
  u = (a > 0x7F800000u) ? v16u{} + kCanonicalNan : u;
  return Floats(u);
}

inline float FlushScalar(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a < 0x00800000u) u = 0;
  if (a > 0x7F800000u) u = kCanonicalNan;
  std::memcpy(&x, &u, 4);
  return x;
}

// Popcount of each 16-bit half of each 32-bit word: low half in bits 0..4, high in 16..20.
inline v16u PopcountHalves(v16u x) {
#if ZEROTH_HAVE_BITALG
  __m512i r = _mm512_popcnt_epi16(reinterpret_cast<__m512i&>(x));
  return reinterpret_cast<v16u&>(r);
#else
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  x = (x + (x >> 4)) & 0x0F0F0F0Fu;
  return (x + (x >> 8)) & 0x001F001Fu;
#endif
}

// 16 halves (u16 counts 0..16) -> k * s as floats: s * (count - 8), exact.
inline v16f HalvesToUpdate(v16h h, v16f s) {
  v16i c = __builtin_convertvector(h, v16i) - 8;
  return __builtin_convertvector(c, v16f) * s;
}

// ---------------------------------------------------------------- one update on a range of groups

// buf[0..) holds the tile in float32; `first_call` is the threefry call of buf[0]
// (the tile start is aligned to kTile, so buf[0] is the first element of a call).
// Applies flush(p + s*k) to groups [g0, g1) (64 elements each).
inline void BinomialGroups(float* buf, const LeafKey& key, float scale, uint32_t first_call, int64_t g0,
                           int64_t g1) {
  const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16f s = v16f{} + scale;
  for (int64_t g = g0; g < g1; ++g) {
    v16u calls = lane + (first_call + static_cast<uint32_t>(16 * g));
    v16u x0, x1;
    Threefry(key, calls, x0, x1);
    v16u p0 = PopcountHalves(x0);
    v16u p1 = PopcountHalves(x1);
    // Word order of the stream: x0 of call j, x1 of call j, ... ; halves low then high.
    v16u a = __builtin_shufflevector(p0, p1, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    v16u b = __builtin_shufflevector(p0, p1, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    v32h ah = reinterpret_cast<v32h&>(a);
    v32h bh = reinterpret_cast<v32h&>(b);
    v16h q0 = __builtin_shufflevector(ah, ah, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    v16h q1 = __builtin_shufflevector(ah, ah, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    v16h q2 = __builtin_shufflevector(bh, bh, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    v16h q3 = __builtin_shufflevector(bh, bh, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    float* p = buf + 64 * g;
    v16f v0, v1, v2, v3;
    std::memcpy(&v0, p, 64);
    std::memcpy(&v1, p + 16, 64);
    std::memcpy(&v2, p + 32, 64);
    std::memcpy(&v3, p + 48, 64);
    v0 = Flush(v0 + HalvesToUpdate(q0, s));
    v1 = Flush(v1 + HalvesToUpdate(q1, s));
    v2 = Flush(v2 + HalvesToUpdate(q2, s));
    v3 = Flush(v3 + HalvesToUpdate(q3, s));
    std::memcpy(p, &v0, 64);
    std::memcpy(p + 16, &v1, 64);
    std::memcpy(p + 32, &v2, 64);
    std::memcpy(p + 48, &v3, 64);
  }
}

// Groups of 1024 elements = 16 calls = 32 words.
inline void RademacherGroups(float* buf, const LeafKey& key, float scale, uint32_t first_call, int64_t g0,
                             int64_t g1) {
  const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16u lane_hi = lane + 16u;
  const v16f plus = v16f{} + scale;
  const v16f minus = v16f{} - scale;
  alignas(64) uint32_t words[32];
  for (int64_t g = g0; g < g1; ++g) {
    v16u calls = lane + (first_call + static_cast<uint32_t>(16 * g));
    v16u x0, x1;
    Threefry(key, calls, x0, x1);
    v16u a = __builtin_shufflevector(x0, x1, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    v16u b = __builtin_shufflevector(x0, x1, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(words, &a, 64);
    std::memcpy(words + 16, &b, 64);
    float* p = buf + 1024 * g;
    for (int w = 0; w < 32; ++w) {
      v16u wb = v16u{} + words[w];
      v16u lo = (wb >> lane) & 1u;
      v16u hi = (wb >> lane_hi) & 1u;
      v16f v0, v1;
      std::memcpy(&v0, p + 32 * w, 64);
      std::memcpy(&v1, p + 32 * w + 16, 64);
      v0 = Flush(v0 + (lo != 0u ? plus : minus));
      v1 = Flush(v1 + (hi != 0u ? plus : minus));
      std::memcpy(p + 32 * w, &v0, 64);
      std::memcpy(p + 32 * w + 16, &v1, 64);
    }
  }
}

// ---------------------------------------------------------------- dtype conversion

template <typename T>
struct Io;

template <>
struct Io<float> {
  static void Load(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FlushScalar(src[i]);
  }
  // flush_cast to float32: the values are already flushed.
  static void Store(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
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
        h = static_cast<uint16_t>((u >> 16) | 0x0040u);
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

struct Job {
  const void* in;
  void* out;
  int64_t n;        // elements of the buffer
  uint64_t offset;  // global flat index of the buffer's element 0
  std::vector<LeafKey> keys;
  std::vector<float> scales;
  int32_t distribution;
};

// Process tiles [t0, t1) (tile t covers global [kTile*t, kTile*(t+1)) clipped to the buffer).
template <typename T>
void RunTiles(const Job& job, int64_t t0, int64_t t1) {
  alignas(64) float buf[kTile];
  const T* in = static_cast<const T*>(job.in);
  T* out = static_cast<T*>(job.out);
  const uint64_t lo_all = job.offset;
  const uint64_t hi_all = job.offset + static_cast<uint64_t>(job.n);
  const int64_t group = job.distribution == kBinomial ? kBinomialGroup : kRademacherGroup;
  const int64_t per_call = job.distribution == kBinomial ? 4 : 64;
  for (int64_t t = t0; t < t1; ++t) {
    const uint64_t tile_start = static_cast<uint64_t>(t) * kTile;
    const uint64_t lo = std::max(lo_all, tile_start);
    const uint64_t hi = std::min(hi_all, tile_start + kTile);
    const int64_t b0 = static_cast<int64_t>(lo - tile_start);
    const int64_t b1 = static_cast<int64_t>(hi - tile_start);
    if (b0 != 0 || b1 != kTile) std::memset(buf, 0, sizeof(buf));
    Io<T>::Load(in + (lo - lo_all), buf + b0, b1 - b0);
    const int64_t g0 = b0 / group;
    const int64_t g1 = (b1 + group - 1) / group;
    const uint32_t first_call = static_cast<uint32_t>(tile_start / per_call);
    for (size_t u = 0; u < job.keys.size(); ++u) {
      if (job.distribution == kBinomial) {
        BinomialGroups(buf, job.keys[u], job.scales[u], first_call, g0, g1);
      } else {
        RademacherGroups(buf, job.keys[u], job.scales[u], first_call, g0, g1);
      }
    }
    Io<T>::Store(buf + b0, out + (lo - lo_all), b1 - b0);
  }
}

template <typename T>
void RunTilesTyped(const Job& job, int64_t t0, int64_t t1) {
  RunTiles<T>(job, t0, t1);
}

using TileFn = void (*)(const Job&, int64_t, int64_t);

ffi::Future Perturb(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys,
                    ffi::Buffer<ffi::F32> scales, ffi::Result<ffi::AnyBuffer> out, int32_t distribution,
                    int64_t offset) {
  auto fail = [&](const char* msg) {
    ffi::Promise p;
    ffi::Future f(p);
    p.SetError(ffi::Error::InvalidArgument(msg));
    return f;
  };
  if (distribution != kBinomial && distribution != kRademacher) return fail("zeroth_perturb: bad distribution");
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count())
    return fail("zeroth_perturb: output must have the input's dtype and size");
  const int64_t n_keys = static_cast<int64_t>(keys.element_count());
  const int64_t n_updates = static_cast<int64_t>(scales.element_count());
  if (n_keys != 2 * n_updates) return fail("zeroth_perturb: keys must be u32[K, 2] and scales f32[K]");
  if (offset < 0 || static_cast<uint64_t>(offset) + x.element_count() > 0xFFFFFFFFull)
    return fail("zeroth_perturb: global indices must fit in 32 bits");

  TileFn fn = nullptr;
  switch (x.element_type()) {
    case ffi::F32: fn = &RunTilesTyped<float>; break;
    case ffi::BF16: fn = &RunTilesTyped<Bf16>; break;
    case ffi::F16: fn = &RunTilesTyped<_Float16>; break;
    default: return fail("zeroth_perturb: dtype must be float32, bfloat16 or float16");
  }

  auto job = std::make_shared<Job>();
  job->in = x.untyped_data();
  job->out = out->untyped_data();
  job->n = static_cast<int64_t>(x.element_count());
  job->offset = static_cast<uint64_t>(offset);
  job->distribution = distribution;
  const uint32_t* k = keys.typed_data();
  const float* s = scales.typed_data();
  for (int64_t u = 0; u < n_updates; ++u) {
    job->keys.push_back(MakeKey(k[2 * u], k[2 * u + 1]));
    job->scales.push_back(s[u]);
  }

  ffi::Promise done;
  ffi::Future future(done);
  if (job->n == 0) {
    done.SetAvailable();
    return future;
  }
  const int64_t t_begin = job->offset / kTile;
  const int64_t t_end = (job->offset + job->n + kTile - 1) / kTile;
  const int64_t n_tiles = t_end - t_begin;
  const int64_t work = job->n * std::max<int64_t>(1, n_updates);
  int64_t n_parts = 1;
  if (work >= kParallelWork) {
    n_parts = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n_tiles);
  }
  if (n_parts <= 1) {
    fn(*job, t_begin, t_end);
    done.SetAvailable();
    return future;
  }
  ffi::CountDownPromise count(done, n_parts);
  for (int64_t part = 1; part < n_parts; ++part) {
    const int64_t a = t_begin + n_tiles * part / n_parts;
    const int64_t b = t_begin + n_tiles * (part + 1) / n_parts;
    pool.Schedule([job, fn, a, b, count]() mutable {
      fn(*job, a, b);
      count.CountDown();
    });
  }
  fn(*job, t_begin, t_begin + n_tiles / n_parts);
  count.CountDown();
  return future;
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
