// A shared-memory set of block keys: written by the one ucm service process
// (under its own lock), read lock-free by every client process so that a
// lookup takes no round trip to the service.
//
// Layout: a 64-byte header, then `slots` entries of 16 bytes (a key as two
// 64-bit words; all-zero marks an empty slot). Open addressing with linear
// probing and backward-shift deletion. Consistency: one sequence counter for
// the whole table (a seqlock). The writer makes it odd, changes entries, and
// makes it even again; a reader retries when the counter was odd or moved
// during its probe, and gives up (answering "ask the service") after a few
// tries. Every shared word is accessed atomically.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ucm {

constexpr std::uint64_t kIndexMagic = 0x7563'6d69'6478'0001ULL;  // "ucmidx" v1
constexpr std::size_t kIndexHeader = 64;
constexpr std::size_t kIndexEntry = 16;

// Bytes a table of `slots` entries needs (slots: a power of two >= 8).
std::size_t index_bytes(std::uint64_t slots);

// Formats `mem` (index_bytes(slots) bytes, zeroed or not) as an empty table.
void index_init(void* mem, std::uint64_t slots);

// Checks the header of a mapped table against its length; the slot count or 0.
std::uint64_t index_slots(const void* mem, std::size_t len);

// Writer side (one writer at a time). Insert answers false when the table is
// too full (it then stays marked incomplete: readers ask the service).
bool index_insert(void* mem, const std::uint8_t* key);
bool index_remove(void* mem, const std::uint8_t* key);
std::uint64_t index_count(const void* mem);

// Reader side: how many of the `n` keys (16 bytes each, in order) are present
// before the first absent one; -1 when the table could not be read
// consistently or is incomplete (ask the service instead).
long long index_prefix(const void* mem, const std::uint8_t* keys, std::size_t n);

}  // namespace ucm
