"""The configurations compared, each launched the way a user would run it.

One configuration is one SGLang server with the same target, draft and CPU settings as every
other; only the speculative flags (and, under ``adatree serve``, the decision rule) differ:

* ``ar``: no speculation, ``python -m sglang.launch_server`` without speculative flags.
* ``static:S,K,N``: SGLang's own algorithm for the draft kind (STANDALONE for a small draft
  model, EAGLE / EAGLE3 for a head) with ``--speculative-num-steps S --speculative-eagle-topk K
  --speculative-num-draft-tokens N``. ``static:default`` passes no shape flags: SGLang's
  auto-chosen default (STANDALONE 3,1,4; EAGLE with a Llama target 5,4,8).
* ``sglang-adaptive``: SGLang's built-in ``--speculative-adaptive`` where the draft kind allows
  it (an EAGLE / EAGLE3 head, topk 1); otherwise SGLang's rule re-implemented by sglang-adatree
  (``ADATREE_POLICY=sglang-adaptive`` under ``adatree serve``, chain candidates only).
* ``turbospec``: TurboSpec's rule re-implemented by sglang-adatree
  (``ADATREE_POLICY=turbospec`` under ``adatree serve``, chain candidates only).
* ``adatree``: ``adatree serve`` with the candidate shapes given (default: the package's set).
* ``adatree:SHAPES``: ``adatree serve`` with exactly ``SHAPES`` (``;``-separated) as its
  candidates (at least one speculative, as for any candidate set); a single shape runs on
  every step (``adatree:2,2,4`` against ``static:2,2,4``: adatree's machinery against
  SGLang's for the same shape).
* ``adatree+profile``: ``adatree serve`` with the candidate shapes given, priced by a step-time
  profile of the deployment (``--step-time-profile FILE``, as ``adatree profile --shapes
  candidates --profile-out FILE`` writes it) instead of a model refitted on its own steps.
* ``adatree@S,K,N``: ``adatree serve`` with the candidate shapes given, pinned to ``S,K,N`` for
  every batch size as an operator pins one from the dashboard (a pin in the server's own
  telemetry database, ``bench.databases``): adatree's step for that shape inside its whole
  candidate set, ``adatree@0`` its step without speculation (a candidate set must speculate,
  so no speculation alone can only be pinned).
* any of the ``adatree serve`` configurations above followed by ``/KEY=VALUE`` settings
  (``adatree+profile/new_batch_steps=1/min_gain=0.05``): the server runs with those settings
  (``ADATREE_KEY=VALUE``, validated here as the server would), so two values of a setting can
  be served side by side. Settings the configuration sets itself (its candidates, decision
  rule, profile, database) are refused.

On ``--device cpu`` every server gets the flags SGLang's speculative path needs there
(``--disable-cuda-graph --sleep-on-idle --attention-backend adatree_cpu --sampling-backend
pytorch --dtype float32``) and the same ``--max-total-tokens``: the adatree plug-in's CPU
backend serves non-speculative decoding too, so every configuration runs the same attention
code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_adatree.config import ENV_PREFIX, convert_setting
from sglang_adatree.core.baselines import LABEL as REIMPLEMENTED
from sglang_adatree.core.shapes import NO_SPEC, TreeShape, parse_candidates
from sglang_adatree.drafts import draft_kind_of
from sglang_adatree.models.paths import TOKEN_MAP_FILE
from sglang_adatree.sglang import allocator

ADAPTIVE_POLICIES = ("adatree", "turbospec", "sglang-adaptive")
# STANDALONE's and EAGLE's (Llama target) shapes when no shape flag is given.
SGLANG_DEFAULT_SHAPES = {"standalone": TreeShape(3, 1, 4), "eagle": TreeShape(5, 4, 8)}
SGLANG_ALGORITHMS = {"standalone": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}
# What every CPU server gets besides --device cpu (`adatree serve` adds the same on a CPU).
# ``adatree compare --instances``: the k-th server of a configuration is named ``NAME#k``.
INSTANCE_MARK = "#"
# ``adatree+profile/KEY=VALUE``: a setting of the configuration's server.
SETTING_MARK = "/"
# What a configuration sets on its server itself (``Configuration.command`` and ``env``).
OWN_SETTINGS = frozenset(
    {"candidate_shapes", "policy", "step_time_profile", "db_url", "home", "record_steps"}
)
CPU_SERVER_FLAGS = ("--disable-cuda-graph", "--sleep-on-idle", "--dtype", "float32")
# The static sweep: chains and trees around SGLang's defaults, all inside the default envelope.
DEFAULT_SWEEP: tuple[TreeShape, ...] = (
    TreeShape(1, 1, 2),
    TreeShape(3, 1, 4),
    TreeShape(5, 1, 6),
    TreeShape(2, 2, 4),
    TreeShape(3, 2, 6),
    TreeShape(5, 4, 8),
)


def detect_draft_kind(draft: Path) -> str:
    """``'eagle3'``, ``'eagle'`` or ``'standalone'`` from the draft's ``config.json``
    (``drafts.draft_kind_of``, the rule the SGLang adapter uses too)."""
    return draft_kind_of(json.loads((draft / "config.json").read_text()))


@dataclass(frozen=True)
class Models:
    """The pair every configuration serves, and how SGLang should treat the draft."""

    target: Path
    draft: Path
    draft_kind: str  # "standalone" | "eagle" | "eagle3" (spec_algo.detect_draft_kind)


@dataclass(frozen=True)
class ServerSettings:
    """What every server shares: device, KV pool size, threads."""

    device: str = "cpu"
    max_total_tokens: int = 16384
    threads: int = 2
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Configuration:
    """One policy as one server: its name in reports, its label, its launch recipe."""

    name: str  # "ar", "static:3,1,4", "static:default", "sglang-adaptive", ...
    kind: str  # "ar" | "static" | "builtin-adaptive" | "adatree-serve"
    shape: TreeShape | None = None  # static shape; None for static:default and adaptive ones
    policy: str | None = None  # ADATREE_POLICY under adatree serve
    candidate_shapes: tuple[TreeShape, ...] = ()  # under adatree serve
    pin: TreeShape | None = None  # under adatree serve: pinned for every batch size
    step_time_profile: str | None = None  # under adatree serve: the profile it prices by
    settings: tuple[tuple[str, str], ...] = ()  # under adatree serve: (name, value) overrides

    @property
    def is_static(self) -> bool:
        return self.kind == "static"

    @property
    def decides(self) -> bool:
        """Whether its decision rule chooses among shapes while it serves (warm-up matters)."""
        return self.kind == "adatree-serve" and self.pin is None and len(self.candidate_shapes) > 1

    @property
    def settings_text(self) -> str:
        """Its settings as its name carries them: ``/KEY=VALUE`` each, or empty."""
        return "".join(f"{SETTING_MARK}{k}={v}" for k, v in self.settings)

    @property
    def slug(self) -> str:
        """The name as a file-name part."""
        slug = self.name.replace(":", "_").replace(";", "+").replace(INSTANCE_MARK, "-")
        return slug.replace(SETTING_MARK, "+").replace("=", "-")

    def label(self, models: Models) -> str:
        """The name with how it was run: shows which baselines are re-implementations."""
        if self.settings:
            # The name without its settings, an instance mark (``NAME#k``) kept.
            plain = dataclasses.replace(
                self, name=self.name.replace(self.settings_text, "", 1), settings=()
            )
            given = ", ".join(f"{k}={v}" for k, v in self.settings)
            return f"{plain.label(models)} with {given}"
        if self.kind == "ar":
            return "ar (no speculation)"
        algorithm = SGLANG_ALGORITHMS[models.draft_kind]
        if self.kind == "static":
            shape = self.shape or SGLANG_DEFAULT_SHAPES.get(models.draft_kind)
            return f"{self.name} (SGLang {algorithm}, shape {shape})"
        if self.kind == "builtin-adaptive":
            return f"sglang-adaptive (SGLang {algorithm} --speculative-adaptive)"
        if self.policy == "adatree":
            if self.pin is not None:
                return f"{self.name} (adatree serve, pinned to {self.pin})"
            if self.name == "adatree":
                return "adatree"
            if self.step_time_profile is not None:
                return f"{self.name} (adatree serve, step times from {self.step_time_profile})"
            shapes = "; ".join(str(s) for s in self.candidate_shapes)
            return f"{self.name} (adatree serve, candidates {shapes})"
        return f"{self.policy} ({REIMPLEMENTED})"

    def command(
        self, models: Models, settings: ServerSettings, port: int, db_url: str | None
    ) -> list[str]:
        """The server's command line."""
        common = [
            "--model-path",
            str(models.target),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--device",
            settings.device,
            "--max-total-tokens",
            str(settings.max_total_tokens),
            "--log-level",
            "warning",
        ]
        if settings.device == "cpu":
            # What `adatree serve` adds on a CPU, given to every server alike.
            common += CPU_SERVER_FLAGS
        draft = ["--speculative-draft-model-path", str(models.draft)]
        token_map = models.draft / TOKEN_MAP_FILE
        if models.draft_kind == "eagle" and token_map.is_file():
            draft += ["--speculative-token-map", str(token_map)]
        if self.kind == "adatree-serve":
            shapes = ";".join(str(s) for s in self.candidate_shapes)
            serve = [str(Path(sys.executable).parent / "adatree"), "serve"]
            if db_url:
                serve += ["--db", db_url]
            if self.step_time_profile is not None:
                serve += ["--step-time-profile", self.step_time_profile]
            return [*serve, "--candidate-shapes", shapes, *common, *draft, *settings.extra_args]
        launch = [sys.executable, "-m", "sglang.launch_server", *common]
        if settings.device == "cpu":
            launch += ["--attention-backend", "adatree_cpu", "--sampling-backend", "pytorch"]
        if self.kind == "ar":
            return [*launch, *settings.extra_args]
        algorithm = SGLANG_ALGORITHMS[models.draft_kind]
        spec = ["--speculative-algorithm", algorithm, *draft]
        if self.kind == "builtin-adaptive":
            spec += ["--speculative-adaptive", "--speculative-eagle-topk", "1"]
        elif self.shape is not None:
            s = self.shape
            spec += [
                "--speculative-num-steps",
                str(s.steps),
                "--speculative-eagle-topk",
                str(s.topk),
                "--speculative-num-draft-tokens",
                str(s.num_draft_tokens),
            ]
        return [*launch, *spec, *settings.extra_args]

    def env(self, settings: ServerSettings) -> dict[str, str]:
        """Environment of the server: same threads and, on a CPU, the same allocator for all
        (``adatree serve``'s: ``sglang.allocator``), the decision rule for ours. Raises
        ``ValueError`` for a bad ``ADATREE_ALLOCATOR``."""
        env = {"OMP_NUM_THREADS": str(settings.threads), "TOKENIZERS_PARALLELISM": "false"}
        if settings.device == "cpu" and (preload := allocator.preload(os.environ)) is not None:
            env["LD_PRELOAD"] = preload
        if self.kind == "adatree-serve":
            env["ADATREE_POLICY"] = str(self.policy)
            env["ADATREE_RECORD_STEPS"] = "true"
            env.update((ENV_PREFIX + k.upper(), v) for k, v in self.settings)
        return env


def with_instances(configs: Sequence[Configuration], instances: int) -> list[Configuration]:
    """Each configuration served by ``instances`` servers: the first under its name, the k-th
    as ``NAME#k``, next to it. Two servers of one configuration differ in speed by a few
    percent, so one server each cannot tell configurations apart by less than that; several
    show the spread. ``ValueError`` for fewer than one."""
    if instances < 1:
        raise ValueError(f"instances must be at least 1, got {instances}")
    return [
        config if k == 1 else dataclasses.replace(config, name=f"{config.name}{INSTANCE_MARK}{k}")
        for config in configs
        for k in range(1, instances + 1)
    ]


def instance_base(name: str) -> str:
    """The configuration a server's name belongs to: ``NAME#k`` -> ``NAME``."""
    return name.split(INSTANCE_MARK, 1)[0]


def chains_of(candidates: Sequence[TreeShape]) -> tuple[TreeShape, ...]:
    """No speculation and the chains of a candidate set: what the chain baselines choose from."""
    return tuple(s for s in candidates if s == NO_SPEC or s.is_chain)


def parse_settings(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``NAME/KEY=VALUE/...`` -> (``NAME``, its settings); ``ValueError`` for one that is not
    ``KEY=VALUE``, not a setting, outside its range or set by the configuration itself."""
    name, *items = text.split(SETTING_MARK)
    settings: dict[str, str] = {}
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"{text}: {item!r} is not KEY=VALUE")
        if key in OWN_SETTINGS:
            raise ValueError(f"{text}: {key} is set by the configuration itself")
        convert_setting(key, value, source=text)  # a ConfigError is a ValueError
        settings[key] = value
    return name, tuple(settings.items())


def parse_configuration(
    text: str,
    draft_kind: str,
    candidates: Sequence[TreeShape],
    step_time_profile: str | None = None,
) -> list[Configuration]:
    """One ``--policies`` item; ``static:sweep`` expands to ``DEFAULT_SWEEP``;
    ``adatree+profile`` needs ``step_time_profile``; ``/KEY=VALUE`` settings apply to
    ``adatree serve`` configurations only."""
    name, settings = parse_settings(text.strip().lower())
    configs = _parse_named(name, draft_kind, candidates, step_time_profile)
    if not settings:
        return configs
    out = []
    for config in configs:
        if config.kind != "adatree-serve":
            raise ValueError(f"{text}: settings apply to adatree serve configurations only")
        with_settings = dataclasses.replace(config, settings=settings)
        out.append(
            dataclasses.replace(with_settings, name=config.name + with_settings.settings_text)
        )
    return out


def _parse_named(
    name: str,
    draft_kind: str,
    candidates: Sequence[TreeShape],
    step_time_profile: str | None,
) -> list[Configuration]:
    """The configurations a ``--policies`` name stands for, settings aside."""
    if name == "ar":
        return [Configuration("ar", "ar")]
    if name == "static:default":
        return [Configuration("static:default", "static")]
    if name == "static:sweep":
        return [Configuration(f"static:{s}", "static", shape=s) for s in DEFAULT_SWEEP]
    if name.startswith("static:"):
        shape = TreeShape.parse(name.split(":", 1)[1])
        if not shape.speculative:
            raise ValueError(f"{name}: a static shape must speculate (use 'ar' for none)")
        return [Configuration(f"static:{shape}", "static", shape=shape)]
    if name == "sglang-adaptive" and draft_kind in ("eagle", "eagle3"):
        return [Configuration("sglang-adaptive", "builtin-adaptive")]
    if name in ("sglang-adaptive", "turbospec"):
        chains = chains_of(candidates)
        return [Configuration(name, "adatree-serve", policy=name, candidate_shapes=chains)]
    if name == "adatree":
        return [
            Configuration(
                "adatree", "adatree-serve", policy="adatree", candidate_shapes=tuple(candidates)
            )
        ]
    if name == "adatree+profile":
        if step_time_profile is None:
            raise ValueError(
                f"{name}: name the profile with --step-time-profile FILE (`adatree profile "
                "--shapes candidates --profile-out FILE` writes one)"
            )
        return [
            Configuration(
                "adatree+profile",
                "adatree-serve",
                policy="adatree",
                candidate_shapes=tuple(candidates),
                step_time_profile=step_time_profile,
            )
        ]
    if name.startswith("adatree@"):
        pin = TreeShape.parse(name.split("@", 1)[1])
        if pin not in candidates:
            allowed = " ".join(str(s) for s in candidates)
            raise ValueError(f"{name}: {pin} is not a candidate shape; pin one of {allowed}")
        return [
            Configuration(
                f"adatree@{pin}",
                "adatree-serve",
                policy="adatree",
                candidate_shapes=tuple(candidates),
                pin=pin,
            )
        ]
    if name.startswith("adatree:"):
        own = parse_candidates(name.split(":", 1)[1])
        label = ";".join(str(s) for s in own)
        return [
            Configuration(
                f"adatree:{label}", "adatree-serve", policy="adatree", candidate_shapes=own
            )
        ]
    raise ValueError(
        f"unknown policy {name!r}; use ar, static:S,K,N, static:default, static:sweep, "
        "sglang-adaptive, turbospec, adatree, adatree:SHAPES, adatree@S,K,N or adatree+profile, "
        "the adatree serve ones optionally followed by /KEY=VALUE settings"
    )


def parse_configurations(
    items: Sequence[str],
    draft_kind: str,
    candidates: str | Sequence[TreeShape],
    step_time_profile: str | None = None,
) -> list[Configuration]:
    """Every configuration of ``--policies``, de-duplicated, in the order given."""
    shapes = parse_candidates(candidates) if isinstance(candidates, str) else tuple(candidates)
    out: list[Configuration] = []
    for item in items:
        for config in parse_configuration(item, draft_kind, shapes, step_time_profile):
            if config.name not in {c.name for c in out}:
                out.append(config)
    # static:default runs SGLang's default shape: an explicit copy of it would only repeat it.
    if any(c.name == "static:default" for c in out):
        default = SGLANG_DEFAULT_SHAPES.get("eagle" if draft_kind == "eagle3" else draft_kind)
        out = [c for c in out if not (c.kind == "static" and c.shape == default)]
    return out
