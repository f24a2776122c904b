"""The float codecs: ``float32`` (exact), ``bfloat16`` and ``float16`` (2 bytes per value,
~2x fewer bytes). A shard is cast value by value, so segments play no part."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crf.exchange.codecs.base import FP32_BYTES, Codec, finite


class FloatCodec(Codec):
    """A shard stored as a float tensor of ``dtype``, cast back to fp32 to decode."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self.exact = dtype == torch.float32
        self._itemsize = torch.empty(0, dtype=dtype).element_size()

    def encode(self, x: torch.Tensor, segments: Sequence[int] | None = None) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(
        self,
        w: torch.Tensor,
        n: int,
        out: torch.Tensor | None = None,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return w.to(torch.float32) if out is None else out.copy_(w)

    def decode_add(
        self,
        w: torch.Tensor,
        n: int,
        acc: torch.Tensor,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return acc.add_(w)  # adds in fp32 without materializing the upcast shard

    def nbytes(self, n: int, segments: Sequence[int] | None = None) -> int:
        return n * self._itemsize

    def numel_ok(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        return w.numel() == n

    def all_finite(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        return finite(w)

    def compression(self) -> float:
        return FP32_BYTES / self._itemsize


FLOAT32 = FloatCodec("float32", torch.float32)
BFLOAT16 = FloatCodec("bfloat16", torch.bfloat16)
FLOAT16 = FloatCodec("float16", torch.float16)
