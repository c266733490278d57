"""Chunked frames (framing version 2, the fs layout): sizes both ways, the
layout, and verification of whole payloads and of spans."""
import os
import struct

from ucm import _native
from ucm.adapters import framing
from ucm.adapters.base import Status

C = framing.CHUNK_BYTES


def test_payload_length_follows_from_the_value_size_and_back():
    for n in [0, 1, C - 1, C, C + 1, 2 * C, 90 * C + 7, 2_949_120]:
        total = framing.chunked_header_bytes(n) + n
        assert framing.chunked_payload_bytes(total) == n
    # sizes no payload length makes are None (a foreign file), never a guess
    made = {framing.chunked_header_bytes(n) + n for n in range(0, 3 * C + 2)}
    for total in range(0, 3 * C + 60):
        assert (framing.chunked_payload_bytes(total) is not None) == (total in made)


def test_layout_and_verification():
    key, payload = os.urandom(16), os.urandom(2 * C + 100)
    header = framing.pack_chunked_header(key, payload)
    assert len(header) == framing.chunked_header_bytes(len(payload)) == 40 + 3 * 8
    magic, version, flags, hkey, length, csum = struct.unpack_from("<4sHH16sQQ", header)
    table = header[40:]
    assert (magic, version, flags, hkey, length) == (b"UCMF", 2, 0, key, len(payload))
    assert table == _native.chunk_checksums(payload, C) and csum == _native.checksum(table)
    assert framing.verify_chunked(key, header, payload) is Status.OK
    assert framing.verify_chunked(os.urandom(16), header, payload) is Status.CORRUPT
    assert framing.verify_chunked(key, header, payload[:-1]) is Status.CORRUPT
    # a version-1 header is not a chunked one
    assert framing.verify_chunked(key, framing.pack_header(key, payload), payload) is Status.CORRUPT
    bad = bytearray(payload)
    bad[C + 5] ^= 1
    assert framing.verify_chunked(key, header, bad) is Status.CORRUPT
    # spans: the chunks covering a range; the bad chunk fails, the others verify
    assert framing.chunked_span(10, 5, len(payload)) == (0, C)
    assert framing.chunked_span(C - 1, 2, len(payload)) == (0, 2 * C)
    assert framing.chunked_span(2 * C + 50, 50, len(payload)) == (2 * C, 2 * C + 100)
    for start, end, want in [(0, C, Status.OK), (2 * C, 2 * C + 100, Status.OK), (C, 2 * C, Status.CORRUPT),
                             (0, 2 * C, Status.CORRUPT)]:
        assert framing.verify_chunked_span(key, header, len(payload), start, bad[start:end]) is want
    # a table whose checksum does not match the header is never trusted
    forged = bytearray(header)
    forged[40] ^= 1
    assert framing.verify_chunked_span(key, forged, len(payload), 0, payload[:C]) is Status.CORRUPT
