// Clang's thread-safety annotations (-Wthread-safety), in the spelling of Abseil's: which mutex
// guards a field, which functions must hold it. They document shared state off a component's loop
// and let the clang build check it; other compilers see nothing.
#pragma once

#include <mutex>

#if defined(__clang__)
#define DDPRUN_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define DDPRUN_THREAD_ANNOTATION(x)
#endif

// gRPC's headers bring Abseil's legacy macros of the same names (the same attributes): ours
// replace them, so that sources including both compile in either order.
#undef GUARDED_BY
#undef PT_GUARDED_BY
#undef REQUIRES
#undef EXCLUDES
#undef ACQUIRE
#undef RELEASE
#undef CAPABILITY
#undef SCOPED_CAPABILITY
#undef NO_THREAD_SAFETY_ANALYSIS
#define GUARDED_BY(x) DDPRUN_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) DDPRUN_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) DDPRUN_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) DDPRUN_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) DDPRUN_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) DDPRUN_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define CAPABILITY(x) DDPRUN_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY DDPRUN_THREAD_ANNOTATION(scoped_lockable)
#define NO_THREAD_SAFETY_ANALYSIS DDPRUN_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace ddprun {

// std::mutex with the capability attribute, and its scoped lock: libstdc++'s own types carry no
// annotations, so the analysis needs these to see what is held.
class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace ddprun
