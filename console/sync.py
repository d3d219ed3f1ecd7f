"""`zeroband-console PROFILE sync`: the console's checkout onto every host, then the project's set-up there.

    ok = await sync(profile, make_transport, say=print)      # a progress line per host and step; False: a host failed

Every destination at once (a host's workdir; with `[sync] shared_fs` one folder for all hosts, written through the
first that answers; hosts on this machine share a folder by its real path):

1. connect; make the workdir; the host script's `files` mode answers the git blob id and executable bit of each of
   HEAD's tracked files there, and the engine/**/*.py files HEAD does not have;
2. send what differs, HEAD's content (git cat-file: the working tree may hold edits that are not the commit),
   over SFTP on the host's SSH connection (a file write on this machine), each file to a temporary name and
   renamed over (a reader never sees half a file); remove those stray engine files (the version `check` compares
   covers every engine/**/*.py). Nothing is sent to a host that has it all: a second sync moves nothing;
3. the venv the host's profile names, when missing or stale (no scripts/setup.sh stamp for these pyproject.toml,
   requirements.lock and setup.sh, a package missing, another torch than the console's): scripts/setup.sh runs
   there with VENV, PYTHON and `[sync] setup_env` (its values travel on stdin, never in a command line) and
   installs the lock's versions. Without BASE_SITE (a site-packages on the host that has the packages, linked into
   the venv) setup downloads packages: a host that cannot reach the registry gets one line saying so and setup is
   not tried.

The console's own checkout is never written (a local host whose workdir is it): it is the version by definition.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import urlsplit

from console.preflight.checkout import Checkout, CheckoutError, TrackedFile
from console.dependency_warnings import without_dependency_warnings
from console.preflight.rules import PACKAGES, same_torch
from console.preflight.runner import FALLBACK_PYTHON, console_torch, identity_missing, run_host_script
from console.profile import HostSpec, Profile
from console.transport import Transport, TransportError
from console.transport import commands as C

REGISTRY = ("pypi.org", 443)  # where scripts/setup.sh's pip goes unless PIP_INDEX_URL or a proxy says otherwise
REGISTRY_TIMEOUT_S = 5.0
SETUP = "scripts/setup.sh"


@dataclass
class Destination:
    """One folder to fill: the hosts that see it, in profile order (the first that answers writes)."""
    key: str
    hosts: list[HostSpec]

    @property
    def label(self) -> str:
        return self.hosts[0].name if len(self.hosts) == 1 else "+".join(h.name for h in self.hosts)


def destinations(profile: Profile) -> list[Destination]:
    out: dict[str, Destination] = {}
    for host in profile.hosts.values():
        if host.transport == "local":
            key = "local:" + os.path.realpath(os.path.expanduser(host.workdir))
        elif profile.sync.shared_fs:
            key = "shared:" + host.workdir
        else:  # nodes of one machine (one address, user and port) in one folder are one destination: written once
            key = f"ssh:{host.user or ''}@{host.target}:{host.port or ''}:{host.workdir}"
        out.setdefault(key, Destination(key, [])).hosts.append(host)
    return list(out.values())


async def sync(profile: Profile, make: Callable[[HostSpec], Transport], say: Callable[[str], None]) -> bool:
    checkout = Checkout.find()
    if checkout is None or not checkout.is_git:
        say("sync: the console does not run from a git checkout: there is nothing to send (clone the project and "
            "run zeroband-console from it)")
        return False
    try:
        tracked = checkout.files
        edited = checkout.changed()
    except CheckoutError as e:
        say(f"sync: {e}")
        return False
    say(f"sync: {checkout.label()}, {len(tracked)} files ({_size(sum(f.size for f in tracked))}) to "
        f"{len(profile.hosts)} host(s)")
    if edited:
        say(f"sync: {len(edited)} tracked file(s) here differ from the commit ({', '.join(edited[:3])}"
            f"{', ...' if len(edited) > 3 else ''}): the hosts get the commit's version (commit to send them)")
    transports = {h.name: make(h) for h in profile.hosts.values()}
    try:
        results = await asyncio.gather(*(_destination(profile, d, transports, checkout, say)
                                         for d in destinations(profile)), return_exceptions=True)
    finally:
        await asyncio.gather(*(t.close() for t in transports.values()), return_exceptions=True)
    ok = True
    for d, result in zip(destinations(profile), results):
        if isinstance(result, BaseException):
            say(f"{d.label}: sync failed: {type(result).__name__}: {result}")
            ok = False
        else:
            ok = ok and result
    say("sync: done" if ok else "sync: not every host is up to date (see the lines above)")
    return ok


async def _destination(profile: Profile, d: Destination, transports: dict[str, Transport], checkout: Checkout,
                       say: Callable[[str], None]) -> bool:
    writer, root, reasons = None, None, []
    for host in d.hosts:  # the first host of a shared folder that answers writes it
        try:
            missing = identity_missing(host)
            if missing:
                raise TransportError(missing, link=True)
            root = await asyncio.wait_for(_workdir(transports[host.name], host), host.connect_timeout * 2 + 10)
            writer = host
            break
        except (TransportError, asyncio.TimeoutError) as e:
            reasons.append(f"{host.name}: cannot reach it: {str(e) or 'timed out'}")
    if writer is None or root is None:
        for line in reasons:
            say(line)
        return False
    t = transports[writer.name]
    try:
        sent = await asyncio.wait_for(_send(t, writer, root, checkout, say, d.label), profile.sync.timeout)
    except (TransportError, asyncio.TimeoutError) as e:
        say(f"{d.label}: sending the files failed: {str(e) or f'timed out after {profile.sync.timeout:g}s'}")
        return False
    if sent is None:  # the console's own checkout
        return True
    ok = True
    venvs: dict[str, HostSpec] = {}
    for host in [writer, *(h for h in d.hosts if h is not writer)]:  # one set-up per venv, the writer's by it
        venvs.setdefault(host.venv or f"python:{host.python}", host)
    for host in venvs.values():
        ok = await _setup(profile, transports[host.name] if host is not writer else t, host, say) and ok
    return ok


async def _workdir(t: Transport, host: HostSpec) -> str:
    """Make the host's workdir; its real path there (SFTP takes no ~ and no relative path)."""
    rc, out, err = await t.run(f"mkdir -p {C.qpath(host.workdir)} && cd {C.qpath(host.workdir)} && pwd -P")
    if rc != 0 or not out.strip():
        raise TransportError(f"cannot make the workdir {host.workdir}: {err.strip() or f'exit status {rc}'}")
    return out.strip().splitlines()[-1]


async def _send(t: Transport, host: HostSpec, root: str, checkout: Checkout, say: Callable[[str], None],
                label: str) -> int | None:
    """Send the tracked files that differ; the number sent, or None for the console's own checkout."""
    started = time.monotonic()
    args = {"mode": "files", "workdir": root, "paths": [f.path for f in checkout.files]}
    rc, answer, error = await run_host_script(t, root, host.python, args, 120)  # the venv may not exist yet
    if answer is None:
        raise TransportError(f"cannot list the files in {root}: {error}")
    if checkout.is_this(answer["machine"], answer["workdir"]):
        say(f"{label}: {root} is the console's own checkout: nothing to send (its venv is scripts/setup.sh's)")
        return None
    there = answer["files"]
    due = [f for f in checkout.files if there.get(f.path) != [f.blob, f.mode == 0o755]]
    stray = answer["stray"]
    if not due and not stray:
        say(f"{label}: {root} is up to date ({len(checkout.files)} files of {checkout.label()})")
        return 0
    say(f"{label}: sending {len(due)} of {len(checkout.files)} files ({_size(sum(f.size for f in due))}) to {root}")
    await _put(t, root, checkout, due)
    if stray:
        rc, _, err = await t.run(f"cd {C.qpath(root)} && rm -f -- {' '.join(C.q(p) for p in stray)}")
        if rc != 0:
            raise TransportError(f"cannot remove {len(stray)} stray engine file(s): {err.strip()}")
        say(f"{label}: removed {len(stray)} engine file(s) the commit does not have: {', '.join(stray[:3])}"
            f"{', ...' if len(stray) > 3 else ''}")
    say(f"{label}: sent {len(due)} file(s) in {time.monotonic() - started:.1f}s")
    return len(due)


async def _put(t: Transport, root: str, checkout: Checkout, due: Sequence[TrackedFile]) -> None:
    batch: list[TrackedFile] = []
    size = 0
    for f in list(due) + [None]:  # batches of ~32 MB: never the whole checkout in memory at once
        if f is not None:
            batch.append(f)
            size += f.size
        if batch and (f is None or size > 32 << 20):
            contents = await asyncio.to_thread(checkout.read, batch)
            await t.put_files(root, [(b.path, contents[b.path], b.mode) for b in batch])
            batch, size = [], 0


# ---- the venv -----------------------------------------------------------------------------------------------------
async def _setup(profile: Profile, t: Transport, host: HostSpec, say: Callable[[str], None]) -> bool:
    why = await _setup_due(t, host)
    if why is None:
        say(f"{host.name}: {host.venv or host.python} is set up")
        return True
    if not host.venv:
        say(f"{host.name}: {host.python}: {why}; set hosts.{host.name}.venv so that sync can make one with {SETUP}, "
            "or install the packages for that python")
        return False
    # FORCE: sync found it due (a package missing, another torch), which setup.sh's stamp alone would not see;
    # TORCH_VERSION: the console's, the build the host's driver calls for (the CPU one or PyPI's CUDA one)
    ours = console_torch()
    env = {"VENV": host.venv, "PYTHON": host.python, "FORCE": "1",
           **({"TORCH_VERSION": ours.split("+", 1)[0]} if ours else {}), **profile.sync.setup_env}
    if "BASE_SITE" not in env:
        blocked = await _registry_blocked(t, host, env)
        if blocked:
            say(f"{host.name}: cannot reach the package registry {blocked} to set up {host.venv} ({why}); give the "
                "host a route or a proxy ([sync] setup_env HTTPS_PROXY or PIP_INDEX_URL), or set [sync] setup_env "
                "BASE_SITE to a site-packages folder on the host that has the packages")
            return False
    say(f"{host.name}: {host.venv}: {why}: running {SETUP} (up to {profile.sync.setup_timeout:g}s)")
    started = time.monotonic()
    command = f"cd {C.qpath(host.workdir)} && set -a && eval \"$(cat)\" && set +a && exec bash {SETUP}"
    try:
        rc, out, err = await t.run(command, timeout=profile.sync.setup_timeout, stdin=C.env_file_text(env).encode())
    except TransportError as e:
        say(f"{host.name}: {SETUP} failed: {e}")
        return False
    lines = without_dependency_warnings(out + err).strip().splitlines()  # not a library's deprecations
    for line in (lines[-20:] if rc != 0 else [ln for ln in lines if ln.startswith("[setup]")]):
        say(f"{host.name}:   {line}")  # setup.sh's own steps; everything pip said when it failed
    if rc != 0:
        say(f"{host.name}: {SETUP} failed with exit status {rc} after {time.monotonic() - started:.0f}s")
        return False
    still = await _setup_due(t, host)
    if still is not None:
        say(f"{host.name}: {SETUP} ran, but {host.venv} still {still}")
        return False
    say(f"{host.name}: {host.venv} set up in {time.monotonic() - started:.0f}s")
    return True


async def _setup_due(t: Transport, host: HostSpec) -> str | None:
    """Why the host's python needs scripts/setup.sh, or None when it is up to date."""
    args = {"mode": "venv", "workdir": host.workdir, "venv": host.venv or ".", "packages": list(PACKAGES),
            "pythonpath": host.env.get("PYTHONPATH"), "fake_gpus": host.env.get("ZEROBAND_FAKE_GPUS")}
    rc, answer, error = await run_host_script(t, host.workdir, host.python_path, args, 60)
    if rc in (126, 127):
        return "does not exist"
    if answer is None:
        return f"does not run ({error})"
    missing = [name for name, v in answer["packages"].items() if v is None]
    if missing:
        return f"lacks {', '.join(missing)}"
    ours, theirs = console_torch(), answer["packages"]["torch"]
    if ours and not same_torch(theirs, ours):
        return f"has torch {theirs}, the console {ours}"
    if answer.get("gpus") and str(theirs).endswith("+cpu"):  # the same version to same_torch, but no CUDA
        return f"has torch {theirs}, the CPU build, on a host with {answer['gpus']} GPU(s)"
    if host.venv and answer["stamp"] != answer["stamp_want"]:
        return ("was set up from another pyproject.toml, requirements.lock or setup.sh" if answer["stamp"] else
                "was not made by setup")
    return None


async def _registry_blocked(t: Transport, host: HostSpec, env: dict[str, str]) -> str | None:
    """'ADDRESS:PORT (why)' when the host cannot open a connection to the registry (or the proxy) pip would use."""
    url = env.get("PIP_INDEX_URL") or env.get("HTTPS_PROXY") or env.get("https_proxy")
    address, port = REGISTRY
    if url:
        parts = urlsplit(url if "//" in url else f"//{url}")
        if parts.scheme == "file":
            return None  # a mirror on the host's own disk: nothing to reach
        address, port = parts.hostname or address, parts.port or (80 if parts.scheme == "http" else 443)
    args = {"mode": "connect", "targets": [[address, port]], "seconds": REGISTRY_TIMEOUT_S}
    _, answer, error = await run_host_script(t, host.workdir, FALLBACK_PYTHON, args, REGISTRY_TIMEOUT_S + 20)
    if answer is None:
        return f"{address}:{port} (the test did not run: {error})"
    _, _, status, detail = answer["links"][0]
    return None if status == "connected" else f"{address}:{port} ({status}: {detail})"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
