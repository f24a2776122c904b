"""Wire formats for pseudo-gradient shards: what one fp32 shard becomes in the store.

* ``float32`` — exact.
* ``bfloat16`` / ``float16`` — 2 bytes per value (~2x fewer bytes).
* ``int8`` — block-wise absmax quantization: per block of ``INT8_BLOCK`` values one fp32
  scale (absmax / 127) and int8 codes, ~4x fewer bytes (as in prime/INTELLECT-1's int8
  all-reduce). Accumulation always happens in fp32 after decoding, in rank order, so the
  reduction stays deterministic: every replica that decodes the same object gets the same bits.

Error feedback (optional, per replica) keeps what quantization dropped and adds it to the next
round's contribution, so the error does not accumulate over rounds.
"""

from __future__ import annotations

import torch

WIRE_FORMATS = ("float32", "bfloat16", "float16", "int8")
INT8_BLOCK = 256
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_wire(name: str) -> str:
    if name not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {name!r}")
    return name


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """fp32 1-D -> the tensor stored on the wire (a float tensor, or uint8 bytes for int8)."""
    if wire in _FLOATS:
        return x.to(_FLOATS[wire])
    n = x.numel()
    nblocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
    padded = torch.zeros(nblocks * INT8_BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nblocks, INT8_BLOCK)
    scales = blocks.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])


def decode(w: torch.Tensor, wire: str, n: int) -> torch.Tensor:
    """Inverse of :func:`encode` for a shard of ``n`` values; always returns fp32."""
    if wire in _FLOATS:
        return w.to(torch.float32)
    nblocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
    if w.dtype != torch.uint8 or w.numel() != nblocks * 4 + n:
        raise ValueError(f"int8 shard has {w.numel()} bytes, expected {nblocks * 4 + n}")
    scales = w[: nblocks * 4].clone().view(torch.float32)
    q = w[nblocks * 4 :].clone().view(torch.int8).to(torch.float32)
    padded = torch.zeros(nblocks * INT8_BLOCK, dtype=torch.float32)
    padded[:n] = q
    return (padded.view(nblocks, INT8_BLOCK) * scales[:, None]).reshape(-1)[:n]


def wire_numel_ok(w: torch.Tensor, wire: str, n: int) -> bool:
    if wire in _FLOATS:
        return w.numel() == n
    return w.numel() == (n + INT8_BLOCK - 1) // INT8_BLOCK * 4 + n


def compression(wire: str) -> float:
    """Bytes of fp32 per byte on the wire (int8 pays 4 bytes of scale per block)."""
    if wire in _FLOATS:
        return 4.0 / torch.empty(0, dtype=_FLOATS[wire]).element_size()
    return 4.0 * INT8_BLOCK / (INT8_BLOCK + 4)
