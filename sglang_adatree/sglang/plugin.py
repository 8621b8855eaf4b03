"""Entry point of the ``sglang.srt.plugins`` group: registers adatree in every SGLang process.

SGLang calls ``register()`` in every process it starts (the launcher, the scheduler, the
detokenizer, ...), before it parses arguments. Registration is therefore idempotent and cheap,
and never assumes the device: the CPU hooks decide per call.
"""

from __future__ import annotations

from typing import Any

_registered = False


def _worker_class(server_args: Any) -> type:
    """The worker for the draft checkpoint's kind: EAGLE-style head or STANDALONE-style model."""
    from sglang_adatree.sglang.spec_algo import detect_draft_kind
    from sglang_adatree.sglang.worker import AdaTreeEagleWorker, AdaTreeStandaloneWorker

    kind = detect_draft_kind(server_args.speculative_draft_model_path)
    return AdaTreeStandaloneWorker if kind == "standalone" else AdaTreeEagleWorker


def _server_info(result: Any, controller: Any, state: dict) -> None:
    """AFTER hook on the scheduler's speculative readback: adatree's live state too."""
    worker = controller.scheduler.draft_worker
    if hasattr(worker, "adatree_server_state"):
        state.update(worker.adatree_server_state())


def register() -> None:
    """Register the ``adatree`` algorithm, its CPU hooks and empty-prompt checks (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang_adatree.sglang.cpu.weights import packed_linear_budget_bytes

    # A bad setting stops the whole plug-in here (SGLang logs the error), not half of it later.
    packed_linear_budget_bytes()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_adatree.sglang import empty_prompts, profiling
    from sglang_adatree.sglang.cpu import hooks as cpu
    from sglang_adatree.sglang.launched import finish_on_resolved_tokens
    from sglang_adatree.sglang.spec_algo import (
        ALGORITHM_NAME,
        AdaTreeSpecAlgo,
        validate_server_args,
    )

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM_NAME,
            supports_overlap=True,
            validate_server_args=validate_server_args,
            spec_class=AdaTreeSpecAlgo,
        )(_worker_class)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController._add_speculative",
        _server_info,
        HookType.AFTER,
    )
    # A decode step finishes when the scheduler has its result's accept counts on the CPU.
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
        finish_on_resolved_tokens,
        HookType.AFTER,
    )
    cpu.install_hooks()
    empty_prompts.install_hooks()
    profiling.install_hooks()
    _registered = True
