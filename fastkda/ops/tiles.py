"""Tile addressing shared by the kernels: every 2-D load and store of a kernel goes through these.

A tile is ``rows × cols`` elements of a row-major tensor whose rows are ``stride`` elements apart: element
``[i, j]`` sits at ``ptr + rows[i]·stride + cols[j]``. ``rows`` may be 32-bit offsets from a per-chunk base
pointer or 64-bit token indices; rows whose ``ok`` flag is False read as zero and are never written. The ``_t``
forms address the same elements as the transposed tile ``[cols, rows]``, for kernels that hold a product's
operand transposed. ``bound`` forms also mask columns at or past ``bound`` (a channel step that may overhang).
"""

import triton
import triton.language as tl

from .common import store_as


@triton.jit
def load_rows(ptr, rows, ok, cols, stride):
    """``[R, D]`` tile: whole rows (every column of ``cols`` exists), rows where ``ok`` is False read as 0."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def store_rows(ptr, rows, ok, cols, stride, x, EMULATE: tl.constexpr):
    """Store ``x [R, D]`` to whole rows where ``ok``, converted to the pointee type (:func:`store_as`)."""
    store_as(ptr + rows[:, None] * stride + cols[None, :], x, ok[:, None], EMULATE)


@triton.jit
def load_tile(ptr, rows, ok, cols, bound, stride):
    """``[R, D]`` tile whose columns at or past ``bound`` read as 0 too."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=ok[:, None] & (cols[None, :] < bound),
                   other=0.0)


@triton.jit
def store_tile(ptr, rows, ok, cols, bound, stride, x, EMULATE: tl.constexpr):
    """Store ``x [R, D]`` where ``ok`` and the column is below ``bound``."""
    store_as(ptr + rows[:, None] * stride + cols[None, :], x, ok[:, None] & (cols[None, :] < bound), EMULATE)


@triton.jit
def load_tile_t(ptr, rows, ok, cols, bound, stride):
    """The transposed tile ``[D, R]``: element ``[j, i]`` is row ``rows[i]``, column ``cols[j]``."""
    return tl.load(ptr + rows[None, :] * stride + cols[:, None], mask=(cols[:, None] < bound) & ok[None, :],
                   other=0.0)


@triton.jit
def store_tile_t(ptr, rows, ok, cols, bound, stride, x, EMULATE: tl.constexpr):
    """Store the transposed tile ``x [D, R]`` (element ``[j, i]`` to row ``rows[i]``, column ``cols[j]``)."""
    store_as(ptr + rows[None, :] * stride + cols[:, None], x, (cols[:, None] < bound) & ok[None, :], EMULATE)


@triton.jit
def lower_sectors(ptr, rows, ok, cols):
    """Where a lower-triangular matrix (element ``[i, j]`` zero for ``j > i``, counted from its first row and
    column) may hold nonzeros, in whole 32-byte sectors of ``ptr``'s element type: column ``cols[j]`` of row
    ``rows[i]`` where its sector is not past the sector of the diagonal, in rows where ``ok``. The sectors beyond
    are neither written nor read (a load reads them as 0), so a row of a ``C``-column matrix moves about half its
    bytes; every element the mask covers is stored, zeros included, so that a load with the same mask reads only
    written memory. Whole sectors keep the mask constant over a vector's elements, so that loads and stores stay
    128-bit; a row's last sector folds ``ok`` in (−1 for a row not ok), so the mask is one comparison an element."""
    SECTOR: tl.constexpr = 256 // ptr.dtype.element_ty.primitive_bitwidth
    return (cols[None, :] // SECTOR) <= tl.where(ok, rows // SECTOR, -1)[:, None]


@triton.jit
def load_lower(ptr, rows, ok, matrix_rows, cols, stride):
    """``[R, D]`` tile of a lower-triangular matrix (:func:`lower_sectors`), its row i the matrix's row
    ``matrix_rows[i]`` at ``rows[i]``; rows where ``ok`` is False and the sectors past the diagonal's read as 0."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=lower_sectors(ptr, matrix_rows, ok, cols),
                   other=0.0)


@triton.jit
def store_lower(ptr, rows, ok, matrix_rows, cols, stride, x, EMULATE: tl.constexpr):
    """Store the lower-triangular tile ``x`` (:func:`load_lower`'s addressing) where ``ok``, up to the
    diagonal's sectors."""
    store_as(ptr + rows[:, None] * stride + cols[None, :], x, lower_sectors(ptr, matrix_rows, ok, cols), EMULATE)


@triton.jit
def tile_offsets(rows, cols, row_stride, col_stride):
    """Element offsets ``rows[i]·row_stride + cols[j]·col_stride`` of a ``[R, D]`` tile, for a tile that is
    loaded and stored at several places (a state held in registers)."""
    return rows[:, None] * row_stride + cols[None, :] * col_stride
