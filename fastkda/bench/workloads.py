"""The workloads fastkda is judged on and the inputs made from them.

The workloads file ships inside the package (``fastkda/bench/workloads.json``, a copy of the project's
``shared/workloads.json`` kept equal by a test), so an installed ``fastkda-bench`` finds it from any directory.
Prefill workloads: ``H`` heads and per-sequence ``lengths``, laid out ``varlen`` (one row of all sequences with
``cu_seqlens``) or ``fixed`` (one row per sequence of equal length), in a ``group``. Decode workloads: ``N``
sequences of ``tokens_per_seq`` tokens over a state pool of ``state_dtype`` (fp32 unless it says bf16).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

DIM = 128  # K = V in every workload
LOWER_BOUND = -5.0  # the lower-bound gate's λ in every workload
ACCURACY_CASE = dict(name="accuracy_H4_T2048", H=4, lengths=[2048], layout="varlen")  # the spec's accuracy case
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # a decode workload's ``state_dtype``


PREFILL_KEYS = ("name", "group", "H", "lengths", "layout")  # what a prefill entry must have
DECODE_KEYS = ("name", "H", "N", "tokens_per_seq")  # what a decode entry must have
LAYOUTS = ("varlen", "fixed")  # a prefill entry's ``layout``


def load_workloads(path=None):
    """The workloads file: the one shipped with the package, or ``path``; ``ValueError`` naming the file (and the
    entry) where it is unreadable, not JSON or not a workloads file (:func:`check_workloads`), so that a bad file
    is refused before anything is measured."""
    source = "the shipped workloads.json" if path is None else str(path)
    try:
        if path is None:
            text = resources.files("fastkda.bench").joinpath("workloads.json").read_text(encoding="utf-8")
        else:
            text = Path(path).read_text(encoding="utf-8")
        found = json.loads(text)
    except (OSError, ValueError) as exc:  # ValueError: not JSON (JSONDecodeError) or not UTF-8 text
        raise ValueError(f"cannot read workloads file {source}: {getattr(exc, 'strerror', None) or exc}") from None
    check_workloads(found, source)
    return found


def check_workloads(found, source):
    """``ValueError`` naming ``source`` and the entry unless ``found`` is a JSON object with lists ``prefill`` and
    ``decode`` whose entries have the keys the bench reads (:data:`PREFILL_KEYS`, :data:`DECODE_KEYS`), a prefill
    ``layout`` of :data:`LAYOUTS` and, for ``fixed`` (one row per sequence), sequences of one length."""
    if not isinstance(found, dict):
        raise ValueError(f"workloads file {source}: not a JSON object with \"prefill\" and \"decode\"")
    for part, keys in (("prefill", PREFILL_KEYS), ("decode", DECODE_KEYS)):
        if not isinstance(found.get(part), list):
            raise ValueError(f"workloads file {source}: no \"{part}\" list")
        for i, w in enumerate(found[part]):
            entry = f"workloads file {source}: {part} entry {i}" + (
                f" ({w['name']})" if isinstance(w, dict) and "name" in w else "")
            if not isinstance(w, dict):
                raise ValueError(f"{entry}: not a JSON object")
            missing = [k for k in keys if k not in w]
            if missing:
                raise ValueError(f"{entry}: missing {', '.join(missing)}")
    for i, w in enumerate(found["prefill"]):
        entry = f"workloads file {source}: prefill entry {i} ({w['name']})"
        if w["layout"] not in LAYOUTS:
            raise ValueError(f"{entry}: layout must be one of {list(LAYOUTS)}, got {w['layout']!r}")
        if not (isinstance(w["lengths"], list) and w["lengths"]):
            raise ValueError(f"{entry}: lengths must be a non-empty list")
        if w["layout"] == "fixed" and len(set(w["lengths"])) > 1:
            raise ValueError(f"{entry}: a fixed layout needs sequences of one length, got {w['lengths']}")


def select(workloads, only=None, group=None, quick=False):
    """The prefill workloads named in ``only`` (in that order, so that a run cut short has measured the ones asked
    for first), or of ``group``, or all; ``quick`` keeps those of at most 12 heads x 8192 tokens. ``ValueError``
    for a name in ``only`` that is no prefill or decode workload (``only`` names both kinds) or an unknown
    ``group``, so that a typo is refused rather than measuring nothing."""
    names = [w["name"] for w in workloads["prefill"] + workloads.get("decode", [])]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(names)}")
    groups = list(dict.fromkeys(w["group"] for w in workloads["prefill"]))
    if group is not None and group not in groups:
        raise ValueError(f"unknown group {group}; known: {', '.join(groups)}")
    chosen = [w for w in workloads["prefill"] if (not only or w["name"] in only) and (not group or w["group"] == group)]
    if only:
        chosen.sort(key=lambda w: only.index(w["name"]))
    if quick:
        chosen = [w for w in chosen if sum(w["lengths"]) * w["H"] <= 12 * 8192]
    return chosen


def select_decode(workloads, only=None):
    """The decode workloads, those named in ``only`` if given."""
    return [w for w in workloads.get("decode", []) if not only or w["name"] in only]


def is_varlen(workload):
    """Whether a prefill workload is one row with ``cu_seqlens`` (the default) rather than equal-length rows."""
    return workload.get("layout", "varlen") == "varlen"


def state_dtype(workload):
    """The torch dtype of a decode workload's state pool."""
    name = workload.get("state_dtype", "fp32")
    if name not in STATE_DTYPES:
        raise ValueError(f"workload {workload.get('name')}: state_dtype must be one of {list(STATE_DTYPES)}, "
                         f"got {name!r}")
    return STATE_DTYPES[name]


def _random(device, seed):
    """(bf16 randn maker, the generator) for one input set."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
    return randn, gen


def _gate(heads, gen, device):
    """The lower-bound gate's parameters: A_log ``[H]`` and dt_bias ``[H, K]``, both ~ U(0, 1)."""
    return dict(A_log=torch.rand(heads, generator=gen, device=device),
                dt_bias=torch.rand(heads, DIM, generator=gen, device=device), scale=DIM ** -0.5)


def make_prefill_inputs(workload, device, seed=0):
    """Inputs as the workloads file describes them: randn bf16 q, k, v, g and β logits, the gate's parameters, an
    fp32 initial state per sequence, int32 ``cu_seqlens`` and the longest length ``max_seqlen`` for varlen (else
    None)."""
    randn, gen = _random(device, seed)
    heads, lengths = workload["H"], workload["lengths"]
    varlen = is_varlen(workload)
    batch, length = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return dict(
        q=randn(batch, length, heads, DIM), k=randn(batch, length, heads, DIM), v=randn(batch, length, heads, DIM),
        g=randn(batch, length, heads, DIM), beta=randn(batch, length, heads), **_gate(heads, gen, device),
        initial_state=torch.randn(len(lengths), heads, DIM, DIM, generator=gen, device=device),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device) if varlen else None,
        max_seqlen=max(lengths) if varlen else None,  # host-known, as a serving engine's batch metadata has it
    )


def make_decode_inputs(workload, device, seed=0):
    """One decode step: N sequences x tokens_per_seq tokens, a pool of the workload's ``state_dtype`` with one
    slot per token (plus a spare, never touched), slots ``[N]`` or ``[N, T]`` and, for T > 1, every draft
    accepted."""
    randn, gen = _random(device, seed)
    heads, seqs, tokens = workload["H"], workload["N"], workload["tokens_per_seq"]
    slots = torch.arange(seqs * tokens, dtype=torch.int32, device=device)
    return dict(
        q=randn(seqs, tokens, heads, DIM), k=randn(seqs, tokens, heads, DIM), v=randn(seqs, tokens, heads, DIM),
        g=randn(seqs, tokens, heads, DIM), beta=randn(seqs, tokens, heads), **_gate(heads, gen, device),
        pool=torch.randn(seqs * tokens + 1, heads, DIM, DIM, generator=gen, device=device).to(state_dtype(workload)),
        slots=slots.reshape(seqs, tokens) if tokens > 1 else slots,
        accepted=torch.full((seqs,), tokens, dtype=torch.int32, device=device) if tokens > 1 else None,
    )
