"""Registration and server-argument handling of the ADATREE algorithm (no server started)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import get_spec

from sglang_adatree.sglang import plugin
from sglang_adatree.sglang.serve import build_command
from sglang_adatree.sglang.spec_algo import (
    AdaTreeArgsError,
    AdaTreeSpecAlgo,
    detect_draft_kind,
    validate_server_args,
)


def _checkpoint(path, architectures, vocab_size=49152):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({"architectures": architectures, "vocab_size": vocab_size})
    )
    return path


def _args(tmp_path, **overrides):
    target = _checkpoint(tmp_path / "target", ["LlamaForCausalLM"])
    draft = _checkpoint(tmp_path / "draft", ["LlamaForCausalLM"])
    values = dict(
        model_path=str(target),
        speculative_draft_model_path=str(draft),
        device="cpu",
        attention_backend=None,
        prefill_attention_backend=None,
        decode_attention_backend=None,
        disable_cuda_graph=True,
        page_size=1,
        pp_size=1,
        speculative_num_steps=None,
        speculative_eagle_topk=None,
        speculative_num_draft_tokens=None,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    monkeypatch.setenv("ADATREE_RECORD_STEPS", "false")
    monkeypatch.delenv("ADATREE_CONFIG", raising=False)
    monkeypatch.delenv("ADATREE_CANDIDATE_SHAPES", raising=False)


def test_register_is_idempotent_and_resolves():
    load_plugins()
    plugin.register()
    plugin.register()
    spec = get_spec("ADATREE")
    assert isinstance(spec, AdaTreeSpecAlgo)
    assert SpeculativeAlgorithm.from_string("adatree") is spec
    for method in ("create_future_map", "carries_draft_hidden_states", "need_topk"):
        assert callable(getattr(spec, method))
    assert spec.need_topk() and spec.get_platform_worker_cls() is None


def test_draft_kind_from_checkpoint(tmp_path):
    assert detect_draft_kind(str(_checkpoint(tmp_path / "a", ["LlamaForCausalLM"]))) == "standalone"
    assert detect_draft_kind(str(_checkpoint(tmp_path / "b", ["LlamaForCausalLMEagle"]))) == "eagle"
    assert (
        detect_draft_kind(str(_checkpoint(tmp_path / "c", ["LlamaForCausalLMEagle3"]))) == "eagle3"
    )
    with pytest.raises(AdaTreeArgsError, match=r"no config\.json"):
        detect_draft_kind(str(tmp_path / "missing"))


def test_envelope_sizes_kv(monkeypatch):
    monkeypatch.setenv("ADATREE_CANDIDATE_SHAPES", "0;3,1,4;5,4,8;2,2,6")
    spec = get_spec("ADATREE") or AdaTreeSpecAlgo("ADATREE", lambda a: None)
    # (5, 4, 8) drafts 5 * 4 = 20 slots per request: the KV reservation must cover them.
    assert spec.resolve_max_speculative_num_draft_tokens(None) == 20
    env = spec.envelope()
    assert (env.steps, env.topk, env.num_draft_tokens) == (5, 4, 8)


def test_valid_args_pass(tmp_path):
    validate_server_args(_args(tmp_path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"speculative_adaptive": True}, "--speculative-adaptive is not supported"),
        (
            {"speculative_use_rejection_sampling": True},
            "--speculative-use-rejection-sampling is not supported",
        ),
        ({"enable_multi_layer_eagle": True}, "--enable-multi-layer-eagle"),
        ({"speculative_num_steps": 3}, "--speculative-num-steps is not used"),
        ({"speculative_eagle_topk": 2}, "--speculative-eagle-topk is not used"),
        ({"speculative_num_draft_tokens": 8}, "--speculative-num-draft-tokens is not used"),
        ({"speculative_draft_model_path": None}, "needs --speculative-draft-model-path"),
        ({"attention_backend": "triton"}, "--attention-backend triton"),
        ({"disable_cuda_graph": False}, "pass --disable-cuda-graph"),
        ({"page_size": 16}, "--page-size"),
        ({"pp_size": 2}, "--pp-size"),
    ],
)
def test_rejected_combinations_name_the_flag(tmp_path, overrides, message):
    with pytest.raises(AdaTreeArgsError, match=message):
        validate_server_args(_args(tmp_path, **overrides))


def test_other_vocabulary_refused(tmp_path):
    args = _args(tmp_path)
    _checkpoint(tmp_path / "draft", ["LlamaForCausalLM"], vocab_size=1000)
    with pytest.raises(AdaTreeArgsError, match="vocabulary has 1000 tokens"):
        validate_server_args(args)


def test_bad_config_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ADATREE_CANDIDATE_SHAPES", "3,1,9")
    with pytest.raises(AdaTreeArgsError, match="adatree configuration"):
        validate_server_args(_args(tmp_path))


def test_unopenable_database_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ADATREE_RECORD_STEPS", "true")
    monkeypatch.setenv("ADATREE_DB_URL", f"sqlite:///{tmp_path / 'missing.sqlite'}")
    with pytest.raises(AdaTreeArgsError, match="adatree db upgrade"):
        validate_server_args(_args(tmp_path))


def test_serve_passes_sglang_flags_and_adds_cpu_defaults():
    env: dict[str, str] = {}
    command = build_command(
        ["--model-path", "T", "--device", "cpu", "--db", "sqlite:///x", "--port", "5"], env
    )
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert command[command.index("--speculative-algorithm") + 1] == "adatree"
    assert "--disable-cuda-graph" in command and "--max-total-tokens" in command
    assert env["ADATREE_DB_URL"] == "sqlite:///x"
    assert "--db" not in command
    with pytest.raises(SystemExit, match="--candidate-shapes"):
        build_command(["--candidate-shapes", "3,1,9"], {})
