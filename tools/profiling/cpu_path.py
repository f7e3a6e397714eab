"""Measure fastkda's CPU path (issue 16, item 5) on this machine.

    python tools/profiling/cpu_path.py [--out DIR] [--transformers-python PYTHON] [--repeats N] [--skip-memory]

(a) peak memory of ``kda_chunked`` (H=4 T=65536 and H=96 T=8192, K=V=128, bf16 inputs, lower-bound gate), each in a
    fresh child process: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the call, absolute and minus the child's
    RSS after its imports and input creation (inputs are made a slice at a time, so making them peaks no higher);
(b) (token, head) pairs per second of ``kda_chunked`` against the float64 token loop (``kda_reference``) at H=4
    T=2048: the loop runs on the first ``--loop-tokens`` tokens and its time is scaled by T / loop-tokens (its cost
    per token does not depend on T: the same state size at every token);
(c) when transformers is importable, here or in ``--transformers-python``: its PyTorch chunked KDA
    (``chunk_kimi_delta_attention``) and recurrent step (``recurrent_kimi_delta_attention``) against fastkda's on the
    same fp32 inputs (H=4, one sequence; T=2048 for the chunked form, one token for the step), with the agreement of
    their results. transformers runs in a child process of that interpreter; it never imports fastkda.

Times are the minimum over ``--repeats`` runs (the median is reported too). Prints a summary and writes
``cpu_path.json`` under ``--out``: machine (CPU model from /proc/cpuinfo), date, torch version and the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KEY_DIM = 128
LOWER_BOUND = -5.0
MEMORY_SHAPES = [(4, 65536), (96, 8192)]
SPEED_SHAPE = (4, 2048)


def _fastkda():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import fastkda.reference

    return fastkda.reference


def make_inputs(heads, length, seed=0, dtype=torch.bfloat16):
    """Random KDA inputs for one sequence: q, k, v, g ``[1, T, H, 128]`` and beta ``[1, T, H]`` (randn, ``dtype``,
    filled a slice of tokens at a time so that no fp32 temporary exceeds 16 MB), A_log, dt_bias, an fp32 initial
    state ``[1, H, V, K]`` and the lower-bound gate -5."""
    gen = torch.Generator().manual_seed(seed)
    slice_tokens = max(1, 2 ** 15 // heads)

    def randn(*shape):
        x = torch.empty(*shape, dtype=dtype)
        for start in range(0, length, slice_tokens):
            stop = min(start + slice_tokens, length)
            x[:, start:stop] = torch.randn(shape[0], stop - start, *shape[2:], generator=gen)
        return x

    inp = {name: randn(1, length, heads, KEY_DIM) for name in ("q", "k", "v", "g")}
    inp["beta"] = randn(1, length, heads)
    inp["A_log"] = torch.rand(heads, generator=gen)
    inp["dt_bias"] = torch.rand(heads, KEY_DIM, generator=gen)
    inp["initial_state"] = torch.randn(1, heads, KEY_DIM, KEY_DIM, generator=gen)
    return inp


def _args(inp):
    return [inp[x] for x in ("q", "k", "v", "g", "beta")]


def _gate(inp):
    return dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND)


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def timed(fn, repeats, setup=None):
    """``(min, median)`` seconds of ``fn()`` over ``repeats`` runs after one warm-up; ``setup()`` runs untimed first."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


# ---- (a) memory, in a fresh child --------------------------------------------------------------------------------

def child_memory(heads, length):
    """Run in a fresh process: one ``kda_chunked`` call; prints its memory as one JSON line."""
    ref = _fastkda()
    inp = make_inputs(heads, length)
    rss_setup, maxrss_setup = _rss_mb(), _maxrss_mb()
    start = time.perf_counter()
    ref.kda_chunked(*_args(inp), **_gate(inp), initial_state=inp["initial_state"])
    seconds = time.perf_counter() - start
    peak = _maxrss_mb()
    output_mb = length * heads * KEY_DIM * 4 / 2 ** 20  # the fp32 output kda_chunked returns
    print(json.dumps(dict(heads=heads, length=length, rss_after_setup_mb=round(rss_setup, 1),
                          maxrss_after_setup_mb=round(maxrss_setup, 1), peak_mb=round(peak, 1),
                          extra_mb=round(peak - rss_setup, 1), output_mb=round(output_mb, 1),
                          seconds=round(seconds, 3))))


def measure_memory(heads, length, threads=None, timeout=600):
    """Peak RSS of ``kda_chunked`` at (heads, length) in a fresh child process of this interpreter."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child-memory", str(heads), str(length)]
    command += [] if threads is None else ["--threads", str(threads)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"memory child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- (b) speed against the float64 token loop ---------------------------------------------------------------------

def measure_speed(heads=SPEED_SHAPE[0], length=SPEED_SHAPE[1], loop_tokens=256, repeats=5):
    """(token, head) pairs per second of ``kda_chunked`` (fp32) and of the float64 token loop, and their ratio.
    The loop runs on the first ``loop_tokens`` tokens (all of them when 0) and is scaled to ``length``."""
    ref = _fastkda()
    inp = make_inputs(heads, length)
    loop_tokens = min(loop_tokens or length, length)
    short = {x: (inp[x][:, :loop_tokens] if x in ("q", "k", "v", "g", "beta") else inp[x]) for x in inp}
    kw = dict(**_gate(inp), initial_state=inp["initial_state"])
    chunked = timed(lambda: ref.kda_chunked(*_args(inp), **kw), repeats)
    loop = timed(lambda: ref.kda_reference(*_args(short), **kw, dtype=torch.float64), max(1, repeats // 2))
    scale = length / loop_tokens
    pairs = heads * length
    return dict(heads=heads, length=length, key_dim=KEY_DIM, value_dim=KEY_DIM, torch_threads=torch.get_num_threads(),
                chunked_s=chunked[0], chunked_median_s=chunked[1], chunked_pairs_per_s=pairs / chunked[0],
                loop_tokens=loop_tokens, loop_measured_s=loop[0], loop_scaled_s=loop[0] * scale,
                loop_pairs_per_s=pairs / (loop[0] * scale), ratio_vs_float64_loop=loop[0] * scale / chunked[0])


# ---- (c) transformers' PyTorch KDA on the same inputs ------------------------------------------------------------

def same_inputs(heads=SPEED_SHAPE[0], length=SPEED_SHAPE[1]):
    """fp32 inputs both implementations take as they are: l2-normalised inside, the log-decay ``a`` itself as the gate
    (the lower-bound gate's values), ``beta`` already through the sigmoid, the initial state K-first for
    transformers (``[1, H, K, V]``) and V-first for fastkda."""
    ref = _fastkda()
    inp = make_inputs(heads, length, seed=1, dtype=torch.float32)
    a = ref.log_decay(inp["g"], inp["A_log"], inp["dt_bias"], LOWER_BOUND)
    return dict(q=inp["q"], k=inp["k"], v=inp["v"], g=a.contiguous(), beta=torch.sigmoid(inp["beta"]),
                initial_state_kv=inp["initial_state"].transpose(-1, -2).contiguous(),
                initial_state_vk=inp["initial_state"])


def child_transformers(in_path, out_path, repeats, step_repeats):
    """Run under the transformers interpreter: times its chunked function and its recurrent step on the saved
    inputs; saves their results to ``out_path`` and prints the timings as one JSON line."""
    import transformers
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    inp = torch.load(in_path)
    chunk_fn, step_fn = kimi.chunk_kimi_delta_attention, kimi.recurrent_kimi_delta_attention
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=inp["initial_state_kv"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    chunked = timed(lambda: chunk_fn(*args, **kw), repeats)
    o, state = chunk_fn(*args, **kw)
    one = [x[:, :1] for x in args]
    step = timed(lambda: step_fn(*one, **kw), step_repeats)
    step_o, step_state = step_fn(*one, **kw)
    torch.save(dict(o=o, state=state, step_o=step_o, step_state=step_state), out_path)
    name = lambda fn: f"{fn.__module__}.{fn.__name__}"  # noqa: E731
    print(json.dumps(dict(transformers=transformers.__version__, torch=torch.__version__,
                          torch_threads=torch.get_num_threads(), chunk_impl=name(chunk_fn), step_impl=name(step_fn),
                          chunked_s=chunked[0], chunked_median_s=chunked[1], step_s=step[0], step_median_s=step[1])))


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def measure_transformers(python, heads=SPEED_SHAPE[0], length=SPEED_SHAPE[1], repeats=5, threads=None, timeout=600):
    """transformers' chunked function and recurrent step (in a child of ``python``) against fastkda's
    ``kda_chunked`` and ``kda_decode_reference`` (fp32, the CPU path) on the same inputs. fastkda is timed before
    and after the child, and its best time of both counts, so a change of the machine's load in between favours
    neither side."""
    ref = _fastkda()
    inp = same_inputs(heads, length)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=inp["initial_state_vk"], use_beta_sigmoid=False)
    o, state = ref.kda_chunked(*args, **kw)
    one = [x[:, :1] for x in args]
    pool0 = inp["initial_state_vk"].clone()
    pool = pool0.clone()
    slots = torch.zeros(1, dtype=torch.int32)
    step_o = ref.kda_decode_reference(*one, pool, slots, use_beta_sigmoid=False)
    step_state = pool.clone()
    fresh = lambda: pool.copy_(pool0)  # noqa: E731  (a fresh state every run: a decaying one turns subnormal)
    step_repeats = max(repeats, 300)

    def ours():
        import fastkda

        return dict(chunked=timed(lambda: ref.kda_chunked(*args, **kw), repeats),
                    step=timed(lambda: ref.kda_decode_reference(*one, pool, slots, use_beta_sigmoid=False),
                               step_repeats, setup=fresh),
                    api=timed(lambda: fastkda.kda_decode(*one, pool, slots, use_beta_sigmoid=False), step_repeats,
                              setup=fresh))

    before = ours()
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = Path(tmp) / "inputs.pt", Path(tmp) / "results.pt"
        torch.save(inp, in_path)
        command = [python, str(Path(__file__).resolve()), "--child-transformers", str(in_path), str(out_path),
                   str(repeats), str(step_repeats)] + ([] if threads is None else ["--threads", str(threads)])
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"transformers child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        results = torch.load(out_path)
    after = ours()
    best = {name: (min(before[name][0], after[name][0]), min(before[name][1], after[name][1])) for name in before}
    return dict(
        transformers=theirs["transformers"], transformers_torch=theirs["torch"],
        transformers_torch_threads=theirs["torch_threads"], chunk_impl=theirs["chunk_impl"],
        step_impl=theirs["step_impl"], heads=heads, length=length,
        chunked=dict(transformers_s=theirs["chunked_s"], transformers_median_s=theirs["chunked_median_s"],
                     fastkda_s=best["chunked"][0], fastkda_median_s=best["chunked"][1],
                     speedup=theirs["chunked_s"] / best["chunked"][0], rel_err_output=_rel(o, results["o"]),
                     rel_err_final_state=_rel(state, results["state"].transpose(-1, -2))),
        decode_step=dict(transformers_us=theirs["step_s"] * 1e6, transformers_median_us=theirs["step_median_s"] * 1e6,
                         fastkda_reference_us=best["step"][0] * 1e6, fastkda_reference_median_us=best["step"][1] * 1e6,
                         fastkda_kda_decode_us=best["api"][0] * 1e6, fastkda_kda_decode_median_us=best["api"][1] * 1e6,
                         speedup=theirs["step_s"] / best["step"][0], rel_err_output=_rel(step_o, results["step_o"]),
                         rel_err_state=_rel(step_state, results["step_state"].transpose(-1, -2))))


def find_transformers_python(given):
    if given:
        return given
    if importlib.util.find_spec("transformers") is not None:
        return sys.executable
    return None


# ---- report --------------------------------------------------------------------------------------------------------

def machine():
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), python=platform.python_version(),
                platform=platform.platform(), load_average_at_start=list(os.getloadavg()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="folder for cpu_path.json (default: the current directory)")
    parser.add_argument("--transformers-python", default=None,
                        help="an interpreter with transformers installed (default: this one, when it has it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-tokens", type=int, default=256,
                        help="tokens the float64 loop runs on (scaled to T); 0: all of them")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for every measurement, transformers' too (default: torch's)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--child-memory", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-transformers", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory:
        return child_memory(*args.child_memory)
    if args.child_transformers:
        in_path, out_path, repeats, step_repeats = args.child_transformers
        return child_transformers(in_path, out_path, int(repeats), int(step_repeats))

    results = dict(machine=machine(), date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   torch=torch.__version__)
    if not args.skip_memory:
        results["memory"] = []
        for heads, length in MEMORY_SHAPES:
            m = measure_memory(heads, length, args.threads)
            results["memory"].append(m)
            print(f"(a) kda_chunked H={heads} T={length}: peak RSS {m['peak_mb']:.0f} MB, {m['extra_mb']:.0f} MB "
                  f"above the {m['rss_after_setup_mb']:.0f} MB after imports and inputs (the output alone: "
                  f"{m['output_mb']:.0f} MB), {m['seconds']:.2f} s")
    s = measure_speed(loop_tokens=args.loop_tokens, repeats=args.repeats)
    results["speed"] = s
    print(f"(b) H={s['heads']} T={s['length']}: kda_chunked {s['chunked_s'] * 1e3:.1f} ms "
          f"({s['chunked_pairs_per_s']:.3g} pairs/s); float64 loop {s['loop_measured_s']:.3f} s on {s['loop_tokens']} "
          f"tokens, {s['loop_scaled_s']:.2f} s scaled ({s['loop_pairs_per_s']:.3g} pairs/s): "
          f"{s['ratio_vs_float64_loop']:.1f}x")
    python = find_transformers_python(args.transformers_python)
    if python is None:
        results["transformers"] = dict(skipped="transformers not importable; pass --transformers-python")
        print("(c) skipped: transformers not importable here; pass --transformers-python")
    else:
        t = measure_transformers(python, repeats=args.repeats, threads=args.threads)
        results["transformers"] = t
        c, d = t["chunked"], t["decode_step"]
        print(f"(c) transformers {t['transformers']} ({t['chunk_impl']}): chunked "
              f"{c['transformers_s'] * 1e3:.1f} ms vs kda_chunked {c['fastkda_s'] * 1e3:.1f} ms: {c['speedup']:.1f}x "
              f"(rel. L2 output {c['rel_err_output']:.1e}, final state {c['rel_err_final_state']:.1e})")
        print(f"    decode step: transformers {d['transformers_us']:.0f} us (median {d['transformers_median_us']:.0f})"
              f" vs kda_decode_reference {d['fastkda_reference_us']:.0f} us (median "
              f"{d['fastkda_reference_median_us']:.0f}): {d['speedup']:.2f}x; kda_decode "
              f"{d['fastkda_kda_decode_us']:.0f} us (rel. L2 output {d['rel_err_output']:.1e}, state "
              f"{d['rel_err_state']:.1e})")
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cpu_path.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
