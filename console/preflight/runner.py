"""The preflight, run: every host at once over its own transport, each step bounded in time.

    report = await preflight(profile, transport_of, mode="check")    # check: every host; start: the run's hosts
    report.problems                                                   # [Problem]: one line each (rules.py)
    report.table()                                                    # when there are none

1. Per host, at once: connect (the profile's connect_timeout; a missing identity_file is said before trying), then
   the host script (host_script.py) with the profile's python, bounded by `check.timeout`. A python that does not
   run is a problem of its own; the script then runs again with `python3` so the host's other problems are still named.
2. The link test, once every host answered: the store's host (each etcd member's host) listens on the store's
   address and port with a listener the check starts and that ends by itself, after every engine host connected
   or after `check.link_timeout` + 3 s; each engine host opens a TCP connection to it. Where the port is taken, or
   the store of this run already runs (`check` beside a running cluster, `add`), the engine hosts dial what listens.
   Each engine host also listens on the address its outer step's collectives will listen on (gloo binds the one on
   its route to the store) and a free port there, and every other engine host dials it: the engines connect to
   each other directly, and a firewall that lets the store's port through may not let those through (not in
   `add`: the running nodes' hosts hold no listener).
3. rules.judge() turns what came back into problems.

Modes: "check" (every host of the profile; a standby host is checked as an engine host unless it only holds the
store), "start" (the hosts a start uses: active hosts, the store's, the etcd members'), "add" (one host, which
must reach the running store).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable, Sequence

from console.preflight.checkout import Checkout
from console.dependency_warnings import without_dependency_warnings
from console.fleet import Fleet, HostState
from console.preflight import host_script
from console.preflight.rules import (PACKAGES, Expect, HostPlan, HostResult, Problem, Target, exposed,
                                     exposure_warning, judge, summary)
from console.profile import HostSpec, Profile, engine_overrides
from console.store import store_backend
from console.transport import Transport, TransportError
from console.transport import commands as C

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
FAKE_GPUS = "ZEROBAND_FAKE_GPUS"  # in a host's env: replaces NVML's count (tests on machines without a GPU)
FALLBACK_PYTHON = "python3"


@dataclass
class Report:
    plans: list[HostPlan]
    results: dict[str, HostResult]
    expect: Expect
    problems: list[Problem]
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # not problems: the run may start (exposure_warning)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [p.line() for p in self.problems]

    def table(self) -> list[str]:
        return summary(self.plans, self.results, self.expect)


async def preflight(profile: Profile, transport_of: Callable[[str], Transport], *, mode: str = "check",
                    hosts: Sequence[str] | None = None, checkout: Checkout | None = None) -> Report:
    checkout = checkout or Checkout.find()
    notes: list[str] = []
    store_running = mode == "add" or (mode == "check" and await store_backend(profile).runs(transport_of))
    if store_running and mode == "check":
        notes.append("the run's store is running: the engine hosts dialled it instead of a listener of the check")
    plans = build_plans(profile, mode, hosts, checkout, bind=not store_running)
    expect = make_expect(profile, checkout)
    results = dict(zip([p.name for p in plans],
                       await asyncio.gather(*(_ask(profile, p, profile.hosts[p.name], transport_of(p.name))
                                              for p in plans))))
    notes += await _link_test(profile, plans, results, transport_of, listen=not store_running, peers=mode != "add")
    warning = exposure_warning(await listeners(profile, plans, results))
    return Report(plans, results, expect, judge(plans, results, expect), notes, [warning] if warning else [])


# ---- what to ask of each host ---------------------------------------------------------------------------------
def build_plans(profile: Profile, mode: str, hosts: Sequence[str] | None, checkout: Checkout | None,
                bind: bool = True) -> list[HostPlan]:
    backend = store_backend(profile)
    servers = backend.servers()  # the TCP store's host, or each etcd member's
    if mode == "check":
        names = list(profile.hosts)
    elif mode == "add":
        names = list(hosts or [])
    else:  # a start: its nodes (the active hosts; --resume: the nodes the run had), the store's and etcd's hosts
        names = [h.name for h in profile.active_hosts()] if hosts is None else list(hosts)
        names += [s.host for s in servers if s.host not in names]
    links = tuple(Target(*e) for e in backend.links())
    plans = []
    for name in names:
        host = profile.hosts[name]
        here = [s for s in servers if s.host == name]
        roles = set()
        if (not host.standby or mode == "add") or (mode == "check" and all(s.role != "store" for s in here)):
            roles.add("engine")
        binds: list[Target] = []
        for s in here if mode != "add" else []:
            roles.add(s.role)
            binds += [Target(*e) for e in s.binds]
        plans.append(_plan(profile, host, frozenset(roles), tuple(binds) if bind else (),
                           links if "engine" in roles else (), checkout))
    return plans


def _plan(profile: Profile, host: HostSpec, roles: frozenset[str], binds: tuple[Target, ...],
          links: tuple[Target, ...], checkout: Checkout | None) -> HostPlan:
    cfg = host_engine_config(profile, host, checkout)
    device, data = engine_settings(profile, host, checkout, cfg)
    return HostPlan(name=host.name, roles=roles, python=host.python_path, venv=host.venv or None,
                    workdir=host.workdir, run_dir=profile.run.dir, config=profile.engine.config, data=data,
                    device=device, workers=host.workers, engine_config=cfg,
                    ifnames=tuple((v, host.env[v]) for v in IFNAME_VARS if host.env.get(v)),
                    binds=binds, links=links)


def host_engine_config(profile: Profile, host: HostSpec, checkout: Checkout | None):
    """This host's engine config as the console's checkout has it (sync makes the hosts' the same) with the
    profile's overrides; None if it cannot be read here."""
    from engine.config import ConfigError, load_config  # torch-free: the engine's own rules, not a copy

    config = Path(profile.engine.config)
    candidates = [config] if config.is_absolute() else \
        [p / config for p in ((checkout.root,) if checkout else ()) + (Path.cwd(),)]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return None
    try:
        return load_config(path, engine_overrides(profile, host), environ=host.env)
    except ConfigError:
        return None  # the profile check (check_engine_config) or the engine says what is wrong


def engine_settings(profile: Profile, host: HostSpec, checkout: Checkout | None,
                    cfg=None) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """(inner.device, the data paths) this host's engine will use (host_engine_config); (None, ()) if it cannot be
    read here."""
    cfg = cfg or host_engine_config(profile, host, checkout)
    if cfg is None:
        return None, ()
    data = [] if cfg.data.fake else [("data.path", p) for p in [cfg.data.path] if p]
    data += [("data.tokenizer", cfg.data.tokenizer)] if cfg.data.tokenizer else []
    return cfg.inner.device, tuple(data)


async def listeners(profile: Profile, plans: Sequence[HostPlan],
                    results: dict[str, HostResult]) -> list[tuple[str, str]]:
    """(what, address) for each listener of the run that carries no authentication: the TCP store (its bind address;
    a name as this machine resolves it) and each engine host's collectives (gloo listens on the host's address on
    its route to the store, as the host script found it). etcd members take only clients with the run's certificate."""
    out = []
    store = next((p for p in plans if "store" in p.roles), None)
    address = store_backend(profile).open_listener()  # the TCP store's bind; etcd members take none without a cert
    if store is not None and address is not None:
        for ip in await _resolved(address):
            name = "" if ip == address else f", {address}"
            out.append((f"the store ({store.name}, port {profile.store.port}{name})", ip))
    for plan in plans:
        peer = (results[plan.name].facts or {}).get("peer") if plan.engine and plan.name in results else None
        if peer:
            out.append((f"{plan.name}'s collectives (gloo)", peer[0]))
    return out


async def _resolved(address: str, timeout: float = 2.0) -> list[str]:
    """An address as is; a name as this machine resolves it (nothing when it does not, within timeout)."""
    if exposed(address) is not None:
        return [address]
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(address, None), timeout)
    except (OSError, asyncio.TimeoutError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def console_torch() -> str | None:
    """The torch installed beside the console (its metadata only: the console never imports torch), if any."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def make_expect(profile: Profile, checkout: Checkout | None) -> Expect:
    return Expect(profile=profile.path, engine=checkout.engine if checkout else None,
                  label=checkout.label() if checkout else "no checkout", torch=console_torch(),
                  min_free_gb=profile.check.min_free_gb, max_clock_skew=profile.check.max_clock_skew,
                  machine=checkout.machine if checkout else None,
                  root=os.path.realpath(checkout.root) if checkout else None)


# ---- asking -----------------------------------------------------------------------------------------------------
async def _ask(profile: Profile, plan: HostPlan, host: HostSpec, t: Transport) -> HostResult:
    result = HostResult(plan.name)
    result.reach = identity_missing(host)
    if result.reach:
        return result
    try:
        await asyncio.wait_for(t.connect(), host.connect_timeout * 2 + 1)
    except TransportError as e:
        result.reach = str(e)
        return result
    except asyncio.TimeoutError:
        result.reach = f"connect timed out after {host.connect_timeout * 2 + 1:g}s"
        return result
    args = {"mode": "facts", "workdir": host.workdir, "venv": host.venv or None, "config": plan.config,
            "run_dir": plan.run_dir, "packages": list(PACKAGES), "data": [p for _, p in plan.data],
            "binds": [[b.address, b.port] for b in plan.binds], "pythonpath": host.env.get("PYTHONPATH"),
            "fake_gpus": host.env.get(FAKE_GPUS), "cuda_visible": host.env.get("CUDA_VISIBLE_DEVICES"),
            "route_to": [plan.links[0].address, plan.links[0].port] if plan.engine and plan.links else None}
    timeout = profile.check.timeout
    result.sent = time.time()
    rc, answer, error = await run_host_script(t, host.workdir, plan.python, args, timeout)
    result.received = time.time()
    if rc in (126, 127):  # the shell could not run that python: say so, and ask python3 for the rest
        result.python_missing = True
        result.sent = time.time()
        rc, answer, error = await run_host_script(t, host.workdir, FALLBACK_PYTHON, args, timeout)
        result.received = time.time()
        if rc in (126, 127):
            return result
    result.facts, result.script_error = answer, error
    return result


def identity_missing(host: HostSpec) -> str | None:
    """The profile's identity_file, said missing before asyncssh tries (it would say "No such file")."""
    if host.transport == "ssh" and host.identity_file and not os.path.exists(os.path.expanduser(host.identity_file)):
        return f"identity_file {host.identity_file} does not exist on this machine"
    return None


async def run_host_script(t: Transport, workdir: str, python: str, args: dict,
                          timeout: float) -> tuple[int, dict | None, str | None]:
    """Run host_script.py on the host with `python` (a relative path is the workdir's, as for the engine); (exit status,
    its JSON answer or None, why not)."""
    program = f"import json\nARGS = json.loads({json.dumps(json.dumps(args))})\n{_script_source()}".encode()
    try:
        # in the workdir when it exists (a relative python is the workdir's), and the script is told so: a relative
        # workdir resolved again from inside would name a folder under itself
        rc, out, err = await t.run(f"if cd {C.qpath(workdir)} 2>/dev/null; then export {host_script.IN_WORKDIR}=1; fi; "
                                   f"exec {C.qpath(python)} -", timeout=timeout, stdin=program)
    except TransportError as e:
        return -1, None, str(e)
    if rc != 0:  # its last line says why; a dependency's deprecation warning after it is not the reason
        last = (without_dependency_warnings(err).strip().splitlines() or [f"exit status {rc}"])[-1]
        return rc, None, last
    try:
        return rc, json.loads(out.strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return rc, None, f"unreadable answer: {out.strip()[-200:]!r}"


@cache
def _script_source() -> str:
    return Path(host_script.__file__).read_text()


# ---- the link test ------------------------------------------------------------------------------------------------
async def _link_test(profile: Profile, plans: list[HostPlan], results: dict[str, HostResult],
                     transport_of: Callable[[str], Transport], listen: bool, peers: bool = True) -> list[str]:
    """Every engine host dials the store's port (and each other's collectives' port) while a listener of the check
    holds it. Returns notes: a port a listener could not hold after all (taken between the host script that found it
    free and the listener's start) was not tested, and a refusal there is not the link's fault."""
    seconds = profile.check.link_timeout
    dialers = [p for p in plans if p.links and results[p.name].facts is not None]
    if not dialers:
        return []
    waits = []
    ends = [(p, Target(peer[0], peer[1], f"{p.name}'s outer-step collectives (gloo)"))
            for p in dialers if peers and (peer := (results[p.name].facts or {}).get("peer"))]
    if len(ends) >= 2:
        for p, end in ends:
            others = [d for d in dialers if d is not p]
            for d in others:
                results[d.name].peers.append(end)
                results[d.name].listening.add(str(end))
            waits.append(_listen(profile.hosts[p.name], [[end.address, end.port]], transport_of(p.name), seconds + 3,
                                 len(others), results[p.name], p))
    for p in plans if listen else []:
        free = [[a, port] for a, port, error in (results[p.name].facts or {}).get("binds", []) if error is None]
        dialled = {t.port for t in dialers[0].links} & {port for _, port in free}
        if not dialled:
            continue
        for d in dialers:  # what the check holds while the others dial: a refusal there is a problem
            results[d.name].listening |= {str(t) for t in d.links if t.port in dialled}
        waits.append(_listen(profile.hosts[p.name], free, transport_of(p.name), seconds + 3,
                             len(dialers) * len(dialled), results[p.name], p))
    dials = [_dial(p, transport_of(p.name), seconds, results[p.name], profile) for p in dialers]
    unheld, _ = await asyncio.gather(asyncio.gather(*waits), asyncio.gather(*dials))
    notes = []
    for host, lost in unheld:
        for bind in lost:
            for d in dialers:
                results[d.name].listening.discard(bind)
            notes.append(f"{host}: {bind} was taken before the check's listener started there: that link was not "
                         f"tested (run the check again)")
    return notes


async def _listen(host: HostSpec, binds: list, t: Transport, seconds: float, expect: int, result: HostResult,
                  plan: HostPlan) -> tuple[str, list[str]]:
    """(host, the binds it could not hold): a port found free by the facts may be taken by the time this listens."""
    args = {"mode": "listen", "binds": binds, "seconds": seconds, "expect": expect}
    _, answer, _ = await run_host_script(t, host.workdir, _python_of(result, plan), args, seconds + 10)
    held = {f"{a}:{p}" for a, p, error in (answer or {}).get("bound", []) if error is None}
    return host.name, [f"{a}:{p}" for a, p in binds if f"{a}:{p}" not in held]


async def _dial(plan: HostPlan, t: Transport, seconds: float, result: HostResult, profile: Profile) -> None:
    host = profile.hosts[plan.name]
    targets = [*plan.links, *result.peers]
    args = {"mode": "connect", "targets": [[x.address, x.port] for x in targets], "seconds": seconds}
    _, answer, error = await run_host_script(t, host.workdir, _python_of(result, plan), args, seconds + 15)
    if answer is None:
        result.links = [[x.address, x.port, "error", f"the link test did not run: {error}"] for x in targets]
    else:
        result.links = answer["links"]


def _python_of(result: HostResult, plan: HostPlan) -> str:
    return FALLBACK_PYTHON if result.python_missing else plan.python


# ---- for the console --------------------------------------------------------------------------------------------
def mark_refused(fleet: Fleet, report: Report, started: Sequence[str] = ()) -> None:
    """A refused start on the dashboard and in `status`: each host with a problem is failed with its first line
    as the reason and every line in its log; the others are told why they did not start."""
    by_host: dict[str, list[Problem]] = {}
    for problem in report.problems:
        by_host.setdefault(problem.host, []).append(problem)
    for plan in report.plans:
        name = plan.name
        if name not in fleet.nodes:
            continue
        mine = by_host.get(name, [])
        for problem in mine:
            fleet.note(name, f"preflight: {problem.what}; fix: {problem.fix}")
        if mine:
            more = f" (+{len(mine) - 1} more in the log)" if len(mine) > 1 else ""
            fleet.set_state(name, HostState.FAILED, f"preflight: {mine[0].what}; fix: {mine[0].fix}{more}")
        elif name in started or "engine" in plan.roles:
            fleet.note(name, "not started: the preflight found problems on " + ", ".join(by_host))


async def check_profile(profile: Profile, make: Callable[[HostSpec], Transport]) -> Report:
    """`zeroband-console PROFILE check`: the profile's engine settings, then every host (transports closed after)."""
    from console.engine_config import check_engine_config
    from console.profile import ProfileError

    transports: dict[str, Transport] = {}

    def transport_of(name: str) -> Transport:
        if name not in transports:
            transports[name] = make(profile.hosts[name])
        return transports[name]
    try:
        report = await preflight(profile, transport_of, mode="check")
        try:  # the client files a start needs (an etcd that runs already: its certificate's)
            tls = await store_backend(profile).client_files_unreadable(
                transport_of, [p.name for p in report.plans if p.engine and report.results[p.name].facts is not None])
        except TransportError as e:
            tls = [f"the store's client files could not be looked for: {e}"]
        report.problems[:0] = [Problem("profile", "tls", line, "copy the file there, or fix the path in [store]")
                               for line in tls]
    finally:
        await asyncio.gather(*(t.close() for t in transports.values()), return_exceptions=True)
    try:
        check_engine_config(profile)
    except ProfileError as e:
        report.problems.insert(0, Problem("profile", "config", str(e), "fix the profile or the engine config"))
    return report
