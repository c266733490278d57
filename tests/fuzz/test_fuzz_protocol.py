"""The socket protocol's framing and argument checks on random and mutated
input: a frame decodes, asks for more bytes, or raises ProtocolError;
nothing else ever comes out, and every call consumes or waits (no hang)."""
import msgpack
import pytest

from fuzzing import SEED, chunks, examples, mutate, rng, value
from ucm.service import protocol as proto

MAX_FRAME = 4096


def drain(dec):
    """Every frame `dec` yields until it needs more bytes; stops at the
    first ProtocolError (the service closes the connection there). Returns
    (frames, error)."""
    frames = []
    for _ in range(len(dec._buf) + 2):  # each frame consumes >= 4 bytes: more calls would be a hang
        try:
            frame = dec.next()
        except proto.ProtocolError as exc:
            return frames, exc
        if frame is proto.NEED_MORE:
            assert dec.need() >= 1
            return frames, None
        frames.append(frame)
    raise AssertionError("FrameDecoder.next() kept returning frames without consuming its buffer")


def request(rnd):
    """A request as CacheClient writes one, with random arguments."""
    op = rnd.choice(("hello", "lookup", "reserve", "commit", "acquire", "release", "pin", "finish", "stats"))
    keys = [rnd.randbytes(16) for _ in range(rnd.randrange(0, 6))]
    args = {"keys": keys}
    if op == "reserve":
        args.update(sizes=[rnd.randrange(1, 1 << 20) for _ in keys], parent=rnd.choice((None, rnd.randbytes(16))))
    elif op == "release":
        args = {"leases": [rnd.randrange(1, 100) for _ in keys]}
    elif op == "hello":
        args = {"version": proto.VERSION}
    elif op == "finish":
        args["output_tokens"] = rnd.randrange(0, 4096)
    elif op == "stats":
        args = {}
    return [rnd.randrange(1 << 32), op, args]


def test_random_streams_only_decode_wait_or_raise_protocol_error():
    rnd = rng("random_streams")
    for n in range(examples(3000)):
        dec = proto.FrameDecoder(MAX_FRAME)
        stream = rnd.randbytes(rnd.randrange(0, 96))
        if rnd.random() < 0.5:  # a plausible length prefix in front of random bytes
            stream = len(stream).to_bytes(4, "little") + stream
        for part in chunks(rnd, stream):
            dec.feed(part)
            _, err = drain(dec)
            if err is not None:
                break


def test_valid_frames_round_trip_whatever_the_chunking():
    rnd = rng("round_trip")
    for n in range(examples(1500)):
        objs = [[rnd.randrange(1 << 32), "op", value(rnd, 3)] for _ in range(rnd.randrange(1, 4))]
        try:
            stream = b"".join(proto.pack(o) for o in objs)
        except (UnicodeEncodeError, OverflowError):
            continue  # not encodable (a lone surrogate, an int past 64 bits): no frame to send
        if len(stream) > MAX_FRAME:
            continue
        dec = proto.FrameDecoder(MAX_FRAME)
        got = []
        for part in chunks(rnd, stream):
            dec.feed(part)
            frames, err = drain(dec)
            assert err is None, (SEED, n, objs, err)
            got += frames
        # msgpack has no NaN identity: compare the re-encoded bytes
        assert [msgpack.packb(g, use_bin_type=True) for g in got] == \
               [msgpack.packb(o, use_bin_type=True) for o in objs], (SEED, n)
        assert dec.next() is proto.NEED_MORE and dec.need() == 4


def test_mutated_requests_only_decode_wait_or_raise_protocol_error():
    rnd = rng("mutated_requests")
    outcomes = {"frames": 0, "errors": 0, "waits": 0}
    for n in range(examples(4000)):
        stream = b"".join(proto.pack(request(rnd)) for _ in range(rnd.randrange(1, 3)))
        dec = proto.FrameDecoder(MAX_FRAME)
        dec.feed(mutate(rnd, stream))
        frames, err = drain(dec)
        outcomes["frames"] += len(frames)
        outcomes["errors"] += err is not None
        outcomes["waits"] += err is None
    # the mutations reach every branch: frames, errors and partial frames
    assert all(outcomes.values()), outcomes


@pytest.mark.parametrize("n", [MAX_FRAME + 1, 1 << 31, (1 << 32) - 1])
def test_an_oversized_length_is_refused_before_its_body_arrives(n):
    dec = proto.FrameDecoder(MAX_FRAME)
    dec.feed(n.to_bytes(4, "little"))
    with pytest.raises(proto.ProtocolError, match=f"frame of {n} bytes exceeds max_frame_bytes={MAX_FRAME}"):
        dec.next()


def test_deep_nesting_and_huge_counts_are_protocol_errors():
    deep = b"\x91" * 3000 + b"\xc0"  # 3000 nested one-element arrays
    huge_map = b"\xdf\xff\xff\xff\xff"  # a map announcing 2**32-1 pairs
    huge_bin = b"\xc6\x00\x00\x10\x00"  # bin of 1 MiB in a 4 KiB frame
    for body in (deep[:MAX_FRAME], huge_map, huge_bin, b"\xc1", b"\xd4\x01\x00"):  # ext type: refused
        dec = proto.FrameDecoder(MAX_FRAME)
        dec.feed(len(body).to_bytes(4, "little") + body)
        with pytest.raises(proto.ProtocolError):
            dec.next()


def check_arg(fn, *a):
    """fn(*a)'s value, or None when it raised ProtocolError (anything else
    propagates and fails the test)."""
    try:
        return fn(*a)
    except proto.ProtocolError:
        return None


def test_argument_checks_return_checked_values_or_raise_protocol_error():
    rnd = rng("args")
    names = ("keys", "sizes", "parent", "leases", "output_tokens", "version", "x")
    accepted = 0
    for n in range(examples(6000)):
        args = value(rnd, 3)
        if rnd.random() < 0.5:  # mostly well-formed maps, with random members
            args = {rnd.choice(names): rnd.choice((value(rnd, 2), [rnd.randbytes(16)] * rnd.randrange(4),
                                                    [rnd.randrange(-2, 1 << 21) for _ in range(2)]))
                    for _ in range(rnd.randrange(0, 4))}
        checked = check_arg(proto.check_args, args, {"keys", "sizes", "parent"})
        if checked is None:
            continue
        assert checked is args and isinstance(args, dict) and set(args) <= {"keys", "sizes", "parent"}
        keys = check_arg(proto.keys_arg, args, "keys", 4)
        if keys is not None:
            accepted += 1
            assert isinstance(keys, list) and len(keys) <= 4
            assert all(type(k) is bytes and len(k) == proto.KEY_BYTES for k in keys)
            sizes = check_arg(proto.ints_arg, args, "sizes", len(keys), 1, 1 << 20)
            if sizes is not None:
                assert len(sizes) == len(keys)
                assert all(type(s) is int and 1 <= s <= 1 << 20 for s in sizes)
        parent = check_arg(proto.opt_key_arg, args, "parent")
        assert parent is None or (type(parent) is bytes and len(parent) == proto.KEY_BYTES)
        tokens = check_arg(proto.int_arg, {"n": value(rnd, 1)}, "n", 0, 1 << 40)
        assert tokens is None or (type(tokens) is int and 0 <= tokens <= 1 << 40)
    assert accepted
