// LD_PRELOAD shim for tests: makes fsync() and fdatasync() of matching files slow, as a loaded or throttled disk
// does, in an unmodified process. NAMM_SLOW_FSYNC_MS: the delay; NAMM_SLOW_FSYNC_SUFFIX: how the file's path
// ends (default: every file; "run.db" slows the database file and not its WAL); NAMM_SLOW_FSYNC_LOG: a file that gets a line per delayed call (time,
// thread, path), so that a test can tell which of a process's threads was inside a sync when.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void Delay(int fd, const char* call) {
  const char* ms = getenv("NAMM_SLOW_FSYNC_MS");
  if (ms == NULL) return;
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof path - 1);
  path[n > 0 ? n : 0] = '\0';
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

int fsync(int fd) {
  static int (*real)(int) = NULL;
  if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  Delay(fd, "fsync");
  return real(fd);
}

int fdatasync(int fd) {
  static int (*real)(int) = NULL;
  if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
  Delay(fd, "fdatasync");
  return real(fd);
}
