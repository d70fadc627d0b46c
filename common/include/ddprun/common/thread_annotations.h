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

// Abseil's legacy header (which gRPC's headers bring in) defines some of the same names to the
// same attributes: whichever comes first is used.
#ifndef GUARDED_BY
#define GUARDED_BY(x) DDPRUN_THREAD_ANNOTATION(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) DDPRUN_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
#ifndef REQUIRES
#define REQUIRES(...) DDPRUN_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) DDPRUN_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
#ifndef ACQUIRE
#define ACQUIRE(...) DDPRUN_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) DDPRUN_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#endif
#ifndef CAPABILITY
#define CAPABILITY(x) DDPRUN_THREAD_ANNOTATION(capability(x))
#endif
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY DDPRUN_THREAD_ANNOTATION(scoped_lockable)
#endif
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS DDPRUN_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif

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

// std::recursive_mutex with the capability attribute (a callback that may destroy its owner).
class CAPABILITY("mutex") RecursiveMutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }

 private:
  std::recursive_mutex mu_;
};

class SCOPED_CAPABILITY RecursiveMutexLock {
 public:
  explicit RecursiveMutexLock(RecursiveMutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~RecursiveMutexLock() RELEASE() { mu_.unlock(); }
  RecursiveMutexLock(const RecursiveMutexLock&) = delete;
  RecursiveMutexLock& operator=(const RecursiveMutexLock&) = delete;

 private:
  RecursiveMutex& mu_;
};

}  // namespace ddprun
