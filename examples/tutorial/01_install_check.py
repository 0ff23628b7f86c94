"""Step 1: check the install.

Import the SDK, read its version and one-line docstring, and list the installed backends with the
``verl backends`` command (it reads only the plugins' declarations and imports no engine).

    python examples/tutorial/01_install_check.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import verl_core


def main() -> None:
    version = verl_core.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version), version
    summary = (verl_core.__doc__ or "").strip().splitlines()[0]
    assert summary.startswith("verl-core:"), summary
    print(f"verl-core {version}: {summary}")

    assert "transformers" not in sys.modules  # importing the core loads no engine library

    verl = Path(sys.executable).with_name("verl")  # the console script installed beside this Python
    listing = subprocess.run([str(verl), "backends"], capture_output=True, text=True, check=True).stdout
    print(listing)
    names = {line.split()[0] for line in listing.splitlines()[2:] if line and not line[0].isspace()}
    assert {"hf", "megatron", "vllm"} <= names, names
    assert "rollout:" in listing


if __name__ == "__main__":
    main()
