"""The ``ADATREE`` speculative algorithm as SGLang 0.5.23's plug-in registry sees it.

``--speculative-algorithm adatree`` resolves to ``AdaTreeSpecAlgo``: a ``CustomSpecAlgo`` that
adds the four methods 0.5.23's base class lacks, reports itself as EAGLE-like or STANDALONE-like
from the draft checkpoint's own config (an EAGLE / EAGLE-3 head, or a small ordinary model),
sizes memory for the envelope of the candidate shapes, and rejects what adatree cannot run
with a message that names the flag.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

from sglang_adatree.config import AdaTreeConfig, ConfigError, load_config
from sglang_adatree.core.shapes import Envelope, envelope
from sglang_adatree.core.step_profile import load_profile_step_time
from sglang_adatree.drafts import draft_kind_of

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "ADATREE"
CPU_ATTENTION_BACKEND = "adatree_cpu"
# SGLang's CPU defaults (intel_amx falls back to torch_native without AMX) that adatree's
# backend replaces on --device cpu; anything else given explicitly is refused.
_CPU_COMPATIBLE_BACKENDS = (None, "intel_amx", "torch_native", CPU_ATTENTION_BACKEND)

# Flags whose features SGLang gates on the literal names EAGLE/EAGLE3 or that fight with a
# per-step shape: adatree cannot honour them, so it refuses them at start-up.
_UNSUPPORTED_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("speculative_adaptive", "--speculative-adaptive", False),
    ("speculative_use_rejection_sampling", "--speculative-use-rejection-sampling", False),
    ("speculative_use_block_verification", "--speculative-use-block-verification", False),
    ("enable_multi_layer_eagle", "--enable-multi-layer-eagle", False),
    ("enable_dp_attention", "--enable-dp-attention", False),
)
_SHAPE_FLAGS: tuple[tuple[str, str], ...] = (
    ("speculative_num_steps", "--speculative-num-steps"),
    ("speculative_eagle_topk", "--speculative-eagle-topk"),
    ("speculative_num_draft_tokens", "--speculative-num-draft-tokens"),
)


class AdaTreeArgsError(ValueError):
    """A server argument adatree cannot run with; the message names the flag."""


def detect_draft_kind(draft_path: str) -> str:
    """``'eagle3'``, ``'eagle'`` or ``'standalone'`` from the draft checkpoint's config.json.

    EAGLE heads declare an ``*Eagle*`` architecture (``LlamaForCausalLMEagle``,
    ``LlamaForCausalLMEagle3``); anything else is served as a separate small draft model.
    """
    config_file = Path(draft_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdaTreeArgsError(
            f"--speculative-draft-model-path {draft_path!r}: no config.json there; adatree "
            "needs a local draft checkpoint (an EAGLE head or a small model)"
        ) from None
    except json.JSONDecodeError as exc:
        raise AdaTreeArgsError(f"{config_file}: not valid JSON ({exc})") from None
    return draft_kind_of(config)


def _published_draft_path() -> str | None:
    try:
        from sglang.srt.runtime_context import get_spec as get_spec_config

        return get_spec_config().speculative_draft_model_path
    except Exception:  # configuration not published in this process yet
        return None


def adatree_config() -> AdaTreeConfig:
    """The process's adatree configuration (``ADATREE_CONFIG`` file and ``ADATREE_*`` env)."""
    return load_config()


class AdaTreeSpecAlgo(CustomSpecAlgo):
    """SGLang's view of adatree: EAGLE-like or STANDALONE-like by the draft checkpoint."""

    _draft_path: str | None = None
    _kind_cache: dict[str, str] = {}  # noqa: RUF012 - per-process cache of detect_draft_kind

    def draft_kind(self) -> str:
        path = _published_draft_path() or self._draft_path
        if path is None:
            raise AdaTreeArgsError(
                "--speculative-algorithm adatree needs --speculative-draft-model-path"
            )
        if path not in self._kind_cache:
            self._kind_cache[path] = detect_draft_kind(path)
        return self._kind_cache[path]

    # -- the duck-typed predicates SGLang dispatches on -----------------------------------

    def is_eagle(self) -> bool:
        return self.draft_kind() in ("eagle", "eagle3")

    def is_eagle3(self) -> bool:
        return self.draft_kind() == "eagle3"

    def is_standalone(self) -> bool:
        return self.draft_kind() == "standalone"

    def supports_mixed_chunk(self) -> bool:
        return False

    def supports_grammar_overlap(self) -> bool:
        # The EAGLE V2 verify path (which both worker kinds use) runs the grammar barrier.
        return True

    def has_draft_kv(self) -> bool:
        return True

    # -- the four methods 0.5.23's CustomSpecAlgo lacks -----------------------------------

    def create_future_map(
        self,
        device: Any,
        req_to_token_pool: Any,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def carries_draft_hidden_states(self) -> bool:
        return self.is_eagle()

    def need_topk(self) -> bool:
        return True

    def get_platform_worker_cls(self) -> type | None:
        # adatree brings its own worker on every platform.
        return None

    # -- server arguments -------------------------------------------------------------------

    def envelope(self) -> Envelope:
        return envelope(adatree_config().candidate_shapes)

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        """KV reserved per request per step: covers every candidate shape's draft slots."""
        env = self.envelope()
        return max(env.kv_tokens_reserved, env.num_draft_tokens)

    def handle_server_args(self, server_args: Any) -> None:
        """Resolve defaults as EAGLE does, then size everything for the envelope."""
        from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

        self._draft_path = server_args.speculative_draft_model_path
        if server_args.device == "cpu":
            # SGLang's speculative path on a CPU needs our attention backend and the
            # torch sampler.
            server_args.attention_backend = CPU_ATTENTION_BACKEND
            server_args.prefill_attention_backend = None
            server_args.decode_attention_backend = None
            server_args.sampling_backend = "pytorch"
        env = self.envelope()
        server_args.speculative_num_steps = env.steps
        server_args.speculative_eagle_topk = env.topk
        server_args.speculative_num_draft_tokens = env.num_draft_tokens
        _handle_eagle_family(server_args)


def validate_server_args(server_args: Any) -> None:
    """Reject what adatree does not support, naming the flag; runs before any resolution."""
    spec = get_spec(ALGORITHM_NAME)
    draft_path = server_args.speculative_draft_model_path
    if draft_path is None:
        raise AdaTreeArgsError(
            "--speculative-algorithm adatree needs --speculative-draft-model-path "
            "(an EAGLE / EAGLE-3 head or a small draft model with the target's vocabulary)"
        )
    if isinstance(spec, AdaTreeSpecAlgo):
        spec._draft_path = draft_path
    for field, flag, allowed in _UNSUPPORTED_FLAGS:
        value = getattr(server_args, field, allowed)
        if value not in (allowed, None):
            raise AdaTreeArgsError(f"{flag} is not supported with --speculative-algorithm adatree")
    for field, flag in _SHAPE_FLAGS:
        if getattr(server_args, field, None) is not None:
            raise AdaTreeArgsError(
                f"{flag} is not used with --speculative-algorithm adatree: it chooses the "
                "shape every decode step; set the candidates with candidate_shapes in the "
                "adatree config (ADATREE_CANDIDATE_SHAPES or the ADATREE_CONFIG file), or pin "
                "a shape from the dashboard"
            )
    if getattr(server_args, "pp_size", 1) not in (1, None):
        raise AdaTreeArgsError(
            "--pp-size > 1 is not supported with --speculative-algorithm adatree"
        )
    if server_args.device == "cpu":
        for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            backend = getattr(server_args, field, None)
            if backend not in _CPU_COMPATIBLE_BACKENDS:
                flag = "--" + field.replace("_", "-")
                raise AdaTreeArgsError(
                    f"{flag} {backend}: on --device cpu adatree runs its own pure-torch "
                    f"backend ({CPU_ATTENTION_BACKEND}, a superset of torch_native); leave "
                    "the flag out"
                )
        if not _cuda_graphs_disabled(server_args):
            raise AdaTreeArgsError(
                "--device cpu: pass --disable-cuda-graph (SGLang resolves graph capture "
                "before the speculative algorithm is consulted; `adatree serve` adds it)"
            )
        if getattr(server_args, "page_size", 1) not in (1, None):
            raise AdaTreeArgsError("--page-size > 1 is not supported by adatree on --device cpu")
    try:
        config = adatree_config()
    except ConfigError as exc:
        raise AdaTreeArgsError(f"adatree configuration: {exc}") from None
    if config.step_time_profile:
        try:
            load_profile_step_time(config.step_time_profile, config.candidate_shapes)
        except ValueError as exc:
            raise AdaTreeArgsError(str(exc)) from None
    kind = detect_draft_kind(draft_path)
    _check_vocabulary(server_args.model_path, draft_path, kind)
    if config.record_steps:
        _check_telemetry_store(config)
    logger.info(
        "adatree: %s draft, %d candidate shapes, envelope %s",
        kind,
        len(config.candidate_shapes),
        envelope(config.candidate_shapes),
    )


def _check_telemetry_store(config: AdaTreeConfig) -> None:
    """The telemetry database must open and be at the schema head before serving starts."""
    from sglang_adatree.telemetry.store import (
        SchemaError,
        check_schema_at_head,
        display_url,
        get_engine,
    )

    url = config.resolved_db_url
    try:
        check_schema_at_head(get_engine(url))
    except SchemaError as exc:
        raise AdaTreeArgsError(str(exc)) from None
    except Exception as exc:
        raise AdaTreeArgsError(
            f"telemetry database {display_url(url)} cannot be opened ({exc}); fix the URL "
            "(--db / ADATREE_DB_URL / db_url), create it with `adatree db upgrade --db URL`, "
            "or turn recording off with record_steps = false"
        ) from None


def _cuda_graphs_disabled(server_args: Any) -> bool:
    if getattr(server_args, "disable_cuda_graph", False):
        return True
    return getattr(server_args, "cuda_graph_backend_decode", None) == "disabled"


def _check_vocabulary(target_path: str, draft_path: str, kind: str) -> None:
    """A draft must speak the target's vocabulary (a reduced EAGLE-3 vocabulary maps back)."""
    try:
        target = json.loads((Path(target_path) / "config.json").read_text())
        draft = json.loads((Path(draft_path) / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return  # remote or unusual checkpoints: SGLang's own loaders check them
    target_vocab = target.get("vocab_size")
    draft_vocab = draft.get("vocab_size")
    if kind == "eagle3" and draft.get("draft_vocab_size"):
        return
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        raise AdaTreeArgsError(
            f"--speculative-draft-model-path {draft_path!r}: its vocabulary has {draft_vocab} "
            f"tokens but the target's has {target_vocab}; the draft must use the target's "
            "tokenizer"
        )
