"""The compiled-artifact cache: what a cold start compiles is saved, and a warm start loads it without tracing.

API:
    compile_cache_key(model_config, dtype, *, device=None, settings=None, source_hash=None) -> str
    compile_cache_dir(cache_key, cache_root=None) -> Path   <root>/compile/<key>
    inductor_cache_scope(path)                          Inductor's caches (and compile settings) for a compile
    ember_source_hash(root=None) -> str                 hash of every .py file of the ember package
    ArtifactStore(directory)
        .save(split, pieces, groups, artifacts, single_output, inputs)   after a cold compile; manifest written last
        .load() -> LoadedGraph | None                   None when absent; a warning and None when corrupt
    describe_graph_inputs(model, call_inputs, gm, example_inputs) -> list[InputSpec] | reason
    LoadedForward(model, loaded_graph)(*call_inputs) -> hidden      the warm start's forward, no dynamo
    InputSpec: ("param", name) | ("input", index) | ("size", input_index, dim)

Layout of a store, one per cache key: `split.pkl` (the split graph: which piece or attention call runs, in order,
with which values), `piece-<g>.bin` (distinct piece g: torch's standalone-compile artifact, Triton/C++ kernels
included, or, for a plain piece, its pickled FX graph; ember.graphs.plain_pieces), `manifest.json` (piece -> group,
which pieces are plain, the graph inputs, a SHA-256 of every file). A store whose pieces are all plain loads without
importing dynamo or Inductor. A save is complete only
once the manifest exists; a file whose size or hash differs from the manifest makes `load` warn and return None, so
the caller compiles again.

The key names everything that changes the compiled code: the model config and dtype, the device kind, every ember
source file (an edit invalidates), the torch and triton versions, and the caller's settings (capture sizes,
compiler pass switches).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.config import cache_dir, package_version
from ember.kernels.triton_key import pin_cache_dir

logger = logging.getLogger("ember")

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


def compile_cache_dir(cache_key: str, cache_root: Path | str | None = None) -> Path:
    """Where Inductor keeps this model's compiled code: <root>/compile/<key>."""
    return Path(cache_dir() if cache_root is None else cache_root) / "compile" / cache_key


@contextlib.contextmanager
def inductor_cache_scope(path: Path) -> Iterator[None]:
    """Point Inductor's on-disk caches at `path` (and turn them on) for a compile. Pointwise kernels take Inductor's
    one heuristic tile: autotuning compiles and times every candidate (6 for a 2D gather such as the rotary rows).

    Triton's cache folder is pinned first, for the rest of the process (`triton_key.pin_cache_dir`): unset,
    Inductor derives it from the folder given here, and ember's own kernels would follow it between starts."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    pin_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    # Inductor reads its cache location from this variable each time it needs it; there is no config option
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        with inductor_config.patch({"fx_graph_cache": True, "triton.autotune_pointwise": False}), \
                functorch_config.patch(enable_autograd_cache=True):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def ember_source_hash(root: Path | str | None = None) -> str:
    """SHA-256 over the relative path and bytes of every .py file under `root` (default: the ember package, hashed
    once per process)."""
    return _package_source_hash() if root is None else _tree_hash(Path(root))


@functools.lru_cache(maxsize=1)
def _package_source_hash() -> str:
    return _tree_hash(Path(__file__).resolve().parent.parent)


def _tree_hash(base: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        digest.update(str(path.relative_to(base)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _device_kind(device: torch.device | str | None) -> str:
    if device is None:
        return "unspecified"
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return device.type


def compile_cache_key(model_config: Mapping[str, Any] | str | Any, dtype: torch.dtype | str, *,
                      device: torch.device | str | None = None, settings: Mapping[str, Any] | None = None,
                      source_hash: str | None = None) -> str:
    """A short hash naming the compiled artifacts of one model build: its config (a dict, a JSON string, or an object
    with `to_dict()` such as a transformers config), dtype, device kind, ember's source, torch and triton versions,
    and `settings` (capture sizes, pass switches: anything JSON-serialisable that changes the compiled code)."""
    if hasattr(model_config, "to_dict"):
        model_config = model_config.to_dict()
    text = model_config if isinstance(model_config, str) else json.dumps(model_config, sort_keys=True, default=str)
    blob = json.dumps([text, str(dtype), _device_kind(device), source_hash or ember_source_hash(),
                       torch.__version__, package_version("triton"),
                       json.dumps(dict(settings or {}), sort_keys=True, default=str), FORMAT_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


InputSpec = tuple  # ("param", name) | ("input", index) | ("size", input_index, dim)


@dataclass
class LoadedGraph:
    """What a warm start needs: the split graph, each piece's compiled callable and the graph's inputs."""
    split: torch.fx.GraphModule
    pieces: dict[str, Any]            # piece name -> loaded artifact (shared by the pieces of one group)
    num_groups: int
    inputs: list[InputSpec]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ArtifactStore:
    """One cache key's directory of compiled artifacts (see the module docstring)."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)

    def save(self, split: torch.fx.GraphModule, pieces: Sequence[str], groups: Sequence[int],
             artifacts: Sequence[Any], single_output: Sequence[bool], inputs: Sequence[InputSpec]) -> None:
        """Write the split graph, one artifact per distinct piece (`artifacts[g]` for group g; `single_output[g]`
        when its piece returns one value rather than a tuple), then the manifest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / MANIFEST).unlink(missing_ok=True)
        files: dict[str, str] = {}
        for g, artifact in enumerate(artifacts):
            name = f"piece-{g}.bin"
            artifact.save(path=str(self.directory / name), format="binary")
            files[name] = _sha256(self.directory / name)
        plain = [_is_plain(a) for a in artifacts]
        # the pieces' own graphs are not needed to run (their artifacts replace them): pickle placeholders
        saved = {name: split._modules[name] for name in pieces}
        try:
            for name in pieces:
                split._modules[name] = torch.nn.Module()
            data = pickle.dumps(split)
        finally:
            split._modules.update(saved)
        _atomic_write(self.directory / "split.pkl", data)
        files["split.pkl"] = _sha256(self.directory / "split.pkl")
        manifest = {"version": FORMAT_VERSION, "pieces": dict(zip(pieces, groups)), "num_groups": len(artifacts),
                    "single_output": list(single_output), "plain": plain,
                    "inputs": [list(spec) for spec in inputs], "files": files}
        _atomic_write(self.directory / MANIFEST, json.dumps(manifest, indent=1).encode())

    def plain_only(self) -> bool:
        """Whether a saved entry exists and every piece of it is a plain FX graph (its load then needs no
        Inductor)."""
        try:
            plain = json.loads((self.directory / MANIFEST).read_text()).get("plain")
        except (OSError, ValueError):
            return False
        return isinstance(plain, list) and bool(plain) and all(p is True for p in plain)

    def load(self) -> LoadedGraph | None:
        """The saved graph and artifacts, or None: silently when nothing was saved, with a warning when an entry is
        corrupt or partial (the caller then compiles again and overwrites it)."""
        path = self.directory / MANIFEST
        if not path.exists():
            return None
        try:
            return self._load(json.loads(path.read_text()))
        except Exception as exc:   # a damaged entry must cost a recompile, never the start-up
            logger.warning("compiled artifacts in %s are unusable (%s: %s); compiling again", self.directory,
                           type(exc).__name__, exc)
            return None

    def _load(self, manifest: dict) -> LoadedGraph:
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {manifest.get('version')} is not {FORMAT_VERSION}")
        for name, digest in manifest["files"].items():
            if _sha256(self.directory / name) != digest:
                raise ValueError(f"{name} does not match its recorded SHA-256 (truncated or overwritten)")
        from ember.graphs.plain_pieces import PlainPiece
        split = pickle.loads((self.directory / "split.pkl").read_bytes())
        loaded = []
        for g, (single, plain) in enumerate(zip(manifest["single_output"], manifest["plain"], strict=True)):
            path = str(self.directory / f"piece-{g}.bin")
            if plain:
                loaded.append(PlainPiece.load(path))      # returns what the piece returns
            else:
                from torch._inductor import CompiledArtifact
                # a loaded artifact returns its outputs as a list, also where the piece returns a single value
                fn = CompiledArtifact.load(path=path, format="binary")
                loaded.append(_FirstOutput(fn) if single else fn)
        if len(loaded) != manifest["num_groups"]:
            raise ValueError(f"{len(loaded)} pieces described, {manifest['num_groups']} recorded")
        pieces = {name: loaded[g] for name, g in manifest["pieces"].items()}
        return LoadedGraph(split, pieces, len(loaded), [tuple(spec) for spec in manifest["inputs"]])


def _is_plain(artifact: Any) -> bool:
    from ember.graphs.plain_pieces import PlainPiece
    return isinstance(artifact, PlainPiece)


class _FirstOutput:
    """Calls a loaded artifact and returns its one output."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)[0]


def describe_graph_inputs(model: nn.Module, call_inputs: Sequence[torch.Tensor], gm: torch.fx.GraphModule,
                          example_inputs: list) -> list[InputSpec] | str:
    """How to rebuild the traced graph's inputs without dynamo: each is a parameter or buffer of `model` (by name),
    one of the call's inputs, or a size of one; a reason string when some input is none of these."""
    owners = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return f"{len(placeholders)} graph inputs but {len(example_inputs)} example inputs"
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(output, (tuple, list)) or len(output) != 1:
        return "the traced graph does not return exactly one tensor"
    specs: list[InputSpec | None] = []
    sizes: dict[str, tuple[int, int]] = {}
    for node, value in zip(placeholders, example_inputs):
        spec = None
        if isinstance(value, torch.Tensor):
            for i, t in enumerate(call_inputs):
                if value is t:
                    spec = ("input", i)
                    fake = node.meta.get("example_value")
                    for dim, size in enumerate(fake.shape if fake is not None else ()):
                        sizes.setdefault(str(size), (i, dim))
            if spec is None and id(value) in owners:
                spec = ("param", owners[id(value)])
            if spec is None:
                return f"graph input {node.name} is neither a model tensor nor a call input"
        specs.append(spec)
    for k, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if specs[k] is None:
            symbol = str(node.meta.get("example_value", value))
            if symbol not in sizes:
                return f"graph input {node.name} = {symbol} is no size of a call input"
            specs[k] = ("size", *sizes[symbol])
    return specs


class LoadedForward:
    """The saved split graph with loaded pieces, called with the model's tensors and this call's inputs."""

    def __init__(self, model: nn.Module, graph: LoadedGraph):
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        self.split = graph.split
        self.args: list[Any] = []
        self.per_call: list[tuple[int, InputSpec]] = []    # (argument index, spec) filled on every call
        for i, spec in enumerate(graph.inputs):
            if spec[0] == "param":
                if spec[1] not in tensors:
                    raise ValueError(f"saved graph input {spec[1]!r} is not a tensor of this model")
                self.args.append(tensors[spec[1]])
            else:
                self.args.append(None)
                self.per_call.append((i, spec))

    def __call__(self, *call: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        for i, spec in self.per_call:
            args[i] = call[spec[1]] if spec[0] == "input" else call[spec[1]].shape[spec[2]]
        return self.split(*args)[0]



def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
