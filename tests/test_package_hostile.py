"""A package is untrusted input. For each hostile or changing package:
`moe-pipeline verify` exits 1 and lists the problem, and `load_package` raises a PackageError before
any tensor is read; a file that changes after verification is refused with a FileChangedError naming
it, and the expert store of `serve --resident-experts` fails that load instead of dying of SIGBUS.

Each test copies one of two packages exported once per module from the session's small run, and
tampers with the copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env, cli

pytestmark = pytest.mark.slow  # the packages are exported from the session's small run (distill: ~30 s)


@pytest.fixture(scope="module")
def packages(small_run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    cli("export", str(small_run), "--out", str(root / "single"))
    cli("export", str(small_run), "--out", str(root / "sharded"), "--max-shard-size", "100KB")
    shards = sorted((root / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 2 and (root / "sharded" / "model.safetensors.index.json").is_file()
    return {"single": root / "single", "sharded": root / "sharded"}


@pytest.fixture
def pkg(packages, tmp_path) -> Path:
    """A fresh copy of the single-file package, inside tmp_path/work (tmp_path itself is 'outside')."""
    return Path(shutil.copytree(packages["single"], tmp_path / "work" / "pkg"))


@pytest.fixture
def sharded(packages, tmp_path) -> Path:
    return Path(shutil.copytree(packages["sharded"], tmp_path / "work" / "sharded"))


def manifest_of(pkg: Path) -> dict:
    return json.loads((pkg / "manifest.json").read_text())


def write_manifest(pkg: Path, manifest) -> None:
    (pkg / "manifest.json").write_text(json.dumps(manifest, indent=1))


def facts(path: Path) -> dict:
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size": path.stat().st_size}


def drop(d: dict, key: str) -> None:
    del d[key]


def relist(pkg: Path, *names: str) -> None:
    """Record the current checksum and size of each of `names` in the manifest, as a forger would."""
    manifest = manifest_of(pkg)
    for name in names:
        manifest["files"][name] = facts(pkg / name)
    write_manifest(pkg, manifest)


def edit_json(pkg: Path, name: str, change) -> None:
    """Rewrite the JSON file `name` of `pkg` with `change(data)` applied (it changes `data`, or returns what
    replaces it), and relist it."""
    data = json.loads((pkg / name).read_text())
    replaced = change(data)
    data = data if replaced is None else replaced
    (pkg / name).write_text(json.dumps(data, indent=1))
    if name != "manifest.json":
        relist(pkg, name)


def verify_fails(pkg: Path, capsys, *expected: str) -> str:
    """`moe-pipeline verify PKG` (the CLI's entry point, in this process): exit 1, each of `expected` listed."""
    from cli.main import main

    capsys.readouterr()
    rc = main(["verify", str(pkg)])
    err = capsys.readouterr().err
    assert rc == 1, err
    for text in expected:
        assert text in err, err
    return err


def load_refused(pkg: Path, monkeypatch, *expected: str) -> None:
    """`load_package(PKG)` raises a PackageError listing `expected`, before any tensor is read."""
    import pipeline.weights
    from export.inference import load_package
    from export.package import PackageError

    def no_tensors(*args, **kwargs):
        raise AssertionError("load_package read tensors of a package that fails verification")

    monkeypatch.setattr(pipeline.weights, "load_weights", no_tensors)
    monkeypatch.setattr(pipeline.weights, "_read_tensor", no_tensors)
    with pytest.raises(PackageError) as info:
        load_package(pkg)
    for text in expected:
        assert any(text in p for p in info.value.problems), info.value.problems


def refused(pkg, capsys, monkeypatch, *expected):
    verify_fails(pkg, capsys, *expected)
    load_refused(pkg, monkeypatch, *expected)


def test_the_untouched_packages_verify_and_load(packages, capsys):
    from export.inference import load_package
    from cli.main import main

    for p in packages.values():
        assert main(["verify", str(p)]) == 0, capsys.readouterr().err
        model, _ = load_package(p)
        assert model.cfg.experts


# -- 10. names that lead out of the package ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["dotdot", "absolute", "nested"])
def test_a_manifest_name_outside_the_package_is_refused_before_it_is_opened(pkg, tmp_path, capsys, monkeypatch, how):
    secret = tmp_path / "secret.txt"  # outside the package, listed with its true checksum and size
    secret.write_text("not part of any package\n")
    name = {"dotdot": "../../secret.txt", "absolute": str(secret), "nested": "sub/../../../secret.txt"}[how]
    manifest = manifest_of(pkg)
    manifest["files"][name] = facts(secret)
    write_manifest(pkg, manifest)
    why = {"dotdot": "leads out of the directory", "absolute": "is an absolute path",
           "nested": "leads out of the directory"}[how]
    refused(pkg, capsys, monkeypatch, f"manifest.json: file name {name!r} {why}")


def test_a_listed_file_that_is_a_link_to_a_file_outside_is_refused(pkg, tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "elsewhere.safetensors"  # the same bytes, so size and checksum agree
    shutil.move(pkg / "model.safetensors", elsewhere)
    (pkg / "model.safetensors").symlink_to(elsewhere)
    refused(pkg, capsys, monkeypatch, f"model.safetensors: a symbolic link to {elsewhere}, outside the package")


def test_verify_on_the_command_line_exits_1_for_an_absolute_name(pkg):
    if not os.access("/etc/passwd", os.R_OK):
        pytest.skip("no readable /etc/passwd here")
    manifest = manifest_of(pkg)
    manifest["files"]["/etc/passwd"] = facts(Path("/etc/passwd"))  # its true checksum: only the name is wrong
    write_manifest(pkg, manifest)
    proc = cli("verify", str(pkg), check=False)
    assert proc.returncode == 1 and "'/etc/passwd' is an absolute path" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# -- 11. a shard index that names what was not verified ----------------------------------------------------

INDEX = "model.safetensors.index.json"


def remap(pkg: Path, to) -> str:
    """Point the index's first tensor at `to(its file)`; returns the tensor's name."""
    index = json.loads((pkg / INDEX).read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = to(index["weight_map"][key])
    (pkg / INDEX).write_text(json.dumps(index, indent=1))
    relist(pkg, INDEX)
    return key


def test_an_index_naming_a_file_outside_the_package_is_refused(sharded, tmp_path, capsys, monkeypatch):
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    shutil.copyfile(first, tmp_path / "work" / "x.safetensors")  # holds the tensor, outside the package
    key = remap(sharded, lambda f: "../x.safetensors")
    refused(sharded, capsys, monkeypatch,
            f"{INDEX}: weight_map entry {key}: '../x.safetensors' leads out of the directory")


def test_an_index_naming_a_file_the_manifest_does_not_list_is_refused(sharded, capsys, monkeypatch):
    key = remap(sharded, lambda f: "model-00009-of-00009.safetensors")
    refused(sharded, capsys, monkeypatch, f"{INDEX}: weight_map entry {key}: "
                                          f"'model-00009-of-00009.safetensors' was not verified")


def test_an_index_placing_a_tensor_in_the_wrong_shard_is_refused(sharded, capsys, monkeypatch):
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    key = remap(sharded, lambda f: shards[-1] if f != shards[-1] else shards[0])
    refused(sharded, capsys, monkeypatch, f"{INDEX}: maps tensor {key} to ", "holds it")


# -- 12. malformed manifest, config.json and index: listed problems, no traceback --------------------------

MANIFEST_DAMAGE = {
    "files a list": (lambda m: {**m, "files": sorted(m["files"])}, "manifest.json: files must be an object"),
    "no size": (lambda m: drop(m["files"]["config.json"], "size"),
                "manifest.json: files['config.json'].size must be a byte count, got nothing"),
    "size a string": (lambda m: m["files"]["config.json"].update(size=str(m["files"]["config.json"]["size"])),
                      "manifest.json: files['config.json'].size must be a byte count, got a string"),
    "entry a number": (lambda m: m["files"].update({"config.json": 7}),
                       "manifest.json: files['config.json'] must be an object"),
    "weights not a list": (lambda m: m.update(weights="model.safetensors"),
                           "manifest.json: weights must be a list of file names, got a string"),
    "unknown dtype": (lambda m: m.update(dtype="float8"), "manifest.json: dtype must be one of float32"),
    "no tensors count": (lambda m: drop(m, "tensors"), "manifest.json: tensors must be a count"),
    "not an object": (lambda m: [m], "manifest.json: a list"),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_malformed_manifest_is_a_listed_problem(pkg, capsys, monkeypatch, damage):
    change, expected = MANIFEST_DAMAGE[damage]
    edit_json(pkg, "manifest.json", change)
    err = verify_fails(pkg, capsys, expected)
    assert "Traceback" not in err
    load_refused(pkg, monkeypatch, expected)


CONFIG_DAMAGE = {
    "hidden a float": (lambda c: c.update(hidden=float(c["hidden"])), "config.json: hidden must be an integer >= 1"),
    "negative vocabulary": (lambda c: c.update(vocab_size=-5), "config.json: vocab_size must be an integer >= 1"),
    "experts a string": (lambda c: c.update(experts="four"), "config.json: experts must be a list of integers"),
    "unknown mlp type": (lambda c: c.update(mlp_type="dense"), 'config.json: mlp_type must be "standard" or "residual"'),
    "not an object": (lambda c: [c], "config.json: a list"),
    "an experts entry too many": (lambda c: c.update(experts=[*c["experts"], 4]),
                                  "config.json: inconsistent fields (model config: one experts entry per MoE layer)"),
    "kv heads not dividing heads": (lambda c: c.update(kv_heads=c["heads"] - 1),
                                    "config.json: inconsistent fields (model config: heads must be a multiple of kv_heads)"),
}


@pytest.mark.parametrize("damage", sorted(CONFIG_DAMAGE))
def test_a_malformed_config_is_a_listed_problem(pkg, capsys, monkeypatch, damage):
    change, expected = CONFIG_DAMAGE[damage]
    edit_json(pkg, "config.json", change)
    refused(pkg, capsys, monkeypatch, expected)


def test_an_inconsistent_config_is_refused_under_python_O_too(pkg):
    """The checks of config.json are exceptions, not asserts, which `python -O` would drop."""
    edit_json(pkg, "config.json", lambda c: c.update(moe_layers=list(reversed(c["moe_layers"])) + [0]))
    proc = subprocess.run([sys.executable, "-O", "-m", "cli", "verify", str(pkg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "config.json: inconsistent fields (model config: one experts entry per MoE layer)" in proc.stderr


@pytest.mark.parametrize("damage", ["weight_map a list", "not json"])
def test_a_malformed_index_is_a_listed_problem(sharded, capsys, monkeypatch, damage):
    if damage == "not json":
        (sharded / INDEX).write_text("{ not json")
        relist(sharded, INDEX)
        expected = f"{INDEX}: not JSON"
    else:
        edit_json(sharded, INDEX, lambda i: i.update(weight_map=sorted(i["weight_map"])))
        expected = f"{INDEX}: needs a weight_map object"
    refused(sharded, capsys, monkeypatch, expected)


# -- 13. files that change after verification ----------------------------------------------------------------

def change_after_verification(monkeypatch, change) -> None:
    """Make `change()` happen after load_package's verification, just before it reads the weights."""
    import pipeline.weights

    real = pipeline.weights.load_weights

    def changed_then_load(*args, **kwargs):
        change()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.weights, "load_weights", changed_then_load)


def rewrite_in_place(path: Path) -> None:
    """Flip one byte in the middle of `path` (same size, same inode), as a later write would: its
    modification time moves on (set explicitly: two writes within the clock's tick share a time)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("how", ["truncated", "rewritten", "replaced"])
def test_a_shard_changed_between_verification_and_loading_is_refused(sharded, monkeypatch, how):
    from export.inference import load_package
    from pipeline.artifacts import FileChangedError

    shard = sorted(sharded.glob("model-*.safetensors"))[0]

    def change():
        if how == "truncated":
            os.truncate(shard, shard.stat().st_size // 2)
        elif how == "rewritten":
            rewrite_in_place(shard)
        else:  # another file renamed over it, size and modification time kept
            st = shard.stat()
            shutil.copyfile(shard, shard.with_suffix(".new"))
            os.utime(shard.with_suffix(".new"), ns=(st.st_atime_ns, st.st_mtime_ns))
            os.replace(shard.with_suffix(".new"), shard)

    change_after_verification(monkeypatch, change)
    with pytest.raises(FileChangedError, match=f"{shard.name}: changed since it was verified"):
        load_package(sharded)


def test_an_expert_store_made_from_a_verified_package_refuses_a_file_changed_since(pkg):
    import torch

    from export.package import verified_package
    from export.serve.placement.residency import ExpertStore
    from pipeline.artifacts import FileChangedError

    verified = verified_package(pkg)
    rewrite_in_place(pkg / "model.safetensors")
    with pytest.raises(FileChangedError, match="model.safetensors: changed since it was verified"):
        ExpertStore(pkg, verified.cfg, torch.float32, files=verified.files)


STORE_SCRIPT = """
import os, sys, torch
from pathlib import Path
from export.package import read_package
from export.serve.placement.residency import ExpertStore
pkg = Path(sys.argv[1])
cfg, _ = read_package(pkg)
store = ExpertStore(pkg, cfg, torch.float32)
store.load(0, 0)  # a load before the change works
weights = pkg / "model.safetensors"
if sys.argv[2] == "truncated":  # to its header: every tensor's bytes gone
    with open(weights, "rb") as f:
        os.truncate(weights, 8 + int.from_bytes(f.read(8), "little"))
else:
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(st.st_size - 4)
        f.write(b"\\xff\\xff\\xff\\x7f")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
for e in range(cfg.experts[0]):
    try:
        store.load(0, e)
    except ValueError as err:
        print("refused:", err)
        continue
    print("loaded expert", e)
"""


@pytest.mark.parametrize("how", ["truncated", "rewritten"])
def test_the_expert_store_fails_a_load_of_a_changed_file_instead_of_dying(pkg, how):
    """In a child process: touching the mapping of a truncated file is SIGBUS, a negative return code here."""
    proc = subprocess.run([sys.executable, "-c", STORE_SCRIPT, str(pkg), how], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines and all(line.startswith("refused: expert ") for line in lines), proc.stdout
    assert "model.safetensors: changed since it was verified" in lines[0]
