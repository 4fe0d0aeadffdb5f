#include "namm/file_util.h"

#include <random>

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace namm {

namespace {
std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent_directory(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return Status::Ok();
  const std::string parent = parent_directory(path);
  if (parent != path) NAMM_RETURN_IF_ERROR(make_directories(parent));
  if (::mkdir(path.c_str(), 0777) != 0 && !(errno == EEXIST && is_directory(path))) {
    return Status::IOError("cannot create directory " + path + ": " + ErrnoText());
  }
  return Status::Ok();
}

Status remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? Status::Ok() : Status::IOError("cannot remove " + path + ": " + ErrnoText());
  }
  // Children before their directory (FTW_DEPTH), links as links (FTW_PHYS).
  const auto remove_one = [](const char* entry, const struct stat*, int, struct FTW*) { return ::remove(entry); };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return Status::IOError("cannot remove " + path + ": " + ErrnoText());
  }
  return Status::Ok();
}

Status remove_path(const std::string& path) {
  if (::remove(path.c_str()) != 0 && errno != ENOENT) {
    return Status::IOError("cannot remove " + path + ": " + ErrnoText());
  }
  return Status::Ok();
}

Result<std::vector<std::string>> list_directory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return Status::IOError("cannot list directory " + path + ": " + ErrnoText());
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

Result<int64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::IOError("cannot read the size of " + path + ": " + ErrnoText());
  return static_cast<int64_t>(st.st_size);
}

Result<int64_t> raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return Status::IOError(std::string("cannot read the open-file limit: ") + std::strerror(errno));
  }
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return Status::IOError(std::string("cannot raise the open-file limit: ") + std::strerror(errno));
    }
  }
  return limit.rlim_cur == RLIM_INFINITY ? int64_t{-1} : static_cast<int64_t>(limit.rlim_cur);
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!path_exists(path)) return Status::NotFound(path + ": no such file");
    return Status::IOError(path + ": cannot open for reading");
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return Status::IOError(path + ": read failed");
  return buffer.str();
}

Result<std::string> read_secret_file(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
  const auto first = text.find_first_not_of(" \t\r\n");
  const auto last = text.find_last_not_of(" \t\r\n");
  const std::string secret = first == std::string::npos ? "" : text.substr(first, last - first + 1);
  if (secret.size() < 16) return Status::InvalidArgument(path + ": a shared secret needs at least 16 characters");
  for (char c : secret) {
    if (c < 0x20 || c > 0x7e) return Status::InvalidArgument(path + ": the shared secret must be printable ASCII");
  }
  return secret;
}

Status write_file_atomically(const std::string& path, const std::vector<std::string_view>& pieces) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(tmp + ": cannot create: " + ErrnoText());
  auto fail = [&](const std::string& what) {
    std::string msg = tmp + ": " + what + ": " + ErrnoText();
    ::close(fd);
    ::unlink(tmp.c_str());
    return Status::IOError(msg);
  };
  for (std::string_view piece : pieces) {
    const char* p = piece.data();
    std::size_t left = piece.size();
    while (left > 0) {
      ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail("write failed");
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0) return fail("fsync failed");
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Status::IOError(tmp + ": close failed: " + ErrnoText());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string msg = "cannot rename " + tmp + " to " + path + ": " + ErrnoText();
    ::unlink(tmp.c_str());
    return Status::IOError(msg);
  }
  // Make the rename itself durable.
  int dir = ::open(parent_directory(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  return Status::Ok();
}

std::string random_hex(std::size_t digits) {
  std::random_device device;
  static const char* const kHex = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < digits; ++i) out += kHex[device() % 16];
  return out;
}

}  // namespace namm
