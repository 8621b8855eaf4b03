"""One frozen, validated configuration: from a TOML file, the environment and code.

Precedence, lowest first: built-in defaults, the TOML file (``ADATREE_CONFIG`` or an explicit
path), environment variables ``ADATREE_<NAME>`` (upper case), keyword overrides from code or the
command line. Every setting is declared once in ``SETTINGS`` with its default, its allowed range
and a one-line help; ``docs/usage.md`` documents each (a test checks it). A bad value fails at
start-up with a message naming the key and the allowed range.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_adatree.core.shapes import (
    DEFAULT_CANDIDATES,
    ShapeError,
    TreeShape,
    parse_candidates,
    validate_candidates,
)

ENV_PREFIX = "ADATREE_"
POLICY_NAMES = ("adatree", "turbospec", "sglang-adaptive")
CONFIG_ENV = "ADATREE_CONFIG"
HOME_ENV = "ADATREE_HOME"
DB_URL_ENV = "ADATREE_DB_URL"


class ConfigError(ValueError):
    """A configuration value outside its allowed range; the message names the key."""


@dataclass(frozen=True)
class Setting:
    """One documented setting: name, default, allowed range (in words) and help."""

    name: str
    default: Any
    allowed: str
    help: str
    convert: Callable[[Any], Any]
    check: Callable[[Any], bool] = lambda v: True


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("a bool is not a number")
    return float(v)


def _int(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("not an integer")
    return int(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _shapes(v: Any) -> tuple[TreeShape, ...]:
    if isinstance(v, str):
        return parse_candidates(v)
    items = []
    for item in v:
        if isinstance(item, TreeShape):
            items.append(item)
        elif isinstance(item, str):
            items.append(TreeShape.parse(item))
        else:
            items.append(TreeShape(*(int(x) for x in item)))
    return validate_candidates(items)


def _optional_str(v: Any) -> str | None:
    if v is None:
        return None
    text = str(v).strip()
    return text or None


def _default_home() -> str:
    return str(Path("~/.cache/sglang-adatree").expanduser())


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "candidate_shapes",
        DEFAULT_CANDIDATES,
        "'S,K,N' shapes, ';'-separated",
        "shapes the policy chooses from; '0' is no speculation",
        _shapes,
    ),
    Setting(
        "policy",
        "adatree",
        "adatree, turbospec, sglang-adaptive",
        "the decision rule: adatree's goodput policy, or a baseline re-implemented for comparison",
        str,
        lambda v: v in POLICY_NAMES,
    ),
    Setting(
        "min_gain",
        0.03,
        "[0, 1]",
        "hysteresis: leave the current shape only for this relative goodput gain",
        _float,
        lambda v: 0.0 <= v <= 1.0,
    ),
    Setting(
        "no_spec_margin",
        0.05,
        "[0, 1]",
        "speculation must beat no speculation by this relative margin",
        _float,
        lambda v: 0.0 <= v <= 1.0,
    ),
    Setting(
        "new_batch_steps",
        5,
        "[0, 1000]",
        "a new batch's first steps (none of its requests ran the step before) speculate if "
        "speculating is predicted to pay at all, free of no_spec_margin (0: never)",
        _int,
        lambda v: 0 <= v <= 1000,
    ),
    Setting(
        "new_batch_max_loss",
        0.0,
        "[0, 0.5]",
        "in those steps speculation runs unless predicted to lose more than this relative "
        "goodput against no speculation",
        _float,
        lambda v: 0.0 <= v <= 0.5,
    ),
    Setting(
        "new_batch_probe",
        True,
        "true / false",
        "a new batch whose speculation is predicted to lose still speculates when what its "
        "first steps would tell about its requests (the spread between the requests before) "
        "is worth the loss",
        _bool,
    ),
    Setting(
        "explore_fraction",
        0.02,
        "[0, 0.5]",
        "share of decode steps that measure a rarely chosen shape",
        _float,
        lambda v: 0.0 <= v <= 0.5,
    ),
    Setting(
        "explore_max_loss",
        0.3,
        "[0, 1]",
        "exploration runs only shapes predicted within this relative goodput loss of the best",
        _float,
        lambda v: 0.0 <= v <= 1.0,
    ),
    Setting(
        "explore_optimism",
        1.0,
        "[0, 5]",
        "an exploring step runs the eligible shape with the best goodput when each shape's "
        "price is lowered by this many standard deviations of how far it may be off against "
        "the chosen shape's (0: the runner-up by the estimates)",
        _float,
        lambda v: 0.0 <= v <= 5.0,
    ),
    Setting(
        "explore_decline_budget",
        0.05,
        "[0, 1]",
        "an exploring step taken where no speculation was chosen runs on each scheduled step "
        "while such steps have lost at most this share of no speculation's goodput, measured; "
        "where they lost more, on this share over their loss of the scheduled steps (1: on "
        "every one)",
        _float,
        lambda v: 0.0 <= v <= 1.0,
    ),
    Setting(
        "explore_seed",
        0,
        ">= 0",
        "seed of the deterministic exploration schedule",
        _int,
        lambda v: v >= 0,
    ),
    Setting(
        "warmup_steps",
        32,
        "[0, 100000]",
        "requests' decode steps (a batch of B counts B; at least one round of the candidates) "
        "that cycle through the candidates before the model decides (none with a "
        "step_time_profile)",
        _int,
        lambda v: 0 <= v <= 100_000,
    ),
    Setting(
        "warmup_run_steps",
        1,
        "[1, 1000]",
        "consecutive steps the warm-up gives each candidate before the next (1: one step each "
        "in turn); a round of the candidates is this many steps of each",
        _int,
        lambda v: 1 <= v <= 1000,
    ),
    Setting(
        "acceptance_decay",
        0.005,
        "(0, 1]",
        "weight of the newest verify step in the online acceptance estimates",
        _float,
        lambda v: 0.0 < v <= 1.0,
    ),
    Setting(
        "acceptance_prior",
        0.6,
        "(0, 1)",
        "prior probability that the top-ranked draft token is accepted",
        _float,
        lambda v: 0.0 < v < 1.0,
    ),
    Setting(
        "acceptance_prior_weight",
        20.0,
        "[0, 1e6]",
        "pseudo-observations behind the acceptance prior at start (they decay like the counts)",
        _float,
        lambda v: 0.0 <= v <= 1e6,
    ),
    Setting(
        "shape_factor_prior_weight",
        60.0,
        "[0, 1e6]",
        "pseudo-requests at factor 1 behind each shape's correction of the positional "
        "acceptance model",
        _float,
        lambda v: 0.0 <= v <= 1e6,
    ),
    Setting(
        "request_prior_steps",
        8.0,
        "[0, 1e6]",
        "pseudo-steps at the estimator's acceptance behind each request's own acceptance "
        "factor (large: every request is the estimator's)",
        _float,
        lambda v: 0.0 <= v <= 1e6,
    ),
    Setting(
        "request_keep",
        0.8,
        "[0, 1)",
        "weight a request's older verify steps keep per step in its acceptance factor (a step "
        "without speculation ages them too)",
        _float,
        lambda v: 0.0 <= v < 1.0,
    ),
    Setting(
        "draft_confidence",
        True,
        "true / false",
        "scale each request's expected acceptance by the draft's confidence in its next token, "
        "where the engine hands it over (core.confidence)",
        _bool,
    ),
    Setting(
        "draft_first_layer",
        False,
        "true / false",
        "price each request under each shape with its tree's first-layer branches weighed by "
        "the draft's top-k probabilities at its next token (its first layer), where the engine "
        "hands it over and draft_confidence is on (core.confidence)",
        _bool,
    ),
    Setting(
        "price_catch_up",
        True,
        "true / false",
        "a decision to stop speculating for the draft's confidence in this step's token alone "
        "is charged the catch-up step it puts before the next speculative step",
        _bool,
    ),
    Setting(
        "residual_decay",
        0.05,
        "(0, 1]",
        "weight of the newest measured step time in the online cost correction",
        _float,
        lambda v: 0.0 < v <= 1.0,
    ),
    Setting(
        "step_time_profile",
        None,
        "a profile JSON, or empty",
        "price the candidates by this deployment's step-time profile (`adatree profile "
        "--shapes candidates --profile-out FILE`) instead of an analytic model refitted on the "
        "server's own steps",
        _optional_str,
    ),
    Setting(
        "skip_idle_draft_extend",
        True,
        "true / false",
        "steps without speculation skip the draft's extend (no cost over plain decoding); the "
        "first speculative step after them runs as a catch-up step (no speculation, with the "
        "extend), and the draft's cache keeps gaps where it skipped",
        _bool,
    ),
    Setting(
        "db_url",
        None,
        "a SQLAlchemy URL, or empty for SQLite under home",
        "telemetry database; also ADATREE_DB_URL or --db",
        _optional_str,
    ),
    Setting(
        "home", None, "a directory", "data directory (models, SQLite, artifacts)", _optional_str
    ),
    Setting("record_steps", True, "true / false", "write one telemetry row per decode step", _bool),
    Setting(
        "control_poll_s",
        1.0,
        "[0.1, 60]",
        "how often the server reads pins and policy versions from the store",
        _float,
        lambda v: 0.1 <= v <= 60.0,
    ),
    Setting(
        "telemetry_queue_size",
        65536,
        "[16, 10000000]",
        "bounded queue between the decode loop and the telemetry writer",
        _int,
        lambda v: 16 <= v <= 10_000_000,
    ),
    Setting(
        "telemetry_batch_size",
        2048,
        "[1, 1000000]",
        "rows per insert transaction",
        _int,
        lambda v: 1 <= v <= 1_000_000,
    ),
    Setting(
        "telemetry_flush_s",
        0.5,
        "[0.01, 60]",
        "longest time a recorded row waits before it is written",
        _float,
        lambda v: 0.01 <= v <= 60.0,
    ),
    Setting(
        "retention_hours",
        24.0,
        "[0.01, 1e6]",
        "per-step rows older than this are rolled up into per-minute aggregates",
        _float,
        lambda v: 0.01 <= v <= 1e6,
    ),
)

SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


# Each setting's default, written once (in SETTINGS); the dataclass below reads it from here.
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


@dataclass(frozen=True)
class AdaTreeConfig:
    """The effective configuration; build it with ``load_config``, never mutate it. One field
    per entry of ``SETTINGS``, in that order (a test checks it)."""

    candidate_shapes: tuple[TreeShape, ...] = DEFAULTS["candidate_shapes"]
    policy: str = DEFAULTS["policy"]
    min_gain: float = DEFAULTS["min_gain"]
    no_spec_margin: float = DEFAULTS["no_spec_margin"]
    new_batch_steps: int = DEFAULTS["new_batch_steps"]
    new_batch_max_loss: float = DEFAULTS["new_batch_max_loss"]
    new_batch_probe: bool = DEFAULTS["new_batch_probe"]
    explore_fraction: float = DEFAULTS["explore_fraction"]
    explore_max_loss: float = DEFAULTS["explore_max_loss"]
    explore_optimism: float = DEFAULTS["explore_optimism"]
    explore_decline_budget: float = DEFAULTS["explore_decline_budget"]
    explore_seed: int = DEFAULTS["explore_seed"]
    warmup_steps: int = DEFAULTS["warmup_steps"]
    warmup_run_steps: int = DEFAULTS["warmup_run_steps"]
    acceptance_decay: float = DEFAULTS["acceptance_decay"]
    acceptance_prior: float = DEFAULTS["acceptance_prior"]
    acceptance_prior_weight: float = DEFAULTS["acceptance_prior_weight"]
    shape_factor_prior_weight: float = DEFAULTS["shape_factor_prior_weight"]
    request_prior_steps: float = DEFAULTS["request_prior_steps"]
    request_keep: float = DEFAULTS["request_keep"]
    draft_confidence: bool = DEFAULTS["draft_confidence"]
    draft_first_layer: bool = DEFAULTS["draft_first_layer"]
    price_catch_up: bool = DEFAULTS["price_catch_up"]
    residual_decay: float = DEFAULTS["residual_decay"]
    step_time_profile: str | None = DEFAULTS["step_time_profile"]
    skip_idle_draft_extend: bool = DEFAULTS["skip_idle_draft_extend"]
    db_url: str | None = DEFAULTS["db_url"]
    home: str | None = DEFAULTS["home"]
    record_steps: bool = DEFAULTS["record_steps"]
    control_poll_s: float = DEFAULTS["control_poll_s"]
    telemetry_queue_size: int = DEFAULTS["telemetry_queue_size"]
    telemetry_batch_size: int = DEFAULTS["telemetry_batch_size"]
    telemetry_flush_s: float = DEFAULTS["telemetry_flush_s"]
    retention_hours: float = DEFAULTS["retention_hours"]

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            _validate(setting, getattr(self, setting.name), source="config")

    @property
    def home_dir(self) -> Path:
        """The data directory, created on first use by whoever writes there."""
        return Path(self.home or _default_home()).expanduser()

    @property
    def resolved_db_url(self) -> str:
        """The telemetry URL: ``db_url`` or SQLite ``adatree.sqlite`` in the data directory."""
        if self.db_url:
            return self.db_url
        return f"sqlite:///{self.home_dir / 'adatree.sqlite'}"

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready values (shapes as 'S,K,N' strings) for the runs table."""
        out: dict[str, Any] = {}
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if setting.name == "candidate_shapes":
                value = [str(s) for s in value]
            out[setting.name] = value
        return out

    def replace(self, **changes: Any) -> AdaTreeConfig:
        """A copy with some settings changed, converted and validated like any other source."""
        converted = {k: convert_setting(k, v, source="code") for k, v in changes.items()}
        return dataclasses.replace(self, **converted)


def _validate(setting: Setting, value: Any, source: str) -> None:
    if value is None and setting.default is None:
        return
    if not setting.check(value):
        raise ConfigError(f"{setting.name} = {value!r} (from {source}): allowed {setting.allowed}")


def convert_setting(name: str, value: Any, source: str) -> Any:
    """``value`` as setting ``name`` holds it; ``ConfigError`` naming ``source`` for an unknown
    name or a value outside the allowed range."""
    setting = SETTINGS_BY_NAME.get(name)
    if setting is None:
        known = ", ".join(sorted(SETTINGS_BY_NAME))
        raise ConfigError(f"unknown setting {name!r} (from {source}); known: {known}")
    try:
        converted = setting.convert(value) if value is not None else None
    except (ShapeError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{name} = {value!r} (from {source}): {exc}; allowed {setting.allowed}"
        ) from exc
    _validate(setting, converted, source)
    return converted


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> AdaTreeConfig:
    """Defaults < TOML file (``path`` or ``$ADATREE_CONFIG``) < ``ADATREE_*`` env < overrides.

    The TOML file holds the settings at top level or under an ``[adatree]`` table.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    file_path = path if path is not None else env.get(CONFIG_ENV)
    if file_path:
        p = Path(file_path).expanduser()
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(p)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
        data = data.get("adatree", data)
        for key, value in data.items():
            values[key] = convert_setting(key, value, source=str(p))
    for setting in SETTINGS:
        key = ENV_PREFIX + setting.name.upper()
        if key in env and key != CONFIG_ENV:
            values[setting.name] = convert_setting(setting.name, env[key], source=key)
    for key, value in overrides.items():
        if value is not None:
            values[key] = convert_setting(key, value, source="code")
    return AdaTreeConfig(**values)
