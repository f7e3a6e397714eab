"""Slot pools of the recurrent and conv states of a stack of KDA layers, as serving engines keep them.

One :class:`KDACache` serves every KDA layer of a model: for each layer a recurrent-state pool
``[P, H, V, K]`` (the layout :func:`fastkda.kda_decode` updates in place) and a conv-state pool ``[P, C, W−1]``
(the shape :func:`fastkda.causal_conv1d` takes, held channel-last in memory by :func:`conv_state_pool`), a row
of each per live request. Slots are handed out on the host
(:meth:`KDACache.allocate`, :meth:`KDACache.release`); the kernels read them from device tensors, where a
negative slot (:data:`NULL_SLOT`) is a padding row that reads zeros and writes nothing. Each pool has one row more
than it hands out, :attr:`KDACache.scratch_slot`: gathers and scatters written in plain PyTorch send a padding
row's write there, so that no live row is written twice in one call and none is written for a padding row.
Prefix-cache checkpoints (fp32 states a prefill wrote at a chunk multiple) go back into a fresh slot with
:meth:`KDACache.restore`.
"""

import numbers

import torch

from ..api import CONV_WIDTHS
from ..plan import SUPPORTED_DIMS
from ..validation import FLOAT_DTYPES, STATE_DTYPES, capturing

NULL_SLOT = -1


def _is_host_int(value):
    """An integer on the host (numpy's too), not a bool: what a slot or a count may be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_integer_tensor(tensor):
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def _host_slot(slot):
    """``slot`` as a host int, or None where it is none: a host int, or a 0-d integer tensor (what iterating over
    an :meth:`KDACache.allocate` result gives, so that a list of those releases as the tensor does)."""
    if isinstance(slot, torch.Tensor) and slot.dim() == 0 and _is_integer_tensor(slot):
        return int(slot.item())
    return int(slot) if _is_host_int(slot) else None


def conv_state_pool(*rows, channels, kernel, dtype, device=None):
    """Zeros of shape ``[*rows, C, W−1]`` whose memory is ``[*rows, W−1, C]``: each of a row's W−1 columns is its
    channels back to back (the layout vLLM keeps too), so the conv's decode step reads and writes whole columns
    with vector accesses (docs/perf-notes.md, 12 heads and 256 sequences: 10.3 against 12.4 us with a bf16 pool,
    13.5 against 15.1 with fp32)."""
    if kernel not in CONV_WIDTHS:
        raise ValueError(f"conv_state_pool: kernel must be in [{CONV_WIDTHS[0]}, {CONV_WIDTHS[-1]}] (the kernel sizes "
                         f"the conv takes), got {kernel}")
    return torch.zeros(*rows, kernel - 1, channels, dtype=dtype, device=device).transpose(-1, -2)


class KDACache:
    """Recurrent and conv state pools for ``num_layers`` KDA layers with ``num_slots`` rows each.

    Args:
        num_slots: rows per pool (requests alive at once).
        num_layers: KDA layers sharing the cache (a layer addresses its own pools by index).
        heads, head_dim: the layer's local heads H and K = V (64 or 128, what the kernels take).
        conv_channels, conv_kernel: the conv's channels (``3·H·D`` for q, k, v) and kernel size W (2 to 8).
        state_dtype: fp32 (default) or bf16 recurrent states; conv_dtype: fp32 (default: exact, and small
            beside the recurrent states) or the activations' dtype (bf16 or fp16).

    Sizes and dtypes the kernels do not take are refused here, by name, rather than at a layer's first call; a
    layer refuses a cache whose heads, head_dim, conv_channels or conv_kernel are not its own.
    """

    def __init__(self, num_slots, num_layers, heads, head_dim, conv_channels, conv_kernel, *,
                 state_dtype=torch.float32, conv_dtype=torch.float32, device=None):
        sizes = dict(num_slots=num_slots, num_layers=num_layers, heads=heads, head_dim=head_dim,
                     conv_channels=conv_channels, conv_kernel=conv_kernel)
        for name, size in sizes.items():
            if not _is_host_int(size) or size < 1:
                raise ValueError(f"KDACache: {name} must be an int >= 1, got {size!r}")
        if head_dim not in SUPPORTED_DIMS:
            raise ValueError(f"KDACache: head_dim must be one of {SUPPORTED_DIMS} (what the kernels take), got "
                             f"{head_dim}")
        if conv_kernel not in CONV_WIDTHS:
            raise ValueError(f"KDACache: conv_kernel must be in [{CONV_WIDTHS[0]}, {CONV_WIDTHS[-1]}] (the kernel "
                             f"sizes the conv takes), got {conv_kernel}")
        for name, dtype, allowed in (("state_dtype", state_dtype, STATE_DTYPES), ("conv_dtype", conv_dtype,
                                                                                   FLOAT_DTYPES)):
            if dtype not in allowed:
                raise ValueError(f"KDACache: {name} must be one of {', '.join(map(str, allowed))}, got {dtype}")
        rows = num_slots + 1  # the last is the scratch row
        self.recurrent = torch.zeros(num_layers, rows, heads, head_dim, head_dim, dtype=state_dtype, device=device)
        self.conv = conv_state_pool(num_layers, rows, channels=conv_channels, kernel=conv_kernel, dtype=conv_dtype,
                                    device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._tickets = torch.zeros(num_slots * heads, dtype=torch.int32, device=device)

    @property
    def num_slots(self):
        """Slots that :meth:`allocate` hands out (the pools hold one more, the scratch row)."""
        return self.recurrent.shape[1] - 1

    @property
    def scratch_slot(self):
        """The pools' last row: never handed out, the target of padding rows' writes."""
        return self.recurrent.shape[1] - 1

    @property
    def heads(self):
        return self.recurrent.shape[2]

    @property
    def head_dim(self):
        return self.recurrent.shape[3]

    @property
    def conv_channels(self):
        return self.conv.shape[2]

    @property
    def conv_kernel(self):
        """The conv's kernel size W (a conv pool row holds W−1 columns)."""
        return self.conv.shape[3] + 1

    @property
    def free_slots(self):
        return len(self._free)

    def allocate(self, count=1):
        """``count`` free slots as an int32 device tensor; their rows are zeroed. Raises when too few are free."""
        if not _is_host_int(count) or count < 0:
            raise ValueError(f"KDACache.allocate: count must be an int >= 0, got {count!r}")
        if count > len(self._free):
            raise RuntimeError(f"KDACache: {count} slot(s) requested, {len(self._free)} of {self.num_slots} free")
        taken = [self._free.pop() for _ in range(int(count))]
        slots = torch.tensor(taken, dtype=torch.int32, device=self.recurrent.device)
        self.recurrent[:, slots.long()] = 0
        self.conv[:, slots.long()] = 0
        return slots

    def release(self, slots):
        """Give slots back (a host int, an iterable of them or of 0-d integer tensors, or an integer tensor of any
        shape, e.g. speculative decoding's ``[N, S]``; null slots are ignored). Releasing a free slot, or anything
        but integers, raises ``ValueError`` before any slot is freed."""
        if isinstance(slots, torch.Tensor) and slots.dim() > 0:
            if not _is_integer_tensor(slots):
                raise ValueError(f"KDACache.release: slots must be integers, got a {slots.dtype} tensor")
            values = slots.reshape(-1).tolist()
        elif _host_slot(slots) is not None:
            values = [_host_slot(slots)]
        else:
            try:
                given = list(slots)
            except TypeError:  # no int and no iterable (a float, None, a 0-d float tensor)
                raise ValueError(f"KDACache.release: slots must be integers (an int, an iterable of them or an "
                                 f"integer tensor), got {slots!r}") from None
            values = [_host_slot(slot) for slot in given]
            for slot, value in zip(given, values):
                if value is None:
                    raise ValueError(f"KDACache.release: slots must be integers, got {slot!r}")
        live = [slot for slot in values if slot >= 0]
        free, seen = set(self._free), set()
        for slot in live:  # every slot checked before any is freed
            if slot >= self.num_slots or slot in free or slot in seen:
                raise ValueError(f"KDACache.release: slot {slot} is not allocated")
            seen.add(slot)
        self._free.extend(live)

    def step_tickets(self, count):
        """``count`` int32 zeros for :func:`fastkda.kda_decode_step`, which leaves them as zeros: one buffer for
        every layer and step, grown when a batch needs more, except while a CUDA graph is captured: a buffer made
        then belongs to the graph's private memory pool, whose blocks other graphs reuse, so it is the graph's own
        (its zeros written by each replay) and not kept."""
        if self._tickets.numel() < count:
            device = self._tickets.device
            if capturing(device):
                return torch.zeros(count, dtype=torch.int32, device=device)
            self._tickets = torch.zeros(count, dtype=torch.int32, device=device)
        return self._tickets[:count]

    def layer(self, index):
        """Layer ``index``'s ``(recurrent pool [P + 1, H, V, K], conv pool [P + 1, C, W−1])``, views into the
        cache (row P the scratch row; the kernels get the first P rows, so that slot P is out of range for them).
        ``index`` in ``[0, layers)``: a negative one would name another layer's pools."""
        layers = self.recurrent.shape[0]
        if not _is_host_int(index) or not 0 <= index < layers:
            raise ValueError(f"KDACache.layer: index must be an int in [0, {layers}) (the cache's layers), got "
                             f"{index!r}")
        return self.recurrent[index], self.conv[index]

    def restore(self, slot, recurrent_states, conv_states):
        """Put a prefix's states into ``slot`` (e.g. a fresh one from :meth:`allocate`): ``recurrent_states
        [layers, H, V, K]`` (a prefill's checkpoint, any float dtype) and ``conv_states [layers, C, W−1]`` (the
        W−1 inputs before the prefix's end). ``slot``: an int or a one-element tensor, allocated (a free slot's
        states would be zeroed when :meth:`allocate` hands it out)."""
        if isinstance(slot, torch.Tensor):
            if slot.numel() != 1 or not _is_integer_tensor(slot):
                raise ValueError(f"KDACache.restore: slot must be an int or a one-element integer tensor, got a "
                                 f"{slot.dtype} tensor of shape {list(slot.shape)}")
            slot = slot.item()
        if not _is_host_int(slot) or not 0 <= slot < self.num_slots:
            raise ValueError(f"KDACache.restore: slot must be an int in [0, {self.num_slots}), got {slot!r}")
        slot = int(slot)
        if slot in self._free:
            raise ValueError(f"KDACache.restore: slot {slot} is not allocated (allocate() it first)")
        for name, states, pool in (("recurrent_states", recurrent_states, self.recurrent),
                                   ("conv_states", conv_states, self.conv)):
            want = [pool.shape[0], *pool.shape[2:]]
            if not isinstance(states, torch.Tensor) or list(states.shape) != want:  # a broadcast would put one
                # layer's states into every layer
                raise ValueError(f"KDACache.restore: {name} must be a tensor of shape {want} (layers first), got "
                                 f"{list(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__}")
        with torch.no_grad():  # the pools are state: no autograd history enters them
            self.recurrent[:, slot].copy_(recurrent_states)
            self.conv[:, slot].copy_(conv_states)
