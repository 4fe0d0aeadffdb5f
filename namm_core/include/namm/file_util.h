// Whole-file reads and crash-safe writes, directories, and the secrets kept in files.
//
// POSIX calls rather than std::filesystem: PyTorch's binary libtorch exports its own statically linked copy of
// libstdc++'s std::filesystem, which takes precedence over the system's in a program linked with it and crashes
// there (pytorch/pytorch#133437; seen in std::filesystem::remove_all with torch 2.11 on a GPU node). Code that
// links libtorch uses these instead.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "namm/status.h"

namespace namm {

// Whether something exists at `path` / is a directory there.
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// The directory part of `path` ("." when it has none).
std::string parent_directory(const std::string& path);

// Creates `path` and any missing parents (mkdir -p); a directory already there is fine.
Status make_directories(const std::string& path);
// Removes `path` and, if it is a directory, everything under it (rm -rf; symbolic links are removed, not
// followed). Nothing there is fine.
Status remove_tree(const std::string& path);
// Removes a file or an empty directory; nothing there is fine.
Status remove_path(const std::string& path);
// The names in directory `path` (not "." and ".."), sorted.
Result<std::vector<std::string>> list_directory(const std::string& path);
// The size in bytes of the file at `path`.
Result<int64_t> file_size(const std::string& path);

// Raises this process's soft limit on open files to its hard limit and returns the new soft limit (a server whose
// every connection is a descriptor: systemd and shells start services at a soft 1,024).
Result<int64_t> raise_open_file_limit();

// Reads a whole file into memory.
Result<std::string> read_file(const std::string& path);

// A shared secret kept in a file (e.g. the coordinator's worker token): the content without surrounding
// whitespace, which must be at least 16 printable characters.
Result<std::string> read_secret_file(const std::string& path);

// `digits` random hexadecimal digits from the OS's random device: identifiers and secrets, never part of a run's
// deterministic state.
std::string random_hex(std::size_t digits);

// Writes `pieces` back to back into `path` so that a crash or error at any point leaves either the old file or the
// complete new one: the data goes to a temporary file in the same directory, is fsync'ed, then renamed over `path`.
Status write_file_atomically(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace namm
