import os

import pytest

from pdserve.kvconnector.transport.block_chunk import (
    MalformedChunkError,
    decode_block_chunk,
    encode_block_chunk,
)
from pdserve.proto import kv_transfer_pb2 as pb


def test_hand_encoded_chunk_is_a_valid_protobuf_message() -> None:
    pages = [os.urandom(4096), memoryview(os.urandom(8192))]
    message = pb.BlockChunk.FromString(encode_block_chunk([5, 300, 7], pages))
    assert list(message.block_ids) == [5, 300, 7]
    assert message.data == bytes(pages[0]) + bytes(pages[1])


def test_decoder_reads_what_protobuf_writes() -> None:
    raw = pb.BlockChunk(block_ids=[1, 2**31], data=b"pages").SerializeToString()
    block_ids, data = decode_block_chunk(raw)
    assert block_ids == [1, 2**31] and bytes(data) == b"pages"


def test_truncated_chunk_is_refused() -> None:
    raw = encode_block_chunk([1], [b"x" * 100])
    with pytest.raises(MalformedChunkError):
        decode_block_chunk(raw[:-10])
