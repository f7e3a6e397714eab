"""Launch plans: the one place that decides every number fastkda's kernels run with.

A plan is a pure function of host-known facts (sequences, heads, tokens, dimensions, gate mode and the GPU's SM
count), so a CUDA graph replays the plan it was captured with and no launch synchronises with the device. The API
makes one plan per call and hands it to the kernels whole (through the custom ops as a tuple of integers,
:meth:`PrefillPlan.launch_numbers`); nothing below the API decides a launch number again. Sweeps and variants
change a plan (:meth:`PrefillPlan.replace`) or the facts it is made from, never module state.

Prefill (:class:`PrefillPlan`) runs three kernels (``fastkda/ops/prefill/``): a token-parallel preparation of
each chunk (``prepare``), the in-chunk inverse (``solve``), and the serial recurrence over chunks, one program per
(sequence, head, V-slice). No step of the recurrence reduces over the value dimension V, so V can be cut into
``v_slices`` slices, each program bitwise identical to the unsplit computation of its columns: the plan takes the
most slices whose programs still fit one per SM, so that few sequences of few heads use more of the GPU.
Decode (:class:`DecodePlan`) and the CPU path (``cpu_chunk``) are planned here too. The measurements behind each
choice are in ``docs/perf-notes.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

V_SLICE_CHOICES = (1, 2, 4)  # what the API accepts for ``v_slices``
ENV_V_SLICES = "FASTKDA_V_SLICES"
SUPPORTED_DIMS = (64, 128)  # key and value dimensions the kernels are built for
MIN_SLICE_WIDTH = 16  # a V-slice narrower than this cannot feed a tensor-core product
NARROW_SLICE_WIDTH = 32  # the auto plan never cuts V into slices narrower than this
CHUNK = 32  # tokens per serial step of the GPU recurrence
BLOCK = 16  # tokens per block of the in-chunk inverse (and the span of any decay factor the preparation forms)
CPU_CHUNK = 16  # tokens per step of the CPU path (its in-chunk decays are formed element-wise)
DECODE_SLICE_WIDTH = 16  # state columns per decode program
WARP_CHOICES = (1, 2, 4, 8, 16)


def _check(condition, message):
    if not condition:
        raise ValueError(f"fastkda plan: {message}")


@dataclass(frozen=True)
class PrefillPlan:
    """Every number one prefill call launches with, the facts it was made from, and why (``reason``).

    Facts: ``num_seqs`` sequences, each a row of ``seq_len`` tokens or, when ``varlen``, the ``cu_seqlens`` spans
    of one row of ``seq_len`` tokens; ``heads`` heads, key and value dimensions, the gate mode, the SM count.
    Chunking: ``chunk`` tokens per serial step, ``block`` tokens per inverse block, ``cpu_chunk`` for the CPU path.
    Recurrence: ``v_slices`` programs per (sequence, head); ``w_u_in_recurrence``: each step forms w = T·β·kd and
    u = T·β·v itself (the solve kernel then only inverts; the same bits either way); ``state_rows_v``: the state is
    held transposed (rows = V), so that a slice's columns are each product's rows; warps and pipeline stages.
    Preparation: warps, stages, key channels per step and ``prepare_token_run`` (consecutive tokens per thread,
    which keeps the in-chunk cumulative sum inside threads; it sets that sum's order, so it is the one number here
    besides ``chunk`` and ``dot_precision`` that changes the results' last bits) of the first kernel; warps, stages and channels per step
    of the solve kernel. ``dot_precision``: the kernels' fp32 products ("tf32" or "ieee")."""

    seq_len: int
    num_seqs: int
    varlen: bool
    heads: int
    key_dim: int
    value_dim: int
    lower_bound_gate: bool
    sms: int
    chunk: int
    block: int
    cpu_chunk: int
    v_slices: int
    w_u_in_recurrence: bool
    state_rows_v: bool
    recurrence_warps: int
    recurrence_stages: int
    prepare_warps: int
    prepare_stages: int
    prepare_channels: int
    prepare_token_run: int
    solve_warps: int
    solve_stages: int
    solve_channels: int
    dot_precision: str = "tf32"
    reason: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for name in ("seq_len", "num_seqs", "heads", "sms"):
            least = 0 if name in ("seq_len", "num_seqs") else 1
            _check(getattr(self, name) >= least, f"{name} must be >= {least}, got {getattr(self, name)}")
        for name in ("key_dim", "value_dim"):
            _check(getattr(self, name) in SUPPORTED_DIMS, f"{name} must be one of {SUPPORTED_DIMS}, got "
                                                          f"{getattr(self, name)}")
        _check(self.block == 16 and self.chunk == 2 * self.block,
               f"the kernels take chunks of two 16-token blocks, got chunk={self.chunk}, block={self.block}")
        _check(self.cpu_chunk >= 1, f"cpu_chunk must be >= 1, got {self.cpu_chunk}")
        width = self.value_dim // max(self.v_slices, 1)
        _check(self.v_slices >= 1 and self.value_dim % self.v_slices == 0 and width >= MIN_SLICE_WIDTH
               and width & (width - 1) == 0,
               f"v_slices={self.v_slices} must cut V={self.value_dim} into power-of-two slices of at least "
               f"{MIN_SLICE_WIDTH} columns")
        for name in ("recurrence_warps", "prepare_warps", "solve_warps"):
            _check(getattr(self, name) in WARP_CHOICES, f"{name} must be one of {WARP_CHOICES}, got "
                                                        f"{getattr(self, name)}")
        for name in ("recurrence_stages", "prepare_stages", "solve_stages"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.prepare_channels in (16, 32, 64, 128) and self.key_dim % self.prepare_channels == 0,
               f"prepare_channels must be 16, 32, 64 or 128 and divide K={self.key_dim}, got {self.prepare_channels}")
        _check(not self.lower_bound_gate or self.prepare_channels == self.key_dim,
               f"under the lower-bound gate the first kernel takes all K={self.key_dim} channels in one step, "
               f"got prepare_channels={self.prepare_channels}")
        _check(self.prepare_token_run >= 1 and self.chunk % self.prepare_token_run == 0,
               f"prepare_token_run must divide the chunk ({self.chunk}), got {self.prepare_token_run}")
        _check(self.solve_channels in (16, 32, 64, 128),
               f"solve_channels must be 16, 32, 64 or 128, got {self.solve_channels}")
        _check(self.dot_precision in ("tf32", "ieee"), f"dot_precision must be 'tf32' or 'ieee', got "
                                                       f"{self.dot_precision!r}")

    @property
    def batch(self) -> int:
        """Rows of the inputs: one holding every sequence (varlen), else one per sequence."""
        return 1 if self.varlen else self.num_seqs

    @property
    def slice_width(self) -> int:
        """Value columns per recurrence program."""
        return self.value_dim // self.v_slices

    @property
    def programs(self) -> int:
        """Recurrence programs: one per (sequence, head, V-slice)."""
        return self.v_slices * self.num_seqs * self.heads

    @property
    def chunk_slots(self) -> int:
        """Chunk slots of the preparation's grid and workspace: sequence n owns ``ceil(len_n / chunk)``
        consecutive slots from ``n·ceil(seq_len / chunk)`` (fixed length) or ``cu_seqlens[n] // chunk + n``
        (varlen), a layout every kernel derives from host-known values (``fastkda/ops/prefill/layout.py``)."""
        if self.varlen:
            return self.batch * self.seq_len // self.chunk + self.num_seqs + 1
        return self.batch * -(-self.seq_len // self.chunk)

    @property
    def prepare_grid(self) -> tuple:
        """Grid of both preparation kernels: one program per (chunk slot, head)."""
        return (self.chunk_slots, self.heads, 1)

    @property
    def recurrence_grid(self) -> tuple:
        """Grid of the recurrence: one program per (V-slice, head, sequence)."""
        return (self.v_slices, self.heads, self.num_seqs)

    def replace(self, **changes) -> "PrefillPlan":
        """This plan with some numbers changed (validated), its reason saying which."""
        changed = ", ".join(f"{name}={value!r}" for name, value in changes.items())
        return dataclasses.replace(self, **changes, reason=f"{self.reason}; overridden: {changed}")

    def launch_numbers(self) -> tuple:
        """The plan as plain integers (bools as 0/1), the form the custom op carries; see
        :meth:`from_launch_numbers`. ``dot_precision`` and ``reason`` travel apart."""
        return _launch_numbers(self)

    @staticmethod
    def from_launch_numbers(numbers, dot_precision="tf32") -> "PrefillPlan":
        """The plan :meth:`launch_numbers` gave (the reason is not carried)."""
        return _plan_from_numbers(tuple(numbers), dot_precision)

    def describe(self) -> str:
        """The plan in words, one line per stage."""
        chain = -(-self.seq_len // self.chunk)
        layout = (f"{self.num_seqs} sequence(s), {self.seq_len} tokens in all (varlen)" if self.varlen
                  else f"{self.batch} sequence(s) of {self.seq_len} tokens")
        gate = "lower-bound gate" if self.lower_bound_gate else "precomputed gate"
        return "\n".join([
            f"shape: {layout}, {self.heads} heads, K={self.key_dim}, V={self.value_dim}, {gate}, {self.sms} SMs",
            f"chunks: {self.chunk} tokens per serial step (inverse blocks of {self.block}); the longest sequence "
            f"walks at most {chain} chunk(s) in order",
            f"preparation: {self.chunk_slots} chunk slots x {self.heads} heads; first kernel {self.prepare_warps} warps, {self.prepare_stages} stages, "
            f"{self.prepare_channels} key channels per step, {self.prepare_token_run} consecutive tokens per thread; "
            f"solve kernel {self.solve_warps} warps, {self.solve_stages} stages, {self.solve_channels} channels per "
            f"step, " + ("T·diag(β) only (the recurrence forms w and u)" if self.w_u_in_recurrence
                         else "forming w and u"),
            f"recurrence: v_slices={self.v_slices} (V cut into {self.v_slices} slice(s) of {self.slice_width} "
            f"columns): {self.programs} programs on {self.sms} SMs, {self.recurrence_warps} warps, "
            f"{self.recurrence_stages} stages, state held as "
            + ("Sᵀ (rows = V)" if self.state_rows_v else "S (rows = K)")
            + (", forming w and u each step" if self.w_u_in_recurrence else ""),
            f"why: {self.reason}",
            f"CPU path: chunks of {self.cpu_chunk} tokens",
        ])


_NUMBER_FIELDS = tuple(f.name for f in dataclasses.fields(PrefillPlan) if f.name not in ("dot_precision", "reason"))
_BOOL_FIELDS = frozenset(f.name for f in dataclasses.fields(PrefillPlan) if f.type == "bool")


@functools.lru_cache(maxsize=4096)
def _launch_numbers(plan):
    return tuple(int(getattr(plan, name)) for name in _NUMBER_FIELDS)


@functools.lru_cache(maxsize=4096)  # the custom op rebuilds the plan on every call: an eager call's host time counts
def _plan_from_numbers(numbers, dot_precision):
    _check(len(numbers) == len(_NUMBER_FIELDS), f"expected {len(_NUMBER_FIELDS)} launch numbers, got {len(numbers)}")
    values = {name: bool(n) if name in _BOOL_FIELDS else int(n) for name, n in zip(_NUMBER_FIELDS, numbers)}
    return PrefillPlan(**values, dot_precision=dot_precision)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def parse_v_slices(value, source: str):
    """``"auto"`` or one of :data:`V_SLICE_CHOICES`; anything else raises ``ValueError`` naming ``source``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value not in V_SLICE_CHOICES:
        raise ValueError(f"{source} must be 'auto' or one of {V_SLICE_CHOICES}, got {value!r}")
    return value


def requested_v_slices(argument="auto"):
    """The caller's choice: the argument unless it is ``"auto"``, then ``$FASTKDA_V_SLICES``, then auto."""
    choice = parse_v_slices(argument, "v_slices")
    if choice == "auto" and os.environ.get(ENV_V_SLICES):
        choice = parse_v_slices(os.environ[ENV_V_SLICES], ENV_V_SLICES)
    return choice


def w_u_in_recurrence(slice_width: int, pairs: int) -> bool:
    """Whether each recurrence step forms w = T·β·kd and u = T·β·v itself instead of loading the solve kernel's.
    It saves the solve kernel's w and u traffic, spread over the whole GPU, and adds two products to every step of
    the serial chain (more per step the wider the slice; at 32 columns every slice forms all of w). So it pays
    when there are many chains to share the saving: from one (sequence, head) pair per two columns of slice width,
    never in slices under 64 columns."""
    return slice_width >= 2 * NARROW_SLICE_WIDTH and 2 * pairs >= slice_width


def state_rows_v(slice_width: int) -> bool:
    """Whether the recurrence holds a slice's state as Sᵀ (rows = V): from 64 columns, where that makes every
    product a wgmma with the state in registers; a narrower slice keeps S (rows = K), whose products have the
    chunk's rows as M (transposed, 32-row products fall back to mma.sync)."""
    return slice_width >= 64


def recurrence_warps(slice_width: int) -> int:
    """8 warps for a 128-column slice (its ``[128, 128]`` fp32 state is 64 registers a thread; on 4 warps it
    spills), else 4 (programs of 4 warps fit two per SM)."""
    return 8 if slice_width >= 128 else 4


def prepare_channels(key_dim: int, lower_bound_gate: bool) -> int:
    """Key channels per step of the first preparation kernel: all of them under the lower-bound gate (one
    load-and-compute phase); 32 under the precomputed gate, whose element-wise diagonal blocks grow with the
    channels per step."""
    return key_dim if lower_bound_gate else min(32, key_dim)


def prepare_token_run(chunk: int, key_dim: int, warps: int) -> int:
    """Consecutive tokens per thread in the first preparation kernel: Triton lays a ``[chunk, K]`` bf16 tile over
    the warps in 8-element rows of K / 8 threads, so each thread holds chunk·K / (warps·256) rows, which the kernel
    fills with consecutive tokens."""
    return max(min(chunk * key_dim // (warps * 256), chunk), 1)


def choose_plan(num_seqs: int, heads: int, seq_len: int, key_dim: int, value_dim: int, sms: int, *,
                varlen: bool = True, lower_bound_gate: bool = True, v_slices="auto") -> PrefillPlan:
    """The prefill plan for ``num_seqs`` sequences of ``heads`` heads on ``sms`` SMs: varlen, one row of
    ``seq_len`` tokens holding them all (``cu_seqlens``); else ``num_seqs`` rows of ``seq_len`` tokens each.

    ``v_slices``: ``"auto"`` (then ``$FASTKDA_V_SLICES`` if set) takes the most slices, at least
    :data:`NARROW_SLICE_WIDTH` columns wide, whose ``s·N·H`` programs fit one per SM, else one slice; or one of
    :data:`V_SLICE_CHOICES`. Raises ``ValueError`` for shapes the kernels do not take."""
    return _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, bool(varlen), bool(lower_bound_gate),
                        requested_v_slices(v_slices))


@functools.lru_cache(maxsize=4096)  # an eager call's host time counts: a repeated shape reuses its plan
def _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, varlen, lower_bound_gate, choice):
    for name, value in (("num_seqs", num_seqs), ("heads", heads), ("seq_len", seq_len), ("sms", sms)):
        _check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer, got {value!r}")
    pairs = max(num_seqs * heads, 1)
    if choice != "auto":
        slices = choice
        _check(value_dim // slices >= MIN_SLICE_WIDTH,
               f"v_slices={choice} leaves slices narrower than {MIN_SLICE_WIDTH} columns of V={value_dim}")
        reason = f"v_slices={choice} requested"
    else:
        splits = [s for s in V_SLICE_CHOICES if s > 1 and value_dim // s >= NARROW_SLICE_WIDTH]
        fitting = [s for s in splits if s * pairs <= sms]
        if fitting:
            slices = max(fitting)
            reason = (f"{pairs} (sequence, head) pairs leave SMs idle, so V is cut into {slices} slices: "
                      f"{slices * pairs} programs fit one per SM on {sms} SMs")
            larger = [s for s in splits if s > slices]
            if larger:
                reason += f" ({min(larger)} slices would put {min(larger) * pairs} programs on {sms} SMs)"
        else:
            slices = 1
            reason = f"{pairs} (sequence, head) pairs"
            reason += (f" fill the GPU: V stays whole ({min(splits)} slices would put {min(splits) * pairs} programs "
                       f"on {sms} SMs, two on some)" if splits else " and no narrower slices are allowed")
    width = value_dim // slices
    in_recurrence = w_u_in_recurrence(width, pairs)
    reason += (f"; {pairs} pairs for {width}-column slices: "
               + ("enough to share the saving, so each recurrence step forms w and u itself" if in_recurrence
                  else "the solve kernel forms w and u (each recurrence step would, from 64-column slices and "
                       "one pair per two columns)"))
    prepare_warps = 4
    return PrefillPlan(
        seq_len=seq_len, num_seqs=num_seqs, varlen=varlen, heads=heads, key_dim=key_dim, value_dim=value_dim,
        lower_bound_gate=lower_bound_gate, sms=sms, chunk=CHUNK, block=BLOCK, cpu_chunk=CPU_CHUNK,
        v_slices=slices, w_u_in_recurrence=in_recurrence, state_rows_v=state_rows_v(width),
        recurrence_warps=recurrence_warps(width), recurrence_stages=3,
        prepare_warps=prepare_warps, prepare_stages=3, prepare_channels=prepare_channels(key_dim, lower_bound_gate),
        prepare_token_run=prepare_token_run(CHUNK, key_dim, prepare_warps),
        solve_warps=4, solve_stages=3, solve_channels=max(key_dim, value_dim), reason=reason)


@dataclass(frozen=True)
class DecodePlan:
    """What the decode kernel launches with: ``v_slices`` programs per (sequence, head), each holding a
    ``[value_dim / v_slices, key_dim]`` fp32 slice of the state on ``warps`` warps, and why."""

    num_seqs: int
    heads: int
    value_dim: int
    v_slices: int
    warps: int
    reason: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        width = self.value_dim // max(self.v_slices, 1)
        _check(self.v_slices >= 1 and self.value_dim % self.v_slices == 0 and width >= MIN_SLICE_WIDTH,
               f"v_slices={self.v_slices} leaves decode slices narrower than {MIN_SLICE_WIDTH} columns of "
               f"V={self.value_dim}")
        _check(self.warps in WARP_CHOICES, f"decode warps must be one of {WARP_CHOICES}, got {self.warps}")

    @property
    def slice_width(self) -> int:
        return self.value_dim // self.v_slices

    def launch_numbers(self) -> tuple:
        """The plan as plain integers, the form the custom op carries (:meth:`from_launch_numbers`)."""
        return (self.num_seqs, self.heads, self.value_dim, self.v_slices, self.warps)

    @staticmethod
    def from_launch_numbers(numbers) -> "DecodePlan":
        return _decode_plan_from_numbers(tuple(numbers))

    def replace(self, **changes) -> "DecodePlan":
        changed = ", ".join(f"{name}={value!r}" for name, value in changes.items())
        return dataclasses.replace(self, **changes, reason=f"{self.reason}; overridden: {changed}")


@functools.lru_cache(maxsize=4096)
def _decode_plan_from_numbers(numbers):
    return DecodePlan(*numbers)


def decode_warps(slice_width: int) -> int:
    """Warps per decode program: 2 for 16 state columns, 4 for 32, 8 beyond (32 state elements a thread)."""
    return 2 if slice_width <= 16 else 4 if slice_width <= 32 else 8


def choose_decode_plan(num_seqs: int, heads: int, value_dim: int, sms: int, v_slices="auto") -> DecodePlan:
    """Decode's plan: slices of :data:`DECODE_SLICE_WIDTH` columns unless overridden. Decode is bound by the
    state's bytes, not by a serial chain, so the slice width is set by registers: a narrow slice leaves room for
    several programs per SM to keep loads in flight."""
    return _choose_decode_plan(num_seqs, heads, value_dim, sms, requested_v_slices(v_slices))


@functools.lru_cache(maxsize=4096)
def _choose_decode_plan(num_seqs, heads, value_dim, sms, choice):
    _check(value_dim in SUPPORTED_DIMS, f"V must be in {SUPPORTED_DIMS}, got {value_dim}")
    if choice == "auto":
        slices = max(value_dim // DECODE_SLICE_WIDTH, 1)
        reason = f"{slices} slices of {DECODE_SLICE_WIDTH} columns: decode is bound by the state's bytes"
    else:
        slices = choice
        reason = f"v_slices={choice} requested"
    return DecodePlan(num_seqs, heads, value_dim, slices, decode_warps(value_dim // slices), reason)
