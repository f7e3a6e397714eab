"""Where a decode step's time goes in transformers' tiny KDA models: fastkda against transformers' PyTorch path and,
on a GPU where transformers bound it, FLA (issue 19), measured two ways that leave out the prompt's prefill and the
host's drift.

    python tools/profiling/models_decode_step.py [--cases kimi_linear:1x64 ...] [--calls 200] [--turns 9]
                                                 [--steps 300] [--device cpu|cuda] [--out FILE]

(a) Per call: the functions fastkda replaces in a decode step (the conv update, the recurrent KDA step, the gated
    norm), each called with the arguments the model passed it in a real decode step on that path (the paths hand
    them states of different layouts), the tensors they update put back before every call, untimed. The paths take
    turns ``--turns`` times; each turn's median of ``--calls`` calls, then the median of the turns.
(b) Per step: one decode forward of the whole model from the cache of its prompt, deep-copied before every step
    (untimed), the paths alternating every step: the median step of each path and, against each other path, the
    median of the ``--steps`` paired differences (fastkda's step minus that path's step next to it).

On a GPU (``--device cuda``: the models in bf16, as ``fastkda.bench.models`` runs them there) every timed call and
step is synchronised before and after, so its time is the host's and the device's together, eager.

Imports fastkda from the repository this file sits in, so a copy of the tool in an older checkout measures that
checkout. Prints a table and writes the numbers as JSON to ``--out``.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda

import torch  # noqa: E402

from fastkda.bench.models import binds_fla, bound_functions, modeling_module, use_path  # noqa: E402
from fastkda.bench.report import git_commit  # noqa: E402
from fastkda.integrations import transformers as fastkda_transformers  # noqa: E402
from fastkda.integrations.tiny_models import tiny_model  # noqa: E402

PATHS = ("pytorch", "fastkda")  # and "fla" on a GPU where transformers bound it (:func:`paths_for`)
CALLS = ("causal_conv1d_update", "recurrent_kimi_delta_attention", "gated_norm")
CASES = [f"{kind}:{case}" for kind in ("kimi_linear", "glm5_next") for case in ("1x64", "2x64", "1x2048", "2x2048")]


def model_cache(output):
    """The cache in a model's output and the keyword that passes it back: ``cache`` (transformers 5.2x) or
    ``past_key_values`` (earlier)."""
    name = "cache" if "cache" in output else "past_key_values"
    return name, output[name]


def paths_for(bound, device):
    """The paths to time: transformers' PyTorch path and fastkda, and FLA where transformers bound it (CUDA)."""
    with_fla = device.type == "cuda" and binds_fla(bound["chunk_kimi_delta_attention"])
    return PATHS + (("fla",) if with_fla else ())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_arguments(model, module, bound, ids, paths):
    """For each path, the arguments each replaced function got in the last decode step of a short greedy
    generation, and the function itself: ``{path: {call: (function, args, kwargs)}}``."""
    norm_class = getattr(module, fastkda_transformers.MODELS[module.__name__])
    captured = {}
    for path in paths:
        use_path(module, path, bound)
        functions = {name: getattr(module, name) for name in CALLS[:2]}
        functions[CALLS[2]] = norm_class.forward
        seen = {}

        def recorder(name, function):
            def record(*args, **kwargs):
                seen[name] = (args, kwargs)
                return function(*args, **kwargs)
            return record

        for name in CALLS[:2]:
            setattr(module, name, recorder(name, functions[name]))
        norm_class.forward = recorder(CALLS[2], functions[CALLS[2]])
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, eos_token_id=None)
        norm_class.forward = functions[CALLS[2]]
        use_path(module, path, bound)  # the functions as the path binds them
        captured[path] = {name: (functions[name], *seen[name]) for name in CALLS}
    return captured


def median_call_us(function, args, kwargs, calls, device):
    """Median µs of ``calls`` calls, every tensor argument put back to its captured values before each (untimed):
    the calls update their states in place, and a state decayed call after call turns subnormal."""
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    saved = [x.clone() for x in tensors]
    times = []
    for _ in range(calls):
        for x, values in zip(tensors, saved):
            x.copy_(values)
        synchronize(device)
        start = time.perf_counter()
        function(*args, **kwargs)
        synchronize(device)
        times.append(time.perf_counter() - start)
    for x, values in zip(tensors, saved):
        x.copy_(values)
    return statistics.median(times) * 1e6


def per_call(model, module, bound, ids, calls, turns, paths, device):
    """(a): ``{path: {call: median µs}}``."""
    captured = decode_step_arguments(model, module, bound, ids, paths)
    times = {path: {name: [] for name in CALLS} for path in paths}
    for turn in range(turns):
        for path in paths[turn % len(paths):] + paths[:turn % len(paths)]:
            use_path(module, path, bound)
            for name, (function, args, kwargs) in captured[path].items():
                times[path][name].append(median_call_us(function, args, kwargs, calls, device))
    return {path: {name: statistics.median(values) for name, values in calls_.items()}
            for path, calls_ in times.items()}


def per_step(model, module, bound, ids, steps, paths, device):
    """(b): each path's median decode step (ms), and against each other path the median paired difference (µs,
    fastkda − that path) and in how many steps fastkda was faster."""
    prompt = {}
    for path in paths:
        use_path(module, path, bound)
        prompt[path] = model_cache(model(ids[:, :-1], use_cache=True))
    token, position = ids[:, -1:], torch.tensor([ids.shape[1] - 1], device=ids.device)
    times = {path: [] for path in paths}
    for step in range(steps):
        for path in paths[step % len(paths):] + paths[:step % len(paths)]:
            use_path(module, path, bound)
            name, cache = prompt[path]
            cache = copy.deepcopy(cache)
            synchronize(device)
            start = time.perf_counter()
            model(token, use_cache=True, cache_position=position, **{name: cache})
            synchronize(device)
            times[path].append(time.perf_counter() - start)
    differences = {other: [(ours - theirs) * 1e6 for ours, theirs in zip(times["fastkda"], times[other])]
                   for other in paths if other != "fastkda"}
    return dict(step_ms={path: statistics.median(values) * 1e3 for path, values in times.items()},
                paired_difference_us={other: statistics.median(d) for other, d in differences.items()},
                fastkda_faster_steps={other: sum(x < 0 for x in d) for other, d in differences.items()}, steps=steps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=CASES, metavar="MODEL:BxT")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, models, bindings = [], {}, {}
    for case in args.cases:
        kind, shape = case.split(":")
        batch, length = (int(n) for n in shape.split("x"))
        module = modeling_module(kind)
        if kind not in models:  # transformers' own functions, before any path replaces them
            models[kind], bindings[kind] = tiny_model(kind, device=device, dtype=dtype), bound_functions(module)
        model, bound = models[kind], bindings[kind]
        paths = paths_for(bound, device)
        ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
        row = dict(model=kind, batch=batch, length=length, device=str(device),
                   calls_us=per_call(model, module, bound, ids, args.calls, args.turns, paths, device),
                   **per_step(model, module, bound, ids, args.steps, paths, device))
        fastkda_transformers.disable()
        for name, function in bound.items():
            setattr(module, name, function)
        rows.append(row)
        order = ["fastkda"] + [path for path in paths if path != "fastkda"]
        calls = "  ".join(name + " " + "/".join(f"{row['calls_us'][path][name]:5.1f}" for path in order)
                          for name in CALLS)
        sums = "/".join(f"{sum(row['calls_us'][path].values()):6.1f}" for path in order)
        steps = "/".join(f"{row['step_ms'][path]:.3f}" for path in order)
        paired = ", ".join(f"{row['paired_difference_us'][other]:+.0f} µs against {other} (fastkda faster in "
                           f"{row['fastkda_faster_steps'][other]}/{args.steps})" for other in order[1:])
        print(f"[decode step] {kind:12s} B{batch} T{length:<5d} µs {'/'.join(order)}: {calls}  sum {sums};  step ms "
              f"{steps}, paired {paired}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(commit=git_commit(), torch=torch.__version__,
                                                  threads=torch.get_num_threads(), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
