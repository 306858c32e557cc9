// msl_cpu_emu.h -- thread scheduler of the CPU emulator (included by msl_cpu_runtime.h only).
//
// Why a separate file: keeps the execution model (dispatchThreads, counting barriers that detect
// divergence and deadlock, SIMD-group rendezvous, the driver's buffer I/O) apart from the
// `metal::` library surface in msl_cpu_runtime.h.  Needs uint/uint3 from that header.
#pragma once

namespace msl_emu {
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "msl_emu error: %s\n", what);
  std::fflush(stderr);
  std::_Exit(3);
}
// Kernel-scope threadgroup arrays are static locals on the CPU; cpu_exec.poison_threadgroup's rewrite registers
// each at its first use (filled with 0xFF bytes: NaN for floats), and dispatch refills them before every
// threadgroup, as a GPU's threadgroup memory holds whatever ran before: a read of memory this threadgroup did
// not write then shows as NaN.
struct TgArrays { std::mutex m; std::vector<std::pair<void*, size_t>> list; };
inline TgArrays& tg_arrays() { static TgArrays a; return a; }
inline bool register_tg_array(void* p, size_t n) {
  std::memset(p, 0xFF, n);
  std::lock_guard<std::mutex> g(tg_arrays().m);
  tg_arrays().list.emplace_back(p, n);
  return true;
}
inline void poison_tg_arrays() {
  std::lock_guard<std::mutex> g(tg_arrays().m);
  for (auto& [p, n] : tg_arrays().list) std::memset(p, 0xFF, n);
}
inline double timeout_s() { const char* e = std::getenv("MSL_EMU_TIMEOUT"); return e ? std::atof(e) : 20.0; }

// Counting barrier over a fixed set of threads; finished threads drop out.  Every arrival
// records its source line: two lines in one phase = a non-uniform barrier.
struct Barrier {
  std::mutex m; std::condition_variable cv;
  int expected = 0, arrived = 0, line = -1; uint64_t gen = 0, mask = 0, last_mask = 0;
  const char* what = "threadgroup_barrier";
  uint64_t arrive_and_wait(int lane, int at_line) {
    std::unique_lock<std::mutex> lk(m);
    if (arrived == 0) line = at_line;
    else if (line != at_line) {
      char b[200]; std::snprintf(b, sizeof b, "non-uniform %s: reached at line %d and at line %d in the same phase",
                                 what, line, at_line);
      fail(b);
    }
    if (lane < 64) mask |= (1ull << lane);
    uint64_t my = gen;
    if (++arrived == expected) { release(); return last_mask; }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s());
    while (gen == my)
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && gen == my) {
        char b[200]; std::snprintf(b, sizeof b, "deadlock in %s at line %d: %d of %d threads arrived "
                                   "(others are in a divergent branch or never reach it)", what, line, arrived, expected);
        fail(b);
      }
    return last_mask;
  }
  void drop() {
    std::lock_guard<std::mutex> lk(m);
    --expected;
    if (arrived > 0 && arrived == expected) release();
  }
  void release() { arrived = 0; ++gen; last_mask = mask; mask = 0; cv.notify_all(); }
};

constexpr int kSimdWidth = 32;
struct SimdGroup { Barrier bar; alignas(16) unsigned char slot[kSimdWidth][16]; };
struct Group { Barrier bar; std::vector<SimdGroup> sgs; std::vector<int> barrier_count; };

struct Ctx {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup,
      threads_per_threadgroup, dispatch_threads_per_threadgroup, threads_per_grid, grid_size, grid_origin,
      threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
      thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup,
      quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
  Group* group;
};
inline thread_local Ctx* tls = nullptr;

template <class P, class A> inline P attr_cast(A a) {
  if constexpr (__is_same(A, uint)) return (P)a;  // scalar attribute
  else if constexpr (__is_same(P, uint3)) return a;
  else if constexpr (__is_same(P, uint2)) return uint2{a.x, a.y};
  else if constexpr (__is_same(P, ushort3)) return ushort3{(ushort)a.x, (ushort)a.y, (ushort)a.z};
  else if constexpr (__is_same(P, ushort2)) return ushort2{(ushort)a.x, (ushort)a.y};
  else return (P)a.x;  // a scalar parameter for a 3-vector attribute takes .x
}

// Entry point of the generated driver executable: argv = dir gx gy gz tx ty tz [tg_bytes...].
// Buffer k is read from dir/b<k>.bin into an exact-size allocation (so ASan sees overruns);
// outputs are written to dir/o<k>.bin.
inline int driver_main(int argc, char** argv, int nbuf, void** bufs, const int* is_out, int ntg, void** tgs,
                       size_t* tg_sizes, void (*run)(uint3, uint3)) {
  if (argc < 8 + ntg) { std::fprintf(stderr, "usage: driver dir gx gy gz tx ty tz [tg bytes]\n"); return 2; }
  std::string dir = argv[1];
  uint3 grid = {(uint)std::atoi(argv[2]), (uint)std::atoi(argv[3]), (uint)std::atoi(argv[4])};
  uint3 tg = {(uint)std::atoi(argv[5]), (uint)std::atoi(argv[6]), (uint)std::atoi(argv[7])};
  std::vector<size_t> sizes(nbuf);
  for (int k = 0; k < nbuf; ++k) {
    std::string p = dir + "/b" + std::to_string(k) + ".bin";
    FILE* f = std::fopen(p.c_str(), "rb");
    if (!f) { std::fprintf(stderr, "cannot open %s\n", p.c_str()); return 2; }
    std::fseek(f, 0, SEEK_END); sizes[k] = (size_t)std::ftell(f); std::fseek(f, 0, SEEK_SET);
    bufs[k] = std::malloc(sizes[k] ? sizes[k] : 1);
    if (sizes[k] && std::fread(bufs[k], 1, sizes[k], f) != sizes[k]) return 2;
    std::fclose(f);
  }
  for (int t = 0; t < ntg; ++t) { tg_sizes[t] = (size_t)std::atoll(argv[8 + t]); tgs[t] = std::malloc(tg_sizes[t] + 1); }
  run(grid, tg);
  for (int k = 0; k < nbuf; ++k) {
    if (!is_out[k]) continue;
    std::string p = dir + "/o" + std::to_string(k) + ".bin";
    FILE* f = std::fopen(p.c_str(), "wb");
    if (!f || std::fwrite(bufs[k], 1, sizes[k], f) != sizes[k]) return 2;
    std::fclose(f);
  }
  for (int k = 0; k < nbuf; ++k) std::free(bufs[k]);
  for (int t = 0; t < ntg; ++t) std::free(tgs[t]);
  return 0;
}

// dispatchThreads semantics: `grid` counts threads; edge threadgroups are trimmed.
inline int dispatch(uint3 grid, uint3 tg, const std::function<void(const Ctx&)>& kernel,
                    const std::function<void()>& group_begin) {
  for (int d = 0; d < 3; ++d) tg[d] = std::max(1u, std::min(tg[d], grid[d]));  // MLX: min(threadgroup, grid)
  uint3 ngroups = (grid + tg - 1) / tg;
  for (uint gz = 0; gz < ngroups.z; ++gz)
    for (uint gy = 0; gy < ngroups.y; ++gy)
      for (uint gx = 0; gx < ngroups.x; ++gx) {
        uint3 gpos = {gx, gy, gz};
        uint3 act = tg;
        for (int d = 0; d < 3; ++d) act[d] = std::min(tg[d], grid[d] - gpos[d] * tg[d]);
        uint n = act.x * act.y * act.z, nsg = (n + kSimdWidth - 1) / kSimdWidth;
        uint full = tg.x * tg.y * tg.z;
        Group g; g.sgs = std::vector<SimdGroup>(nsg); g.barrier_count.assign(n, 0);
        g.bar.expected = (int)n;
        for (uint s = 0; s < nsg; ++s) {
          g.sgs[s].bar.expected = (int)std::min<uint>(kSimdWidth, n - s * kSimdWidth);
          g.sgs[s].bar.what = "simdgroup operation";
        }
        poison_tg_arrays();
        if (group_begin) group_begin();
        std::vector<std::thread> ths; ths.reserve(n);
        for (uint i = 0; i < n; ++i) {
          Ctx c{};
          uint3 lp = {i % act.x, (i / act.x) % act.y, i / (act.x * act.y)};
          c.thread_position_in_threadgroup = lp; c.threadgroup_position_in_grid = gpos;
          c.thread_position_in_grid = gpos * tg + lp; c.threads_per_threadgroup = act;
          c.dispatch_threads_per_threadgroup = tg; c.threads_per_grid = grid; c.grid_size = grid;
          c.grid_origin = uint3{0, 0, 0}; c.threadgroups_per_grid = ngroups;
          c.thread_index_in_threadgroup = i; c.thread_index_in_simdgroup = i % kSimdWidth;
          c.simdgroup_index_in_threadgroup = i / kSimdWidth; c.simdgroups_per_threadgroup = nsg;
          c.dispatch_simdgroups_per_threadgroup = (full + kSimdWidth - 1) / kSimdWidth;
          c.threads_per_simdgroup = kSimdWidth; c.thread_execution_width = kSimdWidth;
          c.thread_index_in_quadgroup = i % 4; c.quadgroup_index_in_threadgroup = i / 4;
          c.quadgroups_per_threadgroup = (n + 3) / 4; c.dispatch_quadgroups_per_threadgroup = (full + 3) / 4;
          c.group = &g;
          ths.emplace_back([c, &kernel]() mutable {
            tls = &c;
            kernel(c);
            c.group->sgs[c.simdgroup_index_in_threadgroup].bar.drop();
            c.group->bar.drop();
          });
        }
        for (auto& t : ths) t.join();
        for (uint i = 1; i < n; ++i)
          if (g.barrier_count[i] != g.barrier_count[0]) {
            char b[200]; std::snprintf(b, sizeof b, "non-uniform threadgroup_barrier in threadgroup (%u,%u,%u): "
                                       "thread 0 hit %d barriers, thread %u hit %d", gx, gy, gz,
                                       g.barrier_count[0], i, g.barrier_count[i]);
            fail(b);
          }
      }
  return 0;
}

// SIMD exchange: publish my value, rendezvous, let `f` read the active lanes, rendezvous again.
template <class T, class F> inline T simd_exchange(T x, int line, F f) {
  static_assert(sizeof(T) <= 16, "simd op on a type wider than 16 bytes");
  Ctx* c = tls; SimdGroup& sg = c->group->sgs[c->simdgroup_index_in_threadgroup];
  uint lane = c->thread_index_in_simdgroup;
  std::memcpy(sg.slot[lane], &x, sizeof(T));
  uint64_t active = sg.bar.arrive_and_wait((int)lane, line);
  auto get = [&](uint l) { T v; std::memcpy(&v, sg.slot[l], sizeof(T)); return v; };
  T r = f(lane, active, get);
  sg.bar.arrive_and_wait((int)lane, line);
  return r;
}
}  // namespace msl_emu

