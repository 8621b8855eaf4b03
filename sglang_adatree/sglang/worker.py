"""The adatree speculative worker: a new tree shape every decode step, verified losslessly.

It extends SGLang's EAGLE V2 worker (EAGLE / EAGLE-3 heads) or its STANDALONE V2 worker (a
separate small draft model). At start-up it builds one runtime state per candidate shape
``(steps, topk, num_draft_tokens)``, no speculation included: draft attention backends, the
target's verify backend and, on a GPU, their CUDA graphs. Each decode step it opens a ticket
with the step controller (``core.controller``: the shape, and whether the step skips the
draft's extend), swaps in that shape's state, runs SGLang's own draft / verify / draft-extend
(on a CPU, a step without speculation that skips the draft's extend is the target's plain
decode instead: ``plain_step``), and attaches what it launched to the step's result object.
When the scheduler has the result's accept counts on the CPU (one step late under overlap
scheduling), a hook on its result processor finishes that ticket with them: the result carries
its own ticket, so a step whose result never comes back cannot shift another's record.

Top-k relay: the draft extend of every step produces candidates at the envelope's top-k, and
each draft slices the prefix it needs (top-k outputs are sorted, so the prefix is exact). That
keeps the relayed tensors one width whatever the next shape is.

Tensor parallelism: every rank must run the same shape. Only rank 0 holds a controller (and
its telemetry and control poller); it broadcasts its step plan
(``controller.plan_on_every_rank``) and every rank runs it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState
from sglang.srt.speculative.eagle_utils import TreeMaskMode
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
from sglang.srt.speculative.standalone_worker_v2 import StandaloneDraftWorker, StandaloneWorkerV2
from sglang.srt.utils.common import get_available_gpu_memory

from sglang_adatree.config import load_config
from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.controller import BatchView, StepOutcome, plan_on_every_rank
from sglang_adatree.core.features import NO_GRAPHS, GraphPadding
from sglang_adatree.core.shapes import TreeShape, envelope
from sglang_adatree.sglang.launched import LAUNCHED_ATTR, LaunchedStep, step_period_start
from sglang_adatree.sglang.plain_step import plain_decode_step, runs_as_plain_decode
from sglang_adatree.sglang.profiling import StepProfiler
from sglang_adatree.sglang.serving import ServingLoop, create_serving_loop
from sglang_adatree.sglang.tree import accepted_path_stats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShapeState:
    """Everything that must change together when the shape changes."""

    shape: TreeShape
    runtime: SpecRuntimeState
    tree_mask_mode: Any  # SGLang's TreeMaskMode for this state's verify mask


def _relay_draft_worker(base: type) -> type:
    """A subclass of SGLang's draft worker ``base`` with top-k relay and tree capture.

    Installed by re-classing the draft worker SGLang built (a ``__class__`` swap to a direct
    subclass that adds no state of its own), so SGLang's constructor runs unchanged.
    """

    class RelayDraftWorker(base):
        relay_topk: int
        last_top_scores_index: torch.Tensor | None = None
        last_verify_input: Any = None

        def draft(self, batch: Any, *, with_topology: bool = False) -> Any:
            spec_info = batch.spec_info
            if spec_info.topk_p is not None and spec_info.topk_p.shape[1] > self.topk:
                # The relay carries relay_topk candidates; this shape drafts from the best.
                spec_info.topk_p = spec_info.topk_p[:, : self.topk].contiguous()
                spec_info.topk_index = spec_info.topk_index[:, : self.topk].contiguous()
            verify_input, parent_list, top_scores_index = super().draft(batch, with_topology=True)
            self.last_top_scores_index = top_scores_index
            self.last_verify_input = verify_input
            if with_topology:
                return verify_input, parent_list, top_scores_index
            return verify_input

        @contextlib.contextmanager
        def _relay_width(self) -> Any:
            saved = self.topk
            self.topk = self.relay_topk
            try:
                yield
            finally:
                self.topk = saved

        def _draft_extend_for_prefill(self, *args: Any, **kwargs: Any) -> Any:
            with self._relay_width():
                return super()._draft_extend_for_prefill(*args, **kwargs)

        def _draft_extend_for_decode(self, *args: Any, **kwargs: Any) -> Any:
            with self._relay_width():
                return super()._draft_extend_for_decode(*args, **kwargs)

    RelayDraftWorker.__name__ = RelayDraftWorker.__qualname__ = f"AdaTreeRelay{base.__name__}"
    return RelayDraftWorker


_EagleRelayDraftWorker = _relay_draft_worker(EagleDraftWorker)
_StandaloneRelayDraftWorker = _relay_draft_worker(StandaloneDraftWorker)


def _set_spec_leaves(shape: TreeShape) -> None:
    """Point SGLang's resolved spec config at ``shape`` (read by KV sizing and capture).

    Written through the bag's setter rather than ``RuntimeContext.override``, which appends
    to a provenance log on every call: a shape switch per step would grow it without bound.
    """
    bag = get_spec()
    bag._set("speculative_num_steps", shape.steps)
    bag._set("speculative_eagle_topk", shape.topk)
    bag._set("speculative_num_draft_tokens", shape.num_draft_tokens)


class AdaTreeWorkerMixin:
    """The adaptive part, shared by the EAGLE-style and STANDALONE-style workers."""

    _draft_worker: Any
    _target_worker: Any
    topk: int
    speculative_num_steps: int
    speculative_num_draft_tokens: int
    device: Any

    def _adatree_setup(self, relay_class: type) -> None:
        self._config = load_config()
        candidates = self._config.candidate_shapes
        self._envelope = envelope(candidates)
        dw = self._draft_worker
        dw.__class__ = relay_class
        dw.relay_topk = self._envelope.topk
        self._shape_states: dict[TreeShape, ShapeState] = {}
        self._current_shape = TreeShape(
            self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens
        )
        self._on_cpu = torch.device(self.device).type == "cpu"
        self._profiler = StepProfiler()
        self._plain_decode_steps = 0  # steps without speculation served as a plain decode
        # On a CPU, when the last decode step ended (perf_counter seconds); None once any
        # other forward (a prefill) ran since, or before the first (``_decode_step``).
        self._decode_ended: float | None = None
        # Rank 0's controller, telemetry and poller, made once the graphs (and with them the
        # padded batch sizes) exist; None on the other ranks.
        self._loop: ServingLoop | None = None

    # -- runtime states ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _shape_override(self, shape: TreeShape) -> Any:
        dw = self._draft_worker
        saved = (
            self.speculative_num_steps,
            self.speculative_num_draft_tokens,
            self.topk,
            dw.speculative_num_steps,
            dw.speculative_num_draft_tokens,
            dw.topk,
        )
        self._set_worker_shape(shape)
        try:
            yield
        finally:
            (
                self.speculative_num_steps,
                self.speculative_num_draft_tokens,
                self.topk,
                dw.speculative_num_steps,
                dw.speculative_num_draft_tokens,
                dw.topk,
            ) = saved
            _set_spec_leaves(self._current_shape)
            dw._rebuild_topk1_chain_buffers()

    def _set_worker_shape(self, shape: TreeShape) -> None:
        dw = self._draft_worker
        self.speculative_num_steps = dw.speculative_num_steps = shape.steps
        self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = shape.num_draft_tokens
        self.topk = dw.topk = shape.topk
        _set_spec_leaves(shape)
        dw._rebuild_topk1_chain_buffers()

    def _build_shape_state(self, shape: TreeShape) -> ShapeState:
        """Draft backends, verify backend and (on a GPU) graphs for one shape."""
        from sglang.srt.model_executor.runner import DecodeCudaGraphRunner

        dw = self._draft_worker
        tic = time.perf_counter()
        free_before = None if self._on_cpu else get_available_gpu_memory(self.device, self.gpu_id)
        with self._shape_override(shape):
            dw.init_attention_backend()
            dw._capture_cuda_graphs()
            target_runner = self._target_worker.model_runner
            saved_workspace = target_runner.init_new_workspace
            try:
                target_attn_backend = target_runner._get_attention_backend(init_new_workspace=True)
            finally:
                target_runner.init_new_workspace = saved_workspace
            target_graph_runner = None
            if not self._on_cpu and not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
                target_graph_runner = DecodeCudaGraphRunner(
                    target_runner,
                    attn_backend=target_attn_backend,
                    speculative_num_steps=shape.steps,
                    speculative_num_draft_tokens=shape.num_draft_tokens,
                )
            runtime = SpecRuntimeState(
                speculative_num_steps=shape.steps,
                speculative_num_draft_tokens=shape.num_draft_tokens,
                draft_attn_backend=dw.draft_attn_backend,
                cuda_graph_runner=dw.cuda_graph_runner,
                target_attn_backend=target_attn_backend,
                target_graph_runner=target_graph_runner,
                draft_extend_attn_backend=dw.draft_extend_attn_backend,
                cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
            )
            # The CPU verify path reads the tree part of the mask only (n x n per request).
            mask_mode = TreeMaskMode.QLEN_ONLY if self._on_cpu else dw.tree_mask_mode
        memory = ""
        if free_before is not None:
            used = free_before - get_available_gpu_memory(self.device, self.gpu_id)
            memory = f", {used:.2f} GB of graphs"
        logger.info(
            "adatree: built runtime state %s in %.2fs%s", shape, time.perf_counter() - tic, memory
        )
        return ShapeState(shape=shape, runtime=runtime, tree_mask_mode=mask_mode)

    def _apply_shape(self, shape: TreeShape) -> None:
        if shape == self._current_shape:
            return
        state = self._shape_states[shape]
        dw = self._draft_worker
        self._current_shape = shape
        self._set_worker_shape(shape)
        rt = state.runtime
        dw.draft_attn_backend = rt.draft_attn_backend
        dw.draft_runner.draft_attn_backend = rt.draft_attn_backend
        dw.cuda_graph_runner = rt.cuda_graph_runner
        dw.draft_extend_attn_backend = rt.draft_extend_attn_backend
        if rt.draft_extend_attn_backend is not None:
            dw.draft_runner.attn_backend = rt.draft_extend_attn_backend
        dw.cuda_graph_runner_for_draft_extend = rt.cuda_graph_runner_for_draft_extend
        dw.tree_mask_mode = state.tree_mask_mode
        target_runner = self._target_worker.model_runner
        target_runner.attn_backend = rt.target_attn_backend
        target_runner.decode_cuda_graph_runner = rt.target_graph_runner

    def _build_all_states(self) -> None:
        tic = time.perf_counter()
        for shape in self._config.candidate_shapes:
            self._shape_states[shape] = self._build_shape_state(shape)
        logger.info(
            "adatree: %d runtime states ready in %.1fs (envelope %s)",
            len(self._shape_states),
            time.perf_counter() - tic,
            self._envelope,
        )
        first = self._config.candidate_shapes[-1]
        self._current_shape = TreeShape(
            self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens
        )
        self._apply_shape(first)
        self._loop = create_serving_loop(self, self._config, self._graph_padding())

    def _graph_padding(self) -> GraphPadding:
        """The decode batch sizes the target's verify graphs were captured for (every shape's
        runner captures the same sizes); none without graphs."""
        for state in self._shape_states.values():
            runner = state.runtime.target_graph_runner
            if runner is not None:
                return GraphPadding(tuple(sorted(int(b) for b in runner.capture_bs)))
        return NO_GRAPHS

    # -- the decode step --------------------------------------------------------------------

    def _stub_skipped_draft_extend(self, batch: Any, batch_output: Any) -> None:
        # Placeholders for a skipped draft extend, at the relay width every shape slices.
        saved = self.topk
        self.topk = self._envelope.topk
        try:
            super()._stub_skipped_draft_extend(batch, batch_output)
        finally:
            self.topk = saved

    def activate_step_by_batch(self, batch_size: int) -> None:
        # The shape is chosen in forward_batch_generation, with more than the batch size.
        return None

    def on_verify_complete_cpu(
        self, num_correct_drafts_per_req: list[int], batch_size: int = 0
    ) -> None:
        # Steps finish through the result processor hook (finish_launched_step), which has
        # the result and with it the step's own ticket; this call carries neither.
        return None

    def _draft_confidence(self, batch: Any) -> tuple[tuple[float, ...], ...] | None:
        """``[batch]`` the draft's first layer for each request (``core.confidence``): the
        probabilities of the top-k tokens it will propose first, the top-k its extend relayed
        to this step (descending; the first is its confidence). A request whose extend was
        skipped holds a placeholder there, which the controller does not read. On a GPU None:
        reading it before the decision would wait for the step before to finish, which overlap
        scheduling runs beside this one's launch. None on the ranks other than 0 too: only
        rank 0's controller decides."""
        if self._loop is None or not self._on_cpu or not self._config.draft_confidence:
            return None
        topk_p = getattr(batch.spec_info, "topk_p", None)  # [batch, relay top-k], descending
        if (
            topk_p is None
            or topk_p.dim() != 2
            or topk_p.shape[0] != len(batch.reqs)
            or topk_p.shape[1] < 1
        ):
            return None
        return tuple(tuple(row) for row in topk_p.tolist())

    def _decode_step(self, run_step: Any, batch: Any, on_publish: Any = None) -> Any:
        # On a CPU the step's wall time, decision and bookkeeping included, is its cost, and
        # so is the scheduler's host work since the decode step before it when the two ran
        # back to back (``launched.step_period_start``); on a GPU, device events bracket the
        # step's work without a sync.
        self._profiler.begin()
        started = time.perf_counter()
        previous_end, self._decode_ended = self._decode_ended, None
        # Request ids and context lengths are host memory, identical on every rank.
        view = BatchView(
            tuple(r.rid for r in batch.reqs),
            tuple(len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs),
            self._draft_confidence(batch),
        )
        controller = self._loop.controller if self._loop is not None else None
        plan, ticket = plan_on_every_rank(controller, view, get_parallel().tp_group)
        self._apply_shape(plan.shape)
        shape = plan.shape
        start_event = end_event = None
        if not self._on_cpu and ticket is not None:
            device_module = torch.get_device_module(self.device)
            start_event = device_module.Event(enable_timing=True)
            end_event = device_module.Event(enable_timing=True)
            start_event.record()
        dw = self._draft_worker
        dw.last_top_scores_index = dw.last_verify_input = None
        # On a CPU, a step without speculation that skips the draft's extend is the target's
        # plain decode (plain_step). SGLang's own path reads the switch below on every step
        # without speculation: the plan says whether the draft's extend runs (a catch-up step,
        # or skip_idle_draft_extend off) or not.
        if (
            self._on_cpu
            and not shape.speculative
            and plan.skips_draft_extend
            and runs_as_plain_decode(batch, self._target_worker)
        ):
            output = plain_decode_step(
                batch, self._target_worker, self.req_to_token_pool.req_to_token, on_publish
            )
            self._stub_skipped_draft_extend(batch, output)
            self._plain_decode_steps += 1
        else:
            with envs.SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND.override(plan.skips_draft_extend):
                output = run_step()
        if ticket is None:
            return output
        if end_event is not None:
            end_event.record()
        paths = None
        verify_input = dw.last_verify_input
        if shape.speculative and verify_input is not None:
            paths = accepted_path_stats(
                accept_index=output.accept_index,
                accept_token_num=output.accept_lens - 1,
                retrieve_next_token=verify_input.retrieve_next_token,
                retrieve_next_sibling=verify_input.retrieve_next_sibling,
                top_scores_index=dw.last_top_scores_index,
                topk=shape.topk,
            )
            # On a CPU, read now, while the step's tensor machinery is in the caches: the
            # finish runs after the scheduler's result processing.
            paths = paths.as_lists() if self._on_cpu else _to_host(paths)
        finished = None
        if end_event is None:
            finished = time.perf_counter()
            self._decode_ended = finished
            started = step_period_start(started, finished, previous_end)
            if self._profiler.enabled:
                emitted = None  # per request, the batch's mean: accepted draft tokens + 1
                if shape.speculative and getattr(output, "accept_lens", None) is not None:
                    emitted = float(output.accept_lens.float().mean())
                self._profiler.end(
                    str(shape),
                    len(batch.reqs),
                    finished - started,
                    str(plan.source),
                    emitted,
                    sum(view.context_lens),
                )
        launched = LaunchedStep(ticket, started, finished, start_event, end_event, paths)
        setattr(output, LAUNCHED_ATTR, launched)
        return output

    def finish_launched_step(self, launched: LaunchedStep, accepted: list[int]) -> None:
        """Finish a launched step's ticket with its accept counts, now on the CPU."""
        if self._loop is None:
            return
        outcome = StepOutcome(
            measured_ms=launched.measured_ms(),
            accepted_per_request=tuple(int(n) for n in accepted),
            wall_time=time.time(),
            paths=launched.paths,
        )
        self._loop.controller.finish(launched.ticket, outcome)

    def adatree_server_state(self) -> dict[str, Any]:
        """adatree's entries of ``/server_info``'s ``internal_states`` (rank 0's)."""
        if self._loop is None:
            return {}
        return {
            **self._loop.server_state(),
            "adatree_plain_decode_steps": self._plain_decode_steps,
        }


def _to_host(stats: AcceptedPathStats) -> AcceptedPathStats:
    """Queue device-to-host copies into pinned buffers; read after the step's results are."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    return AcceptedPathStats(copy(stats.num_children), copy(stats.accepted_rank))


def _forward(self: Any, base: type, batch: Any, **kwargs: Any) -> Any:
    is_decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
    if not is_decode or batch.forward_mode.is_idle():
        # The next decode step's time does not reach back over this forward.
        self._decode_ended = None
        return base.forward_batch_generation(self, batch, **kwargs)
    return self._decode_step(
        lambda: base.forward_batch_generation(self, batch, **kwargs),
        batch,
        kwargs.get("on_publish"),
    )


class AdaTreeEagleWorker(AdaTreeWorkerMixin, EAGLEWorkerV2):
    """adatree over an EAGLE / EAGLE-3 head that reads the target's hidden states."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        EAGLEWorkerV2.__init__(self, server_args, gpu_id, nccl_port, target_worker)
        self._adatree_setup(_EagleRelayDraftWorker)

    def init_cuda_graphs(self) -> None:
        EAGLEWorkerV2.init_cuda_graphs(self)
        self._build_all_states()

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        return _forward(self, EAGLEWorkerV2, batch, **kwargs)


class AdaTreeStandaloneWorker(AdaTreeWorkerMixin, StandaloneWorkerV2):
    """adatree over a separate small draft model with the target's vocabulary."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        StandaloneWorkerV2.__init__(self, server_args, gpu_id, nccl_port, target_worker)
        self._adatree_setup(_StandaloneRelayDraftWorker)

    def init_cuda_graphs(self) -> None:
        StandaloneWorkerV2.init_cuda_graphs(self)
        self._build_all_states()

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        return _forward(self, StandaloneWorkerV2, batch, **kwargs)
