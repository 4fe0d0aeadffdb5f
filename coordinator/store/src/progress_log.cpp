#include "namm/coordinator/progress_log.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ctime>
#include <map>
#include <type_traits>

#include "byte_codec.h"

namespace namm::coordinator {

namespace {

constexpr char kMagic[8] = {'N', 'A', 'M', 'M', 'P', 'L', 'O', 'G'};
constexpr uint32_t kVersion = 2;
constexpr std::size_t kVersionedBytes = sizeof kMagic + sizeof kVersion;  // version 1's whole header
constexpr std::size_t kHolderBytes = 128;
constexpr std::size_t kHeaderBytes = kVersionedBytes + kHolderBytes;
constexpr uint8_t kLeaseIssued = 1, kLeaseEnded = 2, kEvaluation = 3, kReference = 4;
constexpr uint32_t kMaxRecordBytes = 1 << 20;

class Writer {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_arithmetic_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void PutString(const std::string& s) {
    Put(static_cast<uint32_t>(s.size()));
    bytes_ += s;
  }
  template <typename T>
  void PutArray(const T* v, std::size_t n) {
    bytes_.append(reinterpret_cast<const char*>(v), n * sizeof(T));
  }
  // Frames what was put since the last call as one record: length, CRC, payload.
  void EndRecord(std::string* out) {
    Writer frame;
    frame.Put(static_cast<uint32_t>(bytes_.size()));
    frame.Put(crc32_of(bytes_));
    *out += frame.bytes_ + bytes_;
    bytes_.clear();
  }

 private:
  std::string bytes_;
};

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* v) {
    if (at_ + sizeof(T) > bytes_.size()) return false;
    std::memcpy(v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n) || at_ + n > bytes_.size()) return false;
    s->assign(bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  template <typename T>
  bool GetArray(T* v, std::size_t n) {
    if (at_ + n * sizeof(T) > bytes_.size()) return false;
    if (n > 0) std::memcpy(v, bytes_.data() + at_, n * sizeof(T));  // an empty vector's data() may be null
    at_ += n * sizeof(T);
    return true;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  std::string_view bytes_;
  std::size_t at_ = 0;
};

void Encode(const ProgressEntries& e, std::string* out) {
  Writer w;
  for (const LeaseRecord& l : e.leases_issued) {
    w.Put(kLeaseIssued);
    w.Put(l.id);
    w.Put(l.generation);
    w.PutString(l.worker);
    w.Put(static_cast<uint8_t>(l.reference));
    w.Put(l.candidate);
    w.PutString(l.task);
    w.Put(static_cast<uint32_t>(l.prompts.size()));
    w.PutArray(l.prompts.data(), l.prompts.size());
    w.EndRecord(out);
  }
  for (uint64_t id : e.leases_ended) {
    w.Put(kLeaseEnded);
    w.Put(id);
    w.EndRecord(out);
  }
  for (const EvaluationRecord& r : e.evaluations) {
    w.Put(kEvaluation);
    w.Put(r.generation);
    w.Put(r.candidate);
    w.PutString(r.task);
    w.Put(r.prompt);
    w.Put(r.score);
    w.Put(r.cache_size_mean);
    w.Put(r.cache_size_final);
    w.Put(r.prompt_tokens);
    w.Put(r.generated_tokens);
    w.PutString(r.worker);
    w.Put(r.duration_seconds);
    w.Put(static_cast<uint8_t>(r.norm_stats.has_value()));
    if (r.norm_stats) {
      w.Put(r.norm_stats->count);
      w.PutArray(r.norm_stats->mean.data(), r.norm_stats->mean.size());
      w.PutArray(r.norm_stats->var.data(), r.norm_stats->var.size());
    }
    w.EndRecord(out);
  }
  for (const ReferenceResult& r : e.references) {
    w.Put(kReference);
    w.PutString(r.task);
    w.Put(r.prompt);
    w.Put(r.score);
    w.EndRecord(out);
  }
}

// Decodes one record's payload into `e` (issued leases into `issued`, by id); false when malformed.
bool Decode(std::string_view payload, std::map<uint64_t, LeaseRecord>* issued, ProgressEntries* e) {
  Reader r(payload);
  uint8_t type = 0;
  if (!r.Get(&type)) return false;
  if (type == kLeaseIssued) {
    LeaseRecord l;
    uint8_t reference = 0;
    uint32_t prompts = 0;
    if (!r.Get(&l.id) || !r.Get(&l.generation) || !r.GetString(&l.worker) || !r.Get(&reference) ||
        !r.Get(&l.candidate) || !r.GetString(&l.task) || !r.Get(&prompts) || prompts > kMaxRecordBytes) {
      return false;
    }
    l.reference = reference != 0;
    l.prompts.resize(prompts);
    if (!r.GetArray(l.prompts.data(), prompts)) return false;
    (*issued)[l.id] = std::move(l);
  } else if (type == kLeaseEnded) {
    uint64_t id = 0;
    if (!r.Get(&id)) return false;
    issued->erase(id);
  } else if (type == kEvaluation) {
    EvaluationRecord x;
    uint8_t has_stats = 0;
    if (!r.Get(&x.generation) || !r.Get(&x.candidate) || !r.GetString(&x.task) || !r.Get(&x.prompt) ||
        !r.Get(&x.score) || !r.Get(&x.cache_size_mean) || !r.Get(&x.cache_size_final) || !r.Get(&x.prompt_tokens) ||
        !r.Get(&x.generated_tokens) || !r.GetString(&x.worker) || !r.Get(&x.duration_seconds) || !r.Get(&has_stats)) {
      return false;
    }
    if (has_stats != 0) {
      NormStats s;
      if (!r.Get(&s.count) || !r.GetArray(s.mean.data(), s.mean.size()) || !r.GetArray(s.var.data(), s.var.size())) {
        return false;
      }
      x.norm_stats = s;
    }
    e->evaluations.push_back(std::move(x));
  } else if (type == kReference) {
    ReferenceResult x;
    if (!r.GetString(&x.task) || !r.Get(&x.prompt) || !r.Get(&x.score)) return false;
    e->references.push_back(std::move(x));
  } else {
    return false;
  }
  return r.done();
}

// "pid P on HOST since TIME": who holds the log's lock.
std::string Holder() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char since[32];
  std::strftime(since, sizeof since, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::string holder = "pid " + std::to_string(::getpid()) + " on " + host + " since " + since;
  holder.resize(kHolderBytes, '\0');
  return holder;
}

std::string Header(const std::string& holder) {
  std::string h(kMagic, sizeof kMagic);
  h.append(reinterpret_cast<const char*>(&kVersion), sizeof kVersion);
  return h + holder;
}

// The records' offset in `bytes` (a version 1 or 2 log), or 0 when it is not a progress log this build reads.
std::size_t RecordsAt(const std::string& bytes) {
  uint32_t version = 0;
  if (bytes.size() < kVersionedBytes || bytes.compare(0, sizeof kMagic, kMagic, sizeof kMagic) != 0) return 0;
  std::memcpy(&version, bytes.data() + sizeof kMagic, sizeof version);
  if (version == 1) return kVersionedBytes;
  if (version == 2 && bytes.size() >= kHeaderBytes) return kHeaderBytes;
  return 0;
}

// The holder a version 2 header names ("" when unknown).
std::string HolderOf(int fd) {
  std::string header(kHeaderBytes, '\0');
  if (::pread(fd, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size()) ||
      RecordsAt(header) != kHeaderBytes) {
    return "";
  }
  const std::string holder = header.substr(kVersionedBytes);
  return holder.substr(0, holder.find('\0'));
}

}  // namespace

std::string progress_log_path(const std::string& db, int64_t run_id) {
  // Beside the file itself, whatever symbolic link names it: a restart through another link finds the same log.
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::canonical(db, ec);
  return (ec ? db : real.string()) + ".run" + std::to_string(run_id) + ".progress";
}

std::string progress_log_holder(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string holder = HolderOf(fd);
  ::close(fd);
  return holder;
}

Result<std::unique_ptr<ProgressLog>> ProgressLog::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("cannot open the progress log " + path + ": " + std::strerror(errno));
  std::unique_ptr<ProgressLog> log(new ProgressLog(path, fd));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return Status::IOError("cannot lock the progress log " + path + ": " + std::strerror(errno));
    const std::string holder = HolderOf(fd);
    return Status::FailedPrecondition("another coordinator serves this run (" +
                                      (holder.empty() ? std::string("its pid and host unknown") : holder) +
                                      "; it holds the lock on " + path + "): stop it first, or let it finish");
  }
  std::string bytes;
  char buffer[1 << 16];
  for (ssize_t n; (n = ::pread(fd, buffer, sizeof buffer, static_cast<off_t>(bytes.size()))) > 0;) {
    bytes.append(buffer, static_cast<std::size_t>(n));
  }
  log->holder_ = Holder();
  if (bytes.empty()) {
    NAMM_RETURN_IF_ERROR(log->Rewrite(Header(log->holder_)));
    return log;
  }
  // A header cut short (a crash while Reset() rewrote the file) is an empty log.
  if (bytes.size() < kHeaderBytes && Header(log->holder_).compare(0, std::min(bytes.size(), kVersionedBytes), bytes, 0,
                                                                   std::min(bytes.size(), kVersionedBytes)) == 0) {
    NAMM_RETURN_IF_ERROR(log->Rewrite(Header(log->holder_)));
    return log;
  }
  const std::size_t records = RecordsAt(bytes);
  if (records == 0) {
    return Status::InvalidArgument(path + " is not a namm progress log (or of a newer version); refusing to use it");
  }
  std::map<uint64_t, LeaseRecord> issued;
  std::size_t at = records;
  while (at + 8 <= bytes.size()) {
    uint32_t length = 0, crc = 0;
    std::memcpy(&length, bytes.data() + at, 4);
    std::memcpy(&crc, bytes.data() + at + 4, 4);
    if (length > kMaxRecordBytes || at + 8 + length > bytes.size()) break;
    const std::string_view payload(bytes.data() + at + 8, length);
    if (crc32_of(payload) != crc || !Decode(payload, &issued, &log->recovered_)) break;
    at += 8 + length;
  }
  log->ignored_bytes_ = static_cast<int64_t>(bytes.size() - at);
  for (auto& [id, lease] : issued) log->recovered_.leases_issued.push_back(std::move(lease));
  if (log->ignored_bytes_ > 0 && ::ftruncate(fd, static_cast<off_t>(at)) != 0) {
    return Status::IOError("cannot cut the torn tail of " + path + ": " + std::strerror(errno));
  }
  log->end_ = at;
  // This process's name in place (an older build's version 1 header has no room: Reset() writes a new one).
  if (records == kHeaderBytes &&
      ::pwrite(fd, log->holder_.data(), kHolderBytes, kVersionedBytes) != static_cast<ssize_t>(kHolderBytes)) {
    return Status::IOError("cannot write to the progress log " + path + ": " + std::strerror(errno));
  }
  return log;
}

ProgressLog::~ProgressLog() { ::close(fd_); }

Status ProgressLog::Write(const std::string& bytes) {
  for (std::size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::pwrite(fd_, bytes.data() + at, bytes.size() - at, static_cast<off_t>(end_));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError("cannot append to the progress log " + path_ + ": " + std::strerror(errno));
    at += static_cast<std::size_t>(n);
    end_ += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status ProgressLog::Rewrite(const std::string& bytes) {
  if (::ftruncate(fd_, 0) != 0) {
    return Status::IOError("cannot truncate the progress log " + path_ + ": " + std::strerror(errno));
  }
  end_ = 0;
  const Status written = Write(bytes);
  if (!written.ok()) end_ = 0;  // the next Append() writes the header again, over whatever part went
  return written;
}

Status ProgressLog::Append(const ProgressEntries& entries) {
  if (entries.empty()) return Status::Ok();
  std::string bytes;
  Encode(entries, &bytes);
  std::lock_guard<std::mutex> lock(mu_);
  // A Reset() that emptied the file and could not write it again: the header goes first.
  if (end_ == 0) bytes = Header(holder_) + bytes;
  const uint64_t start = end_;
  const Status written = Write(bytes);
  // A torn record must not stay in the middle: reading stops there, and records appended after it (a later
  // append that fits again) would be lost on a restart although acknowledged. The next append overwrites it
  // even where the cut fails (an I/O error), and Open() cuts whatever follows the last whole record.
  if (!written.ok()) {
    (void)::ftruncate(fd_, static_cast<off_t>(start));
    end_ = start;
  }
  return written;
}

Status ProgressLog::Reset(const std::vector<LeaseRecord>& keep) {
  std::string bytes = Header(holder_);
  ProgressEntries leases;
  leases.leases_issued = keep;
  Encode(leases, &bytes);
  std::lock_guard<std::mutex> lock(mu_);
  return Rewrite(bytes);
}

}  // namespace namm::coordinator
