// Whole-file reads and crash-safe writes, and the secrets kept in files.
#pragma once

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
