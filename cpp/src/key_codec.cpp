// KeyCodec (ucm/block_key.hpp): a key of up to 16 bytes packed into its
// BlockKey by value, a longer one interned for the life of the codec.
#include <cstring>
#include <string>
#include <utility>

#include "ucm/block_key.hpp"

namespace ucm {

BlockKey KeyCodec::encode(const char* data, std::size_t len) {
  BlockKey k;
  if (len <= 16) {
    char buf[16] = {0};
    std::memcpy(buf, data, len);
    std::memcpy(&k.lo, buf, 8);
    std::memcpy(&k.hi, buf + 8, 8);
    k.tag = len;
    return k;
  }
  std::string s(data, len);
  auto it = ids_.find(s);
  if (it == ids_.end()) {
    it = ids_.emplace(s, long_.size()).first;
    long_.push_back(std::move(s));
  }
  k.tag = BlockKey::kInterned | it->second;
  return k;
}

std::string KeyCodec::decode(const BlockKey& key) const {
  if (key.tag & BlockKey::kInterned) return long_.at(static_cast<std::size_t>(key.tag & ~BlockKey::kInterned));
  char buf[16];
  std::memcpy(buf, &key.lo, 8);
  std::memcpy(buf + 8, &key.hi, 8);
  return std::string(buf, static_cast<std::size_t>(key.tag));
}

}  // namespace ucm
