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

// The threads of a threadgroup run as fibers (user-space contexts) in one OS thread: a barrier switches to the
// next fiber instead of sleeping in the kernel, which made std::thread-per-GPU-thread runs mostly system time
// (futex waits and thread creation on every threadgroup). Sanitizer builds keep one std::thread per GPU thread
// (MSL_EMU_THREADS, set by cpu_exec): TSan finds missing barriers as races between real threads, and ASan does not
// follow stack switches it is not told of.
// Counting barrier over a fixed set of threads; finished threads drop out.  Every arrival
// records its source line: two lines in one phase = a non-uniform barrier.
struct Barrier {
  std::mutex m; std::condition_variable cv;
  int expected = 0, arrived = 0, line = -1; uint64_t gen = 0, mask = 0, last_mask = 0;
  const char* what = "threadgroup_barrier";
  void arrive(int lane, int at_line) {
    if (arrived == 0) line = at_line;
    else if (line != at_line) {
      char b[200]; std::snprintf(b, sizeof b, "non-uniform %s: reached at line %d and at line %d in the same phase",
                                 what, line, at_line);
      fail(b);
    }
    if (lane < 64) mask |= (1ull << lane);
  }
  [[noreturn]] void deadlock() {
    char b[200]; std::snprintf(b, sizeof b, "deadlock in %s at line %d: %d of %d threads arrived "
                               "(others are in a divergent branch or never reach it)", what, line, arrived, expected);
    fail(b);
  }
#if defined(MSL_EMU_THREADS)
  uint64_t arrive_and_wait(int lane, int at_line) {
    std::unique_lock<std::mutex> lk(m);
    arrive(lane, at_line);
    uint64_t my = gen;
    if (++arrived == expected) { release(); return last_mask; }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s());
    while (gen == my)
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && gen == my) deadlock();
    return last_mask;
  }
  void drop() {
    std::lock_guard<std::mutex> lk(m);
    --expected;
    if (arrived > 0 && arrived == expected) release();
  }
#else
  uint64_t arrive_and_wait(int lane, int at_line);  // below: it yields to the scheduler
  void drop() {
    --expected;
    if (arrived > 0 && arrived == expected) release();
  }
#endif
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

// One thread's whole run: the kernel, then it leaves its SIMD group's and threadgroup's barriers.
inline void run_thread(Ctx& c, const std::function<void(const Ctx&)>& kernel) {
  tls = &c;
  kernel(c);
  c.group->sgs[c.simdgroup_index_in_threadgroup].bar.drop();
  c.group->bar.drop();
}

#if defined(MSL_EMU_THREADS)
inline void run_group(std::vector<Ctx>& cs, const std::function<void(const Ctx&)>& kernel) {
  std::vector<std::thread> ths;
  ths.reserve(cs.size());
  for (Ctx& c : cs) ths.emplace_back([&c, &kernel]() { run_thread(c, kernel); });
  for (auto& t : ths) t.join();
}
#else
// Round-robin fibers: each runs until it waits at a barrier not yet released (it yields) or finishes. A pass over
// every live fiber in which none arrived at a barrier, passed one or finished is a deadlock.
constexpr size_t kFiberStack = 1 << 20;  // lazily committed; kernels keep their registers' arrays here
struct Fiber { ucontext_t ctx; char* stack = nullptr; bool done = false; Barrier* waiting = nullptr; };
struct Scheduler {
  ucontext_t main;
  std::vector<Fiber> fibers;
  std::vector<Ctx>* cs = nullptr;
  const std::function<void(const Ctx&)>* kernel = nullptr;
  size_t current = 0;
  uint64_t events = 0;  // arrivals, passes and completions
  ~Scheduler() { for (Fiber& f : fibers) std::free(f.stack); }
};
inline Scheduler& scheduler() { static Scheduler s; return s; }

inline void fiber_yield() {
  Scheduler& s = scheduler();
  swapcontext(&s.fibers[s.current].ctx, &s.main);
}

inline uint64_t Barrier::arrive_and_wait(int lane, int at_line) {
  Scheduler& s = scheduler();
  arrive(lane, at_line);
  ++s.events;
  uint64_t my = gen;
  if (++arrived == expected) { release(); return last_mask; }
  s.fibers[s.current].waiting = this;
  while (gen == my) fiber_yield();
  s.fibers[s.current].waiting = nullptr;
  ++s.events;
  return last_mask;
}

inline void fiber_main() {
  Scheduler& s = scheduler();
  Fiber& f = s.fibers[s.current];
  run_thread((*s.cs)[s.current], *s.kernel);
  f.done = true;
  ++s.events;
}  // returns to uc_link: the scheduler

inline void run_group(std::vector<Ctx>& cs, const std::function<void(const Ctx&)>& kernel) {
  Scheduler& s = scheduler();
  size_t n = cs.size();
  if (s.fibers.size() < n) s.fibers.resize(n);
  s.cs = &cs;
  s.kernel = &kernel;
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    if (!f.stack) f.stack = static_cast<char*>(std::malloc(kFiberStack));
    f.done = false;
    f.waiting = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = &s.main;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (size_t live = n; live > 0;) {
    uint64_t before = s.events;
    for (size_t i = 0; i < n; ++i) {
      if (s.fibers[i].done) continue;
      s.current = i;
      tls = &cs[i];
      swapcontext(&s.main, &s.fibers[i].ctx);
      if (s.fibers[i].done) --live;
    }
    if (live > 0 && s.events == before) {
      for (size_t i = 0; i < n; ++i)
        if (!s.fibers[i].done && s.fibers[i].waiting) s.fibers[i].waiting->deadlock();
      fail("deadlock: no thread can run");
    }
  }
}
#endif

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
        std::vector<Ctx> cs(n);
        for (uint i = 0; i < n; ++i) {
          Ctx& c = cs[i];
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
        }
        run_group(cs, kernel);
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

