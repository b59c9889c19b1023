"""Invariant collectives: sums across ranks whose bits do not depend on the message size, the
batch composition or the algorithm, on torch.distributed (NCCL on GPUs, gloo on CPU).

NCCL picks its algorithm, protocol and channel count from the message size, so the same values
summed in a decode-sized and a prefill-sized message round differently (measured at 4 x H100:
14% of a bf16 all-reduce's elements change between an 8K- and a 256K-element message). Here every
element is summed by ``rank_sum`` (rl_engine_ext/ops/rank_sum.py) over one fixed binary tree of
the ranks' values in rank order, ((r0 + r1) + (r2 + r3)) ..., in fp32, rounded once to the
tensor's dtype; the collectives only move values (exact copies), so whichever algorithm moved them
the sum is the same:

    algorithm  moves                                                   where
    gather     all_gather of every rank's tensor, each rank sums all   any backend (all_reduce)
    scatter    all_to_all: each rank gets its 1/W slice from every      any backend
               rank and sums it; all_reduce then all_gathers the slices
    one_shot   symmetric memory: each rank stores its tensor into every  CUDA, one host (all_reduce)
               peer's memory over NVLink, then sums the W copies
    two_shot   symmetric memory: each rank stores slice r into rank r's  CUDA, one host
               memory, sums its own slice; all_reduce then stores the
               summed slice into every rank's memory

``algorithm="auto"`` (the default; ``RL_ENGINE_EXT_DIST_ALGORITHM`` forces one) picks by backend and
message size (thresholds measured on 2 and 4 H200s: benchmarks/bench_distributed.py,
benchmarks/results/distributed_h200x*.csv): symmetric memory up to TWO_SHOT_MAX_BYTES, NCCL above. The functions have
torch.distributed's signatures (plus keyword-only ``algorithm`` and ``validate``), so a caller can
swap the module: ``all_reduce(tensor, op, group, async_op)`` in place, ``reduce_scatter_tensor(output,
input, op, group, async_op)``, ``all_gather_into_tensor(output, input, group, async_op)``. op: SUM or
AVG (the fp32 sum divided by the group size before the one rounding); MAX and MIN are exact in any
order and go to torch.distributed as they are. async_op=True returns a completed Work: the
collective is already ordered on the current stream, as torch's synchronous collectives are.

Checks: bf16 / fp16 / fp32, contiguous tensors, matching sizes; a group of at most
RANK_SUM_MAX_PARTS (64) ranks (any size, not only powers of two: the tree carries an odd rank up).
Ranks passing different shapes or dtypes make torch's own collectives hang or fail late, so with
``validate`` (default: on for CPU tensors, where it costs a gloo round trip; off for CUDA tensors,
where it would cost a host synchronisation per call; ``RL_ENGINE_EXT_DIST_VALIDATE=1`` turns it on)
the ranks first exchange (numel, dtype, op) and every rank raises the same ValueError on a mismatch.

The symmetric-memory kernel (one launch: each rank stores its data into the others' memory over
NVLink, a per-block barrier on flags in that memory, a fold of local memory) spin-waits at its
barriers on a few SMs. Do not run it at the same time as another collective of the same GPUs on
another stream (FSDP2's reduce-scatter stream beside its all-gathers): a rank waiting there while
its peer waits for an NCCL kernel is a deadlock. FSDP2 therefore gets the 'scatter' algorithm
(InvariantReduceScatter); the CUDA kernel traps with a message after about 30 s rather than hang.
NVLink multicast is never used (no multimem instructions, no cuMulticast): peers are reached with
ordinary stores.
"""

from __future__ import annotations

import os
import socket
import warnings
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._native import has_native_kernel
from .ops.rank_sum import RANK_SUM_MAX_PARTS, RANK_SUM_PEER_FLAG_BYTES, rank_sum

ALGORITHMS = ("gather", "scatter", "one_shot", "two_shot")
ALGORITHM_ENV = "RL_ENGINE_EXT_DIST_ALGORITHM"
VALIDATE_ENV = "RL_ENGINE_EXT_DIST_VALIDATE"
SYMMETRIC_MEMORY_ENV = "RL_ENGINE_EXT_DIST_SYMMETRIC_MEMORY"  # "0": never use symmetric memory

# auto's thresholds, in bytes of the message (the tensor all_reduce sums, the input of
# reduce_scatter), from benchmarks/bench_distributed.py on 2 and 4 H200s.
GATHER_MAX_BYTES = 64 * 1024  # portable all_reduce: gather up to here, scatter above
ONE_SHOT_MAX_BYTES = 2 * 1024 * 1024  # symmetric memory: one_shot up to here, then two_shot
TWO_SHOT_MAX_BYTES = 8 * 1024 * 1024  # symmetric memory up to here, then scatter (NCCL moves more bytes/s)
# Symmetric-memory messages go through in pieces of at most this many bytes of slots: the workspace
# is 3 such regions per (group, stream).
PEER_PIECE_BYTES = 64 * 1024 * 1024

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _fail(fn: str, message: str) -> ValueError:
    return ValueError(f"rl_engine_ext.distributed.{fn}: {message}")


class _Done:
    """The Work of a collective already enqueued on the current stream (async_op=True)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _done(async_op: bool):
    return _Done() if async_op else None


def _group(group) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("rl_engine_ext.distributed: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    return group if group is not None else dist.group.WORLD


def _divisor(fn: str, op, world: int) -> float | None:
    if op == ReduceOp.SUM:
        return None
    if op == ReduceOp.AVG:
        return float(world)
    raise _fail(fn, f"op {op} is not supported: SUM or AVG (MAX and MIN go to torch.distributed as they are; "
                    "for FSDP2's PREMUL_SUM call set_force_sum_reduction_for_comms(True) on the module)")


def _check_tensor(fn: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rl_engine_ext.distributed.{fn}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise _fail(fn, f"unsupported dtype {t.dtype} for {name} (supported: torch.bfloat16, torch.float16, torch.float32)")
    if not t.is_contiguous():
        raise _fail(fn, f"{name} must be contiguous (as torch.distributed's collectives require)")


def _check_whole_and_part(fn: str, world: int, whole_name: str, whole: torch.Tensor, part_name: str,
                          part: torch.Tensor) -> None:
    """reduce_scatter's input and output, all_gather's output and input: W parts make the whole."""
    _check_tensor(fn, whole_name, whole)
    _check_tensor(fn, part_name, part)
    if whole.dtype != part.dtype:
        raise _fail(fn, f"{whole_name} dtype {whole.dtype} differs from {part_name} dtype {part.dtype}")
    if whole.device != part.device:
        raise RuntimeError(f"rl_engine_ext.distributed.{fn}: {whole_name} is on {whole.device} but {part_name} is on "
                           f"{part.device}")
    if whole.numel() != world * part.numel():
        raise _fail(fn, f"{whole_name} must hold world_size ({world}) x {part_name}'s {part.numel()} elements, got "
                        f"{whole.numel()}")


def _check_group_size(fn: str, world: int) -> None:
    if world > RANK_SUM_MAX_PARTS:
        raise _fail(fn, f"groups of at most {RANK_SUM_MAX_PARTS} ranks, got {world}")


def _validate(fn: str, group, t: torch.Tensor, numel: int, op_code: int, validate: bool | None) -> None:
    """Every rank raises the same error if the ranks' (numel, dtype, op) differ."""
    if validate is None:
        validate = t.device.type == "cpu" or os.environ.get(VALIDATE_ENV, "") not in ("", "0")
    if not validate:
        return
    world = dist.get_world_size(group)
    mine = torch.tensor([numel, _DTYPE_CODES[t.dtype], op_code], dtype=torch.int64, device=t.device)
    every = torch.empty(world * 3, dtype=torch.int64, device=t.device)
    _all_gather(every, mine, group=group)
    rows = every.view(world, 3).tolist()
    if any(row != rows[0] for row in rows):
        names = {code: dtype for dtype, code in _DTYPE_CODES.items()}
        seen = ", ".join(f"rank {r}: {row[0]} elements of {names.get(row[1], row[1])}, op {row[2]}" for r, row in enumerate(rows))
        raise _fail(fn, f"the ranks disagree on the message ({seen})")


def _op_code(op) -> int:
    return 0 if op == ReduceOp.SUM else 1


def _algorithm(fn: str, requested: str | None, allowed: tuple[str, ...]) -> str | None:
    """The algorithm asked for (argument, else environment), or None for auto."""
    name = requested if requested is not None else os.environ.get(ALGORITHM_ENV, "")
    if name in ("", "auto"):
        return None
    if name not in allowed:
        raise _fail(fn, f"algorithm must be one of auto, {', '.join(allowed)}; got {name!r}")
    return name


# ---------------------------------------------------------------------------------------------
# Symmetric memory (CUDA, one host): a workspace per (group, device)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Workspace:
    """A symmetric buffer of every rank of a group (torch symmetric memory), mapped into each GPU:
    two slot regions used in turn, a gather region and the flags of the kernel's barrier
    (csrc/common/rank_sum.h, PeerSumOperands), each region ``region_bytes``. Call k's data goes to
    slot region k % 2: a rank still folding call k-1's slots folds the other region, and every rank
    has finished call k-2 before it arrives at call k-1's first barrier, so the regions are never
    written while read. two_shot writes the gather region only after its first barrier, when every
    rank has finished the previous call."""

    region_bytes: int
    rank: int
    slots: tuple[list[int], list[int]]  # every rank's slot region k, k = 0, 1
    gather: list[int]
    flags: list[int]
    handle: object  # keeps the buffer mapped
    buffer: torch.Tensor
    calls: int = 0
    epoch: int = 0

    def next_call(self, barriers: int) -> tuple[list[int], int]:
        """This call's slot regions and its first barrier's epoch (``barriers`` epochs reserved)."""
        self.calls += 1
        epoch = self.epoch + 1
        self.epoch += barriers
        return self.slots[self.calls % 2], epoch


_WORKSPACES: dict[tuple, _Workspace] = {}
_SYMMETRIC_OK: dict[dist.ProcessGroup, bool] = {}
_PEER_REDUCE = None  # torch.ops.rl_align.peer_reduce.default, bound on first use
_ONE_SHOT, _REDUCE_SCATTER, _TWO_SHOT = 0, 1, 2  # peer_reduce's modes (common/rank_sum.h, PeerMode)


def _symmetric_memory_usable(group: dist.ProcessGroup, t: torch.Tensor) -> bool:
    """CUDA tensors of a group whose ranks share one host, with torch's symmetric memory and this
    build's CUDA kernels. The same answer on every rank (decided from gathered host names), so no
    rank takes a path the others do not; computed once per group (its first CUDA call is collective)."""
    if t.device.type != "cuda" or os.environ.get(SYMMETRIC_MEMORY_ENV, "") == "0":
        return False
    ok = _SYMMETRIC_OK.get(group)
    if ok is None:
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        ok = len(set(hosts)) == 1 and "nccl" in str(dist.get_backend(group)) and has_native_kernel("rank_sum", "cuda")
        if ok:
            try:
                import torch.distributed._symmetric_memory  # noqa: F401
            except ImportError:
                ok = False
        _SYMMETRIC_OK[group] = ok
    return ok


def _symmetric_path(fn: str, group: dist.ProcessGroup, t: torch.Tensor, requested: str | None) -> bool:
    """Whether the symmetric-memory algorithms may run for this call. Not under CUDA graph capture:
    a replayed graph would repeat one call's epoch and slot region, so its barrier would not wait
    and a rank could read another's half-written data. auto then takes the torch.distributed
    algorithms (NCCL's collectives and rank_sum are capturable); asking for one_shot / two_shot
    raises."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        if requested in ("one_shot", "two_shot"):
            raise _fail(fn, f"algorithm {requested!r} cannot be captured in a CUDA graph (its barrier's epoch is set "
                            "per call on the host); 'gather' and 'scatter' can")
        return False
    return _symmetric_memory_usable(group, t)


def _workspace(group: dist.ProcessGroup, device: torch.device, nbytes: int) -> _Workspace:
    """The group's workspace on the current stream with regions of at least ``nbytes`` (collective
    when it is made or grows: every rank does so in the same call, since every rank passes the same
    message). One workspace per stream: collectives on two streams (FSDP2's reduce-scatter stream and
    the compute stream) may run at once, and must not share buffers or flags."""
    key = (group, device.index, torch._C._cuda_getCurrentStream(device.index)[0])
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.region_bytes >= nbytes:
        return ws
    import torch.distributed._symmetric_memory as symm_mem

    region = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
    if ws is not None:
        region = max(region, ws.region_bytes * 2)
    name = group.group_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "is_symm_mem_enabled_for_group") and not symm_mem.is_symm_mem_enabled_for_group(name):
            symm_mem.enable_symm_mem_for_group(name)
    buffer = symm_mem.empty(3 * region + RANK_SUM_PEER_FLAG_BYTES, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, name)
    buffer[3 * region:].zero_()
    handle.barrier()  # every rank's flags are zero before any rank's kernel signals
    ptrs = list(handle.buffer_ptrs)
    ws = _Workspace(region, dist.get_rank(group), (ptrs, [p + region for p in ptrs]), [p + 2 * region for p in ptrs],
                    [p + 3 * region for p in ptrs], handle, buffer)
    _WORKSPACES[key] = ws
    return ws


def _peer_reduce(group, world: int, mode: int, flat_in: torch.Tensor, out: torch.Tensor, segment: int,
                 divisor: float | None, input_stride: int | None = None) -> None:
    """One peer_reduce kernel (csrc/common/rank_sum.h): one_shot, reduce_scatter or two_shot."""
    global _PEER_REDUCE
    if _PEER_REDUCE is None:
        _PEER_REDUCE = torch.ops.rl_align.peer_reduce.default
    elem = flat_in.element_size()
    slot_bytes = world * (flat_in.numel() if mode == _ONE_SHOT else segment) * elem
    ws = _workspace(group, flat_in.device, slot_bytes)
    slots, epoch = ws.next_call(2 if mode == _TWO_SHOT else 1)
    _PEER_REDUCE(flat_in, out, mode, slots, ws.gather, ws.flags, ws.rank, segment,
                 segment if input_stride is None else input_stride, epoch, divisor)


def _two_shot_all_reduce(group, world: int, flat: torch.Tensor, divisor: float | None) -> None:
    """two_shot in pieces of at most PEER_PIECE_BYTES (whole slices each): an element's sum does
    not depend on the piece it travels in."""
    piece = max(world * 8, PEER_PIECE_BYTES // flat.element_size() // (world * 8) * (world * 8))
    for lo in range(0, flat.numel(), piece):
        part = flat[lo:lo + piece]
        _peer_reduce(group, world, _TWO_SHOT, part, part, _slice(part.numel(), world), divisor)


def _two_shot_reduce_scatter(group, world: int, flat_in: torch.Tensor, out: torch.Tensor,
                             divisor: float | None) -> None:
    """reduce_scatter over symmetric memory in pieces of at most PEER_PIECE_BYTES of input: piece k
    is elements [k p, (k + 1) p) of every rank's slice."""
    m = out.numel()
    piece = max(8, PEER_PIECE_BYTES // flat_in.element_size() // world // 8 * 8)
    for lo in range(0, m, piece):
        hi = min(lo + piece, m)
        _peer_reduce(group, world, _REDUCE_SCATTER, flat_in[lo:], out[lo:hi], hi - lo, divisor, input_stride=m)


def _slice(numel: int, world: int) -> int:
    """Elements of each rank's slice: numel split in W slices of 16-byte multiples (the last
    shorter or empty)."""
    return -(-numel // (world * 8)) * 8


# ---------------------------------------------------------------------------------------------
# torch.distributed paths (any backend)
# ---------------------------------------------------------------------------------------------


def _gather_all_reduce(group, world: int, flat: torch.Tensor, divisor: float | None) -> None:
    every = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather(every, flat, group=group)
    flat.copy_(rank_sum(list(every.view(world, -1).unbind(0)), divisor))


def _scatter_sum(group, world: int, flat_in: torch.Tensor, chunk: int, divisor: float | None) -> torch.Tensor:
    """all_to_all of W slices of ``chunk`` elements (flat_in padded to W * chunk), then this
    rank's slice summed over the ranks."""
    if flat_in.numel() != world * chunk:
        flat_in = torch.cat([flat_in, flat_in.new_zeros(world * chunk - flat_in.numel())])
    received = torch.empty_like(flat_in)
    dist.all_to_all_single(received, flat_in, group=group)
    return rank_sum(list(received.view(world, chunk).unbind(0)), divisor)


def _scatter_all_reduce(group, world: int, flat: torch.Tensor, divisor: float | None) -> None:
    """all_to_all, this rank's slice summed, all_gather of the sums (straight into the tensor when
    it is W whole slices)."""
    chunk = _slice(flat.numel(), world)
    mine = _scatter_sum(group, world, flat, chunk, divisor)
    if flat.numel() == world * chunk:
        _all_gather(flat, mine, group=group)
        return
    gathered = torch.empty(world * chunk, dtype=flat.dtype, device=flat.device)
    _all_gather(gathered, mine, group=group)
    flat.copy_(gathered[: flat.numel()])


# ---------------------------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------------------------


@torch.no_grad()  # like torch.distributed: the data of a tensor that requires grad, no graph
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *,
               algorithm: str | None = None, validate: bool | None = None):
    """In-place sum (or average) of ``tensor`` over the group's ranks, every element summed over
    the fixed rank tree (module docstring): the same bits for any message size and algorithm."""
    fn = "all_reduce"
    group = _group(group)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    world = dist.get_world_size(group)
    _check_tensor(fn, "tensor", tensor)
    _check_group_size(fn, world)
    divisor = _divisor(fn, op, world)
    name = _algorithm(fn, algorithm, ALGORITHMS)
    _validate(fn, group, tensor, tensor.numel(), _op_code(op), validate)
    if world == 1 or tensor.numel() == 0:
        if divisor is not None and tensor.numel():
            tensor.copy_(rank_sum([tensor], divisor))
        return _done(async_op)
    nbytes = tensor.numel() * tensor.element_size()
    symmetric = _symmetric_path(fn, group, tensor, name)
    if name is None:
        if symmetric and nbytes <= TWO_SHOT_MAX_BYTES:
            name = "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"
        else:
            name = "gather" if nbytes <= GATHER_MAX_BYTES else "scatter"
    elif name in ("one_shot", "two_shot") and not symmetric:
        raise _fail(fn, f"algorithm {name!r} needs CUDA tensors, an NCCL group on one host and torch's symmetric "
                        "memory; use 'gather' or 'scatter'")
    flat = tensor.view(-1)
    if name == "gather":
        _gather_all_reduce(group, world, flat, divisor)
    elif name == "scatter":
        _scatter_all_reduce(group, world, flat, divisor)
    elif name == "one_shot":
        # slots for W copies of the message: pieces of PEER_PIECE_BYTES / W (auto: one piece)
        piece = max(8, PEER_PIECE_BYTES // world // flat.element_size() // 8 * 8)
        for lo in range(0, flat.numel(), piece):
            part = flat[lo:lo + piece]
            _peer_reduce(group, world, _ONE_SHOT, part, part, part.numel(), divisor)
    else:
        _two_shot_all_reduce(group, world, flat, divisor)
    return _done(async_op)


@torch.no_grad()  # like torch.distributed: the data of a tensor that requires grad, no graph
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, *, algorithm: str | None = None, validate: bool | None = None):
    """``output`` = this rank's slice (slice r = elements r * n .. (r + 1) * n - 1 of ``input``,
    n = output.numel()) of the sum (or average) of the ranks' inputs, every element summed over
    the fixed rank tree. algorithm: 'scatter' (all_to_all, any backend) or 'two_shot' (its first
    shot over symmetric memory)."""
    fn = "reduce_scatter_tensor"
    group = _group(group)
    world = dist.get_world_size(group)
    _check_whole_and_part(fn, world, "input", input, "output", output)
    _check_group_size(fn, world)
    divisor = _divisor(fn, op, world)
    name = _algorithm(fn, algorithm, ("scatter", "two_shot"))
    _validate(fn, group, input, input.numel(), _op_code(op), validate)
    if output.numel() == 0:
        return _done(async_op)
    if world == 1:
        output.view(-1).copy_(rank_sum([input.view(-1)], divisor))
        return _done(async_op)
    symmetric = _symmetric_path(fn, group, input, name)
    if name is None:
        name = "two_shot" if symmetric and input.numel() * input.element_size() <= TWO_SHOT_MAX_BYTES else "scatter"
    elif name == "two_shot" and not symmetric:
        raise _fail(fn, "algorithm 'two_shot' needs CUDA tensors, an NCCL group on one host and torch's symmetric "
                        "memory; use 'scatter'")
    if name == "two_shot":
        _two_shot_reduce_scatter(group, world, input.view(-1), output.view(-1), divisor)
    else:
        output.view(-1).copy_(_scatter_sum(group, world, input.view(-1), output.numel(), divisor))
    return _done(async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False, *, validate: bool | None = None):
    """torch.distributed.all_gather_into_tensor (a copy: invariant as it is), with this module's
    checks, so a caller can take all three collectives from here."""
    fn = "all_gather_into_tensor"
    group = _group(group)
    world = dist.get_world_size(group)
    _check_whole_and_part(fn, world, "output_tensor", output_tensor, "input_tensor", input_tensor)
    _validate(fn, group, input_tensor, input_tensor.numel(), 0, validate)
    return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


@functools.cache
def _invariant_reduce_scatter_class() -> type:
    """InvariantReduceScatter, made on first use: its base class, FSDP2's ReduceScatter, lives in
    torch.distributed.fsdp, whose import (about 3 s of CPU) would otherwise be most of
    `import rl_engine_ext`'s time in every process, sharded or not."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # a torch without FSDP2's custom-collective hooks
        ReduceScatter = object

    class InvariantReduceScatter(ReduceScatter):
        """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) through
        ``reduce_scatter_tensor``: the gradients' sum over the data-parallel ranks in the fixed rank
        tree. FSDP2 passes op AVG (fp32 / bf16 reduce dtypes) or SUM (with its own division after);
        a gradient divide factor other than the group size (PREMUL_SUM) is refused by the op check.
        The algorithm is 'scatter' (NCCL's all_to_all): FSDP2 runs its reduce-scatters on their own
        stream beside its all-gathers, and the symmetric-memory kernels must not (module docstring)."""

        def __init__(self, algorithm: str = "scatter"):
            self.algorithm = algorithm

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            return reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op,
                                         algorithm=self.algorithm)

    InvariantReduceScatter.__qualname__ = "InvariantReduceScatter"  # pickled by name, found through __getattr__
    InvariantReduceScatter.__module__ = __name__
    return InvariantReduceScatter


def __getattr__(name: str):
    if name == "InvariantReduceScatter":
        return _invariant_reduce_scatter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_invariant_reduce_scatter(model: torch.nn.Module, algorithm: str = "scatter") -> int:
    """Sets ``InvariantReduceScatter`` as the gradient reduce-scatter of every FSDP2 module in
    ``model`` (``torch.distributed.fsdp.fully_shard``; call after sharding). Returns how many
    modules were set; raises if there is none (an unsharded model would silently keep NCCL's)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as e:
        raise RuntimeError("rl_engine_ext.distributed.use_invariant_reduce_scatter needs torch's FSDP2 "
                           "(torch.distributed.fsdp.FSDPModule)") from e
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("rl_engine_ext.distributed.use_invariant_reduce_scatter: no FSDP2 module in the model "
                         "(call torch.distributed.fsdp.fully_shard on it first)")
    if not hasattr(modules[0], "set_custom_reduce_scatter"):
        raise RuntimeError(f"rl_engine_ext.distributed.use_invariant_reduce_scatter: torch {torch.__version__}'s "
                           "FSDP2 has no set_custom_reduce_scatter")
    comm = _invariant_reduce_scatter_class()(algorithm)
    for m in modules:
        m.set_custom_reduce_scatter(comm)
    return len(modules)


# torch 2.13's names for the same collectives, so the module swaps for torch.distributed under either.
reduce_scatter_single = reduce_scatter_tensor
all_gather_single = all_gather_into_tensor
