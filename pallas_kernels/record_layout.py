"""Byte layouts of native CKV records: a record is a list of byte segments.

The encoder returns one uint8 array per segment, so that a kernel can store each segment with a
single power-of-two-wide store and the XLA reference can concatenate them; `record_codec` holds
the encodings, `float_codes` the bit-level codecs they use.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a record: bytes ``[offset, offset + width)``."""
    name: str
    offset: int
    width: int


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one record kind.  ``quant_block`` is the tile (fp8) or group (nvfp4) size."""
    kind: Literal["fp8_tiles", "nvfp4_groups", "bf16"]
    nope_dim: int = 512
    rope_dim: int = 64
    quant_block: int = 0
    pad_bytes: int = 0

    def __post_init__(self):
        if self.kind not in ("fp8_tiles", "nvfp4_groups", "bf16"):
            raise ValueError(f"kind: expected 'fp8_tiles', 'nvfp4_groups' or 'bf16', got {self.kind!r}")
        if self.kind != "bf16" and (self.quant_block <= 0 or self.nope_dim % self.quant_block):
            raise ValueError(f"quant_block: expected a positive divisor of nope_dim={self.nope_dim}, "
                             f"got {self.quant_block}")
        if self.kind == "nvfp4_groups" and self.quant_block % 2:
            raise ValueError(f"quant_block: nvfp4 packs two elements per byte, so groups have an even "
                             f"size, got {self.quant_block}")

    @property
    def num_blocks(self) -> int:
        return self.nope_dim // self.quant_block if self.quant_block else 0

    # computed once per layout: the adapter asks for record_bytes in each layer's checks
    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        rope_bytes = 2 * self.rope_dim
        if self.kind == "fp8_tiles":
            widths = [("nope_e4m3", self.nope_dim), ("tile_scales_f32", 4 * self.num_blocks),
                      ("rope_bf16", rope_bytes)]
        elif self.kind == "nvfp4_groups":
            widths = [("nope_e2m1", self.nope_dim // 2), ("group_scales_e4m3", self.num_blocks),
                      ("pad", self.pad_bytes), ("rope_bf16", rope_bytes)]
        else:
            widths = [("nope_bf16", 2 * self.nope_dim), ("rope_bf16", rope_bytes)]
        out, offset = [], 0
        for name, width in widths:
            if width:
                out.append(Segment(name, offset, width))
                offset += width
        return tuple(out)

    @functools.cached_property
    def record_bytes(self) -> int:
        last = self.segments[-1]
        return last.offset + last.width

    @property
    def value_dim(self) -> int:
        """Values per decoded record: NoPE then RoPE."""
        return self.nope_dim + self.rope_dim

    def segment(self, name: str) -> Segment:
        for seg in self.segments:
            if seg.name == name:
                return seg
        raise KeyError(name)
