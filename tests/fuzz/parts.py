"""Part assembly under the fuzzer: a model cut into part packages, as `specjax.models.resolve.assemble` reads them.

A corpus entry (`build`) is a directory holding two small part models' pieces (`src/a/partNN.bin` for the model
assembled, `src/b/partNN.bin` for the other one), their pins (`pins.json`, never mutated) and `layout.json`: which
piece each package slot of model a gets (null: that package is not installed). The fuzzer mutates the layout
(`layout_mutation`: a missing part, parts swapped, a part of the other model, a part twice, an extra package) and
the pieces' bytes (`mutate.raw_mutation`: truncated, altered, extra bytes). The worker (`load`) installs the
packages the layout names into the case directory, points specjax's cache there, and assembles model a: the only
acceptable outcomes are the pinned file, or a one-line ModelLoadError naming the case directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import hypothesis.strategies as st

# Part sizes: model a's are equal (a reorder passes the size check and must be caught by the digests), and b's
# first has their size too (a part of the other model in its place, the same).
A_SIZES = (3000, 3000, 3000, 1234)
B_SIZES = (3000, 1777, 500)


def _model(name: str, pieces: list[bytes]) -> dict:
    data = b"".join(pieces)
    return {"name": name, "filename": f"{name}.gguf", "distribution": f"specjax-fuzz-{name}-part{{i}}",
            "module": f"specjax_fuzz_{name.replace('-', '_')}_part{{i}}", "version": "1.0", "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "extra": f"{name}-extra",
            "parts": [[len(p), hashlib.sha256(p).hexdigest()] for p in pieces]}


def build(root: str, rng):
    """The parts entry under `root`: (directory, files to mutate with their formats)."""
    d = os.path.join(root, "parts")
    pieces = {"a": [rng.bytes(n) for n in A_SIZES], "b": [rng.bytes(n) for n in B_SIZES]}
    files = [("layout.json", "parts_layout")]
    for m, ps in pieces.items():
        os.makedirs(os.path.join(d, "src", m))
        for i, data in enumerate(ps, start=1):
            rel = f"src/{m}/part{i:02d}.bin"
            with open(os.path.join(d, rel), "wb") as f:
                f.write(data)
            if m == "a" or i == 1:
                files.append((rel, "part"))
    with open(os.path.join(d, "pins.json"), "w") as f:
        json.dump({"target": "fuzz-a", "models": [_model("fuzz-a", pieces["a"]), _model("fuzz-b", pieces["b"])]}, f)
    with open(os.path.join(d, "layout.json"), "w") as f:
        json.dump([f"src/a/part{i:02d}.bin" for i in range(1, len(A_SIZES) + 1)], f)
    return d, tuple(files)


FORMATS = ("parts_layout", "part")


def mutate(draw, fmt: str, raw: bytes) -> tuple[bytes, list[str]]:
    """One or two layout changes (the layout is never mutated as bytes: it is the harness's own file), or one or
    two raw mutations of a piece."""
    from .mutate import raw_mutation

    change = layout_mutation if fmt == "parts_layout" else raw_mutation
    desc = []
    for _ in range(draw(st.sampled_from([1, 1, 2]), label="part mutations")):
        raw, d = change(draw, raw)
        desc.append(d)
    return raw, desc


def layout_mutation(draw, raw: bytes) -> tuple[bytes, str]:
    """One change of which piece each package slot gets; always a valid layout (the harness's own file)."""
    layout = json.loads(raw)
    n = len(layout)
    pieces = [f"src/a/part{i:02d}.bin" for i in range(1, len(A_SIZES) + 1)]
    pieces += [f"src/b/part{i:02d}.bin" for i in range(1, len(B_SIZES) + 1)]
    op = draw(st.sampled_from(["missing", "swap", "other", "twice", "extra_package"]), label="layout op")
    i = draw(st.integers(0, n - 1), label="slot")
    if op == "missing":
        layout[i] = None
    elif op == "swap":
        j = draw(st.integers(0, n - 1), label="other slot")
        layout[i], layout[j] = layout[j], layout[i]
    elif op == "other":
        layout[i] = draw(st.sampled_from([p for p in pieces if "/b/" in p]), label="piece")
    elif op == "twice":
        layout[i] = draw(st.sampled_from(pieces), label="piece")
    else:
        layout.append(draw(st.sampled_from(pieces), label="piece"))
    return json.dumps(layout).encode(), f"layout {op}@{i}"


def load(path: str) -> None:
    """Worker target: install the layout's packages under `path`, assemble model a into a cache under `path`."""
    import importlib
    import sys

    from specjax.models import resolve as R

    with open(os.path.join(path, "pins.json")) as f:
        pins = json.load(f)
    with open(os.path.join(path, "layout.json")) as f:
        layout = json.load(f)
    models = {m["name"]: R.PartModel(**{**m, "parts": tuple(map(tuple, m["parts"]))}) for m in pins["models"]}
    target = models[pins["target"]]
    # A fresh install and an empty cache every time: the unmutated entry is loaded in place, and its copies must
    # not inherit the packages or the assembled file of that run.
    site, cache = os.path.join(path, "site"), os.path.join(path, "cache")
    shutil.rmtree(site, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    for i, piece in enumerate(layout, start=1):
        if piece is None:
            continue
        pkg = os.path.join(site, target.module.format(i=i))
        os.makedirs(os.path.join(pkg, "data"))
        open(os.path.join(pkg, "__init__.py"), "w").close()
        os.link(os.path.join(path, piece), os.path.join(pkg, "data", f"part{i:02d}.bin"))
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    os.environ["SPECJAX_CACHE_DIR"] = cache
    R.PART_MODELS = models  # the worker is a forked child: this never reaches another input
    out = R.assemble(target, progress=False)
    digest = hashlib.sha256(open(out, "rb").read()).hexdigest()
    if digest != target.sha256 or not R._trusted(out, target):
        raise AssertionError(f"assembled a file that is not the pinned one: {out}")
