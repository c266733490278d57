// Block keys as the placement core keeps them (BlockKey), the open-addressing
// map over them (KeyMap) and the bytes <-> BlockKey codec (KeyCodec).
//
// Keys are byte strings of any length; up to 16 bytes (ucm's keys are 16)
// they are packed into a BlockKey by value, a longer one is interned by the
// core's KeyCodec for the life of the core.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ucm {

// A key as the core keeps it: up to 16 bytes packed in two words with their
// count in `tag`, or a longer key's surrogate (kInterned | its number).
struct BlockKey {
  static constexpr std::uint64_t kInterned = 1ULL << 63;  // ids stay below 2^63 - 1: ~0 marks an empty KeyMap slot
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  std::uint64_t tag = 0;
  bool operator==(const BlockKey& o) const { return lo == o.lo && hi == o.hi && tag == o.tag; }
  bool operator!=(const BlockKey& o) const { return !(*this == o); }
  // Any strict order (the policies' priorities never tie, so it decides nothing).
  bool operator<(const BlockKey& o) const {
    if (lo != o.lo) return lo < o.lo;
    if (hi != o.hi) return hi < o.hi;
    return tag < o.tag;
  }
};

struct BlockKeyHash {
  std::size_t operator()(const BlockKey& k) const {
    std::uint64_t h = k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL) ^ (k.tag * 0xC2B2AE3D27D4EB4FULL);
    h ^= h >> 33;  // murmur3's finaliser
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return static_cast<std::size_t>(h);
  }
};

// An open-addressing hash map from BlockKey (linear probing, backward-shift
// deletion, at most half full): one probe sequence in one array, where the
// node-based std::unordered_map costs a cache miss per node. The subset of
// std::unordered_map's interface the core uses; an insert or erase
// invalidates iterators and references; iteration order is unspecified
// (nothing the core decides depends on it).
template <class V>
class KeyMap {
 public:
  struct Slot {
    BlockKey first{0, 0, kEmptyTag};
    V second{};
  };

  template <class S>
  class Iter {
   public:
    Iter(S* p, S* end) : p_(p), end_(end) { skip(); }
    S& operator*() const { return *p_; }
    S* operator->() const { return p_; }
    Iter& operator++() {
      ++p_;
      skip();
      return *this;
    }
    bool operator==(const Iter& o) const { return p_ == o.p_; }
    bool operator!=(const Iter& o) const { return p_ != o.p_; }

   private:
    void skip() {
      while (p_ != end_ && p_->first.tag == kEmptyTag) ++p_;
    }
    S* p_;
    S* end_;
  };
  using iterator = Iter<Slot>;
  using const_iterator = Iter<const Slot>;

  iterator begin() { return iterator(slots_.data(), slots_.data() + slots_.size()); }
  iterator end() { return iterator(slots_.data() + slots_.size(), slots_.data() + slots_.size()); }
  const_iterator begin() const { return const_iterator(slots_.data(), slots_.data() + slots_.size()); }
  const_iterator end() const {
    return const_iterator(slots_.data() + slots_.size(), slots_.data() + slots_.size());
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  iterator find(const BlockKey& key) {
    std::size_t i = index_of(key);
    return i == kNone ? end() : iterator(slots_.data() + i, slots_.data() + slots_.size());
  }
  const_iterator find(const BlockKey& key) const {
    std::size_t i = index_of(key);
    return i == kNone ? end() : const_iterator(slots_.data() + i, slots_.data() + slots_.size());
  }
  std::size_t count(const BlockKey& key) const { return index_of(key) == kNone ? 0 : 1; }
  V& at(const BlockKey& key) { return slots_[checked(key)].second; }
  const V& at(const BlockKey& key) const { return slots_[checked(key)].second; }
  V& operator[](const BlockKey& key) { return emplace(key, V{}).first->second; }

  std::pair<iterator, bool> emplace(const BlockKey& key, V value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    std::size_t i = home(key);
    while (slots_[i].first.tag != kEmptyTag) {
      if (slots_[i].first == key) return {iterator(slots_.data() + i, slots_.data() + slots_.size()), false};
      i = (i + 1) & mask_;
    }
    slots_[i].first = key;
    slots_[i].second = std::move(value);
    ++size_;
    return {iterator(slots_.data() + i, slots_.data() + slots_.size()), true};
  }

  std::size_t erase(const BlockKey& key) {
    std::size_t i = index_of(key);
    if (i == kNone) return 0;
    erase_at(i);
    return 1;
  }
  void erase(iterator it) { erase_at(static_cast<std::size_t>(&*it - slots_.data())); }

 private:
  static constexpr std::uint64_t kEmptyTag = ~0ULL;  // no key has it (see BlockKey)
  static constexpr std::size_t kNone = ~std::size_t{0};

  std::size_t home(const BlockKey& key) const { return BlockKeyHash()(key) & mask_; }

  std::size_t index_of(const BlockKey& key) const {
    if (size_ == 0) return kNone;
    std::size_t i = home(key);
    while (slots_[i].first.tag != kEmptyTag) {
      if (slots_[i].first == key) return i;
      i = (i + 1) & mask_;
    }
    return kNone;
  }

  std::size_t checked(const BlockKey& key) const {
    std::size_t i = index_of(key);
    if (i == kNone) throw std::out_of_range("KeyMap: no such key");
    return i;
  }

  void erase_at(std::size_t i) {
    for (std::size_t j = (i + 1) & mask_; slots_[j].first.tag != kEmptyTag; j = (j + 1) & mask_) {
      const std::size_t k = home(slots_[j].first);
      if (((j - k) & mask_) >= ((j - i) & mask_)) {  // j's home is not in (i, j]: it may move back to i
        slots_[i] = std::move(slots_[j]);
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.resize(old.empty() ? 16 : old.size() * 2);
    mask_ = slots_.size() - 1;
    size_ = 0;
    for (auto& s : old) {
      if (s.first.tag != kEmptyTag) emplace(s.first, std::move(s.second));
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
};
using KeySet = std::unordered_set<BlockKey, BlockKeyHash>;
using OptKey = std::optional<BlockKey>;

// Bytes <-> BlockKey.
class KeyCodec {
 public:
  BlockKey encode(const char* data, std::size_t len);
  std::string decode(const BlockKey& key) const;

 private:
  std::unordered_map<std::string, std::uint64_t> ids_;  // interned keys longer than 16 bytes
  std::vector<std::string> long_;
};

}  // namespace ucm
