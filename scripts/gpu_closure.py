"""Print `name==version` for the packages the GPU host lacks and the named ones need.

Walks the requirements of the given distributions as installed in THIS environment (the project's
.venv, so the versions are the ones the project is tested with), leaving out every requirement whose
name is in the image's list (scripts/gpu_image_packages.txt, from the device's KINDS.md) and torch
and transformers (the host's own CUDA builds serve; chat/ works on transformers 5.17 too). The named
packages themselves are always printed, listed in the image or not (peft: the image's is another
version).
Used by scripts/gpu_site.sh.
"""

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as norm


def main(image_list: str, *names: str) -> None:
    with open(image_list) as f:
        skip = {norm(n) for n in f.read().split()} | {"torch", "transformers"}
    todo, found = [norm(n) for n in names], {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            sys.exit(f"{name} is not installed here: run this with the project's .venv")
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement, or another platform's
            if norm(req.name) not in skip:
                todo.append(norm(req.name))
    for name, version in sorted(found.items()):
        sys.stdout.write(f"{name}=={version}\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
