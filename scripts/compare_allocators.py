"""Paired comparison of the CPU servers' allocators: each configuration twice, on glibc's malloc
(``ADATREE_ALLOCATOR=system``) and on tcmalloc, interleaved prompt by prompt as ``adatree
compare`` runs its configurations (``bench.paired``).

Prints ``adatree compare``'s table (ratios to the first configuration on glibc's malloc) and,
per configuration, the median of the per-prompt TPOT ratios tcmalloc / glibc. Answers must be
identical: the allocator changes no arithmetic.

Usage: ``.venv/bin/python scripts/compare_allocators.py [--policies ar,adatree] [--prompts
mtbench] [--num-requests 16] [--new-tokens 64] [--threads 2]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from sglang_adatree.config import load_config
from sglang_adatree.sglang import allocator
from sglang_adatree.tools.bench import commands
from sglang_adatree.tools.bench.configurations import (
    Configuration,
    ServerSettings,
    parse_configurations,
)
from sglang_adatree.tools.bench.paired import PairedPlan, run_paired, summarize, table_lines
from sglang_adatree.tools.bench.workloads import load_workload


@dataclasses.dataclass(frozen=True)
class OnAllocator(Configuration):
    """A configuration whose server starts on ``allocator_name`` whatever the environment says."""

    allocator_name: str = "system"

    def env(self, settings: ServerSettings) -> dict[str, str]:
        env = super().env(settings)
        env.pop("LD_PRELOAD", None)
        # `adatree serve` reads the choice again and preloads on its own.
        env[allocator.ALLOCATOR_ENV] = self.allocator_name
        if self.allocator_name == "tcmalloc":
            env["LD_PRELOAD"] = str(allocator.find_tcmalloc())
        return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands.add_model_arguments(parser)
    parser.add_argument("--policies", default="ar,adatree")
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if allocator.find_tcmalloc() is None:
        raise SystemExit("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
    models = commands.resolve_models(args)
    base = parse_configurations(
        commands.split_items(args.policies), models.draft_kind, load_config().candidate_shapes
    )
    configs = []
    for config in base:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for name in ("system", "tcmalloc"):
            fields["name"] = f"{config.name}+{name}"
            configs.append(OnAllocator(**fields, allocator_name=name))
    workload = load_workload(args.prompts, args.num_requests, args.seed)
    plan = PairedPlan(
        models=models,
        settings=ServerSettings("cpu", 16384, args.threads),
        configurations=tuple(configs),
        workload=workload,
        new_tokens=args.new_tokens,
        work_dir=Path(tempfile.mkdtemp(prefix="adatree-allocators-")),
    )
    samples = run_paired(plan).samples
    print("\n".join(table_lines(summarize([(c.name, c.name) for c in configs], samples))))
    tpot = {(s.prompt, s.configuration): s.tpot_ms for s in samples if s.error is None}
    for config in base:
        a, b = f"{config.name}+system", f"{config.name}+tcmalloc"
        ratios = [
            tpot[(i, b)] / tpot[(i, a)]
            for i in range(len(workload))
            if tpot.get((i, a)) and tpot.get((i, b))
        ]
        if ratios:
            print(
                f"{b} / {a}: median TPOT ratio {statistics.median(ratios):.3f} over "
                f"{len(ratios)} prompts, faster on {sum(r < 1 for r in ratios)}"
            )
    return 1 if any(s.error for s in samples) else 0


if __name__ == "__main__":
    sys.exit(main())
