// The rehearsal device: a Paddle custom-device runtime whose "device" is host memory and whose
// XCCL collectives move data between the processes of one host through POSIX shared memory.
//
// - Device memory is aligned host memory; streams and events are synchronous (every call has
//   finished when it returns), so copies are plain memcpy.
// - A communicator is one shared-memory segment named by the unique id Paddle distributes
//   (made by rank 0, passed through Paddle's TCP store). Every rank maps it, and the last rank
//   to map it unlinks the name: nothing stays in /dev/shm, even when a rank dies later.
// - The name carries the run's tag (GPTPLAN_DEVICE_RUN, set by whoever launches one run's
//   ranks), and a rank joins only a communicator of its own run: two runs on one machine whose
//   ranks met at one rendezvous port (chosen free by one launcher, taken by another before it
//   was bound) end with an error naming both, never share a communicator.
// - Collectives: each rank writes its chunk into its own slot, a phase barrier, every rank
//   reads the slots it needs (reductions in rank order, so every rank gets the same bits), a
//   second barrier before the slots are reused. Large buffers go through in slot-sized chunks.
// - send/recv: one ring buffer per ordered pair of ranks. A send copies what fits and returns;
//   the rest waits in an outbox that every later call (recv, collectives, stream syncs) moves
//   on, so isend/isend/irecv/irecv cannot deadlock. group_start/group_end run the queued
//   sends and receives together.
// - Every wait has a deadline (GPTPLAN_DEVICE_TIMEOUT_S, default 120 s) and checks whether the
//   peer's process still exists: a dead or hung peer ends the call with an error, never a hang.
// - No helper threads (a thread blocked at exit would keep the process alive).

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "paddle/phi/backends/device_ext.h"

#include "device_name.h"

namespace {

// ---------------------------------------------------------------------------------------------
// settings and errors

double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double d = std::strtod(v, &end);
  if (end == v || d <= 0) return fallback;
  return d;
}

double timeout_s() {
  static double t = env_double("GPTPLAN_DEVICE_TIMEOUT_S", 120.0);
  return t;
}

size_t slot_bytes() {
  static size_t s = static_cast<size_t>(env_double("GPTPLAN_DEVICE_SLOT_MB", 4.0) * 1048576.0) & ~size_t(63);
  return std::max<size_t>(s, 4096);
}

size_t chan_bytes() {
  static size_t s = static_cast<size_t>(env_double("GPTPLAN_DEVICE_CHANNEL_MB", 4.0) * 1048576.0) & ~size_t(63);
  return std::max<size_t>(s, 4096);
}

void report(const std::string& what) {
  std::fprintf(stderr, "[%s device, pid %d] %s\n", GPTPLAN_DEVICE_TYPE, getpid(), what.c_str());
  std::fflush(stderr);
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool process_gone(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) == -1 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  return p != nullptr && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

// Spins briefly, then yields, then sleeps: 2-4 processes share a few cores.
struct Backoff {
  unsigned n = 0;
  void pause() {
    ++n;
    if (n < 64) return;
    if (n < 256) {
      sched_yield();
      return;
    }
    timespec ts{0, n < 2048 ? 20000 : 200000};
    nanosleep(&ts, nullptr);
  }
};

// ---------------------------------------------------------------------------------------------
// the shared segment

constexpr uint64_t kMagic = 0x6770706c616e6476ULL;  // "gpplandv"
constexpr size_t kLine = 64;

struct alignas(kLine) Counter {
  std::atomic<uint64_t> v;
  char pad[kLine - sizeof(std::atomic<uint64_t>)];
};

struct Header {
  std::atomic<uint64_t> magic;
  uint64_t nranks;
  uint64_t slot;
  uint64_t chan;
  uint64_t total;
  std::atomic<uint64_t> attached;
  std::atomic<uint64_t> aborted;  // set by a rank that failed: the others stop waiting
  char pad[kLine - 7 * sizeof(uint64_t)];
};

struct PendingSend {
  std::vector<char> data;  // what did not fit into the ring yet
  size_t done = 0;
};

}  // namespace

struct C_CCLComm_st {
  std::string name;
  size_t rank = 0;
  size_t nranks = 0;
  char* base = nullptr;
  size_t size = 0;
  Header* hdr = nullptr;
  Counter* pids = nullptr;    // [nranks]
  Counter* phase = nullptr;   // [nranks]
  Counter* heads = nullptr;   // [nranks*nranks] bytes written by src into (src, dst)
  Counter* tails = nullptr;   // [nranks*nranks] bytes read by dst from (src, dst)
  char* slots = nullptr;      // [nranks][slot]
  char* chans = nullptr;      // [nranks*nranks][chan]
  uint64_t my_phase = 0;
  std::vector<std::deque<PendingSend>> outbox;  // per destination
  size_t pending = 0;
  bool broken = false;
  std::recursive_mutex mu;

  char* slot(size_t r) { return slots + r * hdr->slot; }
  size_t pair(size_t src, size_t dst) const { return src * nranks + dst; }
  char* chan(size_t src, size_t dst) { return chans + pair(src, dst) * hdr->chan; }
};

namespace {

// Live communicators, for syncs that move the outboxes on. Never destroyed: Paddle destroys its
// communicators from its own static destructors, which may run after this library's.
std::mutex& g_comms_mu = *new std::mutex();
std::vector<C_CCLComm>& g_comms = *new std::vector<C_CCLComm>();

// One wait with a deadline; `ready` is polled. Returns false (after reporting) on a deadline,
// a dead peer or an abort by another rank.
template <typename Ready>
bool wait_for(C_CCLComm comm, const char* what, long peer, Ready ready) {
  if (ready()) return true;
  Backoff b;
  double start = now_s();
  double next_check = start + 0.2;
  while (!ready()) {
    b.pause();
    if ((b.n & 63) != 0) continue;
    double t = now_s();
    if (t < next_check) continue;
    next_check = t + 0.2;
    if (comm->hdr->aborted.load(std::memory_order_acquire) != 0) {
      report(std::string(what) + ": another rank of the communicator failed; giving up");
      comm->broken = true;
      return false;
    }
    for (size_t r = 0; r < comm->nranks; ++r) {
      if (peer >= 0 && static_cast<size_t>(peer) != r) continue;
      int pid = static_cast<int>(comm->pids[r].v.load(std::memory_order_acquire));
      if (r != comm->rank && process_gone(pid)) {
        report(std::string(what) + ": rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
               ") of the communicator has exited");
        comm->hdr->aborted.store(1, std::memory_order_release);
        comm->broken = true;
        return false;
      }
    }
    if (t - start > timeout_s()) {
      report(std::string(what) + ": no answer from " +
             (peer >= 0 ? "rank " + std::to_string(peer) : std::string("the other ranks")) + " within " +
             std::to_string(static_cast<int>(timeout_s())) + " s (GPTPLAN_DEVICE_TIMEOUT_S)");
      comm->hdr->aborted.store(1, std::memory_order_release);
      comm->broken = true;
      return false;
    }
  }
  return true;
}

bool barrier(C_CCLComm comm, const char* what) {
  uint64_t p = ++comm->my_phase;
  comm->phase[comm->rank].v.store(p, std::memory_order_release);
  for (size_t r = 0; r < comm->nranks; ++r) {
    if (r == comm->rank) continue;
    if (!wait_for(comm, what, -1, [&] { return comm->phase[r].v.load(std::memory_order_acquire) >= p; }))
      return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// data types and reductions

size_t dtype_size(C_DataType t) {
  switch (t) {
    case BOOL:
    case UINT8:
    case INT8:
      return 1;
    case UINT16:
    case INT16:
    case FLOAT16:
    case BFLOAT16:
      return 2;
    case UINT32:
    case INT32:
    case FLOAT32:
      return 4;
    case UINT64:
    case INT64:
    case FLOAT64:
    case COMPLEX64:
      return 8;
    case COMPLEX128:
      return 16;
    default:
      return 0;
  }
}

const char* dtype_name(C_DataType t) {
  static const char* names[] = {"undefined", "bool",    "uint8",   "uint16",  "uint32",   "uint64",
                                "int8",      "int16",   "int32",   "int64",   "float16",  "float32",
                                "float64",   "bfloat16", "complex64", "complex128"};
  int i = static_cast<int>(t);
  return (i >= 0 && i < 16) ? names[i] : "unknown";
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
  if (exp == 0) {
    if (man == 0) {
      f = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ff;
      f = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (man << 13);
  } else {
    f = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

uint16_t float_to_half(float value) {  // round to nearest even, as Paddle's float16
  uint32_t x;
  std::memcpy(&x, &value, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (ax < 0x38800000u) {                                              // subnormal or zero
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent
  uint32_t rounded = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | rounded);
}

float bf16_to_float(uint16_t b) {
  uint32_t f = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

uint16_t float_to_bf16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

template <typename T, typename A>
void reduce_typed(C_CCLReduceOp op, void* dst, const void* const* srcs, size_t nsrc, size_t n, size_t nranks) {
  T* out = static_cast<T*>(dst);
  for (size_t i = 0; i < n; ++i) {
    A acc = static_cast<A>(static_cast<const T*>(srcs[0])[i]);
    for (size_t s = 1; s < nsrc; ++s) {
      A v = static_cast<A>(static_cast<const T*>(srcs[s])[i]);
      switch (op) {
        case SUM:
        case AVG:
          acc = acc + v;
          break;
        case MAX:
          acc = v > acc ? v : acc;
          break;
        case MIN:
          acc = v < acc ? v : acc;
          break;
        case PRODUCT:
          acc = acc * v;
          break;
      }
    }
    if (op == AVG) acc = acc / static_cast<A>(nranks);
    out[i] = static_cast<T>(acc);
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce_16(C_CCLReduceOp op, void* dst, const void* const* srcs, size_t nsrc, size_t n, size_t nranks) {
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float acc = ToF(static_cast<const uint16_t*>(srcs[0])[i]);
    for (size_t s = 1; s < nsrc; ++s) {
      float v = ToF(static_cast<const uint16_t*>(srcs[s])[i]);
      switch (op) {
        case SUM:
        case AVG:
          acc += v;
          break;
        case MAX:
          acc = v > acc ? v : acc;
          break;
        case MIN:
          acc = v < acc ? v : acc;
          break;
        case PRODUCT:
          acc *= v;
          break;
      }
    }
    if (op == AVG) acc /= static_cast<float>(nranks);
    out[i] = FromF(acc);
  }
}

// dst[i] = op over srcs[s][i], s in order; false for a type the device cannot reduce
bool reduce_into(C_DataType t, C_CCLReduceOp op, void* dst, const void* const* srcs, size_t nsrc, size_t n,
                 size_t nranks) {
  switch (t) {
    case BOOL:
      if (op == SUM || op == MAX) {
        op = MAX;
      } else if (op == PRODUCT) {
        op = MIN;
      }
      reduce_typed<uint8_t, unsigned>(op == AVG ? MAX : op, dst, srcs, nsrc, n, nranks);
      return true;
    case UINT8:
      reduce_typed<uint8_t, unsigned>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case INT8:
      reduce_typed<int8_t, int>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case UINT16:
      reduce_typed<uint16_t, unsigned>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case INT16:
      reduce_typed<int16_t, int>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case UINT32:
      reduce_typed<uint32_t, uint32_t>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case INT32:
      reduce_typed<int32_t, int32_t>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case UINT64:
      reduce_typed<uint64_t, uint64_t>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case INT64:
      reduce_typed<int64_t, int64_t>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case FLOAT32:
      reduce_typed<float, float>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case FLOAT64:
      reduce_typed<double, double>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case FLOAT16:
      reduce_16<half_to_float, float_to_half>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case BFLOAT16:
      reduce_16<bf16_to_float, float_to_bf16>(op, dst, srcs, nsrc, n, nranks);
      return true;
    case COMPLEX64:
      if (op != SUM) return false;
      reduce_typed<float, float>(op, dst, srcs, nsrc, 2 * n, nranks);
      return true;
    case COMPLEX128:
      if (op != SUM) return false;
      reduce_typed<double, double>(op, dst, srcs, nsrc, 2 * n, nranks);
      return true;
    default:
      return false;
  }
}

C_Status unsupported(const char* what, C_DataType t) {
  report(std::string(what) + ": data type " + dtype_name(t) + " is not supported");
  return C_ERROR;
}

// ---------------------------------------------------------------------------------------------
// point to point

// Moves as much of `src` as fits into the ring (src -> dst); returns the bytes moved.
size_t push_ring(C_CCLComm comm, size_t dst, const char* data, size_t len) {
  size_t cap = comm->hdr->chan;
  size_t p = comm->pair(comm->rank, dst);
  uint64_t head = comm->heads[p].v.load(std::memory_order_relaxed);
  uint64_t tail = comm->tails[p].v.load(std::memory_order_acquire);
  size_t space = cap - static_cast<size_t>(head - tail);
  size_t n = std::min(space, len);
  char* ring = comm->chan(comm->rank, dst);
  size_t moved = 0;
  while (moved < n) {
    size_t off = static_cast<size_t>((head + moved) % cap);
    size_t k = std::min(n - moved, cap - off);
    std::memcpy(ring + off, data + moved, k);
    moved += k;
  }
  if (n > 0) comm->heads[p].v.store(head + n, std::memory_order_release);
  return n;
}

size_t pull_ring(C_CCLComm comm, size_t src, char* out, size_t len) {
  size_t cap = comm->hdr->chan;
  size_t p = comm->pair(src, comm->rank);
  uint64_t tail = comm->tails[p].v.load(std::memory_order_relaxed);
  uint64_t head = comm->heads[p].v.load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(head - tail);
  size_t n = std::min(avail, len);
  const char* ring = comm->chan(src, comm->rank);
  size_t moved = 0;
  while (moved < n) {
    size_t off = static_cast<size_t>((tail + moved) % cap);
    size_t k = std::min(n - moved, cap - off);
    std::memcpy(out + moved, ring + off, k);
    moved += k;
  }
  if (n > 0) comm->tails[p].v.store(tail + n, std::memory_order_release);
  return n;
}

// Moves every queued send of `comm` on as far as the rings allow; true if something moved.
bool progress_outbox(C_CCLComm comm) {
  if (comm->pending == 0) return false;
  bool moved = false;
  for (size_t d = 0; d < comm->nranks; ++d) {
    auto& q = comm->outbox[d];
    while (!q.empty()) {
      PendingSend& s = q.front();
      size_t n = push_ring(comm, d, s.data.data() + s.done, s.data.size() - s.done);
      if (n > 0) moved = true;
      s.done += n;
      if (s.done < s.data.size()) break;
      q.pop_front();
      --comm->pending;
    }
  }
  return moved;
}

void progress_all() {
  std::lock_guard<std::mutex> g(g_comms_mu);
  for (C_CCLComm c : g_comms) {
    if (c->pending == 0) continue;
    std::lock_guard<std::recursive_mutex> l(c->mu);
    progress_outbox(c);
  }
}

// A send: what fits goes into the ring now, the rest is copied into the outbox (the caller may
// reuse its buffer as soon as this returns).
void post_send(C_CCLComm comm, size_t dst, const char* data, size_t len) {
  size_t n = 0;
  if (comm->outbox[dst].empty()) n = push_ring(comm, dst, data, len);
  if (n < len) {
    PendingSend s;
    s.data.assign(data + n, data + len);
    comm->outbox[dst].push_back(std::move(s));
    ++comm->pending;
  }
}

bool complete_recv(C_CCLComm comm, size_t src, char* out, size_t len) {
  size_t got = 0;
  return wait_for(comm, "recv", static_cast<long>(src), [&] {
    progress_outbox(comm);
    got += pull_ring(comm, src, out + got, len - got);
    return got == len;
  });
}

bool flush_outbox(C_CCLComm comm, const char* what) {
  if (comm->pending == 0) return true;
  return wait_for(comm, what, -1, [&] {
    progress_outbox(comm);
    return comm->pending == 0;
  });
}

struct GroupOp {
  bool is_send;
  C_CCLComm comm;
  size_t peer;
  char* buf;
  size_t len;
};

thread_local int g_group_depth = 0;
thread_local std::vector<GroupOp> g_group_ops;

bool run_group(std::vector<GroupOp>& ops) {
  for (auto& op : ops)
    if (op.is_send) {
      std::lock_guard<std::recursive_mutex> l(op.comm->mu);
      post_send(op.comm, op.peer, op.buf, op.len);
    }
  std::vector<size_t> got(ops.size(), 0);
  for (size_t i = 0; i < ops.size(); ++i) {
    GroupOp& op = ops[i];
    if (op.is_send) continue;
    std::lock_guard<std::recursive_mutex> l(op.comm->mu);
    bool ok = wait_for(op.comm, "recv (grouped)", static_cast<long>(op.peer), [&] {
      for (auto& o : ops) progress_outbox(o.comm);
      got[i] += pull_ring(op.comm, op.peer, op.buf + got[i], op.len - got[i]);
      return got[i] == op.len;
    });
    if (!ok) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// communicators

std::string hex_random(size_t n) {
  std::string s;
  unsigned char buf[32];
  FILE* f = std::fopen("/dev/urandom", "rb");
  size_t got = f ? std::fread(buf, 1, sizeof(buf), f) : 0;
  if (f) std::fclose(f);
  if (got < sizeof(buf)) {
    uint64_t x = static_cast<uint64_t>(getpid()) * 0x9e3779b97f4a7c15ULL ^
                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    for (auto& c : buf) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      c = static_cast<unsigned char>(x);
    }
  }
  static const char* digits = "0123456789abcdef";
  for (size_t i = 0; i < n && i < sizeof(buf); ++i) {
    s.push_back(digits[buf[i] >> 4]);
    s.push_back(digits[buf[i] & 15]);
  }
  return s;
}

constexpr size_t kUniqueIdSize = 64;
constexpr size_t kRunTagMax = 16;

// This process's run tag: GPTPLAN_DEVICE_RUN's letters and digits (at most kRunTagMax), '' when
// unset. Read at each use (a process may set it before its first collective).
std::string run_tag() {
  const char* v = std::getenv("GPTPLAN_DEVICE_RUN");
  std::string s;
  for (; v != nullptr && *v != '\0' && s.size() < kRunTagMax; ++v) {
    if ((*v >= '0' && *v <= '9') || (*v >= 'a' && *v <= 'z') || (*v >= 'A' && *v <= 'Z')) s.push_back(*v);
  }
  return s;
}

// The run tag inside a communicator name "/<device>-[<tag>-]<random hex>" ('' when none).
std::string tag_of(const std::string& name) {
  std::string prefix = std::string("/") + GPTPLAN_DEVICE_TYPE + "-";
  if (name.compare(0, prefix.size(), prefix) != 0) return "";
  size_t dash = name.find('-', prefix.size());
  return dash == std::string::npos ? "" : name.substr(prefix.size(), dash - prefix.size());
}

size_t layout(size_t nranks, size_t slot, size_t chan, size_t* off_pids, size_t* off_phase, size_t* off_heads,
              size_t* off_tails, size_t* off_slots, size_t* off_chans) {
  size_t o = sizeof(Header);
  *off_pids = o;
  o += nranks * sizeof(Counter);
  *off_phase = o;
  o += nranks * sizeof(Counter);
  *off_heads = o;
  o += nranks * nranks * sizeof(Counter);
  *off_tails = o;
  o += nranks * nranks * sizeof(Counter);
  o = (o + 4095) & ~size_t(4095);
  *off_slots = o;
  o += nranks * slot;
  *off_chans = o;
  o += nranks * nranks * chan;
  return o;
}

void bind(C_CCLComm c) {
  size_t a, b, h, t, s, ch;
  layout(c->nranks, c->hdr->slot, c->hdr->chan, &a, &b, &h, &t, &s, &ch);
  c->pids = reinterpret_cast<Counter*>(c->base + a);
  c->phase = reinterpret_cast<Counter*>(c->base + b);
  c->heads = reinterpret_cast<Counter*>(c->base + h);
  c->tails = reinterpret_cast<Counter*>(c->base + t);
  c->slots = c->base + s;
  c->chans = c->base + ch;
}

C_Status comm_init(size_t nranks, C_CCLRootId* unique_id, size_t rank, C_CCLComm* out) {
  if (unique_id == nullptr || unique_id->data == nullptr || unique_id->sz < 8) {
    report("comm_init: no unique id");
    return C_ERROR;
  }
  std::string name(static_cast<const char*>(unique_id->data), strnlen(static_cast<const char*>(unique_id->data), unique_id->sz));
  if (tag_of(name) != run_tag()) {
    auto shown = [](const std::string& t) { return t.empty() ? std::string("none") : t; };
    report("comm_init: communicator " + name + " belongs to another run (run tag " + shown(tag_of(name)) +
           "; this rank's GPTPLAN_DEVICE_RUN: " + shown(run_tag()) +
           "): two runs on this machine met at one rendezvous port; not joining it");
    return C_ERROR;
  }
  auto* c = new C_CCLComm_st();
  c->name = name;
  c->rank = rank;
  c->nranks = nranks;
  c->outbox.resize(nranks);
  double start = now_s();
  int fd = -1;
  if (rank == 0) {
    size_t a, b, h, t, s, ch;
    size_t total = layout(nranks, slot_bytes(), chan_bytes(), &a, &b, &h, &t, &s, &ch);
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(total)) != 0) {
      report("comm_init: cannot create shared memory " + name + ": " + std::strerror(errno));
      if (fd >= 0) {
        close(fd);
        shm_unlink(name.c_str());
      }
      delete c;
      return C_FAILED;
    }
    c->size = total;
  } else {
    Backoff b;
    for (;;) {
      fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_size > 0) {
          c->size = static_cast<size_t>(st.st_size);
          break;
        }
        close(fd);
        fd = -1;
      }
      if (now_s() - start > timeout_s()) {
        report("comm_init: rank 0 did not create " + name + " within " +
               std::to_string(static_cast<int>(timeout_s())) + " s (GPTPLAN_DEVICE_TIMEOUT_S)");
        delete c;
        return C_FAILED;
      }
      b.pause();
    }
  }
  void* p = mmap(nullptr, c->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    report("comm_init: cannot map " + name + ": " + std::strerror(errno));
    shm_unlink(name.c_str());
    delete c;
    return C_FAILED;
  }
  c->base = static_cast<char*>(p);
  c->hdr = reinterpret_cast<Header*>(c->base);
  if (rank == 0) {
    c->hdr->nranks = nranks;
    c->hdr->slot = slot_bytes();
    c->hdr->chan = chan_bytes();
    c->hdr->total = c->size;
    c->hdr->magic.store(kMagic, std::memory_order_release);
  } else {
    Backoff b;
    while (c->hdr->magic.load(std::memory_order_acquire) != kMagic) {
      if (now_s() - start > timeout_s()) {
        report("comm_init: " + name + " was never initialised by rank 0");
        munmap(c->base, c->size);
        shm_unlink(name.c_str());
        delete c;
        return C_FAILED;
      }
      b.pause();
    }
    if (c->hdr->nranks != nranks) {
      report("comm_init: " + name + " has " + std::to_string(c->hdr->nranks) + " ranks, this rank expected " +
             std::to_string(nranks));
      munmap(c->base, c->size);
      delete c;
      return C_ERROR;
    }
  }
  bind(c);
  c->pids[rank].v.store(static_cast<uint64_t>(getpid()), std::memory_order_release);
  uint64_t n = c->hdr->attached.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (n == nranks) shm_unlink(name.c_str());  // every rank has it mapped: the name can go
  bool ok = wait_for(c, "comm_init", -1, [&] { return c->hdr->attached.load(std::memory_order_acquire) >= nranks; });
  if (!ok) {
    shm_unlink(name.c_str());  // a rank never came: do not leave the name behind
    munmap(c->base, c->size);
    delete c;
    return C_FAILED;
  }
  {
    std::lock_guard<std::mutex> g(g_comms_mu);
    g_comms.push_back(c);
  }
  *out = c;
  return C_SUCCESS;
}

C_Status comm_destroy(C_CCLComm c) {
  if (c == nullptr) return C_SUCCESS;
  {
    std::lock_guard<std::mutex> g(g_comms_mu);
    g_comms.erase(std::remove(g_comms.begin(), g_comms.end(), c), g_comms.end());
  }
  if (!c->broken) flush_outbox(c, "destroy_comm");
  munmap(c->base, c->size);
  delete c;
  return C_SUCCESS;
}

#define CHECK_COMM(what)                                                          \
  if (comm == nullptr) {                                                          \
    report(std::string(what) + ": no communicator");                              \
    return C_ERROR;                                                               \
  }                                                                               \
  std::lock_guard<std::recursive_mutex> lock_(comm->mu);                          \
  if (comm->broken) {                                                             \
    report(std::string(what) + ": the communicator failed before; not usable");   \
    return C_FAILED;                                                              \
  }                                                                               \
  progress_outbox(comm);

// ---------------------------------------------------------------------------------------------
// collectives

C_Status all_reduce(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op, C_CCLComm comm, C_Stream) {
  CHECK_COMM("all_reduce");
  size_t es = dtype_size(t);
  if (es == 0) return unsupported("all_reduce", t);
  size_t per = comm->hdr->slot / es;
  std::vector<const void*> srcs(comm->nranks);
  for (size_t off = 0; off < count || (off == 0 && count == 0); off += per) {
    size_t n = std::min(per, count - off);
    if (count == 0) break;
    std::memcpy(comm->slot(comm->rank), static_cast<char*>(send) + off * es, n * es);
    if (!barrier(comm, "all_reduce")) return C_FAILED;
    for (size_t r = 0; r < comm->nranks; ++r) srcs[r] = comm->slot(r);
    if (!reduce_into(t, op, static_cast<char*>(recv) + off * es, srcs.data(), comm->nranks, n, comm->nranks)) {
      barrier(comm, "all_reduce");
      return unsupported("all_reduce", t);
    }
    if (!barrier(comm, "all_reduce")) return C_FAILED;
  }
  return C_SUCCESS;
}

C_Status reduce(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op, size_t root, C_CCLComm comm,
                C_Stream) {
  CHECK_COMM("reduce");
  size_t es = dtype_size(t);
  if (es == 0) return unsupported("reduce", t);
  size_t per = comm->hdr->slot / es;
  std::vector<const void*> srcs(comm->nranks);
  for (size_t off = 0; off < count; off += per) {
    size_t n = std::min(per, count - off);
    std::memcpy(comm->slot(comm->rank), static_cast<char*>(send) + off * es, n * es);
    if (!barrier(comm, "reduce")) return C_FAILED;
    bool ok = true;
    if (comm->rank == root) {
      for (size_t r = 0; r < comm->nranks; ++r) srcs[r] = comm->slot(r);
      ok = reduce_into(t, op, static_cast<char*>(recv) + off * es, srcs.data(), comm->nranks, n, comm->nranks);
    }
    if (!barrier(comm, "reduce")) return C_FAILED;
    if (!ok) return unsupported("reduce", t);
  }
  return C_SUCCESS;
}

C_Status broadcast(void* buf, size_t count, C_DataType t, size_t root, C_CCLComm comm, C_Stream) {
  CHECK_COMM("broadcast");
  size_t es = dtype_size(t);
  if (es == 0) return unsupported("broadcast", t);
  size_t bytes = count * es, per = comm->hdr->slot;
  for (size_t off = 0; off < bytes; off += per) {
    size_t n = std::min(per, bytes - off);
    if (comm->rank == root) std::memcpy(comm->slot(root), static_cast<char*>(buf) + off, n);
    if (!barrier(comm, "broadcast")) return C_FAILED;
    if (comm->rank != root) std::memcpy(static_cast<char*>(buf) + off, comm->slot(root), n);
    if (!barrier(comm, "broadcast")) return C_FAILED;
  }
  return C_SUCCESS;
}

C_Status all_gather(void* send, void* recv, size_t count, C_DataType t, C_CCLComm comm, C_Stream) {
  CHECK_COMM("all_gather");
  size_t es = dtype_size(t);
  if (es == 0) return unsupported("all_gather", t);
  size_t bytes = count * es, per = comm->hdr->slot;
  for (size_t off = 0; off < bytes; off += per) {
    size_t n = std::min(per, bytes - off);
    std::memcpy(comm->slot(comm->rank), static_cast<char*>(send) + off, n);
    if (!barrier(comm, "all_gather")) return C_FAILED;
    for (size_t r = 0; r < comm->nranks; ++r)
      std::memcpy(static_cast<char*>(recv) + r * bytes + off, comm->slot(r), n);
    if (!barrier(comm, "all_gather")) return C_FAILED;
  }
  return C_SUCCESS;
}

// send holds nranks blocks of `count`; this rank gets the reduction of every rank's block `rank`
C_Status reduce_scatter(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op, C_CCLComm comm,
                        C_Stream) {
  CHECK_COMM("reduce_scatter");
  size_t es = dtype_size(t);
  if (es == 0) return unsupported("reduce_scatter", t);
  size_t R = comm->nranks;
  size_t per = comm->hdr->slot / (es * R);  // elements per destination block per round
  if (per == 0) per = 1;
  std::vector<const void*> srcs(R);
  for (size_t off = 0; off < count; off += per) {
    size_t n = std::min(per, count - off);
    char* mine = comm->slot(comm->rank);
    for (size_t d = 0; d < R; ++d)
      std::memcpy(mine + d * per * es, static_cast<char*>(send) + (d * count + off) * es, n * es);
    if (!barrier(comm, "reduce_scatter")) return C_FAILED;
    for (size_t r = 0; r < R; ++r) srcs[r] = comm->slot(r) + comm->rank * per * es;
    bool ok = reduce_into(t, op, static_cast<char*>(recv) + off * es, srcs.data(), R, n, R);
    if (!barrier(comm, "reduce_scatter")) return C_FAILED;
    if (!ok) return unsupported("reduce_scatter", t);
  }
  return C_SUCCESS;
}

C_Status all_to_all(const void** send, const size_t* send_count, const C_DataType* send_t, void** recv,
                    const size_t* recv_count, const C_DataType* recv_t, size_t rank, size_t nranks, C_CCLComm comm,
                    C_Stream) {
  CHECK_COMM("all_to_all");
  (void)rank;
  std::vector<GroupOp> ops;
  for (size_t r = 0; r < nranks; ++r) {
    size_t sb = send_count[r] * dtype_size(send_t[r]);
    size_t rb = recv_count[r] * dtype_size(recv_t[r]);
    if (r == comm->rank) {
      std::memcpy(recv[r], send[r], std::min(sb, rb));
      continue;
    }
    ops.push_back({true, comm, r, const_cast<char*>(static_cast<const char*>(send[r])), sb});
    ops.push_back({false, comm, r, static_cast<char*>(recv[r]), rb});
  }
  return run_group(ops) ? C_SUCCESS : C_FAILED;
}

bool tracing();

C_Status send(void* buf, size_t count, C_DataType t, size_t dst, C_CCLComm comm, C_Stream) {
  CHECK_COMM("send");
  if (tracing()) report("send " + std::to_string(count) + " to " + std::to_string(dst) + " on " + comm->name);
  size_t len = count * dtype_size(t);
  if (g_group_depth > 0) {
    g_group_ops.push_back({true, comm, dst, static_cast<char*>(buf), len});
    return C_SUCCESS;
  }
  post_send(comm, dst, static_cast<const char*>(buf), len);
  return C_SUCCESS;
}

C_Status recv(void* buf, size_t count, C_DataType t, size_t src, C_CCLComm comm, C_Stream) {
  CHECK_COMM("recv");
  if (tracing()) report("recv " + std::to_string(count) + " from " + std::to_string(src) + " on " + comm->name);
  size_t len = count * dtype_size(t);
  if (g_group_depth > 0) {
    g_group_ops.push_back({false, comm, src, static_cast<char*>(buf), len});
    return C_SUCCESS;
  }
  return complete_recv(comm, src, static_cast<char*>(buf), len) ? C_SUCCESS : C_FAILED;
}

bool tracing() {
  static bool on = [] {
    const char* v = std::getenv("GPTPLAN_DEVICE_TRACE");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

C_Status group_start() {
  if (tracing()) report("group_start");
  ++g_group_depth;
  return C_SUCCESS;
}

C_Status group_end() {
  if (g_group_depth <= 0) return C_ERROR;
  if (--g_group_depth > 0) return C_SUCCESS;
  std::vector<GroupOp> ops;
  ops.swap(g_group_ops);
  return run_group(ops) ? C_SUCCESS : C_FAILED;
}

C_Status unique_id_size(size_t* sz) {
  *sz = kUniqueIdSize;
  return C_SUCCESS;
}

C_Status unique_id(C_CCLRootId* id) {
  if (id->sz < kUniqueIdSize) return C_ERROR;
  std::string tag = run_tag();
  std::string name = std::string("/") + GPTPLAN_DEVICE_TYPE + "-" + (tag.empty() ? "" : tag + "-") + hex_random(16);
  std::memset(id->data, 0, id->sz);
  std::memcpy(id->data, name.data(), std::min(name.size(), id->sz - 1));
  return C_SUCCESS;
}

C_Status comm_name(C_CCLComm comm, char* out) {
  if (comm == nullptr || out == nullptr) return C_ERROR;
  std::strncpy(out, comm->name.c_str(), 127);
  return C_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// device, memory, streams

int g_current = 0;

C_Status ok_device(const C_Device) { return C_SUCCESS; }
C_Status set_device(const C_Device d) {
  g_current = d->id;
  return C_SUCCESS;
}
C_Status get_device(const C_Device d) {
  d->id = g_current;
  return C_SUCCESS;
}
C_Status no_op() { return C_SUCCESS; }

size_t device_count() {
  static size_t n = static_cast<size_t>(env_double("GPTPLAN_DEVICE_COUNT", 8.0));
  return std::max<size_t>(1, std::min<size_t>(n, 64));
}

C_Status get_count(size_t* count) {
  *count = device_count();
  return C_SUCCESS;
}

C_Status get_list(size_t* devices) {
  for (size_t i = 0; i < device_count(); ++i) devices[i] = i;
  return C_SUCCESS;
}

C_Status allocate(const C_Device, void** ptr, size_t size) {
  size_t n = (std::max<size_t>(size, 1) + 63) & ~size_t(63);
  void* p = std::aligned_alloc(64, n);
  *ptr = p;
  return p ? C_SUCCESS : C_FAILED;
}

C_Status deallocate(const C_Device, void* ptr, size_t) {
  std::free(ptr);
  return C_SUCCESS;
}

C_Status memory_set(const C_Device, void* ptr, unsigned char value, size_t size) {
  std::memset(ptr, value, size);
  return C_SUCCESS;
}

C_Status copy(const C_Device, void* dst, const void* src, size_t size) {
  if (size) std::memmove(dst, src, size);
  return C_SUCCESS;
}
C_Status copy_async(const C_Device, C_Stream, void* dst, const void* src, size_t size) {
  if (size) std::memmove(dst, src, size);
  return C_SUCCESS;
}
C_Status copy_p2p(const C_Device, const C_Device, void* dst, const void* src, size_t size) {
  if (size) std::memmove(dst, src, size);
  return C_SUCCESS;
}
C_Status copy_p2p_async(const C_Device, const C_Device, C_Stream, void* dst, const void* src, size_t size) {
  if (size) std::memmove(dst, src, size);
  return C_SUCCESS;
}

// Streams and events are synchronous, so they carry no state: every handle is the same static
// object and destroying one frees nothing (Paddle may destroy a handle more than once at exit).
struct C_Stream_st {
  int unused;
};
struct C_Event_st {
  int unused;
};
C_Stream_st g_stream{0};
C_Event_st g_event{0};

C_Status create_stream(const C_Device, C_Stream* s) {
  *s = reinterpret_cast<C_Stream>(&g_stream);
  return C_SUCCESS;
}
C_Status destroy_stream(const C_Device, C_Stream) { return C_SUCCESS; }
C_Status create_event(const C_Device, C_Event* e) {
  *e = reinterpret_cast<C_Event>(&g_event);
  return C_SUCCESS;
}
C_Status destroy_event(const C_Device, C_Event) { return C_SUCCESS; }
C_Status record_event(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }
C_Status query_stream(const C_Device, C_Stream) { return C_SUCCESS; }
C_Status query_event(const C_Device, C_Event) { return C_SUCCESS; }
C_Status sync_device(const C_Device) {
  progress_all();
  return C_SUCCESS;
}
C_Status sync_stream(const C_Device, C_Stream) {
  progress_all();
  return C_SUCCESS;
}
C_Status sync_event(const C_Device, C_Event) {
  progress_all();
  return C_SUCCESS;
}
C_Status stream_wait_event(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }
C_Status add_callback(const C_Device d, C_Stream s, C_Callback cb, void* user) {
  C_Status st = C_SUCCESS;
  cb(d, s, user, &st);
  return C_SUCCESS;
}

C_Status memory_stats(const C_Device, size_t* total, size_t* free_mem) {
  long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  *total = static_cast<size_t>(pages) * static_cast<size_t>(page);
  size_t avail_b = static_cast<size_t>(avail) * static_cast<size_t>(page);
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f != nullptr) {
    char line[256];
    while (std::fgets(line, sizeof(line), f)) {
      unsigned long kb;
      if (std::sscanf(line, "MemAvailable: %lu kB", &kb) == 1) {
        avail_b = static_cast<size_t>(kb) * 1024;
        break;
      }
    }
    std::fclose(f);
  }
  *free_mem = avail_b;
  return C_SUCCESS;
}

C_Status min_chunk(const C_Device, size_t* size) {
  *size = 64;
  return C_SUCCESS;
}

C_Status bool_false(const C_Device, bool* supported) {
  *supported = false;
  return C_SUCCESS;
}

C_Status bool_true(const C_Device, bool* supported) {
  *supported = true;
  return C_SUCCESS;
}

C_Status version(const C_Device, size_t* v) {
  *v = 1;
  return C_SUCCESS;
}

C_Status profiler_init(C_Profiler, void**) { return C_SUCCESS; }
C_Status profiler_void(C_Profiler, void*) { return C_SUCCESS; }
C_Status profiler_collect(C_Profiler, uint64_t, void*) { return C_SUCCESS; }

}  // namespace

// Paddle 3.3.1's ProcessGroupCustom does not pass its coalescing (the batched p2p of pipeline
// schedules) on to the plugin's group_start/group_end, so a ring of "recv then send" batches (the
// interleaved schedule's last stage -> first stage) would block every rank in its recv. The
// Python side (runner.device.install_paddle_hooks) brackets Paddle's coalescing with these.
extern "C" __attribute__((visibility("default"))) int gptplan_device_group_start() {
  return group_start() == C_SUCCESS ? 0 : 1;
}
extern "C" __attribute__((visibility("default"))) int gptplan_device_group_end() {
  return group_end() == C_SUCCESS ? 0 : 1;
}

extern "C" void InitPlugin(CustomRuntimeParams* params) {
  PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = const_cast<char*>(GPTPLAN_DEVICE_TYPE);
  params->sub_device_type = const_cast<char*>("host-memory");
  C_DeviceInterface* i = params->interface;
  std::memset(reinterpret_cast<void*>(i), 0, sizeof(C_DeviceInterface));
  i->size = sizeof(C_DeviceInterface);

  i->initialize = no_op;
  i->finalize = no_op;
  i->init_device = ok_device;
  i->set_device = set_device;
  i->get_device = get_device;
  i->deinit_device = ok_device;

  i->create_stream = create_stream;
  i->destroy_stream = destroy_stream;
  i->query_stream = query_stream;
  i->stream_add_callback = add_callback;
  i->create_event = create_event;
  i->destroy_event = destroy_event;
  i->record_event = record_event;
  i->query_event = query_event;
  i->synchronize_device = sync_device;
  i->synchronize_stream = sync_stream;
  i->synchronize_event = sync_event;
  i->stream_wait_event = stream_wait_event;

  i->device_memory_allocate = allocate;
  i->device_memory_deallocate = deallocate;
  i->device_memory_set = memory_set;
  i->host_memory_allocate = allocate;
  i->host_memory_deallocate = deallocate;
  i->unified_memory_allocate = allocate;
  i->unified_memory_deallocate = deallocate;
  i->memory_copy_h2d = copy;
  i->memory_copy_d2h = copy;
  i->memory_copy_d2d = copy;
  i->memory_copy_p2p = copy_p2p;
  i->async_memory_copy_h2d = copy_async;
  i->async_memory_copy_d2h = copy_async;
  i->async_memory_copy_d2d = copy_async;
  i->async_memory_copy_p2p = copy_p2p_async;

  i->get_device_count = get_count;
  i->get_device_list = get_list;
  i->device_memory_stats = memory_stats;
  i->device_min_chunk_size = min_chunk;
  i->get_runtime_version = version;
  i->get_driver_version = version;
  i->is_float16_supported = bool_true;
  i->is_bfloat16_supported = bool_true;
  i->is_dnn_supported = bool_false;

  i->xccl_get_comm_name = comm_name;
  i->xccl_get_unique_id_size = unique_id_size;
  i->xccl_get_unique_id = unique_id;
  i->xccl_comm_init_rank = comm_init;
  i->xccl_destroy_comm = comm_destroy;
  i->xccl_all_reduce = all_reduce;
  i->xccl_broadcast = broadcast;
  i->xccl_reduce = reduce;
  i->xccl_all_gather = all_gather;
  i->xccl_reduce_scatter = reduce_scatter;
  i->xccl_group_start = group_start;
  i->xccl_group_end = group_end;
  i->xccl_send = send;
  i->xccl_recv = recv;
  i->xccl_all_to_all = all_to_all;

  i->profiler_initialize = profiler_init;
  i->profiler_finalize = profiler_void;
  i->profiler_prepare_tracing = profiler_void;
  i->profiler_start_tracing = profiler_void;
  i->profiler_stop_tracing = profiler_void;
  i->profiler_collect_trace_data = profiler_collect;
}
