"""Derives a draft model for speculative decoding from a target's own weights: a subset of its
decoder layers with its embedding, final norm and head, saved as a model folder of its own
(docs/speculative.md, and benchmarks/RESULTS.md for how the built-in
model's draft was chosen)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tierserve.model.fetch import BUILTIN_MODEL_NAME, default_cache_dir, fetch_builtin_model

# The built-in draft: SmolLM2-135M's first 2 of 30 layers (the fastest of those tried; none is fast
# enough on a CPU, benchmarks/RESULTS.md, speculative decoding).
BUILTIN_DRAFT_LAYERS = (0, 1)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def layer_spec(layers: tuple[int, ...]) -> str:
    """A short name for a layer subset, e.g. ``L0-5+29``: runs of consecutive layers joined by +."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return "L" + "+".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def derive_draft(target_dir: Path, out_dir: Path, layers: tuple[int, ...]) -> Path:
    """Writes to ``out_dir`` (replacing what is there) the model made of
    ``target_dir``'s ``layers`` (in that order, renumbered from 0) plus every non-layer tensor;
    returns ``out_dir``. Same vocabulary and tokenizer as the target, so its drafts verify."""
    from safetensors.torch import load_file

    config = json.loads((target_dir / "config.json").read_text())
    if not layers or max(layers) >= config["num_hidden_layers"] or min(layers) < 0:
        raise ValueError(f"layers {layers} outside the target's {config['num_hidden_layers']}")
    renumber = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            m = _LAYER.match(name)
            if m is None:
                tensors[name] = tensor
            elif int(m.group(1)) in renumber:
                tensors[f"model.layers.{renumber[int(m.group(1))]}.{name[m.end():]}"] = tensor
    copied = [target_dir / name for name in _COPIED if (target_dir / name).is_file()]
    return write_model_folder(out_dir, config | {"num_hidden_layers": len(layers)}, tensors, copied)


def write_model_folder(out_dir: Path, config: dict, tensors: dict, copied: Sequence[Path] = ()) -> Path:
    """Writes ``config.json``, ``model.safetensors`` and copies of ``copied`` to ``out_dir``,
    replacing what is there, whole or not at all (built beside it, then renamed); returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for source in copied:
            shutil.copy(source, tmp / source.name)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def builtin_draft_dir(cache_dir: Path | None = None, layers: tuple[int, ...] = BUILTIN_DRAFT_LAYERS) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"{BUILTIN_MODEL_NAME}-draft-{layer_spec(layers)}"


def fetch_builtin_draft(cache_dir: Path | None = None, layers: tuple[int, ...] = BUILTIN_DRAFT_LAYERS,
                        progress: bool = True) -> Path:
    """The built-in model's draft folder, derived (once) from the built-in model, converted first if needed."""
    out = builtin_draft_dir(cache_dir, layers)
    if (out / "model.safetensors").is_file():
        return out
    return derive_draft(fetch_builtin_model(cache_dir, progress), out, layers)
