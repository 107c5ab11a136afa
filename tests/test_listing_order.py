"""The suite lists folders in an order of its own (conftest.py: ACTOBS_LISTING_ORDER), so a test that reads a listing
in the file system's order fails here as it would on another machine; and the product's walk of a sandbox's layer
reports in name order whatever order the folder lists in."""
import glob
import os
from pathlib import Path

import conftest
from actobs.sandbox import container_files

NAMES = [f"n{i:02d}" for i in range(48)]


def test_every_listing_comes_in_the_suites_order(tmp_path):
    """os.listdir, os.scandir, pathlib's iterdir and glob, glob.glob and os.walk give the same order: the names
    shuffled by the run's seed (never sorted: 48 names sort by chance once in 48!) or reversed, or under `native` the
    file system's own."""
    for n in NAMES:
        (tmp_path / n).touch()
    native = conftest._LISTERS["listdir"](tmp_path)
    native_order = conftest.LISTING_ORDER == "native"
    want = native if native_order else conftest._reordered(conftest.LISTING_ORDER, native, lambda n: n)
    assert native_order or want != sorted(NAMES)
    with os.scandir(tmp_path) as it:
        scanned = [e.name for e in it]
    got = {"listdir": os.listdir(tmp_path), "scandir": scanned, "iterdir": [p.name for p in tmp_path.iterdir()],
           "Path.glob": [p.name for p in tmp_path.glob("n*")],
           "glob.glob": [os.path.basename(p) for p in glob.glob(f"{tmp_path}/n*")],
           "os.walk": next(os.walk(tmp_path))[2]}
    assert got == {k: want for k in got}


def test_the_layer_walk_is_in_name_order_whatever_the_folder_order(tmp_path):
    """walk_layer: a folder's entries in name order, then its sub-folders', depth first; under a listing order that is
    not."""
    for d in ("b", "a/y", "a/x"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("c", "a/z", "a/x/f", "b/e", *[f"a/y/{n}" for n in NAMES]):
        Path(tmp_path, f).touch()
    walked = [f"{rel}/{name}" for _, rel, name, _ in container_files.walk_layer(str(tmp_path), 1000)]
    assert walked == ["/a", "/b", "/c", "/a/x", "/a/y", "/a/z", "/a/x/f", *[f"/a/y/{n}" for n in NAMES], "/b/e"]
