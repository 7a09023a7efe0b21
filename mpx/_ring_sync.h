/* Atomics, clocks and parking for mpx/_ring.pyx. Acquire/release on the words that
 * publish a slot; a seq_cst fence between "announce parked" and "re-check" on one side and
 * "publish" and "look for parked peers" on the other, so no wake-up can be lost. */
#ifndef MPX_RING_SYNC_H
#define MPX_RING_SYNC_H

#include <stdint.h>
#include <stddef.h>
#include <time.h>
#include <sched.h>
#include <poll.h>
#include <errno.h>
#include <limits.h>
#include <unistd.h>
#include <sys/mman.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

static inline void mpx_set_flag(int *p) { __atomic_store_n(p, 1, __ATOMIC_SEQ_CST); }
static inline int mpx_get_flag(int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
/* Clear *p; 1 if it was set (one taker wins). The plain load first keeps the common
 * unset case free of a locked instruction. */
static inline int mpx_take_flag(int *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE) && __atomic_exchange_n(p, 0, __ATOMIC_ACQ_REL);
}
static inline uint64_t mpx_load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void mpx_store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t mpx_load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void mpx_store32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void mpx_bump32(uint32_t *p) { __atomic_add_fetch(p, 1, __ATOMIC_SEQ_CST); }
/* Set *p from 0 to 1; 1 if this call did, 0 if it was not 0. */
static inline int mpx_claim32(uint32_t *p) {
    uint32_t zero = 0;
    return __atomic_compare_exchange_n(p, &zero, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
static inline void mpx_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void mpx_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t mpx_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void mpx_yield(void) { sched_yield(); }

/* Sleep while *addr == expected, at most timeout_ns. Spurious returns are fine: callers
 * re-check. Returns 1 when a signal interrupted the sleep (so Python can run its handler),
 * else 0. Without futex (not Linux) it sleeps in 200 us steps instead. */
static inline int mpx_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts;
    if (timeout_ns < 0) timeout_ns = 0;
#ifdef __linux__
    ts.tv_sec = timeout_ns / 1000000000LL;
    ts.tv_nsec = timeout_ns % 1000000000LL;
    if (syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0) < 0 && errno == EINTR)
        return 1;
    return 0;
#else
    if (timeout_ns > 200000) timeout_ns = 200000;
    ts.tv_sec = 0;
    ts.tv_nsec = timeout_ns;
    if (__atomic_load_n(addr, __ATOMIC_ACQUIRE) == expected && nanosleep(&ts, NULL) < 0)
        return errno == EINTR;
    return 0;
#endif
}

static inline void mpx_futex_wake(uint32_t *addr) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* Wake the ends parked on *addr, stamping *woken_ns first: how late they run after it is
 * what a park costs them (mpx/_ring.pyx, _RingEnd._park). */
static inline void mpx_wake_stamped(uint32_t *addr, uint64_t *woken_ns) {
    __atomic_store_n(woken_ns, (uint64_t)mpx_now_ns(), __ATOMIC_RELEASE);
    mpx_bump32(addr);
    mpx_futex_wake(addr);
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* A pollable handle on a process; -2 if it no longer exists, -1 if unknown. Readable once the process has exited (a zombie
 * counts), which kill(pid, 0) cannot tell, and immune to pid reuse. */
static inline int mpx_pidfd_open(int pid) {
#ifdef __linux__
    int fd;
    if (pid <= 0) return -1;
    fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0 && errno == ESRCH) return -2; /* already gone */
    return fd < 0 ? -1 : fd;
#else
    (void)pid;
    return -1;
#endif
}

static inline int mpx_pidfd_exited(int fd) {
    struct pollfd p;
    if (fd == -2) return 1;
    if (fd < 0) return 0;
    p.fd = fd;
    p.events = POLLIN;
    p.revents = 0;
    return poll(&p, 1, 0) > 0;
}

static inline void mpx_close_fd(int fd) { if (fd >= 0) close(fd); }

static inline void mpx_advise_huge(void *p, size_t n) {
#ifdef MADV_HUGEPAGE
    uintptr_t start = ((uintptr_t)p + 4095) & ~(uintptr_t)4095;
    uintptr_t end = ((uintptr_t)p + n) & ~(uintptr_t)4095;
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p; (void)n;
#endif
}

#endif
