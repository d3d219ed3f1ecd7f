"""What the preflight concludes: pure functions from what each host reported (console/preflight/host_script.py) and what
the console expects, to one Problem per thing to fix. No I/O here; tests/test_preflight.py feeds it facts.

    problems = judge(plans, results, expect)     # [Problem(host, kind, what, fix)], in profile order
    problem.line()                               # "node-b: torch is not installed ...; fix: zeroband-console P sync"
    summary(plans, results, expect)              # the table `check` prints when nothing is wrong
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from console.transport.base import without_backoff

MIN_PYTHON = (3, 11)  # pyproject.toml requires-python
PACKAGES = ("torch", "transformers", "pydantic", "numpy")  # what the engine imports first; torch's version is compared


@dataclass(frozen=True)
class Problem:
    host: str
    # reach, python, workdir, version, packages, torch, devices, memory, disk, data, manifest, iface, clock, bind, link
    kind: str
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.host}: {self.what}; fix: {self.fix}"


@dataclass(frozen=True)
class Target:
    """A port a host must listen on (bind) or reach (link)."""
    address: str
    port: int
    what: str  # "the store", "etcd member node-a"...

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class HostPlan:
    """What the console asks of one host (built from the profile by console/preflight/runner.py)."""
    name: str
    roles: frozenset[str]  # "engine", "store", "etcd"
    python: str  # the interpreter the engine runs with (venv/bin/python when the profile names a venv)
    venv: str | None
    workdir: str
    run_dir: str
    config: str
    data: tuple[tuple[str, str], ...] = ()  # (setting, path): ("data.path", "corpus/x.jsonl"), ("data.tokenizer", ...)
    device: str | None = None  # inner.device: auto, cpu, cuda (None: the engine config could not be read here)
    workers: int = 1
    ifnames: tuple[tuple[str, str], ...] = ()  # (NCCL_SOCKET_IFNAME, "eth0")...
    binds: tuple[Target, ...] = ()
    links: tuple[Target, ...] = ()
    engine_config: Any = None  # the engine's Config for this host (None: unreadable here): the memory estimate's input

    @property
    def engine(self) -> bool:
        return "engine" in self.roles


@dataclass
class HostResult:
    """What came back from one host: its facts (None if it could not be asked) and the link test."""
    name: str
    reach: str | None = None  # why the host could not be reached (or its script not run)
    facts: dict[str, Any] | None = None
    python_missing: bool = False  # the profile's python did not run; facts came from python3 if at all
    script_error: str | None = None
    sent: float = 0.0  # the console's clock around the host script (the host's clock is read in between)
    received: float = 0.0
    links: list[list[Any]] = field(default_factory=list)  # [address, port, status, detail] per Target
    listening: set[str] = field(default_factory=set)  # targets a listener of the check held during the link test
    peers: list[Target] = field(default_factory=list)  # the other engine hosts' collectives it dialled


@dataclass(frozen=True)
class Expect:
    """The console's side: its checkout's version, its torch, the profile's limits."""
    profile: str
    engine: str | None  # the engine digest every host must have (console/preflight/checkout.py)
    label: str  # "commit 1a2b3c4d5e" for the lines
    torch: str | None  # the console's installed torch (metadata), None if it has none: then the hosts' majority
    min_free_gb: float = 2.0
    max_clock_skew: float = 3.0
    machine: str | None = None
    root: str | None = None  # the console's checkout: a host folder that is this one is the console's version


def judge(plans: Sequence[HostPlan], results: dict[str, HostResult], expect: Expect) -> list[Problem]:
    torch = expect.torch or _majority([_torch(results[p.name]) for p in plans if p.name in results])
    out: list[Problem] = []
    for plan in plans:
        out += judge_host(plan, results[plan.name], expect, torch)
    out += judge_manifests(plans, results)
    out += _edited_checkout(plans, results, expect)
    order = {p.name: i for i, p in enumerate(plans)}
    return sorted(out, key=lambda p: order.get(p.host, len(order)))  # stable: a host's lines stay in check order


def judge_host(plan: HostPlan, result: HostResult, expect: Expect, torch: str | None) -> list[Problem]:
    if result.reach is not None:
        return [_unreachable(plan, result.reach)]
    out = []
    if result.python_missing:
        out.append(_python_missing(plan, expect))
    if result.facts is None:
        if result.script_error:
            out.append(Problem(plan.name, "python", f"the check could not run on the host: {result.script_error}",
                               f"run `{plan.python} -V` there; the check needs a python 3"))
        return out
    f = result.facts
    if not result.python_missing:
        out += _python(plan, f, expect, torch)
    out += _project(plan, f, expect)
    out += _machine(plan, f, expect, result)
    out += _network(plan, f, result)
    return out


def _unreachable(plan: HostPlan, reason: str) -> Problem:
    reason = without_backoff(reason)  # the transport's backoff: not part of a verdict
    what, _, hint = reason.partition("; ")  # the transport's host-key lines carry their own fix after "; "
    if hint:
        return Problem(plan.name, "reach", what, hint)
    if reason.startswith("jump host "):
        fix = f"check hosts.{plan.name}.jump_host (try ssh to it)"
    elif "ssh_config" in reason:
        fix = f"create it or fix hosts.{plan.name}.ssh_config"
    elif "authentication failed" in reason:
        fix = f"check hosts.{plan.name}.user and identity_file (its public key must be in the host's authorized_keys)"
    elif "is not a private key" in reason:
        fix = f"point hosts.{plan.name}.identity_file at the private key (the file without .pub)"
    elif "identity_file" in reason:
        fix = f"create the key (ssh-keygen) or point hosts.{plan.name}.identity_file at an existing one"
    else:
        fix = f"check that the host is up and hosts.{plan.name}'s address and port (try ssh to it)"
    return Problem(plan.name, "reach", reason, fix)


def _python_missing(plan: HostPlan, expect: Expect) -> Problem:
    if plan.venv:
        return Problem(plan.name, "python", f"the venv {plan.venv} does not exist (no {plan.python})",
                       f"zeroband-console {expect.profile} sync (scripts/setup.sh makes it), or fix "
                       f"hosts.{plan.name}.venv")
    return Problem(plan.name, "python", f"python {plan.python} not found",
                   f"install Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+ there or set hosts.{plan.name}.python / venv")


def _python(plan: HostPlan, f: dict[str, Any], expect: Expect, torch: str | None) -> list[Problem]:
    version = tuple(f["python"][:2])
    if version < MIN_PYTHON:
        return [Problem(plan.name, "python", f"{plan.python} is Python {'.'.join(map(str, f['python']))}, the engine "
                        f"needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+",
                        f"set hosts.{plan.name}.venv (sync makes one) or python to a newer interpreter")]
    fix = (f"zeroband-console {expect.profile} sync (it runs scripts/setup.sh in the venv)" if plan.venv else
           f"set hosts.{plan.name}.venv (sync makes it with scripts/setup.sh) or install them for {plan.python}")
    missing = [name for name, v in f["packages"].items() if v is None]
    if missing:
        return [Problem(plan.name, "packages", f"{', '.join(missing)} not installed for {plan.python}", fix)]
    theirs = f["packages"].get("torch")
    if torch and theirs and not same_torch(theirs, torch):
        whose = "the console's" if expect.torch else "most hosts'"
        return [Problem(plan.name, "torch", f"torch {theirs} for {plan.python}, {whose} is {torch}", fix)]
    return []


def _project(plan: HostPlan, f: dict[str, Any], expect: Expect) -> list[Problem]:
    sync = f"zeroband-console {expect.profile} sync"
    if f["workdir"] is None:
        return [Problem(plan.name, "workdir", f"the workdir {plan.workdir} does not exist",
                        f"{sync} (it creates it and puts the project there), or fix hosts.{plan.name}.workdir")]
    out = []
    if not _own(f, expect) and f["engine"] != expect.engine:
        host = (f"commit {f['git'][:10]}, " if f.get("git") else "") + \
               (f"engine {f['engine']}" if f["engine"] else "no engine/ folder")
        out.append(Problem(plan.name, "version", f"the project in {f['workdir']} is not the console's (host: {host}; "
                           f"console: {expect.label}, engine {expect.engine})", sync))
    if f["config"] is False:
        out.append(Problem(plan.name, "workdir", f"engine config {plan.config} not found in {f['workdir']}",
                           f"{sync}, or fix engine.config"))
    if plan.engine:
        for (setting, path), fact in zip(plan.data, f["data"]):
            if not fact["exists"]:
                out.append(Problem(plan.name, "data", f"{setting} {path} does not exist on the host ({fact['path']})",
                                   f"copy it there (the same folder on every host), or set "
                                   f"hosts.{plan.name}.overrides.\"{setting}\""))
    return out


def _own(f: dict[str, Any], expect: Expect) -> bool:
    """The host's folder is the console's own checkout (the same machine and real path)."""
    return expect.root is not None and expect.machine == f["machine"] and f["workdir"] == expect.root


def _edited_checkout(plans: Sequence[HostPlan], results: dict[str, HostResult], expect: Expect) -> list[Problem]:
    """Engines in the console's own checkout run its files as they are on disk; `sync` sends the other hosts its
    commit. Edits to engine/**/*.py not committed (or new files) would have this machine's nodes run other code
    than the others' (a new module: the others fail at import), so they are a problem where there are others."""
    facts = {p.name: f for p in plans if p.engine and (f := results[p.name].facts)}
    own = [n for n, f in facts.items() if _own(f, expect)]
    if not own or len(own) == len(facts) or expect.engine is None:
        return []
    edited = [n for n in own if facts[n]["engine"] != expect.engine]
    return [Problem(n, "version", f"the console's checkout {expect.root} has engine files that differ from its "
                    f"{expect.label} (engine {facts[n]['engine']} on disk, {expect.engine} committed): this node would "
                    f"run them, and the other hosts the commit", "commit them and sync, or stash them")
            for n in edited]


def _machine(plan: HostPlan, f: dict[str, Any], expect: Expect, result: HostResult) -> list[Problem]:
    out = []
    if plan.engine and plan.device is not None:
        out += _devices(plan, f, expect)
    disk = f["disk"]
    if disk["free"] is not None and disk["free"] < expect.min_free_gb * 1e9:
        out.append(Problem(plan.name, "disk", f"{disk['free'] / 1e9:.1f} GB free under {disk['path']} "
                           f"(check.min_free_gb = {expect.min_free_gb:g})",
                           "free some space there, or point run.dir at a larger disk"))
    skew = clock_skew(f["time"], result.sent, result.received)
    if abs(skew) > expect.max_clock_skew:
        out.append(Problem(plan.name, "clock", f"the clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} "
                           f"the console's (check.max_clock_skew = {expect.max_clock_skew:g} s; time-based rounds "
                           "compare clocks)", "sync it with NTP (timedatectl set-ntp true, or chrony)"))
    return out


def _devices(plan: HostPlan, f: dict[str, Any], expect: Expect) -> list[Problem]:
    gpus = f["gpus"]
    on_gpu = plan.device == "cuda" or (plan.device == "auto" and gpus["count"] > 0)
    if on_gpu and plan.workers > gpus["count"]:
        seen = f"{gpus['source']} sees {gpus['count']} GPU{'' if gpus['count'] == 1 else 's'}" + \
               (f" ({gpus['note']})" if gpus["note"] and not gpus["count"] else "")
        return [Problem(plan.name, "devices", f"workers = {plan.workers} on inner.device {plan.device} but {seen}",
                        f"set hosts.{plan.name}.workers to at most {gpus['count']} (the same on every host of a "
                        f"DiLoCo run), fix the GPUs (nvidia-smi), or set inner.device = \"cpu\"")]
    torch = (f.get("packages") or {}).get("torch") or ""
    if on_gpu and gpus["count"] and torch.endswith("+cpu"):  # auto would train on the CPU, cuda would fail
        plural = "" if gpus["count"] == 1 else "s"
        return [Problem(plan.name, "torch", f"torch {torch} for {plan.python} is the CPU build, but inner.device "
                        f"{plan.device} and {gpus['source']} sees {gpus['count']} GPU{plural}",
                        f"zeroband-console {expect.profile} sync installs the CUDA build where nvidia-smi works "
                        f"(or set hosts.{plan.name}.venv to a venv with it)")] + _memory(plan, gpus)
    if not on_gpu and plan.workers > f["cpus"]:
        return [Problem(plan.name, "devices", f"workers = {plan.workers} on the CPU but the host has {f['cpus']} CPUs",
                        f"set hosts.{plan.name}.workers to at most {f['cpus']}")]
    return _memory(plan, gpus) if on_gpu else []


def _memory(plan: HostPlan, gpus: dict[str, Any]) -> list[Problem]:
    """The memory estimate (engine/memory.py, torch-free) against the host's smallest GPU: one line naming the
    largest part and the first setting that would fit."""
    from engine.memory import GiB, budget, estimate, fitting

    if plan.engine_config is None or not gpus.get("memory"):
        return []
    try:
        est = estimate(plan.engine_config, workers=plan.workers, device="cuda")
    except ValueError:
        return []  # a model or tokenizer the estimate cannot read: the engine's own start says what is wrong
    room = budget(gpus["memory"])
    if est.per_gpu <= room:
        return []
    top = est.largest()
    fit = fitting(plan.engine_config, plan.workers, gpus["memory"])
    return [Problem(plan.name, "memory", f"the estimate is {est.per_gpu / GiB:.1f} GiB per GPU (largest: {top.name} "
                    f"{top.bytes / GiB:.1f} GiB), more than the {room / GiB:.1f} GiB usable of the "
                    f"{gpus['memory'] / GiB:.0f} GiB GPUs {gpus['source']} sees",
                    f"set {fit} (python -m engine.train CONFIG --dry-run shows the table)" if fit else
                    "a larger GPU, more workers with a sharded inner.strategy, or a smaller model")]


def _network(plan: HostPlan, f: dict[str, Any], result: HostResult) -> list[Problem]:
    out = []
    for var, value in plan.ifnames:
        if not ifname_matches(var, value, f["interfaces"]):
            out.append(Problem(plan.name, "iface", f"{var}={value} names no interface of the host (it has "
                               f"{', '.join(f['interfaces']) or 'none'})",
                               f"set hosts.{plan.name}.env.{var} to the interface on the route to the other hosts"))
    for address, port, error in f["binds"]:
        target = next((t for t in plan.binds if (t.address, t.port) == (address, port)), None)
        if error is None or target is None:
            continue
        fix = ("set store.bind (or store.address) to one of the host's addresses" if "EADDRNOTAVAIL" in error else
               f"end what listens there (ss -ltnp 'sport = :{port}') or choose another port in [store]")
        out.append(Problem(plan.name, "bind", f"cannot listen on {address}:{port} for {target.what}: {error}", fix))
    for address, port, status, detail in result.links:
        target = next((t for t in [*plan.links, *result.peers] if (t.address, t.port) == (address, port)), None)
        if target is None or status == "connected":
            continue
        if status == "refused" and f"{address}:{port}" not in result.listening:
            continue  # nothing of ours listened there (the store host has its own line): the path itself is open
        why = {"timeout": "no answer (a firewall drops it?)", "refused": "refused while the check listened there"}
        fix = (f"open TCP {port} from this host to {address} (firewall, security group), or set store.address to an "
               "address this host reaches") if target in plan.links else (
               f"open TCP from this host to {address} on every port (gloo listens on one the system picks; "
               f"firewall, security group)")
        out.append(Problem(plan.name, "link", f"cannot reach {target.what} at {address}:{port}: "
                           f"{why.get(status, detail)}", fix))
    return out


def judge_manifests(plans: Sequence[HostPlan], results: dict[str, HostResult]) -> list[Problem]:
    """A prepared folder must be the same on every engine host (a copy of one prepare, compared by its manifest)."""
    out = []
    seen: dict[str, list[tuple[str, str, str]]] = {}  # setting -> [(host, path, manifest digest)]
    for plan in plans:
        facts = results[plan.name].facts if plan.name in results else None
        if not plan.engine or facts is None or results[plan.name].reach:
            continue
        for (setting, path), fact in zip(plan.data, facts["data"]):
            if fact["manifest"]:
                seen.setdefault(setting, []).append((plan.name, path, fact["manifest"]))
    for setting, hosts in seen.items():
        common = _majority([digest for _, _, digest in hosts])
        first = next(h for h in hosts if h[2] == common)
        for host, path, digest in hosts:
            if digest != common:
                out.append(Problem(host, "manifest", f"{setting} {path} differs from {first[0]}'s {first[1]} "
                                   f"(manifest {digest} vs {common}): not the same prepared data",
                                   "copy one prepared folder to every host (python -m engine.data verify DIR "
                                   "checks a copy)"))
    return out


# ---- over the internet ------------------------------------------------------------------------------------------
CGNAT = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (Tailscale's addresses): not private to Python


def exposed(address: str) -> bool | None:
    """Whether a listener on address may be reached from the internet: every interface (0.0.0.0, ::), or an
    address that is not private (RFC 1918, loopback, link-local, CGNAT 100.64/10, ULA fc00::/7; Python counts the
    documentation ranges as private too). None: not an address (a name resolved nowhere)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    return ip.is_unspecified or not (ip.is_private or ip in CGNAT)


def exposure_warning(listeners: Sequence[tuple[str, str]]) -> str | None:
    """One warning for the run (or None) naming each (what, address) that listens beyond a private network: the
    TCP store and gloo's connections carry no authentication and no encryption. The ways to close it."""
    open_ = [f"{what} on {address}" + (" (every interface)" if address.strip("[]") in ("0.0.0.0", "::") else "")
             for what, address in listeners if exposed(address)]
    if not open_:
        return None
    return (f"warning: listening on an address that is not private, with no authentication and no encryption (the "
            f"TCP store, gloo): {'; '.join(open_)}. Whoever reaches them can join or steer the run and read its "
            "updates. Close it: etcd with TLS for the store (store.backend = \"etcd\"), a VPN between the hosts such "
            "as WireGuard (their VPN addresses in the profile), or the store bound to a private address (store.bind); "
            "docs/operations.md, \"Over the internet\"")


# ---- small pure pieces ----------------------------------------------------------------------------------------
def clock_skew(remote: float, sent: float, received: float) -> float:
    """How far the host's clock is from the console's: 0 when it read a time between sending and receiving."""
    if remote < sent:
        return remote - sent
    if remote > received:
        return remote - received
    return 0.0


def ifname_matches(var: str, value: str, names: Sequence[str]) -> list[str]:
    """The interfaces a socket-interface variable selects. NCCL: a comma list of prefixes, `=` for exact names,
    `^` to exclude; gloo: exact names."""
    text = value.strip()
    exclude = var.startswith("NCCL") and text.startswith("^")
    text = text[1:] if exclude else text
    exact = not var.startswith("NCCL") or text.startswith("=")
    patterns = [p.strip() for p in text.lstrip("=").split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)
    if exclude:
        return [n for n in names if n != "lo" and not hit(n)]
    return [n for n in names if hit(n)]


def same_torch(a: str, b: str) -> bool:
    return a.split("+", 1)[0] == b.split("+", 1)[0]  # 2.13.0+cu128 and 2.13.0+cpu are the same torch


def _torch(result: HostResult) -> str | None:
    return (result.facts or {}).get("packages", {}).get("torch")


def _majority(values: Sequence[str | None]) -> str | None:
    present = [v for v in values if v]
    return Counter(present).most_common(1)[0][0] if present else None


# ---- the summary table ------------------------------------------------------------------------------------------
COLUMNS = ("host", "roles", "python", "torch", "project", "devices", "free disk", "data", "links", "clock")


def summary(plans: Sequence[HostPlan], results: dict[str, HostResult], expect: Expect) -> list[str]:
    rows = [COLUMNS] + [_row(p, results[p.name], expect) for p in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _row(plan: HostPlan, result: HostResult, expect: Expect) -> tuple[str, ...]:
    f = result.facts or {}
    if not f:
        return (plan.name, ",".join(sorted(plan.roles)), *(["-"] * (len(COLUMNS) - 2)))
    py = ".".join(map(str, f["python"]))
    own = _own(f, expect)
    gpus = f["gpus"]
    on_gpu = plan.device == "cuda" or (plan.device == "auto" and gpus["count"] > 0)
    devices = (f"{plan.workers}/{gpus['count']} GPU" if on_gpu else f"{plan.workers}/{f['cpus']} CPU") \
        if plan.engine else "-"
    data = ", ".join("prepared " + d["manifest"] if d["manifest"] else "ok" for d in f["data"]) \
        if plan.engine and f["data"] else "-"
    statuses = [status for _, _, status, _ in result.links]  # the store's first, then the peers'
    links = (f"{len(statuses)} connected" if len(statuses) > 1 and set(statuses) == {"connected"} else
             ", ".join(statuses) or "-")
    skew = clock_skew(f["time"], result.sent, result.received)
    return (plan.name, ",".join(sorted(plan.roles)), py, f["packages"].get("torch") or "-",
            "this checkout" if own else f"engine {f['engine']}", devices,
            f"{f['disk']['free'] / 1e9:.0f} GB" if f["disk"]["free"] is not None else "?", data, links,
            f"{skew:+.1f} s")
