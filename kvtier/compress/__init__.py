"""Codecs (quantize/dequantize pairs), the binary record format and the lz4 byte stage.

    from kvtier.compress import get_codec
    codec = get_codec("int4", group_size=32, axis="channel")
    enc = codec.encode(x); x2 = codec.decode(enc, device=x.device); enc.nbytes
"""
from kvtier.compress.base import Codec, Encoded
from kvtier.compress.codecs import NAMES, get_codec
from kvtier.compress.record import CorruptRecordError, RecordError, UnsupportedVersionError, pack_record, unpack_record

__all__ = ["Codec", "Encoded", "get_codec", "NAMES", "pack_record", "unpack_record", "RecordError",
           "CorruptRecordError", "UnsupportedVersionError"]
