"""The SGLang adapter: the only subpackage that imports SGLang or mutates its state.

SGLang's internal APIs change between releases, so the adapter is pinned to one version and
refuses any other at import time with a message that says what to install.
"""

from __future__ import annotations

REQUIRED_SGLANG_VERSION = "0.5.23"


class SGLangVersionError(ImportError):
    """The installed SGLang is not the release this adapter was written against."""


def check_sglang_version() -> str:
    """Return SGLang's version, or raise ``SGLangVersionError`` naming the required one."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangVersionError(
            f"sglang-adatree needs sglang=={REQUIRED_SGLANG_VERSION}, which is not installed "
            f"({exc}); install it with: pip install sglang=={REQUIRED_SGLANG_VERSION}"
        ) from exc
    version = getattr(sglang, "__version__", "unknown")
    if version != REQUIRED_SGLANG_VERSION:
        raise SGLangVersionError(
            f"sglang-adatree {__package__} supports sglang=={REQUIRED_SGLANG_VERSION} only, "
            f"but sglang=={version} is installed; install the supported release with: "
            f"pip install sglang=={REQUIRED_SGLANG_VERSION}"
        )
    return version


check_sglang_version()
