"""The install: one TensorFlow in the venv, a demo install without the developer tools, extras
that the docs name and setup.py defines, and the demo's digits as scikit-learn wrote them."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
# Pages that tell a person what to pip install.
INSTALL_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "dockerfiles").glob("Dockerfile*"))]
# What the demo does not use, and made the first venv 3.2 GB (issue 30).
NOT_FOR_THE_DEMO = {"tensorflow", "tf-keras", "scikit-learn", "scipy", "moto", "boto3", "matplotlib", "pytest",
                    "kubernetes", "pyarrow", "pandas"}


def _setup_kwargs() -> dict:
    """setup()'s install_requires and extras_require, read from setup.py without running it."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")


def _makefile_rule(target: str) -> str:
    text = (REPO / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    return re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M).group(1)


def test_one_tensorflow_distribution_in_the_environment():
    """tensorflow and tensorflow-cpu both install the package `tensorflow`: with the two, 3 GB of
    which the files of whichever came last are imported. tf-keras requires `tensorflow` and so
    brought it beside tensorflow-cpu until the Makefile installed it without its dependencies."""
    providers = importlib.metadata.packages_distributions().get("tensorflow", [])
    assert len(set(providers)) == 1, f"distributions installing the tensorflow package: {sorted(set(providers))}"


def test_pip_check_finds_only_tf_keras_asking_for_the_tensorflow_it_does_not_need():
    """Every requirement is met, but tf-keras's `tensorflow`: tensorflow-cpu provides it."""
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    unmet = [line for line in result.stdout.splitlines() if line.strip() and "No broken requirements" not in line]
    assert all(re.match(r"tf-keras [\d.]+ (requires tensorflow, which is not installed|has requirement tensorflow)", u)
               for u in unmet), unmet


def test_the_demo_installs_one_tensorflow_and_no_developer_tools():
    kwargs = _setup_kwargs()
    recipe = _makefile_rule("$(DEMO_STAMP)")
    (extras,) = re.findall(r'pip install --quiet -e "\.\[([\w,]+)\]"', recipe)
    demo = {_name(r) for r in kwargs["install_requires"]}
    for extra in extras.split(","):
        demo |= {_name(r) for r in kwargs["extras_require"][extra]}
    assert "tensorflow-cpu" in demo
    assert not demo & NOT_FOR_THE_DEMO, sorted(demo & NOT_FOR_THE_DEMO)
    # make demo's data step runs prepare_data.py: it must not import scikit-learn
    source = (REPO / "model_zoo" / "digits" / "prepare_data.py").read_text(encoding="utf-8")
    assert "sklearn" not in re.sub(r'""".*?"""', "", source, flags=re.S)


def test_tf_keras_is_installed_only_without_its_dependencies():
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    for line in text.replace("\\\n", " ").splitlines():
        if "pip install" in line and ("TF_KERAS" in line or "tf-keras" in line):
            assert "--no-deps" in line, line
    assert all("tf-keras" not in r for r in _setup_kwargs()["extras_require"]["dev"])


def test_every_documented_extra_exists():
    """`elasticdl[x]` and `.[x,y]` in the docs and Dockerfiles name extras of setup.py."""
    defined = set(_setup_kwargs()["extras_require"])
    named = set()
    for page in INSTALL_PAGES:
        for group in re.findall(r"(?:elasticdl|\.)\[([\w,-]+)\]", page.read_text(encoding="utf-8")):
            named |= {(page.name, extra) for extra in group.split(",")}
    assert {("README.md", "pandas"), ("README.md", "kubernetes"), ("README.md", "parquet")} <= named
    assert {(page, extra) for page, extra in named if extra not in defined} == set()


def test_the_images_install_what_a_pod_uses():
    """A master pod starts the other pods (the kubernetes client); pods read Parquet data."""
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (REPO / "dockerfiles" / name).read_text(encoding="utf-8")
        (extras,) = re.findall(r"elasticdl\[([\w,-]+)\]", text)
        assert {"kubernetes", "parquet"} <= set(extras.split(",")), name


def test_without_the_kubernetes_client_the_backend_names_the_extra(monkeypatch):
    from elasticdl.launch.kubernetes.client import K8sClient, K8sConfigError

    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes raises ImportError
    with pytest.raises(K8sConfigError, match=r"pip install 'elasticdl\[kubernetes\]'.*--backend local"):
        K8sClient("default")


def test_the_vendored_digits_and_their_split_are_scikit_learns():
    """prepare_data.py reads digits.csv.gz and splits it itself: the same records in the same
    files as scikit-learn's load_digits and train_test_split wrote before."""
    sys.path.insert(0, str(REPO / "model_zoo" / "digits"))
    try:
        import prepare_data
    finally:
        sys.path.pop(0)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    reference = load_digits()
    data, target = prepare_data.load_digits()
    assert data.dtype == reference.data.dtype and np.array_equal(data, reference.data)
    assert np.array_equal(target, reference.target)
    for seed, fraction in ((0, 0.2), (3, 0.25), (11, 0.1)):
        expected = train_test_split(np.arange(len(target)), test_size=fraction, random_state=seed, stratify=target)
        got = prepare_data.stratified_split(target, fraction, seed)
        assert all(np.array_equal(e, g) for e, g in zip(expected, got)), (seed, fraction)


def test_a_keras2_module_without_tf_keras_is_told_the_matching_version_without_dependencies(monkeypatch):
    import importlib.util

    from elasticdl.model.keras_generation import KerasVersionError, activate

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else find_spec(name, *a))
    tensorflow = "tensorflow-cpu" if _installed("tensorflow-cpu") else "tensorflow"
    minor = ".".join(importlib.metadata.version(tensorflow).split(".")[:2])
    with pytest.raises(KerasVersionError, match=re.escape(f"pip install --no-deps 'tf-keras~={minor}.0'")):
        activate("2")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
