// agentflash_cpu::parallel_for: how the CPU kernels split a call's work over threads.
//
// On most threads it is at::parallel_for (OpenMP): each of torch's threads takes a fixed share
// and the call returns when every thread has finished its share. On a busy machine the OS
// takes a core from one of them for a time slice (milliseconds) and the call waits for it:
// beside a process busy all the time, agentflash-11m's decode forward (~40 calls of tens of
// microseconds) took 19.9 ms instead of 4.0 (tools/bench_busy.py; 9.5 on an engine thread).
//
// On an engine thread (`set_engine_thread`: the runtime's, where every forward runs through
// these kernels) the work is cut in chunks that threads claim one at a time instead (an atomic
// counter): the calling thread claims and computes chunks until none are left, then waits only
// for chunks another thread claimed and has not finished. A worker the OS has not run yet
// claims nothing and is never waited for. The workers (started at first use) wait for the next
// call spinning while a compiled forward runs (`Hold`), and otherwise for a millisecond before
// they sleep, leaving the cores to other work while the engine waits; a spinning worker yields
// its core every 64 pauses to any thread waiting for it (an event loop, a client), which then
// runs between the forward's calls rather than preempting a worker that holds a chunk
// (docs/performance.md, "A busy machine"). Torch's own ops on that
// thread run on it alone, so OpenMP's threads stay asleep too. Every kernel computes each
// output independently of the chunk and the thread (kernels.h): the numbers are the same
// either way.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace agentflash_cpu {

using ChunkFn = void (*)(const void* body, int64_t begin, int64_t end);

// The calling thread's kernels split their work over `threads` threads (it and threads - 1
// workers of the pool), and its torch ops run on it alone; threads <= 0 undoes both.
void set_engine_thread(int threads);

// The calling thread's share of the pool, 0 where it is not an engine thread.
int engine_threads();

// The threads a kernel call made here splits its work over.
inline int kernel_threads() {
  const int threads = engine_threads();
  return threads > 0 ? threads : at::get_num_threads();
}

// f(b0, b1) over chunks covering [begin, end), each at least `grain` long (the last may be
// shorter), on the calling engine thread and the pool's workers; returns when all have run.
// Called from a chunk, or while another thread's call runs on the pool: runs inline.
void run_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* body);

// While a Hold lives (a compiled forward, common/program_op.cpp) the pool's workers wait for
// the next call spinning (and yielding), never sleeping: a forward's kernels follow one
// another microseconds apart. Made on an engine thread, it wakes sleeping workers, which come
// while the forward starts; elsewhere it does nothing.
class Hold {
 public:
  Hold();
  ~Hold();
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;

 private:
  bool held_;
};

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  if (engine_threads() == 0) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  run_chunks(begin, end, grain,
             [](const void* body, int64_t b0, int64_t b1) {
               (*static_cast<const F*>(body))(b0, b1);
             },
             &f);
}

}  // namespace agentflash_cpu
