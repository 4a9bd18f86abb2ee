"""llama.cpp as a backend: ``llama-cpp`` and ``llama-cpp-f16-cache``.

Both start :mod:`conformance.adapters.llama_cpp_server` and speak ``PROTOCOL.md`` to it, so
llama.cpp runs in a process of its own: an abort (llama.cpp's answer to a model with no
blocks) fails one test, shows the assertion, and the next test gets a fresh server. See the
server's docstring for how a model is written and run, what the adapter leaves to llama.cpp,
and the precision of each variant. Needs the extra ``llama-cpp`` (``llama-cpp-python`` and
``gguf``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
import sys

from conformance.adapter import BackendLoadError, BackendOptions
from conformance.adapters.subprocess_backend import SubprocessBackend

__all__ = ["LlamaCppBackend", "LlamaCppF16CacheBackend"]


class LlamaCppBackend(SubprocessBackend):
    """llama.cpp with a float32 key/value cache and flash attention off: float32 throughout."""

    kv_cache = "f32"

    def __init__(self, options: BackendOptions | None = None) -> None:
        missing = [name for name in ("llama_cpp", "gguf") if importlib.util.find_spec(name) is None]
        if missing:
            raise BackendLoadError(
                f"the llama-cpp adapter needs {' and '.join(missing)}: "
                "pip install 'decoder-conformance[llama-cpp]' (llama-cpp-python builds from "
                "source, a few minutes)"
            )
        server = [sys.executable, "-m", "conformance.adapters.llama_cpp_server"]
        command = shlex.join([*server, "--kv-cache", self.kv_cache])
        given = options or BackendOptions()
        super().__init__(dataclasses.replace(given, backend_command=command))


class LlamaCppF16CacheBackend(LlamaCppBackend):
    """llama.cpp as it runs by default: keys and values cached in float16, flash attention
    as llama.cpp picks. It declares float32, the precision of the F32 model a user loads."""

    kv_cache = "f16"
