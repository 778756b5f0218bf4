"""Run the benchmark: plan the cases, measure every implementation, return the JSON document.

One case is an op on one shape at one thread count; it yields one record per pass
(``fwd``, ``fwd+bwd``). Implementations, all in the same process on the same tensors:

* ``torch``: torch eager, the reference every ratio divides by (for what torch lacks,
  the natural composition, see :mod:`normkit.bench.ops`);
* ``normkit``: the normkit module, on the ``auto`` backend unless ``--backend`` names
  another (``triton``: normkit's Triton kernels where ``auto`` runs torch's on CUDA);
* ``torch.compile``, ``normkit.compile``: the torch module and the normkit module under
  ``torch.compile(dynamic=False)`` (opt-in); the first call of each pass (compile + one
  run) is reported as ``compile_s`` and kept out of the timings; compile caches are
  reset per case;
* ``liger``, ``apex``: when importable, with CUDA, for the ops they cover.

An implementation that fails to build or run gets an ``error`` and the others go on.

JSON document (``schema`` = :data:`SCHEMA`)::

    {"schema": "normkit-bench/1",
     "command": "normkit bench --shapes small",          # the exact command line
     "environment": {"date", "normkit", "normkit_commit", "torch", "python", "platform",
                     "cpu_model",
                     "cpu_count", "device", "device_name", "dtype", "param_dtype",
                     "threads": [1],
                     "input", "input_doc", "copy_bandwidth_gbs": {"1": 9.8},
                     "copy_buffer_bytes", "memory_method", "load_average": {"start", "end"},
                     "allocator": {"transparent_hugepage", "normkit_huge_pages",
                                   "page_reporting_order", "variables"}},
     "settings": {"ops", "shapes", "shape_list", "repeats", "warmup", "min_time_s",
                  "compile", "seed", "flush_mib", "cuda_graphs", "backend"},
     "implementations": {"torch": {"used": true, "reason": null}, "liger": {...}, ...},
     "ops": [{"op", "kind", "normkit", "baseline", "available", "reason"}],
     "results": [{"op", "shape": [M, D], "layout", "pass", "threads", "ideal_bytes",
                  "baseline", "normkit",
                  "impls": {"torch": {"ms", "samples_ms", "number", "ratio", "ratio_iqr",
                                      "gbs", "pct_copy", "compile_s", "memory", "error"},
                            ...}}]}

``ms`` is the median time per call, ``samples_ms`` the per-round times, ``number`` the
calls per measurement, ``ratio`` the median per-round ``torch ms / this ms`` (> 1:
faster than torch eager) and ``ratio_iqr`` its first and third quartiles, ``gbs`` the
ideal bytes over the median time, ``pct_copy`` that as a percentage of the copy
bandwidth, ``memory`` (``fwd+bwd`` only) holds ``peak_bytes``, ``saved_bytes`` and
``output_bytes`` (see :mod:`normkit.bench.measure`). ``normkit_commit`` is the git commit
of the normkit source that ran (:func:`source_commit`; ``None`` outside a git checkout):
``normkit bench --compare`` shows it for each side (:mod:`normkit.bench.compare`).
"""

from __future__ import annotations

import copy
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import measure
from .ops import EXTERNALS, OPS, PASSES, Op, Shape, get_op, parse_shapes

__all__ = ["SCHEMA", "DTYPES", "INPUTS", "DEFAULT_FLUSH_MIB", "BENCH_BACKENDS", "BenchConfig",
           "run", "plan", "errors", "make_input", "environment", "with_backend"]

#: The version tag of the JSON document.
SCHEMA = "normkit-bench/1"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Input kinds: name -> what it is and which normkit path it exercises.
INPUTS = {
    "randn": "standard normal: well-conditioned, so on the CPU normkit's auto backend keeps "
             "torch's fused kernels wherever they are accurate (the fast path)",
    "offset": "standard normal + 100: |mean|/std = 100, past normkit's accuracy thresholds, "
              "so on the CPU normkit recomputes with its compensated path (torch just loses "
              "precision)",
}

_OFFSET = 100.0

#: Implementation names in column order.
IMPLEMENTATIONS = ("torch", "normkit", "torch.compile", "normkit.compile",
                   *(ext.name for ext in EXTERNALS))
#: ``BenchConfig.backend`` values: the normkit backends worth timing.
BENCH_BACKENDS = ("auto", "eager", "triton")


def with_backend(module: nn.Module, backend: str) -> nn.Module:
    """``module`` with ``backend`` set on every submodule that has one (normkit's layers
    read ``self.backend`` at each call); ``"auto"`` leaves it as built. ValueError where
    no submodule has a backend to set.

    Example:
        >>> import normkit
        >>> with_backend(normkit.GroupNorm(2, 4), "triton").backend
        'triton'
    """
    if backend == "auto":
        return module
    layers = [m for m in module.modules() if isinstance(getattr(m, "backend", None), str)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no backend to set to {backend!r}")
    for layer in layers:
        layer.backend = backend
    return module


#: The implementations that run under torch.compile.
COMPILED = ("torch.compile", "normkit.compile")

Progress = Callable[[int, int, str], None]


#: MiB written before every timed call by default (``BenchConfig.flush_mib``): on CUDA more
#: than four times an H200's or H100's L2 (60 / 50 MB); on the CPU none, as the CPU tables
#: in benchmarks/RESULTS.md were measured (a flush there costs ~25 ms per call, and a
#: server's shared L3 is not this process's alone to keep warm or cold).
DEFAULT_FLUSH_MIB = {"cuda": 256, "cpu": 0}


@dataclass(frozen=True)
class BenchConfig:
    """What to run. Every field has the command line's default.

    Args:
        ops: op names; empty means every op available here.
        device: ``"cpu"`` or ``"cuda"``.
        threads: CPU thread counts (``torch.set_num_threads``); each runs the whole set.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (inputs and modules).
        param_dtype: the modules' dtype when it is not ``dtype``: ``"float32"`` with
            16-bit inputs times mixed precision as ``torch.autocast`` runs it (16-bit
            activations, float32 parameters and buffers); ``None``: ``dtype``.
        shapes: a set name (``standard``, ``small``) or a spec such as ``4096x1024,8x64x28x28:cl``.
        input: ``"randn"`` or ``"offset"`` (see :data:`INPUTS`).
        repeats: timed rounds per pass.
        warmup: untimed calls per implementation before the rounds.
        min_time: seconds one measurement lasts at least (calls are repeated to reach it).
        compile: also time ``torch.compile`` of the torch module and of normkit's.
        copy_mib: MiB of the buffer the copy bandwidth is measured on.
        seed: seed of the inputs.
        flush_mib: MiB written before every timed call, untimed, so that inputs come
            from memory and not from the cache (:class:`normkit.bench.measure.Timer`);
            ``None``: 256 on CUDA (an H200's L2 holds 60 MB), 0 on the CPU.
        cuda_graphs: CUDA only: time each implementation's call captured in a CUDA graph
            and replayed (:func:`normkit.bench.measure.graphed`): the kernels' time
            without the host's, for every implementation alike. An eager call costs the
            host 20-100+ us (Python, dispatch, launches), more than a small
            normalization's kernels take, so eager timings of small shapes measure the
            host; graph replays measure what the GPU does.
        backend: the ``backend`` of normkit's modules: ``"auto"`` (as users get them),
            ``"eager"`` (the compensated statistics everywhere) or ``"triton"``
            (normkit's Triton kernels on CUDA, also where ``"auto"`` runs torch's, e.g.
            BatchNorm and GroupNorm); an op whose module has no backend records a build
            error for normkit.

    Example:
        >>> config = BenchConfig(ops=("layer_norm",), threads=(1, 2), shapes="small")
        >>> config.device, config.repeats, config.flush_mib == DEFAULT_FLUSH_MIB["cpu"]
        ('cpu', 15, True)
    """

    ops: tuple[str, ...] = ()
    device: str = "cpu"
    threads: tuple[int, ...] = (1,)
    dtype: str = "float32"
    param_dtype: str | None = None
    shapes: str = "standard"
    input: str = "randn"
    repeats: int = 15
    warmup: int = 3
    min_time: float = 2e-3
    compile: bool = False
    copy_mib: int = 256
    seed: int = 0
    flush_mib: int | None = None
    cuda_graphs: bool = False
    backend: str = "auto"
    shape_list: tuple[Shape, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in self.ops:
            get_op(name)  # KeyError naming the valid ops
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested, but torch.cuda.is_available() is False "
                             f"(torch {torch.__version__})")
        if not self.threads or any(t < 1 for t in self.threads):
            raise ValueError(f"threads must be positive integers, got {self.threads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.param_dtype is not None and self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype must be one of {', '.join(DTYPES)} or None, got "
                             f"{self.param_dtype!r}")
        if self.input not in INPUTS:
            raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {self.input!r}")
        if self.repeats < 1 or self.warmup < 0 or self.min_time < 0 or self.copy_mib < 1:
            raise ValueError(f"expected repeats >= 1, warmup >= 0, min_time >= 0 and "
                             f"copy_mib >= 1, got {self.repeats}, {self.warmup}, "
                             f"{self.min_time}, {self.copy_mib}")
        if self.backend not in BENCH_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BENCH_BACKENDS)}, got "
                             f"{self.backend!r}")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError(f"cuda_graphs times CUDA graph replays and needs device "
                             f"'cuda', got device {self.device!r}")
        if self.flush_mib is None:
            object.__setattr__(self, "flush_mib", DEFAULT_FLUSH_MIB[self.device])
        elif self.flush_mib < 0:
            raise ValueError(f"flush_mib must be >= 0, got {self.flush_mib}")
        object.__setattr__(self, "shape_list", parse_shapes(self.shapes))


def plan(config: BenchConfig) -> tuple[list[tuple[Op, Shape]], list[dict]]:
    """The ``(op, shape)`` cases to run and the ops skipped, each with its reason.

    Example:
        >>> cases, skipped = plan(BenchConfig(ops=("layer_norm", "batch_norm"),
        ...                                   shapes="7x33,2x3x4x5"))
        >>> [(op.name, shape.label) for op, shape in cases], skipped
        ([('layer_norm', '7x33'), ('batch_norm', '2x3x4x5')], [])
    """
    ops = [get_op(name) for name in config.ops] if config.ops else list(OPS)
    cases, skipped = [], []
    for op in ops:
        reason = op.available()
        if reason is not None:
            skipped.append({"op": op.name, "reason": reason})
            continue
        shapes = [shape for shape in config.shape_list if shape.kind == op.kind]
        if not shapes:
            skipped.append({"op": op.name, "reason": f"no {op.kind} shape in the shape set "
                            f"({'4-dim N x C x H x W' if op.kind == 'image' else 'M x D'})"})
        cases.extend((op, shape) for shape in shapes)
    return cases, skipped


def make_input(shape: Shape, dtype: torch.dtype, device: str | torch.device,
               kind: str = "randn") -> torch.Tensor:
    """A benchmark input of ``shape`` (laid out channels_last when it says so).

    Example:
        >>> x = make_input(Shape((2, 3, 4, 5), channels_last=True), torch.float32, "cpu")
        >>> x.is_contiguous(memory_format=torch.channels_last)
        True
    """
    # (drawn by the CPU's generator on any device: a CUDA graph capture that fails leaves
    # the CUDA generator in capture mode, and every later draw there raises "Offset
    # increment outside graph capture" -- one implementation's failure must not end the
    # run, seen on an H200 with torch 2.11)
    x = torch.randn(shape.dims).to(device)
    if kind == "offset":
        x += _OFFSET
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if shape.channels_last else x


def _fresh(name: str, module: nn.Module, inputs: Sequence[torch.Tensor]
           ) -> tuple[nn.Module, list[torch.Tensor]]:
    """A copy of ``module`` and of the input leaves for a CUDA graph's capture: leaves no
    forward has used yet, so that their first use is in the capture's warm-up on its side
    stream (torch's recipe for whole-network capture). A leaf used on the default stream
    before keeps its gradient accumulator's stream there, and with a backward in the
    graph the capture broke on it (``measure.graphed``; seen on an H200 with torch 2.11:
    "The AccumulateGrad node's stream does not match..."). Compiled modules are not
    copied (their caches are per object).

    Example:
        >>> lin, x = torch.nn.Linear(2, 2), torch.ones(3, 2, requires_grad=True)
        >>> copy, (x2,) = _fresh("torch", lin, [x])
        >>> copy.weight is lin.weight, torch.equal(copy.weight, lin.weight), x2 is x
        (False, True, False)
    """
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    if name in COMPILED:
        return module, leaves
    return copy.deepcopy(module), leaves


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _blank(error: str | None = None) -> dict:
    """An implementation's entry before (or instead of) its measurement."""
    return {"ms": None, "samples_ms": [], "number": None, "ratio": None, "ratio_iqr": None,
            "gbs": None, "pct_copy": None, "compile_s": None, "memory": None, "error": error}


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def source_commit() -> str | None:
    """The git commit normkit runs from, ``"<short hash>+dirty"`` when its package files
    differ from that commit, or ``None`` when it does not run from a git checkout (an
    installed wheel; a copy inside some other repository does not count: the package's
    own files must be tracked there).

    Example:
        >>> commit = source_commit()
        >>> commit is None or len(commit.split("+")[0]) >= 7
        True
    """
    import normkit

    package = os.path.dirname(os.path.abspath(normkit.__file__))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", package, *args], capture_output=True, text=True,
                              timeout=10, check=False)

    try:
        tracked = git("ls-files", "--error-unmatch", "__init__.py")
        head = git("rev-parse", "--short=12", "HEAD")
        if tracked.returncode != 0 or head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return f"{commit}+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else commit


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


_ALLOCATOR_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                        "THP_MEM_ALLOC_ENABLE", "NORMKIT_HUGEPAGES", "LD_PRELOAD")


_PAGE_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"


def page_reporting_order() -> int | None:
    """The order of the smallest free block a virtual machine's balloon driver reports
    to its hypervisor (free page reporting: the host then drops the block's memory and
    backs it afresh on the guest's next touch), or ``None`` where nothing reports (bare
    metal, a VM without it, not Linux). At order 9 every freed 2 MiB huge page goes back
    to the host, so large fresh outputs pay the host's faults too (``benchmarks/RESULTS.md``,
    "Huge pages with two threads").

    Example:
        >>> order = page_reporting_order()
        >>> order is None or order >= 0
        True
    """
    try:
        with open(_PAGE_REPORTING_ORDER) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allocator() -> dict:
    """How large CPU buffers are allocated in this process: the transparent-huge-page
    setting, whether normkit advises huge pages (:mod:`normkit.kernels.memory`), the
    order of the free blocks a VM reports to its hypervisor
    (:func:`page_reporting_order`) and the allocator variables set in the environment
    (glibc's heap reuse, torch's THP switch, a preloaded jemalloc/tcmalloc). Large
    out-of-place ops are bound by first-touch page faults, so their times depend on
    these.

    Example:
        >>> sorted(allocator())
        ['normkit_huge_pages', 'page_reporting_order', 'transparent_hugepage', 'variables']
    """
    from ..kernels import memory

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = None
    return {"transparent_hugepage": thp,
            "normkit_huge_pages": memory.huge_pages_available(),
            "page_reporting_order": page_reporting_order(),
            "variables": {k: os.environ[k] for k in _ALLOCATOR_VARIABLES if k in os.environ}}


def environment(config: BenchConfig) -> dict:
    """The machine and software a run happens on (the ``environment`` of the JSON).

    Example:
        >>> env = environment(BenchConfig(shapes="small"))
        >>> env["device"], env["threads"], env["torch"] == torch.__version__
        ('cpu', [1], True)
    """
    import normkit

    cpu = _cpu_model()
    cuda = config.device == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "normkit": normkit.__version__,
        "normkit_commit": source_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "device": config.device,
        "device_name": torch.cuda.get_device_name() if cuda else cpu,
        "dtype": config.dtype,
        "param_dtype": config.param_dtype or config.dtype,
        "threads": list(config.threads),
        "input": config.input,
        "input_doc": INPUTS[config.input],
        "copy_bandwidth_gbs": {},
        "copy_buffer_bytes": config.copy_mib << 20,
        "memory_method": ("cuda: torch.cuda.max_memory_allocated over forward+backward, above "
                          "the memory allocated before it" if cuda else
                          "cpu: distinct storages saved for backward (saved_tensors_hooks) "
                          "plus outputs"),
        "load_average": {"start": _load_average(), "end": None},
        "allocator": allocator(),
    }


def _implementations(config: BenchConfig) -> dict[str, dict]:
    status = {"torch": {"used": True, "reason": None}, "normkit": {"used": True, "reason": None}}
    for name in COMPILED:
        if not config.compile:
            status[name] = {"used": False, "reason": "not requested (--compile)"}
        elif not hasattr(torch, "compile"):
            status[name] = {"used": False, "reason": "this torch has no torch.compile"}
        else:
            status[name] = {"used": True, "reason": None}
    for ext in EXTERNALS:
        reason = ext.status(config.device)
        status[ext.name] = {"used": reason is None, "reason": reason}
    return status


class _Case:
    """Builds one case's modules and tensors and measures its passes."""

    def __init__(self, op: Op, shape: Shape, config: BenchConfig, used: dict[str, dict],
                 copy_gbs: float, threads: int, timer: measure.Timer) -> None:
        self.op, self.shape, self.config, self.threads = op, shape, config, threads
        self.copy_gbs = copy_gbs
        self.dtype = DTYPES[config.dtype]
        self.param_dtype = DTYPES[config.param_dtype or config.dtype]
        self.timer = timer
        torch.manual_seed(config.seed)
        if config.compile:
            torch.compiler.reset()  # fresh caches: no recompile limit, no dynamic shapes
        x = make_input(shape, self.dtype, config.device, config.input)
        extra = [make_input(shape, self.dtype, config.device) for _ in range(op.inputs - 1)]
        self.inputs = [x, *extra]
        self.dys = [torch.randn_like(x, device="cpu").to(x.device) for _ in range(op.outputs)]
        self.modules: dict[str, nn.Module] = {}
        self.build_errors: dict[str, str] = {}
        for name in IMPLEMENTATIONS:
            if not used[name]["used"]:
                continue
            try:
                module = self._build(name)
            except Exception as error:
                self.build_errors[name] = f"build failed: {_describe(error)}"
                continue
            if module is not None:
                self.modules[name] = module

    def _build(self, name: str) -> nn.Module | None:
        dims = self.shape.dims
        if name == "torch":
            module = self.op.baseline(dims)
        elif name in ("normkit", "normkit.compile"):
            module = with_backend(self.op.build(self.op.resolve(), dims), self.config.backend)
        elif name == "torch.compile":
            module = self.op.baseline(dims)
        else:
            ext = next(ext for ext in EXTERNALS if ext.name == name)
            build = ext.builder(self.op.name)
            if build is None:
                return None  # this library does not cover the op
            module = build(dims)
        module = module.to(device=self.config.device, dtype=self.param_dtype
                           ).train(self.op.training)
        return torch.compile(module, dynamic=False) if name in COMPILED else module

    def _wall(self, step: Callable[[], object]) -> float:
        """Wall-clock seconds of one call (the first call: compilation happens on the host)."""
        cuda = self.config.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - begin

    def _step(self, module: nn.Module, inputs: Sequence[torch.Tensor],
              grad: bool) -> Callable[[], object]:
        if not grad:
            return lambda: module(*inputs)
        targets = [*inputs, *(p for p in module.parameters() if p.requires_grad)]
        dys = [dy.clone() for dy in self.dys]  # own copies: some kernels write dx over dy

        def step() -> None:
            torch.autograd.grad(_as_tuple(module(*inputs)), targets, dys)

        return step

    def _memory(self, name: str, module: nn.Module, inputs: Sequence[torch.Tensor],
                step: Callable[[], object]) -> dict | None:
        cuda = self.config.device == "cuda"
        if name in COMPILED:  # saved-tensor hooks do not see into compiled graphs
            return {"peak_bytes": measure.cuda_peak_bytes(step), "saved_bytes": None,
                    "output_bytes": None} if cuda else None
        memory = measure.saved_bytes(lambda: _as_tuple(module(*inputs)))
        if cuda:
            memory["peak_bytes"] = measure.cuda_peak_bytes(step)
        return memory

    def measure(self, pass_: str) -> dict:
        """One record (see the module docstring) for ``pass_``."""
        grad = pass_ == "fwd+bwd"
        config, op = self.config, self.op
        inputs = ([t.detach().clone().requires_grad_() for t in self.inputs] if grad
                  else self.inputs)
        ideal = op.ideal_bytes(self.shape.dims, pass_, self.inputs[0].element_size(),
                               self.param_dtype.itemsize)
        entries = {name: _blank(error) for name, error in self.build_errors.items()}
        steps = {}
        per_call = []
        with torch.set_grad_enabled(grad):
            for name, module in self.modules.items():
                entry = entries[name] = _blank()
                step = self._step(module, inputs, grad)
                try:
                    first = self._wall(step)
                    if name in COMPILED:
                        entry["compile_s"] = first
                    last = first
                    for _ in range(config.warmup):
                        last = self.timer(step)
                    if grad:
                        entry["memory"] = self._memory(name, module, inputs, step)
                    if config.cuda_graphs:
                        step = measure.graphed(self._step(*_fresh(name, module, inputs), grad))
                        last = self.timer(step)
                except Exception as error:
                    entry["error"] = _describe(error)
                    continue
                steps[name] = step
                per_call.append(last)
            # (a measurement lasts min_time of wall time, cache flushes included)
            number = (measure.calibrate(min(per_call) + self.timer.flush_seconds,
                                        config.min_time) if per_call else 1)
            try:
                samples = measure.interleaved(steps, self.timer, config.repeats, number)
            except Exception as error:  # e.g. out of memory mid-run: report, go on
                for name in steps:
                    entries[name]["error"] = f"timing failed: {_describe(error)}"
                samples = {}
        reference = samples.get("torch")
        for name, times in samples.items():
            median = statistics.median(times)
            entries[name].update(ms=median * 1e3, samples_ms=[t * 1e3 for t in times],
                                 number=number, gbs=ideal / median / 1e9 if median > 0 else None)
            if reference:
                q1, q2, q3 = measure.ratio_quartiles(reference, times)
                entries[name].update(ratio=q2, ratio_iqr=[q1, q3])
            if entries[name]["gbs"] is not None:
                entries[name]["pct_copy"] = 100 * entries[name]["gbs"] / self.copy_gbs
        ordered = {name: entries[name] for name in IMPLEMENTATIONS if name in entries}
        return {"op": op.name, "shape": list(self.shape.dims), "layout": self.shape.layout,
                "pass": pass_, "threads": self.threads, "ideal_bytes": ideal,
                "baseline": op.baseline_doc, "normkit": op.normkit_doc, "impls": ordered}


def _label(record: dict) -> str:
    shape = "x".join(map(str, record["shape"]))
    if record["layout"] == "channels_last":
        shape += " cl"
    ours = record["impls"].get("normkit", {})
    if ours.get("error"):
        outcome = "normkit error"
    elif ours.get("ratio") is not None:
        outcome = f"normkit {ours['ratio']:.2f}x torch"
    else:
        outcome = "no ratio"
    return f"{record['op']} {shape} {record['pass']} [{record['threads']}t]: {outcome}"


def run(config: BenchConfig | None = None, *, command: str | None = None,
        progress: Progress | None = None) -> dict:
    """Run the benchmark and return its JSON document (see the module docstring).

    ``progress(done, total, label)`` is called before the first case (``done=0``) and
    after every pass. The thread count in effect before the call is restored after it.

    Example:
        >>> doc = run(BenchConfig(ops=("layer_norm",), shapes="4x8", repeats=2, warmup=0,
        ...                       min_time=0.0, copy_mib=1))
        >>> [(r["pass"], sorted(r["impls"])) for r in doc["results"]]
        [('fwd', ['normkit', 'torch']), ('fwd+bwd', ['normkit', 'torch'])]
    """
    config = BenchConfig() if config is None else config
    cases, skipped = plan(config)
    used = _implementations(config)
    env = environment(config)
    selected = [get_op(name) for name in config.ops] if config.ops else list(OPS)
    doc = {
        "schema": SCHEMA,
        "command": command,
        "environment": env,
        "settings": {"ops": list(config.ops), "shapes": config.shapes,
                     "shape_list": [shape.spec for shape in config.shape_list],
                     "repeats": config.repeats, "warmup": config.warmup,
                     "min_time_s": config.min_time, "compile": config.compile,
                     "seed": config.seed, "flush_mib": config.flush_mib,
                     "cuda_graphs": config.cuda_graphs, "backend": config.backend},
        "implementations": used,
        "ops": [{"op": op.name, "kind": op.kind, "normkit": op.normkit_doc,
                 "baseline": op.baseline_doc, "available": reason is None, "reason": reason}
                for op, reason in ((op, op.available()) for op in selected)],
        "skipped": skipped,
        "results": [],
    }
    total = len(config.threads) * len(cases) * len(PASSES)
    done = 0
    if progress is not None:
        progress(0, total, "measuring copy bandwidth")
    previous_threads = torch.get_num_threads()
    try:
        for threads in config.threads:
            torch.set_num_threads(threads)
            copy_gbs = measure.copy_bandwidth(config.device, config.copy_mib << 20)
            env["copy_bandwidth_gbs"][str(threads)] = copy_gbs
            timer = measure.Timer(config.device, config.flush_mib << 20)
            for op, shape in cases:
                case = _Case(op, shape, config, used, copy_gbs, threads, timer)
                for pass_ in PASSES:
                    record = case.measure(pass_)
                    doc["results"].append(record)
                    done += 1
                    if progress is not None:
                        progress(done, total, _label(record))
                del case
    except KeyboardInterrupt:  # (Ctrl-C, or SIGTERM through the CLI): keep what was measured
        doc["interrupted"] = f"after {done} of {total} passes"
    finally:
        torch.set_num_threads(previous_threads)
    env["load_average"]["end"] = _load_average()
    return doc


def errors(doc: dict) -> list[str]:
    """Every failed implementation in a document, as ``op shape layout pass impl: error``.

    Example:
        >>> errors({"results": []})
        []
    """
    found = []
    for record in doc["results"]:
        for name, entry in record["impls"].items():
            if entry.get("error"):
                shape = "x".join(map(str, record["shape"]))
                found.append(f"{record['op']} {shape} {record['layout']} {record['pass']} "
                             f"[{record['threads']}t] {name}: {entry['error']}")
    return found
