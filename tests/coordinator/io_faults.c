// LD_PRELOAD shim for tests: a loaded or failing disk, in an unmodified process and without privileges.
//
// Slow syncs: fsync() and fdatasync() of matching files take NAMM_SLOW_FSYNC_MS longer. NAMM_SLOW_FSYNC_SUFFIX:
// how the file's path ends (default: every file; "run.db" slows the database file and not its WAL);
// NAMM_SLOW_FSYNC_LOG: a file that gets a line per delayed call (time, thread, path), so that a test can tell
// which of a process's threads was inside a sync when.
//
// Failures: calls on files whose path contains NAMM_IO_FAULT_MATCH fail with NAMM_IO_FAULT_ERRNO (EIO, ENOSPC,
// EMFILE or a number) instead of running:
//   NAMM_IO_FAULT_CALLS      which: a comma-separated list of open, write, sync (default write)
//   NAMM_IO_FAULT_WHILE      only while this file exists (a test starts and ends the fault by creating and
//                            removing it)
//   NAMM_IO_FAULT_PERIOD_MS  with NAMM_IO_FAULT_DOWN_MS: only in the first DOWN ms of every PERIOD ms (a disk that
//                            fails in bursts; default: all the time). Time, not a count of calls: a pattern of
//                            calls can starve one caller whose retries fall on the failing ones every time.
//   NAMM_IO_FAULT_FIRST      the first this many matching calls fail whatever the time (bursts alone can miss
//                            a run's few calls of a kind: a test that needs one to fail sets 1)
//   NAMM_IO_FAULT_SKIP       the first this many matching calls go through; FIRST counts from the next (a test
//                            that needs one particular call to fail)
//   NAMM_IO_FAULT_LOG        a file that gets a line per failed call (time, call, path)
// A write that fails writes nothing.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void PathOf(int fd, char* path, size_t size) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, size - 1);
  path[n > 0 ? n : 0] = '\0';
}

static long EnvLong(const char* name, long fallback) {
  const char* value = getenv(name);
  return value != NULL && *value != '\0' ? strtol(value, NULL, 10) : fallback;
}

static void Delay(int fd, const char* call) {
  const char* ms = getenv("NAMM_SLOW_FSYNC_MS");
  if (ms == NULL) return;
  char path[4096];
  PathOf(fd, path, sizeof path);
  const char* suffix = getenv("NAMM_SLOW_FSYNC_SUFFIX");
  const size_t length = strlen(path), wanted = suffix != NULL ? strlen(suffix) : 0;
  if (wanted > length || strcmp(path + length - wanted, suffix != NULL ? suffix : "") != 0) return;
  const double start = Now();
  usleep((useconds_t)(atoi(ms) * 1000));
  const char* log = getenv("NAMM_SLOW_FSYNC_LOG");
  if (log == NULL) return;
  FILE* f = fopen(log, "a");
  if (f == NULL) return;
  fprintf(f, "%.3f %.3f tid %ld %s %s\n", start, Now(), (long)syscall(SYS_gettid), call, path);
  fclose(f);
}

static int FaultErrno(void) {
  const char* name = getenv("NAMM_IO_FAULT_ERRNO");
  if (name == NULL || strcmp(name, "EIO") == 0) return EIO;
  if (strcmp(name, "ENOSPC") == 0) return ENOSPC;
  if (strcmp(name, "EMFILE") == 0) return EMFILE;
  return atoi(name) > 0 ? atoi(name) : EIO;
}

// Whether this call (`kind`: open, write or sync) on `path` fails.
static int Fails(const char* kind, const char* path) {
  const char* match = getenv("NAMM_IO_FAULT_MATCH");
  if (match == NULL || path == NULL || strstr(path, match) == NULL) return 0;
  const char* kinds = getenv("NAMM_IO_FAULT_CALLS");
  if (kinds == NULL) kinds = "write";
  const size_t n = strlen(kind);
  const char* at = strstr(kinds, kind);
  if (at == NULL || (at != kinds && at[-1] != ',') || (at[n] != '\0' && at[n] != ',')) return 0;
  const char* trigger = getenv("NAMM_IO_FAULT_WHILE");
  if (trigger != NULL && access(trigger, F_OK) != 0) return 0;
  const double now = Now();
  static long matching_calls = 0;  // since the trigger appeared
  const long call = __atomic_add_fetch(&matching_calls, 1, __ATOMIC_RELAXED) - EnvLong("NAMM_IO_FAULT_SKIP", 0);
  if (call <= 0) return 0;
  const int first = call <= EnvLong("NAMM_IO_FAULT_FIRST", 0);
  const long period = EnvLong("NAMM_IO_FAULT_PERIOD_MS", 0), down = EnvLong("NAMM_IO_FAULT_DOWN_MS", 0);
  if (!first && period > 0 && (long long)(now * 1000) % period >= down) return 0;
  const char* log = getenv("NAMM_IO_FAULT_LOG");
  if (log != NULL) {
    FILE* f = fopen(log, "a");
    if (f != NULL) {
      fprintf(f, "%.3f %s %s\n", now, kind, path);
      fclose(f);
    }
  }
  errno = FaultErrno();
  return 1;
}

static int FdFails(const char* kind, int fd) {
  if (getenv("NAMM_IO_FAULT_MATCH") == NULL) return 0;
  char path[4096];
  PathOf(fd, path, sizeof path);
  return Fails(kind, path);
}

#define REAL(name)                     \
  static __typeof__(&name) real = NULL; \
  if (real == NULL) real = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

int fsync(int fd) {
  REAL(fsync);
  Delay(fd, "fsync");
  return FdFails("sync", fd) ? -1 : real(fd);
}

int fdatasync(int fd) {
  REAL(fdatasync);
  Delay(fd, "fdatasync");
  return FdFails("sync", fd) ? -1 : real(fd);
}

ssize_t write(int fd, const void* buffer, size_t n) {
  REAL(write);
  return FdFails("write", fd) ? -1 : real(fd, buffer, n);
}

ssize_t pwrite(int fd, const void* buffer, size_t n, off_t offset) {
  REAL(pwrite);
  return FdFails("write", fd) ? -1 : real(fd, buffer, n, offset);
}

ssize_t pwrite64(int fd, const void* buffer, size_t n, off64_t offset) {
  REAL(pwrite64);
  return FdFails("write", fd) ? -1 : real(fd, buffer, n, offset);
}

// open() and its variants take a mode only with O_CREAT or O_TMPFILE.
#define MODE_ARG(flags, mode)            \
  mode_t mode = 0;                       \
  if ((flags) & (O_CREAT | O_TMPFILE)) { \
    va_list args;                        \
    va_start(args, flags);               \
    mode = (mode_t)va_arg(args, int);    \
    va_end(args);                        \
  }

int open(const char* path, int flags, ...) {
  REAL(open);
  MODE_ARG(flags, mode);
  return Fails("open", path) ? -1 : real(path, flags, mode);
}

int open64(const char* path, int flags, ...) {
  REAL(open64);
  MODE_ARG(flags, mode);
  return Fails("open", path) ? -1 : real(path, flags, mode);
}

int openat(int dir, const char* path, int flags, ...) {
  REAL(openat);
  MODE_ARG(flags, mode);
  return Fails("open", path) ? -1 : real(dir, path, flags, mode);
}

int openat64(int dir, const char* path, int flags, ...) {
  REAL(openat64);
  MODE_ARG(flags, mode);
  return Fails("open", path) ? -1 : real(dir, path, flags, mode);
}
