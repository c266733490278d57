#include "ucm/index.hpp"

#include <atomic>
#include <cstring>

namespace ucm {

namespace {

struct Header {
  std::uint64_t magic;
  std::uint64_t slots;
  std::atomic<std::uint64_t> seq;        // odd while the writer changes entries
  std::atomic<std::uint64_t> count;      // keys present
  std::atomic<std::uint64_t> incomplete; // a key could not be inserted: readers ask the service
};
static_assert(sizeof(Header) <= kIndexHeader, "header too large");

struct Entry {
  std::atomic<std::uint64_t> k0, k1;
};
static_assert(sizeof(Entry) == kIndexEntry, "entry must be 16 bytes");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "64-bit atomics must be lock-free");

constexpr int kReadTries = 16;

Header* header(void* mem) { return static_cast<Header*>(mem); }
const Header* header(const void* mem) { return static_cast<const Header*>(mem); }
Entry* entries(void* mem) { return reinterpret_cast<Entry*>(static_cast<char*>(mem) + kIndexHeader); }
const Entry* entries(const void* mem) {
  return reinterpret_cast<const Entry*>(static_cast<const char*>(mem) + kIndexHeader);
}

void split(const std::uint8_t* key, std::uint64_t& k0, std::uint64_t& k1) {
  std::memcpy(&k0, key, 8);
  std::memcpy(&k1, key + 8, 8);
}

// Keys are digests already; the multiply spreads crafted ones too.
std::uint64_t home(std::uint64_t k0, std::uint64_t k1, std::uint64_t mask) {
  return ((k0 ^ (k1 * 0x9E3779B97F4A7C15ULL)) * 0xBF58476D1CE4E5B9ULL >> 17) & mask;
}

// Slot of the key, or of the empty slot ending its probe sequence (found = false).
std::uint64_t probe(const Entry* e, std::uint64_t mask, std::uint64_t k0, std::uint64_t k1, bool& found) {
  std::uint64_t i = home(k0, k1, mask);
  for (std::uint64_t step = 0; step <= mask; ++step, i = (i + 1) & mask) {
    const std::uint64_t a = e[i].k0.load(std::memory_order_relaxed);
    const std::uint64_t b = e[i].k1.load(std::memory_order_relaxed);
    if (a == 0 && b == 0) break;  // empty (first: the all-zero key is never in the table)
    if (a == k0 && b == k1) {
      found = true;
      return i;
    }
  }
  found = false;
  return i;
}

struct WriteSection {
  Header* h;
  explicit WriteSection(Header* hh) : h(hh) {
    h->seq.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }
  ~WriteSection() { h->seq.fetch_add(1, std::memory_order_release); }
};

}  // namespace

std::size_t index_bytes(std::uint64_t slots) { return kIndexHeader + slots * kIndexEntry; }

void index_init(void* mem, std::uint64_t slots) {
  std::memset(mem, 0, index_bytes(slots));
  Header* h = header(mem);
  h->slots = slots;
  h->magic = kIndexMagic;
}

std::uint64_t index_slots(const void* mem, std::size_t len) {
  if (len < kIndexHeader) return 0;
  const Header* h = header(mem);
  const std::uint64_t slots = h->slots;
  if (h->magic != kIndexMagic || slots < 8 || (slots & (slots - 1)) != 0) return 0;
  if (slots > (len - kIndexHeader) / kIndexEntry) return 0;
  return slots;
}

bool index_insert(void* mem, const std::uint8_t* key) {
  Header* h = header(mem);
  const std::uint64_t mask = h->slots - 1;
  std::uint64_t k0, k1;
  split(key, k0, k1);
  if (k0 == 0 && k1 == 0) {  // the empty marker: cannot be indexed
    h->incomplete.store(1, std::memory_order_release);
    return false;
  }
  Entry* e = entries(mem);
  bool found;
  const std::uint64_t i = probe(e, mask, k0, k1, found);
  if (found) return true;
  // At most 3/4 full, so probe sequences stay short and always end.
  if (h->count.load(std::memory_order_relaxed) + 1 > h->slots / 4 * 3) {
    h->incomplete.store(1, std::memory_order_release);
    return false;
  }
  WriteSection w(h);
  e[i].k1.store(k1, std::memory_order_relaxed);
  e[i].k0.store(k0, std::memory_order_relaxed);
  h->count.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool index_remove(void* mem, const std::uint8_t* key) {
  Header* h = header(mem);
  const std::uint64_t mask = h->slots - 1;
  std::uint64_t k0, k1;
  split(key, k0, k1);
  Entry* e = entries(mem);
  bool found;
  std::uint64_t i = probe(e, mask, k0, k1, found);
  if (!found) return false;
  WriteSection w(h);
  // Backward-shift deletion: pull later members of the cluster into the hole
  // when the hole lies on their probe path.
  std::uint64_t j = i;
  for (;;) {
    j = (j + 1) & mask;
    const std::uint64_t a = e[j].k0.load(std::memory_order_relaxed);
    const std::uint64_t b = e[j].k1.load(std::memory_order_relaxed);
    if (a == 0 && b == 0) break;
    const std::uint64_t hj = home(a, b, mask);
    // Move j into the hole i unless hj lies cyclically in (i, j].
    const bool stays = (i <= j) ? (i < hj && hj <= j) : (i < hj || hj <= j);
    if (stays) continue;
    e[i].k0.store(a, std::memory_order_relaxed);
    e[i].k1.store(b, std::memory_order_relaxed);
    i = j;
  }
  e[i].k0.store(0, std::memory_order_relaxed);
  e[i].k1.store(0, std::memory_order_relaxed);
  h->count.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

std::uint64_t index_count(const void* mem) { return header(mem)->count.load(std::memory_order_relaxed); }

long long index_prefix(const void* mem, const std::uint8_t* keys, std::size_t n) {
  const Header* h = header(mem);
  const std::uint64_t mask = h->slots - 1;
  const Entry* e = entries(mem);
  for (int attempt = 0; attempt < kReadTries; ++attempt) {
    if (h->incomplete.load(std::memory_order_acquire)) return -1;
    const std::uint64_t s1 = h->seq.load(std::memory_order_acquire);
    if (s1 & 1) continue;
    std::size_t hit = 0;
    for (; hit < n; ++hit) {
      std::uint64_t k0, k1;
      split(keys + hit * 16, k0, k1);
      bool found;
      probe(e, mask, k0, k1, found);
      if (!found) break;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h->seq.load(std::memory_order_relaxed) == s1) return static_cast<long long>(hit);
  }
  return -1;
}

}  // namespace ucm
