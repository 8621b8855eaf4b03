"""MODEL_CARD.md rendering: a head trained in two runs on two data sets names every command."""

import dataclasses

from sglang_adatree.models.breakeven import PassTimes, ShapeGain
from sglang_adatree.models.card import render
from sglang_adatree.models.evaluate import Agreement
from sglang_adatree.models.train import TrainConfig


def _run(cfg: TrainConfig, steps: int, seconds: int, best: float, init: dict | None) -> dict:
    sets = [{"name": n, "seed": i, "batch_size": 32 * (i + 1), "max_new_tokens": 256}
            for i, n in enumerate(cfg.data)]  # fmt: skip
    return {
        "config": dataclasses.asdict(cfg),
        "data": {
            "names": list(cfg.data),
            "sequences": 900,
            "answer_tokens": 150_000,
            "hours": 2.5,
            "max_new_tokens": 256,
            "sets": sets,
        },
        "steps": steps,
        "train_seconds": seconds,
        "train_answer_tokens": 147_000,
        "val_answer_tokens": 3_000,
        "best_val_top1": best,
        "init": init,
    }


def test_a_two_run_head_names_both_runs_and_both_data_sets():
    first = _run(TrainConfig(draft="eagle", lr=0.002), 456, 2160, 0.517, None)
    second_cfg = TrainConfig(draft="eagle", data=("train", "train-b"), init_from="/x/run-1")
    second = _run(second_cfg, 700, 3000, 0.6, first)
    results = [Agreement("eval-mtbench", 7000, 0.41, 0.6, (0.41, 0.38), {1: 1.4}, {})]
    times = PassTimes(256, 1, 5, {1: 40.0, 2: 45.0}, {1: 3.0, 2: 3.5}, {1: 8.0, 2: 9.0}, "AMD EPYC")
    gains = [ShapeGain("chain 1", 1, 1, 2, 1.41, 46.0, 1.22, 1.15)]
    text = render("eagle", "EAGLE head", second, results, times, gains, "adatree models ...",
                  {"num_params": 5.3e6, "file_mb": 8.4, "hot_vocab": 16384})  # fmt: skip
    assert "**top-1 agreement: 0.41**" in text
    assert "fp32, 1 threads of an AMD EPYC, after a 256-token context" in text
    assert "1156 optimizer steps in 86 min" in text  # both runs
    assert "Trained in 2 runs" in text and "456 steps, 36 min, best validation 0.517" in text
    assert "--data train train-b --init-from <run 1 weights>" in text and "/x/run-1" not in text
    assert "datagen --name train --seed 0 --batch-size 32" in text
    assert "datagen --name train-b --seed 1 --batch-size 64" in text
