"""What the three Triton backends (integer, SpQR, 2/4/16) share: whether Triton is importable
and running in its interpreter, which inputs their kernels take, how a launch configuration is
chosen on the GPU, what a compiled kernel needs of an SM and how many of its blocks fit there,
and the interpreter's bf16 rounding.

Triton is optional (``pip install 'lowbit[triton]'``): without it this module still imports and
the backends refuse every layer with a sentence instead of failing at import.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from lowbit.errors import LowbitError

try:
    import triton
except ImportError:  # the backends explain themselves in unsupported()
    triton = None

__all__ = [
    "LaunchRefused",
    "gemv_unless_refused",
    "tuned_config",
    "Resources",
    "SMLimits",
    "SM90",
    "blocks_per_sm",
    "launch_refusal",
    "resources_of",
    "device_limits",
    "resident_programs",
    "split_for",
    "fastest_config",
    "compile_ahead",
    "capturing",
    "cached_config",
    "time_call",
    "interpreting",
    "input_refusal",
    "round_bf16",
    "triton",
]

Config = TypeVar("Config")
T = TypeVar("T")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def input_refusal(x: Tensor, weight: Tensor) -> str | None:
    """Why a Triton kernel cannot multiply ``x`` by a weight stored in ``weight`` (a sentence
    completing "the triton backend cannot run this layer: ..."), or None when it can."""
    if triton is None:
        return "Triton is not installed (pip install 'lowbit[triton]')"
    if x.device.type != "cuda" and not interpreting():
        return (
            f"its kernels need a CUDA device (or TRITON_INTERPRET=1), and the input is "
            f"on {x.device.type}"
        )
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"its kernels take fp16 or bf16 inputs, not {x.dtype}"
    if weight.device != x.device:
        return f"the weight is on {weight.device} and the input on {x.device}"
    return None


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs per block (ptxas' resource line and Triton's metadata)."""

    registers: int  # per thread
    shared: int  # bytes per block, Triton's dynamic shared memory plus ptxas' static
    spill: int  # bytes of local memory per thread (spill stores and the stack frame)
    num_warps: int


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of one architecture (the CUDA occupancy calculator's table)."""

    registers: int = 65536
    register_unit: int = 256  # registers are allocated per warp in units of this many
    max_registers: int = 255  # per thread
    shared: int = 233472  # bytes per SM
    shared_per_block: int = 232448  # the largest opt-in allocation of one block
    shared_reserved: int = 1024  # the driver's bytes per resident block
    warps: int = 64
    blocks: int = 32
    sms: int = 132  # an H100 SXM
    # sm_90 on: the Tensor Memory Accelerator (bulk copies to shared memory), and warpgroup MMAs
    # that read their first operand from registers
    hopper: bool = True


#: sm_90 (H100): the target the compile tests and the default grids assume
SM90 = SMLimits()


def blocks_per_sm(res: Resources, limits: SMLimits = SM90) -> int:
    """Resident blocks per SM of a kernel with resources ``res`` (0: it cannot launch)."""
    per_warp = -(-res.registers * 32 // limits.register_unit) * limits.register_unit
    by_registers = (limits.registers // max(per_warp, 1)) // res.num_warps
    if res.shared > limits.shared_per_block:
        return 0
    by_shared = limits.shared // (res.shared + limits.shared_reserved)
    return min(by_registers, by_shared, limits.warps // res.num_warps, limits.blocks)


def launch_refusal(res: Resources, limits: SMLimits = SM90) -> str | None:
    """Why a kernel with resources ``res`` must not be launched (a sentence), or None: shared
    memory over the per-block limit, no block resident, or registers spilled to local memory."""
    if res.shared > limits.shared_per_block:
        return f"it needs {res.shared} bytes of shared memory per block, over {limits.shared_per_block}"
    if blocks_per_sm(res, limits) == 0:
        return f"{res.registers} registers x {32 * res.num_warps} threads do not fit one SM"
    if res.spill:
        return f"it spills {res.spill} bytes per thread to local memory"
    return None


def resources_of(compiled) -> Resources:
    """The resources of a kernel Triton compiled and loaded on a GPU (``kernel.warmup`` or a
    launch returns it)."""
    compiled._init_handles()
    return Resources(compiled.n_regs, compiled.metadata.shared, compiled.n_spills,
                     compiled.metadata.num_warps)  # fmt: skip


_LIMITS: dict[torch.device, SMLimits] = {}


def device_limits(device: torch.device) -> SMLimits:
    """The SM limits of a CUDA device from its properties (:data:`SM90` elsewhere)."""
    if device.type != "cuda":
        return SM90
    if device not in _LIMITS:
        props = torch.cuda.get_device_properties(device)
        _LIMITS[device] = SMLimits(
            registers=getattr(props, "regs_per_multiprocessor", SM90.registers),
            shared=getattr(props, "shared_memory_per_multiprocessor", SM90.shared),
            shared_per_block=getattr(props, "shared_memory_per_block_optin", SM90.shared_per_block),
            warps=getattr(props, "max_threads_per_multi_processor", 32 * SM90.warps) // 32,
            sms=props.multi_processor_count,
            hopper=props.major >= 9,
        )
    return _LIMITS[device]


def resident_programs(probe: Callable[[], object], device: torch.device) -> int | str:
    """Programs of one compiled kernel that run at once on ``device`` (blocks per SM x SMs),
    or the sentence saying why it cannot launch there; ``probe()`` compiles it
    (``kernel.warmup``)."""
    from triton.runtime.errors import OutOfResources

    limits = device_limits(device)
    try:
        res = resources_of(probe())
    except OutOfResources as err:
        return str(err)
    refusal = launch_refusal(res, limits)
    return refusal if refusal is not None else blocks_per_sm(res, limits) * limits.sms


def split_for(programs: int, units: int, resident: int) -> int:
    """SPLIT_K for a grid of ``programs`` x SPLIT_K over ``units`` of K: the most splits that
    keep the grid within one wave of ``resident`` programs (no tail wave), at least 1, at most
    ``units``."""
    return max(1, min(units, resident // max(programs, 1)))


#: every ``(configuration, ms)`` :func:`fastest_config` timed, in order (benchmarks print and
#: clear it; lowbit never reads it)
TIMINGS: list[tuple[tuple, float]] = []


class LaunchRefused(LowbitError):
    """No launch configuration of a kernel runs on this device for these operands."""


def gemv_unless_refused(prepared: dict, x: Tensor, gemv: Callable[[], Tensor]) -> Tensor | None:
    """``gemv()``, or None when its kernel cannot launch for a layer's operands: a backend then
    takes its decode-and-``F.linear`` path, correct at any M. The refusal is kept in the layer's
    ``prepared`` layout (per single-row or multi-row input, the kernels' two variants) and
    warned about once, so later calls go straight to that path."""
    key = ("gemv refused", x.shape[0] == 1)
    if key in prepared:
        return None
    try:
        return gemv()
    except LaunchRefused as err:
        prepared[key] = str(err)
        warnings.warn(
            f"a Triton GEMV kernel cannot launch for a layer here ({err}); that layer decodes its "
            f"weight and calls F.linear instead",
            stacklevel=3,
        )
        return None


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: whatever launches now lands in it,
    so tuning, profiling and references wait for a call outside the capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cached_config(cache: dict, key: Hashable, choose: Callable[[], Config]) -> Config:
    """``cache[key]``, set to ``choose()`` on the key's first call. A choice made inside a CUDA
    graph capture (the default configuration, untimed: nothing may be launched into the graph
    but the product) is used and not kept, so that the first call outside a capture tunes."""
    config = cache.get(key)
    if config is None:
        config = choose()
        if not capturing():
            cache[key] = config
    return config


def tuned_config(
    shapes: Sequence[tuple],
    config_of: Callable[[tuple], Config | str],
    launch: Callable[[Config], Tensor],
    expected: Callable[[], Tensor],
    tolerance: float,
    compile_only: Callable[[Config], object] | None = None,
) -> Config:
    """The launch configuration of one of ``shapes`` (block shapes, the default first):
    ``config_of(shape)`` gives its configuration or why it cannot launch; one shape is taken
    as it is, several are timed by :func:`fastest_config` against ``expected()``, their kernels
    compiled side by side first (:func:`compile_ahead`: ``config_of`` compiles a shape's
    kernel to read its resources, ``compile_only`` the chosen configurations'). Raises
    :class:`LaunchRefused` naming every refusal when no shape can launch."""
    several = len(shapes) > 1 and not capturing()
    first = config_of(shapes[0])  # in order first: Triton's per-kernel state is built once
    if several:
        compile_ahead(config_of, shapes[1:])
    configs, refused = [], []
    for i, shape in enumerate(shapes):
        config = first if i == 0 else config_of(shape)
        if isinstance(config, str):
            refused.append(f"{shape}: {config}")
        else:
            configs.append(config)
    if not configs:
        raise LaunchRefused(f"no launch configuration runs here ({'; '.join(refused)})")
    if not several:  # one shape, or capturing: no reference launched into the graph
        return configs[0]
    if compile_only is not None:
        compile_ahead(compile_only, configs)
    return fastest_config(launch, configs, expected(), tolerance)


def compile_ahead(compile_one: Callable[[T], object], items: Sequence[T]) -> None:
    """``compile_one(item)`` for every item at once, in threads (Triton compiles with the GIL
    released and runs ptxas as a process): a tuning that then compiles them in order finds them
    in Triton's cache, so a sweep costs about its slowest compile, not their sum. Purely a
    warm-up: an item that fails here is compiled (and fails, or not) again in order, where the
    error is dealt with; so every error here is dropped."""
    workers = min(len(items), os.cpu_count() or 1)
    if workers < 2 or interpreting():
        return
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def one(item: T) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)  # a new thread starts on device 0
            compile_one(item)
        except Exception:  # noqa: BLE001 - a warm-up: the ordered pass reports errors
            pass

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, items))


def fastest_config(
    launch: Callable[[Config], Tensor],
    configs: Sequence[Config],
    expected: Tensor | None = None,
    tolerance: float = 0.0,
) -> Config:
    """The configuration with the smallest :func:`time_call` time of ``launch(config)`` (the whole
    call's GPU work), among those that launch and, when ``expected`` is given, whose output is
    within ``tolerance * max|expected|`` of it (checked once, before timing).

    A configuration the GPU refuses for its resources (Triton's ``OutOfResources``) is skipped,
    one that computes something else is skipped with a warning; every other error (a sticky
    CUDA error above all) propagates. Raises :class:`LaunchRefused` when none is left. Called
    while a CUDA graph is being captured (a first call in someone's capture), it launches
    nothing that would land in the graph and answers the first configuration, the default.
    """
    from triton.runtime.errors import OutOfResources

    if capturing():
        return configs[0]
    best, best_ms, refused = None, float("inf"), []
    for config in configs:
        try:
            out = launch(config)
        except OutOfResources as err:
            refused.append(f"{config}: {err}")
            continue
        if expected is not None:
            err = (out.float() - expected.float()).abs().max()
            if not err <= tolerance * expected.float().abs().max():
                warnings.warn(f"launch configuration {config} is off the reference by {err:.3g}",
                              stacklevel=2)  # fmt: skip
                refused.append(f"{config}: off the reference by {err:.3g}")
                continue
        ms = time_call(lambda c=config: launch(c))
        TIMINGS.append((config, ms))
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise LaunchRefused(f"no launch configuration runs here ({'; '.join(refused)})")
    return best


#: bytes written, then read, between timed calls: more than any GPU's L2 (H100/H200: 50 MB)
L2_FLUSH_BYTES = 256 << 20


def time_call(fn: Callable[[], object], reps: int = 20, flush: str = "read") -> float:
    """Milliseconds of one call of ``fn`` on the GPU as a decode step meets it: ``fn`` captured
    in a CUDA graph (its Python launch cost left out, as under CUDA-graph decoding) and each
    replay timed by CUDA events after a 256 MB buffer is zeroed and, with ``flush="read"``,
    read back (the L2 then holds clean lines of other data, as after the layers before it;
    ``"write"`` leaves them dirty, to be written back during the call); the median of ``reps``.

    The graph keeps a launch cost of tens of microseconds from reordering kernels that take
    10-20; a call that cannot be captured is timed as a whole by ``triton.testing.do_bench``,
    with a warning naming why.
    """
    buffer = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    total = torch.empty((), dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compiled, and its allocations in the caching allocator
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:  # torch.AcceleratorError included
        warnings.warn(f"timed without a CUDA graph (the call cannot be captured: {err})",
                      stacklevel=2)  # fmt: skip
        torch.cuda.synchronize()
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=20)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]  # fmt: skip
    for start, end in events:
        buffer.zero_()  # nothing the call reads is left in the L2
        if flush == "read":  # the dirty lines written back now, clean ones in their place
            torch.sum(buffer, 0, dtype=torch.int64, out=total)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


if triton is not None:
    import triton.language as tl

    @triton.jit
    def round_bf16(v):
        """fp32 -> fp32 holding the nearest bf16, ties to even (the interpreter's casts to bf16
        truncate; on the GPU ``.to(tl.bfloat16)`` rounds correctly and this is not used)."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def keep_loads_above(out_ptr, K):
        """A store that never runs (``K >= 1`` whenever a kernel runs): the loads issued before
        it stay above it, since ptxas does not move a load across a store it cannot prove
        disjoint. Without it ptxas issues a load just before its first use, even with registers
        to spare: a prefetch lands in the next step, and loads whose uses are spread over a
        loop wait for memory one after another (``tools/kernel_sass.py`` prints where each
        loop loads its words and how many round trips it waits; Triton 3.6's and 3.9's ptxas
        alike). Coherent loads only: a ``.nc`` load may still move across it."""
        tl.store(out_ptr, 0.0, mask=K < 0)
