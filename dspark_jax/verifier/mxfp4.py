"""MXFP4 expert tensors, dequantized while reading: gpt-oss's and compressed-tensors'.

The OCP Microscaling format (docs/formats.md, "MXFP4 experts"): blocks of 32 values share
one E8M0 scale (2**(code - 127)); each value is an FP4 E2M1 code, two to a byte, the low
nibble first. gpt-oss stores an expert weight ``W`` [E, A, B] (transformers' layout: A the
input width) as ``W_blocks`` [E, B, A/32, 16] uint8 and ``W_scales`` [E, B, A/32] uint8,
that is transposed, each output row's inputs in blocks of 32. compressed-tensors'
``mxfp4-pack-quantized`` (Kimi-K3's experts) stores a weight [R, C] (torch's [out, in]) as
``weight_packed`` [R, C/2] uint8 and ``weight_scale`` [R, C/32] uint8: the same bytes as
gpt-oss's per output row, untransposed. A value times its scale is exact in bf16 and fp32
(at most two significant bits), so the dequantized weight is the one transformers'
``convert_moe_packed_tensors`` (compressed-tensors' ``unpack_fp4_from_uint8`` times
``decompress_mx_scale``) builds, bit for bit, in either dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
PACKED_SUFFIXES = ("weight_packed", "weight_scale")  # compressed-tensors' tensor names
NAN_SCALE = 0xFF  # E8M0's only NaN


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks' and scales' shapes of an expert weight of ``shape`` [E, A, B]."""
    e, a, b = shape
    return (e, b, a // BLOCK, BLOCK // 2), (e, b, a // BLOCK)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., G * 32] float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    out = values.reshape(*scales.shape, BLOCK) * scale[..., None]
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def _blocked(blocks_of, scales_of, span: slice, width: int) -> np.ndarray:
    """Values ``[..., span]`` of a last axis of ``width`` stored in blocks of 32, reading
    only the blocks that hold them: ``blocks_of(g0, g1)`` [..., g1 - g0, 16] codes,
    ``scales_of(g0, g1)`` [..., g1 - g0]. A NaN scale is a ValueError (a corrupt file)."""
    c0, c1, step = span.indices(width)
    assert step == 1, span
    g0, g1 = c0 // BLOCK, -(-c1 // BLOCK)
    scale = np.asarray(scales_of(g0, g1))
    if (scale == NAN_SCALE).any():
        raise ValueError(f"E8M0's NaN scale ({NAN_SCALE})")
    return dequantize(np.asarray(blocks_of(g0, g1)), scale)[..., c0 - g0 * BLOCK : c1 - g0 * BLOCK]


def read_slice(blocks: np.ndarray, scales: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """``W[index]`` of the weight W [E, A, B] that gpt-oss's ``blocks``/``scales`` store
    (memory maps: only the requested experts and output rows, and the blocks holding the
    requested inputs, are read)."""
    es, rows, cols = index
    part = _blocked(lambda a, b: blocks[es, cols, a:b], lambda a, b: scales[es, cols, a:b],
                    rows, blocks.shape[2] * BLOCK)  # fmt: skip
    return part.transpose(0, 2, 1)


def read_packed(packed: np.ndarray, scales: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
    """``W[rows, cols]`` of the weight W [R, C] that compressed-tensors' ``weight_packed``
    [R, C/2] and ``weight_scale`` [R, C/32] store (only the blocks holding ``cols``)."""
    n = len(range(*rows.indices(packed.shape[0])))

    def blocks_of(a, b):
        return np.asarray(packed[rows, a * BLOCK // 2 : b * BLOCK // 2]).reshape(n, b - a, -1)

    return _blocked(blocks_of, lambda a, b: scales[rows, a:b], cols, packed.shape[1] * 2)
