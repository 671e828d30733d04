"""The built wheel contains every package of the source tree, at its `specjax.*` name.

The expected contents are discovered from the source tree, not listed here: every directory with Python files
under specjax/, backends/ (-> specjax/backends) and kernels/ (-> specjax/kernels), and every configs/**/*.yaml
(-> specjax/configs). So a new subpackage that pyproject.toml's explicit `packages` list does not name makes
this test fail. The wheel is built from a copy of the sources (so the work tree gets no build/ or egg-info),
then unpacked into a folder and imported from there, outside the repository, by a subprocess.
"""
from __future__ import annotations

import configparser
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> its path inside the wheel.
MAPPING = {"specjax": "specjax", "backends": "specjax/backends", "kernels": "specjax/kernels",
           "configs": "specjax/configs"}
SKIP_DIRS = {"__pycache__", ".pytest_cache"}

def source_packages() -> list[str]:
    """Wheel paths of every source directory (below the mapped roots) that holds Python files."""
    found = []
    for src, dst in MAPPING.items():
        base = os.path.join(ROOT, src)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            if any(f.endswith(".py") for f in filenames):
                rel = os.path.relpath(dirpath, base)
                found.append(dst if rel == "." else f"{dst}/{rel.replace(os.sep, '/')}")
    return sorted(found)


def source_files(suffix: str, wheel_dir: str) -> list[str]:
    """Wheel paths of the source files with `suffix` that belong in `wheel_dir` (not in its subfolders)."""
    src, dst = max(((s, d) for s, d in MAPPING.items() if wheel_dir == d or wheel_dir.startswith(d + "/")),
                   key=lambda sd: len(sd[1]))
    folder = os.path.join(ROOT, src, wheel_dir[len(dst):].lstrip("/"))
    return sorted(f"{wheel_dir}/{f}" for f in os.listdir(folder) if f.endswith(suffix))


def config_yamls() -> list[str]:
    base = os.path.join(ROOT, "configs")
    out = []
    for dirpath, _, filenames in os.walk(base):
        for f in filenames:
            if f.endswith((".yaml", ".yml")):
                out.append("specjax/configs/" + os.path.relpath(os.path.join(dirpath, f), base).replace(os.sep, "/"))
    return sorted(out)


def _have_local_build_backend() -> bool:
    """setuptools >= 68 and wheel importable: the build can run without fetching its backend."""
    if importlib.util.find_spec("wheel") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 68


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is missing (pip install -e .[test])")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache")
    for name in os.listdir(ROOT):
        path = os.path.join(ROOT, name)
        if name in MAPPING:
            shutil.copytree(path, src / name, ignore=ignore)
        elif os.path.isfile(path) and name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "MANIFEST.in"):
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(src)]
    if _have_local_build_backend():
        cmd.insert(4, "--no-isolation")  # otherwise build fetches setuptools/wheel into an isolated env
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"wheel build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return str(out / wheels[0])


@pytest.fixture(scope="module")
def names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_discovery_sees_the_core_packages():
    """Guard: discovery itself works (else every parametrized test below could pass vacuously)."""
    pkgs = source_packages()
    for must in ("specjax", "specjax/models", "specjax/drafters", "specjax/backends", "specjax/kernels",
                 "specjax/kernels/pallas", "specjax/configs"):
        assert must in pkgs
    assert len(config_yamls()) >= 2


def init_packages() -> list[str]:
    """Dotted names of every source folder with an __init__.py below the mapped roots (the wheel's packages)."""
    return sorted(p.replace("/", ".") for p in source_packages()
                  if os.path.isfile(os.path.join(ROOT, *_source_folder(p), "__init__.py")))


def _source_folder(wheel_dir: str) -> tuple[str, ...]:
    """Source folder (as path parts below ROOT) of a wheel path, through the longest matching mapped root."""
    src, dst = max(((s, d) for s, d in MAPPING.items() if wheel_dir == d or wheel_dir.startswith(d + "/")),
                   key=lambda sd: len(sd[1]))
    rest = wheel_dir[len(dst):].lstrip("/")
    return (src, *rest.split("/")) if rest else (src,)


def declared_packages() -> set[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["tool"]["setuptools"]["packages"])


def test_pyproject_packages_name_every_source_package():
    """Fast check (no wheel build): pyproject's explicit `packages` list names every folder with an __init__.py
    under specjax/, backends/, kernels/, configs/ at its specjax.* name, and nothing that is gone."""
    found = set(init_packages())
    assert {"specjax", "specjax.runners", "specjax.kernels", "specjax.backends"} <= found, sorted(found)
    declared = declared_packages()
    missing, gone = sorted(found - declared), sorted(declared - found)
    assert not missing, f"add to pyproject.toml [tool.setuptools] packages: {missing}"
    assert not gone, f"pyproject.toml [tool.setuptools] packages names folders without an __init__.py: {gone}"


@pytest.mark.slow
@pytest.mark.parametrize("pkg", source_packages())
def test_wheel_contains_package(names, pkg):
    expected = source_files(".py", pkg)
    missing = [f for f in expected if f not in names]
    assert not missing, f"{pkg}: missing from the wheel: {missing}"


@pytest.mark.slow
def test_wheel_contains_every_config_yaml(names):
    missing = [f for f in config_yamls() if f not in names]
    assert not missing, f"config files missing from the wheel: {missing}"


@pytest.mark.slow
def test_wheel_contains_the_shipped_weights(names):
    """The draft model and the heads the method configs default to are package data, with their READMEs."""
    base = pathlib.Path(__file__).resolve().parent.parent / "specjax" / "assets"
    shipped = sorted(p.name for p in base.iterdir() if p.is_dir())
    assert {"smollm2-135m-draft", "smollm2-135m-medusa", "smollm2-135m-eagle", "smollm2-135m-eagle3"} <= set(shipped)
    for d in shipped:
        if d == "draft_vocab":  # ranked token ids per tokenizer (draft_vocab_size), not a model
            files = sorted(p.name for p in (base / d).glob("*.json"))
            assert files and all(f"specjax/assets/{d}/{f}" in names for f in files), f"{d} missing from the wheel"
            continue
        for f in ("config.json", "model.safetensors", "README.md"):
            assert f"specjax/assets/{d}/{f}" in names, f"specjax/assets/{d}/{f} missing from the wheel"


def test_wheel_contains_the_cpu_kernel_source(names):
    # The CPU kernels are compiled from these files on first use (specjax.kernels.cpu_build).
    sources = sorted(f.name for f in pathlib.Path(ROOT, "kernels", "cpu").iterdir() if f.suffix in (".cc", ".h"))
    assert sources, "no C++ kernel sources found under kernels/cpu"
    missing = [f for f in sources if f"specjax/kernels/cpu/{f}" not in names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"


def test_wheel_has_no_stray_top_level_packages(names):
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"specjax", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    for stray in ("backends/", "kernels/", "configs/", "tests/"):
        assert not any(n.startswith(stray) for n in names), f"top-level {stray} shipped in the wheel"


@pytest.mark.slow
def test_console_script_target_is_in_the_wheel(names, wheel):
    with zipfile.ZipFile(wheel) as z:
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        cp = configparser.ConfigParser()
        cp.read_string(z.read(entry).decode())
    target = cp["console_scripts"]["specjax"]
    module = target.split(":")[0]
    path = module.replace(".", "/")
    assert path + ".py" in names or path + "/__init__.py" in names, \
        f"console script {target} points at a module not in the wheel"


@pytest.mark.slow
def test_unpacked_wheel_imports_outside_the_repo(wheel, tmp_path):
    """Import the shipped packages from the unpacked wheel (cwd outside the repo, the wheel dir first on the path)
    and find the packaged configs through importlib.resources."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = (
        "import importlib, os, sys\n"
        "site = sys.argv[1]\n"
        "mods = ['specjax', 'specjax.models.llama', 'specjax.models.loading', 'specjax.drafters', 'specjax.backends',"
        " 'specjax.kernels', 'specjax.kernels.pallas', 'specjax.engine', 'specjax.api', 'specjax.runners',"
        " 'specjax.tools', 'specjax.cli', 'specjax.config', 'specjax.heads', 'specjax.train']\n"
        "for m in mods:\n"
        "    f = importlib.import_module(m).__file__\n"
        "    assert f.startswith(site), (m, f)\n"
        "from specjax.config import available_configs, packaged_config_path\n"
        "names = available_configs()\n"
        "assert 'methods/ngram' in names, names\n"
        "assert str(packaged_config_path('methods/ngram')).startswith(site)\n"
        "print('ok', len(names))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-P", "-c", code, str(site)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ extras
# A core install is inference only: training's packages (the `train` extra) and flax are not installed there.
# These run specjax in a fresh interpreter where a meta-path finder makes such packages unimportable, which is
# what a `pip install specjax` without extras looks like to the code.
_BLOCKER = r"""
import sys
BLOCKED = set(sys.argv[1].split(","))

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""
TRAINING_ONLY = "optax,orbax,flax"


def _run_blocked(blocked: str, body: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _BLOCKER + body, blocked], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def test_blocker_blocks():
    """Guard: the finder really makes a blocked package unimportable (else the tests below prove nothing)."""
    res = _run_blocked("optax,json", "import json\n")
    assert res.returncode != 0 and "blocked by the test" in res.stderr, res.stderr[-2000:]


def test_inference_entry_points_import_without_the_train_extra():
    body = (
        "import specjax, specjax.api, specjax.cli.main, specjax.runners.batch, specjax.runners.speculative\n"
        "import specjax.drafters.build, specjax.heads.eagle_io, specjax.heads.medusa_io, specjax.models.draft_io\n"
        "import specjax.tools.bench, specjax.tools.startup\n"
        "from specjax import LLM, SamplingParams\n"
        "import sys\n"
        "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))\n"
    )
    res = _run_blocked(TRAINING_ONLY, body)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded []" in res.stdout, res.stdout


def test_shipped_weights_read_without_flax():
    """safetensors' framework="flax" reader (used for the shipped heads and draft) needs jax, not flax."""
    path = pathlib.Path(ROOT, "specjax", "assets", "smollm2-135m-medusa", "model.safetensors")
    body = (
        "import math\n"
        "import jax  # as in specjax, which always has jax imported (it registers bfloat16 with numpy)\n"
        "from safetensors import safe_open\n"
        f"with safe_open({str(path)!r}, framework='flax') as f:\n"
        "    name = min(f.keys(), key=lambda k: math.prod(f.get_slice(k).get_shape()))\n"
        "    print('read', name, type(f.get_tensor(name)).__module__)\n"
    )
    res = _run_blocked(TRAINING_ONLY, body)
    assert res.returncode == 0 and "read " in res.stdout, res.stderr[-3000:]
    assert "jax" in res.stdout, res.stdout  # a jax array, made without flax


def test_train_head_without_the_train_extra_says_how_to_install():
    body = "from specjax.cli.main import main\nraise SystemExit(main(['train-head', '--config', 'train/draft']))\n"
    res = _run_blocked("optax,orbax", body)
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specjax: error:"), res.stderr[-3000:]
    assert 'pip install -e ".[train]"' in lines[0] and "optax" in lines[0]


def test_batch_io_imports_without_fcntl_and_says_why_it_cannot_lock(tmp_path):
    body = (
        "from specjax.runners.batch_io import BatchError, ResultFile\n"
        "try:\n"
        f"    ResultFile({str(tmp_path / 'out.jsonl')!r})\n"
        "except BatchError as e:\n"
        "    print('error:', e)\n"
    )
    res = _run_blocked("fcntl", body)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "error:" in res.stdout and "fcntl" in res.stdout, res.stdout


def _project() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _names(requirements) -> set[str]:
    import re

    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _extra(extras: dict, name: str, seen=()) -> set[str]:
    """Distribution names an extra installs, self-references (`specjax[a,b]`) followed."""
    out = set()
    for req in extras[name]:
        if req.startswith("specjax["):
            for sub in req[len("specjax["):req.index("]")].split(","):
                if sub not in seen:
                    out |= _extra(extras, sub.strip(), (*seen, name))
        else:
            out |= _names([req])
    return out


def test_core_install_is_inference_only_and_test_extra_covers_the_extras():
    project = _project()
    core = _names(project["dependencies"])
    assert not core & {"optax", "orbax-checkpoint", "flax"}, sorted(core)
    extras = project["optional-dependencies"]
    assert _extra(extras, "train") >= {"optax", "orbax-checkpoint"}
    assert _extra(extras, "serve") >= {"fastapi", "uvicorn", "pydantic", "prometheus-client"}
    test = _extra(extras, "test")
    assert test >= _extra(extras, "train") | _extra(extras, "serve") | _extra(extras, "plots")
    assert test >= {"pytest", "hypothesis", "openai", "httpx"}


def test_flax_is_never_imported():
    """flax left the dependencies: no source or test file may import it (safetensors' framework="flax" is jax)."""
    import ast

    offenders = []
    for folder in ("specjax", "backends", "kernels", "tests", "benchmarks"):
        for path in pathlib.Path(ROOT, folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "flax"]
    assert not offenders, f"flax is not a dependency any more; imported at {offenders}"
