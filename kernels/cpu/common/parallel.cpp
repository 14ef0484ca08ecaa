// The pool of worker threads behind agentflash_cpu::parallel_for on engine threads (parallel.h).
//
// One job runs at a time. Its chunks are handed out by one 64-bit word, generation (32 bits) |
// chunks (16) | next chunk (16): a thread claims chunk `next` by moving the word to next + 1,
// so a claim names its job too (a thread that read the word of an earlier job fails to claim).
// The job's function and bounds are written before its word is published and read only by a
// thread that has claimed one of its chunks, and the job does not end before that chunk does.

#include "parallel.h"

#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace agentflash_cpu {
namespace {

constexpr int kNextBits = 16;
constexpr uint64_t kField = (uint64_t{1} << kNextBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kField);
// chunks per thread a call is cut into (where its grain allows): a thread the OS stops holds
// up one chunk at most, and unequal chunks (attention runs of different lengths) even out;
// four cost a quiet machine's decode forward ~0.3 ms more in tile set-ups and claims
constexpr int64_t kChunksPerThread = 2;
// how long an idle worker watches for the next job before it sleeps (outside a Hold): long
// enough to span the engine's host work between the target's and the drafter's forwards
// (with 100 us, the workers slept there and woke late for each forward)
constexpr auto kSpin = std::chrono::microseconds(1000);

thread_local int t_threads = 0;        // this thread's share of the pool (0: not an engine thread)
thread_local int t_omp_threads = 0;    // OpenMP's thread count here before set_engine_thread
thread_local bool t_in_chunks = false;  // a pool worker, or a thread whose job runs

struct Job {
  ChunkFn fn;
  const void* body;
  int64_t begin, end, size;
};

class Pool {
 public:
  std::mutex busy;  // held by the thread whose job runs

  // Workers up to `helpers` (started here; they stay), `helpers` of them taking part.
  void ensure(int helpers) {
    while (started_ < helpers) {
      const int id = started_++;
      std::thread([this, id] { work(id); }).detach();
    }
    helpers_.store(helpers, std::memory_order_relaxed);
  }

  void hold(bool on) {
    if (holds_.fetch_add(on ? 1 : -1, std::memory_order_seq_cst) == 0 && on &&
        sleepers_.load(std::memory_order_seq_cst) > 0)
      wake();
  }

  // Run `chunks` chunks of `job` here and on the workers; returns when all have run, with the
  // first exception any chunk threw rethrown.
  void run(const Job& job, int64_t chunks) {
    job_ = job;
    error_ = nullptr;
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t generation = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store((generation << 32) | (static_cast<uint64_t>(chunks) << kNextBits),
                 std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake();
    uint64_t seen;
    while (claim_one(seen)) {
    }
    for (int spins = 0; finished_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();  // a worker holding a chunk waits for a core
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> finished_{0};
  std::atomic<int> helpers_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> holds_{0};
  int started_ = 0;  // (touched under `busy` only)
  Job job_{};
  std::exception_ptr error_;
  std::mutex error_lock_;
  std::mutex sleep_;
  std::condition_variable wake_;

  void wake() {
    { std::lock_guard<std::mutex> lock(sleep_); }
    wake_.notify_all();
  }

  // Claim the running job's next chunk and compute it; false where none is left (`seen`: the
  // claim word last read).
  bool claim_one(uint64_t& seen) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      seen = word;
      if ((word & kField) >= ((word >> kNextBits) & kField)) return false;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        break;
    }
    const Job& job = job_;
    const int64_t b0 = job.begin + static_cast<int64_t>(seen & kField) * job.size;
    try {
      job.fn(job.body, b0, std::min(job.end, b0 + job.size));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock_);
      if (!error_) error_ = std::current_exception();
    }
    finished_.fetch_add(1, std::memory_order_release);
    return true;
  }

  void work(int id) {
    t_in_chunks = true;
    pthread_setname_np(pthread_self(), "agentflash-cpu");
    uint64_t seen = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (id < helpers_.load(std::memory_order_relaxed) && claim_one(seen)) continue;
      // nothing to claim: watch for the next job (through a Hold, or a while), then sleep
      const auto start = std::chrono::steady_clock::now();
      bool changed = false;
      while (!changed && (holds_.load(std::memory_order_relaxed) > 0 ||
                          std::chrono::steady_clock::now() - start < kSpin)) {
        for (int i = 0; i < 64 && !changed; ++i) {
          _mm_pause();
          changed = claim_.load(std::memory_order_relaxed) != seen;
        }
        if (!changed) std::this_thread::yield();  // a thread waiting for this core runs first
      }
      if (!changed) {
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] {
          return claim_.load(std::memory_order_seq_cst) != seen ||
                 holds_.load(std::memory_order_seq_cst) > 0;
        });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = claim_.load(std::memory_order_acquire);
    }
  }
};

Pool*& instance() {
  // a forked child has none of the parent's threads: it starts a pool of its own
  static Pool* pool = [] {
    pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
    return new Pool();
  }();
  return pool;  // never destroyed: its detached workers may outlive static destructors
}

}  // namespace

void set_engine_thread(int threads) {
  at::get_num_threads();  // torch's per-thread set-up first, which would undo the line below
  if (threads > 0) {
    if (t_threads == 0) t_omp_threads = omp_get_max_threads();
    t_threads = threads;
    omp_set_num_threads(1);  // this thread's OpenMP regions (torch's ops) run on it alone
  } else if (t_threads > 0) {
    t_threads = 0;
    omp_set_num_threads(t_omp_threads);
  }
}

int engine_threads() { return t_threads; }

Hold::Hold() : held_(t_threads > 1) {
  if (held_) instance()->hold(true);
}

Hold::~Hold() {
  if (held_) instance()->hold(false);
}

void run_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* body) {
  const int64_t n = end - begin;
  const int threads = t_threads;
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain || t_in_chunks) {
    fn(body, begin, end);
    return;
  }
  Pool& pool = *instance();
  std::unique_lock<std::mutex> lock(pool.busy, std::try_to_lock);
  if (!lock.owns_lock()) {  // another engine thread's job runs: this one computes its own
    fn(body, begin, end);
    return;
  }
  const int64_t per = threads * kChunksPerThread;
  const int64_t size =
      std::max({grain, (n + per - 1) / per, (n + kMaxChunks - 1) / kMaxChunks});
  pool.ensure(threads - 1);
  t_in_chunks = true;
  struct Done {
    ~Done() { t_in_chunks = false; }
  } done;
  pool.run(Job{fn, body, begin, end, size}, (n + size - 1) / size);
}

}  // namespace agentflash_cpu

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def("set_engine_thread(int threads) -> ()",
        [](int64_t threads) { agentflash_cpu::set_engine_thread(static_cast<int>(threads)); });
}
