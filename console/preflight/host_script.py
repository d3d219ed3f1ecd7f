"""The preflight's host script: what runs on each host, with the host's own python, before anything starts there.

The console never imports torch (tests/test_console_torch_free.py), and neither does this script: the versions of
torch and the other packages come from their installed metadata. It is one file of the standard library only, and
old pythons parse it (3.6+, no annotations), because it has to run to say that a python is too old or a venv
lacks torch. The console sends it on the channel's stdin after one line that sets its arguments:

    ARGS = json.loads('{"mode": "facts", "workdir": "/opt/zeroband", ...}')   # console/preflight/runner.py
    <this file>                                                              # run as `PYTHON -`

and reads one JSON object from its stdout. Modes:

    facts    python, packages, the project's version (git commit and a digest of engine/**/*.py), GPUs and the
             smallest one's memory (NVML; or ZEROBAND_FAKE_GPUS from the profile, "8" or "8x80" for 80 GiB each,
             the one fake allowed, for tests on machines without a GPU), CPUs,
             free disk under the run folder, data paths and a prepared folder's manifest digest, network
             interfaces, whether the store's address and port can be bound, the venv's set-up stamp, the clock,
             and for an engine host the address its collectives listen on (the one on the route to the store, as
             engine/mesh/group.py picks it) with a port free there now: the far end of the peers' link test
    listen   listen on the store's address and port(s) and accept (close at once) until `expect` connections came
             or `seconds` passed: the far end of the link test
    connect  open a TCP connection to each target, retrying a refusal until `seconds` (the listener may not be up
             yet): connected, refused, timeout or unreachable, each with the error's text
    files    the git blob id and executable bit of each named file under the workdir, and the engine/**/*.py files
             that are not named (console/sync.py sends the first that differ and removes the second)
    venv     the python's packages and the venv's set-up stamp against the workdir's (sync: is set-up due?)

The digest of engine/**/*.py is the same function the console uses for its own checkout (`engine_digest`), so a
host that holds the console's files has the console's digest, with or without git.
"""

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

MANIFEST = "manifest.json"  # engine/data/shards.py: a prepared folder's manifest
STAMP = ".zeroband-setup"  # scripts/setup.sh: in the venv, the digest of what it was set up from
SETUP_INPUTS = ("pyproject.toml", "requirements.lock", "scripts/setup.sh")  # what that digest covers, in order
SUBPROCESS_S = 5.0
IN_WORKDIR = "ZEROBAND_HOST_SCRIPT_IN_WORKDIR"  # set by runner.run_host_script when it started it in the workdir


# ---- digests shared with the console ----------------------------------------------------------------------------
def blob_id(path):
    """The file's git blob id (sha1 of "blob SIZE\\0" + content): comparable with `git ls-tree` without git."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def digest_of(entries):
    """A short digest of (relative path, blob id) pairs, whatever their order."""
    h = hashlib.sha256()
    for path, blob in sorted(entries):
        h.update(("%s\0%s\n" % (path, blob)).encode())
    return h.hexdigest()[:12]


def engine_files(root):
    """(relative path, absolute path) of every engine/**/*.py under root (caches skipped), sorted."""
    out = []
    base = os.path.join(root, "engine")
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in files:
            if name.endswith(".py"):
                full = os.path.join(folder, name)
                out.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return sorted(out)


def engine_digest(root):
    """(digest, file count) of root's engine/**/*.py, or (None, 0) when root has no engine folder."""
    if not os.path.isdir(os.path.join(root, "engine")):
        return None, 0
    files = engine_files(root)
    return digest_of((rel, blob_id(full)) for rel, full in files), len(files)


def setup_digest(root):
    """What scripts/setup.sh writes into VENV/.zeroband-setup: `sha256sum pyproject.toml requirements.lock
    scripts/setup.sh | sha256sum | cut -c1-16`, or None when any of them is missing."""
    lines = []
    for rel in SETUP_INPUTS:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                lines.append("%s  %s\n" % (hashlib.sha256(f.read()).hexdigest(), rel))
        except OSError:
            return None
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]


def machine_id():
    """This machine's identity: with a folder's real path it says "the console's own checkout". /etc/machine-id (or
    the host name) and the kernel's boot id: machines cloned from one image often share the first, never the second."""
    def first_line(*paths):
        for path in paths:
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text:
                return text
        return None
    machine = first_line("/etc/machine-id", "/var/lib/dbus/machine-id") or socket.gethostname()
    boot = first_line("/proc/sys/kernel/random/boot_id")
    return machine + "/" + boot if boot else machine


def the_workdir(a):
    """The workdir's real path. runner.run_host_script starts the script inside it when it exists (and says so): a
    relative workdir is then the current folder, not a folder under it; otherwise it is resolved from where the
    script runs (the login folder over SSH, the console's folder locally), as the engine's `cd` would."""
    if os.environ.get(IN_WORKDIR):
        return os.path.realpath(os.getcwd())
    return os.path.realpath(os.path.expanduser(a["workdir"]))


# ---- facts ------------------------------------------------------------------------------------------------------
def here(workdir, path):
    """A path as the engine sees it: relative to the workdir unless absolute; ~ is this user's home."""
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(workdir, path)


def package_versions(names):
    try:
        from importlib import metadata
    except ImportError:  # python < 3.8: too old anyway, and said so
        return dict((name, None) for name in names)
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 -- PackageNotFoundError, or a broken install: either way not usable
            out[name] = None
    return out


def git_commit(workdir):
    if not os.path.exists(os.path.join(workdir, ".git")):
        return None
    try:
        done = subprocess.run(["git", "-C", workdir, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=SUBPROCESS_S)
    except (OSError, subprocess.SubprocessError):
        return None
    text = done.stdout.decode(errors="replace").strip()
    return text if done.returncode == 0 and text else None


def gpus(fake, visible):
    """How many GPUs the engine will find and the memory of the smallest (bytes; None where unknown): NVML's (nvidia-smi
    without the NVML bindings), the count limited by CUDA_VISIBLE_DEVICES; `fake` (ZEROBAND_FAKE_GPUS, "COUNT" or
    "COUNTxGIB", e.g. "8x80") replaces both, for tests on machines without a GPU."""
    if fake is not None:
        count, _, size = str(fake).lower().partition("x")
        memory = int(float(size.strip().rstrip("gib") or 0) * 2 ** 30) or None
        count, source, note = int(count), "fake (ZEROBAND_FAKE_GPUS)", None
    else:
        count, source, note, memory = nvml_count()
    if visible is not None and count:
        count = min(count, len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]))
    return {"count": count, "source": source, "note": note, "memory": memory if count else None}


def nvml_count():
    """(count, source, note, the smallest GPU's total memory in bytes or None)."""
    try:
        import pynvml  # nvidia-ml-py: a dependency of the project, so on every host the engine runs on
    except ImportError:
        return smi_count("no NVML bindings (nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            sizes = [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
                     for i in range(count)]
            return count, "nvml", None, min(sizes) if sizes else None
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 -- NVMLError_LibraryNotFound, DriverNotLoaded...: no usable GPU
        return 0, "nvml", str(e) or type(e).__name__, None


def smi_count(why):
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=SUBPROCESS_S)
    except (OSError, subprocess.SubprocessError):
        return 0, "none", why + "; no nvidia-smi", None
    sizes = [int(float(ln)) * 2 ** 20 for ln in done.stdout.decode(errors="replace").split()
             if ln.replace(".", "", 1).isdigit()]  # MiB, one line per GPU
    return len(sizes), "nvidia-smi", why, min(sizes) if sizes else None


def cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_disk(path):
    """Free bytes for this user on the file system that holds path (its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return {"path": probe, "free": None, "error": e.strerror}
    return {"path": probe, "free": st.f_bavail * st.f_frsize, "error": None}


def data_fact(workdir, path):
    """Whether a data path exists (a glob: matches something) and, for a prepared folder, its manifest's sha256."""
    import glob

    full = here(workdir, path)
    if any(c in path for c in "*?["):
        return {"path": full, "exists": bool(glob.glob(full, recursive=True)), "manifest": None}
    manifest = None
    if os.path.isfile(os.path.join(full, MANIFEST)):
        with open(os.path.join(full, MANIFEST), "rb") as f:
            manifest = hashlib.sha256(f.read()).hexdigest()[:12]
    return {"path": full, "exists": os.path.exists(full), "manifest": manifest}


def interfaces():
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except (AttributeError, OSError):
        try:
            return sorted(os.listdir("/sys/class/net"))
        except OSError:
            return []


def bind_error(address, port):
    """None if this host can listen on address:port now; else the error ("EADDRINUSE: Address already in use")."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        # the store sets it too: a port in TIME_WAIT after the last run is free for it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, int(port)))
        s.listen(1)
        return None
    except OSError as e:
        return describe(e)
    finally:
        s.close()


def peer_address(route_to):
    """[address, port]: this host's address on the route to [address, port] (where the engine's gloo listens) and a
    port free on it now; None when there is no such route."""
    if not route_to:
        return None
    try:
        try:  # IPv4 where the name has an IPv4 address, as the engine resolves the store (engine/store/server.py)
            info = socket.getaddrinfo(route_to[0], int(route_to[1]), socket.AF_INET, socket.SOCK_DGRAM)
        except socket.gaierror:
            info = socket.getaddrinfo(route_to[0], int(route_to[1]), socket.AF_UNSPEC, socket.SOCK_DGRAM)
        family, target = info[0][0], info[0][4]
        with socket.socket(family, socket.SOCK_DGRAM) as u:
            u.connect(target)  # UDP: sends nothing, picks the route
            address = u.getsockname()[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            return [address, s.getsockname()[1]]
    except OSError:
        return None


def describe(e):
    name = errno.errorcode.get(e.errno or 0, "")
    text = e.strerror or str(e)
    return "%s: %s" % (name, text) if name else text


def facts(a):
    workdir = the_workdir(a) if a.get("workdir") else os.getcwd()
    has_workdir = os.path.isdir(workdir)
    digest, count = engine_digest(workdir) if has_workdir else (None, 0)
    venv = a.get("venv")
    stamp = None
    if venv:
        try:
            with open(os.path.join(here(workdir, venv), STAMP)) as f:
                stamp = f.read().strip()
        except OSError:
            stamp = None
    out = {
        "python": list(sys.version_info[:3]), "executable": sys.executable, "machine": machine_id(),
        "workdir": workdir if has_workdir else None,
        "config": os.path.isfile(here(workdir, a["config"])) if a.get("config") else None,
        "engine": digest, "engine_files": count, "git": git_commit(workdir) if has_workdir else None,
        "packages": package_versions(a.get("packages", [])),
        "stamp": stamp, "stamp_want": setup_digest(workdir) if has_workdir else None,
        "gpus": gpus(a.get("fake_gpus"), a.get("cuda_visible")), "cpus": cpus(),
        "disk": free_disk(here(workdir, a.get("run_dir") or ".")),
        "data": [data_fact(workdir, p) for p in a.get("data", [])],
        "interfaces": interfaces(),
        "binds": [[address, port, bind_error(address, port)] for address, port in a.get("binds", [])],
        "peer": peer_address(a.get("route_to")),
    }
    out["time"] = time.time()  # last: the console brackets it between sending this script and reading its answer
    return out


# ---- the link test ----------------------------------------------------------------------------------------------
def listen(a):
    """Listen on every [address, port]; accept and close until `expect` connections or `seconds` have passed."""
    import selectors

    sel = selectors.DefaultSelector()
    bound, accepted = [], 0
    for address, port in a["binds"]:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, int(port)))
            s.listen(64)
        except OSError as e:
            bound.append([address, port, describe(e)])
            s.close()
            continue
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        bound.append([address, port, None])
    deadline = time.time() + float(a["seconds"])
    while sel.get_map() and accepted < int(a.get("expect", 1 << 30)) and time.time() < deadline:
        for key, _ in sel.select(timeout=max(0.0, min(0.2, deadline - time.time()))):
            try:
                conn, _ = key.fileobj.accept()
            except OSError:
                continue
            accepted += 1
            try:  # let the dialler close first: the TIME_WAIT stays on its side, not on the store's port
                conn.settimeout(1.0)
                conn.recv(1)
            except OSError:
                pass
            conn.close()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return {"bound": bound, "accepted": accepted}


def connect_one(address, port, deadline, result):
    last = None
    while True:
        left = deadline - time.time()
        if left <= 0:
            result.append(last or ["timeout", "no answer"])
            return
        try:
            socket.create_connection((address, int(port)), timeout=left).close()
            result.append(["connected", None])
            return
        except socket.timeout:
            result.append(["timeout", "no answer within the time"])
            return
        except ConnectionRefusedError as e:
            last = ["refused", describe(e)]  # the listener may not be up yet: try again until the deadline
        except socket.gaierror as e:
            result.append(["unresolved", "%s: %s" % (address, e.strerror or e)])
            return
        except OSError as e:
            if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                result.append(["unreachable", describe(e)])
                return
            last = ["error", describe(e)]
        time.sleep(min(0.2, max(0.0, deadline - time.time())))


def connect(a):
    deadline = time.time() + float(a["seconds"])
    results = [[] for _ in a["targets"]]
    threads = [threading.Thread(target=connect_one, args=(address, port, deadline, results[i]), daemon=True)
               for i, (address, port) in enumerate(a["targets"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(a["seconds"]) + 5)
    return {"links": [[address, port] + (r[0] if r else ["timeout", "no answer"])
                      for (address, port), r in zip(a["targets"], results)]}


# ---- sync's view of the workdir -----------------------------------------------------------------------------------
def files(a):
    root = the_workdir(a)
    named = set(a["paths"])
    out = {}
    for rel in a["paths"]:
        full = os.path.join(root, rel)
        if os.path.isfile(full) and not os.path.islink(full):
            out[rel] = [blob_id(full), bool(os.stat(full).st_mode & 0o100)]
        else:
            out[rel] = None
    stray = [rel for rel, _ in engine_files(root) if rel not in named]
    return {"workdir": root, "machine": machine_id(), "files": out, "stray": stray}


def venv(a):
    """What sync needs to decide whether scripts/setup.sh must run for this python (the venv's)."""
    workdir = the_workdir(a)
    stamp = None
    try:
        with open(os.path.join(here(workdir, a["venv"]), STAMP)) as f:
            stamp = f.read().strip()
    except OSError:
        pass
    return {"python": list(sys.version_info[:3]), "packages": package_versions(a.get("packages", [])),
            "stamp": stamp, "stamp_want": setup_digest(workdir), "gpus": gpus(a.get("fake_gpus"), None)["count"]}


def main(a):
    sys.path[:0] = [p for p in (a.get("pythonpath") or "").split(os.pathsep) if p]  # as the engine will see it
    mode = a.get("mode", "facts")
    result = {"facts": facts, "listen": listen, "connect": connect, "files": files, "venv": venv}[mode](a)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__" and "ARGS" in globals():
    main(globals()["ARGS"])  # set by the line the console puts before this file
