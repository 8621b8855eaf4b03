"""Served step times on a model card: `adatree profile` files, the chains' served gains, the
checks before an evaluation, and the card's section."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from sglang_adatree.models.breakeven import PassTimes, ShapeGain, load_served, served_gains
from sglang_adatree.models.card import ServedSection, render
from sglang_adatree.models.evaluate import Agreement, served_profile
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.train import TrainConfig
from sglang_adatree.tools.profile import summarize_profile


def _step(
    shape: str, ms: float, source: str = "warmup", batch: int = 1, emitted: float | None = None
) -> dict:
    return {"shape": shape, "source": source, "emitted": emitted, "batch_size": batch,
            "step_ms": ms, "forward_ms": 0.9 * ms, "forward_calls": 3}  # fmt: skip


def test_a_profile_leaves_out_catch_up_steps_and_larger_batches(tmp_path):
    rows = [
        _step("0,1,1", 90.0), _step("0,1,1", 100.0), _step("0,1,1", 95.0),
        # A catch-up runs no speculation plus the draft's extend: neither plain nor speculative.
        _step("0,1,1", 140.0, "catch-up"), _step("0,1,1", 150.0, "catch-up"),
        _step("1,1,2", 120.0, emitted=2.0), _step("1,1,2", 110.0, emitted=1.0),
        _step("1,1,2", 130.0, batch=2, emitted=1.5),
    ]  # fmt: skip
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_shape = {p.shape: p for p in summarize_profile(path)}
    assert by_shape["0,1,1"].steps == 3 and by_shape["0,1,1"].step_ms == 95.0
    assert by_shape["0,1,1"].emitted is None
    assert by_shape["1,1,2"].steps == 2 and by_shape["1,1,2"].step_ms == 115.0
    assert by_shape["1,1,2"].emitted == 1.5
    # A step right after one of another shape pays for the change: left out.
    changed = [{**_step("0,1,1", 95.0), "previous_shape": "0,1,1"}, _step("0,1,1", 95.0)]
    changed.append({**_step("0,1,1", 300.0), "previous_shape": "3,4,8"})
    path.write_text("".join(json.dumps(r) + "\n" for r in changed))
    (plain,) = summarize_profile(path)
    assert plain.steps == 2 and plain.step_ms == 95.0
    # A step without speculation that ran the draft's extend costs its step less that extend.
    path.write_text(json.dumps({**_step("0,1,1", 110.0), "draft_forward_ms": 12.0}) + "\n")
    assert summarize_profile(path)[0].step_less_draft_ms == 98.0
    # Files from before the source was logged still read.
    path.write_text(json.dumps({k: v for k, v in _step("2,1,3", 80.0).items() if k != "source"}))
    assert summarize_profile(path)[0].step_ms == 80.0


# As served: chain 3 emits less than its held-out agreement predicts.
EMITTED = {"1,1,2": 1.5, "3,1,4": 1.6, "2,2,4": 1.9}


def _profile(tmp_path, draft: str = "/home/x/models/eagle-smollm2", shapes=None) -> str:
    shapes = shapes or {"0,1,1": 100.0, "1,1,2": 125.0, "3,1,4": 160.0, "2,2,4": 150.0}
    data = {
        "target": "/home/x/models/target",
        "draft": draft,
        "prompts": "mtbench",
        "settings": {
            "draft": "eagle",
            "shapes": "0;1,1,2;3,1,4;2,2,4",
            "requests": 12,
            "new_tokens": 64,
            "threads": 2,
            "cpu": "AMD EPYC",
        },
        "shapes": [
            {
                "shape": k,
                "steps": 40,
                "step_ms": v,
                "forward_ms": 0.9 * v,
                "overhead": 1.1,
                "emitted": EMITTED.get(k),
            }
            for k, v in shapes.items()
        ],
    }
    path = tmp_path / "served.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_served_gains_compare_each_chain_with_the_plain_step(tmp_path):
    served = load_served(_profile(tmp_path))
    assert served.plain_ms == 100.0 and served.steps["0,1,1"] == 40
    # The plain step less the draft's extend, where the profile has it.
    data = json.loads(Path(_profile(tmp_path)).read_text())
    data["shapes"][0]["step_less_draft_ms"] = 92.0
    (tmp_path / "less.json").write_text(json.dumps(data))
    assert load_served(tmp_path / "less.json").plain_ms == 92.0
    gains = served_gains(served, [1, 2, 3])
    # Chain 2 was not profiled; the tree 2,2,4 is no chain of the card.
    assert [g.name for g in gains] == ["chain 1", "chain 3"]
    one, three = gains
    assert one.speedup == pytest.approx(1.5 * 100 / 125, abs=1e-3)
    assert one.break_even_emitted == pytest.approx(1.25)
    assert (three.steps, three.topk, three.num_draft_tokens) == (3, 1, 4)
    # The served emitted tokens, not what the agreement would predict.
    assert three.emitted == 1.6
    assert three.speedup == pytest.approx(1.6 * 100 / 160, abs=1e-3)


def test_a_profile_without_plain_steps_or_shapes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without speculation"):
        load_served(_profile(tmp_path, shapes={"1,1,2": 125.0}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not an `adatree profile --out` file"):
        load_served(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_served(tmp_path / "missing.json")
    # A profile from before emitted tokens were logged cannot give served speedups.
    old = json.loads(Path(_profile(tmp_path)).read_text())
    old["shapes"] = [{k: v for k, v in r.items() if k != "emitted"} for r in old["shapes"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="no emitted tokens for 1,1,2"):
        load_served(tmp_path / "old.json")


def _args(**kw) -> argparse.Namespace:
    values = {"draft": "eagle", "card": True, "weights": None, "served": None}
    values.update(kw)
    return argparse.Namespace(**values)


def test_served_profile_is_checked_before_the_evaluation(tmp_path):
    paths = ModelPaths(tmp_path / "home")
    assert served_profile(_args(), paths) is None
    profile = _profile(tmp_path, draft=str(paths.eagle_dir))
    assert served_profile(_args(served=profile), paths).plain_ms == 100.0
    with pytest.raises(ValueError, match="with --card"):
        served_profile(_args(served=profile, card=False), paths)
    with pytest.raises(ValueError, match="not with --weights"):
        served_profile(_args(served=profile, weights="/w"), paths)
    # A profile of the other draft cannot go on this card.
    with pytest.raises(ValueError, match="not the bundled standalone draft"):
        served_profile(_args(served=profile, draft="standalone"), paths)


def test_the_card_quotes_the_served_chains_and_the_profile_command(tmp_path):
    cfg = TrainConfig(draft="eagle")
    training = {
        "config": dataclasses.asdict(cfg),
        "data": {"names": ["train"], "sequences": 900, "answer_tokens": 150_000, "hours": 2.5,
                 "max_new_tokens": 256,
                 "sets": [{"name": "train", "seed": 0, "batch_size": 32,
                           "max_new_tokens": 256}]},
        "steps": 400, "train_seconds": 2000, "train_answer_tokens": 147_000,
        "val_answer_tokens": 3_000, "best_val_top1": 0.6, "init": None,
    }  # fmt: skip
    results = [Agreement("eval-mtbench", 7000, 0.55, 0.75, (0.55, 0.57), {1: 1.55, 3: 2.06}, {})]
    times = PassTimes(256, 2, 5, {1: 60.0, 2: 100.0}, {1: 6.0, 2: 10.0}, {1: 13.0, 2: 27.0})
    gains = [ShapeGain("chain 1", 1, 1, 2, 1.55, 110.0, 0.85, 1.83)]
    served = load_served(_profile(tmp_path))
    section = ServedSection(served, served_gains(served, [1, 3]), "served.json")
    extra = {"num_params": 5.3e6, "file_mb": 8.4, "hot_vocab": 16384}
    text = render("eagle", "EAGLE head", training, results, times, gains, "adatree ...", extra,
                  section)  # fmt: skip
    assert "### Served by SGLang on this CPU" in text
    assert (
        "`adatree profile --draft eagle --shapes '0;1,1,2;3,1,4;2,2,4' --requests 12 "
        "--new-tokens 64 --threads 2 --out served.json`" in text
    )
    assert "steps without speculation (100.0 ms over 40 steps, less the draft's extend" in text
    assert "| chain 1 | 1, 1, 2 | 1.50 | 1.55 | 125.0 | 1.25 | 1.20x |" in text
    assert "| chain 3 | 3, 1, 4 | 1.60 | 2.06 | 160.0 | 1.60 | 1.00x |" in text
    assert "Best served chain: chain 1 at 1.20x" in text
    # Without a profile the card has no served section.
    plain = render("eagle", "EAGLE head", training, results, times, gains, "adatree ...", extra)
    assert "Served by SGLang" not in plain
