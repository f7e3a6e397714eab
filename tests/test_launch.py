"""The direct launch path's specialisation key (fastkda/ops/common.py) against Triton's own: two arguments with the
same key must get the same specialisation from Triton, or a compiled kernel could be reused where it is wrong."""

import itertools

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from fastkda.ops.common import _specialisation

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
    import triton

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
