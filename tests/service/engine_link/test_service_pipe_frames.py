"""The service's end of the engine pipe speaks multiprocessing.Connection's framing, without
blocking: messages written by a Connection arrive whole, however the bytes are split, and
messages it writes (also ones larger than the pipe holds) are read whole by a Connection."""

from __future__ import annotations

import multiprocessing
import os
import select
import struct
import threading

import pytest

from service.engine_link.engine_process import FrameReader, write_frame

SIZES = [0, 1, 4, 16384, 16385, 3 * 2**20]  # around the small-message path; past the buffer


def payload(size: int, seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(size))


@pytest.fixture
def pipe():
    ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=True)
    os.set_blocking(ours.fileno(), False)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_messages_from_a_connection_arrive_whole(pipe):
    ours, theirs = pipe
    sent = [payload(size, n) for n, size in enumerate(SIZES)]
    writer = threading.Thread(target=lambda: [theirs.send_bytes(m) for m in sent])
    writer.start()
    reader, received = FrameReader(), []
    while len(received) < len(sent):
        select.select([ours.fileno()], [], [], 5.0)
        received += reader.feed(ours.fileno())
    writer.join()
    assert received == sent


def test_messages_written_here_are_read_whole_by_a_connection(pipe):
    ours, theirs = pipe
    sent = [payload(size, n) for n, size in enumerate(SIZES)]
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.extend(theirs.recv_bytes() for _ in sent))
    reader.start()
    for message in sent:
        write_frame(ours.fileno(), message)  # the 3 MiB one waits for the reader: pipe full
    reader.join(10.0)
    assert received == sent


def test_partial_frames_wait_for_their_rest_and_long_headers_parse():
    reader = FrameReader()
    long_header = struct.pack("!iQ", -1, 5) + b"hello"  # the framing of messages >= 2 GiB
    stream = struct.pack("!i", 3) + b"abc" + long_header + struct.pack("!i", 2) + b"x"
    complete: list[bytes] = []
    for byte in stream:  # one byte at a time
        reader._buffer.append(byte)
        complete += reader.frames()
    assert complete == [b"abc", b"hello"]
    reader._buffer += b"y"
    assert reader.frames() == [b"xy"]


def test_the_end_of_the_pipe_is_eof(pipe):
    ours, theirs = pipe
    theirs.send_bytes(b"last")
    theirs.close()
    reader = FrameReader()
    select.select([ours.fileno()], [], [], 5.0)
    with pytest.raises(EOFError):
        while True:  # the message, then the end
            assert reader.feed(ours.fileno()) in ([b"last"], [])
