"""fastkda's Gluon kernels on Triton's CPU interpreter, for the tests: Gluon has no interpreter of its own, so
without this a Gluon kernel first meets a check on the GPU.

:func:`interpreted_gluon` runs a module's ``@gluon.jit`` functions as Triton's interpreter runs ``@triton.jit``
ones (``TRITON_INTERPRET=1``, triton 3.6): a program at a time, each block value a numpy array, the ``tl``
operations and the ``@triton.jit`` helpers the Gluon code calls as the interpreter runs them. The Gluon operations
the module uses become:

* layouts: ignored (a layout changes where a value lives, never the value), so ``convert_layout`` is the identity;
* shared memory: a numpy array per allocation, NaN-filled, with views for ``index`` and ``permute``;
* ``cp.async`` (``async_copy``): the masked load is read when it is issued (masked-off elements zero, as
  ``cp.async`` zero-fills them) and lands in shared memory when ``wait_group`` retires its commit group;
* ``warpgroup_mma``: the product of the bf16 operands in fp32, adding onto the accumulator term by term in the
  order k = 0, 1, ... (as ``tests/interpreter.py`` makes the interpreter's ``tl.dot`` do), ``warpgroup_mma_wait``
  retiring the oldest products in flight;
* barriers and fences: no-ops for the values (one program runs at a time, every warp at once); a landed
  ``cp.async`` copy, like a register store, must be fenced before the tensor cores read it;
* ``gl.warp_specialize``: each partition in a thread of its own, one running at a time, each until it waits on an
  mbarrier (cooperatively, so runs repeat; the default partition in the calling thread); ``mbarrier`` init,
  arrive and wait by phase parity (predicates honoured), and ``async_copy.mbarrier_arrive``, whose copies land as
  late as the barrier allows: when only such arrivals are left in its phase;
* ``mma_v2``: the product of its operands in fp32, term by term in order, as ``warpgroup_mma``;
* ``x.to(gl.bfloat16)`` from fp32: rounded to nearest even, as the GPU's ``cvt.rn.bf16.f32`` does (the
  interpreter's own conversion truncates, which biases every rounding of a recurrence the same way).

What it checks on top of the values, where a GPU would race or read garbage (:class:`GluonRaceError`): reading
shared memory a copy is still in flight to (a ``wait_group`` count too high, or a ring slot read before its
chunk's group); issuing a copy into memory a copy is in flight to, or that a product still in flight reads; a
store of registers to memory that a product in flight reads; a product reading memory that registers were stored
to with no ``fence_async_shared`` after the store (the tensor cores read through the async proxy); a program that
ends with copies in flight; an mbarrier wait that no partition can complete (a deadlock). It cannot see races
between the warps of one program (a missing barrier), nor timing: the GPU tests and
``tests/tools/test_compile_stats.py`` (ptxas) cover those.
"""

import contextlib
import inspect
import threading
import types

import numpy as np

from interpreter import add_products_in_order


class GluonRaceError(AssertionError):
    """A Gluon kernel's use of shared memory that would race or read unwritten data on the GPU."""


def _tl():
    import triton.language as tl

    return tl


def _np_dtype(dtype):
    from triton.runtime.interpreter import _get_np_dtype

    return _get_np_dtype(dtype)


def _value(x):
    """A constexpr's value, an interpreter tensor's data or a Python value, as a numpy array."""
    x = getattr(x, "value", x)
    return np.asarray(getattr(getattr(x, "handle", None), "data", x))


def _int(x):
    """:func:`_value`'s (first) element as an int: an index, a count."""
    return int(_value(x).reshape(-1)[0])


def _true(x):
    """Whether :func:`_value` holds everywhere: a predicate, a flag."""
    return bool(_value(x).all())


def _as_fp32(data, dtype):
    """A bf16 (uint16 bits), fp16 or fp32 operand's values as fp32 (exact)."""
    tl = _tl()
    if dtype == tl.bfloat16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _nearest_even_bf16(builder_cast):
    """The interpreter's cast with fp32 -> bf16 rounded to nearest even (NaN stays NaN), other casts its own."""
    def cast_impl(self, src, dst_type):
        from triton.runtime.interpreter import TensorHandle

        tl = _tl()
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return TensorHandle(rounded, dst_type.scalar)
        return builder_cast(self, src, dst_type)

    return cast_impl


def _poison(dtype, shape):
    """A new allocation's contents: NaN in the element type's bits."""
    tl = _tl()
    if dtype == tl.bfloat16:
        return np.full(shape, 0x7FC0, dtype=np.uint16)
    if not dtype.is_floating():  # mbarriers and other integer allocations
        return np.zeros(shape, dtype=_np_dtype(dtype))
    return np.full(shape, np.nan, dtype=_np_dtype(dtype))


class SharedMemory:
    """A view of one shared-memory allocation: its values and, element for element, what is in flight to or from
    it (copies not yet landed, products that still read it, register stores not yet fenced)."""

    def __init__(self, dtype, values, copying, reading, unfenced):
        self.dtype = dtype
        self.values, self.copying, self.reading, self.unfenced = values, copying, reading, unfenced

    @classmethod
    def allocate(cls, dtype, shape):
        shape = [int(x) for x in shape]
        return cls(dtype, _poison(dtype, shape), np.zeros(shape, bool), np.zeros(shape, np.int32),
                   np.zeros(shape, bool))

    @property
    def shape(self):
        return list(self.values.shape)

    def _view(self, select):
        return SharedMemory(self.dtype, *(select(a) for a in (self.values, self.copying, self.reading,
                                                              self.unfenced)))

    def index(self, i):
        i = _int(i)
        if not 0 <= i < self.values.shape[0]:
            raise GluonRaceError(f"shared memory index {i} outside [0, {self.values.shape[0]})")
        return self._view(lambda a: a[i])

    def slice(self, start, length, dim=0):
        start, length, dim = (_int(x) for x in (start, length, dim))
        index = [slice(None)] * self.values.ndim
        index[dim] = slice(start, start + length)
        return self._view(lambda a: a[tuple(index)])

    @property
    def address(self):
        """Where the view starts in memory (an mbarrier's identity)."""
        return self.values.__array_interface__["data"][0]

    def permute(self, order):
        order = tuple(_int(x) for x in order)
        return self._view(lambda a: a.transpose(order))

    def read(self, what):
        if self.copying.any():
            raise GluonRaceError(f"{what} reads shared memory that a cp.async group still in flight writes")
        return self.values.copy()

    def load(self, layout=None):
        from triton.runtime.interpreter import TensorHandle

        tl = _tl()
        data = self.read("a shared-memory load")
        return tl.tensor(TensorHandle(data, self.dtype), tl.block_type(self.dtype, self.shape))

    def store(self, value):
        if self.copying.any() or self.reading.any():
            raise GluonRaceError("a store of registers to shared memory that a copy or a product in flight uses")
        if value.dtype.scalar != self.dtype:
            raise GluonRaceError(f"a {value.dtype.scalar} store to {self.dtype} shared memory")
        self.values[...] = value.handle.data
        self.unfenced[...] = True


def _land(destination, data):
    """A copy lands: its values in place. Landed ``cp.async`` data counts as written through the generic proxy, so a
    product reading it needs a ``fence_async_shared`` after the landing, as registers stored do."""
    destination.values[...] = data
    destination.copying[...] = False
    destination.unfenced[...] = True


def _complete(products, outstanding):
    """All but the newest ``outstanding`` of a partition's products in flight completed: their operands free."""
    while len(products) > outstanding:
        for x in products.pop(0)[0]:
            x.reading -= 1


class _Barrier:
    """An mbarrier: arrivals a phase, arrivals left in this one, phases completed, and the ``cp.async`` copies whose
    arrivals it still waits for."""

    def __init__(self, count):
        self.count, self.left, self.completed, self.attached = count, count, 0, []


class _Emulation:
    """The state of the program running: commit groups of copies, products in flight, its warps."""

    def __init__(self):
        self.num_warps = 4
        self.allocations = []
        self.partitions = []  # every partition's state, this program's
        self.local = threading.local()
        self.barriers = {}  # an mbarrier's address -> its _Barrier
        self.turn = threading.Condition()  # held by the partition that runs
        self.live, self.aborted = 1, False  # partitions running; one failed
        self.epoch, self.waiting = 0, {}  # completed phases and ended partitions; thread -> epoch it waits since
        self.launches = 0  # programs run (a test can tell that the Gluon kernels ran at all)
        self.deadlock_s = 60  # a safety net only: deadlocks are found when every live partition waits

    @property
    def state(self):
        """The running partition's copies (open, committed) and products in flight."""
        if not hasattr(self.local, "state"):
            self.local.state = types.SimpleNamespace(open_group=[], groups=[], products=[])
            self.partitions.append(self.local.state)
        return self.local.state

    @property
    def open_group(self):
        return self.state.open_group

    @open_group.setter
    def open_group(self, value):
        self.state.open_group = value

    @property
    def groups(self):
        return self.state.groups

    @property
    def products(self):
        return self.state.products

    def copy(self, destination, pointer, mask):
        tl = _tl()
        if destination.copying.any() or destination.reading.any():
            raise GluonRaceError("a cp.async into shared memory that a copy or a product still in flight uses")
        loaded = tl.load(pointer) if mask is None else tl.load(pointer, mask=mask, other=0)
        if loaded.dtype.scalar != destination.dtype:
            raise GluonRaceError(f"a cp.async of {loaded.dtype.scalar} into {destination.dtype} shared memory")
        destination.copying[...] = True
        self.open_group.append((destination, np.broadcast_to(loaded.handle.data, destination.values.shape).copy()))

    def commit(self):
        self.groups.append(self.open_group)
        self.open_group = []

    def wait(self, outstanding):
        while len(self.groups) > _int(outstanding):
            for destination, data in self.groups.pop(0):
                _land(destination, data)

    def fence(self):
        for allocation in self.allocations:
            allocation.unfenced[...] = False

    def product(self, a, b, acc, use_acc, is_async):
        from triton.runtime.interpreter import TensorHandle

        tl = _tl()
        operands = []
        for name, x in (("a", a), ("b", b)):
            if isinstance(x, SharedMemory):
                if x.unfenced.any():
                    raise GluonRaceError(f"warpgroup_mma's {name} reads registers stored to shared memory with no "
                                         "fence_async_shared after the store")
                operands.append(_as_fp32(x.read(f"warpgroup_mma's {name}"), x.dtype))
                dtype = x.dtype
            else:
                operands.append(_as_fp32(x.handle.data, x.dtype.scalar))
                dtype = x.dtype.scalar
            if dtype != tl.bfloat16:
                raise GluonRaceError(f"warpgroup_mma's {name} is {dtype}; the kernels multiply bf16")
        total = acc.handle.data.copy() if _true(use_acc) else np.zeros(acc.handle.data.shape, np.float32)
        add_products_in_order(total, *operands)
        read = [x for x in (a, b) if isinstance(x, SharedMemory)]
        for x in read:
            x.reading += 1
        result = tl.tensor(TensorHandle(total, tl.float32), acc.type)
        self.products.append((read, id(result)))
        if not is_async:
            self.retire(0)
        return result

    def retire(self, outstanding, deps=()):
        """``warpgroup_mma_wait``: all but the newest ``outstanding`` products completed; every result in ``deps``
        must be among them (a result used before its product completes reads registers still being written)."""
        _complete(self.products, _int(outstanding))
        in_flight = {result for _, result in self.products}
        if any(id(dep) in in_flight for dep in deps):
            raise GluonRaceError("warpgroup_mma_wait returns a product still in flight (its count is too high)")

    def barrier(self, bar, what):
        found = self.barriers.get(bar.address)
        if found is None:
            raise GluonRaceError(f"{what} on an mbarrier never initialised")
        return found

    def barrier_init(self, bar, count):
        self.barriers[bar.address] = _Barrier(_int(count))

    def async_arrive(self, bar, increment_count):
        """``cp.async.mbarrier.arrive``: an arrival on ``bar`` made when this partition's copies so far land
        (with ``increment_count``, one more arrival expected for it first). The copies travel with the barrier and
        land as late as they may: when only such arrivals are left in the phase."""
        barrier = self.barrier(bar, "cp.async's arrive")
        self.commit()
        copies = [copy for group in self.groups for copy in group]
        self.groups.clear()
        barrier.attached.append(copies)
        barrier.left += 1 if increment_count else 0
        self.settle(barrier)

    def barrier_arrive(self, bar, count=1, pred=True):
        if not _true(pred):
            return
        barrier = self.barrier(bar, "an arrive")
        barrier.left -= _int(count)
        self.settle(barrier)

    def settle(self, barrier):
        """Complete the barrier's phase once its arrivals are in, the copies' arrivals last (their copies land)."""
        if barrier.left == len(barrier.attached) and barrier.attached:
            for copies in barrier.attached:
                for destination, data in copies:
                    _land(destination, data)
            barrier.left -= len(barrier.attached)
            barrier.attached.clear()
        if barrier.left < 0:
            raise GluonRaceError("more arrivals on an mbarrier than its phase expects")
        if barrier.left == 0:
            barrier.left, barrier.completed = barrier.count, barrier.completed + 1
            self.epoch += 1
            self.turn.notify_all()

    def barrier_wait(self, bar, parity, pred=True):
        """Until the phase of ``parity`` has completed, that is until the barrier's completed phases' parity
        differs from it; waiting hands the turn to the other partitions. If every live partition waits, none can
        complete a phase: a deadlock, reported."""
        if not _true(pred):
            return
        barrier = self.barrier(bar, "a wait")
        parity = _int(parity) & 1
        me = threading.get_ident()
        while barrier.completed % 2 == parity:
            if self.aborted:
                raise GluonRaceError("another partition failed")
            stuck = sum(1 for since in self.waiting.values() if since == self.epoch)  # no progress since they waited
            if stuck + 1 >= self.live:
                self.aborted = True
                self.turn.notify_all()
                raise GluonRaceError("deadlock: every partition waits on an mbarrier that none completes")
            self.waiting[me] = self.epoch
            self.turn.wait(timeout=self.deadlock_s)
            del self.waiting[me]

    def specialize(self, functions_and_args):
        """The partitions: the default one in the calling thread (it inherits what the program did before), the
        workers in threads of their own, one partition running at a time (:attr:`turn`) until it waits on an
        mbarrier or ends; the default partition's result."""
        results, errors = [None] * len(functions_and_args), []

        def run(i, fn, args):
            try:
                with self.turn:
                    results[i] = fn(*args)
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)
                self.aborted = True
            finally:
                with self.turn:
                    self.live -= 1
                    self.epoch += 1
                    self.turn.notify_all()

        self.live, self.aborted, self.waiting = len(functions_and_args), False, {}
        threads = [threading.Thread(target=run, args=(i, fn, args), daemon=True)
                   for i, (fn, args) in enumerate(functions_and_args) if i]
        for thread in threads:
            thread.start()
        run(0, *functions_and_args[0])
        for thread in threads:
            thread.join()
        self.live = 1
        if errors:
            raise errors[0]
        return results[0]

    def mma_v2(self, a, b, acc):
        """``acc + a·b`` (batched over leading dimensions), term by term in order, in fp32."""
        from triton.runtime.interpreter import TensorHandle

        tl = _tl()
        total = add_products_in_order(acc.handle.data.astype(np.float32),
                                      *(_as_fp32(x.handle.data, x.dtype.scalar) for x in (a, b)))
        return tl.tensor(TensorHandle(total, tl.float32), acc.type)

    def end_program(self):
        if any(p.open_group or p.groups for p in self.partitions) or any(b.attached for b in self.barriers.values()):
            raise GluonRaceError("the program ends with cp.async copies in flight (no final wait_group(0))")
        for partition in self.partitions:
            _complete(partition.products, 0)
        self.partitions.clear()
        self.local = threading.local()
        self.barriers.clear()
        self.allocations.clear()


def _gl_shim(emulation):
    """The ``gl`` a Gluon module sees: the Gluon operations it uses, on the interpreter."""
    tl = _tl()

    def layout(*args, **kwargs):
        return None

    def allocate_shared_memory(element_ty, shape, layout=None, value=None):
        memory = SharedMemory.allocate(element_ty, shape)
        emulation.allocations.append(memory)
        if value is not None:
            memory.store(value)
        return memory

    def static_assert(condition, message=""):
        if not _true(condition):
            raise AssertionError(f"gl.static_assert failed: {message}")

    return types.SimpleNamespace(
        BlockedLayout=layout, SliceLayout=layout, NVMMADistributedLayout=layout, DotOperandLayout=layout,
        SwizzledSharedLayout=layout, NVMMASharedLayout=types.SimpleNamespace(get_default_for=layout),
        arange=lambda start, end, layout=None: tl.arange(start, end),
        zeros=lambda shape, dtype, layout=None: tl.zeros(shape, dtype),
        full=lambda shape, value, dtype, layout=None: tl.full(shape, value, dtype),
        convert_layout=lambda value, layout=None, assert_trivial=False: value,
        allocate_shared_memory=allocate_shared_memory,
        static_range=lambda *args, **kwargs: tl.static_range(*args, **kwargs),
        static_assert=static_assert,
        num_warps=lambda: emulation.num_warps,
        program_id=lambda axis: tl.program_id(axis),
        load=lambda *args, **kwargs: tl.load(*args, **kwargs),
        store=lambda *args, **kwargs: tl.store(*args, **kwargs),
        where=lambda *args: tl.where(*args),
        sum=lambda *args, **kwargs: tl.sum(*args, **kwargs),
        warp_specialize=lambda functions_and_args, worker_num_warps, worker_num_regs: emulation.specialize(
            functions_and_args),
        minimum=lambda *args: tl.minimum(*args),
        maximum=lambda *args: tl.maximum(*args),
        constexpr=tl.constexpr, int32=tl.int32, int64=tl.int64, float16=tl.float16, float32=tl.float32,
        bfloat16=tl.bfloat16,
        barrier=lambda: None, thread_barrier=lambda: None,
    )


class _InterpretedGluon:
    """A ``@gluon.jit`` kernel launched as ``kernel[grid](*args, **constexprs_and_options)`` on the interpreter."""

    def __init__(self, function, emulation):
        from triton.runtime.interpreter import InterpretedFunction

        self.interpreted = InterpretedFunction(function.fn)
        self.emulation = emulation

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, *args, **kwargs)

    def __call__(self, *args, **kwargs):  # a device-side call from another Gluon function
        return self.interpreted(*args, **kwargs)

    def run(self, grid, *args, num_warps=4, **kwargs):
        from triton.runtime import interpreter

        fn = self.interpreted.rewrite()
        self.emulation.num_warps = num_warps
        self.emulation.launches += 1
        names = inspect.getfullargspec(fn).args
        constexprs = {name for name in names if "constexpr" in str(fn.__annotations__.get(name, ""))}
        kwargs = {name: value for name, value in kwargs.items() if name in names}
        scope = interpreter._patch_lang(fn)
        try:
            bound = inspect.getcallargs(fn, *args, **kwargs)
            bound = {name: value if name in constexprs else interpreter._implicit_cvt(value)
                     for name, value in bound.items()}
            grid = tuple(grid) + (1,) * (3 - len(grid))
            interpreter.interpreter_builder.set_grid_dim(*grid)
            for x in range(grid[0]):
                for y in range(grid[1]):
                    for z in range(grid[2]):
                        interpreter.interpreter_builder.set_grid_idx(x, y, z)
                        fn(**bound)
                        self.emulation.end_program()
        finally:
            scope.restore()


@contextlib.contextmanager
def interpreted_gluon(modules, monkeypatch):
    """Within the block, the Gluon kernels and functions of ``modules`` (a module or several, one emulation for
    all: a kernel may call another module's Gluon functions) run on the interpreter (module docstring):
    ``monkeypatch`` (pytest's) swaps the modules' Gluon names for emulated ones and puts them back after."""
    import triton.language as tl
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.runtime.interpreter import InterpreterBuilder

    emulation = _Emulation()
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", _nearest_even_bf16(InterpreterBuilder.cast_impl))
    monkeypatch.setattr(tl.block_type, "layout", None, raising=False)  # a value's layout: none here (ignored)
    replaced = dict(
        tl=tl, gl=_gl_shim(emulation),
        async_copy=types.SimpleNamespace(
            async_copy_global_to_shared=lambda smem, pointer, mask=None, **_: emulation.copy(smem, pointer, mask),
            commit_group=emulation.commit, wait_group=emulation.wait,
            mbarrier_arrive=lambda bar, increment_count=True: emulation.async_arrive(bar, increment_count)),
        fence_async_shared=emulation.fence,
        mbarrier=types.SimpleNamespace(
            init=emulation.barrier_init, invalidate=lambda bar: None, MBarrierLayout=lambda *a, **k: None,
            arrive=lambda bar, *, count=1, pred=True: emulation.barrier_arrive(bar, count, pred),
            wait=lambda bar, phase, pred=True, deps=(): emulation.barrier_wait(bar, phase, pred)),
        mma_v2=lambda a, b, acc, input_precision=None: emulation.mma_v2(a, b, acc),
        warpgroup_mma=lambda a, b, acc, *, use_acc=True, is_async=False, **_: emulation.product(
            a, b, acc, use_acc, is_async),
        warpgroup_mma_wait=lambda num_outstanding=0, deps=None: _retired(emulation, num_outstanding, deps),
        cta_barrier=lambda: None)
    interpreted = {}  # id(Gluon function) -> its one emulation, whichever module names it (a JITFunction's hash
    # analyses its source's references, which the swapped names break)
    for module in modules if isinstance(modules, (tuple, list)) else (modules,):
        for name, value in replaced.items():
            if name in ("tl", "gl") or hasattr(module, name):  # the interpreter patches the tl a function sees
                monkeypatch.setattr(module, name, value, raising=False)
        for name, value in list(vars(module).items()):
            if isinstance(value, GluonJITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = _InterpretedGluon(value, emulation)
                monkeypatch.setattr(module, name, interpreted[id(value)])
    yield emulation


def _retired(emulation, outstanding, deps):
    emulation.retire(outstanding, deps)
    return deps[0] if len(deps) == 1 else tuple(deps)
