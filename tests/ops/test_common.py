"""The direct launch path's specialisation key (fastkda/ops/common.py) against Triton's own: two arguments with the
same key must get the same specialisation from Triton, or a compiled kernel could be reused where it is wrong."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
if triton.__version__.split(".")[:2] != ["3", "6"]:
    pytest.skip("the direct launch mirrors triton 3.6 (other versions launch through Triton)", allow_module_level=True)

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from fastkda.ops.common import _specialisation  # noqa: E402

INTS = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**63 - 16, 2**63, 2**64 - 16]


def triton_key(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_key_is_at_least_as_fine_as_tritons():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    args = INTS + [0.5, -3.0, None, True, False, buffer, buffer[1:], buffer[8:], buffer[9:], buffer.float(),
                   buffer.float()[1:], buffer.float()[4:], torch.zeros(4, dtype=torch.int32)]
    for a, b in itertools.combinations(args, 2):
        if type(a) is type(b) and _specialisation([a]) == _specialisation([b]):
            assert triton_key(a) == triton_key(b), (a, b)


def test_keys_hold_no_tensors():
    """A key that held a tensor (a parameter, a subclass) would keep its memory alive in the launch cache."""
    parameter = torch.nn.Parameter(torch.zeros(8))
    assert _specialisation([parameter]) == _specialisation([torch.zeros(8)])
    assert not any(isinstance(part, torch.Tensor) for part in _specialisation([parameter, torch.zeros(3), 5]))


def test_a_profilers_launch_hook_sends_launches_through_triton():
    from fastkda.ops.common import _launch_hooked

    def hook(metadata):
        return None

    assert not _launch_hooked()
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _launch_hooked()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert not _launch_hooked()


def test_direct_path_launches_the_first_calls_binary_with_every_parameter_in_order(monkeypatch):
    """``launch`` on the CPU with stand-ins for the GPU pieces: the first call of a specialisation goes through
    ``kernel[grid]`` (Triton compiles and launches); the next with equal specialisation calls that compiled kernel's
    ``run`` with the grid, the stream and every parameter in signature order (constexpr values included); a call
    whose specialisation differs (a misaligned tensor) goes through ``kernel[grid]`` again."""
    from fastkda.ops import common

    launched = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            launched.append(("direct", args))

    class Kernel:
        arg_names = ["x", "n", "scale", "BLOCK", "FLAG"]

        def __getitem__(self, grid):
            def through_triton(*args, **meta):
                launched.append(("triton", grid, args, meta))
                return Compiled()
            return through_triton

    monkeypatch.setattr(common, "_INTERPRETING", False)
    monkeypatch.setattr(common, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # the CPU stand-ins' device, as get_device says
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    kernel, x = Kernel(), torch.zeros(64, dtype=torch.bfloat16)
    common.launch(kernel, (3, 2, 1), x, 100, 0.5, FLAG=True, BLOCK=16, num_warps=4)
    common.launch(kernel, (3, 2, 1), x, 116, 0.25, FLAG=True, BLOCK=16, num_warps=4)
    common.launch(kernel, (3, 2, 1), x[1:], 100, 0.5, FLAG=True, BLOCK=16, num_warps=4)
    assert [entry[0] for entry in launched] == ["triton", "direct", "triton"]
    assert launched[1][1] == (3, 2, 1, 1234, "function", "metadata", None, None, None, x, 116, 0.25, 16, True)


def test_a_call_on_another_gpu_launches_there(monkeypatch):
    """Triton launches on the current device: a call whose tensors are on another GPU (a model split over GPUs in
    one process) is launched inside ``torch.cuda.device`` of its first argument's GPU; one on the current GPU is
    launched as it is."""
    import contextlib

    from fastkda.ops import common

    current, switched, launched = [0], [], []

    class OnGpu:  # stands for a CUDA tensor
        def __init__(self, index):
            self.index, self.device = index, f"cuda:{index}"

        def get_device(self):
            return self.index

    @contextlib.contextmanager
    def on_device(device):
        switched.append(device)
        before, current[0] = current[0], int(device.split(":")[1])
        yield
        current[0] = before

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append(current[0])

    monkeypatch.setattr(common, "_INTERPRETING", False)
    monkeypatch.setattr(common, "_DIRECT_LAUNCH", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", on_device)
    common.launch(Kernel(), (1, 1, 1), OnGpu(1), 5, BLOCK=16)
    common.launch(Kernel(), (1, 1, 1), OnGpu(0), 5, BLOCK=16)
    assert switched == ["cuda:1"] and launched == [1, 0]
