"""Load a user's model file (docs/design.md §3, a contract) and build the model on the meta device.

A model file defines ``build_model()`` and ``example_inputs(micro_batch_size)``, optionally
``loss_fn(output, inputs)``, ``SEQ_LEN``, ``tp_plan`` and ``pipeline_blocks``. ``example_inputs``
returns the forward arguments: a tensor, a tuple (positional) or a dict (keyword). Building on
meta allocates no memory, so a 1T-parameter model loads in seconds.

Every failure is a ``ModelFileError`` naming the file and the cause.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.block_dict import adopt_block_dicts
from autopar.errors import ModelFileError
from autopar.input_cast import cast_wider_inputs
from autopar.usercode import calls_model, model_failures

TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """A loaded model file: its module and the optional declarations it made."""

    path: Path
    sha256: str
    module: ModuleType
    seq_len: int | None
    tp_plan: Mapping[str, str] | None
    pipeline_blocks: str | None

    def __post_init__(self) -> None:
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ModelFileError(f"{self.path}: SEQ_LEN must be a positive integer, got {self.seq_len!r}")
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping):
                raise ModelFileError(f"{self.path}: tp_plan must be a dict of submodule pattern -> style")
            for pattern, style in self.tp_plan.items():
                if style not in TP_STYLES:
                    raise ModelFileError(
                        f"{self.path}: tp_plan[{pattern!r}] = {style!r}; use one of {', '.join(TP_STYLES)}"
                    )
        if self.pipeline_blocks is not None and not isinstance(self.pipeline_blocks, str):
            raise ModelFileError(f"{self.path}: pipeline_blocks must be the name of a ModuleList attribute")

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor] | None:
        return getattr(self.module, "loss_fn", None)

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        """Call ``build_model()`` under ``device`` (meta by default: no memory is used). On meta,
        every parameter the model registers is on meta, wherever its constructor made it."""
        from autopar.usercode import user_code  # time limit, exits and BaseExceptions, stdout to stderr

        # a parameter made by a constructor that ignores the default device (XLNet's
        # ``nn.Parameter(torch.FloatTensor(d, n, h))``) would be a CPU tensor inside a meta model
        on_meta = _parameters_on_meta() if torch.device(device).type == "meta" else contextlib.nullcontext()
        with user_code("build_model()", self.path, f" on {device}"), torch.device(device), on_meta:
            model = self.module.build_model()
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"{self.path}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
        adopt_block_dicts(model)  # torchtitan's numbered ModuleDict of layers read as a block list
        cast_wider_inputs(model)  # fp32 features into 16-bit weights, as autocast casts them
        return model

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """The buffers ``build_model()`` computes (position ids, relative-position indices, rotary
        frequencies), by name, on the CPU: the model is built with every parameter on meta (no
        parameter memory) and its buffers real. A model materialised from a meta build has storage
        but no values for them (``to_empty``), and an index buffer of garbage makes the profiler's
        forward fail (Swin's relative-position index, CLIP's position ids). A parameter is created on
        the CPU before it is registered (and moved to meta); where one does not fit the host, there
        are no values ({}): the caller keeps its fallback (floating buffers zero). Built once per
        loaded file (the profiler's layer, contention and whole-model runs, validate's drift check
        each materialise the model); callers copy the values, never write them."""
        cached = self.__dict__.get("_buffer_values")
        if cached is None:
            cached = self._build_buffer_values()
            object.__setattr__(self, "_buffer_values", cached)  # a cache, not a field: frozen stays frozen
        return cached

    def _build_buffer_values(self) -> dict[str, torch.Tensor]:
        from autopar.usercode import user_code

        try:
            with user_code("build_model()", self.path, " with parameters on meta"), _parameters_on_meta():
                model = self.module.build_model()
        except ModelFileError as exc:
            if "allocate" in str(exc) or "MemoryError" in str(exc):
                return {}
            raise
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"{self.path}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
        return {n: b for n, b in model.named_buffers() if b.device.type != "meta"}

    def user_files(self) -> tuple[str, ...]:
        """The files of the user's code: the model file and wherever its build_model,
        example_inputs and loss_fn are defined (a file beside it they were imported from)."""
        files = {str(self.path)}
        for name in ("build_model", "example_inputs", "loss_fn"):
            code = getattr(getattr(self.module, name, None), "__code__", None)
            if code is not None:
                files.add(code.co_filename)
        return tuple(sorted(files))

    def running(self, during: str) -> contextlib.AbstractContextManager[None]:
        """A guard around autopar running this model on real tensors ``during`` something ("while
        timing the block at micro-batch 2, tp 1 on cpu"): the model's failure becomes one line,
        exit 2 (autopar.usercode.model_failures); autopar's own errors pass through."""
        return model_failures(self.path, during, self.user_files())

    def example_inputs(self, micro_batch_size: int, device: str | torch.device = "meta") -> Any:
        """One micro-batch of forward arguments, moved to ``device``."""
        from autopar.usercode import user_code

        with user_code(f"example_inputs({micro_batch_size})", self.path), torch.device(device):
            inputs = self.module.example_inputs(micro_batch_size)
        return _to_device(inputs, torch.device(device))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to meta as it is registered; buffers and plain
    tensors stay where they are made (the CPU)."""
    register = nn.Module.register_parameter
    moved: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (original, meta): one registered twice stays tied

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            if id(param) not in moved:
                moved[id(param)] = (param, type(param)(param.detach().to("meta"), requires_grad=param.requires_grad))
            param = moved[id(param)][1]
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__


def _to_device(value: Any, device: torch.device) -> Any:
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


@calls_model
def call_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` the way the contract says: tuple -> *args, dict -> **kwargs, else one arg."""
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


@calls_model
def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` through the user's model: marked as a call into the model, so that an
    error of autograd's own engine there (an in-place change of a saved tensor, which has no
    Python frame of the user's) is the model's failure (autopar.usercode.raised_by_model)."""
    loss.backward()


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` as a fresh module and check it meets the model-file contract."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file {p} does not exist")
    if p.suffix != ".py":
        raise ModelFileError(f"model file {p} must be a Python file ending in .py")
    name = f"autopar_user_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"model file {p} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    from autopar.usercode import user_code

    try:
        with user_code("import", f"model file {p}"):
            spec.loader.exec_module(module)
    except ModelFileError:
        sys.modules.pop(name, None)
        raise
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(module, required, None)):
            raise ModelFileError(f"model file {p} must define {required}() (see the model-file contract in README)")
    loss = getattr(module, "loss_fn", None)
    if loss is not None and not callable(loss):
        raise ModelFileError(f"model file {p}: loss_fn must be a function (output, inputs) -> loss")
    return ModelFile(
        path=p,
        sha256=file_sha256(p),
        module=module,
        seq_len=getattr(module, "SEQ_LEN", None),
        tp_plan=getattr(module, "tp_plan", None),
        pipeline_blocks=getattr(module, "pipeline_blocks", None),
    )
