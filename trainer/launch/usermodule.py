"""The user's model module, importable in the driver and on every Ray worker.

``model.name = "mymodels.digits:lenet"`` with ``mymodels/`` in the working directory: the installed ``dutycycle``
console script, unlike ``python -m``, does not put the working directory on ``sys.path``, and a Ray worker runs in
another directory, maybe on another node. So:

- **The driver** imports the module with the working directory on ``sys.path`` (``importable``: appended, so an
  installed package of the same name still wins, as it will on the workers), before Ray starts: a typo or a
  missing dependency fails in a second, naming the module, the working directory and the fix.
- **Ray workers** get the module through Ray's runtime environment: ``py_modules`` with the module's top-level
  package (``mymodels/``) or file (``mymodel.py``), given to the worker group as
  ``RunConfig(worker_runtime_env=...)`` (``worker_runtime_env``). Ray puts it on the workers' ``PYTHONPATH``.

Why a zip URI, not the folder: Ray uploads a local folder named in ``py_modules`` only for a job's own runtime
environment (``ray.init(runtime_env=...)``, once, when the job connects); a task's or an actor's, which is what
Ray Train gives its workers, must name URIs ("Passing directories or modules to be dynamically uploaded is only
supported at the job level"). A job already connected (a notebook, a test suite's cluster, a second ``train``
in one process) cannot add to its own. So the driver zips the package itself into Ray Train's storage
(``ray.storage_path``, else ``RUN_DIR/ray``: every node must read it anyway) and names that zip: ``file://`` on a
local or shared file system, ``s3://``/``gs://`` as they are (Ray fetches those with ``smart_open``, which must be
installed on the nodes). The zip's name carries the hash of its content, and its entries have fixed dates, so the
same code is the same URI (Ray unpacks each URI once per node and reuses it) and changed code a new one, never a
stale copy. The job's own ``py_modules``, if it has any, are kept (Ray would otherwise replace them with ours).

What travels: a module that is not installed (outside site-packages and the standard library) and is not
dutycycle itself, without ``__pycache__``, compiled files and hidden entries; at most ``MAX_BYTES``. An installed
package is taken to be installed on every node, as dutycycle itself must be.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io as _io
import os
import sys
import sysconfig
import zipfile

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError

MAX_BYTES = 64 << 20  # a module's code; more means data sits in the package folder
WRAPPER = "dutycycle_py_module"  # the zip's one top-level folder, which Ray strips when it unpacks a URI
_EPOCH = (1980, 1, 1, 0, 0, 0)  # every entry's date: the same files are the same zip, byte for byte


def importable(name: str) -> None:
    """Make ``model.name``'s module importable in this process: the working directory joins ``sys.path`` (at
    the end) when the module is not found without it."""
    top = name.partition(":")[0].split(".")[0]
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        return
    if importlib.util.find_spec(top) is None:
        sys.path.append(cwd)
        importlib.invalidate_caches()


def module_source(name: str) -> str | None:
    """The folder (a package) or file (a module) that ``model.name``'s top-level module is imported from, when it
    must travel to Ray workers; None for a built-in model name, an installed module, or dutycycle itself."""
    if ":" not in name:
        return None
    top = name.partition(":")[0].split(".")[0]
    if top == "dutycycle":
        return None
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None  # the driver's import check names it; nothing to ship
    locations = list(spec.submodule_search_locations or [])
    if len(locations) > 1:
        raise ConfigError(f"model.name = {name!r}: {top} is a namespace package spread over {len(locations)} "
                          f"folders ({', '.join(locations)}); Ray workers can get one folder: keep it in one, or "
                          "install it on every node")
    path = locations[0] if locations else spec.origin
    if not path or not os.path.exists(path) or _installed(path):
        return None
    return os.path.abspath(path)


def _installed(path: str) -> bool:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths}
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def _files(source: str) -> list[tuple[str, str]]:
    """``(absolute path, name in the zip)`` of every file that travels, sorted."""
    base = os.path.dirname(source)
    if os.path.isfile(source):
        return [(source, os.path.relpath(source, base))]
    out = []
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for f in sorted(files):
            if f.startswith(".") or f.endswith((".pyc", ".pyo")):
                continue
            path = os.path.join(folder, f)
            out.append((path, os.path.relpath(path, base)))
    return out


def package_zip(source: str) -> bytes:
    """The module at ``source`` (a package folder or a ``.py`` file) as a zip Ray unpacks onto a worker's path:
    ``WRAPPER/<package>/...`` or ``WRAPPER/<module>.py``; the same files give the same bytes."""
    files = _files(source)
    size = sum(os.path.getsize(p) for p, _ in files)
    if size > MAX_BYTES:
        raise ConfigError(f"the model's module {source} holds {size / 2**20:.0f} MiB, more than the "
                          f"{MAX_BYTES >> 20} MiB of code that is sent to every Ray worker; move data out of the "
                          "package folder, or install the package on every node")
    buf = _io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, arcname in files:
            info = zipfile.ZipInfo(f"{WRAPPER}/{arcname}", date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(path, "rb") as f:
                z.writestr(info, f.read())
    return buf.getvalue()


def ship(source: str, storage: str) -> str:
    """Write the zip of ``source`` under ``storage`` (``STORAGE/py_modules/<name>-<hash>.zip``, once: the same
    content is the same file) and return the URI Ray fetches it from."""
    data = package_zip(source)
    stem = os.path.splitext(os.path.basename(source.rstrip(os.sep)))[0]
    uri = io.join(storage, "py_modules", f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}.zip")
    if not io.exists(uri):
        io.write_bytes_atomic(uri, data)
    if io.protocol(uri) == "file":
        return "file://" + os.path.abspath(uri[len("file://"):] if uri.startswith("file://") else uri)
    if io.protocol(uri) == "memory":
        raise ConfigError(f"ray.storage_path = {storage!r} is in this process's memory, which Ray workers cannot "
                          "read the model's module from; use a shared folder or an object store")
    return uri


def worker_runtime_env(cfg, storage: str) -> dict:
    """The runtime environment of a run's Ray Train workers beyond the job's: ``py_modules`` with the model's
    module when it must travel (``module_source``); empty otherwise."""
    source = module_source(cfg.model.name)
    if source is None:
        return {}
    import ray  # heavy: only a Ray launch needs it

    job = ray.get_runtime_context().runtime_env or {}
    return {"py_modules": [*(job.get("py_modules") or []), ship(source, storage)]}
