"""Fails when a module includes a Trestle header from a module it does not declare (its CMake target's links).

Arrows go down only: operations (convert/) -> sources -> bridge -> formats -> ckpt, the layout description
(parallel/layout) below the bridge, and ckpt depending on nothing else of Trestle. The table mirrors each folder's
target_link_libraries; a new dependency must be added to both, on purpose.
"""
import pathlib
import re
import sys

ALLOWED = {
    "ckpt": {"ckpt"},
    "parallel/layout": {"ckpt", "parallel/layout"},
    "parallel": {"ckpt", "parallel/layout", "parallel"},
    "convert/formats/torch": {"ckpt", "convert/formats/torch"},
    "convert/formats/safetensors": {"ckpt", "convert/formats/safetensors"},
    "convert/bridge": {"ckpt", "parallel/layout", "convert/formats/torch", "convert/bridge"},
    "convert/sources": {"ckpt", "parallel/layout", "convert/formats/torch", "convert/formats/safetensors",
                        "convert/bridge", "convert/sources"},
    "convert": {"ckpt", "parallel/layout", "convert/formats/torch", "convert/formats/safetensors", "convert/bridge",
                "convert/sources", "convert"},
    "train/data": {"ckpt", "train/data"},
    "train/optim": {"ckpt", "kernels", "train/optim"},
    "train/log": {"ckpt", "train/log"},
    "kernels/cpu": {"kernels/cpu"},
    "kernels/cuda": {"kernels/cpu", "kernels/cuda"},
    "kernels": {"kernels/cpu", "kernels/cuda", "kernels"},
    "train/model": {"ckpt", "parallel/layout", "kernels", "kernels/cpu", "kernels/cuda", "train/model"},
    "train/loop": {"ckpt", "parallel/layout", "parallel", "kernels", "train/data", "train/model", "train/optim",
                   "train/log", "train/loop"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main(root):
    root = pathlib.Path(root)
    problems, files = [], 0
    for module, allowed in ALLOWED.items():
        folder = root / module
        sources = sorted(p for p in folder.iterdir() if p.suffix in (".h", ".cc", ".cu"))
        if not sources:
            problems.append(f"{module}: no sources (the table is out of date)")
        for path in sources:
            files += 1
            for header in INCLUDE.findall(path.read_text()):
                owner = str(pathlib.PurePosixPath(header).parent)
                if owner not in allowed:
                    problems.append(f"{path.relative_to(root)} includes \"{header}\": {module} does not depend on {owner}")
    for p in problems:
        print(p)
    print(f"{files} files in {len(ALLOWED)} modules checked: {len(problems)} undeclared includes")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2]))
