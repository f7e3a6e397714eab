"""Time variants of the preparation kernels in one device call (whole prefill call, auto plan), each checked
against the first (they differ only in rounding). A variant is either module settings or a source edit of
``fastkda/ops/prefill.py``, imported as a separate module so that Triton compiles it afresh.

python scripts/prepare_variants.py [--only H96_B1_T8192 ...] [--source OLD_PREFILL.py ...]
Every variant is first compiled in a process of its own, all at once (Triton's cache is shared on disk), so
the device call pays for one compile, not one per variant."""

import argparse
import importlib
import subprocess
import sys
import time
from pathlib import Path

from triton.testing import do_bench

import fastkda.api
from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs

SOURCE = Path(fastkda.api.__file__).parent / "ops" / "prefill.py"
PREFETCH_HELPER = '''@triton.jit
def _log2_decay_values(gv, valid, h, kk, A_log, dt_bias, lower_bound, K: tl.constexpr,
                       LOWER_BOUND_GATE: tl.constexpr, EMULATE: tl.constexpr):
    if LOWER_BOUND_GATE:
        slope = tl.exp(tl.load(A_log + h).to(tl.float32)) * LOG2E
        bias = tl.load(dt_bias + h * K + kk).to(tl.float32)
        a = (lower_bound * LOG2E) * fast_reciprocal(1.0 + fast_exp2(-slope * (gv + bias[None, :]), EMULATE), EMULATE)
    else:
        a = tl.maximum(gv, LOG_DECAY_FLOOR) * LOG2E
    return tl.where(valid[:, None], a, 0.0)


'''
LOOP_HEAD = '''    for c in range(K // BK):
        kk = c * BK + tl.arange(0, BK)
        m = valid[:, None]
        q_b = load_f32(q_c + r[:, None] * stride_q + kk[None, :], m) * qs[:, None]
        k_b = load_f32(k_c + r[:, None] * stride_k + kk[None, :], m) * ks[:, None]
        a3 = tl.reshape(_log2_decay_block(g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, K,
                                          LOWER_BOUND_GATE, EMULATE), (NB, BC, BK))
'''
PREFETCHED_LOOP_HEAD = '''    kk_next = tl.arange(0, BK)
    q_next = tl.load(q_c + r[:, None] * stride_q + kk_next[None, :], mask=valid[:, None], other=0.0)
    k_next = tl.load(k_c + r[:, None] * stride_k + kk_next[None, :], mask=valid[:, None], other=0.0)
    g_next = tl.load(g_c + r[:, None] * stride_g + kk_next[None, :], mask=valid[:, None], other=0.0)
    for c in range(K // BK):
        kk = c * BK + tl.arange(0, BK)
        m = valid[:, None]
        q_raw, k_raw, g_raw = q_next, k_next, g_next
        kk_next = kk + BK
        more = valid[:, None] & (kk_next[None, :] < K)
        q_next = tl.load(q_c + r[:, None] * stride_q + kk_next[None, :], mask=more, other=0.0)
        k_next = tl.load(k_c + r[:, None] * stride_k + kk_next[None, :], mask=more, other=0.0)
        g_next = tl.load(g_c + r[:, None] * stride_g + kk_next[None, :], mask=more, other=0.0)
        q_b = q_raw.to(tl.float32) * qs[:, None]
        k_b = k_raw.to(tl.float32) * ks[:, None]
        a3 = tl.reshape(_log2_decay_values(g_raw.to(tl.float32), valid, h, kk, A_log, dt_bias, lower_bound, K,
                                           LOWER_BOUND_GATE, EMULATE), (NB, BC, BK))
'''


def prefetch(src):
    """The first kernel's channel loop issues the next block's q/k/g loads before computing the current one."""
    assert LOOP_HEAD in src
    src = src.replace(LOOP_HEAD, PREFETCHED_LOOP_HEAD)
    return src.replace("@triton.jit\ndef _log2_decay_block(", PREFETCH_HELPER + "@triton.jit\ndef _log2_decay_block(", 1)


# (label, module settings, source edit or None)
VARIANTS = [
    ("as committed", {}, None),
    ("prepare capped at 128 registers (2 programs per SM)", dict(PREPARE_MAXNREG=128), None),
    ("prepare 16-channel steps, capped at 128 registers", dict(PREPARE_MAXNREG=128, PREPARE_CHANNELS=16), None),
    ("prepare on 16 warps (128 registers, no cap needed)", dict(PREPARE_WARPS=16), None),
    ("next channel block prefetched", {}, prefetch),
    ("solve on 4 warps", dict(SOLVE_WARPS=4), None),
]


def variant_module(index, settings, edit):
    """``fastkda.ops.prefill`` reloaded (its defaults back), or a source-edited copy of it; then ``settings``
    applied. The API imports ``chunk_kda_forward`` from ``fastkda.ops.prefill`` at each call, so the variant's
    is put there."""
    prefill = importlib.reload(importlib.import_module("fastkda.ops.prefill"))
    module = prefill
    if edit is not None:
        path = SOURCE.parent / f"_variant{index}.py"
        path.write_text(edit(SOURCE.read_text()))
        module = importlib.import_module(f"fastkda.ops._variant{index}")
    for name, value in settings.items():
        setattr(module, name, value)
    prefill.chunk_kda_forward = module.chunk_kda_forward
    return module


def variants(source_files):
    """The built-in variants, then one per ``--source`` file (a whole other ``prefill.py``, e.g. an older one)."""
    extra = [(f"source {path}", {}, lambda _, text=Path(path).read_text(): text) for path in source_files]
    return VARIANTS + extra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=["H96_B1_T8192", "H12_N1_T8192"])
    parser.add_argument("--source", nargs="*", default=[], help="other prefill.py files to time as variants")
    parser.add_argument("--compile-only", type=int, help="run variant INDEX once on a small case (cache warm-up)")
    args = parser.parse_args()
    chosen = variants(args.source)
    try:
        if args.compile_only is not None:  # fills Triton's on-disk cache; many of these run at once
            variant_module(args.compile_only, *chosen[args.compile_only][1:])
            for w in load_workloads()["prefill"]:
                if w["name"] in args.only:  # the timed shapes themselves: Triton specialises on some of their values
                    fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")()
            return
        started = time.time()
        workers = [subprocess.Popen([sys.executable, __file__, "--compile-only", str(index), "--only", *args.only,
                                     "--source", *args.source])
                   for index in range(len(chosen))]
        for worker in workers:
            worker.wait()
        print(f"[variants] {len(chosen)} variants compiled in parallel in {time.time() - started:.0f} s", flush=True)
        for w in load_workloads()["prefill"]:
            if w["name"] not in args.only:
                continue
            run = fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")
            expected = None
            for index, (label, settings, edit) in enumerate(chosen):
                try:
                    variant_module(index, settings, edit)
                    out = run()[0]
                    if expected is None:
                        expected = out.float().clone()
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                    print(f"[variants] {w['name']} {label}: {ms:.3f} ms (whole call), vs first {err:.1e}", flush=True)
                except Exception as error:  # one broken variant must not hide the others' numbers
                    print(f"[variants] {w['name']} {label}: failed: {type(error).__name__}: {str(error)[:300]}",
                          flush=True)
    finally:
        if args.compile_only is None:
            importlib.reload(importlib.import_module("fastkda.ops.prefill"))
            for path in SOURCE.parent.glob("_variant*.py"):
                path.unlink()


if __name__ == "__main__":
    main()
